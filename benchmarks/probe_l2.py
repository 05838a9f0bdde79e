"""How much faster than HBM is the H200's L2, for the decode step's kind of reads?

Asking o_proj's weights into L2 during attention did not make o_proj faster (results/2026-11-30_probe_l2_*.json).
Two measurements say whether L2 can help a decode GEMV at all:

- read: a streaming read (every program sums its slices of a bf16 buffer) over buffers of 8 MB to 4 GB, launched
  back to back in a CUDA graph, so that a buffer that fits in L2 is read from it after the first launch: GB/s.
- gemv: the engine's GEMV kernel with o_proj's, qkv's and down's shapes, 36 launches in a CUDA graph with
  programmatic dependent launch, over one weight (L2-resident after the first launch where it fits) and over
  36 distinct weights (read from HBM): us per launch.

    python3 benchmarks/probe_l2.py --out $OUT/l2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench_h200 import cuda_ms
from llm_anatomy.kernels import gemv
from llm_anatomy.kernels.pdl import enable_pdl

SIZES_MB = (8, 16, 24, 32, 40, 48, 64, 128, 1024, 4096)
LAUNCHES = 20
LAYERS = 36
SHAPES = {"o_proj": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 12288)}  # Qwen3-8B: (rows, columns)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_gbps(size_mb: int) -> float:
    """GB/s of LAUNCHES back-to-back streaming reads of a size_mb buffer, timed as one CUDA graph."""
    n = size_mb * 2**20 // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    programs = 4 * torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(programs, device="cuda", dtype=torch.float32)

    def run():
        for _ in range(LAUNCHES):
            _read_kernel[(programs,)](x, out, n, BLOCK=4096, num_warps=8)
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ms = cuda_ms(graph.replay, iters=10, warmup=2)
    assert torch.isfinite(out).all()
    return LAUNCHES * n * 2 / ms / 1e6


def gemv_us(rows: int, cols: int, distinct: bool) -> float:
    """Microseconds per launch of the engine's GEMV, LAYERS launches in a graph over one or LAYERS weights."""
    weights = [torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(LAYERS if distinct else 1)]
    x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)

    def run():
        for i in range(LAYERS):
            gemv.gemv(x, weights[i % len(weights)])
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return cuda_ms(graph.replay, iters=20, warmup=3) * 1e3 / LAYERS


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    enable_pdl(torch.device("cuda"))
    props = torch.cuda.get_device_properties(0)
    out = {"device": props.name, "l2_mb": getattr(props, "L2_cache_size", 0) / 2**20, "read_gbps": {}, "gemv_us": {}}
    with torch.inference_mode():
        for mb in SIZES_MB:
            out["read_gbps"][mb] = read_gbps(mb)
            print(f"read {mb:5d} MB {out['read_gbps'][mb]:8.0f} GB/s", flush=True)
            torch.cuda.empty_cache()
        for name, (rows, cols) in SHAPES.items():
            one, many = gemv_us(rows, cols, False), gemv_us(rows, cols, True)
            mb = rows * cols * 2 / 2**20
            out["gemv_us"][name] = {"mb": mb, "one_weight_us": one, "distinct_weights_us": many}
            print(f"gemv {name:7s} {mb:5.0f} MB: one weight {one:6.2f} us ({mb * 2**20 / one / 1e3:5.0f} GB/s), "
                  f"{LAYERS} weights {many:6.2f} us ({mb * 2**20 / many / 1e3:5.0f} GB/s)", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
