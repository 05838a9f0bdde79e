"""A whole batch-1 decode step of Qwen3 as one persistent CUDA kernel that streams the weights (a probe: measured
slower than the engine's graph of Triton kernels, so the engine does not use it; see probe_decode_step.py and
RESULTS.md, ninth session).

Batch-1 decode reads every weight once and does little else, so its speed is the rate at which the weights
stream. As ~300 separate kernels (norms, GEMVs, RoPE, attention), each GEMV ramps up after the small kernel
before it and drains before the next: about 2 us per GEMV beyond its bytes on the H200 (benchmarks/RESULTS.md,
eighth session). Here one block per multiprocessor runs the whole step:

- a producer warp streams the block's share of every weight the step reads (per layer qkv, o_proj, gate_up,
  down; then the LM head), in order, into a ring of shared-memory stages (bulk copies completing on mbarriers),
  never waiting for anything but a free stage;
- eight consumer warps run the step's phases, with a grid-wide arrival count where a phase needs all of the
  one before: the input norm and qkv rows | QK-norm, RoPE, the KV store and attention over chunks of the
  context | the merge of the chunks | o_proj rows and the residual add | the norm and gate_up rows with
  SiLU*up | down rows and the residual add. Meanwhile the ring already holds the next phase's weights.

Each consumer warp owns one ring stage (STAGES == WARPS): a warp never waits on a stage's barrier more than one
phase ahead, where an mbarrier parity wait would pass at once. Rounding follows HF's (and the Triton path's):
bf16 after each product, the residual add in bf16, norms in float32 rounded before the weight.

Needs a Hopper GPU (bulk copies, 221 KB of shared memory a block), bf16 weights and cache, head_dim 128 and
the shapes `supports` checks; every block must be resident at once (one per multiprocessor, nothing else on
the device's stream).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from llm_anatomy.kernels.cuda import STREAM_HELPERS, launch

WARPS, STAGES, SLOT_BYTES = 8, 8, 24576
MAX_CHUNKS = 64  # attention partials per head; a chunk is a multiple of 32 tokens
HEAD_DIM = 128
# The timeline's stamps in a layer: its start, then each phase's end (its last warp's) and each wait's release
EVENTS = ("qkv_start", "qkv", "wait1", "attention", "wait2", "merge", "wait3", "o_proj", "wait4", "gate_up", "wait5",
          "down")
EVENTS_PER_LAYER = len(EVENTS)

BODY = r"""
#define NQ (QD / HEAD_DIM)
#define NKV (KVD / HEAD_DIM)
#define GROUP (NQ / NKV)
#define QKV (QD + 2 * KVD)
#define CONSUMERS (WARPS * 32)
#define ROWS_H (SLOT_BYTES / (H * 2))   // rows of a K = H weight per ring stage
#define ROWS_Q (SLOT_BYTES / (QD * 2))  // rows of o_proj (K = QD) per ring stage
#define VEC_BYTES (I * 2)
typedef unsigned short bf16;
#define INFINITY __int_as_float(0x7f800000)

struct Layer { const bf16 *in_norm, *qkv, *q_norm, *k_norm, *o, *post_norm, *gate_up, *down; };

// Waits that do not spin: the thread sleeps in try_wait until the phase completes (the hint, in ns, bounds each
// sleep), leaving the issue slots of its scheduler to the warps that compute. A spinning producer shares a
// scheduler with consumer warps 0 and 4.
__device__ __forceinline__ void mbar_sleep_wait(unsigned bar, unsigned parity) {
    unsigned ok;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3; selp.u32 %0, 1, 0, p; }"
                     : "=r"(ok) : "r"(bar), "r"(parity), "r"(0x989680) : "memory");
    } while (!ok);
}

struct Ring {  // a block's ring: stage s is filled through full[s], handed back through empty[s]
    unsigned char* stages;
    unsigned long long* full;
    unsigned long long* empty;
    __device__ const bf16* wait_item(unsigned it) const {
        unsigned s = it % STAGES;
        mbar_sleep_wait(smem_addr(&full[s]), (it / STAGES) & 1);
        return (const bf16*)(stages + s * SLOT_BYTES);
    }
    __device__ void release_item(unsigned it) const {
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mbar_arrive(smem_addr(&empty[it % STAGES]));
    }
    __device__ void produce(unsigned it, const void* a, unsigned na, const void* b, unsigned nb) const {
        unsigned s = it % STAGES, round = it / STAGES;
        if (round > 0) mbar_sleep_wait(smem_addr(&empty[s]), (round - 1) & 1);
        unsigned bar = smem_addr(&full[s]);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(na + nb) : "memory");
        bulk_load(stages + s * SLOT_BYTES, a, na, bar);
        if (nb) bulk_load(stages + s * SLOT_BYTES + na, b, nb, bar);
    }
};

// TIMELINE: thread 0 of each block stamps the global timer at each phase's end and each wait's release
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
#define MARK(row, e) do { if (TIMELINE && timeline) timeline[(size_t)(row) * (EVENTS_PER_LAYER * n_layers + 2) + (e)] = now_ns(); } while (0)
// a phase's end: when the block's last consumer warp is done with it
#define MARK_ALL(e) do { if (TIMELINE && timeline) { consumers_sync(); MARK(blockIdx.x, e); } } while (0)

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" :: "n"(CONSUMERS) : "memory"); }
__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float bf(bf16 v) { return __uint_as_float(((unsigned)v) << 16); }
__device__ __forceinline__ bf16 ldg_bf16(const bf16* p) { return __ldcg((const unsigned short*)p); }
__device__ __forceinline__ int rows_lo(int n) { return (int)((long long)blockIdx.x * n / gridDim.x); }
__device__ __forceinline__ int rows_hi(int n) { return (int)((long long)(blockIdx.x + 1) * n / gridDim.x); }
__device__ __forceinline__ int items(int rows, int per) { return (rows + per - 1) / per; }
// A block's items of a phase (item k: rows k*per ..): a contiguous share, or with INTERLEAVE every gridDim.x-th item
struct Split {
    int first, count, step;
    __device__ Split(int rows, int per) {
        const int n = items(rows, per);
        if (INTERLEAVE) {
            first = blockIdx.x, step = gridDim.x;
            count = first < n ? (n - first + step - 1) / step : 0;
        } else {
            first = rows_lo(n), step = 1;
            count = rows_hi(n) - first;
        }
        if (NO_WEIGHTS) count = 0;
    }
    __device__ int item(int j) const { return first + j * step; }
};
// a warp's rank for latency-bound tasks: warps 1, 2, 3, 5, 6, 7 first, then 0 and 4 (the producer's scheduler)
__device__ __forceinline__ int task_rank(int warp) { return warp % 4 ? warp - 1 - warp / 4 : 6 + warp / 4; }

// Every block's writes before it are visible to every block after it. Consumers only; barrier k of the step
// (from 1) waits for k arrivals of every block on one counter, so nothing needs resetting between barriers.
// The block's writes are ordered before thread 0's release by the block barrier (a release is cumulative), and
// other blocks' writes after its acquire likewise: no fence per thread. (On the H200 a barrier took 1.0-1.25 us
// with no weights streaming, and about 4.5 us behind the ring's traffic, with or without fences.)
__device__ void grid_wait(unsigned* counter, unsigned k) {
    consumers_sync();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
        unsigned seen, target = k * gridDim.x;
        while (true) {
            asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
            if (seen >= target) break;
            __nanosleep(32);
        }
    }
    consumers_sync();
}

// vec <- RMSNorm(src) x w, HF's rounding (src: bf16 written by other blocks, read through L2)
__device__ void norm_into(const bf16* src, const bf16* w, float eps, bf16* vec, float* red) {
    float ss = 0.f;
    for (int c = threadIdx.x; c < H / 8; c += CONSUMERS) {
        uint4 v = __ldcg((const uint4*)src + c);
        unsigned u[4] = {v.x, v.y, v.z, v.w};
        #pragma unroll
        for (int i = 0; i < 4; ++i) ss += lo(u[i]) * lo(u[i]) + hi(u[i]) * hi(u[i]);
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = ss;
    consumers_sync();
    float total = 0.f;
    #pragma unroll
    for (int k = 0; k < WARPS; ++k) total += red[k];
    const float inv = rsqrtf(total / H + eps);
    for (int c = threadIdx.x; c < H / 8; c += CONSUMERS) {
        uint4 v = __ldcg((const uint4*)src + c), g = ((const uint4*)w)[c];
        unsigned u[4] = {v.x, v.y, v.z, v.w}, gw[4] = {g.x, g.y, g.z, g.w}, o[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i)
            o[i] = rne(round_bf16(lo(u[i]) * inv) * lo(gw[i])) | (rne(round_bf16(hi(u[i]) * inv) * hi(gw[i])) << 16);
        ((uint4*)vec)[c] = make_uint4(o[0], o[1], o[2], o[3]);
    }
    consumers_sync();  // vec is whole; red may be reused
}

// The block's items of a K-column weight of `total` rows (K = KC x 256) against x held in registers (lane: columns
// c*256 + lane*8..), ring items from `base`; out(row, float) for each row, by one lane.
template <int KC, class Out>
__device__ void dot_rows(const Ring& ring, unsigned base, int total, int per, const uint4* xr, Out out) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const Split sp(total, per);
    for (int j = (warp - (int)(base % WARPS) + WARPS) % WARPS; j < sp.count; j += WARPS) {
        const bf16* st = ring.wait_item(base + j);
        const int row0 = sp.item(j) * per, rows = min(per, total - row0);
        float acc[3] = {0.f, 0.f, 0.f};
        #pragma unroll
        for (int r = 0; r < 3; ++r) {
            if (r < rows) {
                #pragma unroll
                for (int c = 0; c < KC; ++c) acc[r] += dot8(*(const uint4*)(st + r * KC * 256 + c * 256 + lane * 8), xr[c]);
            }
        }
        ring.release_item(base + j);
        #pragma unroll
        for (int r = 0; r < 3; ++r) {
            float a = warp_sum(acc[r]);
            if (r < rows && lane == r) out(row0 + r, a);
        }
    }
}

template <int KC>
__device__ __forceinline__ void load_x(const bf16* vec, uint4* xr) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int c = 0; c < KC; ++c) xr[c] = *(const uint4*)(vec + c * 256 + lane * 8);
}

// QK-norm and RoPE of one head (128 bf16 values): lane holds dims 2l, 2l+1 (first half, x1) and 64 + 2l, 65 + 2l
// (second, x2). Returns them rounded to bf16 as floats in a[2], b[2].
__device__ __forceinline__ void norm_rope(unsigned x1, unsigned x2, const bf16* w, float eps, const float* cos_row,
                                          const float* sin_row, float* a, float* b) {
    const int lane = threadIdx.x & 31;
    float a0 = lo(x1), a1 = hi(x1), b0 = lo(x2), b1 = hi(x2);
    float inv = rsqrtf(warp_sum(a0 * a0 + a1 * a1 + b0 * b0 + b1 * b1) / HEAD_DIM + eps);
    unsigned w1 = *(const unsigned*)(w + 2 * lane), w2 = *(const unsigned*)(w + 64 + 2 * lane);
    a0 = round_bf16(round_bf16(a0 * inv) * lo(w1));
    a1 = round_bf16(round_bf16(a1 * inv) * hi(w1));
    b0 = round_bf16(round_bf16(b0 * inv) * lo(w2));
    b1 = round_bf16(round_bf16(b1 * inv) * hi(w2));
    float c0 = cos_row[2 * lane], c1 = cos_row[2 * lane + 1], s0 = sin_row[2 * lane], s1 = sin_row[2 * lane + 1];
    a[0] = round_bf16(a0 * c0 - b0 * s0);
    a[1] = round_bf16(a1 * c1 - b1 * s1);
    b[0] = round_bf16(b0 * c0 + a0 * s0);
    b[1] = round_bf16(b1 * c1 + a1 * s1);
}

// One warp: the GROUP query heads of KV head g over context tokens [c0, c1) -> unnormalised partials of chunk c.
// Each 32 tokens' keys and values are asked for first (they depend only on the block table); the queries are normed
// and rotated while the first arrive. This step's own key and value (position pos) come from qkv, not the cache:
// knew (the warp's 128 bf16 in shared memory) for the lane whose token it is, vnew for every lane's 4 dimensions.
__device__ void attend_chunk(const bf16* qkv, const Layer& w, float eps, const float* cos_row, const float* sin_row,
                             bf16* kc, bf16* vc, const int* table, int page, long long slot_stride,
                             int pos, long long slot_new, int g, int c, int c0, int c1, float* qs, bf16* knew,
                             float* part_acc, float* part_ml) {
    const int lane = threadIdx.x & 31;
    const float scale = rsqrtf((float)HEAD_DIM);
    float m[GROUP], l[GROUP], acc[GROUP][4];
    #pragma unroll
    for (int h = 0; h < GROUP; ++h) {
        m[h] = -INFINITY; l[h] = 0.f;
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc[h][i] = 0.f;
    }
    uint2 vnew;
    for (int s0 = c0; s0 < c1; s0 += 32) {
        const int t = s0 + lane;
        const bool valid = t < c1;
        const long long slot = valid ? (long long)table[t / page] * page + t % page : 0;  // slot 0 holds finite values
        const uint4* krow = (const uint4*)(kc + slot * slot_stride + g * HEAD_DIM);
        uint4 kr[16];
        #pragma unroll
        for (int i = 0; i < 16; ++i) kr[i] = __ldcg(krow + i);
        // lane's 4 dimensions of each token's value: the first 16 tokens' loaded with the keys, the rest after the
        // scores (all 32 with the keys spill: 9 warps a block leave 168 registers a thread)
        uint2 vr[32];
        #pragma unroll
        for (int j = 0; j < 16; ++j) {  // invalid tokens read slot 0 and get p = 0
            long long sj = __shfl_sync(0xffffffffu, slot, j);
            vr[j] = __ldcg((const uint2*)(vc + sj * slot_stride + g * HEAD_DIM + 4 * lane));
        }
        if (s0 == c0) {  // the queries (and, in the chunk that holds it, this step's key and value), meanwhile
            unsigned x1[GROUP + 1], x2[GROUP + 1];  // every head's values loaded at once (the last: the key's)
            #pragma unroll
            for (int h = 0; h <= GROUP; ++h) {
                const bf16* src = qkv + (h < GROUP ? (g * GROUP + h) * HEAD_DIM : QD + g * HEAD_DIM);
                x1[h] = __ldcg((const unsigned*)(src + 2 * lane));
                x2[h] = __ldcg((const unsigned*)(src + 64 + 2 * lane));
            }
            #pragma unroll
            for (int h = 0; h < GROUP; ++h) {
                float a[2], b[2];
                norm_rope(x1[h], x2[h], w.q_norm, eps, cos_row, sin_row, a, b);
                float* q = qs + h * HEAD_DIM;
                q[2 * lane] = a[0]; q[2 * lane + 1] = a[1]; q[64 + 2 * lane] = b[0]; q[65 + 2 * lane] = b[1];
            }
            if (pos >= c0 && pos < c1) {
                float a[2], b[2];
                norm_rope(x1[GROUP], x2[GROUP], w.k_norm, eps, cos_row, sin_row, a, b);
                const unsigned k1 = rne(a[0]) | (rne(a[1]) << 16), k2 = rne(b[0]) | (rne(b[1]) << 16);
                ((unsigned*)knew)[lane] = k1;
                ((unsigned*)knew)[32 + lane] = k2;
                vnew = __ldcg((const uint2*)(qkv + QD + KVD + g * HEAD_DIM + 4 * lane));
                if (slot_new >= 0) {  // into the cache, for the steps after this one
                    bf16* kd = kc + slot_new * slot_stride + g * HEAD_DIM;
                    *(unsigned*)(kd + 2 * lane) = k1;
                    *(unsigned*)(kd + 64 + 2 * lane) = k2;
                    *(uint2*)(vc + slot_new * slot_stride + g * HEAD_DIM + 4 * lane) = vnew;
                }
            }
            __syncwarp();
        }
        const int jp = pos - s0;  // this step's token among these 32, if 0 <= jp < 32
        if (lane == jp) {
            #pragma unroll
            for (int i = 0; i < 16; ++i) kr[i] = ((const uint4*)knew)[i];
        }
        float s[GROUP];
        #pragma unroll
        for (int h = 0; h < GROUP; ++h) s[h] = 0.f;
        #pragma unroll
        for (int i = 0; i < 16; ++i) {
            unsigned u[4] = {kr[i].x, kr[i].y, kr[i].z, kr[i].w};
            #pragma unroll
            for (int h = 0; h < GROUP; ++h) {
                float4 qa = *(const float4*)(qs + h * HEAD_DIM + i * 8), qb = *(const float4*)(qs + h * HEAD_DIM + i * 8 + 4);
                s[h] += lo(u[0]) * qa.x + hi(u[0]) * qa.y + lo(u[1]) * qa.z + hi(u[1]) * qa.w
                      + lo(u[2]) * qb.x + hi(u[2]) * qb.y + lo(u[3]) * qb.z + hi(u[3]) * qb.w;
            }
        }
        #pragma unroll
        for (int j = 16; j < 32; ++j) {
            long long sj = __shfl_sync(0xffffffffu, slot, j);
            vr[j] = __ldcg((const uint2*)(vc + sj * slot_stride + g * HEAD_DIM + 4 * lane));
        }
        float p[GROUP];
        #pragma unroll
        for (int h = 0; h < GROUP; ++h) {
            float sc = valid ? s[h] * scale : -INFINITY;
            float m_new = fmaxf(m[h], warp_max(sc));  // finite: lane 0's token is valid
            p[h] = __expf(sc - m_new);
            float alpha = __expf(m[h] - m_new);
            l[h] = l[h] * alpha + warp_sum(p[h]);
            m[h] = m_new;
            #pragma unroll
            for (int i = 0; i < 4; ++i) acc[h][i] *= alpha;
        }
        #pragma unroll
        for (int j = 0; j < 32; ++j) {
            uint2 v = j == jp ? vnew : vr[j];
            float v0 = lo(v.x), v1 = hi(v.x), v2 = lo(v.y), v3 = hi(v.y);
            #pragma unroll
            for (int h = 0; h < GROUP; ++h) {
                float pj = __shfl_sync(0xffffffffu, p[h], j);
                acc[h][0] += pj * v0; acc[h][1] += pj * v1; acc[h][2] += pj * v2; acc[h][3] += pj * v3;
            }
        }
    }
    #pragma unroll
    for (int h = 0; h < GROUP; ++h) {
        const int at = (g * GROUP + h) * MAX_CHUNKS + c;
        *(float4*)(part_acc + (long long)at * HEAD_DIM + 4 * lane) = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
        if (lane == 0) { part_ml[2 * at] = m[h]; part_ml[2 * at + 1] = l[h]; }
    }
    __syncwarp();  // qs and knew are reused by the warp's next chunk
}

// One warp: 32 dimensions of one head, merged over the chunks' partials (the first 32 chunks' sums asked for with
// the maxima, not after them).
__device__ void merge_head(const float* part_acc, const float* part_ml, int n_chunks, int head, int d, bf16* out) {
    const int lane = threadIdx.x & 31, base = head * MAX_CHUNKS;
    float first[32];
    #pragma unroll
    for (int c = 0; c < 32; ++c) first[c] = c < n_chunks ? __ldcg(part_acc + (long long)(base + c) * HEAD_DIM + d) : 0.f;
    float m0 = lane < n_chunks ? __ldcg(part_ml + 2 * (base + lane)) : -INFINITY;
    float m1 = lane + 32 < n_chunks ? __ldcg(part_ml + 2 * (base + lane + 32)) : -INFINITY;
    float l0 = lane < n_chunks ? __ldcg(part_ml + 2 * (base + lane) + 1) : 0.f;
    float l1 = lane + 32 < n_chunks ? __ldcg(part_ml + 2 * (base + lane + 32) + 1) : 0.f;
    const float m_all = warp_max(fmaxf(m0, m1));
    const float w0 = lane < n_chunks ? __expf(m0 - m_all) : 0.f, w1 = lane + 32 < n_chunks ? __expf(m1 - m_all) : 0.f;
    const float total = warp_sum(l0 * w0 + l1 * w1);
    float o = 0.f;
    #pragma unroll
    for (int c = 0; c < 32; ++c) o += __shfl_sync(0xffffffffu, w0, c) * first[c];
    for (int c = 32; c < n_chunks; ++c)
        o += __shfl_sync(0xffffffffu, w1, c & 31) * __ldcg(part_acc + (long long)(base + c) * HEAD_DIM + d);
    out[head * HEAD_DIM + d] = (bf16)rne(o / total);
}

extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
decode_step(const Layer* layers, int n_layers, const bf16* embed, const bf16* final_norm, const bf16* lm_head,
            int vocab, const float* cos_t, const float* sin_t, bf16* k_cache, bf16* v_cache, long long layer_stride,
            long long slot_stride, int page, const int* table, const int* ctx_len, const long long* pos_p,
            const long long* slot_p, const long long* id_p, float* logits, bf16* res, bf16* qkv_out, bf16* attn_out,
            bf16* act, float* part_acc, float* part_ml, unsigned* counter, float eps,
            unsigned long long* timeline) {
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* vec = (bf16*)(smem + STAGES * SLOT_BYTES);  // a normed input, the activation, or the warps' queries
    unsigned long long* bars = (unsigned long long*)(smem + STAGES * SLOT_BYTES + VEC_BYTES);
    float* red = (float*)(bars + 2 * STAGES);
    const Ring ring{smem, bars, bars + STAGES};
    const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31;
    if (tid == 0) init_ring(ring.full, ring.empty, STAGES, 1);
    __syncthreads();
    const Split s_qkv(QKV, ROWS_H), s_o(H, ROWS_Q), s_gu(I, 1), s_dn(H, 1), s_lm(vocab, ROWS_H);

    if (warp == WARPS) {  // the producer: weights depend on nothing, so it runs ahead through the whole step
        if (lane == 0 && !NO_WEIGHTS) {
            unsigned it = 0;
            for (int l = 0; l < n_layers; ++l) {
                const Layer w = layers[l];
                for (int j = 0; j < s_qkv.count; ++j) {
                    const int r = s_qkv.item(j) * ROWS_H;
                    ring.produce(it++, w.qkv + (size_t)r * H, min(ROWS_H, QKV - r) * H * 2, 0, 0);
                }
                for (int j = 0; j < s_o.count; ++j) {
                    const int r = s_o.item(j) * ROWS_Q;
                    ring.produce(it++, w.o + (size_t)r * QD, min(ROWS_Q, H - r) * QD * 2, 0, 0);
                }
                for (int j = 0; j < s_gu.count; ++j) {  // gate row r, then up row r
                    const int r = s_gu.item(j);
                    ring.produce(it++, w.gate_up + (size_t)r * H, H * 2, w.gate_up + (size_t)(I + r) * H, H * 2);
                }
                for (int j = 0; j < s_dn.count; ++j) ring.produce(it++, w.down + (size_t)s_dn.item(j) * I, I * 2, 0, 0);
            }
            for (int j = 0; j < s_lm.count; ++j) {
                const int r = s_lm.item(j) * ROWS_H;
                ring.produce(it++, lm_head + (size_t)r * H, min(ROWS_H, vocab - r) * H * 2, 0, 0);
            }
        }
        return;
    }

    const int ctx = *ctx_len;
    const long long pos = *pos_p, slot_new = *slot_p;
    const float* cos_row = cos_t + pos * (HEAD_DIM / 2);
    const float* sin_row = sin_t + pos * (HEAD_DIM / 2);
    const int chunk = 32 * ((ctx + 32 * MAX_CHUNKS - 1) / (32 * MAX_CHUNKS)), n_chunks = (ctx + chunk - 1) / chunk;
    uint4 xr[H / 256];
    unsigned base = 0, barrier = 0;
    const bf16* resid = embed + *id_p * H;  // the residual stream: the token's embedding, then res
    for (int l = 0; l < n_layers; ++l) {
        const Layer w = layers[l];
        bf16* kc = k_cache + l * layer_stride;
        bf16* vc = v_cache + l * layer_stride;
        const int e = l * EVENTS_PER_LAYER;
        MARK(blockIdx.x, e);
        // input norm, qkv rows
        norm_into(resid, w.in_norm, eps, vec, red);
        load_x<H / 256>(vec, xr);
        dot_rows<H / 256>(ring, base, QKV, ROWS_H, xr, [&](int r, float a) { qkv_out[r] = (bf16)rne(a); });
        base += s_qkv.count;
        MARK_ALL(e + 1);
        if (!(SKIP & 1)) grid_wait(counter, ++barrier);
        MARK(blockIdx.x, e + 2);
        // QK-norm, RoPE, KV store, attention: (KV head, chunk) tasks over every warp of the grid
        float* qs = (float*)vec + warp * GROUP * HEAD_DIM;
        bf16* knew = (bf16*)((float*)vec + WARPS * GROUP * HEAD_DIM) + warp * HEAD_DIM;
        // the latency-bound tasks go first to warps 1, 2, 3, 5, 6, 7 (warps 0 and 4 share a scheduler with the producer)
        for (int t = (SKIP & 2) ? 1 << 30 : blockIdx.x + gridDim.x * task_rank(warp); t < NKV * n_chunks; t += gridDim.x * WARPS) {
            const int g = t / n_chunks, c = t % n_chunks;
            attend_chunk(qkv_out, w, eps, cos_row, sin_row, kc, vc, table, page, slot_stride, (int)pos, slot_new, g, c,
                         c * chunk, min(c * chunk + chunk, ctx), qs, knew, part_acc, part_ml);
        }
        MARK_ALL(e + 3);
        if (!(SKIP & 2)) grid_wait(counter, ++barrier);
        MARK(blockIdx.x, e + 4);
        for (int t = (SKIP & 2) ? 1 << 30 : blockIdx.x + gridDim.x * task_rank(warp); t < NQ * (HEAD_DIM / 32); t += gridDim.x * WARPS)
            merge_head(part_acc, part_ml, n_chunks, t / (HEAD_DIM / 32), (t % (HEAD_DIM / 32)) * 32 + lane, attn_out);
        MARK_ALL(e + 5);
        if (!(SKIP & 2)) grid_wait(counter, ++barrier);
        MARK(blockIdx.x, e + 6);
        // o_proj rows, the residual add
        {
            uint4 xo[QD / 256];
            #pragma unroll
            for (int c = 0; c < QD / 256; ++c) xo[c] = __ldcg((const uint4*)(attn_out + c * 256 + lane * 8));
            const bf16* old = resid;
            dot_rows<QD / 256>(ring, base, H, ROWS_Q, xo, [&](int r, float a) {
                res[r] = (bf16)rne(round_bf16(a) + bf(ldg_bf16(old + r)));
            });
            base += s_o.count;
        }
        resid = res;
        MARK_ALL(e + 7);
        if (!(SKIP & 1)) grid_wait(counter, ++barrier);
        MARK(blockIdx.x, e + 8);
        // post-attention norm, gate_up rows with SiLU * up
        norm_into(res, w.post_norm, eps, vec, red);
        load_x<H / 256>(vec, xr);
        for (int j = (warp - (int)(base % WARPS) + WARPS) % WARPS; j < s_gu.count; j += WARPS) {
            const bf16* st = ring.wait_item(base + j);
            float g = 0.f, u = 0.f;
            #pragma unroll
            for (int c = 0; c < H / 256; ++c) {
                g += dot8(*(const uint4*)(st + c * 256 + lane * 8), xr[c]);
                u += dot8(*(const uint4*)(st + H + c * 256 + lane * 8), xr[c]);
            }
            ring.release_item(base + j);
            g = round_bf16(warp_sum(g));
            u = round_bf16(warp_sum(u));
            if (lane == 0) act[s_gu.item(j)] = (bf16)rne(round_bf16(g / (1.f + __expf(-g))) * u);
        }
        base += s_gu.count;
        MARK_ALL(e + 9);
        if (!(SKIP & 1)) grid_wait(counter, ++barrier);
        MARK(blockIdx.x, e + 10);
        // down rows (the activation from shared memory), the residual add
        for (int c = tid; c < I / 8; c += CONSUMERS) ((uint4*)vec)[c] = __ldcg((const uint4*)act + c);
        consumers_sync();
        for (int j = (warp - (int)(base % WARPS) + WARPS) % WARPS; j < s_dn.count; j += WARPS) {
            const bf16* st = ring.wait_item(base + j);
            float a = 0.f;
            #pragma unroll 8
            for (int c = 0; c < I / 256; ++c) a += dot8(*(const uint4*)(st + c * 256 + lane * 8), *(const uint4*)(vec + c * 256 + lane * 8));
            ring.release_item(base + j);
            a = warp_sum(a);
            const int r = s_dn.item(j);
            if (lane == 0) res[r] = (bf16)rne(round_bf16(a) + bf(ldg_bf16(res + r)));
        }
        base += s_dn.count;
        MARK_ALL(e + 11);
        if (!(SKIP & 1)) grid_wait(counter, ++barrier);
    }
    // the final norm, LM head rows
    MARK(blockIdx.x, EVENTS_PER_LAYER * n_layers);
    norm_into(resid, final_norm, eps, vec, red);
    load_x<H / 256>(vec, xr);
    dot_rows<H / 256>(ring, base, vocab, ROWS_H, xr, [&](int r, float a) { logits[r] = round_bf16(a); });
    MARK_ALL(EVENTS_PER_LAYER * n_layers + 1);
    // the last block out resets the counters for the next step (every block is past every barrier by then)
    consumers_sync();
    if (tid == 0 && atomicAdd(&counter[1], 1u) == gridDim.x - 1) { counter[0] = 0; counter[1] = 0; }
}
"""


def source(hidden: int, q_size: int, kv_size: int, intermediate: int, timeline: bool = False,
           no_weights: bool = False, skip: int = 0, interleave: bool = False) -> str:
    """The kernel's CUDA source for these shapes; with `timeline`, it stamps each phase's end. For probing only:
    with `no_weights` no weight is read or multiplied (the norms, attention, merge and grid-wide waits run as they
    are); `skip` (the results are then wrong) 1 leaves out the four grid-wide waits after weight phases, 2 the
    attention, the merge and their two waits, 3 both. `interleave`: a block takes every gridDim.x-th item of each
    weight phase rather than a contiguous share."""
    defines = {"H": hidden, "QD": q_size, "KVD": kv_size, "I": intermediate, "HEAD_DIM": HEAD_DIM, "WARPS": WARPS,
               "STAGES": STAGES, "SLOT_BYTES": SLOT_BYTES, "MAX_CHUNKS": MAX_CHUNKS, "TIMELINE": int(timeline),
               "EVENTS_PER_LAYER": EVENTS_PER_LAYER, "NO_WEIGHTS": int(no_weights), "SKIP": skip,
               "INTERLEAVE": int(interleave)}
    return "".join(f"#define {k} {v}\n" for k, v in defines.items()) + STREAM_HELPERS % () + BODY


def shared_bytes(intermediate: int) -> int:
    return STAGES * SLOT_BYTES + intermediate * 2 + 2 * STAGES * 8 + WARPS * 4


def supports(config, weight_dtype: torch.dtype, cache_dtype: torch.dtype) -> str | None:
    """None if the kernel runs this model's batch-1 decode step, else why not."""
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    why = [(weight_dtype != torch.bfloat16 or cache_dtype != torch.bfloat16, "bf16 weights and cache only"),
           (config.head_dim != HEAD_DIM, f"head_dim {HEAD_DIM} only"),
           (not config.qk_norm or config.attention_bias, "Qwen3 attention only (QK-norm, no bias)"),
           (h % 256 or q % 256 or i % 256, "hidden, q and intermediate sizes must be multiples of 256"),
           (2 * h * 2 > SLOT_BYTES or i * 2 > SLOT_BYTES or q * 2 > SLOT_BYTES, "rows too long for a ring stage"),
           (SLOT_BYTES // (h * 2) > 3 or SLOT_BYTES // (q * 2) > 3, "rows too short (at most 3 a stage)"),
           ((q // HEAD_DIM) % (kv // HEAD_DIM) or (q // kv) * HEAD_DIM * 4 * WARPS + WARPS * HEAD_DIM * 2 > i * 2,
            "GQA group too large"),
           (shared_bytes(i) > 227 * 1024, "shared memory")]
    return next((reason for bad, reason in why if bad), None)


@dataclass
class Scratch:
    """The kernel's device buffers between phases (written and read within a step)."""
    res: torch.Tensor
    qkv: torch.Tensor
    attn: torch.Tensor
    act: torch.Tensor
    part_acc: torch.Tensor
    part_ml: torch.Tensor
    counter: torch.Tensor


class DecodeStepKernel:
    """The batch-1 decode step of one model over its paged KV cache: `__call__` fills `logits` [1, vocab] float32
    from the step's token id, position, slot, context length and block table (device tensors, read at run time,
    so the call can be captured in a CUDA graph once and replayed)."""

    def __init__(self, model, k_cache: torch.Tensor, v_cache: torch.Tensor, n_layers: int | None = None,
                 timeline: bool = False, no_weights: bool = False, skip: int = 0, interleave: bool = False):
        if skip not in (0, 1, 2, 3):
            raise ValueError(f"skip: 0, 1, 2 or 3 (see source), not {skip!r}")
        cfg = model.config
        why = supports(cfg, model.lm_head.weight.dtype, k_cache.dtype)
        if why:
            raise ValueError(f"the decode-step kernel does not run this model: {why}")
        dev = k_cache.device
        self.cfg, self.k_cache, self.v_cache, self.model = cfg, k_cache, v_cache, model
        self.n_layers = n_layers or cfg.num_hidden_layers
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
        self.page = k_cache.shape[2]
        rows = []
        for layer in model.model.layers[:self.n_layers]:
            a, m = layer.self_attn, layer.mlp
            for t, shape in ((layer.input_layernorm.weight, (cfg.hidden_size,)),
                             (a.qkv_proj.weight, (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)),
                             (a.q_norm.weight, (HEAD_DIM,)), (a.k_norm.weight, (HEAD_DIM,)),
                             (a.o_proj.weight, (cfg.hidden_size, cfg.q_size)),
                             (layer.post_attention_layernorm.weight, (cfg.hidden_size,)),
                             (m.gate_up_proj.weight, (2 * cfg.intermediate_size, cfg.hidden_size)),
                             (m.down_proj.weight, (cfg.hidden_size, cfg.intermediate_size))):
                assert tuple(t.shape) == shape and t.is_contiguous() and t.dtype == torch.bfloat16, shape
                rows.append(t.data_ptr())
        self.layers = torch.tensor(rows, dtype=torch.int64, device=dev)  # Layer structs: 8 pointers each
        self.rotary = model.rotary
        self.scratch = Scratch(
            res=torch.empty(cfg.hidden_size, dtype=torch.bfloat16, device=dev),
            qkv=torch.empty(cfg.q_size + 2 * cfg.kv_size, dtype=torch.bfloat16, device=dev),
            attn=torch.empty(cfg.q_size, dtype=torch.bfloat16, device=dev),
            act=torch.empty(cfg.intermediate_size, dtype=torch.bfloat16, device=dev),
            part_acc=torch.empty(cfg.num_attention_heads * MAX_CHUNKS * HEAD_DIM, dtype=torch.float32, device=dev),
            part_ml=torch.empty(cfg.num_attention_heads * MAX_CHUNKS * 2, dtype=torch.float32, device=dev),
            counter=torch.zeros(2, dtype=torch.int32, device=dev))
        self.shared = shared_bytes(cfg.intermediate_size)
        code = source(cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, timeline, no_weights, skip,
                      interleave)
        self.kernel = torch.cuda._compile_kernel(code, "decode_step",
                                                 compute_capability="%d%d" % torch.cuda.get_device_capability(dev))
        self.kernel.set_shared_memory_config(self.shared)
        self.grid = torch.cuda.get_device_properties(dev).multi_processor_count
        # with `timeline`: [blocks] x [EVENTS_PER_LAYER a layer, then the LM head's start and end] ns stamps
        self.timeline = torch.zeros(self.grid, EVENTS_PER_LAYER * self.n_layers + 2, dtype=torch.int64,
                                    device=dev) if timeline else None

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor,
                 block_tables: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """ids, positions, slots: [1] int64; context_lens [1] int32; block_tables [1, width] int32 -> [1, vocab]."""
        m, s = self.model, self.scratch
        if logits is None:
            logits = torch.empty(1, self.cfg.vocab_size, dtype=torch.float32, device=ids.device)
        args = [self.layers, self.n_layers, m.model.embed_tokens.weight, m.model.norm.weight, m.lm_head.weight,
                self.cfg.vocab_size, self.rotary.cos, self.rotary.sin, self.k_cache, self.v_cache,
                ctypes.c_longlong(self.k_cache.stride(0)), ctypes.c_longlong(self.k_cache.stride(2)), self.page,
                block_tables, context_lens, positions, slots, ids, logits, s.res, s.qkv, s.attn, s.act, s.part_acc,
                s.part_ml, s.counter, float(self.cfg.rms_norm_eps),
                self.timeline if self.timeline is not None else ctypes.c_void_p(0)]
        launch(self.kernel, self.grid, (WARPS + 1) * 32, args, pdl=False, shared=self.shared)
        return logits
