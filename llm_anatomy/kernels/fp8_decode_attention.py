"""Paged decode attention over an fp8 e4m3 KV cache as a hand-written CUDA kernel: tensor-core fragments loaded
straight from global memory, no shared memory.

The Triton kernel (decode_attention.py) converts the cache to fp16 in registers in a blocked layout, and Triton then
moves K and V through shared memory into tl.dot's operand layouts (V, the transposed operand, worst). Here one warp
takes one (sequence, KV head, split) and each lane loads exactly the cache bytes its mma.sync fragments need, in
16-byte pieces, converted by `cvt.rn.f16x2.e4m3x2` (exact, NaN kept) as they go into the fragment registers:

- Scores as S^T = K Q^T (m16n8k16, f16 in, f32 out): 16 tokens are the MMA's rows and the GQA group (2..8 query
  heads in Qwen3) its 8 columns, so no group is padded to 16. The head dimension is permuted alike in K and Q
  (`k_dim`) so that each lane's A fragments for all 8 k-steps are 32 consecutive bytes of each of its two token rows.
- The tile's token rows are permuted (`tile_token`) so that the logical tokens one lane holds in the P.V MMA's A
  fragment, V^T, are 4 consecutive physical tokens: a lane loads 16 bytes of each of 4 token rows and transposes the
  4x4 byte blocks with prmt. The output rows (the head dimension) are permuted (`out_dim`) so that a lane's rows of
  all 8 m-tiles are 16 consecutive values of the head.
- The probabilities go from the scores' C fragments to P.V's B fragment with movmatrix.trans (no shared memory).

Numerics as the Triton fp8 path: the bf16 query in fp16, the cache values exact in fp16, float32 sums, softmax in
float32 (exp2 with log2(e) folded into the scale), the probabilities in fp16 for the second MMA. With one split the
kernel writes the output (bf16); with several it writes the partials the Triton merge kernel reads, and that merge
runs after it. The layout maps are written out below as small Python functions that the kernel's indexing mirrors
(tests/test_fp8_decode_attention.py emulates the fragments with them). An engine's plan chooses it for an fp8 cache
(engine/plan.py, DecodeAttentionPlan.fp8_cuda); the figures are in benchmarks/README.md.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

import torch
import triton

from . import sm_count
from .cuda import compile_kernel, launch
from .decode_attention import _decode_attention_merge_kernel, merge_chunks, merge_warps

HEAD_DIM = 128
MAX_GROUP = 8  # query heads of a KV head: the MMA's n
WARPS = 4  # a block's warps, one (sequence, KV head, split) each
# 16-token tiles a warp's iteration takes (more bytes in flight a load round), and whether it loads all of the next
# iteration's tiles before converting this one's (more again, at twice the registers for the raw bytes); without,
# the next iteration's K is loaded once this one's scores are computed, and its V once this one's P.V products are.
TILES, PREFETCH = 2, False
MIN_BLOCKS = 3  # blocks a multiprocessor must fit (__launch_bounds__): 3 of TILES = 2 fit without spilling


# A warp per split is a quarter of a Triton program's warps: decode_attention.default_splits' two programs per
# multiprocessor leave this kernel 8 warps a multiprocessor at batch 1 (and fewer for batches that default_splits
# gives one split), too few loads in flight to read at full bandwidth. `warp_splits` aims at WARPS_PER_SM instead,
# without cutting a context into splits shorter than MIN_SPLIT_TOKENS (each split's partials cost the merge). The
# entry point's default (splits=None) is warp_splits' count for any context; short contexts past it find their
# splits empty, which leave at once, and the merge reads only the splits that hold tokens.
WARPS_PER_SM, MIN_SPLIT_TOKENS, MAX_SPLITS = 16, 128, 128


def warp_splits(batch: int, n_kv_heads: int, sm_count: int, context: int) -> int:
    """Splits for this kernel that give every multiprocessor about WARPS_PER_SM warps over `context` tokens (the
    longest sequence's): at least one, no split shorter than MIN_SPLIT_TOKENS, at most MAX_SPLITS (the merge holds
    its splits' partials in registers, merge_warps)."""
    want = triton.cdiv(WARPS_PER_SM * sm_count, batch * n_kv_heads)
    return max(1, min(want, context // MIN_SPLIT_TOKENS, MAX_SPLITS))


# The layout maps (lane = 4 * g + t, g = lane >> 2 in 0..7, t = lane & 3 in 0..3); the CUDA source follows them.
def k_dim(t: int, step: int, j: int) -> int:
    """Head dimension of the score MMA's k index 2t, 2t+1, 2t+8, 2t+9 (j = 0..3) of k-step `step` (0..7), in K and Q
    alike: the 4 consecutive bytes 32t + 4 step + j, so that lane t's 8 k-steps are bytes [32t, 32t + 32) of a row."""
    return 32 * t + 4 * step + j


def tile_token(row: int) -> int:
    """Physical token (0..15, within the tile) of the score MMA's row `row` = P.V's logical token `row`: 2t + j ->
    4t + j and 2t + 8 + j -> 4t + 2 + j, so that P.V's lane t holds the physical tokens 4t..4t+3."""
    t, j = (row % 8) // 2, row % 2
    return 4 * t + j + (2 if row >= 8 else 0)


def out_dim(m_tile: int, row: int) -> int:
    """Head dimension of the P.V MMA's row `row` (0..15) of m-tile `m_tile` (0..7): row g -> 16g + 2m, row g + 8 ->
    16g + 2m + 1, so that lane g's rows of all 8 m-tiles are the 16 values from 16g."""
    return 16 * (row % 8) + 2 * m_tile + (row // 8)


SOURCE = r"""
#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)
__device__ __forceinline__ unsigned f16x2_of_e4m3x2(unsigned v) {  // bytes 0, 1 of v -> fp16 halves low, high
    unsigned r;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(r) : "r"(v));
    return r;
}
__device__ __forceinline__ unsigned f16x2_of_high_e4m3x2(unsigned v) {  // bytes 2, 3 of v
    unsigned r;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, hi; }" : "=r"(r) : "r"(v));
    return r;
}
__device__ __forceinline__ unsigned f16x2(float lo, float hi) {  // cvt puts its first operand in the upper half
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ unsigned f16x2_of_bf16x2(unsigned w) {
    return f16x2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
__device__ __forceinline__ unsigned rne(float f) {  // float -> bf16 bits, round to nearest even
    unsigned u = __float_as_uint(f);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ float ex2(float x) {  // 2^x; 2^-inf = 0
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ unsigned transpose8x8(unsigned v) {
    unsigned r;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(v));
    return r;
}
// c += A (16 x 16, rows g and g + 8 of lane 4g + t) . B (16 x 8, column g), f16 in, f32 sums
__device__ __forceinline__ void mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                    unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint4 load16(const unsigned char* p, bool valid) {
    return valid ? *(const uint4*)p : make_uint4(0, 0, 0, 0);
}

// The slot of token n0 + (lane mod TOKENS) of the sequence, or 0 past the split's end (its table entry may not exist)
__device__ __forceinline__ int slot_of(const int* table, int n0, int end, int page_shift, int lane) {
    const int tok = n0 + lane % TOKENS;
    return tok < end ? (table[tok >> page_shift] << page_shift) | (tok & ((1 << page_shift) - 1)) : 0;
}

// One iteration's raw cache bytes. K: tile j's rows tile_token(g) and tile_token(g + 8), bytes [32t, 32t + 32) of
// each (k_dim); V: the tile's physical tokens 4t..4t+3, bytes [16g, 16g + 16) of each (out_dim). A K row past the
// split's end is read from slot 0 (always there, and in L2 after the first such read; its score is masked to -inf
// whatever its bytes), also for the iteration after the last, which costs a warp 2 KB read from L2 and saves the
// predicates; a V row there is zeros, not read (its bytes could be NaN, and 0 x NaN is NaN).
struct Raw { uint4 k[TILES][2][2]; uint4 v[TILES][4]; };

__device__ __forceinline__ void load_k(Raw& r, const unsigned char* k_lane, int stride_slot, int slot, int g) {
    #pragma unroll
    for (int j = 0; j < TILES; ++j) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {  // rows g and g + 8 of the score MMA
            const int tok = 16 * j + 4 * (g >> 1) + (g & 1) + 2 * h;
            const unsigned long long off = (unsigned long long)(unsigned)__shfl_sync(FULL, slot, tok) * (unsigned)stride_slot;
            r.k[j][h][0] = *(const uint4*)(k_lane + off);
            r.k[j][h][1] = *(const uint4*)(k_lane + off + 16);
        }
    }
}
__device__ __forceinline__ void load_v(Raw& r, const unsigned char* v_lane, int stride_slot, int slot, int n0, int end,
                                       int t) {
    #pragma unroll
    for (int j = 0; j < TILES; ++j) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int tok = 16 * j + 4 * t + i;
            const unsigned long long off = (unsigned long long)(unsigned)__shfl_sync(FULL, slot, tok) * (unsigned)stride_slot;
            r.v[j][i] = load16(v_lane + off, n0 + tok < end);
        }
    }
}

__device__ __forceinline__ unsigned word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

extern "C" __global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS)
fp8_decode_attention(const unsigned short* q, const unsigned char* k_cache, const unsigned char* v_cache,
                     const int* block_tables, const int* context_lens, float* acc_out, float* ml_out,
                     unsigned short* out, float scale_log2, int batch, int n_kv_heads, int splits, int stride_qb,
                     int stride_qh, int stride_ob, int stride_oh, int stride_tb, int stride_slot,
                     long long stride_head, int page_shift) {
    // The next kernel (the merge, or whatever follows) may launch now and wait: pdl.py's LAUNCH_FIRST
    asm volatile("griddepcontrol.launch_dependents;" :::);
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int w = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (w >= batch * n_kv_heads * splits) return;
    const int s = w % splits, kvh = (w / splits) % n_kv_heads, b = w / (splits * n_kv_heads);
    // The lengths and block tables are written before the step, not by a kernel of it: read before the wait
    const int ctx = context_lens[b];
    const int per_split = ((ctx + splits - 1) / splits + TOKENS - 1) / TOKENS * TOKENS;  // decode_attention._split_len
    const int start = s * per_split, end = min(start + per_split, ctx);
    const int h0 = kvh * GROUP + 2 * t;  // this lane's output heads: h0, h0 + 1 (where < GROUP of them)
    if (start >= ctx) {  // a split past the context: the merge skips it; one split of a padded row: zeros
#if DIRECT
        asm volatile("griddepcontrol.wait;" ::: "memory");
        #pragma unroll
        for (int h = 0; h < 2; ++h)
            if (2 * t + h < GROUP) {
                uint4* o = (uint4*)(out + (long long)b * stride_ob + (long long)(h0 + h) * stride_oh + 16 * g);
                o[0] = o[1] = make_uint4(0, 0, 0, 0);
            }
#endif
        return;
    }
    const int* table = block_tables + (long long)b * stride_tb;
    int slot = slot_of(table, start, end, page_shift, lane);
    asm volatile("griddepcontrol.wait;" ::: "memory");  // q, K and V are the kernels' before

    // Q^T as the B fragments of the 8 k-steps: column g = head kvh * GROUP + g (zeros past the group), k as k_dim
    unsigned qb[8][2];
    {
        uint4 raw[4] = {};
        if (g < GROUP) {
            const uint4* qp = (const uint4*)(q + (long long)b * stride_qb + (long long)(kvh * GROUP + g) * stride_qh + 32 * t);
            #pragma unroll
            for (int c = 0; c < 4; ++c) raw[c] = qp[c];
        }
        #pragma unroll
        for (int c = 0; c < 4; ++c) {  // 8 bf16 of head dims 32t + 8c: k-steps 2c and 2c + 1
            qb[2 * c][0] = f16x2_of_bf16x2(raw[c].x);
            qb[2 * c][1] = f16x2_of_bf16x2(raw[c].y);
            qb[2 * c + 1][0] = f16x2_of_bf16x2(raw[c].z);
            qb[2 * c + 1][1] = f16x2_of_bf16x2(raw[c].w);
        }
    }
    const unsigned char* k_lane = k_cache + kvh * stride_head + 32 * t;  // this lane's bytes of a token's head row
    const unsigned char* v_lane = v_cache + kvh * stride_head + 16 * g;
    // O^T's C fragments: m-tile m, rows out_dim(m, g) = 16g + 2m and 16g + 2m + 1, columns heads 2t, 2t + 1
    float o[8][4];
    #pragma unroll
    for (int m = 0; m < 8; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};  // l: this lane's rows only, summed at the end

    Raw cur;
    load_k(cur, k_lane, stride_slot, slot, g);
    load_v(cur, v_lane, stride_slot, slot, start, end, t);
    slot = slot_of(table, start + TOKENS, end, page_shift, lane);
    for (int n0 = start; n0 < end; n0 += TOKENS) {
#if PREFETCH
        Raw next;
        load_k(next, k_lane, stride_slot, slot, g);
        load_v(next, v_lane, stride_slot, slot, n0 + TOKENS, end, t);
        slot = slot_of(table, n0 + 2 * TOKENS, end, page_shift, lane);
#endif
        // S^T = K Q^T, scaled to log2 units; rows past the end -inf
        float sc[TILES][4];
        #pragma unroll
        for (int j = 0; j < TILES; ++j) {
            float c[4] = {0.f, 0.f, 0.f, 0.f};
            #pragma unroll
            for (int k = 0; k < 8; ++k) {
                const unsigned lo = word(cur.k[j][0][k >> 2], k & 3), hi = word(cur.k[j][1][k >> 2], k & 3);
                mma(c, f16x2_of_e4m3x2(lo), f16x2_of_e4m3x2(hi), f16x2_of_high_e4m3x2(lo), f16x2_of_high_e4m3x2(hi),
                    qb[k][0], qb[k][1]);
            }
            const int tok = n0 + 16 * j + 4 * (g >> 1) + (g & 1);  // row g; row g + 8 is tok + 2
            sc[j][0] = tok < end ? c[0] * scale_log2 : NEG_INF;
            sc[j][1] = tok < end ? c[1] * scale_log2 : NEG_INF;
            sc[j][2] = tok + 2 < end ? c[2] * scale_log2 : NEG_INF;
            sc[j][3] = tok + 2 < end ? c[3] * scale_log2 : NEG_INF;
        }
#if !PREFETCH  // K is in the MMAs' registers: its bytes' registers take the next iteration's K while this one goes on
        load_k(cur, k_lane, stride_slot, slot, g);
#endif
        // online softmax per head (column): this lane's heads 2t (c0, c2) and 2t + 1 (c1, c3), max over all 8 g
        float alpha[2];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = m_run[h];
            #pragma unroll
            for (int j = 0; j < TILES; ++j) mx = fmaxf(mx, fmaxf(sc[j][h], sc[j][h + 2]));
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 16));
            const float base = mx == NEG_INF ? 0.f : mx;  // nothing valid yet: no -inf - -inf
            alpha[h] = ex2(m_run[h] - base);
            float sum = 0.f;
            #pragma unroll
            for (int j = 0; j < TILES; ++j) {
                sc[j][h] = ex2(sc[j][h] - base);
                sc[j][h + 2] = ex2(sc[j][h + 2] - base);
                sum += sc[j][h] + sc[j][h + 2];
            }
            l_run[h] = l_run[h] * alpha[h] + sum;
            m_run[h] = mx;
        }
        #pragma unroll
        for (int m = 0; m < 8; ++m) {
            o[m][0] *= alpha[0]; o[m][2] *= alpha[0];
            o[m][1] *= alpha[1]; o[m][3] *= alpha[1];
        }
        // O^T += V^T P^T per tile
        #pragma unroll
        for (int j = 0; j < TILES; ++j) {
            // P^T rows (logical tokens g, g + 8) x heads 2t, 2t + 1 -> P: B fragments, k = logical tokens
            const unsigned pb0 = transpose8x8(f16x2(sc[j][0], sc[j][1]));
            const unsigned pb1 = transpose8x8(f16x2(sc[j][2], sc[j][3]));
            #pragma unroll
            for (int c = 0; c < 4; ++c) {  // head dims 16g + 4c .. + 3: m-tiles 2c (rows +0, +1), 2c + 1 (+2, +3)
                const unsigned x = word(cur.v[j][0], c), y = word(cur.v[j][1], c);
                const unsigned z = word(cur.v[j][2], c), u = word(cur.v[j][3], c);
                const unsigned xy01 = __byte_perm(x, y, 0x5140), xy23 = __byte_perm(x, y, 0x7362);
                const unsigned zu01 = __byte_perm(z, u, 0x5140), zu23 = __byte_perm(z, u, 0x7362);
                mma(o[2 * c], f16x2_of_e4m3x2(xy01), f16x2_of_high_e4m3x2(xy01), f16x2_of_e4m3x2(zu01),
                    f16x2_of_high_e4m3x2(zu01), pb0, pb1);
                mma(o[2 * c + 1], f16x2_of_e4m3x2(xy23), f16x2_of_high_e4m3x2(xy23), f16x2_of_e4m3x2(zu23),
                    f16x2_of_high_e4m3x2(zu23), pb0, pb1);
            }
        }
#if PREFETCH
        cur = next;
#else  // likewise V
        load_v(cur, v_lane, stride_slot, slot, n0 + TOKENS, end, t);
        slot = slot_of(table, n0 + 2 * TOKENS, end, page_shift, lane);
#endif
    }
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_run[h] += __shfl_xor_sync(FULL, l_run[h], 4);
        l_run[h] += __shfl_xor_sync(FULL, l_run[h], 8);
        l_run[h] += __shfl_xor_sync(FULL, l_run[h], 16);
    }
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (2 * t + h >= GROUP) continue;
#if DIRECT
        const float inv = 1.f / fmaxf(l_run[h], 1e-30f);
        unsigned pk[8];
        #pragma unroll
        for (int m = 0; m < 8; ++m) pk[m] = rne(o[m][h] * inv) | rne(o[m][h + 2] * inv) << 16;
        uint4* op = (uint4*)(out + (long long)b * stride_ob + (long long)(h0 + h) * stride_oh + 16 * g);
        op[0] = make_uint4(pk[0], pk[1], pk[2], pk[3]);
        op[1] = make_uint4(pk[4], pk[5], pk[6], pk[7]);
#else  // partials: acc [b, head, split, d] unnormalised, ml [b, head, split, 2] = (max, sum), max in natural units
        const long long base = ((long long)b * n_kv_heads * GROUP + h0 + h) * splits + s;
        float4* ap = (float4*)(acc_out + base * HEAD_DIM + 16 * g);
        #pragma unroll
        for (int c = 0; c < 4; ++c)
            ap[c] = make_float4(o[2 * c][h], o[2 * c][h + 2], o[2 * c + 1][h], o[2 * c + 1][h + 2]);
        if (g == 0) {
            ml_out[base * 2] = m_run[h] * 0.6931471805599453f;
            ml_out[base * 2 + 1] = l_run[h];
        }
#endif
    }
}
"""


log = logging.getLogger("llm_anatomy")


@cache
def _compiles(device_index: int) -> bool:
    try:
        with torch.cuda.device(device_index):
            compile_kernel(source(4, True), "fp8_decode_attention", device_index, 0)
    except Exception as e:  # no NVRTC in this PyTorch build: the Triton kernel reads the fp8 cache
        log.warning("the fp8 decode attention did not compile (%s); the Triton kernel serves", str(e).splitlines()[0])
        return False
    return True


def available(device: torch.device) -> bool:
    """Whether this kernel runs on the device: a Hopper or later GPU where NVRTC compiles it (checked once)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
            and _compiles(device.index if device.index is not None else torch.cuda.current_device()))


def source(group: int, direct: bool, tiles: int = TILES, prefetch: bool = PREFETCH, min_blocks: int = MIN_BLOCKS) -> str:
    defines = (f"#define GROUP {group}\n#define DIRECT {int(direct)}\n#define TILES {tiles}\n#define TOKENS {16 * tiles}\n"
               f"#define PREFETCH {int(prefetch)}\n#define MIN_BLOCKS {min_blocks}\n#define WARPS {WARPS}\n"
               f"#define HEAD_DIM {HEAD_DIM}\n")
    return defines + SOURCE


def unsupported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                context_lens: torch.Tensor) -> str | None:
    """Why this kernel cannot take these tensors (the caller then keeps the Triton kernel), or None."""
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) < (9, 0):
        return "needs a CUDA device of compute capability 9.0 or later"
    if k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != torch.float8_e4m3fn:
        return "the cache is not float8_e4m3fn"
    if q.dtype != torch.bfloat16:
        return "the query is not bf16"
    batch, n_heads, head_dim = q.shape
    n_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    if head_dim != HEAD_DIM or k_cache.shape[3] != HEAD_DIM:
        return f"head_dim {head_dim} is not {HEAD_DIM}"
    if n_heads % n_kv_heads or not 1 <= n_heads // n_kv_heads <= MAX_GROUP:
        return f"{n_heads} query heads over {n_kv_heads} KV heads: a group of 1..{MAX_GROUP} heads needed"
    if page_size & (page_size - 1):
        return f"page size {page_size} is not a power of two"
    if (k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1
            or k_cache.stride(0) != page_size * k_cache.stride(1)):
        return "K and V caches not laid out alike with flat slots"
    if k_cache.stride(1) >= 2 ** 31:
        return "slot stride past 32 bits"
    if k_cache.stride(1) % 16 or k_cache.stride(2) % 16 or k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:
        return "cache rows not 16-byte aligned"
    if q.stride(2) != 1 or q.stride(0) % 8 or q.stride(1) % 8 or q.data_ptr() % 16:
        return "query rows not contiguous and 16-byte aligned"
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1 or context_lens.dtype != torch.int32:
        return "block tables / context lengths not int32 (tables' rows contiguous)"
    if not context_lens.is_contiguous():
        return "context lengths not contiguous"
    return None


def fp8_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, splits: int | None = None, pdl: bool = False,
                         launch_first: bool = False, tiles: int = TILES, prefetch: bool = PREFETCH,
                         min_blocks: int = MIN_BLOCKS) -> torch.Tensor:
    """decode_attention.paged_decode_attention for a bf16 query over an fp8 e4m3 cache (see `unsupported` for the
    rest it needs; otherwise ValueError): q [B, H, 128]; k/v_cache one layer's [pages, page_size, KVH, 128];
    block_tables [B, max_pages] int32; context_lens [B] int32 (0: a padded row, zeros out) -> [B, H, 128] bf16.
    Splits as there (None: warp_splits' count for any context: a warp each), partials merged by its merge kernel;
    `pdl`, `launch_first` as there.
    tiles, prefetch, min_blocks: the kernel's variant (TILES, PREFETCH, MIN_BLOCKS say what they are)."""
    reason = unsupported(q, k_cache, v_cache, block_tables, context_lens)
    if reason:
        raise ValueError(f"fp8_decode_attention: {reason}")
    if tiles not in (1, 2):  # each lane holds one token's slot (slot_of): an iteration's tokens fit a warp's 32 lanes
        raise ValueError(f"fp8_decode_attention: tiles must be 1 or 2 (an iteration of at most 32 tokens), not {tiles}")
    batch, n_heads, head_dim = q.shape
    n_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = n_heads // n_kv_heads
    splits = splits or warp_splits(batch, n_kv_heads, sm_count(q.device), MAX_SPLITS * MIN_SPLIT_TOKENS)
    direct = splits == 1
    out = torch.empty(batch, n_heads, head_dim, dtype=q.dtype, device=q.device)
    acc = torch.empty(0 if direct else batch * n_heads * splits * head_dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(0 if direct else batch * n_heads * splits * 2, dtype=torch.float32, device=q.device)
    warps = batch * n_kv_heads * splits
    with torch.cuda.device(q.device):
        kernel = compile_kernel(source(group, direct, tiles, prefetch, min_blocks), "fp8_decode_attention", q.device.index, 0)
        launch(kernel, triton.cdiv(warps, WARPS), 32 * WARPS,
               [q, k_cache, v_cache, block_tables, context_lens, acc, ml, out, float(scale * 1.4426950408889634),
                batch, n_kv_heads, splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                block_tables.stride(0), k_cache.stride(1), ctypes.c_longlong(k_cache.stride(2)),
                page_size.bit_length() - 1], pdl=pdl)
    if not direct:
        merge(acc, ml, context_lens, out, splits, tiles, pdl, launch_first)
    return out


def merge(acc: torch.Tensor, ml: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor, splits: int, tiles: int,
          pdl: bool = False, launch_first: bool = False) -> None:
    """The Triton merge of decode_attention over the kernel's partials (acc [B, H, splits, 128] unnormalised,
    ml [B, H, splits, 2] = (max, sum) in natural-log units) into out [B, H, 128]; its tile is the kernel's iteration
    (16 x tiles tokens), which its count of the splits that hold tokens (_splits_used) assumes."""
    batch, n_heads, head_dim = out.shape
    splits_pad = max(2, triton.next_power_of_2(splits))
    chunks = merge_chunks(batch * n_heads, head_dim, sm_count(out.device))
    _decode_attention_merge_kernel[(batch, n_heads, chunks)](
        acc, ml, context_lens, out, out.stride(0), out.stride(1), n_heads, splits, SPLITS_PAD=splits_pad,
        HEAD_DIM=head_dim, D_BLOCK=head_dim // chunks, BLOCK_N=16 * tiles, USE_PDL=pdl,
        LAUNCH_FIRST=launch_first, launch_pdl=pdl, num_warps=merge_warps(splits_pad, head_dim // chunks))
