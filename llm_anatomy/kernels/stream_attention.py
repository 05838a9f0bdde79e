"""Batch-1 decode attention's split kernel as a hand-written CUDA kernel that reads the KV cache before its inputs
exist.

The Triton split kernel (decode_attention.py) starts reading keys and values once the QK-norm/RoPE kernel before
it has ended. Yet every position of the cache but the newest was written by earlier steps: only this step's query
and its newest key and value depend on the kernel before. Here each block (a KV head's share of the context)
issues the copies of its first tiles of keys and values into a ring of shared-memory stages (cp.async, gathered
through the block table a token at a time) before its PDL wait, and the tile that holds the newest position after
it. Eight warps then score and accumulate each tile on CUDA cores: a warp takes 32 / GROUP tokens a round, each
lane four of the head's 128 dimensions, and one transpose-reduction of shuffles gives each lane one (token, query
head) score. An online softmax per warp; the block's warps merge theirs in shared memory and write the split's
partials in the Triton kernel's format, which its merge kernel reads.

Numerics: float32 scores and sums from bf16 keys, values and queries; the probabilities stay float32 (the Triton
kernel rounds them to bf16 for its product with V).
"""

from __future__ import annotations

import ctypes

import torch

from .cuda import STREAM_HELPERS, compile_kernel, launch
from .pdl import PDL

class _Switch:
    on = False


STREAM = _Switch()  # whether decode_attention hands batch-1 splits to this kernel
STAGES = 4  # the ring's stages of TILE tokens' keys and values
THREADS = 256  # eight warps
HEAD_DIM = 128  # a lane takes four dimensions
SHARED_LIMIT = 227 * 1024

SOURCE = r"""
#define HEAD_DIM 128
#define GROUP %(GROUP)d                  // query heads a KV head serves (a power of two up to 32)
#define TILE %(TILE)d                    // tokens a stage
#define STAGES %(STAGES)d
#define PAGE %(PAGE)d                    // tokens a page of the cache
#define THREADS 256
#define WARPS 8
#define ROUND (32 / GROUP)               // tokens a warp scores at once: one (token, head) pair a lane
#define ROUNDS (TILE / WARPS / ROUND)
#define NEG_INF (-__int_as_float(0x7f800000))
""" + STREAM_HELPERS + r"""
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {  // bytes 0: zeros
    asm volatile("cp.async.cg.shared.global [%%0], [%%1], 16, %%2;" :: "r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Keys and values of tile i of [start, end) into its stage: 16 pieces of 16 bytes a row, gathered per token
// through the split's pages (in shared memory).
__device__ __forceinline__ void issue(int i, int start, int end, int tid, unsigned short* ks, unsigned short* vs,
                                      const unsigned short* k_cache, const unsigned short* v_cache,
                                      const int* pages, int first_page, long long stride_slot, long long head_offset) {
    unsigned short* kd = ks + (i %% STAGES) * TILE * HEAD_DIM;
    unsigned short* vd = vs + (i %% STAGES) * TILE * HEAD_DIM;
    #pragma unroll
    for (int c = tid; c < TILE * 16; c += THREADS) {
        const int t = c >> 4, piece = c & 15, tok = start + i * TILE + t;
        const bool ok = tok < end;
        const long long slot = ok ? (long long)pages[tok / PAGE - first_page] * PAGE + tok %% PAGE : 0;
        const long long off = slot * stride_slot + head_offset + piece * 8;
        cp_async16(kd + t * HEAD_DIM + piece * 8, k_cache + off, ok ? 16 : 0);
        cp_async16(vd + t * HEAD_DIM + piece * 8, v_cache + off, ok ? 16 : 0);
    }
}

// A step of the transpose-reduction of 32 lanes' 2W partial sums: each lane keeps the half of the pairs whose
// index agrees with its own in bit W, adding its partner's share of them (W from 16 down to 1: registers only).
template <int W> __device__ __forceinline__ void reduce_step(float* part, int lane) {
    const bool upper = lane & W;
    #pragma unroll
    for (int j = 0; j < W; ++j) {
        const float send = upper ? part[j] : part[j + W];
        const float keep = upper ? part[j + W] : part[j];
        part[j] = keep + __shfl_xor_sync(0xffffffffu, send, W);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
stream_attention(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k_cache,
                 const unsigned short* __restrict__ v_cache, const int* __restrict__ table,
                 const int* __restrict__ ctx_lens, float* __restrict__ acc_out, float* __restrict__ ml_out,
                 float scale_log2, long long stride_slot, long long stride_head, int splits) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned short* ks = (unsigned short*)smem;  // [STAGES][TILE][HEAD_DIM]
    unsigned short* vs = ks + STAGES * TILE * HEAD_DIM;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid %% 32;
    const int kvh = blockIdx.x / splits, s = blockIdx.x %% splits;
    // The context's length and the block table are written before the step, not by a kernel of it.
    const int ctx = ctx_lens[0];
    const int per = ((ctx + splits - 1) / splits + TILE - 1) / TILE * TILE;  // as the merge counts splits
    const int start = s * per, end = min(start + per, ctx);
    if (start >= end) return;  // a split past the context: the merge skips it
    asm volatile("griddepcontrol.launch_dependents;" :::);  // the merge: small, it waits beside this block
    const int tiles = (end - start + TILE - 1) / TILE;
    const long long head_offset = (long long)kvh * stride_head;
    int* pages = (int*)(vs + STAGES * TILE * HEAD_DIM);  // the split's pages of the block table
    const int first_page = start / PAGE;
    for (int i = tid; i <= (end - 1) / PAGE - first_page; i += THREADS) pages[i] = table[first_page + i];
    __syncthreads();
    // Before the wait: the tiles wholly before the newest position (ctx - 1), which this step's kernel before
    // writes. Then the rest of the first STAGES - 1, one commit group a tile in tile order.
    int issued = 0;
    while (issued < STAGES - 1 && issued < tiles && start + (issued + 1) * TILE <= ctx - 1) {
        issue(issued++, start, end, tid, ks, vs, k_cache, v_cache, pages, first_page, stride_slot, head_offset);
        commit();
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (; issued < STAGES - 1; ++issued) {
        if (issued < tiles)
            issue(issued, start, end, tid, ks, vs, k_cache, v_cache, pages, first_page, stride_slot, head_offset);
        commit();
    }
    float qf[GROUP][4];  // this lane's four dimensions of each query head, scaled for exp2
    #pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const uint2 v = __ldcg((const uint2*)(q + (kvh * GROUP + g) * HEAD_DIM + lane * 4));
        qf[g][0] = lo(v.x) * scale_log2; qf[g][1] = hi(v.x) * scale_log2;
        qf[g][2] = lo(v.y) * scale_log2; qf[g][3] = hi(v.y) * scale_log2;
    }
    float acc[GROUP][4] = {};
    float m = NEG_INF, l = 0.f;  // for head lane %% GROUP: the running max (base 2), this lane's share of the sum
    for (int i = 0; i < tiles; ++i) {
        asm volatile("cp.async.wait_group %%0;" :: "n"(STAGES - 2) : "memory");
        __syncthreads();  // tile i is in; every warp is done with the stage that tile i + STAGES - 1 refills
        if (i + STAGES - 1 < tiles)
            issue(i + STAGES - 1, start, end, tid, ks, vs, k_cache, v_cache, pages, first_page, stride_slot,
                  head_offset);
        commit();
        const unsigned short* kt = ks + (i %% STAGES) * TILE * HEAD_DIM;
        const unsigned short* vt = vs + (i %% STAGES) * TILE * HEAD_DIM;
        #pragma unroll
        for (int r = 0; r < ROUNDS; ++r) {
            const int t0 = (warp * ROUNDS + r) * ROUND;  // the round's first token in the tile
            float part[32];  // [token][head] partial dot products over this lane's dimensions
            #pragma unroll
            for (int t = 0; t < ROUND; ++t) {
                const uint2 kv = *(const uint2*)(kt + (t0 + t) * HEAD_DIM + lane * 4);
                const float k0 = lo(kv.x), k1 = hi(kv.x), k2 = lo(kv.y), k3 = hi(kv.y);
                #pragma unroll
                for (int g = 0; g < GROUP; ++g)
                    part[t * GROUP + g] = qf[g][0] * k0 + qf[g][1] * k1 + qf[g][2] * k2 + qf[g][3] * k3;
            }
            reduce_step<16>(part, lane);  // 31 shuffles: lane L ends with pair L's whole score
            reduce_step<8>(part, lane);
            reduce_step<4>(part, lane);
            reduce_step<2>(part, lane);
            reduce_step<1>(part, lane);
            const int tok = start + i * TILE + t0 + lane / GROUP;
            const float score = tok < end ? part[0] : NEG_INF;
            float top = score;  // the round's max of this lane's head
            #pragma unroll
            for (int w = GROUP; w < 32; w <<= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, w));
            const float m_new = fmaxf(m, top);
            const float alpha = m_new == NEG_INF ? 1.f : exp2f(m - m_new);
            const float p = m_new == NEG_INF ? 0.f : exp2f(score - m_new);
            l = l * alpha + p;
            m = m_new;
            #pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float a = __shfl_sync(0xffffffffu, alpha, g);
                #pragma unroll
                for (int j = 0; j < 4; ++j) acc[g][j] *= a;
            }
            #pragma unroll
            for (int t = 0; t < ROUND; ++t) {
                const uint2 vv = *(const uint2*)(vt + (t0 + t) * HEAD_DIM + lane * 4);
                const float v0 = lo(vv.x), v1 = hi(vv.x), v2 = lo(vv.y), v3 = hi(vv.y);
                #pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    const float pg = __shfl_sync(0xffffffffu, p, t * GROUP + g);
                    acc[g][0] += pg * v0; acc[g][1] += pg * v1; acc[g][2] += pg * v2; acc[g][3] += pg * v3;
                }
            }
        }
    }
    // The warps' softmaxes merged in shared memory (the ring is free once every copy has landed).
    #pragma unroll
    for (int w = GROUP; w < 32; w <<= 1) l += __shfl_xor_sync(0xffffffffu, l, w);
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    float* warp_m = (float*)smem;                   // [WARPS][GROUP]
    float* warp_l = warp_m + WARPS * GROUP;         // [WARPS][GROUP]
    float* warp_acc = warp_l + WARPS * GROUP;       // [WARPS][GROUP][HEAD_DIM]
    if (lane < GROUP) { warp_m[warp * GROUP + lane] = m; warp_l[warp * GROUP + lane] = l; }
    #pragma unroll
    for (int g = 0; g < GROUP; ++g)
        #pragma unroll
        for (int j = 0; j < 4; ++j) warp_acc[(warp * GROUP + g) * HEAD_DIM + lane * 4 + j] = acc[g][j];
    __syncthreads();
    for (int e = tid; e < GROUP * HEAD_DIM; e += THREADS) {
        const int g = e / HEAD_DIM, d = e %% HEAD_DIM;
        float top = NEG_INF;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_m[w * GROUP + g]);
        float sum = 0.f, out = 0.f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float mw = warp_m[w * GROUP + g];
            const float f = mw == NEG_INF ? 0.f : exp2f(mw - top);
            sum += warp_l[w * GROUP + g] * f;
            out += warp_acc[(w * GROUP + g) * HEAD_DIM + d] * f;
        }
        const int row = (kvh * GROUP + g) * splits + s;  // [head][split], as the Triton kernel writes
        acc_out[(long long)row * HEAD_DIM + d] = out;
        if (d == 0) { ml_out[row * 2] = top * 0.6931471805599453f; ml_out[row * 2 + 1] = sum; }
    }
}
"""


def source(group: int, tile: int, stages: int, page: int) -> str:
    return SOURCE % {"GROUP": group, "TILE": tile, "STAGES": stages, "PAGE": page}


def shared_bytes(tile: int, stages: int, group: int, pages: int = 0) -> int:
    """The ring (keys and values), or the warps' merge if larger; then a split's `pages` page numbers."""
    return max(stages * tile * HEAD_DIM * 2 * 2, (8 * group * (HEAD_DIM + 2)) * 4) + 4 * pages


def split_pages(table_width: int, page: int, splits: int, tile: int) -> int:
    """The most pages a split's tokens span, for a block table of table_width pages: its tokens, a whole number
    of tiles of at most table_width x page / splits (rounded up), start anywhere in a page."""
    return (-(-table_width * page // splits) + tile) // page + 2


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, splits: int,
             tile: int, stages: int) -> bool:
    """One bf16 query row on a Hopper-or-later GPU, head_dim 128, a power-of-two GQA group that a round of
    32 / group tokens per warp divides the tile into, K and V caches laid out alike with 16-byte rows, and the
    ring with the split's pages within a block's shared memory."""
    batch, n_heads, head_dim = q.shape
    n_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = n_heads // n_kv_heads
    return (batch == 1 and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9
            and q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16 and head_dim == HEAD_DIM
            and n_heads == group * n_kv_heads and group in (1, 2, 4, 8, 16, 32) and q.is_contiguous()
            and tile % (8 * (32 // group)) == 0 and stages >= 2
            and shared_bytes(tile, stages, group, split_pages(block_tables.shape[1], page, splits, tile)) <= SHARED_LIMIT
            and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
            and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
            and k_cache.stride(0) == page * k_cache.stride(1) and k_cache.stride(2) % 8 == 0
            and k_cache.stride(1) % 8 == 0 and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0)


def split_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, splits: int, tile: int, stages: int,
                    acc: torch.Tensor, ml: torch.Tensor) -> None:
    """The split kernel's work for one sequence (see supports): acc [1, H, splits, D] and ml [1, H, splits, 2]
    receive each split's unnormalised output and (max, sum) as decode_attention's split kernel writes them, for
    its merge kernel with BLOCK_N = tile."""
    n_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = q.shape[1] // n_kv_heads
    with torch.cuda.device(q.device):
        kernel = compile_kernel(source(group, tile, stages, page), "stream_attention", q.device.index, SHARED_LIMIT)
        pages = split_pages(block_tables.shape[1], page, splits, tile)
        launch(kernel, n_kv_heads * splits, THREADS,
               [q, k_cache, v_cache, block_tables, context_lens, acc, ml, float(scale * 1.4426950408889634),
                ctypes.c_longlong(k_cache.stride(1)), ctypes.c_longlong(k_cache.stride(2)), splits],
               pdl=PDL.on, shared=shared_bytes(tile, stages, group, pages))
