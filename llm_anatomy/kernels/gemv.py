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


@triton.autotune(configs=CONFIGS, key=["M_PAD", "N", "K", "GATED"])  # the best tile is the same with PDL
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym,
                 K: tl.constexpr, M_PAD: tl.constexpr, GATED: tl.constexpr, IEEE: tl.constexpr,
                 USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    gdc_enter(USE_PDL)
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_PAD)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    u_ptrs = w_ptrs + N * stride_wn  # GATED: the up rows sit N rows below the gate rows
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    acc_up = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for _ in range(0, K // BLOCK_K):
        x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
        acc += _dot(x, tl.load(w_ptrs, mask=rn[:, None] < N, other=0.0), IEEE)
        if GATED:
            acc_up += _dot(x, tl.load(u_ptrs, mask=rn[:, None] < N, other=0.0), IEEE)
            u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = y_ptr.dtype.element_ty
    if GATED:  # HF rounds each projection, SiLU's output and the product to the model dtype
        g = acc.to(dtype).to(tl.float32)
        s = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
        y = (s * acc_up.to(dtype).to(tl.float32)).to(dtype)
    else:
        y = acc.to(dtype)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


MAX_ROWS = 16


def gemv(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight[N, K].T -> [M, N]; with gated, weight is [2n, K] and the result is
    SiLU(x @ gate.T) * (x @ up.T), [M, n]. K must be a multiple of 512."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _gemv_kernel[grid](x, weight, y, m, n, x.stride(0), weight.stride(0), y.stride(0), K=k, M_PAD=16,
                       GATED=gated, IEEE=x.dtype == torch.float32, USE_PDL=PDL.on, launch_pdl=PDL.on)
    return y


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.shape[0] <= MAX_ROWS and x.shape[1] % 512 == 0 and x.is_contiguous() and weight.is_contiguous()
