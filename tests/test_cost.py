"""The cost model against torch's FlopCounterMode on the real network, and against the published Qwen3-8B figures."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llm_anatomy import Engine
from llm_anatomy.hub import resolve
from llm_anatomy.models import attention
from llm_anatomy.models.config import ModelConfig
from llm_anatomy.probe.cost import decode_cost, prefill_cost, weight_bytes_per_step


def matmul_sdpa(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    """SDPA spelled out in matmuls, so FlopCounterMode sees attention's FLOPs (it cannot see the CPU kernel)."""
    if enable_gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.fixture
def engine(save_tiny, monkeypatch):
    directory, _ = save_tiny(num_attention_heads=8, num_key_value_heads=2)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", matmul_sdpa)
    return Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=512)


def counted(engine, fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_prefill_flops_match_flop_counter(engine):
    ids = list(range(1, 49))
    seq = engine.add_request(ids, engine.sampling_params(max_tokens=1, temperature=0))
    flops = counted(engine, engine.step)
    # The matmul SDPA computes the masked half too: compare with the non-causal count.
    model = prefill_cost(engine.config, torch.float32, [(len(ids), 0)], causal=False)
    assert seq.finished
    assert abs(model.flops - flops) / flops < 0.02


def test_decode_flops_match_flop_counter(engine):
    prompts = [list(range(1, 20)), list(range(3, 40))]
    seqs = [engine.add_request(p, engine.sampling_params(max_tokens=5, temperature=0, ignore_eos=True))
            for p in prompts]
    engine.step()  # prefill
    engine.step()  # one decode step, so that the next one has some history
    # The reference decode path attends over whole blocks, padded to the longest table of the batch; an
    # exact kernel reads only each context. Count what this path does: the formula is the same.
    padded = engine.pool.blocks_for(max(s.num_tokens for s in seqs)) * engine.pool.block_size
    flops = counted(engine, engine.step)
    model = decode_cost(engine.config, torch.float32, [padded] * len(seqs))
    assert abs(model.flops - flops) / flops < 0.02


def test_qwen3_8b_figures():
    config = ModelConfig.from_hf(resolve("Qwen/Qwen3-8B").config)
    weights = weight_bytes_per_step(config, torch.bfloat16)
    assert weights["layers"] == pytest.approx(13.89e9, rel=2e-3)  # reference/anchors.md
    assert weights["lm_head"] == pytest.approx(1.245e9, rel=2e-3)
    step = decode_cost(config, torch.bfloat16, [1024])
    assert step.part("kv_read", "bytes") == 1024 * 147_456
    assert step.bytes == pytest.approx(15.14e9 + 1024 * 147_456, rel=2e-3)
    # 2048-token prefill: 29.7 TFLOP (anchors.md: 2 x 6.95e9 per token plus causal attention, lm_head excluded)
    prefill = prefill_cost(config, torch.bfloat16, [(2048, 0)], logits_tokens=0)
    assert prefill.flops == pytest.approx(29.7e12, rel=0.01)
    assert decode_cost(config, torch.bfloat16, [1]).intensity < 2
