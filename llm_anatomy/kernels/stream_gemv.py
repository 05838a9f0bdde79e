"""The batch-1 decode GEMV as a hand-written CUDA kernel that reads its weights before its inputs exist.

A decode step is ~145 dependent GEMVs with small kernels (norms, RoPE, attention) between them. Each Triton GEMV
starts reading weights only once the kernel before it has ended, and its tail leaves multiprocessors idle: a fixed
cost per GEMV that adds up over a step's ~145 (benchmarks/README.md). Here one block per multiprocessor takes an even
share of the rows: its producer warp streams them by bulk copies into a ring of shared-memory stages from the moment the
block is resident, before the PDL wait (weights never depend on the kernel before), while eight consumer warps
wait for the input, then dot each stage with it. The ring takes most of a multiprocessor's shared memory, so the
next GEMV's block cannot share a multiprocessor with this one's (the small kernels between still can): it becomes
resident, and starts streaming, on each multiprocessor as this GEMV's block there ends, filling the tail
(benchmarks/README.md has the measured step).

The GEMVs after a norm (qkv, gate_up) take the norm too (`norm`): each block adds the product before to the
residual stream and RMS-normalises the row itself (16 KB from L2, a block-wide sum), and block 0 writes the new
stream. A decode step then has no norm kernels but the first and the last, and one wait fewer per norm in its chain.

fp8 weights (a float32 scale per row) go to the tensor cores: the consumers quantize x per token themselves (after
the norm, as fp8_quant.quantize_rows does) and each warp runs mma.sync m16n8k32 e4m3 over its windows of a stage,
two 16-byte shared-memory reads and two MMAs for 1 KB. Converting the weights in registers for float FMAs (W8A16,
before) was bound by instruction issue, 21 instructions per 8 weights (benchmarks/README.md); an MMA's 16 rows take
16 weight rows, or fewer rows cut into pieces of K (mma_layout).

Numerics: float32 sums of bf16 products, each output rounded to bf16; gated rounds as the Triton GEMV and HF do
(each projection, SiLU's output, the product). fp8: each 128 columns' MMA sums start from zero and are added in
float32 (the tensor cores' fp8 sums keep fewer bits), times the row's and x's scales. Deterministic: per-warp
partial sums added in a fixed order.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

import torch

from . import sm_count
from .cuda import BF16X2, ROW_DIVISION, STREAM_HELPERS, compile_kernel, launch

log = logging.getLogger(__name__)

CONSUMERS = 256  # eight warps: for bf16 thread t takes the 16-byte pieces t, t + 256, ... of every row; for fp8 each
# warp takes 128-byte windows of the stage in turn (see the kernel)
# A stage's bytes (one bulk copy, two when gated), by weight bytes: an fp8 stage holds 64 KB, four times a bf16
# stage's rows (the MMA's 16 rows for Qwen3-8B's K = 4096); fewer, longer stages measured faster for fp8 when its
# weights were converted in registers, no different for bf16 (benchmarks/README.md).
STAGE_BYTES = {2: 32 * 1024, 1: 64 * 1024}
# A stage's half is read by COPIES bulk copies, each block starting at a different one, rather than by one copy
# from its start: batch-1 TPOT 0.8% shorter for fp8 weights and bf16 alike (benchmarks/README.md).
COPIES = 4
RING_BYTES = 192 * 1024  # leaves the small kernels between GEMVs room to stay resident beside a block
# The ring of fp8 qkv weights before the one-kernel attention (`before_attention`): that kernel
# (decode_attention.rope_decode_attention, about 36 KB of shared memory for its layout conversions) is then resident
# beside the GEMV's block and reads its first tile of the cache during the GEMV. Measured with fp8 weights
# (benchmarks/README.md); bf16 weights keep RING_BYTES (not measured).
RING_BEFORE_ATTENTION = 128 * 1024
SHARED_LIMIT = 227 * 1024  # a Hopper block's opt-in maximum
# x stays in registers (128 floats a consumer thread at most). Below 2048 columns (Qwen3-0.6B) the products are
# too small to fill a block per multiprocessor, and were not measured: the Triton GEMV keeps them.
MIN_K, MAX_K = 2048, 32768

SOURCE = r"""
#define K %(K)d
#define ROWS %(ROWS)d                   // weight rows a stage (of each half when gated)
#define HALVES %(HALVES)d               // 2: gate_up, the up rows n below the gate rows
#define STAGE_ELEMS (HALVES * ROWS * K)
#define CONSUMERS %(CONSUMERS)d
#define COPIES %(COPIES)d                  // bulk copies a stage's half is cut into
#define NORMED %(NORMED)d                 // x is a product to add to the residual stream and RMS-normalise first
#define FP8 %(FP8)d                       // weights in float8 e4m3 with a float32 scale per row (W8A8, see mma_layout), else bf16
#define SEGS %(SEGS)d                     // FP8: each row cut into this many pieces of K, one of the MMA's 16 rows each
#define SEG_BYTES (K / SEGS)
#define WINDOWS (SEG_BYTES / 128)         // FP8: 128-byte windows of a piece, dealt to the consumer warps in turn
#define WARPS (CONSUMERS / 32)
#define WPW %(WPW)d                       // FP8: windows a warp takes (the last round may leave warps out)
#define WB (FP8 ? 1 : 2)                  // bytes of a weight
#define KP (K / 8)                               // 16-byte pieces of a row
#define PIECES ((KP + CONSUMERS - 1) / CONSUMERS)  // of them, each consumer thread's (the last may be short)
#define HAS_PIECE(p) ((p) < PIECES - 1 || KP %% CONSUMERS == 0 || tid < KP %% CONSUMERS)
""" + STREAM_HELPERS + ROW_DIVISION + BF16X2.replace("%", "%%") + r"""
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    f[0] = lo(v.x); f[1] = hi(v.x); f[2] = lo(v.y); f[3] = hi(v.y); f[4] = lo(v.z); f[5] = hi(v.z); f[6] = lo(v.w); f[7] = hi(v.w);
}
__device__ __forceinline__ uint4 add8(uint4 a, uint4 b) {
    return make_uint4(add_bf16x2(a.x, b.x), add_bf16x2(a.y, b.y), add_bf16x2(a.z, b.z), add_bf16x2(a.w, b.w));
}
__device__ __forceinline__ uint4 mul8(uint4 a, uint4 b) {
    return make_uint4(mul_bf16x2(a.x, b.x), mul_bf16x2(a.y, b.y), mul_bf16x2(a.z, b.z), mul_bf16x2(a.w, b.w));
}
__device__ __forceinline__ uint4 pack8(const float* f) {
    return make_uint4(bf16x2(f[0], f[1]), bf16x2(f[2], f[3]), bf16x2(f[4], f[5]), bf16x2(f[6], f[7]));
}
__device__ __forceinline__ float dot8f(uint4 w, const float* x) {
    return lo(w.x) * x[0] + hi(w.x) * x[1] + lo(w.y) * x[2] + hi(w.y) * x[3]
         + lo(w.z) * x[4] + hi(w.z) * x[5] + lo(w.w) * x[6] + hi(w.w) * x[7];
}
// x / scale, clamped to +-448, to e4m3 with rounding to nearest even (fp8_quant.quantize_rows' arithmetic), four
// values to four bytes, the first in the lowest; cvt puts its first operand in the upper byte
__device__ __forceinline__ unsigned e4m3x4(const float* v, RowDivisor scale) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %%0, %%1, %%2;" : "=h"(lo) : "f"(e4m3_range(v[1], scale)), "f"(e4m3_range(v[0], scale)));
    asm("cvt.rn.satfinite.e4m3x2.f32 %%0, %%1, %%2;" : "=h"(hi) : "f"(e4m3_range(v[3], scale)), "f"(e4m3_range(v[2], scale)));
    return (unsigned)lo | (unsigned)hi << 16;
}
// d += A (16 x 32 e4m3, rows g and g + 8 of lane g * 4 + t) . B (32 x 8 e4m3, column g), float32 (sm_89 and later)
__device__ __forceinline__ void mma_e4m3(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%%0, %%1, %%2, %%3}, {%%4, %%5, %%6, %%7}, {%%8, %%9}, "
        "{%%0, %%1, %%2, %%3};" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
stream_gemv(const unsigned char* __restrict__ w, const unsigned short* __restrict__ x,
            unsigned short* __restrict__ y, int n, int stages, const unsigned short* __restrict__ res_in,
            unsigned short* __restrict__ res_out, const unsigned short* __restrict__ norm_w, float eps,
            const float* __restrict__ w_scale, const long long* __restrict__ x_row) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring = smem;
    unsigned char* xq = ring + (size_t)stages * STAGE_ELEMS * WB;  // FP8: x in e4m3, K bytes
    unsigned long long* full = (unsigned long long*)(xq + (FP8 ? K : 0));
    unsigned long long* empty = full + stages;
    float* warp_sums = (float*)(empty + stages);  // NORMED: each consumer warp's sum of squares
    float* warp_maxes = warp_sums + CONSUMERS / 32;  // FP8: each consumer warp's largest magnitude of x
    float* partial = warp_maxes + CONSUMERS / 32;  // [warp][half][piece of K][row of this block]
    const int tid = threadIdx.x, warp = tid / 32, lane = tid %% 32;
    const int groups = n / ROWS;
    const int g0 = (int)((long long)blockIdx.x * groups / gridDim.x);
    const int g1 = (int)((long long)(blockIdx.x + 1) * groups / gridDim.x);
    const int mine = (g1 - g0) * ROWS;
    if (tid == 0) init_ring(full, empty, stages, CONSUMERS / 32);
    __syncthreads();
    // The next kernel may launch now: a small one fits beside this block and waits; the next GEMV's block
    // does not fit, so it lands on each multiprocessor as this GEMV's block there ends.
    asm volatile("griddepcontrol.launch_dependents;" :::);

    if (warp == CONSUMERS / 32) {  // the producer: no wait for the kernel before, weights are constant
        if (lane == 0) {
            for (int g = g0, it = 0; g < g1; ++g, ++it) {
                const int slot = it %% stages, round = it / stages;
                if (round > 0) mbar_wait(smem_addr(&empty[slot]), (round - 1) & 1);
                const unsigned bar = smem_addr(&full[slot]);
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%%0], %%1;"
                             :: "r"(bar), "r"(STAGE_ELEMS * WB) : "memory");
                unsigned char* dst = ring + (size_t)slot * STAGE_ELEMS * WB;
                // each half in COPIES bulk copies, the first a different one in each block (see COPIES)
                for (int h = 0; h < HALVES; ++h) {
                    const size_t src = ((size_t)(h ? n : 0) + (size_t)g * ROWS) * K * WB;
                    const unsigned part = ROWS * K * WB / COPIES;
                    for (int c0 = 0; c0 < COPIES; ++c0) {
                        const int c = (c0 + blockIdx.x) %% COPIES;
                        bulk_load(dst + h * ROWS * K * WB + c * part, w + src + c * part, part, bar);
                    }
                }
            }
        }
        return;
    }

#if NORMED
    uint4 nw[PIECES];  // the norm's weight is constant: read before the wait
    #pragma unroll
    for (int p = 0; p < PIECES; ++p)
        nw[p] = HAS_PIECE(p) ? __ldg((const uint4*)(norm_w + (p * CONSUMERS + tid) * 8)) : make_uint4(0, 0, 0, 0);
#endif
#if FP8  // the row scales are constant too: a thread's first row's, read now, not after its sums (a memory round trip
         // at the end of the GEMV, which the next one waits for)
    const float scale0 = tid < mine ? __ldg(w_scale + g0 * ROWS + tid) : 0.f;
    const float scale0_up = HALVES == 2 && tid < mine ? __ldg(w_scale + n + g0 * ROWS + tid) : 0.f;
#endif
    asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the kernel before's output
    if (x_row != nullptr) x += (size_t)__ldcg(x_row) * K;  // x a table (the embedding), the input its row x_row[0]
    float xf[PIECES * 8];
    #pragma unroll
    for (int p = 0; p < PIECES; ++p) {
        uint4 v = HAS_PIECE(p) ? __ldcg((const uint4*)(x + (p * CONSUMERS + tid) * 8)) : make_uint4(0, 0, 0, 0);
#if NORMED  // the residual add, rounded to bf16 as HF's (none before the first layer); block 0 writes the new stream
        if (res_in != nullptr && HAS_PIECE(p)) v = add8(v, __ldcg((const uint4*)(res_in + (p * CONSUMERS + tid) * 8)));
        if (blockIdx.x == 0 && HAS_PIECE(p)) *(uint4*)(res_out + (p * CONSUMERS + tid) * 8) = v;
#endif
        unpack8(v, &xf[p * 8]);
    }
#if NORMED  // RMSNorm in float32 over the whole row: each block computes it for itself (16 KB read from L2)
    float ss = 0.f;
    #pragma unroll
    for (int i = 0; i < PIECES * 8; ++i) ss += xf[i] * xf[i];
    ss = warp_sum(ss);
    if (lane == 0) warp_sums[warp] = ss;
    asm volatile("bar.sync 1, %%0;" :: "n"(CONSUMERS) : "memory");
    float total = 0.f;
    #pragma unroll
    for (int k = 0; k < CONSUMERS / 32; ++k) total += warp_sums[k];
    const float inv = rsqrtf(total / K + eps);
    #pragma unroll
    for (int p = 0; p < PIECES; ++p) {  // x * inv rounded to bf16, times the weight rounded to bf16, as HF's
        #pragma unroll
        for (int j = 0; j < 8; ++j) xf[p * 8 + j] *= inv;
        unpack8(mul8(pack8(&xf[p * 8]), nw[p]), &xf[p * 8]);
    }
#endif
#if FP8
    // x quantized per token as fp8_quant.quantize_rows does (scale = amax / 448), into shared memory: each thread
    // then holds the pieces of it that its MMA fragments pair with the weights'
    float m = 0.f;
    #pragma unroll
    for (int i = 0; i < PIECES * 8; ++i) m = fmaxf(m, fabsf(xf[i]));
    m = warp_max(m);
    if (lane == 0) warp_maxes[warp] = m;
    asm volatile("bar.sync 1, %%0;" :: "n"(CONSUMERS) : "memory");
    float amax = 0.f;
    #pragma unroll
    for (int k = 0; k < CONSUMERS / 32; ++k) amax = fmaxf(amax, warp_maxes[k]);
    const float x_scale = __fdiv_rn(fmaxf(amax, 1e-12f), 448.f);
    const RowDivisor x_div = row_divisor(x_scale);
    #pragma unroll
    for (int p = 0; p < PIECES; ++p)
        if (HAS_PIECE(p))
            *(uint2*)(xq + (p * CONSUMERS + tid) * 8) = make_uint2(e4m3x4(&xf[p * 8], x_div),
                                                                   e4m3x4(&xf[p * 8 + 4], x_div));
    asm volatile("bar.sync 1, %%0;" :: "n"(CONSUMERS) : "memory");
    // Lane grp * 4 + t feeds the MMA's rows grp and grp + 8 (two row slots: weight rows, or pieces of K of fewer
    // rows) and its column grp. The sum runs over K in any order as long as a lane's A and B bytes are the same
    // columns of the row: a lane reads 16-byte chunks of each 128-byte window, chunk t or t + 4 first by the
    // parity of grp, so that the 8 lanes of a shared-memory phase hit 8 distinct chunks (no bank conflicts), and
    // its column carries x's bytes at the same places. Only C[slot][grp] is a row's dot: lane grp * 4 + grp / 2
    // holds both of its slots'.
    const int grp = lane >> 2, t = lane & 3, seg = grp %% SEGS, chunk = (t + 4 * (grp & 1)) * 16;
    const int slot_lo = grp / SEGS, slot_hi = slot_lo + 8 / SEGS;
    const int off_lo = slot_lo * K + seg * SEG_BYTES + chunk, off_hi = slot_hi * K + seg * SEG_BYTES + chunk;
    uint4 xb[WPW][2];
    #pragma unroll
    for (int j = 0; j < WPW; ++j) {
        const int at = seg * SEG_BYTES + (warp + WARPS * j) * 128 + chunk;
        const bool in = warp + WARPS * j < WINDOWS;
        xb[j][0] = in ? *(const uint4*)(xq + at) : make_uint4(0, 0, 0, 0);
        xb[j][1] = in ? *(const uint4*)(xq + (at ^ 64)) : make_uint4(0, 0, 0, 0);
    }
#endif
    for (int g = g0, it = 0; g < g1; ++g, ++it) {
        const int slot = it %% stages, round = it / stages;
        mbar_wait(smem_addr(&full[slot]), round & 1);
#if FP8
        const unsigned char* stage = ring + (size_t)slot * STAGE_ELEMS;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int j = 0; j < WPW; ++j) {
            if (WINDOWS %% WARPS == 0 || warp + WARPS * j < WINDOWS) {
                const unsigned char* window = stage + (warp + WARPS * j) * 128;
                const uint4 a0 = *(const uint4*)(window + off_lo), b0 = *(const uint4*)(window + off_hi);
                const uint4 a1 = *(const uint4*)(window + (off_lo ^ 64)), b1 = *(const uint4*)(window + (off_hi ^ 64));
                // A window's 128 columns from zero, then added in float32: the tensor cores' fp8 sums keep fewer
                // bits (as fp8_gemv.w8a8_gemv's K blocks)
                float d[4] = {0.f, 0.f, 0.f, 0.f};
                mma_e4m3(d, a0.x, b0.x, a0.y, b0.y, xb[j][0].x, xb[j][0].y);
                mma_e4m3(d, a0.z, b0.z, a0.w, b0.w, xb[j][0].z, xb[j][0].w);
                mma_e4m3(d, a1.x, b1.x, a1.y, b1.y, xb[j][1].x, xb[j][1].y);
                mma_e4m3(d, a1.z, b1.z, a1.w, b1.w, xb[j][1].z, xb[j][1].w);
                #pragma unroll
                for (int e = 0; e < 4; ++e) acc[e] += d[e];
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_addr(&empty[slot]));
        if (t == grp >> 1) {  // this lane holds its column's two dots
            const int base = (g - g0) * ROWS;
            partial[((warp * HALVES + slot_lo / ROWS) * SEGS + seg) * mine + base + slot_lo %% ROWS] = grp & 1 ? acc[1] : acc[0];
            partial[((warp * HALVES + slot_hi / ROWS) * SEGS + seg) * mine + base + slot_hi %% ROWS] = grp & 1 ? acc[3] : acc[2];
        }
#else
        const unsigned char* stage = ring + (size_t)slot * STAGE_ELEMS * 2;
        float acc[HALVES * ROWS];
        #pragma unroll
        for (int r = 0; r < HALVES * ROWS; ++r) {
            float a = 0.f;
            #pragma unroll
            for (int p = 0; p < PIECES; ++p)
                if (HAS_PIECE(p)) a += dot8f(*(const uint4*)(stage + (size_t)r * K * 2 + (p * CONSUMERS + tid) * 16), &xf[p * 8]);
            acc[r] = a;
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_addr(&empty[slot]));  // the stage is in registers: the producer may refill it
        #pragma unroll
        for (int r = 0; r < HALVES * ROWS; ++r) {
            const float v = warp_sum(acc[r]);
            if (lane == 0) partial[(warp * HALVES + r / ROWS) * mine + (g - g0) * ROWS + r %% ROWS] = v;
        }
#endif
    }
    asm volatile("bar.sync 1, %%0;" :: "n"(CONSUMERS) : "memory");
    for (int i = tid; i < mine; i += CONSUMERS) {
        float a = 0.f;
        #pragma unroll
        for (int k = 0; k < CONSUMERS / 32; ++k)
            #pragma unroll
            for (int s = 0; s < SEGS; ++s) a += partial[(k * HALVES * SEGS + s) * mine + i];
#if FP8
        a *= i == tid ? scale0 : w_scale[g0 * ROWS + i];
#endif
#if FP8
        a *= x_scale;
#endif
        unsigned out;
        if (HALVES == 2) {
            float u = 0.f;
            #pragma unroll
            for (int k = 0; k < CONSUMERS / 32; ++k)
                #pragma unroll
                for (int s = 0; s < SEGS; ++s) u += partial[((k * HALVES + 1) * SEGS + s) * mine + i];
#if FP8
            u *= i == tid ? scale0_up : w_scale[n + g0 * ROWS + i];
#endif
#if FP8
            u *= x_scale;
#endif
            const float gate = round_bf16(a);
            out = rne(round_bf16(gate / (1.f + __expf(-gate))) * round_bf16(u));
        } else {
            out = rne(a);
        }
        y[g0 * ROWS + i] = (unsigned short)out;
    }
}
"""


def rows_per_stage(n: int, k: int, gated: bool, weight_bytes: int = 2) -> int:
    """Weight rows a stage copies (of each half when gated): as many as fit in the weights' STAGE_BYTES and divide n,
    so that every stage is whole (Qwen3-8B in bf16: 4 for K = 4096, 2 for gate_up's halves, 1 for down's K = 12288);
    fp8 stages go to the tensor cores, their rows are mma_layout's (16, 8 and 4)."""
    if weight_bytes == 1:
        layout = mma_layout(n, k, gated)
        if layout is None:
            raise ValueError(f"an fp8 GEMV of {n} x {k} does not fit the tensor cores' layout (see mma_layout)")
        return layout[0]
    most = max(1, STAGE_BYTES[weight_bytes] // (k * weight_bytes * (2 if gated else 1)))
    return next(r for r in range(most, 0, -1) if n % r == 0)


def mma_layout(n: int, k: int, gated: bool) -> tuple[int, int, int] | None:
    """How an fp8 GEMV feeds the tensor cores, or None where it cannot (the Triton GEMV takes it): (rows a stage
    copies of each half, pieces of K a row is cut into so that a stage's rows times pieces make the MMA's 16 rows,
    128-byte windows a consumer warp takes). Rows: a power of two that fits the stage and divides n; the pieces
    must come in whole 128-byte windows; a warp's share of x stays in registers (8 windows at most)."""
    halves = 2 if gated else 1
    most = STAGE_BYTES[1] // (k * halves)
    rows = next((r for r in (16, 8, 4, 2, 1) if r <= most and 2 <= r * halves <= 16 and n % r == 0), None)
    if rows is None:
        return None
    segs = 16 // (rows * halves)
    if k % (segs * 128):
        return None
    windows_per_warp = -(-(k // segs // 128) // (CONSUMERS // 32))
    return (rows, segs, windows_per_warp) if windows_per_warp <= 8 else None


def copies(half_bytes: int) -> int:
    """Bulk copies a stage's half of `half_bytes` is read by: COPIES where each is a whole number of 16-byte pieces
    (what a bulk copy takes), else one."""
    return COPIES if half_bytes % (16 * COPIES) == 0 else 1


def source(n: int, k: int, gated: bool, normed: bool = False, weight_bytes: int = 2) -> str:
    _, segs, wpw = mma_layout(n, k, gated) if weight_bytes == 1 else (0, 1, 1)
    rows = rows_per_stage(n, k, gated, weight_bytes)
    return SOURCE % {"K": k, "ROWS": rows, "HALVES": 2 if gated else 1, "CONSUMERS": CONSUMERS,
                     "COPIES": copies(rows * k * weight_bytes), "NORMED": int(normed),
                     "FP8": int(weight_bytes == 1), "SEGS": segs, "WPW": wpw}


def plan(n: int, k: int, gated: bool, blocks: int, weight_bytes: int = 2, ring_bytes: int = RING_BYTES
         ) -> tuple[int, int]:
    """(ring stages, shared bytes) of a launch over `blocks` blocks: the ring fills `ring_bytes`, less what the
    per-warp partial sums of the block's rows take (and, for fp8, x quantized)."""
    rows = rows_per_stage(n, k, gated, weight_bytes)
    halves = 2 if gated else 1
    segs = mma_layout(n, k, gated)[1] if weight_bytes == 1 else 1
    stage = halves * rows * k * weight_bytes
    most_rows = -(-(n // rows) // blocks) * rows
    # the partial sums, the warps' sums of squares and largest magnitudes, x in fp8
    rest = CONSUMERS // 32 * (halves * most_rows * segs + 2) * 4 + (k if weight_bytes == 1 else 0)
    stages = min(ring_bytes, SHARED_LIMIT - rest - 1024) // stage
    return stages, stages * (stage + 16) + rest


@cache
def _compiles(device_index: int) -> bool:
    try:
        with torch.cuda.device(device_index):
            for weight_bytes in (2, 1):  # bf16 and fp8 weights
                compile_kernel(source(64, 8 * CONSUMERS, False, weight_bytes=weight_bytes), "stream_gemv", device_index,
                               SHARED_LIMIT)
    except Exception as e:  # no NVRTC in this PyTorch build: the Triton GEMV serves every row
        log.warning("the streaming GEMV did not compile (%s); the Triton GEMV takes batch 1 too", str(e).splitlines()[0])
        return False
    return True


def available(device: torch.device) -> bool:
    """Whether this kernel runs on the device: a Hopper or later GPU where NVRTC compiles it (checked once)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and _compiles(device.index if device.index is not None else torch.cuda.current_device()))


def eligible(rows: int, k: int, dtype: torch.dtype) -> bool:
    """Whether a GEMV over `rows` rows of `dtype` with `k` columns is this kernel's (if its weight fits, see
    supports): a plan that streams uses it for these (ExecutionPlan.streams)."""
    return rows == 1 and dtype == torch.bfloat16 and k % 8 == 0 and MIN_K <= k <= MAX_K


def supports(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> bool:
    """A single bf16 row on a GPU (see available) times bf16 weights, or fp8 e4m3 ones (with a scale per row) in
    a shape the tensor cores take (mma_layout), K in 16-byte pieces, a ring of at least two stages."""
    n = weight.shape[0] // (2 if gated else 1)
    k = weight.shape[1]
    fp8 = weight.dtype == torch.float8_e4m3fn
    return (eligible(x.shape[0], k, x.dtype) and x.is_cuda and (weight.dtype == x.dtype or fp8)
            and k * weight.element_size() % 16 == 0 and x.is_contiguous() and weight.is_contiguous() and x.data_ptr() % 16 == 0
            and (not fp8 or mma_layout(n, k, gated) is not None)
            and plan(n, k, gated, sm_count(x.device), weight.element_size())[0] >= 2)


def supports_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor) -> bool:
    """Whether the GEMV can add x to the residual stream (None: no stream yet) and RMS-normalise it itself
    (stream_gemv's `norm`): the stream and the norm's weight one row of x's dtype, contiguous, in 16-byte pieces."""
    return all(t.dtype == x.dtype and t.is_cuda and t.is_contiguous() and t.numel() == x.shape[1]
               and t.data_ptr() % 16 == 0 for t in (x, residual, norm_weight) if t is not None)


def stream_gemv(x: torch.Tensor, weight: torch.Tensor, gated: bool = False,
                norm: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, float] | None = None,
                pdl: bool = False, scale: torch.Tensor | None = None, before_attention: bool = False,
                x_row: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T -> [1, N] (bf16); with gated, weight = [gate; up] and the result SiLU(gate) * up.
    With norm = (residual, new_residual, norm_weight, eps), the product is of RMSNorm(x + residual) * norm_weight
    instead (rounded as HF rounds), and new_residual receives x + residual: the norm kernel before a GEMV, done by
    the GEMV's consumers (see supports_norm). `pdl`: launched with programmatic dependent launch (pdl.py).
    An fp8 e4m3 weight comes with `scale`, float32 [rows of weight]: the kernel quantizes x (normalised, if `norm`)
    per token as fp8_quant.quantize_rows does and row r's fp8 dot is multiplied by scale[r] and x's scale (W8A8, as
    the Triton GEMV of 2-16 rows and the prefill's products). `before_attention`: the next kernel is the one-kernel
    decode attention; fp8 weights then stream through a ring of RING_BEFORE_ATTENTION. With `x_row` (int64 [1] on
    the device) x is a table [rows, K] (the embedding) and the input its row x_row[0], read after the PDL wait: the
    gather before the first layer done by its qkv GEMV, whose norm's residual is then None (new_residual receives
    the row)."""
    n = weight.shape[0] // (2 if gated else 1)
    k = weight.shape[1]
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 != (scale is not None):
        raise ValueError("an fp8 weight needs its per-row scale, a bf16 weight takes none")
    if x_row is not None and (x_row.dtype != torch.int64 or x_row.numel() != 1 or not x_row.is_cuda):
        raise ValueError("x_row must be one int64 index on the device")
    if norm is not None and norm[0] is None and x_row is None:
        raise ValueError("a norm without a residual stream is the first layer's, over a gathered row (x_row)")
    blocks = sm_count(x.device)
    stages, shared = plan(n, k, gated, blocks, weight.element_size(),
                          RING_BEFORE_ATTENTION if before_attention and fp8 else RING_BYTES)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    null = ctypes.c_void_p(0)
    residual, new_residual, norm_weight, eps = norm or (null, null, null, 0.0)
    residual = null if residual is None else residual
    with torch.cuda.device(x.device):  # the kernel's module and the stream are those of x's device
        kernel = compile_kernel(source(n, k, gated, norm is not None, weight.element_size()), "stream_gemv",
                                x.device.index, SHARED_LIMIT)
        launch(kernel, blocks, CONSUMERS + 32, [weight, x, y, n, stages, residual, new_residual, norm_weight,
                                                float(eps), scale if fp8 else null,
                                                null if x_row is None else x_row], pdl=pdl, shared=shared)
    return y
