"""Prefill's products whose next step is elementwise, with that step in the epilogue, so that the raw product
never reaches memory to be read back: gate_up with SiLU(gate) * up (silu_mul reads the [rows, 2 x intermediate]
product and writes half of it again), and qkv with QK-norm, RoPE and the KV-cache store (what
rope.qk_norm_rope_store does after a plain product).

A persistent, TMA-fed Triton GEMM: one program per multiprocessor walks the output tiles. With `gated`, each TMA
load brings a block of gate rows and the matching block of up rows (a [2, BN, BK] box of the weight seen as
[2, N, K]), so one [BM, 2 BN] product holds matching tiles of both; the epilogue splits it and rounds as HF does.
With `rope`, BN is a whole number of heads and each tile lies in q, k or v: the epilogue normalises and rotates
each head of a q or k tile, and writes k and v tiles both to this step's k, v and to their cache slots.

On the H200 (benchmarks/probe_prefill_gemm.py) the plain product at best ties cuBLAS, so only the gated one is
used: it beats cuBLAS + silu_mul by 2-3 %. Triton 3.6 does not warp-specialize on Hopper (the loop's attribute
is accepted and leaves no trace in the compiled kernel), and an epilogue adding the residual stream, measured in
commit 28ad9bc, lost to cuBLAS and the fused add + RMSNorm kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import sm_count
from .pdl import PDL, gdc_enter


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


@triton.jit
def _qkv_epilogue(acc, off_m, off_n, M, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, qn_ptr, kn_ptr,
                  cos_ptr, sin_ptr, pos_ptr, slot_ptr, eps, Q, KV,
                  BM: tl.constexpr, BN: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """One [BM, BN] tile of the qkv product: QK-norm and RoPE on q and k heads (the numerics of
    rope.qk_norm_rope_store), then q out; k and v out and into their cache slots (slot -1: nowhere).
    Branch-free (v tiles compute a rotation they do not keep; stores are masked by the tile's part): Triton 3.6's
    loop flattening, which overlaps this with the next tile's first loads, fails on branches in the loop."""
    dtype = q_ptr.dtype.element_ty
    x = acc.to(dtype)  # HF rounds the product to the model dtype
    HALF: tl.constexpr = HEAD_DIM // 2
    is_q = off_n < Q
    is_v = off_n >= Q + KV
    rows = off_m + tl.arange(0, BM)
    in_rows = rows < M
    # each head's halves for rotate-half RoPE: [BM, heads in the tile, HALF]
    a, b = tl.split(tl.permute(tl.reshape(x, (BM, BN // HEAD_DIM, 2, HALF)), (0, 1, 3, 2)))
    a = a.to(tl.float32)
    b = b.to(tl.float32)
    d = tl.arange(0, HALF)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(a * a, axis=2) + tl.sum(b * b, axis=2)) / HEAD_DIM + eps)[:, :, None]
        w_ptr = tl.where(is_q, qn_ptr, kn_ptr)
        w1 = tl.load(w_ptr + d).to(tl.float32)[None, None, :]
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)[None, None, :]
        a = ((a * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        b = ((b * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    pos = tl.load(pos_ptr + rows, mask=in_rows, other=0)
    table = pos.to(tl.int64)[:, None, None] * HALF + d[None, None, :]
    cos = tl.load(cos_ptr + table)
    sin = tl.load(sin_ptr + table)
    o1 = (a * cos - b * sin).to(dtype)
    o2 = (b * cos + a * sin).to(dtype)
    out = tl.where(is_v, x, tl.reshape(tl.permute(tl.join(o1, o2), (0, 1, 3, 2)), (BM, BN)))
    cols = tl.arange(0, BN)[None, :]
    row64 = rows.to(tl.int64)[:, None]
    tl.store(q_ptr + row64 * Q + off_n + cols, out, mask=in_rows[:, None] & is_q)
    # k and v: this step's [M, KV] tensors and the cache's [slots, KV]
    col = tl.where(is_v, off_n - Q - KV, off_n - Q)
    kv_mask = in_rows[:, None] & (off_n >= Q)
    tl.store(tl.where(is_v, v_ptr, k_ptr) + row64 * KV + col + cols, out, mask=kv_mask)
    slot = tl.load(slot_ptr + rows, mask=in_rows & (off_n >= Q), other=-1)
    tl.store(tl.where(is_v, v_cache_ptr, k_cache_ptr) + slot.to(tl.int64)[:, None] * KV + col + cols, out,
             mask=kv_mask & (slot >= 0)[:, None])


# M is the prompt's length, and the index vectors' alignment changes with it (see rope.py): one compile serves
# every length.
@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _matmul_kernel(a_desc, b_desc, c_desc, M, N, K,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   NUM_SMS: tl.constexpr, GATED: tl.constexpr, IEEE: tl.constexpr,
                   USE_PDL: tl.constexpr,
                   # rope: the qkv epilogue's outputs and arguments (c_desc: None); unused otherwise
                   ROPE: tl.constexpr = False, q_ptr=None, k_ptr=None, v_ptr=None, k_cache_ptr=None, v_cache_ptr=None,
                   qn_ptr=None, kn_ptr=None, cos_ptr=None, sin_ptr=None, pos_ptr=None, slot_ptr=None, eps=0.0,
                   Q=0, KV=0, HEAD_DIM: tl.constexpr = 128, HAS_NORM: tl.constexpr = False):
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
        if ROPE:
            _qkv_epilogue(acc, off_m, off_n, M, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, qn_ptr, kn_ptr,
                          cos_ptr, sin_ptr, pos_ptr, slot_ptr, eps, Q, KV, BM, BN, HEAD_DIM, HAS_NORM)
        elif GATED:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
            g = gate.to(c_desc.dtype).to(tl.float32)  # HF rounds every product to the model dtype
            s = (g * tl.sigmoid(g)).to(c_desc.dtype)  # SiLU rounds before the product, as in HF
            out = (s.to(tl.float32) * up.to(c_desc.dtype).to(tl.float32)).to(c_desc.dtype)
            c_desc.store([off_m, off_n], out)
        else:
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


# The engine's tile for prefill's gated product, and the fewest rows it is used from: on the H200 (Qwen3-8B,
# benchmarks/probe_prefill_gemm.py, 2026-11-30) 319 / 635 / 1266 / 2547 us a layer at 1024 / 2048 / 4096 / 8192
# tokens against cuBLAS + silu_mul's 328 / 646 / 1298 / 2597; below 1024 rows it was not measured.
GATED_TILE = GemmTile(128, 128, 64, 3, 8, 16)
GATED_MIN_ROWS = 1024


def supports_gated(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether prefill's gated product runs here: TMA (compute capability 9.0+), bf16/fp16, enough rows, a tile
    of intermediate columns that divides the intermediate size, and rows that TMA can address (16-byte aligned)."""
    n = weight.shape[0] // 2
    return (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9 and x.dtype in (torch.bfloat16,
            torch.float16) and weight.dtype == x.dtype and x.shape[0] >= GATED_MIN_ROWS and n % GATED_TILE.bn == 0
            and x.shape[1] % 8 == 0 and x.is_contiguous() and weight.is_contiguous())


def matmul(x: torch.Tensor, weight: torch.Tensor, tile: GemmTile, gated: bool = False) -> torch.Tensor:
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
        USE_PDL=PDL.on, launch_pdl=PDL.on,
        num_warps=tile.warps, num_stages=tile.stages)
    return out


# The engine's tile for prefill's qkv product with QK-norm, RoPE and the KV store in its epilogue, and the fewest
# rows it is used from (benchmarks/probe_prefill_gemm.py, section qkv).
QKV_TILE = GemmTile(128, 256, 64, 3, 8, 16)
QKV_MIN_ROWS = 1024


def supports_qkv_rope(x: torch.Tensor, weight: torch.Tensor, q_size: int, kv_size: int, head_dim: int,
                      tile: GemmTile = QKV_TILE) -> bool:
    """Whether prefill's qkv product and QK-norm/RoPE/store run here: as supports_gated, with tiles of whole
    heads that never straddle q, k and v."""
    return (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9 and x.dtype in (torch.bfloat16,
            torch.float16) and weight.dtype == x.dtype and x.shape[0] >= QKV_MIN_ROWS and tile.bn % head_dim == 0
            and q_size % tile.bn == 0 and kv_size % tile.bn == 0 and x.shape[1] % 8 == 0 and x.is_contiguous()
            and weight.is_contiguous())


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, tile: GemmTile, n_heads: int, n_kv_heads: int, head_dim: int,
             q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor,
             sin: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] @ weight[(H + 2 KVH) x D, K].T, then what rope.qk_norm_rope_store(kv_out=True) does to it:
    returns q [M, H, D], k and v [M, KVH, D] (as stored), k and v also written to the cache at slot_mapping."""
    M, K = x.shape
    Q, KV = n_heads * head_dim, n_kv_heads * head_dim
    if tile.bn % head_dim or Q % tile.bn or KV % tile.bn or weight.shape[0] != Q + 2 * KV:
        raise ValueError(f"qkv_rope: a tile of {tile.bn} columns must hold whole heads of {head_dim} and divide "
                         f"q's {Q} and k's {KV} columns; the weight has {weight.shape[0]} rows")
    q = torch.empty(M, Q, dtype=x.dtype, device=x.device)
    k, v = torch.empty(M, KV, dtype=x.dtype, device=x.device), torch.empty(M, KV, dtype=x.dtype, device=x.device)
    a = TensorDescriptor.from_tensor(x, [tile.bm, tile.bk])
    b = TensorDescriptor.from_tensor(weight, [tile.bn, tile.bk])
    sms = sm_count(x.device)
    tiles = triton.cdiv(M, tile.bm) * triton.cdiv(Q + 2 * KV, tile.bn)
    has_norm = q_norm is not None
    _matmul_kernel[(min(sms, tiles),)](
        a, b, None, M, Q + 2 * KV, K, BM=tile.bm, BN=tile.bn, BK=tile.bk, GROUP_M=tile.group_m, NUM_SMS=sms,
        GATED=False, IEEE=x.dtype == torch.float32, USE_PDL=PDL.on, launch_pdl=PDL.on,
        num_warps=tile.warps, num_stages=tile.stages,
        ROPE=True, q_ptr=q, k_ptr=k, v_ptr=v, k_cache_ptr=k_cache, v_cache_ptr=v_cache,
        qn_ptr=q_norm if has_norm else x, kn_ptr=k_norm if has_norm else x, cos_ptr=cos, sin_ptr=sin,
        pos_ptr=positions, slot_ptr=slot_mapping, eps=eps, Q=Q, KV=KV, HEAD_DIM=head_dim, HAS_NORM=has_norm)
    return q.view(M, n_heads, head_dim), k.view(M, n_kv_heads, head_dim), v.view(M, n_kv_heads, head_dim)


def matmul_reference(x, weight, gated=False):
    y = x @ weight.T
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y
