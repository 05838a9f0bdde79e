"""Per-token fp8 quantization of activations for the W8A8 products (models/quant.py).

A row's values are quantized by one scale, amax / 448 (float32), from that row. The row is read once: a program
holds whole rows in registers (ROWS rows of up to ONE_PASS_MAX columns, padded to a power of two), takes their
largest magnitudes, and writes the fp8 e4m3 values and the scales. Longer rows take two passes over column blocks:
the first finds the largest magnitude, the second reads the row again (from L2) to write it. With `gated` the row is
the gate_up projection's [gate, up] and the values quantized are SiLU(gate) * up, rounded to the model dtype as HF
rounds them, so that the down projection's input never exists in bf16.

The arithmetic (row_scale, to_fp8, also used by the norm that quantizes its output, kernels/norm.py) is the PyTorch
reference's (quantize_rows_reference): IEEE division, round to nearest even, values clamped to +-448 first
(PyTorch's CUDA division by a number multiplies by its reciprocal, so there a scale can differ in its last bit).
"""

import torch
import triton
import triton.language as tl

from . import fp8_quant_cuda
from .activation import silu_mul_rounded
from .pdl import gdc_enter

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12  # an all-zero row: a tiny scale, zeros
_FP8_MAX, _MIN_AMAX = tl.constexpr(FP8_MAX), tl.constexpr(MIN_AMAX)  # as the kernel sees them
ONE_PASS_MAX = 16384  # the longest (padded) row held in registers: gate_up's 2 x 12288 of Qwen3-8B takes one pass
BLOCK = 2048  # columns a pass loads at once for longer rows; the second pass finds them in L2
PROGRAM_COLUMNS = 4096  # short rows are packed ROWS to a program up to this many columns
COLUMNS_PER_WARP = 1024  # 32 values a thread: a row of 4096 gets 4 warps, one of 16384 gets 16


@triton.jit
def row_scale(amax):
    """The scale of a row whose largest magnitude is amax (float32): amax / 448, a zero row's tiny but not 0."""
    return tl.div_rn(tl.maximum(amax, _MIN_AMAX), _FP8_MAX)


@triton.jit
def to_fp8(v, scale, dtype: tl.constexpr):
    """float32 values over their row's scale, clamped to +-448, rounded to nearest even in `dtype` (fp8 e4m3)."""
    v = tl.div_rn(v, scale)
    return tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX).to(dtype)


@triton.jit
def _row_values(x_ptr, cols, mask, inter, GATED: tl.constexpr):
    """The rows' values at `cols`, float32: the rows themselves, or SiLU(gate) * up rounded as HF rounds it."""
    if GATED:
        g = tl.load(x_ptr + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + inter + cols, mask=mask, other=0.0)
        return silu_mul_rounded(g, u).to(tl.float32)
    return tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, rows, k, stride_x, stride_q, GATED: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    row_ok = row < rows
    x_rows = x_ptr + row * stride_x
    q_rows = q_ptr + row * stride_q
    if ONE_PASS:  # BLOCK covers the row: one read
        cols = tl.arange(0, BLOCK)[None, :]
        mask = row_ok & (cols < k)
        v = _row_values(x_rows, cols, mask, k, GATED)
        scale = row_scale(tl.max(tl.abs(v), axis=1))[:, None]
        tl.store(q_rows + cols, to_fp8(v, scale, q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([ROWS, BLOCK], tl.float32)
        for c0 in range(0, k, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)[None, :]
            amax = tl.maximum(amax, tl.abs(_row_values(x_rows, cols, row_ok & (cols < k), k, GATED)))
        scale = row_scale(tl.max(amax, axis=1))[:, None]
        for c0 in range(0, k, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)[None, :]
            mask = row_ok & (cols < k)
            v = _row_values(x_rows, cols, mask, k, GATED)
            tl.store(q_rows + cols, to_fp8(v, scale, q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale, mask=row_ok)


def launch_shape(rows: int, k: int) -> dict:
    """The kernel's constants for `rows` rows of `k` values (gated: k values of SiLU(gate) * up): whole rows in
    registers where they fit, short rows several to a program, about 32 values a thread."""
    padded = triton.next_power_of_2(k)
    if padded > ONE_PASS_MAX:
        return dict(ROWS=1, BLOCK=BLOCK, ONE_PASS=False, num_warps=8)
    per_program = max(1, min(PROGRAM_COLUMNS // padded, triton.next_power_of_2(rows)))
    warps = max(1, min(16, per_program * padded // COLUMNS_PER_WARP))
    return dict(ROWS=per_program, BLOCK=padded, ONE_PASS=True, num_warps=warps)


def quantize_rows(x: torch.Tensor, gated: bool = False, pdl: bool = False, cuda: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (fp8 e4m3 [M, K], float32 scales [M, 1]): one scale per row, from that row.
    With gated, x is [M, 2 I] = [gate, up] and the result quantizes SiLU(gate) * up, [M, I]. With `cuda` (an
    engine's plan, where the device has it), gated rows that the CUDA cluster kernel takes go there: the same bits
    (for plain rows of a hidden state's length it is the slower, benchmarks/README.md)."""
    if cuda and gated and fp8_quant_cuda.supports(x, gated):
        return fp8_quant_cuda.quantize_rows(x, gated, pdl)
    rows, k = x.shape
    if gated:
        k //= 2
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        shape = launch_shape(rows, k)
        _quantize_rows_kernel[(triton.cdiv(rows, shape["ROWS"]),)](
            x, q, scale, rows, k, x.stride(0), q.stride(0), GATED=gated, USE_PDL=pdl, launch_pdl=pdl, **shape)
    return q, scale


def quantize_rows_reference(x: torch.Tensor, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in PyTorch ops."""
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    x32 = x.float()
    scale = x32.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
