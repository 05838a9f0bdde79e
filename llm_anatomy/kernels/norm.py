"""RMSNorm, fused with the residual add that precedes it (one read of x and residual, one write of each).

Numerics are HF Qwen3's: the add rounds to the model dtype, the norm runs in float32, its result is rounded
to the model dtype before the weight multiplies it.
"""

import torch
import triton
import triton.language as tl

from .pdl import gdc_enter


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, stride_x, stride_r, stride_o,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                    LAUNCH_FIRST: tl.constexpr):
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
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            pdl: bool = False, launch_first: bool = False) -> torch.Tensor:
    """x [rows, n]. With `residual`, first residual <- x + residual (in place), then norm(residual). `pdl`,
    `launch_first`: see pdl.py (launch_first where the next kernel is the streaming GEMV)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    res = residual if residual is not None else x
    _rmsnorm_kernel[(rows,)](x, res, weight, out, n, eps, x.stride(0), res.stride(0), out.stride(0),
                             HAS_RESIDUAL=residual is not None, BLOCK=block, USE_PDL=pdl,
                             LAUNCH_FIRST=launch_first, launch_pdl=pdl,
                             num_warps=8 if block >= 4096 else 4)
    return out


def rmsnorm_reference(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
        residual.copy_(x)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
