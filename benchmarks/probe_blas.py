"""Do the prefill's GEMMs run faster through cuBLASLt than through torch's default BLAS path?  Qwen3-8B's four
projection shapes at 2048 and 8192 tokens, bf16, F.linear timed with torch.backends.cuda.preferred_blas_library
set to each, interleaved, on fresh weights per shape.

    python3 benchmarks/probe_blas.py --out $OUT/blas.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_h200 import cuda_ms, positive_int

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
LIBRARIES = ("cublas", "cublaslt")


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=positive_int, default=3)
    args = parser.parse_args(argv)
    default = torch.backends.cuda.preferred_blas_library()
    out = {"default": str(default), "results": {}}
    for tokens in (2048, 8192):
        for name, (n, k) in SHAPES.items():
            x = torch.randn(tokens, k, dtype=torch.bfloat16, device="cuda")
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
            times = {lib: [] for lib in LIBRARIES}
            for _ in range(args.rounds):
                for lib in LIBRARIES:
                    torch.backends.cuda.preferred_blas_library(lib)
                    times[lib].append(cuda_ms(lambda: F.linear(x, w), iters=20, warmup=5))
            torch.backends.cuda.preferred_blas_library(default)
            flops = 2 * tokens * n * k
            row = {lib: {"ms": statistics.median(t), "tflops": flops / statistics.median(t) / 1e9}
                   for lib, t in times.items()}
            out["results"][f"{name} {tokens}"] = row
            print(f"{name:8s} {tokens:5d}", {lib: round(r["tflops"], 1) for lib, r in row.items()}, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
