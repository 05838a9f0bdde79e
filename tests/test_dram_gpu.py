"""On a CUDA device with Nsight Compute only: the byte model against ncu's DRAM counters for Qwen3-8B (synthetic
bf16), prefills of 2048 and 8192 tokens within 5%, decode steps at 512 and 32k context within 1%."""

import shutil

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(shutil.which("ncu") is None, reason="needs Nsight Compute (ncu) on PATH")]


@pytest.mark.parametrize("prompt,prefill_within,decode_within", [
    (511, None, 0.01),  # decode at 512
    (2048, 0.05, 0.01),
    (8192, 0.05, 0.01),
    (32767, None, 0.01),  # decode at 32k (the prompt prefilled in chunks)
])
def test_modelled_bytes_against_nsight_compute(prompt, prefill_within, decode_within):
    from llm_anatomy.engine.config import EngineConfig
    from llm_anatomy.hub import resolve
    from llm_anatomy.models.config import ModelConfig
    from llm_anatomy.probe.cost import device_shapes
    from llm_anatomy.probe.dram import DramReplay

    settings = EngineConfig(model="Qwen/Qwen3-8B", weights="synthetic", kv_cache_tokens=prompt + 64).describe()
    replay = DramReplay(settings, [1000 + i % 5000 for i in range(prompt)], {"temperature": 0},
                        ModelConfig.from_hf(resolve("Qwen/Qwen3-8B").config), torch.bfloat16,
                        device_shapes(torch.device("cuda")), "cuda")
    record = replay.measure()
    assert record.available, record.note
    prefill, decode = record.phases
    for phase, within in ((prefill, prefill_within), (decode, decode_within)):
        print(phase.phase, phase.tokens, phase.context_len, f"measured {phase.measured_bytes / 1e9:.3f} GB, "
              f"modelled {phase.modelled_bytes / 1e9:.3f} GB",
              {c.category: (round(c.measured_bytes / 1e9, 3), round(c.modelled_bytes / 1e9, 3))
               for c in phase.categories})
        if within is not None:
            assert phase.modelled_bytes == pytest.approx(phase.measured_bytes, rel=within)
