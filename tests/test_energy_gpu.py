"""On a CUDA device with NVML only: a measured call's energy inside its own interval, the phases adding up, and
`--repeat` giving steady-state J per token within 5%."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def engine():
    from llm_anatomy import Engine

    return Engine.from_pretrained("Qwen/Qwen3-0.6B", device="cuda", weights="synthetic", max_model_len=4096,
                                  kv_cache_tokens=16384, max_num_seqs=4)


def test_call_energy_and_steady_state(engine):
    from llm_anatomy.probe.call import CallRequest, measure_call, steady_energy
    from llm_anatomy.probe.ceilings import datasheet_ceilings

    request = CallRequest(messages=[{"role": "user", "content": "Explain what a KV cache is."}],
                          sampling=dict(max_tokens=256, temperature=0, ignore_eos=True))
    _, a = measure_call(engine, request, datasheet_ceilings(engine.device))
    if not a.telemetry.available:
        pytest.skip(a.telemetry.note)
    e = {r.phase: r for r in a.telemetry.energy}
    call = e["call"]
    assert call.low_j <= call.joules <= call.high_j
    parts = e["before_prefill"].joules + e["prefill"].joules + e["decode"].joules
    assert parts == pytest.approx(call.joules, rel=1e-9)
    assert e["prefill"].shorter_than_update  # a 30-token prefill takes a few ms
    steady_energy(engine, a, 20)
    by = {r.phase: r for r in a.steady_energy}
    assert set(by) == {"prefill", "decode"}, a.notes
    for r in by.values():
        print(r.phase, f"{r.j_per_token:.5f} J/token [{r.j_per_token_low:.5f}, {r.j_per_token_high:.5f}], "
              f"spread {r.spread:.1%}, s.e. {r.standard_error:.1%}, {r.repeats} repeats, {r.seconds:.1f} s")
        assert r.within_target, a.notes
