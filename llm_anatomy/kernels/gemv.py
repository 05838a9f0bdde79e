"""Skinny matrix products (a few rows of activations times a weight matrix): the weights of every decode step.

Decode reads every weight once per step for a handful of rows, so the product is bound by memory, not
arithmetic. The kernel streams [BLOCK_N, BLOCK_K] weight tiles through tl.dot (rows padded to 16, the
tensor cores' minimum), software-pipelined `num_stages` deep so that enough loads are in flight to fill
the memory system. With `gated`, the weight is gate_up = [gate; up] and each program computes matching
rows of both, so the output is SiLU(gate) * up directly: the MLP's activation costs no extra launch or
round trip through memory.
"""

import os

import torch
import triton
import triton.language as tl

from .pdl import PDL, gdc_enter

# A small search: per shape, Triton times each once on the first call (about a second per shape).
CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bn, bk, w in ((16, 256, 4), (16, 512, 4), (32, 256, 4), (32, 128, 4), (64, 128, 4), (16, 512, 8))
    for s in (3, 4, 5)
]
if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU tests: one config, no timing
    CONFIGS = CONFIGS[:1]


@triton.jit
def _dot(x, w, IEEE: tl.constexpr):
    if IEEE:  # float32 weights: exact products, not TF32
        return tl.dot(x, tl.trans(w), input_precision="ieee")
    return tl.dot(x, tl.trans(w))


@triton.autotune(configs=CONFIGS, key=["M_PAD", "N", "K", "GATED", "NORM"])  # the best tile is the same with PDL
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, res_ptr, res_out_ptr, norm_ptr, eps, M, N, stride_xm, stride_wn, stride_ym,
                 K: tl.constexpr, M_PAD: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    gdc_enter(USE_PDL)
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_PAD)
    rk = tl.arange(0, BLOCK_K)
    x_offs = rm[:, None] * stride_xm + rk[None, :]  # x and residual: [M, K], the same strides
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    u_ptrs = w_ptrs + N * stride_wn  # GATED: the up rows sit N rows below the gate rows
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    acc_up = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    squares = tl.zeros([M_PAD], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + x_offs + k0, mask=rm[:, None] < M, other=0.0)
        if HAS_RESIDUAL:  # h = x + residual in the model dtype, as HF adds; program 0 writes it out
            r = tl.load(res_ptr + x_offs + k0, mask=rm[:, None] < M, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(res_out_ptr + x_offs + k0, x, mask=(rm[:, None] < M) & (pid == 0))
        if NORM:  # RMSNorm(h) @ W = rsqrt(mean(h^2) + eps) * ((h * g) @ W): the scale is applied at the end
            squares += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
            x = (x.to(tl.float32) * tl.load(norm_ptr + k0 + rk).to(tl.float32)[None, :]).to(dtype)
        acc += _dot(x, tl.load(w_ptrs, mask=rn[:, None] < N, other=0.0), IEEE)
        if GATED:
            acc_up += _dot(x, tl.load(u_ptrs, mask=rn[:, None] < N, other=0.0), IEEE)
            u_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if NORM:
        inv = tl.rsqrt(squares / K + eps)[:, None]
        acc *= inv
        acc_up *= inv
    if GATED:  # HF rounds each projection, SiLU's output and the product to the model dtype
        g = acc.to(dtype).to(tl.float32)
        s = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
        y = (s * acc_up.to(dtype).to(tl.float32)).to(dtype)
    else:
        y = acc.to(dtype)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


MAX_ROWS = 16


def gemv(x: torch.Tensor, weight: torch.Tensor, gated: bool = False, norm: torch.Tensor | None = None,
         eps: float = 0.0, residual: torch.Tensor | None = None):
    """x [M, K] (M <= 16) @ weight[N, K].T -> [M, N]; with gated, weight is [2n, K] and the result is
    SiLU(x @ gate.T) * (x @ up.T), [M, n]. K must be a multiple of 512.

    With `norm` (an RMSNorm's weight), the product is RMSNorm(x) @ weight.T: the norm rides in the GEMV instead
    of a kernel of its own before it. With `residual` too, x + residual is normed and the call returns
    (y, x + residual), the new residual in a new tensor (every program reads the old one)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride() == x.stride(), "residual must be laid out like x"
    res_out = torch.empty_like(x) if residual is not None else x
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _gemv_kernel[grid](x, weight, y, residual if residual is not None else x, res_out,
                       norm if norm is not None else weight, eps, m, n, x.stride(0), weight.stride(0), y.stride(0),
                       K=k, M_PAD=16, GATED=gated, NORM=norm is not None, HAS_RESIDUAL=residual is not None,
                       IEEE=x.dtype == torch.float32, USE_PDL=PDL.on, launch_pdl=PDL.on)
    return (y, res_out) if residual is not None else y


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.shape[0] <= MAX_ROWS and x.shape[1] % 512 == 0 and x.is_contiguous() and weight.is_contiguous()
