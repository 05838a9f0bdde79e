"""Products over fp8 e4m3 weights with float32 scales: the decode GEMV (up to 16 rows) and, from the same kernel with
a grid over rows, the matmul of a prefill where torch._scaled_mm does not serve (block scales, see models/quant.py).

Like the bf16 GEMV (gemv.py), a program streams [BLOCK_N, BLOCK_K] weight tiles through tl.dot, rows padded to
16 for the tensor cores; the weights are half the bytes. Each tile is converted to the activations' dtype in
registers (exact: every e4m3 value is a bf16 value) and multiplied by the unquantized activations (W8A16), so the
only error is the weights' own. The scales apply to the float32 sums: per output channel once at the end, per
block of weight_block_size after each block of columns (the tile's columns are cut into sub-tiles of one scale
block each). With `gated` the weight is gate_up = [gate; up] and the output SiLU(gate) * up, rounded as HF
rounds it (gemv.store_rows).

w8a8_gemv is the decode GEMV of per-channel weights where the rows come quantized per token (kernels/fp8_quant.py):
the e4m3 tiles of both go to the tensor cores as they are, with no conversion in registers, which is what bounds
the W8A16 kernel above (benchmarks/README.md has the figures). The weight rows are the dot's M side and the
activation rows, padded to 16, its N side ("swap AB"), so that a 64-row weight tile takes Hopper's warpgroup MMA.
Each K block's dot starts from zero and is added to float32 sums: Hopper's fp8 MMA accumulates with fewer bits
than float32, and a dot that carried the sum across all of K would lose them (DeepSeek-V3's technical report).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from .gemv import store_rows
from .pdl import gdc_enter

FP8 = torch.float8_e4m3fn
MAX_ROWS = 16  # the GEMV's rows; more go to fp8_matmul


@dataclass(frozen=True)
class Tile:
    """BLOCK_M activation rows x BLOCK_N weight rows a program, BLOCK_K columns a step."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"M{self.block_m}_N{self.block_n}_K{self.block_k}_w{self.num_warps}_s{self.num_stages}"


# Starting points, not tuned on a GPU yet: the GEMV's tile holds, once converted, as many bf16 weights as the bf16
# GEMV's default tile (gemv.DEFAULT_TILE: 32 x 256), so registers hold the same; the matmul's is a plain 128 x 128.
GEMV_TILE = Tile(16, 32, 256, 4, 4)
MATMUL_TILE = Tile(128, 128, 128, 8, 3)
# float32 activations take four times a bf16 tile's shared memory a stage: half the rows fit in a Hopper block's
MATMUL_TILE_F32 = Tile(64, 128, 128, 8, 3)


def matmul_tile(dtype: torch.dtype) -> Tile:
    return MATMUL_TILE_F32 if dtype == torch.float32 else MATMUL_TILE


@triton.jit
def _dot(x, w, IEEE: tl.constexpr):
    if IEEE:  # float32 activations: exact products, not TF32
        return tl.dot(x, tl.trans(w), input_precision="ieee")
    return tl.dot(x, tl.trans(w))


@triton.jit
def _block_sum(x_ptr, w_ptr, s_ptr, rm, rn, k, M, N, stride_xm, stride_wn, stride_sn, BLOCKWISE: tl.constexpr,
               SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, SUB_K: tl.constexpr, IEEE: tl.constexpr):
    """x[rm, k:k+SUB_K] @ w[rn, k:k+SUB_K]^T in float32, times the block's scale of each row when BLOCKWISE."""
    rk = k + tl.arange(0, SUB_K)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=rm[:, None] < M, other=0.0)
    w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=rn[:, None] < N, other=0.0)
    part = _dot(x, w.to(x.dtype), IEEE)
    if BLOCKWISE:
        scale = tl.load(s_ptr + (rn // SCALE_ROWS) * stride_sn + k // SCALE_COLS, mask=rn < N, other=0.0)
        part = part * scale[None, :]
    return part


# The row count changes with the batch: compiling per count is waste. ("gemv" in the name: the kernel probe counts
# it with the matrix products.)
@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_sn, stride_ym,
                K: tl.constexpr, GATED: tl.constexpr, IEEE: tl.constexpr, BLOCKWISE: tl.constexpr,
                SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, USE_PDL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    gdc_enter(USE_PDL)  # see pdl.py
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // SUB_K):
            k = k0 + j * SUB_K
            acc += _block_sum(x_ptr, w_ptr, s_ptr, rm, rn, k, M, N, stride_xm, stride_wn, stride_sn,
                              BLOCKWISE, SCALE_ROWS, SCALE_COLS, SUB_K, IEEE)
            if GATED:  # the up rows sit N rows below the gate rows (rows rn + N of 2N), their scales' rows too
                acc_up += _block_sum(x_ptr, w_ptr, s_ptr, rm, rn + N, k, M, 2 * N, stride_xm, stride_wn,
                                     stride_sn, BLOCKWISE, SCALE_ROWS, SCALE_COLS, SUB_K, IEEE)
    if not BLOCKWISE:  # one scale per output channel: applied once, to the whole sum
        acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(s_ptr + N + rn, mask=rn < N, other=0.0)[None, :]
    store_rows(y_ptr, acc, acc_up, rm, rn, M, N, stride_ym, GATED)


# Measured on an H200 for Qwen3-8B's shapes (benchmarks/README.md): 64 weight rows a program; gate_up's two halves
# take longer K steps, a long K (down_proj) a deeper pipeline.
W8A8_TILE = Tile(16, 64, 128, 4, 4)
W8A8_TILE_GATED = Tile(16, 64, 256, 4, 3)
W8A8_TILE_LONG_K = Tile(16, 64, 128, 4, 8)
LONG_K = 8192


def w8a8_tile(k: int, gated: bool) -> Tile:
    return W8A8_TILE_GATED if gated else W8A8_TILE_LONG_K if k >= LONG_K else W8A8_TILE


@triton.jit
def _w8a8_block(xq, w_ptr, rn, rk, N, stride_wn):
    w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=rn[:, None] < N, other=0.0)
    return tl.dot(w, tl.trans(xq))  # [BLOCK_N, 16], from zero: see the module's docstring


@triton.jit(do_not_specialize=["M"])
def _w8a8_gemv_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym,
                      K: tl.constexpr, GATED: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    acc_up = tl.zeros([BLOCK_N, 16], tl.float32)
    gdc_enter(USE_PDL)  # see pdl.py
    for k in range(0, K, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        xq = tl.load(xq_ptr + rm[:, None] * stride_xm + rk[None, :], mask=rm[:, None] < M, other=0.0)
        acc += _w8a8_block(xq, w_ptr, rn, rk, N, stride_wn)
        if GATED:  # the up rows sit N rows below the gate rows, their scales too
            acc_up += _w8a8_block(xq, w_ptr, rn + N, rk, 2 * N, stride_wn)
    x_scale = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)[None, :]
    acc = acc * tl.load(ws_ptr + rn, mask=rn < N, other=0.0)[:, None] * x_scale
    if GATED:
        acc_up = acc_up * tl.load(ws_ptr + N + rn, mask=rn < N, other=0.0)[:, None] * x_scale
    store_rows(y_ptr, tl.trans(acc), tl.trans(acc_up), rm, rn, M, N, stride_ym, GATED)


def supports_w8a8(xq: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether w8a8_gemv takes these quantized rows: up to 16, e4m3 like the weight, K a multiple of 256 (the
    longest K step of the tiles), on a GPU with fp8 tensor cores (or the interpreter)."""
    return (xq.dim() == 2 and xq.shape[0] <= MAX_ROWS and xq.dtype == FP8 and weight.dtype == FP8
            and xq.shape[1] == weight.shape[1] and xq.shape[1] % W8A8_TILE_GATED.block_k == 0
            and xq.stride(1) == 1 and weight.is_contiguous() and _has_fp8(xq.device))


def w8a8_gemv(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              dtype: torch.dtype, gated: bool = False, tile: Tile | None = None, pdl: bool = False) -> torch.Tensor:
    """(xq [M, K] e4m3 x x_scale [M, 1]) @ (weight [N, K] e4m3 x scale [N] per channel)^T -> [M, N] in `dtype`
    (M <= 16); with gated, weight = [gate; up] and the result SiLU(gate) * up, [M, N / 2]. `pdl`: see pdl.py."""
    m, k = xq.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    tile = tile or w8a8_tile(k, gated)
    y = torch.empty(m, n, dtype=dtype, device=xq.device)
    _w8a8_gemv_kernel[(triton.cdiv(n, tile.block_n),)](
        xq, x_scale.reshape(m).contiguous(), weight, scale, y, m, n, xq.stride(0), weight.stride(0), y.stride(0),
        K=k, GATED=gated, USE_PDL=pdl, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, launch_pdl=pdl, num_warps=tile.num_warps,
        num_stages=tile.num_stages)
    return y


def _sub_k(tile: Tile, block: tuple[int, int] | None) -> int | None:
    """Columns a dot takes at once: the tile's, or one scale block's where the tile spans several; None where
    the tile and the block do not nest."""
    if block is None:
        return tile.block_k
    cols = block[1]
    if tile.block_k % cols == 0 and cols >= 16:
        return cols
    return tile.block_k if cols % tile.block_k == 0 else None


@cache
def _has_fp8(device: torch.device) -> bool:
    """Triton's e4m3 needs Ada (sm_89) or later; the interpreter (a CPU tensor) has it."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _supports(x: torch.Tensor, weight: torch.Tensor, block, tile: Tile) -> bool:
    if not (x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and weight.dtype == FP8
            and x.shape[1] == weight.shape[1] and x.is_contiguous() and weight.is_contiguous()):
        return False
    return _has_fp8(x.device) and x.shape[1] % tile.block_k == 0 and _sub_k(tile, block) is not None


def supports(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None = None,
             tile: Tile = GEMV_TILE) -> bool:
    """Whether fp8_gemv takes this product: up to 16 rows, K a multiple of the tile's columns."""
    return x.shape[0] <= MAX_ROWS and _supports(x, weight, block, tile)


def supports_matmul(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None = None,
                    tile: Tile | None = None) -> bool:
    return _supports(x, weight, block, tile or matmul_tile(x.dtype))


def _launch(x, weight, scale, block, gated: bool, tile: Tile, pdl: bool) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    scale_rows, scale_cols = block or (1, k)
    grid = (triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m))
    _fp8_gemv_kernel[grid](x, weight, scale, y, m, n, x.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
                      K=k, GATED=gated, IEEE=x.dtype == torch.float32, BLOCKWISE=block is not None,
                      SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols, USE_PDL=pdl, BLOCK_M=tile.block_m,
                      BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SUB_K=_sub_k(tile, block), launch_pdl=pdl,
                      num_warps=tile.num_warps, num_stages=tile.num_stages)
    return y


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
             gated: bool = False, tile: Tile = GEMV_TILE, pdl: bool = False) -> torch.Tensor:
    """x [M, K] (M <= 16) @ dequantized(weight [N, K] fp8, scale)^T -> [M, N] in x's dtype; scale is [N] (per
    channel) or [ceil(N / block[0]), ceil(K / block[1])]. With gated, weight is [2n, K] = [gate; up] and the result
    SiLU(x @ gate^T) * (x @ up^T), [M, n]. `pdl`: see pdl.py."""
    return _launch(x, weight, scale, block, gated, tile, pdl)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
               gated: bool = False, tile: Tile | None = None, pdl: bool = False) -> torch.Tensor:
    """fp8_gemv for any number of rows (a prefill): programs over tiles of rows too (the tile: matmul_tile's for
    the activations' dtype unless given)."""
    return _launch(x, weight, scale, block, gated, tile or matmul_tile(x.dtype), pdl)


def fp8_matmul_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         block: tuple[int, int] | None = None, gated: bool = False) -> torch.Tensor:
    """The same product in PyTorch, float32 throughout, rounded to x's dtype as the kernel's epilogue rounds."""
    n_rows, k = weight.shape
    if block is None:
        w = weight.float() * scale.float()[:, None]
    else:  # one scale per block of rows x columns
        w = weight.float() * scale.float().repeat_interleave(block[0], 0)[:n_rows].repeat_interleave(block[1], 1)[:, :k]
    y = x.float() @ w.t()
    if not gated:
        return y.to(x.dtype)
    n, dtype = y.shape[1] // 2, x.dtype
    g = y[:, :n].to(dtype).float()
    s = (g * torch.sigmoid(g)).to(dtype).float()
    return (s * y[:, n:].to(dtype).float()).to(dtype)
