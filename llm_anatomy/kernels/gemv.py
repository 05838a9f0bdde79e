"""Skinny matrix products (a few rows of activations times a weight matrix): the weights of every decode step.

Decode reads every weight once per step for a handful of rows, so the product is bound by memory, not
arithmetic. The kernel streams [BLOCK_N, BLOCK_K] weight tiles through tl.dot (rows padded to 16, the
tensor cores' minimum), software-pipelined `num_stages` deep so that enough loads are in flight to fill
the memory system. With `gated`, the weight is gate_up = [gate; up] and each program computes matching
rows of both, so the output is SiLU(gate) * up directly: the MLP's activation costs no extra launch or
round trip through memory.

A single bf16 row goes to the streaming CUDA kernel instead (stream_gemv.py), where it is enabled.

(down's GEMV waits for the whole of gate_up's output at the kernel boundary: starting on each chunk as soon as it
was written, through flags, was slower in the step, benchmarks/README.md.)
"""

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .activation import silu_mul_rounded
from .pdl import gdc_enter


@dataclass(frozen=True)
class Tile:
    """How the kernel cuts a product: BLOCK_N weight rows per program, BLOCK_K columns per load."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    prefetch: int = 0  # K tiles of weights read before waiting for the kernel before (PDL): see PREFETCH_CHOICES

    def __str__(self) -> str:
        name = f"N{self.block_n}_K{self.block_k}_w{self.num_warps}_s{self.num_stages}"
        return name + (f"_p{self.prefetch}" if self.prefetch else "")


# The best tile of a shape depends on its neighbours in the decode step (with programmatic dependent launch a
# kernel's tail overlaps the next one's start), not on the kernel timed alone, so start-up tunes each shape inside
# the captured step (engine/tuning.py) among these candidates: the tiles that came near a shape's best step in a
# sweep of Qwen3-8B's shapes, and two-warp variants of them (benchmarks/README.md).
CANDIDATE_TILES = [Tile(bn, bk, w, s) for bn, bk, w, s in (
    (32, 512, 4, 4), (16, 256, 2, 4), (32, 256, 4, 5), (64, 256, 4, 4), (32, 512, 8, 4), (32, 256, 4, 4),
    (64, 128, 4, 5), (32, 128, 2, 4), (64, 128, 4, 4), (16, 512, 4, 4), (32, 128, 4, 4), (32, 128, 4, 3),
    (16, 512, 4, 3), (32, 256, 2, 4), (16, 512, 2, 4), (32, 128, 2, 5), (64, 128, 2, 4))]
# For a shape not tuned (no graphs: eager decode): second-best or better for three of Qwen3-8B's four layer
# shapes in bf16; float32's twice-as-large tiles need a shallower pipeline to fit in shared memory.
DEFAULT_TILE = {2: Tile(32, 256, 4, 4), 4: Tile(16, 256, 4, 3)}
# A GEMV's weights do not depend on the kernel before it, so its first K tiles can be read before its PDL wait,
# while that kernel finishes. It pays for some shapes and loses for others (benchmarks/README.md), so start-up
# tries these on each shape's best tile rather than setting one.
PREFETCH_CHOICES = (1, 2)


def prefetch_variants(tile: Tile, k: int) -> list[Tile]:
    """The tile reading its first 1 or 2 K tiles of weights before the wait, where K has more than that."""
    return [replace(tile, prefetch=p) for p in PREFETCH_CHOICES if k // tile.block_k > p]


def tile_key(n: int, k: int, gated: bool, dtype: torch.dtype) -> tuple:
    """What a tile is chosen by: the product's shape (n output rows; 2n weight rows when gated) and dtype."""
    return (n, k, gated, str(dtype).removeprefix("torch."))


@triton.jit
def _dot(x, w, IEEE: tl.constexpr):
    if IEEE:  # float32 weights: exact products, not TF32
        return tl.dot(x, tl.trans(w), input_precision="ieee")
    return tl.dot(x, tl.trans(w))


@triton.jit(do_not_specialize=["M"])  # the row count changes with the batch; compiling per count is waste
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym,
                 K: tl.constexpr, M_PAD: tl.constexpr, GATED: tl.constexpr, IEEE: tl.constexpr,
                 USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_PAD)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    acc_up = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    if PREFETCH > 0:  # the weights do not depend on the kernel before: start reading them while it finishes
        rp = tl.arange(0, PREFETCH * BLOCK_K)
        wp_ptrs = w_ptr + rn[:, None] * stride_wn + rp[None, :]
        w_first = tl.load(wp_ptrs, mask=rn[:, None] < N, other=0.0)
        if GATED:
            u_first = tl.load(wp_ptrs + N * stride_wn, mask=rn[:, None] < N, other=0.0)
    gdc_enter(USE_PDL, LAUNCH_FIRST=True)  # see pdl.py
    if PREFETCH > 0:
        x_first = tl.load(x_ptr + rm[:, None] * stride_xm + rp[None, :], mask=rm[:, None] < M, other=0.0)
        acc += _dot(x_first, w_first, IEEE)
        if GATED:
            acc_up += _dot(x_first, u_first, IEEE)
    rk = PREFETCH * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    u_ptrs = w_ptrs + N * stride_wn  # GATED: the up rows sit N rows below the gate rows
    for _ in range(PREFETCH, K // BLOCK_K):
        x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
        acc += _dot(x, tl.load(w_ptrs, mask=rn[:, None] < N, other=0.0), IEEE)
        if GATED:
            acc_up += _dot(x, tl.load(u_ptrs, mask=rn[:, None] < N, other=0.0), IEEE)
            u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    store_rows(y_ptr, acc, acc_up, rm, rn, M, N, stride_ym, GATED)


@triton.jit
def store_rows(y_ptr, acc, acc_up, rm, rn, M, N, stride_ym, GATED: tl.constexpr):
    """The epilogue: y = acc, or with GATED SiLU(acc) * acc_up, rounded as HF rounds each projection, SiLU's
    output and the product to the model dtype."""
    dtype = y_ptr.dtype.element_ty
    if GATED:
        y = silu_mul_rounded(acc.to(dtype), acc_up.to(dtype))
    else:
        y = acc.to(dtype)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


MAX_ROWS = 16


def gemv(x: torch.Tensor, weight: torch.Tensor, gated: bool = False, tile: Tile | None = None,
         pdl: bool = False) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight[N, K].T -> [M, N]; with gated, weight is [2n, K] and the result is
    SiLU(x @ gate.T) * (x @ up.T), [M, n]. K must be a multiple of 512. `tile`: how to cut it (the plan's tuned
    tile, ExecutionPlan.gemv_tile), else the default for the weight's element size; `pdl`: see pdl.py."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    tile = tile or DEFAULT_TILE[weight.element_size()]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, tile.block_n),)](
        x, weight, y, m, n, x.stride(0), weight.stride(0), y.stride(0), K=k, M_PAD=16, GATED=gated,
        IEEE=x.dtype == torch.float32, USE_PDL=pdl, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        PREFETCH=tile.prefetch, launch_pdl=pdl, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return y


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.shape[0] <= MAX_ROWS and x.shape[1] % 512 == 0 and x.is_contiguous() and weight.is_contiguous()
