"""Per-token fp8 quantization of activations for the W8A8 products (models/quant.py), one kernel a product.

Each program takes one row: it reads the row for its largest magnitude, then again (from L2) to write the fp8 e4m3
values and the row's float32 scale, amax / 448. With `gated` the row is the gate_up projection's [gate, up] and
the values quantized are SiLU(gate) * up, rounded to the model dtype as HF rounds them, so that the down
projection's input never exists in bf16. The arithmetic is the PyTorch reference's (quantize_rows_reference):
IEEE division, round to nearest even, values clamped to +-448 first (PyTorch's CUDA division by a number
multiplies by its reciprocal, so there a scale can differ in its last bit).
"""

import torch
import triton
import triton.language as tl

from .activation import silu_mul_rounded
from .pdl import gdc_enter

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12  # an all-zero row: a tiny scale, zeros
_FP8_MAX, _MIN_AMAX = tl.constexpr(FP8_MAX), tl.constexpr(MIN_AMAX)  # as the kernel sees them
BLOCK = 2048  # columns a pass loads at once; a longer row takes several, the second pass finds them in L2


@triton.jit
def _row_values(x_ptr, cols, mask, inter, GATED: tl.constexpr):
    """A row's values at `cols`, float32: the row itself, or SiLU(gate) * up rounded as HF rounds it."""
    if GATED:
        g = tl.load(x_ptr + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + inter + cols, mask=mask, other=0.0)
        return silu_mul_rounded(g, u).to(tl.float32)
    return tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, k, stride_x, stride_q, GATED: tl.constexpr,
                          BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, k, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_row_values(x_row, cols, cols < k, k, GATED)))
    scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), _MIN_AMAX), _FP8_MAX)
    for c0 in range(0, k, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < k
        v = tl.div_rn(_row_values(x_row, cols, mask, k, GATED), scale)
        v = tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)
        tl.store(q_ptr + row * stride_q + cols, v.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor, gated: bool = False, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (fp8 e4m3 [M, K], float32 scales [M, 1]): one scale per row, from that row.
    With gated, x is [M, 2 I] = [gate, up] and the result quantizes SiLU(gate) * up, [M, I]."""
    rows, k = x.shape
    if gated:
        k //= 2
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q, scale, k, x.stride(0), q.stride(0), GATED=gated,
                                       BLOCK=min(BLOCK, triton.next_power_of_2(k)), USE_PDL=pdl, launch_pdl=pdl,
                                       num_warps=8)
    return q, scale


def quantize_rows_reference(x: torch.Tensor, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in PyTorch ops."""
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    x32 = x.float()
    scale = x32.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
