"""The fp8 GEMV / matmul kernel (kernels/fp8_gemv.py) against its PyTorch reference: under Triton's interpreter on
the CPU (float32 activations), natively on a GPU (bf16 too); and the fp8 layer's fast path that uses it."""

import pytest
import torch

pytest.importorskip("triton")

from llm_anatomy.kernels import use_kernels  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if not use_kernels(DEVICE):
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from llm_anatomy.kernels.fp8_gemv import (Tile, fp8_gemv, fp8_matmul, fp8_matmul_reference, supports,  # noqa: E402
                                          supports_matmul, supports_w8a8, w8a8_gemv)
from llm_anatomy.kernels.fp8_quant import quantize_rows_reference  # noqa: E402
from llm_anatomy.models.quant import Fp8Linear, quantize  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]
SMALL = Tile(16, 32, 256, 4, 2)  # the interpreter's cost grows with the tile; these shapes need no more


def weights(n, k, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes, so that a scale applied to the wrong row or block shows
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n)[:, None]
    q, scale = quantize(w, block)
    return q.to(DEVICE), scale.to(DEVICE)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [None, (32, 128)])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows", [1, 16])
def test_fp8_gemv_matches_reference(dtype, block, gated, rows):
    q, scale = weights(2 * 40 if gated else 72, 512, block)  # N not a multiple of the tile's 32 rows
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    assert supports(x, q, block)
    out = fp8_gemv(x, q, scale, block, gated)
    ref = fp8_matmul_reference(x, q, scale, block, gated)
    assert out.shape == ref.shape == (rows, 40 if gated else 72) and out.dtype == dtype
    assert rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("block", [None, (16, 64)])
def test_fp8_matmul_over_many_rows(block):
    q, scale = weights(48, 256, block, seed=2)
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE)  # rows over three M tiles
    assert supports_matmul(x, q, block, SMALL) and not supports(x, q, block, SMALL)
    assert rel(fp8_matmul(x, q, scale, block, tile=SMALL), fp8_matmul_reference(x, q, scale, block)) < 1e-5
    assert rel(fp8_matmul(x, q, scale, block, True, SMALL), fp8_matmul_reference(x, q, scale, block, True)) < 1e-5


def test_what_the_kernel_does_not_take():
    q, scale = weights(32, 512, None)
    x = torch.randn(2, 512, device=DEVICE)
    assert not supports(torch.randn(2, 320, device=DEVICE), weights(32, 320, None)[0])  # K not a multiple of 256
    assert not supports(torch.randn(17, 512, device=DEVICE), q)  # more rows than a GEMV's
    assert not supports(x, q.float())  # not fp8
    assert not supports(x.t().contiguous().t(), q)  # not contiguous
    assert not supports(x, q, (32, 96))  # a scale block that does not nest with the tile's columns


def test_fp8_layer_fast_path_is_the_kernel_and_falls_back_exactly():
    linear = torch.nn.Linear(512, 64, bias=True).to(DEVICE)
    layer = Fp8Linear.from_linear(linear)
    x = torch.randn(3, 512, device=DEVICE)
    exact = layer(x)
    assert rel(layer.fast_product(x), exact) < 1e-5
    assert rel(layer.fast_product(x, gated=True), torch.nn.functional.silu(exact[:, :32]) * exact[:, 32:]) < 1e-5
    narrow = Fp8Linear.from_linear(torch.nn.Linear(96, 16).to(DEVICE))  # K the kernel does not take: PyTorch
    y = torch.randn(2, 96, device=DEVICE)
    assert torch.equal(narrow.fast_product(y), narrow(y))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_w8a8_gemv_matches_the_product_of_its_quantized_operands(gated, rows):
    """The fp8 tensor-core GEMV: quantized rows times quantized weights, each scaled, equal to that product in
    float32 (N not a multiple of the tile's 64 rows: the masked tail; scales per row of very different sizes)."""
    q, scale = weights(2 * 40 if gated else 72, 512, None, seed=4)
    xq, x_scale = quantize_rows_reference(torch.randn(rows, 512, generator=torch.Generator().manual_seed(5))
                                          * torch.logspace(-2, 1, rows)[:, None])
    xq, x_scale = xq.to(DEVICE), x_scale.to(DEVICE)
    assert supports_w8a8(xq, q)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    strided = torch.cat([x_scale, torch.zeros_like(x_scale)], dim=1)[:, :1]  # a [M, 1] view with a row stride of 2
    out = w8a8_gemv(xq, strided, q, scale, dtype, gated)
    ref = fp8_matmul_reference(xq.float() * x_scale, q, scale, None, gated).to(dtype)
    assert out.shape == ref.shape == (rows, 40 if gated else 72) and out.dtype == dtype
    assert rel(out, ref) < TOL[dtype]


def test_what_the_w8a8_gemv_does_not_take():
    q, _ = weights(64, 512, None)
    xq = torch.zeros(2, 512, dtype=torch.float8_e4m3fn, device=DEVICE)
    assert supports_w8a8(xq, q)
    assert not supports_w8a8(torch.zeros(17, 512, dtype=torch.float8_e4m3fn, device=DEVICE), q)  # over 16 rows
    assert not supports_w8a8(xq.float(), q)  # rows not quantized
    assert not supports_w8a8(xq[:, :384], weights(64, 384, None)[0])  # K not a multiple of 256
    assert not supports_w8a8(xq, q.float())  # weights not fp8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_layer_decode_rows_are_w8a8_on_the_gpu():
    """A decode step's few bf16 rows on the fast path (per-channel scales, sm_90+): quantized per token and
    multiplied by the fp8 tensor-core GEMV, the same as quantizing with the PyTorch ops and multiplying exactly;
    gate_up can hand on its SiLU(gate) * up quantized."""
    from llm_anatomy.models.quant import Fp8Rows

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("W8A8 needs sm_90")
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(torch.nn.Linear(1024, 768, bias=False, device=DEVICE, dtype=torch.bfloat16))
    x = torch.randn(8, 1024, device=DEVICE, dtype=torch.bfloat16)
    xq, x_scale = quantize_rows_reference(x)
    want = fp8_matmul_reference(xq.float() * x_scale, layer.weight, layer.weight_scale).bfloat16()
    assert rel(layer.fast_product(x), want) < 2e-2
    gate, up = want.float().chunk(2, dim=-1)
    assert rel(layer.fast_product(x, gated=True), torch.nn.functional.silu(gate) * up) < 2e-2
    handed = layer.fast_product(x, gated=True, quantized_output=True)
    assert isinstance(handed, Fp8Rows) and handed.values.shape == (8, 384)
    assert rel(handed.dequantized(), torch.nn.functional.silu(gate) * up) < 5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_fp8_layer_prefill_on_the_gpu(block):
    """A prefill's product on the fast path: W8A8 through torch._scaled_mm (per-channel scales, sm_90+), or the fp8
    matmul kernel with its default tile (block scales): within activation-quantization error of the exact one."""
    from llm_anatomy.models.config import WeightScheme

    torch.manual_seed(0)
    linear = torch.nn.Linear(1024, 768, bias=False, device=DEVICE, dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(linear, WeightScheme("block", "weight_scale_inv", block) if block else None)
    x = torch.randn(300, 1024, device=DEVICE, dtype=torch.bfloat16)
    exact = layer(x)
    assert rel(layer.fast_product(x), exact) < (0.05 if block is None else 2e-2)
    gate, up = exact.float().chunk(2, dim=-1)
    assert rel(layer.fast_product(x, gated=True), torch.nn.functional.silu(gate) * up) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("k", [4096, 12288])
def test_fp8_fast_accumulation_stays_within_a_few_roundings_of_float32_sums(k):
    """fast_accum (the plan's fp8_fast_accum): torch._scaled_mm sums in the tensor cores' fp8 accumulator. Against
    float32 sums of the same fp8 operands it differs from the promoted sums, and by a few bf16 roundings of the
    output at most (Qwen3-8B's K: 4096, and down_proj's 12288)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("W8A8 needs sm_90")
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(torch.nn.Linear(k, 1024, bias=False, device=DEVICE, dtype=torch.bfloat16))
    x = torch.randn(512, k, device=DEVICE, dtype=torch.bfloat16)
    xq, x_scale = quantize_rows_reference(x)
    sums = (xq.float() * x_scale) @ (layer.weight.float() * layer.weight_scale[:, None]).t()
    rounding = rel(sums.bfloat16(), sums)
    promoted, fast = layer.fast_product(x), layer.fast_product(x, fast_accum=True)
    assert not torch.equal(promoted, fast)
    assert rel(promoted, sums) < 1.5 * rounding
    assert rel(fast, sums) < 4 * rounding


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_fp8_engine_plans_fast_accumulation_and_its_gemms_take_it(save_tiny, monkeypatch):
    """choose_plan: fp8 weights whose GEMMs are W8A8 (models/quant.w8a8_gemms) sum fast on a GPU's fast path; bf16
    weights, fp8 ones without W8A8 products, or the PyTorch path, have no such GEMMs. The engine's prefill passes it
    to every torch._scaled_mm."""
    from llm_anatomy import Engine
    from llm_anatomy.engine.config import EngineConfig
    from llm_anatomy.engine.plan import choose_plan

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("W8A8 needs sm_90")
    config = EngineConfig(device="cuda")
    assert choose_plan(config, DEVICE, "float8_e4m3fn", "bfloat16", w8a8_gemms=True).fp8_fast_accum
    assert not choose_plan(config, DEVICE, "float8_e4m3fn", "bfloat16").fp8_fast_accum  # block scales: no W8A8
    assert not choose_plan(config, DEVICE, "bfloat16", "bfloat16", w8a8_gemms=True).fp8_fast_accum
    assert not choose_plan(EngineConfig(device="cuda", fast_path=False), DEVICE, "float8_e4m3fn",
                           "bfloat16", w8a8_gemms=True).fp8_fast_accum
    directory, _ = save_tiny(hidden_size=512, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=4,
                             head_dim=32, num_hidden_layers=2)
    engine = Engine.from_pretrained(directory, device=DEVICE, dtype=torch.bfloat16, kv_cache_tokens=4096,
                                    max_num_seqs=2, quantization="fp8", cuda_graphs=False)
    assert engine.plan.fp8_fast_accum and engine.plan.describe()["fp8_fast_accum"]
    seen = []
    scaled_mm = torch._scaled_mm

    def recording(*args, **kwargs):
        seen.append(kwargs.get("use_fast_accum"))
        return scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    engine.generate_many([list(range(3, 300))], temperature=0, max_tokens=1)
    assert seen and all(seen)  # qkv, o, gate_up and down of both layers' prefill


@pytest.mark.parametrize("gated", [False, True])
def test_per_token_quantization_kernel_matches_its_reference(gated):
    """kernels/fp8_quant.quantize_rows against the PyTorch ops: the same scales and fp8 values (on the GPU to the
    scale's last bit; Triton 3.6's interpreter loses the carry where a value rounds up to the next power of two, and its
    sigmoid differs in the last bit, so on the CPU: those values aside, and the gated scales to float32's
    precision). Rows of very different sizes, a row of zeros, rows longer than one pass of the kernel."""
    from llm_anatomy.kernels.fp8_quant import FP8_MAX, ONE_PASS_MAX, quantize_rows, quantize_rows_reference

    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    k = ONE_PASS_MAX + 300
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 2 * k if gated else k, generator=g) * torch.logspace(-4, 3, 6)[:, None]
    x[3] = 0
    x = x.to(dtype).to(DEVICE)
    q, scale = quantize_rows(x, gated)
    want_q, want_scale = quantize_rows_reference(x, gated)
    assert q.shape == want_q.shape == (6, k) and q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert torch.equal(q[3].float(), torch.zeros(k, device=DEVICE))
    if DEVICE.type == "cuda":  # PyTorch's CUDA division by a number multiplies by its reciprocal: a last bit apart
        torch.testing.assert_close(scale, want_scale, rtol=2.5e-7, atol=0)
        assert (q.float() == want_q.float()).float().mean() > 0.999
        return
    if gated:
        assert torch.allclose(scale, want_scale, rtol=1e-6, atol=0)
    else:
        assert torch.equal(scale, want_scale)
    mantissa = (want_q.float().abs() / 2 ** want_q.float().abs().log2().floor()).nan_to_num(0)
    checked = (mantissa != 1.0) & (want_q.float().abs() < FP8_MAX)  # no carry to judge
    assert checked.float().mean() > 0.8
    assert (q.float() == want_q.float())[checked].float().mean() > 0.99
    assert (q.float().abs().amax(dim=1)[[0, 1, 2, 4, 5]] == FP8_MAX).all()  # each row's largest maps to 448


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_mlp_hands_the_down_projection_quantized_rows():
    """A prefill's fp8 MLP in bf16: gate_up's W8A8 product leaves SiLU(gate) * up quantized per token (quant.Fp8Rows,
    never written in bf16) and down_proj multiplies it as it is, the same as quantizing that activation with the
    PyTorch ops and multiplying; within activation-quantization error of the exact product."""
    from llm_anatomy.engine.plan import ExecutionPlan
    from llm_anatomy.kernels.fp8_quant import quantize_rows_reference
    from llm_anatomy.models.config import ModelConfig
    from llm_anatomy.models.quant import Fp8Rows, quantize_linear_layers
    from llm_anatomy.models.qwen3 import MLP

    torch.manual_seed(0)
    config = ModelConfig.from_hf({"model_type": "qwen3", "vocab_size": 8, "hidden_size": 512, "intermediate_size": 768,
                                  "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "head_dim": 128, "max_position_embeddings": 64})
    mlp = MLP(config).to(DEVICE, torch.bfloat16)
    quantize_linear_layers(mlp)
    x = torch.randn(40, 512, device=DEVICE, dtype=torch.bfloat16)
    act = mlp._fast_activation(x, ExecutionPlan(kernels=True))
    assert isinstance(act, Fp8Rows)
    gate, up = torch._scaled_mm(*_w8a8_operands(x, mlp.gate_up_proj), out_dtype=torch.bfloat16).chunk(2, dim=-1)
    want_q, want_scale = quantize_rows_reference(torch.cat([gate, up], dim=-1), gated=True)
    assert rel(act.values.float(), want_q.float()) < 2e-2 and rel(act.scale, want_scale) < 1e-2
    out = mlp(x, ExecutionPlan(kernels=True))
    assert rel(out, mlp(x, ExecutionPlan())) < 0.05


def _w8a8_operands(x, layer):
    from llm_anatomy.kernels.fp8_quant import quantize_rows_reference

    xq, x_scale = quantize_rows_reference(x)
    return xq, layer.weight.t(), x_scale, layer.weight_scale.view(1, -1)


# The fp8 KV cache on a GPU only: Triton 3.6's interpreter rounds float32 -> e4m3 wrongly where the mantissa
# carries into the exponent (tests/test_kv_cache_fp8.py), so its cache would differ from the reference's.
@pytest.mark.parametrize("kv_cache_dtype,head", [("auto", False), ("auto", True)]
                         + ([("fp8", False), ("fp8", True)] if DEVICE.type == "cuda" else []))
def test_fp8_engine_fast_path_equals_its_reference(save_tiny, kv_cache_dtype, head):
    """--quantization fp8 through the whole engine: the fused-kernel path (the fp8 GEMV for decode, the fp8 matmul
    for the prefill; on a GPU with graphs, the streaming GEMV at batch 1) against the PyTorch path over the same
    dequantized weights; with quantize_lm_head, lm_head's product takes the same paths."""
    from llm_anatomy import Engine

    directory, _ = save_tiny(hidden_size=512, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=4,
                             head_dim=32, num_hidden_layers=1, initializer_range=0.2)
    kw = dict(device=DEVICE, dtype=torch.float32, kv_cache_tokens=128, block_size=4, max_num_seqs=2,
              quantization="fp8", kv_cache_dtype=kv_cache_dtype, quantize_lm_head=head)
    out = {}
    for fast in (True, False):
        engine = Engine.from_pretrained(directory, fast_path=fast, cuda_graphs=fast, **kw)
        assert engine.plan.weight_dtype == "float8_e4m3fn"
        assert (engine.plan.head_dtype == "float8_e4m3fn") == head
        assert (engine.pool.k.dtype == torch.float8_e4m3fn) == (kv_cache_dtype == "fp8")
        result = engine.generate_many([[5, 9, 2, 7, 1, 3], [8, 8, 1]], temperature=0, max_tokens=4, ignore_eos=True,
                                      logprobs=1)
        out[fast] = [r.output_token_ids for r in result], [[lp for lp, _ in r.logprobs] for r in result]
    assert out[True][0] == out[False][0]
    for a, b in zip(out[True][1], out[False][1]):
        assert a == pytest.approx(b, abs=1e-3)


def hostile_rows(n, dtype, seed=11):
    """Rows that each try the quantization's edges: all zeros, one huge value among small ones (the rest fall into
    e4m3's subnormal range, some exactly on it or halfway, or to zero), values at and just under 448 times the scale (rounding to +-448), tiny
    values (the scale's floor, MIN_AMAX), mixed signs over orders of magnitude, and plain random rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, n, generator=g)
    x[0] = 0
    x[1] = torch.randn(n, generator=g) * 1e-3
    x[1, 7] = 3e4
    # values that land on e4m3's subnormals (steps of 2^-9 below 2^-6, times the scale), ties between them included
    x[1, 8:16] = 3e4 / 448 * torch.tensor([2 ** -9, 1.5 * 2 ** -9, 2 ** -8, -3 * 2 ** -9, 2.5 * 2 ** -9,
                                           0.99 * 2 ** -6, 0.5 * 2 ** -9, -0.51 * 2 ** -9])
    x[2, :] = 1.0
    x[2, ::3] = -0.999  # 0.999 x 448 = 447.6: rounds to 448
    x[3] = torch.randn(n, generator=g) * 1e-30  # below MIN_AMAX: the floor scale
    x[4] = torch.randn(n, generator=g) * torch.logspace(-8, 4, n)
    x[5, :] = -2.0
    x[6] = torch.randn(n, generator=g) * 100
    return x.to(dtype).to(DEVICE)


def norm_inputs(n, dtype, residual):
    """Norm inputs whose normed rows are the hostile ones: x = the rows, the residual (if any) their difference
    from a random stream, the weight ones but a sign flipped and a tiny one."""
    x = hostile_rows(n, dtype)
    w = torch.ones(n, dtype=dtype, device=DEVICE)
    w[:3] = torch.tensor([1.0, -1.0, 1e-6])
    res = None
    if residual:
        res = rand(*x.shape, seed=12).to(dtype)
        x = (x - res).to(dtype)
    return x, w, res


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def bits(q):
    return q.view(torch.uint8)


BITWISE_DTYPES = [torch.float32, torch.bfloat16]  # the interpreter rounds bf16 as it stores it: both kernels alike


@pytest.mark.parametrize("dtype", BITWISE_DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n", [512, 1000])  # a power of two, and a padded row
def test_norm_quantized_is_bitwise_the_norm_then_quantize_rows(dtype, residual, n):
    """kernels/norm.rmsnorm_fp8: the fp8 values, scales and new residual bit for bit those of rmsnorm followed by
    fp8_quant.quantize_rows (the bf16-rounded normed rows quantized), on hostile rows."""
    from llm_anatomy.kernels.fp8_quant import quantize_rows
    from llm_anatomy.kernels.norm import rmsnorm, rmsnorm_fp8

    x, w, res = norm_inputs(n, dtype, residual)
    res_fused = None if res is None else res.clone()
    q, scale = rmsnorm_fp8(x, w, 1e-6, residual=res_fused)
    want_q, want_scale = quantize_rows(rmsnorm(x, w, 1e-6, residual=res))
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (x.shape[0], 1)
    assert torch.equal(bits(q), bits(want_q))
    assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))
    if residual:
        assert torch.equal(res_fused, res)
    values = q.float()
    # the zero row and the tiny one (its squares underflow: normed to ~1e-27, under MIN_AMAX) quantize to zeros
    assert (values[[0, 3]] == 0).all() and (scale[[0, 3]] == torch.tensor(1e-12) / 448).all()
    assert (values.abs().amax(dim=1)[[1, 2, 4, 5, 6, 7, 8]] == 448).all()  # the other rows' largest: 448
    assert values.isfinite().all()


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows,k", [(1, 512), (3, 1000), (9, 512), (2, 2 * 16384 + 100)])
def test_quantize_rows_launch_shapes_on_hostile_rows(gated, rows, k):
    """quantize_rows over every launch shape (one row a program and several, padded rows, rows too long for one
    pass) against the reference: scales equal (on the GPU to the last bit, see above), fp8 values equal where the
    interpreter rounds right (see above); the row of zeros gives zeros."""
    from llm_anatomy.kernels.fp8_quant import FP8_MAX, launch_shape, quantize_rows, quantize_rows_reference

    shape = launch_shape(rows, k)
    assert (shape["ROWS"] > 1) == (k < 1024 and rows > 1) and shape["ONE_PASS"] == (k <= 16384)
    x = hostile_rows(2 * k if gated else k, torch.float32)[:rows]
    q, scale = quantize_rows(x, gated)
    want_q, want_scale = quantize_rows_reference(x, gated)
    assert q.shape == want_q.shape == (rows, k) and scale.shape == (rows, 1)
    assert (q[0].float() == 0).all()
    same = q.float() == want_q.float()
    if DEVICE.type == "cuda" or gated:
        torch.testing.assert_close(scale, want_scale, rtol=1e-6 if gated else 2.5e-7, atol=0)
    else:
        assert torch.equal(scale, want_scale)
    if DEVICE.type == "cuda":
        assert same.float().mean() > 0.999
    else:
        mantissa = (want_q.float().abs() / 2 ** want_q.float().abs().log2().floor()).nan_to_num(0)
        checked = (mantissa != 1.0) & (want_q.float().abs() < FP8_MAX)
        assert same[checked].float().mean() > 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows", [1, 16, 512, 8192])
def test_norm_quantized_is_the_two_kernels_on_the_gpu(residual, rows):
    """On CUDA in bf16 at Qwen3-8B's width: rmsnorm_fp8 against rmsnorm then quantize_rows, hostile rows among
    random ones, and the PyTorch reference's fp8 values (its scales to the last bit, see above). The residual and
    the scales bit for bit; the values too but for a rare one a code away (Triton may order the fp8 variant's sum
    of squares differently: measured 8 of 33.5 million at 8192 rows)."""
    from llm_anatomy.kernels.fp8_quant import quantize_rows, quantize_rows_reference
    from llm_anatomy.kernels.norm import rmsnorm, rmsnorm_fp8

    x, w, res = norm_inputs(4096, torch.bfloat16, residual)
    more = rows - x.shape[0]
    if more > 0:
        x = torch.cat([x, rand(more, 4096, seed=13).bfloat16() * 5])
        res = None if res is None else torch.cat([res, rand(more, 4096, seed=14).bfloat16()])
    x, res = x[:rows].contiguous(), None if res is None else res[:rows].contiguous()
    res_fused = None if res is None else res.clone()
    q, scale = rmsnorm_fp8(x, w, 1e-6, residual=res_fused)
    normed = rmsnorm(x, w, 1e-6, residual=res)
    want_q, want_scale = quantize_rows(normed)
    apart = bits(q).int() - bits(want_q).int()
    assert torch.equal(scale, want_scale) and apart.abs().max().item() <= 1
    assert (apart != 0).sum().item() <= q.numel() * 1e-6
    if residual:
        assert torch.equal(res_fused, res)
    ref_q, ref_scale = quantize_rows_reference(normed)
    torch.testing.assert_close(scale, ref_scale, rtol=2.5e-7, atol=0)
    assert (q.float() == ref_q.float()).float().mean() > 0.999


def test_fp8_engine_with_quantizing_norms_equals_it_without(save_tiny, monkeypatch):
    """--quantization fp8 with W8A8 products (on the CPU in float32, the W8A8 test patched to take it, as a Hopper GPU
    takes bf16): the norms that hand qkv_proj and gate_up_proj their rows quantized (qwen3.takes_fp8_rows) give the
    same greedy tokens and logprobs, bit for bit, as norms that write the rows for the products to quantize. A
    prefill of 23 tokens (torch._scaled_mm), then a decode step of two rows (the W8A8 GEMV)."""
    from llm_anatomy import Engine
    from llm_anatomy.kernels import norm
    from llm_anatomy.models import quant, qwen3

    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    if DEVICE.type == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("W8A8 needs sm_90")
    if DEVICE.type == "cpu":
        monkeypatch.setattr(quant.Fp8Linear, "w8a8_on", lambda self, device, dtype: self.block is None)
    fused = []
    rmsnorm_fp8 = norm.rmsnorm_fp8
    monkeypatch.setattr(norm, "rmsnorm_fp8", lambda *a, **kw: fused.append(a[0].shape[0]) or rmsnorm_fp8(*a, **kw))
    directory, _ = save_tiny(hidden_size=512, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=4,
                             head_dim=32, num_hidden_layers=1, initializer_range=0.2)
    prompts = [[(7 * i) % 50 + 1 for i in range(20)], [8, 8, 1]]
    out = []
    for quantizing_norms in (True, False):
        if not quantizing_norms:
            monkeypatch.setattr(qwen3, "takes_fp8_rows", lambda *a, **kw: False)
        engine = Engine.from_pretrained(directory, device=DEVICE, dtype=dtype, kv_cache_tokens=128, block_size=4,
                                        max_num_seqs=2, quantization="fp8", fast_path=True, cuda_graphs=False)
        result = engine.generate_many(prompts, temperature=0, max_tokens=2, ignore_eos=True, logprobs=1)
        out.append([(r.output_token_ids, [lp for lp, _ in r.logprobs]) for r in result])
        if quantizing_norms:  # both norms in the prefill and in the decode step: the prefill's second (its one
            # layer is the last) over the two sampled rows alone
            assert fused == [23, 2, 2, 2]
            fused.clear()
    assert not fused
    assert out[0] == out[1]


def test_which_products_the_norm_quantizes_for(monkeypatch):
    """qwen3.takes_fp8_rows: the norm hands its rows quantized only to an fp8 layer whose fast product is W8A8
    (per-row scales; a gated product without a bias), on the fast path, and never where the plan streams the rows
    (batch 1: the streaming GEMV reads them in bf16)."""
    from llm_anatomy.engine.plan import ExecutionPlan
    from llm_anatomy.models import quant
    from llm_anatomy.models.config import WeightScheme
    from llm_anatomy.models.qwen3 import takes_fp8_rows

    monkeypatch.setattr(quant, "_rowwise_scaled_mm", lambda device: True)  # as on a Hopper GPU
    layer = Fp8Linear.from_linear(torch.nn.Linear(2048, 64, bias=False))
    biased = Fp8Linear.from_linear(torch.nn.Linear(2048, 64, bias=True))
    blocks = Fp8Linear.from_linear(torch.nn.Linear(2048, 64, bias=False), WeightScheme("block", "s", (32, 128)))
    fast, streaming = ExecutionPlan(kernels=True), ExecutionPlan(kernels=True, stream_gemv=True)
    rows = torch.zeros(2, 2048, dtype=torch.bfloat16, device=DEVICE)  # where the module's kernels run
    one = rows[:1]
    assert takes_fp8_rows(rows, layer, fast) and takes_fp8_rows(rows, layer, fast, gated=True)
    assert takes_fp8_rows(one, layer, fast) and takes_fp8_rows(rows, layer, streaming)
    assert not takes_fp8_rows(one, layer, streaming)  # batch 1 streams: bf16 rows as before
    assert not takes_fp8_rows(rows, layer, ExecutionPlan())  # the PyTorch path
    assert not takes_fp8_rows(rows.float(), layer, fast)  # W8A16
    assert not takes_fp8_rows(rows, blocks, fast)  # block scales: W8A16
    assert takes_fp8_rows(rows, biased, fast) and not takes_fp8_rows(rows, biased, fast, gated=True)
    assert not takes_fp8_rows(rows, torch.nn.Linear(2048, 64, bias=False).bfloat16(), fast)  # bf16 weights
