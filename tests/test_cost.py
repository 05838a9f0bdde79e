"""The cost model: FLOPs against torch's FlopCounterMode on the network's own causal forward, bytes against a hand
count for a tiny model and against Nsight Compute's counts for Qwen3-8B."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias
from torch.utils.flop_counter import FlopCounterMode

from llm_anatomy import Engine
from llm_anatomy.hub import resolve
from llm_anatomy.models import attention
from llm_anatomy.models.config import ModelConfig
from llm_anatomy.engine.events import Step
from llm_anatomy.engine.plan import ExecutionPlan
from llm_anatomy.probe.recorder import StepMeasure, StepRecord, step_cost
from llm_anatomy.probe.cost import (GemmTiling, KernelShapes, decode_cost, device_shapes, gemm_reads, prefill_cost,
                                    weight_bytes_per_step)

from conftest import tiny_hf_config

SDPA = F.scaled_dot_product_attention


def exact_sdpa(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, scale=None):
    """SDPA in matmuls over each query's unmasked keys only, so that FlopCounterMode (blind to the CPU's fused
    kernel) counts exactly the attention a causal or masked forward needs. Checked against SDPA itself."""
    if enable_gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    n_q, n_k = q.shape[-2], k.shape[-2]
    if isinstance(attn_mask, CausalBias):
        attn_mask = attn_mask._materialize(q.device)
    if is_causal:
        attn_mask = torch.ones(n_q, n_k, dtype=torch.bool).tril()
    if attn_mask is None:
        attn_mask = torch.ones(n_q, n_k, dtype=torch.bool)
    mask = attn_mask.expand(*q.shape[:-2], n_q, n_k)
    out = torch.empty_like(q)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in q.shape[:-2])).reshape(-1, q.dim() - 2).tolist():
        qi, ki, vi, mi = q[tuple(index)], k[tuple(index)], v[tuple(index)], mask[tuple(index)]
        for row in range(n_q):
            keys = mi[row].nonzero().squeeze(-1)
            scores = qi[row:row + 1] @ ki[keys].T * (scale or q.shape[-1] ** -0.5)
            out[tuple(index)][row] = (scores.softmax(-1) @ vi[keys])[0]
    reference = SDPA(q, k, v, attn_mask=attn_mask.expand(*q.shape[:-2], n_q, n_k))
    assert torch.allclose(out, reference, atol=1e-5), "the counted attention computes what SDPA computes"
    return out


@pytest.fixture
def engine(save_tiny, monkeypatch):
    directory, _ = save_tiny(num_attention_heads=8, num_key_value_heads=2)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", exact_sdpa)
    return Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=512)


def counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_causal_prefill_flops_match_the_flop_counter(engine):
    """The model's own prefill, causal: attention counted as the unmasked half, lm_head on the last token."""
    ids = list(range(1, 49))
    seq = engine.add_request(ids, engine.sampling_params(max_tokens=1, temperature=0))
    flops = counted(engine.step)
    assert seq.finished
    assert prefill_cost(engine.config, torch.float32, [(len(ids), 0)]).flops == flops


def test_long_prompt_alone_flops_match_the_flop_counter(engine, monkeypatch):
    """A long fresh prompt alone (the threshold lowered to the tiny model's 48 tokens) attends its last row alone in
    the last layer: one query over its 48 keys there."""
    from llm_anatomy.probe import cost

    for module in (attention, cost):
        monkeypatch.setattr(module, "FP8_PREFILL_MIN_TOKENS", 48)
    seq = engine.add_request(list(range(1, 49)), engine.sampling_params(max_tokens=1, temperature=0))
    flops = counted(engine.step)
    assert seq.finished
    longer = prefill_cost(engine.config, torch.float32, [(48, 0)])
    assert longer.flops == flops
    monkeypatch.setattr(cost, "FP8_PREFILL_MIN_TOKENS", 49)  # as a shorter prompt: causal in every layer
    c = engine.config
    keys = 48 * 49 / 2 - 48  # the last layer's causal attention less its one row's
    assert prefill_cost(c, torch.float32, [(48, 0)]).flops - flops == 4 * c.num_attention_heads * c.head_dim * keys


def test_prefill_of_two_prompts_flops_match_the_flop_counter(engine):
    """Two prompts in one step: the last layer past its K/V store runs on their two sampled rows alone."""
    seqs = [engine.add_request(list(range(1, 30)), engine.sampling_params(max_tokens=1, temperature=0)),
            engine.add_request(list(range(5, 22)), engine.sampling_params(max_tokens=1, temperature=0))]
    flops = counted(engine.step)
    assert all(s.finished for s in seqs)
    assert prefill_cost(engine.config, torch.float32, [(29, 0), (17, 0)]).flops == flops


def test_chunked_prefill_flops_match_the_flop_counter(save_tiny, monkeypatch):
    """A prompt's later chunk attends to its cached prefix and causally to itself, but not in its last layer:
    it samples nothing. The anatomy's recorder counts such a step so, from the step's tokens."""
    directory, _ = save_tiny(num_attention_heads=8, num_key_value_heads=2)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", exact_sdpa)
    engine = Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=512,
                                    max_num_batched_tokens=16)
    engine.add_request(list(range(1, 41)), engine.sampling_params(max_tokens=1, temperature=0))
    engine.step()  # tokens 0..15
    flops = counted(engine.step)  # tokens 16..31 after a prefix of 16: no logits yet
    assert prefill_cost(engine.config, torch.float32, [(16, 16)], logits_tokens=0).flops == flops
    chunk = StepRecord(Step(1, True, [], [16], [32], 0, tokens=[None]), 0, StepMeasure())
    assert step_cost(engine, chunk).flops == flops
    last = StepRecord(Step(2, True, [], [8], [40], 0, tokens=[7]), 0, StepMeasure())
    assert step_cost(engine, last).flops == counted(engine.step)  # tokens 32..39, the last sampled


def test_decode_flops_match_the_flop_counter(engine):
    """A batch of two decoding: each attends to its own context, new token included."""
    prompts = [list(range(1, 20)), list(range(3, 40))]
    seqs = [engine.add_request(p, engine.sampling_params(max_tokens=5, temperature=0, ignore_eos=True))
            for p in prompts]
    engine.step()  # prefill
    engine.step()  # one decode step, so that the next one has some history
    contexts = [s.num_tokens for s in seqs]  # after the coming step: cached + the token it forwards
    flops = counted(engine.step)
    assert decode_cost(engine.config, torch.float32, contexts).flops == flops


@pytest.mark.parametrize("order,group,expected", [
    # m=12, n=8 in tiles of 4 x 4: 3 rows x 2 columns of tiles, 4 tiles a wave.
    # rows: wave 1 = (0,0) (0,1) (1,0) (1,1): rows {0,1}, columns {0,1}; wave 2 = (2,0) (2,1): row 2, both columns
    ("rows", 1, (2 * 4 + 1 * 4, 2 * 4 + 2 * 4)),
    # grouped by 3 rows (M first): wave 1 = (0,0) (1,0) (2,0) (0,1); wave 2 = (1,1) (2,1)
    ("grouped", 3, (3 * 4 + 2 * 4, 2 * 4 + 1 * 4)),
])
def test_gemm_reads_count_each_waves_operand_blocks(order, group, expected):
    assert gemm_reads(12, 8, 1, GemmTiling(4, 4, order, group), 4) == expected


TINY_SHAPES = KernelShapes(sms=1000, cublas=GemmTiling(4, 16), gated=GemmTiling(4, 16, "grouped", 2),
                           gated_min_rows=8, gemv_max_rows=2)


def tiny_config() -> ModelConfig:
    # hidden 64, intermediate 128, 2 layers, 4 heads of 32 (q 128), 2 KV heads (kv 64), vocab 512, QK-norm
    return ModelConfig.from_hf(tiny_hf_config().to_dict())


def test_prefill_bytes_by_hand():
    """A 12-token prefill of the tiny model in float32 (4 B), every GEMM in one wave, gate_up through the fused
    Triton product (12 rows >= 8), counted kernel by kernel; the last layer past its qkv product on the sampled
    row alone, by GEMVs (1 row <= 2)."""
    cost = prefill_cost(tiny_config(), torch.float32, [(12, 0)], shapes=TINY_SHAPES)
    hand = {
        "linear": 2 * (256 * 64 + 64 * 128 + 256 * 64 + 64 * 128) * 4 + 2 * (2 * 64 + 2 * 32) * 4,  # + norms' weights
        # the first layer: qkv: x; o: its input and the residual stream it adds into; gate_up: x; down: its input
        # and the stream; the last: qkv over x, then GEMVs over one row (no epilogue: the norms add the stream)
        "linear_inputs": (12 * 64 + (12 * 128 + 12 * 64) + 12 * 64 + (12 * 128 + 12 * 64)) * 4
                         + (12 * 64 + 128 + 64 + 128) * 4,
        # the first layer's two norms and the last one's first over the stream; its second and the final one over
        # one row's product and stream
        "norm": 3 * 12 * 64 * 4 + 2 * 2 * 64 * 4,
        "rope": 2 * 12 * (256 * 4 + 32 * 4),  # the qkv product, and cos and sin rows of 16 float32
        "attention": 2 * 12 * 128 * 4,  # the rotated queries
        "kv_read": 12 * (2 * 2 * 64 * 4), "kv_write": 12 * (2 * 2 * 64 * 4),
        "embedding": 12 * 64 * 4,
        "lm_head": 512 * 64 * 4 + 64 * 4 + 64 * 4,  # weight, final norm's weight, one hidden row
        "logits": 512 * 4,
        "activation": 0, "bias": 0, "quantize": 0,
    }
    assert {name: part["bytes"] for name, part in cost.parts.items()} == hand
    assert cost.bytes == sum(hand.values())


def test_decode_bytes_by_hand():
    """One decode step at context 20: GEMVs read their weights and input once; the norms read the product and the
    stream; attention reads the context and its 16 splits' float32 partials (head_dim + 2 each)."""
    cost = decode_cost(tiny_config(), torch.float32, [20], shapes=TINY_SHAPES)
    parts = {name: part["bytes"] for name, part in cost.parts.items()}
    assert parts["linear_inputs"] == 2 * (64 + 128 + 64 + 128) * 4
    assert parts["norm"] == 2 * 2 * 2 * 64 * 4 + 2 * 64 * 4
    assert parts["attention"] == 2 * 128 * 4 + 2 * 4 * 16 * (32 + 2) * 4
    assert parts["kv_read"] == 20 * 1024 and parts["kv_write"] == 1024
    assert cost.bytes == 576_512


def test_w8a8_bytes_by_hand():
    """fp8 weights with a scale per row and bf16 (2 B) activations, W8A8: the products read fp8 rows (a byte an
    element, a float32 scale a row): the norms write qkv_proj's and gate_up_proj's so, the quantization kernels read
    o_proj's input and the gate_up product; no fp8 product adds into the stream, so every norm reads two inputs.
    A batch-1 decode step streams bf16 rows: nothing quantized."""
    shapes = replace(TINY_SHAPES, weight_size=1, weight_row_scale_bytes=4, w8a8=True)
    c = tiny_config()
    weights = 2 * ((256 * 64 + 64 * 128 + 256 * 64 + 64 * 128) + (256 + 64 + 256 + 64) * 4 + (2 * 64 + 2 * 32) * 2)

    def parts(cost):
        return {name: part["bytes"] for name, part in cost.parts.items()}

    prefill = parts(prefill_cost(c, torch.bfloat16, [(12, 0)], shapes=shapes))  # GEMMs: 12 rows > 2
    assert prefill["linear"] == weights
    # The first layer's qkv and gate_up read 12 rows of 64, o and down of 128, each a byte an element and a scale a
    # row; the last layer's qkv 12 rows of 64 so, then its sampled row streams in bf16
    assert prefill["linear_inputs"] == (12 * (64 + 128 + 64 + 128) + 4 * 12 * 4 + 12 * 64 + 12 * 4
                                        + (128 + 64 + 128) * 2)
    assert prefill["quantize"] == 12 * (128 + 2 * 128) * 2  # the first layer's o input; [gate, up] of the GEMM
    # two inputs each: the first layer's norms over 12 rows, the last one's first too, its second and the final one
    # over the sampled row
    assert prefill["norm"] == (2 * 2 * 12 * 64 + 2 * 12 * 64 + 2 * 64 + 2 * 64) * 2
    assert prefill["activation"] == 0
    decode = parts(decode_cost(c, torch.bfloat16, [20, 20], shapes=shapes))  # GEMVs: 2 rows
    assert decode["linear_inputs"] == 2 * (2 * (64 + 128 + 64 + 128) + 4 * 2 * 4)
    assert decode["quantize"] == 2 * 2 * (128 + 128) * 2  # o's input; the GEMV's SiLU * up
    single = parts(decode_cost(c, torch.bfloat16, [20], shapes=shapes))
    assert single["linear_inputs"] == 2 * (64 + 128 + 64 + 128) * 2 and single["quantize"] == 0
    assert parts(decode_cost(c, torch.float32, [20, 20], shapes=shapes))["quantize"] == 0  # W8A16: float32
    assert device_shapes(torch.device("cpu"), ExecutionPlan(weight_dtype="float8_e4m3fn")).w8a8 is False


def test_kernel_shapes_are_the_kernels_own():
    from llm_anatomy.engine.plan import DecodeAttentionPlan
    from llm_anatomy.kernels import decode_attention, gemv, matmul
    from llm_anatomy.probe.cost import DEFAULT_SHAPES as shapes

    tile = matmul.GATED_TILE
    assert (shapes.gated.bm, shapes.gated.bn, shapes.gated.group_m) == (tile.bm, tile.bn, tile.group_m)
    assert shapes.gated_min_rows == matmul.GATED_MIN_ROWS and shapes.gemv_max_rows == gemv.MAX_ROWS
    assert shapes.attention == DecodeAttentionPlan()  # the plan every engine starts from
    for batch in (2, 3, 8, 64):
        assert shapes.decode_splits(batch, 4096, 8) == decode_attention.default_splits(batch, 8, shapes.sms)


def test_qwen3_8b_figures():
    config = ModelConfig.from_hf(resolve("Qwen/Qwen3-8B").config)
    weights = weight_bytes_per_step(config, torch.bfloat16)
    assert weights["layers"] == pytest.approx(13.89e9, rel=2e-3)  # reference/anchors.md
    assert weights["lm_head"] == pytest.approx(1.245e9, rel=2e-3)
    step = decode_cost(config, torch.bfloat16, [1024])
    assert step.part("kv_read", "bytes") == 1024 * 147_456
    assert step.bytes == pytest.approx(15.14e9 + 1024 * 147_456, rel=2e-3)
    # 2048-token prefill: 29.7 TFLOP for the whole network (anchors.md: 2 x 6.95e9 per token plus causal attention,
    # lm_head excluded), less the last layer's o_proj and MLP for the 2047 rows that are not sampled
    prefill = prefill_cost(config, torch.bfloat16, [(2048, 0)])
    skipped = 2 * 2047 * (4096 * 4096 + 3 * 4096 * 12288)
    assert prefill.flops - prefill.part("lm_head", "flops") + skipped == pytest.approx(29.7e12, rel=0.01)
    assert prefill.part("lm_head", "flops") == 2 * 4096 * 151_936
    assert decode_cost(config, torch.bfloat16, [1]).intensity < 2


@pytest.mark.parametrize("what,measured,tolerance", [
    # Nsight Compute's DRAM reads + writes of one step of this engine, synthetic Qwen3-8B in bf16 on an H200
    # (shared/reference/anchors.md, 2026-12-01; the prefill and the decode at 8193 tokens of context
    # tests/test_dram_gpu.py's, 2026-12-04, the last layer over the sampled row): decode within 1%, prefill within 5%
    (("decode", 512), 15.233e9, 0.01),
    (("decode", 8193), 16.381e9, 0.01),
    (("decode", 32768), 20.014e9, 0.01),
    (("prefill", 2048), 38.875e9, 0.05),
])
def test_bytes_against_nsight_compute(what, measured, tolerance):
    config = ModelConfig.from_hf(resolve("Qwen/Qwen3-8B").config)
    kind, n = what
    cost = (decode_cost(config, torch.bfloat16, [n]) if kind == "decode"
            else prefill_cost(config, torch.bfloat16, [(n, 0)]))
    assert cost.bytes == pytest.approx(measured, rel=tolerance)
