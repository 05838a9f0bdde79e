"""The decode MLP block as one persistent CUDA C++ kernel that streams its weights, against the engine's kernels.

probe_stream_chain.py showed a persistent kernel streaming weights through shared memory across dependent
products beating one GEMV launch per product. Here the same design does a whole batch-1 MLP block of
Qwen3-8B: the residual add and RMSNorm (every block computes them itself), gate_up with SiLU*up, a grid-wide
wait for the activation, then down. A producer warp streams the block's gate/up rows and then its down rows
into a ring of shared-memory stages from the kernel's start, before the programmatic-dependent-launch wait
and through the grid-wide one; eight consumer warps each take whole rows (a warp-wide dot product).

Timed: 36 layers (each its own weights, each layer's input the last one's output) in a CUDA graph with PDL,
against the engine's path (norm kernel, gated GEMV, GEMV; its start-up's tiles where XDG_CACHE_HOME holds them),
interleaved over rounds. Checked: the first layer's output and residual
against float32 products in PyTorch rounded as HF rounds, and the 36th layer's against the engine's path.

    python3 benchmarks/probe_stream_mlp.py --out $OUT/stream_mlp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_h200 import cuda_ms, positive_int
from llm_anatomy.engine.tuning import cached_tiles, device_tag
from llm_anatomy.kernels import gemv, norm
from llm_anatomy.kernels.pdl import enable_pdl
from llm_anatomy.kernels.cuda import STREAM_HELPERS, launch

LAYERS, HIDDEN, INTER, EPS = 36, 4096, 12288, 1e-6  # Qwen3-8B
# A stage holds GU_ROWS gate rows and as many up rows, or one down row. Each consumer warp owns one stage and takes
# every WARPS-th item: a warp never waits on a phase of its stage's barrier more than one ahead (with fewer stages
# than warps, a parity wait two phases ahead passed at once, and the kernel failed)
GU_ROWS, STAGES, SLOT_BYTES = 1, 8, 24576
SOURCE = (r"""
#define H %(H)d
#define I %(I)d
#define GU_ROWS %(GU_ROWS)d
#define STAGES %(STAGES)d
#define SLOT_BYTES %(SLOT_BYTES)d
#define WARPS 8  // consumer warps, one per stage (STAGES == WARPS)
#define CONSUMERS (WARPS * 32)
typedef unsigned short bf16;

""" + STREAM_HELPERS + r"""
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %%0;" :: "n"(CONSUMERS) : "memory"); }
__device__ __forceinline__ unsigned pack(float a, float b) { return rne(a) | (rne(b) << 16); }

// x: the attention block's output; res: the residual stream, res <- x + res; out <- MLP(RMSNorm(x + res)).
// act: scratch for SiLU(gate) * up. counter: two zeros, left at zero.
extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
stream_mlp(const bf16* x, bf16* res, const bf16* norm_w, const bf16* gate_up, const bf16* down, bf16* act,
           bf16* out, unsigned* counter, float eps) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring = smem;
    bf16* vec = (bf16*)(smem + STAGES * SLOT_BYTES);                       // normed x, then act: I values
    unsigned long long* full = (unsigned long long*)(smem + STAGES * SLOT_BYTES + I * 2);
    unsigned long long* empty = full + STAGES;
    float* red = (float*)(empty + STAGES);
    static_assert(STAGES == WARPS, "a stage per consumer warp");
    const int tid = threadIdx.x, warp = tid / 32, lane = tid %% 32;
    const int groups = I / GU_ROWS;
    const int ga = blockIdx.x * groups / gridDim.x, n_gu = (blockIdx.x + 1) * groups / gridDim.x - ga;
    const int ra = blockIdx.x * H / gridDim.x, n_dn = (blockIdx.x + 1) * H / gridDim.x - ra;
    if (tid == 0) init_ring(full, empty, STAGES, 1);
    __syncthreads();

    if (warp == WARPS) {  // the producer: weights depend on nothing, so no PDL wait
        if (lane == 0) {
            const unsigned gu_bytes = GU_ROWS * H * 2;
            for (int it = 0; it < n_gu + n_dn; ++it) {
                int slot = it %% STAGES, round = it / STAGES;
                if (round > 0) mbar_wait(smem_addr(&empty[slot]), (round - 1) & 1);
                unsigned bar = smem_addr(&full[slot]);
                unsigned char* dst = ring + slot * SLOT_BYTES;
                if (it < n_gu) {  // GU_ROWS gate rows, then the matching up rows
                    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%%0], %%1;" :: "r"(bar), "r"(2 * gu_bytes) : "memory");
                    size_t row = (size_t)(ga + it) * GU_ROWS;
                    bulk_load(dst, gate_up + row * H, gu_bytes, bar);
                    bulk_load(dst + gu_bytes, gate_up + (I + row) * H, gu_bytes, bar);
                } else {
                    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%%0], %%1;" :: "r"(bar), "r"(I * 2) : "memory");
                    bulk_load(dst, down + (size_t)(ra + it - n_gu) * I, I * 2, bar);
                }
            }
        }
        return;
    }

    asm volatile("griddepcontrol.wait;" ::: "memory");  // x and res are the kernels' before
    asm volatile("griddepcontrol.launch_dependents;" :::);  // the next may take each multiprocessor as this leaves it
    // residual add and RMSNorm, HF's rounding: h = bf16(x + res); normed = bf16(bf16(h * rms) * w)
    const int c0 = tid * 16;
    uint4 xa = __ldcg((const uint4*)(x + c0)), xb = __ldcg((const uint4*)(x + c0 + 8));
    uint4 ra_ = __ldcg((const uint4*)(res + c0)), rb_ = __ldcg((const uint4*)(res + c0 + 8));
    unsigned xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    unsigned rw[8] = {ra_.x, ra_.y, ra_.z, ra_.w, rb_.x, rb_.y, rb_.z, rb_.w};
    float h[16];
    float ss = 0.f;
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        h[2 * i] = round_bf16(lo(xw[i]) + lo(rw[i]));
        h[2 * i + 1] = round_bf16(hi(xw[i]) + hi(rw[i]));
        ss += h[2 * i] * h[2 * i] + h[2 * i + 1] * h[2 * i + 1];
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    consumers_sync();
    float total = 0.f;
    #pragma unroll
    for (int k = 0; k < WARPS; ++k) total += red[k];
    const float inv = rsqrtf(total / H + eps);
    uint4 wa = *(const uint4*)(norm_w + c0), wb = *(const uint4*)(norm_w + c0 + 8);
    unsigned ww[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
    unsigned nw[8], hw[8];
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        nw[i] = pack(round_bf16(h[2 * i] * inv) * lo(ww[i]), round_bf16(h[2 * i + 1] * inv) * hi(ww[i]));
        hw[i] = pack(h[2 * i], h[2 * i + 1]);
    }
    *(uint4*)(vec + c0) = make_uint4(nw[0], nw[1], nw[2], nw[3]);
    *(uint4*)(vec + c0 + 8) = make_uint4(nw[4], nw[5], nw[6], nw[7]);
    consumers_sync();
    uint4 xr[H / 256];  // this lane's normed x: columns c * 256 + lane * 8 .. + 7
    #pragma unroll
    for (int c = 0; c < H / 256; ++c) xr[c] = *(const uint4*)(vec + c * 256 + lane * 8);

    // gate_up, SiLU * up: a warp per stage of GU_ROWS gate and GU_ROWS up rows; warp w's items use stage w
    for (int j = warp; j < n_gu; j += WARPS) {
        int slot = warp, round = j / STAGES;
        mbar_wait(smem_addr(&full[slot]), round & 1);
        const bf16* stage = (const bf16*)(ring + slot * SLOT_BYTES);
        float acc[2 * GU_ROWS];
        #pragma unroll
        for (int r = 0; r < 2 * GU_ROWS; ++r) {
            float a = 0.f;
            #pragma unroll
            for (int c = 0; c < H / 256; ++c) a += dot8(*(const uint4*)(stage + r * H + c * 256 + lane * 8), xr[c]);
            acc[r] = a;
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_addr(&empty[slot]));
        #pragma unroll
        for (int r = 0; r < 2 * GU_ROWS; ++r) acc[r] = warp_sum(acc[r]);
        if (lane < GU_ROWS) {  // lane q writes row q (every lane holds every sum)
            float g = 0.f, u = 0.f;
            #pragma unroll
            for (int q = 0; q < GU_ROWS; ++q) if (q == lane) { g = round_bf16(acc[q]); u = round_bf16(acc[GU_ROWS + q]); }
            float s = round_bf16(g / (1.f + __expf(-g)));
            act[(size_t)(ga + j) * GU_ROWS + lane] = (bf16)rne(s * u);
        }
    }

    // every block's act written: a grid-wide arrival count (the producer keeps streaming down rows meanwhile)
    __threadfence();
    consumers_sync();
    if (tid == 0) {
        atomicAdd(&counter[0], 1u);
        unsigned seen;
        do { asm volatile("ld.acquire.gpu.u32 %%0, [%%1];" : "=r"(seen) : "l"(counter) : "memory"); }
        while (seen < gridDim.x);
        if (atomicAdd(&counter[1], 1u) == gridDim.x - 1) { counter[0] = 0; counter[1] = 0; }  // all are past it
    }
    consumers_sync();
    if (blockIdx.x == 0) {  // every block has read res by now
        *(uint4*)(res + c0) = make_uint4(hw[0], hw[1], hw[2], hw[3]);
        *(uint4*)(res + c0 + 8) = make_uint4(hw[4], hw[5], hw[6], hw[7]);
    }
    #pragma unroll
    for (int q = 0; q < I / 8 / CONSUMERS; ++q) ((uint4*)vec)[tid + q * CONSUMERS] = __ldcg((const uint4*)act + tid + q * CONSUMERS);
    consumers_sync();

    // down: a warp per row, on its own stage as before
    for (int it = n_gu + (warp - n_gu %% WARPS + WARPS) %% WARPS; it < n_gu + n_dn; it += WARPS) {
        int k = it - n_gu, slot = warp, round = it / STAGES;
        mbar_wait(smem_addr(&full[slot]), round & 1);
        const bf16* row = (const bf16*)(ring + slot * SLOT_BYTES);
        float a = 0.f;
        #pragma unroll 8
        for (int c = 0; c < I / 256; ++c)
            a += dot8(*(const uint4*)(row + c * 256 + lane * 8), *(const uint4*)(vec + c * 256 + lane * 8));
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_addr(&empty[slot]));
        a = warp_sum(a);
        if (lane == 0) out[ra + k] = (bf16)rne(a);
    }
}
""") % {"H": HIDDEN, "I": INTER, "GU_ROWS": GU_ROWS, "STAGES": STAGES, "SLOT_BYTES": SLOT_BYTES}
SMEM = STAGES * SLOT_BYTES + INTER * 2 + 2 * STAGES * 8 + 8 * 4


def reference_layer(x, res, norm_w, gate_up, down):
    """HF's rounding: h = x + res (bf16); normed; gate_up; SiLU(gate) * up; down. Returns (out, h)."""
    h = x + res
    normed = norm.rmsnorm_reference(h, norm_w, EPS)
    gate, up = F.linear(normed.float(), gate_up.float()).bfloat16().chunk(2, dim=-1)
    return F.linear((F.silu(gate) * up).float(), down.float()).bfloat16(), h


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=positive_int, default=5)
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    enable_pdl(dev)
    keys = [gemv.tile_key(INTER, HIDDEN, True, torch.bfloat16), gemv.tile_key(HIDDEN, INTER, False, torch.bfloat16)]
    tuned = cached_tiles(device_tag(dev), True, keys)  # the engine's tiles from its start-up tuning, if cached
    gemv.TILES.update(tuned or {})
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(0)
    gate_ups = (torch.randn(LAYERS, 2 * INTER, HIDDEN, device=dev, generator=g) / HIDDEN ** 0.5).bfloat16()
    downs = (torch.randn(LAYERS, HIDDEN, INTER, device=dev, generator=g) / INTER ** 0.5).bfloat16()
    norm_ws = (1 + 0.1 * torch.randn(LAYERS, HIDDEN, device=dev, generator=g)).bfloat16()
    x0 = torch.randn(1, HIDDEN, device=dev, generator=g).bfloat16()
    res0 = torch.randn(1, HIDDEN, device=dev, generator=g).bfloat16()
    out = {"layers": LAYERS, "gb": LAYERS * 3 * HIDDEN * INTER * 2 / 1e9,
           "engine_tiles": {str(k): str(gemv.TILES.get(k, "default")) for k in keys}}

    def engine_path(res):
        x = x0
        for i in range(LAYERS):
            normed = norm.rmsnorm(x, norm_ws[i], EPS, residual=res)
            x = gemv.gemv(gemv.gemv(normed, gate_ups[i], gated=True), downs[i])
        return x

    major, minor = torch.cuda.get_device_capability(dev)
    kernel = torch.cuda._compile_kernel(SOURCE, "stream_mlp", compute_capability=f"{major}{minor}")
    kernel.set_shared_memory_config(SMEM)
    act = torch.empty(INTER, device=dev, dtype=torch.bfloat16)
    counter = torch.zeros(2, device=dev, dtype=torch.int32)
    outs = torch.empty(LAYERS, 1, HIDDEN, device=dev, dtype=torch.bfloat16)

    def stream_path(res):
        x = x0
        for i in range(LAYERS):
            launch(kernel, sms, 32 * 9, [x, res, norm_ws[i], gate_ups[i], downs[i], act, outs[i], counter, EPS],
                   pdl=True, shared=SMEM)
            x = outs[i]
        return x

    # correctness: one layer against float32 products, 36 against the engine's path
    ref_out, ref_h = reference_layer(x0, res0, norm_ws[0], gate_ups[0], downs[0])
    res_s, res_e = res0.clone(), res0.clone()
    last_s, last_e = stream_path(res_s), engine_path(res_e)
    torch.cuda.synchronize()
    out["check"] = {"first_out_vs_fp32": rel(outs[0], ref_out), "counters_zero": bool((counter == 0).all()),
                    "last_out_vs_engine": rel(last_s, last_e), "last_residual_vs_engine": rel(res_s, res_e)}
    res_one = res0.clone()
    launch(kernel, sms, 32 * 9, [x0, res_one, norm_ws[0], gate_ups[0], downs[0], act, outs[0], counter, EPS],
           pdl=False, shared=SMEM)
    torch.cuda.synchronize()
    out["check"]["first_residual_exact"] = bool(torch.equal(res_one, ref_h))
    print("check", out["check"], flush=True)

    graphs, times = {}, {"engine": [], "stream": []}
    for name, path in (("engine", engine_path), ("stream", stream_path)):
        res = res0.clone()
        path(res)
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            path(res)
    for _ in range(args.rounds):  # interleaved, so that a drift of the machine falls on both
        for name, graph in graphs.items():
            times[name].append(cuda_ms(graph.replay, iters=20, warmup=3) * 1e3 / LAYERS)
    for name, t in times.items():
        us = statistics.median(t)
        out[name] = {"us_per_layer": us, "tb_s": 3 * HIDDEN * INTER * 2 / us / 1e6, "all_us": t}
        print(name, {k: v for k, v in out[name].items() if k != "all_us"}, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
