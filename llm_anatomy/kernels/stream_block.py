"""Batch-1 decode: a layer's o_proj, residual add, RMSNorm and MLP as one persistent CUDA C++ kernel that streams
its weights (cuda.py builds and launches it).

Each decode GEMV launched on its own pays about 2 us beyond its bytes (ramp, drain, the wait for the kernel
before; benchmarks/RESULTS.md, eighth session), and the layer has four. Here one block per multiprocessor does a
layer's second half: a producer warp streams the block's rows of o_proj, then of gate_up, then of down, through a
ring of shared-memory stages (bulk copies completing on mbarriers), from the kernel's start: before the PDL wait,
since weights depend on nothing, and on through the two grid-wide waits (o_proj's output, then SiLU*up's, must be
complete before anyone reads them). Eight consumer warps each own one stage and take every eighth item; a warp
dots whole rows with the input it holds. The residual add and RMSNorm are done by every block for itself.
Numerics are HF's (each projection, the residual add, the norm and SiLU*up rounded to bf16), as in the Triton
path. On the H200 with Qwen3-8B's MLP, 36 layers took 73.9 us a layer against 75.4 for the kernels it replaces
(benchmarks/probe_stream_mlp.py).

The kernel needs all its blocks resident at once (one per multiprocessor, for the grid-wide waits), bf16, one
token, and row lengths that are multiples of 256; `supports` says when it applies, else the Triton path runs.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from . import cuda
from .pdl import PDL

WARPS = 8  # consumer warps, one ring stage each
SOURCE = r"""
#define H %(H)d
#define Q %(Q)d
#define I %(I)d
#define O_ROWS %(O_ROWS)d
#define SLOT_BYTES %(SLOT)d
#define VEC %(VEC)d
#define WARPS %(WARPS)d
#define O_PROJ %(O_PROJ)d  // 1: attn is the attention's output, o_proj is done here; 0: attn is o_proj's output
#define STAGES WARPS
#define CONSUMERS (WARPS * 32)
typedef unsigned short bf16;

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ bool mbar_done(unsigned bar, unsigned parity) {
    unsigned ok;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%%1], %%2; selp.u32 %%0, 1, 0, p; }"
                 : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    return ok;
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) { while (!mbar_done(bar, parity)) {} }
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void expect_bytes(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%%0], %%1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%%0], [%%1], %%2, [%%3];"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %%0;" :: "n"(CONSUMERS) : "memory"); }
__device__ __forceinline__ float lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ unsigned rne(float f) {  // float -> bf16 bits, round to nearest even
    unsigned u = __float_as_uint(f);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ float round_bf16(float f) { return __uint_as_float(rne(f) << 16); }
__device__ __forceinline__ unsigned pack(float a, float b) { return rne(a) | (rne(b) << 16); }
__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
    return lo(w.x) * lo(x.x) + hi(w.x) * hi(x.x) + lo(w.y) * lo(x.y) + hi(w.y) * hi(x.y)
         + lo(w.z) * lo(x.z) + hi(w.z) * hi(x.z) + lo(w.w) * lo(x.w) + hi(w.w) * hi(x.w);
}
__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ int first_item(int start, int warp) { return start + (warp - start %% WARPS + WARPS) %% WARPS; }
__device__ __forceinline__ void grid_wait(unsigned* count, int tid) {
    // every block's writes before this point visible to every block after it; the counts are left at zero
    __threadfence();
    consumers_sync();
    if (tid == 0) {
        atomicAdd(&count[0], 1u);
        unsigned seen;
        do { asm volatile("ld.acquire.gpu.u32 %%0, [%%1];" : "=r"(seen) : "l"(count) : "memory"); }
        while (seen < gridDim.x);
        if (atomicAdd(&count[1], 1u) == gridDim.x - 1) { count[0] = 0; count[1] = 0; }  // all are past it
    }
    consumers_sync();
}

// attn: the attention's output (Q); res: the residual stream, res <- o_proj(attn) + res;
// out <- down(SiLU(gate) * up) of RMSNorm(res). o_buf (H), act (I): scratch; count: four zeros, left at zero.
extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
gemv_stream_block(const bf16* attn, const bf16* o_w, bf16* o_buf, bf16* res, const bf16* norm_w,
                  const bf16* gate_up, const bf16* down, bf16* act, bf16* out, unsigned* count, float eps) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring = smem;
    bf16* vec = (bf16*)(smem + STAGES * SLOT_BYTES);  // the normed input, then SiLU * up
    unsigned long long* full = (unsigned long long*)(smem + STAGES * SLOT_BYTES + VEC * 2);
    unsigned long long* empty = full + STAGES;
    float* red = (float*)(empty + STAGES);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid %% 32;
    const int ra = blockIdx.x * H / gridDim.x, rows = (blockIdx.x + 1) * H / gridDim.x - ra;  // o_proj, down
    const int ga = blockIdx.x * I / gridDim.x, n_gu = (blockIdx.x + 1) * I / gridDim.x - ga;   // gate/up
    const int n_op = O_PROJ ? (rows + O_ROWS - 1) / O_ROWS : 0, gu0 = n_op, dn0 = n_op + n_gu, items = dn0 + rows;
    const bf16* o_in = O_PROJ ? (const bf16*)o_buf : attn;  // the attention block's output
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%%0], 1;" :: "r"(smem_addr(&full[s])));
            asm volatile("mbarrier.init.shared::cta.b64 [%%0], 1;" :: "r"(smem_addr(&empty[s])));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp == WARPS) {  // the producer: the weights depend on nothing, so it does not wait for the kernel before
        if (lane == 0) {
            for (int it = 0; it < items; ++it) {
                int slot = it %% STAGES, round = it / STAGES;
                if (round > 0) mbar_wait(smem_addr(&empty[slot]), (round - 1) & 1);
                unsigned bar = smem_addr(&full[slot]);
                unsigned char* dst = ring + slot * SLOT_BYTES;
                if (it < gu0) {  // up to O_ROWS rows of o_proj
                    int r = it * O_ROWS, n = min(O_ROWS, rows - r);
                    expect_bytes(bar, n * Q * 2);
                    bulk_load(dst, o_w + (size_t)(ra + r) * Q, n * Q * 2, bar);
                } else if (it < dn0) {  // a gate row and its up row
                    size_t g = ga + it - gu0;
                    expect_bytes(bar, 2 * H * 2);
                    bulk_load(dst, gate_up + g * H, H * 2, bar);
                    bulk_load(dst + H * 2, gate_up + (I + g) * H, H * 2, bar);
                } else {  // a down row
                    expect_bytes(bar, I * 2);
                    bulk_load(dst, down + (size_t)(ra + it - dn0) * I, I * 2, bar);
                }
            }
        }
        return;
    }

    asm volatile("griddepcontrol.wait;" ::: "memory");  // attn and res come from the kernels before
    asm volatile("griddepcontrol.launch_dependents;" :::);

    // o_proj: this block's rows; lane l holds attn's columns c * 256 + l * 8 .. + 7
    if (O_PROJ) {
        uint4 xr[Q / 256];
        #pragma unroll
        for (int c = 0; c < Q / 256; ++c) xr[c] = __ldcg((const uint4*)(attn + c * 256 + lane * 8));
        for (int it = warp; it < gu0; it += WARPS) {
            mbar_wait(smem_addr(&full[warp]), (it / STAGES) & 1);
            const bf16* stage = (const bf16*)(ring + warp * SLOT_BYTES);
            int r0 = it * O_ROWS, n = min(O_ROWS, rows - r0);
            float acc[O_ROWS];
            #pragma unroll
            for (int r = 0; r < O_ROWS; ++r) {
                float a = 0.f;
                if (r < n) {
                    #pragma unroll
                    for (int c = 0; c < Q / 256; ++c) a += dot8(*(const uint4*)(stage + r * Q + c * 256 + lane * 8), xr[c]);
                }
                acc[r] = a;
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(smem_addr(&empty[warp]));
            float mine = 0.f;
            #pragma unroll
            for (int r = 0; r < O_ROWS; ++r) { float s = warp_sum(acc[r]); if (r == lane) mine = s; }
            if (lane < n) o_buf[ra + r0 + lane] = (bf16)rne(mine);
        }
        grid_wait(count, tid);
    }

    // h = bf16(o + res); normed = bf16(bf16(h * rms(h)) * w): every block for itself, 8 columns a thread at a time
    float ss = 0.f;
    for (int c = tid; c < H / 8; c += CONSUMERS) {
        uint4 o = __ldcg((const uint4*)o_in + c), r = __ldcg((const uint4*)res + c);
        unsigned ow[4] = {o.x, o.y, o.z, o.w}, rw[4] = {r.x, r.y, r.z, r.w};
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            float a = round_bf16(lo(ow[i]) + lo(rw[i])), b = round_bf16(hi(ow[i]) + hi(rw[i]));
            ss += a * a + b * b;
        }
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    consumers_sync();
    float total = 0.f;
    #pragma unroll
    for (int k = 0; k < WARPS; ++k) total += red[k];
    const float inv = rsqrtf(total / H + eps);
    for (int c = tid; c < H / 8; c += CONSUMERS) {
        uint4 o = __ldcg((const uint4*)o_in + c), r = __ldcg((const uint4*)res + c), w = *((const uint4*)norm_w + c);
        unsigned ow[4] = {o.x, o.y, o.z, o.w}, rw[4] = {r.x, r.y, r.z, r.w}, ww[4] = {w.x, w.y, w.z, w.w}, nw[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            float a = round_bf16(lo(ow[i]) + lo(rw[i])), b = round_bf16(hi(ow[i]) + hi(rw[i]));
            nw[i] = pack(round_bf16(a * inv) * lo(ww[i]), round_bf16(b * inv) * hi(ww[i]));
        }
        ((uint4*)vec)[c] = make_uint4(nw[0], nw[1], nw[2], nw[3]);
    }
    consumers_sync();

    // gate_up with SiLU(gate) * up: a warp per (gate row, up row)
    {
        uint4 xr[H / 256];
        #pragma unroll
        for (int c = 0; c < H / 256; ++c) xr[c] = *(const uint4*)(vec + c * 256 + lane * 8);
        for (int it = first_item(gu0, warp); it < dn0; it += WARPS) {
            mbar_wait(smem_addr(&full[warp]), (it / STAGES) & 1);
            const bf16* stage = (const bf16*)(ring + warp * SLOT_BYTES);
            float g = 0.f, u = 0.f;
            #pragma unroll
            for (int c = 0; c < H / 256; ++c) {
                g += dot8(*(const uint4*)(stage + c * 256 + lane * 8), xr[c]);
                u += dot8(*(const uint4*)(stage + H + c * 256 + lane * 8), xr[c]);
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(smem_addr(&empty[warp]));
            g = round_bf16(warp_sum(g));
            u = round_bf16(warp_sum(u));
            if (lane == 0) act[ga + it - gu0] = (bf16)rne(round_bf16(g / (1.f + __expf(-g))) * u);
        }
    }
    grid_wait(count + 2, tid);

    if (blockIdx.x == 0) {  // every block has read res by now
        for (int c = tid; c < H / 8; c += CONSUMERS) {
            uint4 o = __ldcg((const uint4*)o_in + c), r = __ldcg((const uint4*)res + c);
            ((uint4*)res)[c] = make_uint4(pack(round_bf16(lo(o.x) + lo(r.x)), round_bf16(hi(o.x) + hi(r.x))),
                                          pack(round_bf16(lo(o.y) + lo(r.y)), round_bf16(hi(o.y) + hi(r.y))),
                                          pack(round_bf16(lo(o.z) + lo(r.z)), round_bf16(hi(o.z) + hi(r.z))),
                                          pack(round_bf16(lo(o.w) + lo(r.w)), round_bf16(hi(o.w) + hi(r.w))));
        }
    }
    for (int c = tid; c < I / 8; c += CONSUMERS) ((uint4*)vec)[c] = __ldcg((const uint4*)act + c);
    consumers_sync();

    // down: a warp per row
    for (int it = first_item(dn0, warp); it < items; it += WARPS) {
        mbar_wait(smem_addr(&full[warp]), (it / STAGES) & 1);
        const bf16* row = (const bf16*)(ring + warp * SLOT_BYTES);
        float a = 0.f;
        #pragma unroll 8
        for (int c = 0; c < I / 256; ++c)
            a += dot8(*(const uint4*)(row + c * 256 + lane * 8), *(const uint4*)(vec + c * 256 + lane * 8));
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_addr(&empty[warp]));
        a = warp_sum(a);
        if (lane == 0) out[ra + it - dn0] = (bf16)rne(a);
    }
}
"""


class _Switch:
    on = True
    with_o_proj = True


STREAM = _Switch()  # off: the Triton path (start-up's tile tuning times the GEMVs it replaces)


@contextlib.contextmanager
def disabled():
    before, STREAM.on = STREAM.on, False
    try:
        yield
    finally:
        STREAM.on = before


def layout(h: int, q: int, i: int) -> tuple[int, int, int]:
    """(stage bytes, o_proj rows per stage, dynamic shared memory bytes): a stage holds a gate row and its up
    row, a down row, or as many o_proj rows as fit."""
    slot = max(2 * h * 2, i * 2, q * 2)
    return slot, slot // (q * 2), WARPS * slot + 2 * max(h, i) + 2 * WARPS * 8 + WARPS * 4


@functools.cache
def _shared_limit(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", 48 * 1024)


def supports(attn: torch.Tensor, o_proj: torch.nn.Linear, norm_weight: torch.Tensor, gate_up: torch.nn.Linear,
             down: torch.nn.Linear) -> bool:
    """Whether the kernel takes this layer's decode step: on, one token, bf16 without biases, contiguous,
    multiples of 256, and its shared memory fits the GPU."""
    if not (STREAM.on and attn.shape[0] == 1 and cuda.available(attn.device)):
        return False
    weights = (o_proj.weight, norm_weight, gate_up.weight, down.weight)
    if any(w.dtype != torch.bfloat16 or not w.is_contiguous() for w in weights) or attn.dtype != torch.bfloat16:
        return False
    if o_proj.bias is not None or gate_up.bias is not None or down.bias is not None:
        return False
    h, q, i = o_proj.out_features, o_proj.in_features, down.in_features
    if h % 256 or q % 256 or i % 256:
        return False
    return layout(h, q, i)[2] <= _shared_limit(attn.device.index or 0)


@functools.cache
def _counts(device: torch.device) -> torch.Tensor:
    return torch.zeros(4, dtype=torch.int32, device=device)  # the kernel leaves them at zero


def stream_block(attn: torch.Tensor, residual: torch.Tensor, o_proj: torch.Tensor, norm_weight: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor, eps: float, with_o_proj: bool = True) -> torch.Tensor:
    """attn [1, q] (the attention's output), residual [1, h] (updated in place: residual + o_proj(attn)) ->
    the MLP's output [1, h] of RMSNorm(new residual). Weights as the model holds them: o_proj [h, q], gate_up
    [2i, h] (gate rows, then up rows), down [h, i]. Without with_o_proj, attn is o_proj's output already."""
    h, q = o_proj.shape
    i = down.shape[1]
    slot, o_rows, shared = layout(h, q, i)
    dev = attn.device
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    source = SOURCE % {"H": h, "Q": q, "I": i, "O_ROWS": o_rows, "SLOT": slot, "VEC": max(h, i), "WARPS": WARPS,
                       "O_PROJ": int(with_o_proj)}
    kernel = cuda.compile_kernel(source, "gemv_stream_block", index, shared)
    o_buf = torch.empty(h, dtype=attn.dtype, device=dev)
    act = torch.empty(i, dtype=attn.dtype, device=dev)
    out = torch.empty(1, h, dtype=attn.dtype, device=dev)
    blocks = torch.cuda.get_device_properties(index).multi_processor_count
    cuda.launch(kernel, blocks, 32 * (WARPS + 1), [attn.contiguous(), o_proj, o_buf, residual, norm_weight, gate_up,
                                                    down, act, out, _counts(dev), float(eps)], shared, pdl=PDL.on)
    return out


def stream_block_reference(attn, residual, o_proj, norm_weight, gate_up, down, eps):
    """The same in PyTorch, HF's rounding (float32 products rounded to bf16); updates residual in place."""
    from .norm import rmsnorm_reference

    o = (attn.float() @ o_proj.float().T).to(attn.dtype)
    normed = rmsnorm_reference(o, norm_weight, eps, residual=residual)
    gate, up = (normed.float() @ gate_up.float().T).to(attn.dtype).chunk(2, dim=-1)
    return ((torch.nn.functional.silu(gate) * up).float() @ down.float().T).to(attn.dtype)
