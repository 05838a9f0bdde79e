"""Prefill's gate_up product with SiLU(gate) * up in its epilogue, so that the [rows, 2 x intermediate] product
never reaches memory (silu_mul reads it back and writes half of it again: pure memory traffic).

A persistent, TMA-fed Triton GEMM: one program per multiprocessor walks the output tiles. With `gated`, each TMA
load brings a block of gate rows and the matching block of up rows (a [2, BN, BK] box of the weight seen as
[2, N, K]), so one [BM, 2 BN] product holds matching tiles of both; the epilogue splits it and rounds as HF does.

The plain product at best ties cuBLAS, so only the gated one is used, where it beats cuBLAS + silu_mul. Triton
3.6 does not warp-specialize on Hopper (the loop's attribute is accepted and leaves no trace in the compiled
kernel), so every tile's epilogue runs between its products: two other epilogues lost to cuBLAS and the kernel
after it, adding the residual stream (cuBLAS adds it itself, with beta = 1: qwen3.residual_linear) and QK-norm +
RoPE + the KV store on qkv. (Measured: benchmarks/README.md.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import sm_count
from .activation import silu_mul_rounded
from .pdl import gdc_enter


@dataclass(frozen=True)
class GemmTile:
    """An output tile of BM x BN (BN per half when gated), BK columns per TMA load, `stages` loads in flight."""
    bm: int
    bn: int
    bk: int
    stages: int
    warps: int
    group_m: int = 8

    def __str__(self) -> str:
        return f"M{self.bm}_N{self.bn}_K{self.bk}_s{self.stages}_w{self.warps}_g{self.group_m}"


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row blocks share each weight tile while it is in L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile_id // in_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile_id % group_rows), (tile_id % in_group) // group_rows


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # float32: exact products, not TF32
        return tl.dot(a, b.T, acc, input_precision="ieee")
    return tl.dot(a, b.T, acc)


@triton.jit(do_not_specialize=["M"])  # M is the prompt's length: one compile serves every length
def _matmul_kernel(a_desc, b_desc, c_desc, M, N, K,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   NUM_SMS: tl.constexpr, GATED: tl.constexpr, IEEE: tl.constexpr,
                   USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)
    BW: tl.constexpr = 2 * BN if GATED else BN  # weight rows per tile: gated, BN of gate then BN of up
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    # The epilogue recomputes its tile's coordinates from its own counter, so that the pipeliner need not
    # carry values from the loads' side of the loop to the stores' side.
    tile_out = tl.program_id(0) - NUM_SMS
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BM, BW), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BK
            if GATED:  # one TMA load brings the gate block and the up block: a [2, BN, BK] box of [2, N, K]
                b = tl.reshape(b_desc.load([0, pid_n * BN, off_k]), (BW, BK))
            else:
                b = b_desc.load([pid_n * BN, off_k])
            acc = _dot(a_desc.load([pid_m * BM, off_k]), b, acc, IEEE)
        tile_out += NUM_SMS
        pid_m, pid_n = _tile_coords(tile_out, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        if GATED:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
            # HF rounds every product to the model dtype, then SiLU's output, then theirs
            out = silu_mul_rounded(gate.to(c_desc.dtype), up.to(c_desc.dtype))
        else:
            out = acc.to(c_desc.dtype)
        c_desc.store([off_m, off_n], out)


# The engine's tile for prefill's gated product, and the fewest rows it is used from: it beat cuBLAS + silu_mul
# from 1024 to 8192 rows; below 1024 it was not measured (benchmarks/README.md).
GATED_TILE = GemmTile(128, 128, 64, 3, 8, 16)
GATED_MIN_ROWS = 1024


def supports_gated(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether prefill's gated product runs here: TMA (compute capability 9.0+), bf16/fp16, enough rows, a tile
    of intermediate columns that divides the intermediate size, and rows that TMA can address (16-byte aligned)."""
    n = weight.shape[0] // 2
    return (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9 and x.dtype in (torch.bfloat16,
            torch.float16) and weight.dtype == x.dtype and x.shape[0] >= GATED_MIN_ROWS and n % GATED_TILE.bn == 0
            and x.shape[1] % 8 == 0 and x.is_contiguous() and weight.is_contiguous())


def matmul(x: torch.Tensor, weight: torch.Tensor, tile: GemmTile, gated: bool = False, pdl: bool = False
           ) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T; gated: weight is [gate; up] (2I rows) and the result SiLU(gate) * up [M, I]."""
    M, K = x.shape
    rows = weight.shape[0]
    N = rows // 2 if gated else rows
    if gated and N % tile.bn:
        raise ValueError(f"gated matmul: the intermediate size {N} is not a multiple of the tile's {tile.bn}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    a = TensorDescriptor.from_tensor(x, [tile.bm, tile.bk])
    if gated:  # [gate; up] seen as [2, N, K]
        w3 = weight.view(2, N, K)
        b = TensorDescriptor(w3, list(w3.shape), list(w3.stride()), [2, tile.bn, tile.bk])
    else:
        b = TensorDescriptor.from_tensor(weight, [tile.bn, tile.bk])
    c = TensorDescriptor.from_tensor(out, [tile.bm, tile.bn])
    sms = sm_count(x.device)
    tiles = triton.cdiv(M, tile.bm) * triton.cdiv(N, tile.bn)
    _matmul_kernel[(min(sms, tiles),)](
        a, b, c, M, N, K, BM=tile.bm, BN=tile.bn, BK=tile.bk, GROUP_M=tile.group_m, NUM_SMS=sms,
        GATED=gated, IEEE=x.dtype == torch.float32,
        USE_PDL=pdl, launch_pdl=pdl,
        num_warps=tile.warps, num_stages=tile.stages)
    return out


def matmul_reference(x, weight, gated=False):
    y = x @ weight.T
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y
