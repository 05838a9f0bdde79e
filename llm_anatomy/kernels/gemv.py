"""Skinny matrix products (a few rows of activations times a weight matrix): the weights of every decode step.

Decode reads every weight once per step for a handful of rows, so the product is bound by memory, not
arithmetic. The kernel streams [BLOCK_N, BLOCK_K] weight tiles through tl.dot (rows padded to 16, the
tensor cores' minimum), software-pipelined `num_stages` deep so that enough loads are in flight to fill
the memory system. With `gated`, the weight is gate_up = [gate; up] and each program computes matching
rows of both, so the output is SiLU(gate) * up directly: the MLP's activation costs no extra launch or
round trip through memory.

In a decode step the RMSNorms need no kernels of their own (`norm=`, `add_to=`): the GEMV that writes the
residual stream adds its product in place (HF's residual add) and leaves the sums of squares of each 16 columns
of the new stream; the GEMV that reads the stream sums those to each row's RMS before its loop, then
normalises each x tile as it loads it (from L2: the stream is a few KB). Nothing is stored or reduced inside the
loop, so the weight loads stay pipelined.
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


# The best tile is the same with PDL. An in-place add (ADD) must not accumulate over the tuner's timing runs.
@triton.autotune(configs=CONFIGS, key=["M_PAD", "N", "K", "GATED", "NORM", "ADD"], restore_value=["y_ptr"])
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, norm_ptr, squares_ptr, eps, M, N, stride_xm, stride_wn, stride_ym,
                 K: tl.constexpr, M_PAD: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
                 ADD: tl.constexpr, SQUARES_PAD: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    gdc_enter(USE_PDL)
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_PAD)
    rk = tl.arange(0, BLOCK_K)
    dtype = y_ptr.dtype.element_ty
    cols = tl.arange(0, SQUARES_PAD)
    if NORM == 1:  # x is the residual stream: its RMS per row from the sums of squares its writer left
        sums = tl.load(squares_ptr + rm[:, None] * (K // 16) + cols[None, :],
                       mask=(rm[:, None] < M) & (cols[None, :] < K // 16), other=0.0)
        inv_rms = tl.rsqrt(tl.sum(sums, axis=1) / K + eps)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    g_ptrs = norm_ptr + rk
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    u_ptrs = w_ptrs + N * stride_wn  # GATED: the up rows sit N rows below the gate rows
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    acc_up = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for _ in range(0, K // BLOCK_K):
        x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
        if NORM == 1:  # HF's RMSNorm: normalise in float32, round, scale by the weight, round
            x = (x.to(tl.float32) * inv_rms[:, None]).to(dtype).to(tl.float32)
            x = (x * tl.load(g_ptrs).to(tl.float32)[None, :]).to(dtype)
            g_ptrs += BLOCK_K
        if NORM == 2:  # EXPERIMENT: scale by the weight only, the RMS after the loop
            x = (x.to(tl.float32) * tl.load(g_ptrs).to(tl.float32)[None, :]).to(dtype)
            g_ptrs += BLOCK_K
        acc += _dot(x, tl.load(w_ptrs, mask=rn[:, None] < N, other=0.0), IEEE)
        if GATED:
            acc_up += _dot(x, tl.load(u_ptrs, mask=rn[:, None] < N, other=0.0), IEEE)
            u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if NORM >= 2:  # EXPERIMENT: the RMS applied after the product (3: as if the weight were folded into W)
        sums = tl.load(squares_ptr + rm[:, None] * (K // 16) + cols[None, :],
                       mask=(rm[:, None] < M) & (cols[None, :] < K // 16), other=0.0)
        inv_rms = tl.rsqrt(tl.sum(sums, axis=1) / K + eps)
        acc *= inv_rms[:, None]
        acc_up *= inv_rms[:, None]
    if GATED:  # HF rounds each projection, SiLU's output and the product to the model dtype
        g = acc.to(dtype).to(tl.float32)
        s = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
        y = (s * acc_up.to(dtype).to(tl.float32)).to(dtype)
    else:
        y = acc.to(dtype)
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    if ADD:  # y is the residual stream: add the rounded product as HF does, and leave the new sums of squares
        y = (y.to(tl.float32) + tl.load(y_ptrs, mask=inside, other=0.0).to(tl.float32)).to(dtype)
        sq = y.to(tl.float32)
        sq = tl.sum(tl.reshape(sq * sq, [M_PAD, BLOCK_N // 16, 16]), axis=2)
        group = pid * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
        tl.store(squares_ptr + rm[:, None] * (N // 16) + group[None, :], sq,
                 mask=(rm[:, None] < M) & (group[None, :] < N // 16))
    tl.store(y_ptrs, y, mask=inside)


MAX_ROWS = 16


def gemv(x: torch.Tensor, weight: torch.Tensor, gated: bool = False, norm: torch.Tensor | None = None,
         eps: float = 0.0, add_to: torch.Tensor | None = None, squares: torch.Tensor | None = None,
         norm_mode: int = 1) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight[N, K].T -> [M, N]; with gated, weight is [2n, K] and the result is
    SiLU(x @ gate.T) * (x @ up.T), [M, n]. K must be a multiple of 512.

    The residual stream of a decode step, with `squares` ([MAX_ROWS, hidden // 16] float32, see new_squares):
    - norm (an RMSNorm's weight): x is the stream and the product is RMSNorm(x) @ weight.T; `squares` must hold
      the sums the GEMV that last wrote x left;
    - add_to (the stream, [M, N]): add_to += x @ weight.T in place, returned; `squares` gets its new sums."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if (norm is not None or add_to is not None) and squares is None:
        raise ValueError("norm= and add_to= need the stream's squares buffer")
    if add_to is not None and (add_to.shape != (m, n) or not add_to.is_contiguous()):
        raise ValueError(f"add_to must be a contiguous [{m}, {n}] stream, got {tuple(add_to.shape)}")
    y = add_to if add_to is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _gemv_kernel[grid](x, weight, y, norm if norm is not None else weight, squares if squares is not None else y,
                       eps, m, n, x.stride(0), weight.stride(0), y.stride(0), K=k, M_PAD=16, GATED=gated,
                       NORM=norm_mode if norm is not None else 0, ADD=add_to is not None,
                       SQUARES_PAD=triton.next_power_of_2(max(k // 16, 1)), IEEE=x.dtype == torch.float32,
                       USE_PDL=PDL.on, launch_pdl=PDL.on)
    return y


def new_squares(hidden_size: int, device) -> torch.Tensor:
    """The buffer in which a decode step's residual stream keeps its per-16-column sums of squares."""
    return torch.zeros(MAX_ROWS, hidden_size // 16, dtype=torch.float32, device=device)


def fits(rows: int, k: int) -> bool:
    return rows <= MAX_ROWS and k % 512 == 0


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return fits(*x.shape) and x.is_contiguous() and weight.is_contiguous()
