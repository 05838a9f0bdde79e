"""Can this project run hand-written CUDA C++ kernels on the device without nvcc, with programmatic dependent
launch (PDL) and inside CUDA graphs? The groundwork for a decode megakernel (see RESULTS.md, eighth session).

PyTorch compiles CUDA C++ source with NVRTC (torch.cuda._compile_kernel, which ships with its CUDA wheels); its
launcher has no launch attributes, so here the kernel is launched through the driver's cuLaunchKernelEx with
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION. A chain of LAUNCHES kernels, each waiting for the one
before (griddepcontrol.wait) and adding 1 to every element, captured in a CUDA graph with and without the
attribute: the result must be LAUNCHES everywhere, and the time per launch says what PDL saves.

    python3 benchmarks/probe_nvrtc.py --out $OUT/nvrtc.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench_h200 import cuda_ms
from llm_anatomy.kernels.cuda import launch

LAUNCHES, N = 200, 1 << 16
SOURCE = r"""
extern "C" __global__ void add_one(float* y, int n) {
    asm volatile("griddepcontrol.wait;" ::: "memory");       // the kernel before has finished and flushed
    asm volatile("griddepcontrol.launch_dependents;" :::);   // the next may be launched now
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += 1.0f;
}
"""


def chain(kernel, pdl: bool) -> dict:
    y = torch.zeros(N, device="cuda")

    def run():
        for _ in range(LAUNCHES):
            launch(kernel, N // 256, 256, [y, N], pdl)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    correct = bool((y == LAUNCHES).all())
    return {"correct": correct, "us_per_launch": cuda_ms(graph.replay, iters=20, warmup=3) * 1e3 / LAUNCHES}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    major, minor = torch.cuda.get_device_capability()
    kernel = torch.cuda._compile_kernel(SOURCE, "add_one", compute_capability=f"{major}{minor}")
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "pdl": chain(kernel, True),
           "no_pdl": chain(kernel, False)}
    print(json.dumps(out), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
