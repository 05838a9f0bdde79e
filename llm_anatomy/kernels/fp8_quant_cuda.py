"""Per-token fp8 quantization of activations (fp8_quant.quantize_rows) as a CUDA kernel whose row is shared by a
thread-block cluster.

The Triton kernel gives a row to one program, which loads it, reduces it to its largest magnitude and only then
writes it: a decode step's 512 rows of SiLU(gate) * up (2 x 12288 values) are four waves of one 48 KB row a
multiprocessor, each wave waiting for its loads before its reduction and stores. Here a row is cut into CLUSTER
contiguous pieces, one block of 128 threads each, and the blocks of a cluster (Hopper) exchange their pieces'
largest magnitudes through distributed shared memory. Each thread issues all its loads before it computes and keeps
its values as packed bf16 (SiLU(gate) * up is rounded to bf16 anyway), so that a multiprocessor holds MIN_BLOCKS
blocks and many rows' pieces are in flight at once.

The arithmetic is the Triton kernel's, bit for bit (its PTX as Triton 3 lowers it): SiLU(gate) * up as
activation.silu_mul_rounded (exp(-g) as ex2.approx of g * -log2(e), 1 / (1 + e) as div.full, SiLU rounded to
bf16, then the product rounded to bf16), the scale max(amax, 1e-12) / 448 and each value over it with IEEE
division, clamped to +-448 and rounded to nearest even e4m3. bf16 rows only (the W8A8 path's dtype). Written
plainly, the kernel's time goes to issuing its instructions more than to memory, so it reaches the same results in
fewer: the SiLU without div.full's and ex2's range handling for gates where that changes nothing, two lanes rounded
and multiplied by one instruction (cuda.BF16X2), the division by the row's scale with its reciprocal taken once a
row (cuda.ROW_DIVISION). The GPU tests check each against the plain form for every bf16 input.

An engine's plan (engine/plan.py, cuda_gated_quant) sends it the gated rows, the down projection's input; the
plain rows of a hidden state's length stay with the Triton kernel, which is the faster there (benchmarks/README.md).
"""

from __future__ import annotations

import logging
from functools import cache

import torch

from .cuda import BF16X2, ROW_DIVISION, compile_kernel, launch

THREADS = 128  # a block's threads; each loads 8 values (16 bytes) of its row at a time
MAX_ITEMS = 3  # 8-value pieces a thread holds at most while CLUSTER may still grow: 3072 columns a block
MAX_CLUSTER = 8  # the portable cluster size
MAX_K = MAX_CLUSTER * 8 * THREADS * 8  # rows up to 65536 values: at most 8 pieces a thread
MIN_BLOCKS = 8  # blocks a multiprocessor must fit (__launch_bounds__): the registers a thread may take

HELPERS = r"""
__device__ __forceinline__ float ex2_approx(float x) { float r; asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
__device__ __forceinline__ float div_full(float a, float b) {
    float r; asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float round_bf16(float f) {
    unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return __uint_as_float((unsigned)h << 16);
}
__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
// activation.silu_mul_rounded as Triton lowers it: sigmoid(g) = 1 / (1 + exp(-g)), exp(-g) = 2^(g * -log2 e)
__device__ __forceinline__ float silu_mul(float g, float u) {
    const float sig = div_full(1.0f, __fadd_rn(ex2_approx(__fmul_rn(g, -1.4426950408889634f)), 1.0f));
    return round_bf16(__fmul_rn(round_bf16(__fmul_rn(g, sig)), u));
}
__device__ __forceinline__ unsigned silu_mul2(unsigned g, unsigned u) {  // two bf16 lanes; the results are bf16
    return (__float_as_uint(silu_mul(bf16_lo(g), bf16_lo(u))) >> 16)
         | (__float_as_uint(silu_mul(bf16_hi(g), bf16_hi(u))) & 0xffff0000u);
}
// The same for gates >= FAST_GATE_MIN, in fewer instructions:
// there d = 1 + exp(-g) <= 2^126, where div.full(1, d) is rcp.approx(d) itself, and .ftz changes no result (where
// ex2's result is subnormal, 1 + it is 1 either way); two lanes at once where rounding to bf16 (cuda.BF16X2).
// The GPU test checks it against silu_mul2 for every bf16 gate.
#define FAST_GATE_MIN -87.0f
__device__ __forceinline__ float ex2_ftz(float x) {
    float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r;
}
__device__ __forceinline__ float rcp_ftz(float x) {
    float r; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r;
}
__device__ __forceinline__ float silu_fast(float g) {
    return __fmul_rn(g, rcp_ftz(__fadd_rn(ex2_ftz(__fmul_rn(g, -1.4426950408889634f)), 1.0f)));
}
__device__ __forceinline__ unsigned silu_mul2_fast(unsigned g, unsigned u) {
    return mul_bf16x2(bf16x2(silu_fast(bf16_lo(g)), silu_fast(bf16_hi(g))), u);
}
// Lane-wise on two bf16 values (exact: a bf16 max is one of its operands; a NaN operand is passed over, as fmaxf)
__device__ __forceinline__ unsigned max_abs2(unsigned m, unsigned w) {
    unsigned r; asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(m), "r"(w & 0x7fff7fffu)); return r;
}
__device__ __forceinline__ unsigned min2(unsigned m, unsigned w) {
    unsigned r; asm("min.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(m), "r"(w)); return r;
}
// Four bf16 values (two words, the lowest first) over the scale -> four e4m3 bytes, the first in the lowest byte
__device__ __forceinline__ unsigned e4m3x4(unsigned w0, unsigned w1, RowDivisor scale) {
    unsigned short lo, hi;  // cvt puts its first operand in the upper byte
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo)
        : "f"(e4m3_range(bf16_hi(w0), scale)), "f"(e4m3_range(bf16_lo(w0), scale)));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi)
        : "f"(e4m3_range(bf16_hi(w1), scale)), "f"(e4m3_range(bf16_lo(w1), scale)));
    return (unsigned)lo | ((unsigned)hi << 16);
}
"""

KERNEL = r"""
// x [rows, K] bf16 (gated: [rows, 2K] = [gate, up]) -> q [rows, K] e4m3, scales [rows] float32. Block `rank` of
// the row's cluster takes columns [rank * CHUNK, (rank + 1) * CHUNK), its thread i the 8 columns at
// rank * CHUNK + 8 * (item * THREADS + i) for each item. The grid is whole clusters; a block past the last row
// still joins its cluster's barriers. A thread's values stay packed bf16 (SiLU(gate) * up is rounded to bf16, the
// plain rows are bf16): the fewer registers, the more blocks a multiprocessor holds, the more rows in flight.
extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, MIN_BLOCKS)
quantize_rows(const unsigned short* x, unsigned char* q, float* scales, int rows, int stride_x, int stride_q) {
    __shared__ float warp_max[THREADS / 32];
    __shared__ float block_max;
    // Launched early (PDL): wait for the kernel before, then let the next one launch
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
    const int row = blockIdx.x / CLUSTER, rank = blockIdx.x % CLUSTER;  // 1-D clusters: consecutive blocks
    const bool live = row < rows;
    const unsigned short* xr = x + (long long)row * stride_x;
    uint4 val[ITEMS];
#if GATED
    uint4 up[ITEMS];
#endif
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {  // every load first: the block's whole piece in flight at once
        const int col = rank * CHUNK + 8 * (i * THREADS + threadIdx.x);
        const bool ok = live && col < K;
        val[i] = ok ? *(const uint4*)(xr + col) : make_uint4(0, 0, 0, 0);
#if GATED
        up[i] = ok ? *(const uint4*)(xr + K + col) : make_uint4(0, 0, 0, 0);
#endif
    }
#if GATED  // the fast SiLU unless one of this thread's gates is below its range (the branch is the warp's, but for
          // rows that hold such gates)
    unsigned low = 0x7f807f80u;  // +inf, +inf
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) low = min2(min2(low, min2(val[i].x, val[i].y)), min2(val[i].z, val[i].w));
    if (fminf(bf16_lo(low), bf16_hi(low)) >= FAST_GATE_MIN) {
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i)
            val[i] = make_uint4(silu_mul2_fast(val[i].x, up[i].x), silu_mul2_fast(val[i].y, up[i].y),
                                silu_mul2_fast(val[i].z, up[i].z), silu_mul2_fast(val[i].w, up[i].w));
    } else {
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i)
            val[i] = make_uint4(silu_mul2(val[i].x, up[i].x), silu_mul2(val[i].y, up[i].y),
                                silu_mul2(val[i].z, up[i].z), silu_mul2(val[i].w, up[i].w));
    }
#endif
    unsigned amax2 = 0;  // padding is 0
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i)
        amax2 = max_abs2(max_abs2(max_abs2(max_abs2(amax2, val[i].x), val[i].y), val[i].z), val[i].w);
    float amax = fmaxf(bf16_lo(amax2), bf16_hi(amax2));
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = warp_max[0];
        #pragma unroll
        for (int w = 1; w < THREADS / 32; ++w) m = fmaxf(m, warp_max[w]);
        block_max = m;
    }
#if CLUSTER > 1
    // The cluster's blocks publish their maxima, then each reads all of them from the others' shared memory
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    const unsigned local = (unsigned)__cvta_generic_to_shared(&block_max);
    amax = 0.0f;
    #pragma unroll
    for (int r = 0; r < CLUSTER; ++r) {
        unsigned remote;
        float m;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(r));
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(m) : "r"(remote) : "memory");
        amax = fmaxf(amax, m);
    }
    // Done reading: a block's shared memory must outlive the others' reads, so none exits before this barrier
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#else
    __syncthreads();
    amax = block_max;
#endif
    const float scale = __fdiv_rn(fmaxf(amax, 1e-12f), 448.0f);
    const RowDivisor divisor = row_divisor(scale);
    unsigned char* qr = q + (long long)row * stride_q;
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int col = rank * CHUNK + 8 * (i * THREADS + threadIdx.x);
        if (live && col < K)
            *(uint2*)(qr + col) = make_uint2(e4m3x4(val[i].x, val[i].y, divisor), e4m3x4(val[i].z, val[i].w, divisor));
    }
    if (live && rank == 0 && threadIdx.x == 0) scales[row] = scale;
#if CLUSTER > 1
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
"""

log = logging.getLogger("llm_anatomy")


def launch_shape(k: int) -> tuple[int, int]:
    """(CLUSTER, ITEMS) for rows of k values: blocks of up to MAX_ITEMS x 1024 columns, as many as the row needs up to
    MAX_CLUSTER (more columns a block past that), the columns then spread evenly over them."""
    per_item = 8 * THREADS
    items = max(min(MAX_ITEMS, -(-k // per_item)), -(-k // (MAX_CLUSTER * per_item)))
    cluster = -(-k // (items * per_item))
    return cluster, -(-k // (cluster * per_item))


def source(k: int, gated: bool, min_blocks: int = MIN_BLOCKS) -> str:
    cluster, items = launch_shape(k)
    min_blocks = max(1, min_blocks * MAX_ITEMS // max(MAX_ITEMS, items))  # longer rows' threads hold more
    return (f"#define K {k}\n#define GATED {int(gated)}\n#define CLUSTER {cluster}\n#define ITEMS {items}\n"
            f"#define THREADS {THREADS}\n#define CHUNK {items * 8 * THREADS}\n#define MIN_BLOCKS {min_blocks}\n"
            + ROW_DIVISION + BF16X2 + HELPERS + KERNEL)


@cache
def _compiles(device_index: int) -> bool:
    try:
        with torch.cuda.device(device_index):
            compile_kernel(source(4096, True), "quantize_rows", device_index, 0)
    except Exception as e:  # no NVRTC in this PyTorch build: the Triton kernel quantizes
        log.warning("the CUDA fp8 row quantization did not compile (%s); the Triton kernel serves",
                    str(e).splitlines()[0])
        return False
    return True


def available(device: torch.device) -> bool:
    """Whether this kernel runs on the device: Hopper or later (clusters), where NVRTC compiles it (checked once)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
            and _compiles(device.index if device.index is not None else torch.cuda.current_device()))


def supports(x: torch.Tensor, gated: bool) -> bool:
    """Whether these rows fit the kernel: bf16 on a CUDA device, rows contiguous and 16-byte aligned, a row's
    (gated: each half's) length a multiple of 8."""
    if not x.is_cuda or x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
        return False
    k = x.shape[1] // 2 if gated else x.shape[1]
    return (k > 0 and k % 8 == 0 and (not gated or x.shape[1] == 2 * k) and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0 and k <= MAX_K)


def quantize_rows(x: torch.Tensor, gated: bool = False, pdl: bool = False, min_blocks: int = MIN_BLOCKS
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_quant.quantize_rows (the same values and scales) for rows `supports` accepts, else ValueError.
    min_blocks: the kernel's variant (MIN_BLOCKS says what it is)."""
    if not supports(x, gated):
        raise ValueError(f"fp8_quant_cuda.quantize_rows: rows {tuple(x.shape)} {x.dtype} (stride {x.stride()}) are "
                         "not contiguous 16-byte aligned bf16 rows of a multiple of 8 values")
    rows, k = x.shape[0], x.shape[1] // (2 if gated else 1)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        cluster, _ = launch_shape(k)
        with torch.cuda.device(x.device):
            kernel = compile_kernel(source(k, gated, min_blocks), "quantize_rows", x.device.index, 0)
            launch(kernel, rows * cluster, THREADS, [x, q, scale, rows, x.stride(0), q.stride(0)], pdl=pdl)
    return q, scale
