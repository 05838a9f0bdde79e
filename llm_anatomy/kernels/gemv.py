"""Skinny matrix products (a few rows of activations times a weight matrix): the weights of every decode step.

Decode reads every weight once per step for a handful of rows, so the product is bound by memory, not
arithmetic. The kernel streams [BLOCK_N, BLOCK_K] weight tiles through tl.dot (rows padded to 16, the
tensor cores' minimum), software-pipelined `num_stages` deep so that enough loads are in flight to fill
the memory system. Shapes are few (one per projection), so each is tuned once.
"""

import os

import torch
import triton
import triton.language as tl


# A small search: per shape, Triton times each once on the first call (about a second per shape).
CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=4, num_stages=s)
    for bn, bk in ((16, 256), (16, 512), (32, 256), (32, 128), (64, 128)) for s in (3, 4, 5)
]
if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU tests: one config, no timing
    CONFIGS = CONFIGS[:1]


@triton.autotune(configs=CONFIGS, key=["M_PAD", "N", "K"])
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym,
                 K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_PAD)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for _ in range(0, K // BLOCK_K):
        x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptrs, mask=rn[:, None] < N, other=0.0)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


MAX_ROWS = 16


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight[N, K].T -> [M, N]; K must be a multiple of 512."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _gemv_kernel[grid](x, weight, y, m, n, x.stride(0), weight.stride(0), y.stride(0), K=k, M_PAD=16)
    return y


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.shape[0] <= MAX_ROWS and x.shape[1] % 512 == 0 and x.is_contiguous() and weight.is_contiguous()
