"""The CUDA cluster kernel of per-token fp8 quantization (kernels/fp8_quant_cuda.py): bit for bit the Triton kernel's
values and scales (the GPU tests), what it takes and refuses, and when an engine's plan chooses it."""

import pytest
import torch

from llm_anatomy.kernels import fp8_quant, fp8_quant_cuda, use_kernels
from test_quant_kernels import hostile_rows

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                            reason="needs a Hopper-or-later CUDA device")


@pytest.mark.parametrize("k", [8, 1000, 1024, 3072, 4096, 5120, 12288, 25600, 65536])
def test_launch_shape_covers_the_row_with_the_fewest_blocks(k):
    cluster, items = fp8_quant_cuda.launch_shape(k)
    per_block = items * 8 * fp8_quant_cuda.THREADS
    assert 1 <= cluster <= fp8_quant_cuda.MAX_CLUSTER and cluster * per_block >= k
    assert (cluster - 1) * per_block < k  # no block of the cluster is left without columns
    if k <= fp8_quant_cuda.MAX_CLUSTER * fp8_quant_cuda.MAX_ITEMS * 8 * fp8_quant_cuda.THREADS:
        assert items <= fp8_quant_cuda.MAX_ITEMS
    assert items <= 8  # MAX_K's bound on the registers a thread holds


def test_what_the_kernel_does_not_take():
    """CPU rows, other dtypes, rows not of 8-value pieces, strided columns and over-long rows are refused (the caller
    keeps the Triton kernel): quantize_rows(cuda=True) gives the Triton kernel's result for them."""
    x = torch.randn(4, 64).bfloat16()
    assert not fp8_quant_cuda.supports(x, False)  # on the CPU
    with pytest.raises(ValueError, match="not contiguous 16-byte aligned bf16 rows"):
        fp8_quant_cuda.quantize_rows(x)
    if not use_kernels(x.device):  # Triton runs CPU rows under its interpreter only (the CPU suite's)
        return
    q, scale = fp8_quant.quantize_rows(x, gated=True, cuda=True)
    want_q, want_scale = fp8_quant.quantize_rows(x, gated=True)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)


@hopper
@pytest.mark.gpu
def test_refusals_on_the_gpu():
    dev = torch.device("cuda")
    ok = torch.randn(4, 4096, device=dev).bfloat16()
    assert fp8_quant_cuda.supports(ok, False) and fp8_quant_cuda.supports(ok, True)
    assert not fp8_quant_cuda.supports(ok.half(), False)
    assert not fp8_quant_cuda.supports(torch.randn(4, 4100, device=dev).bfloat16(), False)  # 4100 % 8
    assert not fp8_quant_cuda.supports(torch.randn(4, 24, device=dev).bfloat16(), True)  # halves of 12
    assert not fp8_quant_cuda.supports(ok[:, ::2], False)  # strided columns
    assert not fp8_quant_cuda.supports(ok.view(-1)[4:4 + 4 * 4088].view(4, 4088), False)  # not 16-byte aligned
    assert not fp8_quant_cuda.supports(torch.empty(1, fp8_quant_cuda.MAX_K + 8, device=dev).bfloat16(), False)


def triton_quantized(x, gated):
    return fp8_quant.quantize_rows(x, gated)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows,k", [(1, 4096), (9, 1024), (9, 1000), (7, 3072), (9, 5120), (9, 12288), (5, 25600),
                                    (9, 40000)])
def test_bit_for_bit_the_triton_kernel(gated, rows, k):
    """The hostile rows (zeros, one huge value among subnormals, values rounding to 448, the scale's floor, orders
    of magnitude) and random ones: the same fp8 bytes and scales as the Triton kernel, for every cluster size."""
    width = 2 * k if gated else k
    x = torch.cat([hostile_rows(width, torch.bfloat16), torch.randn(rows, width, device="cuda").bfloat16() * 3])
    q, scale = fp8_quant_cuda.quantize_rows(x, gated)
    want_q, want_scale = triton_quantized(x, gated)
    assert q.shape == want_q.shape == (x.shape[0], k) and scale.shape == (x.shape[0], 1)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_scale)
    assert (q[0].float() == 0).all()


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("min_blocks", [1, 4, 12])
def test_its_variants_give_the_same_bits(min_blocks):
    x = torch.cat([hostile_rows(2 * 12288, torch.bfloat16), torch.randn(600, 2 * 12288, device="cuda").bfloat16()])
    q, scale = fp8_quant_cuda.quantize_rows(x, True, min_blocks=min_blocks)
    want_q, want_scale = triton_quantized(x, True)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_many_rows_a_wider_buffer_and_a_graph_with_early_launch(gated):
    """8192 rows read from a buffer wider than the row (row stride past K), launched with PDL inside a CUDA graph
    after another kernel: the Triton kernel's bits, and a replay with new inputs gives the new rows' bits."""
    k = 4096
    width = 2 * k if gated else k
    buf = torch.randn(8192, width + 64, device="cuda").bfloat16()
    x = buf[:, :width]
    warm = fp8_quant_cuda.quantize_rows(x, gated, pdl=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2  # a kernel before, writing what the quantization reads
        q, scale = fp8_quant_cuda.quantize_rows(y, gated, pdl=True)
    buf.copy_(torch.randn_like(buf, dtype=torch.float32).bfloat16() * 5)
    graph.replay()
    want_q, want_scale = triton_quantized(x * 2, gated)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
    assert not torch.equal(q.view(torch.uint8), warm[0].view(torch.uint8))


@hopper
@pytest.mark.gpu
def test_an_fp8_engine_plans_it_and_a_bf16_engine_does_not():
    from llm_anatomy.engine.config import EngineConfig
    from llm_anatomy.engine.plan import choose_plan

    dev = torch.device("cuda", torch.cuda.current_device())
    config = EngineConfig(device="cuda")
    assert choose_plan(config, dev, "float8_e4m3fn", "bfloat16").cuda_gated_quant
    assert not choose_plan(config, dev, "bfloat16", "bfloat16").cuda_gated_quant
    assert not choose_plan(EngineConfig(device="cuda", fast_path=False), dev, "float8_e4m3fn", "bfloat16").cuda_gated_quant


def test_the_plan_leaves_it_off_without_a_gpu():
    from llm_anatomy.engine.config import EngineConfig
    from llm_anatomy.engine.plan import choose_plan

    plan = choose_plan(EngineConfig(device="cpu"), torch.device("cpu"), "float8_e4m3fn", "bfloat16")
    assert plan.cuda_gated_quant is False and plan.describe()["cuda_gated_quant"] is False


# The fast SiLU (fp8_quant_cuda.HELPERS) against the plain one for every input, run on the device: a block per
# gate, its threads over every up value
EXHAUSTIVE = r"""
// blockIdx.x: a gate's bits; each thread takes up values u and u ^ 0x8000 (its negation) in the two lanes
extern "C" __global__ void silu_mul_fast_vs_plain(unsigned* mismatches) {
    const unsigned g = blockIdx.x, gg = g | g << 16;
    const float gate = __uint_as_float(g << 16);
    if (!(gate >= FAST_GATE_MIN) && gate == gate) return;  // the kernel takes the plain form for these (NaN: fast)
    unsigned bad = 0;
    for (unsigned u = threadIdx.x; u < 65536; u += blockDim.x) {
        const unsigned uu = u | (u ^ 0x8000u) << 16;
        bad += silu_mul2_fast(gg, uu) != silu_mul2(gg, uu);
    }
    if (bad) atomicAdd(mismatches, bad);
}
"""


@hopper
@pytest.mark.gpu
def test_the_fast_silu_is_the_plain_one_for_every_gate_and_up_value():
    from llm_anatomy.kernels.cuda import BF16X2, ROW_DIVISION, compile_kernel, launch

    dev = torch.cuda.current_device()
    kernel = compile_kernel(ROW_DIVISION + BF16X2 + fp8_quant_cuda.HELPERS + EXHAUSTIVE, "silu_mul_fast_vs_plain",
                            dev, 0)
    mismatches = torch.zeros(1, dtype=torch.int32, device="cuda")
    launch(kernel, 65536, 256, [mismatches], pdl=False)
    assert mismatches.item() == 0


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_rows_holding_infinities_nans_and_gates_below_the_fast_range(gated):
    """A row with an infinity (its scale infinite), one with NaNs, one whose gates run down to -1e4 (the plain SiLU
    for the threads that hold them) and one with -inf among its gates: the Triton kernel's bits."""
    k = 12288
    width = 2 * k if gated else k
    x = torch.randn(6, width, device="cuda") * 3
    x[0, 5] = float("inf")
    x[1, 100:110] = float("nan")
    x[2, : k // 2] = -torch.logspace(0, 4, k // 2, device="cuda")
    x[3, 7] = float("-inf")
    x[4, 8000] = -90.0  # one gate below the fast range: its thread alone takes the plain form
    x = x.bfloat16()
    q, scale = fp8_quant_cuda.quantize_rows(x, gated)
    want_q, want_scale = triton_quantized(x, gated)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_scale)
