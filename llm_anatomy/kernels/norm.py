"""RMSNorm, fused with the residual add that precedes it (one read of x and residual, one write of each).

Numerics are HF Qwen3's: the add rounds to the model dtype, the norm runs in float32, its result is rounded
to the model dtype before the weight multiplies it.

rmsnorm_fp8 writes the result quantized per token for a W8A8 product instead (fp8 e4m3 values and a float32 scale
per row): the arithmetic of fp8_quant.quantize_rows(rmsnorm(...)), the result rounded to the model dtype and then
quantized (fp8_quant.row_scale, to_fp8), without writing it and reading it back. The same bits in Triton's
interpreter; on a GPU Triton lays this variant out differently and may add a row's squares in another order, so a
rare value lands on the neighbouring model-dtype value before it is quantized, one fp8 code away (how rare:
benchmarks/README.md).
"""

import torch
import triton
import triton.language as tl

from .fp8_quant import FP8, row_scale, to_fp8
from .pdl import gdc_enter


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, n_cols, eps, stride_x, stride_r, stride_o,
                    HAS_RESIDUAL: tl.constexpr, QUANTIZED: tl.constexpr, BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr, LAUNCH_FIRST: tl.constexpr):
    gdc_enter(USE_PDL, LAUNCH_FIRST)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)  # the new residual, in place
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (xf * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    if QUANTIZED:  # the result as rmsnorm writes it (model dtype), then as quantize_rows quantizes it
        y = y.to(x.dtype).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), axis=0))  # padding columns are 0
        tl.store(out_ptr + row * stride_o + cols, to_fp8(y, scale, out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, weight, eps, residual, out, scale, pdl, launch_first):
    rows, n = x.shape
    block = triton.next_power_of_2(n)
    res = residual if residual is not None else x
    _rmsnorm_kernel[(rows,)](x, res, weight, out, scale, n, eps, x.stride(0), res.stride(0), out.stride(0),
                             HAS_RESIDUAL=residual is not None, QUANTIZED=scale is not None, BLOCK=block,
                             USE_PDL=pdl, LAUNCH_FIRST=launch_first, launch_pdl=pdl,
                             num_warps=8 if block >= 4096 else 4)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            pdl: bool = False, launch_first: bool = False) -> torch.Tensor:
    """x [rows, n]. With `residual`, first residual <- x + residual (in place), then norm(residual). `pdl`,
    `launch_first`: see pdl.py (launch_first where the next kernel is the streaming GEMV)."""
    out = torch.empty_like(x)
    _launch(x, weight, eps, residual, out, None, pdl, launch_first)
    return out


def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm's result quantized per token: (fp8 e4m3 [rows, n], float32 scales [rows, 1]), as
    fp8_quant.quantize_rows(rmsnorm(x, weight, eps, residual)) (see the module's docstring for a rare last-bit
    difference on a GPU); the residual as rmsnorm leaves it."""
    rows, n = x.shape
    q = torch.empty(rows, n, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    _launch(x, weight, eps, residual, q, scale, pdl, False)
    return q, scale


def rmsnorm_reference(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
        residual.copy_(x)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
