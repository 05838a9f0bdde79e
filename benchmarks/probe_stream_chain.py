"""Does streaming weights across GEMV boundaries remove the ~2 us each decode GEMV pays beyond its bytes?

The premise of a decode megakernel, tested on its simplest case: a chain of LAYERS products x <- W_i x (4096 x
4096 bf16, o_proj's shape, each output rounded to bf16 and fed to the next), batch 1.
- triton: the engine's GEMV kernel, one launch per product, with programmatic dependent launch, in a CUDA graph.
- stream: one persistent CUDA C++ kernel (compiled by NVRTC, probe_nvrtc.py), one block per multiprocessor. A
  producer warp streams the block's weight rows (4 rows, 32 KB, per bulk copy) into a ring of shared-memory
  stages, on and on across the products, never waiting for x; eight consumer warps take x_i once all blocks have
  written it (a grid-wide arrival counter), then dot the staged rows with it. While they wait, the ring already
  holds the next product's first rows.
Both chains' outputs are checked against float32 products in PyTorch (bf16 rounding at each step).

    python3 benchmarks/probe_stream_chain.py --out $OUT/stream_chain.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench_h200 import cuda_ms
from llm_anatomy.kernels import gemv
from llm_anatomy.kernels.pdl import enable_pdl
from llm_anatomy.kernels.cuda import STREAM_HELPERS

LAYERS, N, K = 36, 4096, 4096  # the chain timed against the engine's GEMV: o_proj's shape
# name -> (rows of W, rows per bulk copy, ring stages, whether products wait for the one before (else: timing
# only, the streaming rate this design reaches with no grid-wide waits))
VARIANTS = {"stream": (4096, 4, 6, True), "stream_2rows_12stages": (4096, 2, 12, True),
            "stream_no_wait": (4096, 4, 6, False), "stream_qkv_shape": (6144, 4, 6, True)}
SOURCE = r"""
#define K %(K)d
#define N %(N)d
#define ROWS %(ROWS)d
#define STAGES %(STAGES)d
#define MAX_GROUPS %(MAX_GROUPS)d
#define WAIT %(WAIT)d
#define XS %(XS)d  // the row stride of xs: product i reads the first K of row i, writes N to row i + 1
#define CONSUMERS 256
#define STAGE_BYTES (ROWS * K * 2)

""" + STREAM_HELPERS + r"""
extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
stream_chain(const unsigned short* w, unsigned short* xs, unsigned* counter, int layers) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned short* ring = (unsigned short*)smem;                                  // STAGES x ROWS x K
    unsigned long long* full = (unsigned long long*)(smem + STAGES * STAGE_BYTES);
    unsigned long long* empty = full + STAGES;
    float* red = (float*)(empty + STAGES);                                          // 8 warps x MAX_GROUPS*ROWS
    const int tid = threadIdx.x, warp = tid / 32, lane = tid %% 32;
    const int groups = N / ROWS;
    const int g0 = blockIdx.x * groups / gridDim.x, g1 = (blockIdx.x + 1) * groups / gridDim.x;
    const int mine = g1 - g0;
    if (tid == 0) init_ring(full, empty, STAGES, 8);
    __syncthreads();

    if (warp == 8) {  // the producer: this block's rows of every product, in order, as fast as stages free up
        if (lane == 0) {
            int it = 0;
            for (int layer = 0; layer < layers; ++layer) {
                for (int g = g0; g < g1; ++g, ++it) {
                    int slot = it %% STAGES, round = it / STAGES;
                    if (round > 0) mbar_wait(smem_addr(&empty[slot]), (round - 1) & 1);
                    unsigned bar = smem_addr(&full[slot]);
                    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%%0], %%1;"
                                 :: "r"(bar), "r"(STAGE_BYTES) : "memory");
                    const unsigned short* src = w + ((size_t)layer * N + (size_t)g * ROWS) * K;
                    bulk_load(ring + (size_t)slot * ROWS * K, src, STAGE_BYTES, bar);
                }
            }
        }
        return;
    }

    // the consumers: thread t takes columns t*8 .. t*8+7 and 2048 + t*8 .. (16-byte pieces, no bank conflicts)
    int it = 0;
    for (int layer = 0; layer < layers; ++layer) {
        if (WAIT && layer > 0) {  // x_layer complete: every block has written its rows of it
            if (tid == 0) {
                unsigned seen;
                do { asm volatile("ld.acquire.gpu.u32 %%0, [%%1];" : "=r"(seen) : "l"(counter) : "memory"); }
                while (seen < (unsigned)(layer * gridDim.x));
            }
            asm volatile("bar.sync 1, %%0;" :: "n"(CONSUMERS) : "memory");
        }
        const unsigned short* x = xs + (size_t)layer * XS;
        uint4 xa = __ldcg((const uint4*)(x + tid * 8)), xb = __ldcg((const uint4*)(x + K / 2 + tid * 8));
        float xf[16] = {lo(xa.x), hi(xa.x), lo(xa.y), hi(xa.y), lo(xa.z), hi(xa.z), lo(xa.w), hi(xa.w),
                        lo(xb.x), hi(xb.x), lo(xb.y), hi(xb.y), lo(xb.z), hi(xb.z), lo(xb.w), hi(xb.w)};
        float part[MAX_GROUPS * ROWS];
        #pragma unroll
        for (int gi = 0; gi < MAX_GROUPS; ++gi) {
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) part[gi * ROWS + r] = 0.f;
            if (gi < mine) {
                int slot = it %% STAGES, round = it / STAGES;
                mbar_wait(smem_addr(&full[slot]), round & 1);
                const unsigned short* stage = ring + (size_t)slot * ROWS * K;
                #pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    uint4 wa = *(const uint4*)(stage + r * K + tid * 8);
                    uint4 wb = *(const uint4*)(stage + r * K + K / 2 + tid * 8);
                    float acc = lo(wa.x) * xf[0] + hi(wa.x) * xf[1] + lo(wa.y) * xf[2] + hi(wa.y) * xf[3]
                              + lo(wa.z) * xf[4] + hi(wa.z) * xf[5] + lo(wa.w) * xf[6] + hi(wa.w) * xf[7]
                              + lo(wb.x) * xf[8] + hi(wb.x) * xf[9] + lo(wb.y) * xf[10] + hi(wb.y) * xf[11]
                              + lo(wb.z) * xf[12] + hi(wb.z) * xf[13] + lo(wb.w) * xf[14] + hi(wb.w) * xf[15];
                    part[gi * ROWS + r] = acc;
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(smem_addr(&empty[slot]));
                ++it;
            }
        }
        #pragma unroll
        for (int i = 0; i < MAX_GROUPS * ROWS; ++i) {
            float v = part[i];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) red[warp * MAX_GROUPS * ROWS + i] = v;
        }
        asm volatile("bar.sync 1, %%0;" :: "n"(CONSUMERS) : "memory");
        if (tid < mine * ROWS) {
            float v = 0.f;
            #pragma unroll
            for (int k = 0; k < 8; ++k) v += red[k * MAX_GROUPS * ROWS + tid];
            xs[(size_t)(layer + 1) * XS + g0 * ROWS + tid] = (unsigned short)rne(v);
        }
        __threadfence();
        asm volatile("bar.sync 1, %%0;" :: "n"(CONSUMERS) : "memory");
        if (tid == 0) atomicAdd(counter, 1u);
    }
}
"""


def reference(weights: torch.Tensor, x0: torch.Tensor) -> list[torch.Tensor]:
    """x_{i+1} = W_i x_i[:K] in float32, rounded to bf16 as the kernels round it."""
    xs = [x0]
    for w in weights:
        xs.append((w.float() @ xs[-1][:w.shape[1]].float()).bfloat16())
    return xs


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    enable_pdl(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(0)
    weights = (torch.randn(LAYERS, N, K, device=dev, generator=g) / K ** 0.5).bfloat16()
    x0 = torch.randn(K, device=dev, generator=g).bfloat16()
    ref = reference(weights, x0)
    out = {"layers": LAYERS, "shape": [N, K], "gb": LAYERS * N * K * 2 / 1e9}

    # triton: the engine's GEMV, one launch per product
    def triton_chain():  # each product writes a fresh output, the next one's input: no copies between
        x, first = x0[None], None
        for i in range(LAYERS):
            x = gemv.gemv(x, weights[i])
            first = x if first is None else first
        return first, x
    triton_chain()
    graph_t = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph_t):
        first, last = triton_chain()
    graph_t.replay()
    torch.cuda.synchronize()
    out["triton"] = {"rel_err_first": rel(first[0], ref[1]), "rel_err_last": rel(last[0], ref[-1]),
                     "us_per_product": cuda_ms(graph_t.replay, iters=20, warmup=3) * 1e3 / LAYERS}
    print("triton", out["triton"], flush=True)

    for name, (n, rows, stages, wait) in VARIANTS.items():
        w = weights if n == N else (torch.randn(LAYERS, n, K, device=dev, generator=g) / K ** 0.5).bfloat16()
        out[name] = stream(w, x0, rows, stages, wait, sms)
        print(name, out[name], flush=True)
    for name in ("triton", *VARIANTS):
        n = VARIANTS[name][0] if name in VARIANTS else N
        out[name]["tb_s"] = n * K * 2 / out[name]["us_per_product"] / 1e6
    print({name: (round(r["us_per_product"], 2), round(r["tb_s"], 2)) for name, r in out.items() if isinstance(r, dict)})
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


def stream(weights: torch.Tensor, x0: torch.Tensor, rows: int, stages: int, wait: bool, sms: int) -> dict:
    """The persistent kernel over the chain (square products feed the next; others all take x0's successor)."""
    dev = x0.device
    layers, n, k = weights.shape
    max_groups = -(-n // rows // sms)
    source = SOURCE % {"K": k, "N": n, "ROWS": rows, "STAGES": stages, "MAX_GROUPS": max_groups, "WAIT": int(wait),
                       "XS": max(n, k)}
    smem = stages * rows * k * 2 + 2 * stages * 8 + 8 * max_groups * rows * 4
    major, minor = torch.cuda.get_device_capability(dev)
    kernel = torch.cuda._compile_kernel(source, "stream_chain", compute_capability=f"{major}{minor}")
    kernel.set_shared_memory_config(smem)
    xs = torch.zeros(layers + 1, max(n, k), device=dev, dtype=torch.bfloat16)
    xs[0, :k] = x0
    counter = torch.zeros(1, device=dev, dtype=torch.int32)

    def run():
        counter.zero_()
        kernel(grid=(sms, 1, 1), block=(256 + 32, 1, 1), args=[weights, xs, counter, layers], shared_mem=smem)
    run()
    torch.cuda.synchronize()
    result = {"rows_per_copy": rows, "stages": stages, "ring_kb": stages * rows * k * 2 / 1024}
    if wait:  # no wait: the products read x before it is written, so their values are not checked
        ref = reference(weights, x0)
        result.update(rel_err_first=rel(xs[1, :n], ref[1]), rel_err_last=rel(xs[-1, :n], ref[-1]))
        assert result["rel_err_first"] < 1e-2, result
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    result["us_per_product"] = cuda_ms(graph.replay, iters=20, warmup=3) * 1e3 / layers
    return result


if __name__ == "__main__":
    main()
