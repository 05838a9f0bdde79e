"""Where does a decode step lose time when its RMSNorms ride in the GEMVs? Each variant against the kernel per
norm, per Qwen3-8B projection, over 36 layers in one CUDA graph with PDL, on the H200.

Consumers (qkv, gate_up; they read the residual stream):
- norm_kernel: the RMSNorm kernel (residual add included) and then the plain GEMV, as the engine runs today;
- fused_loop: the GEMV normalises each x tile in its loop from the row's RMS (NORM=1, HF's rounding);
- fused_g_loop: only the weight g in the loop, the RMS applied after the product (NORM=2);
- fused_epilogue: x raw in the loop, the RMS after (NORM=3: timing only, as if g were folded into W).
Producers (o_proj, down; they write the stream): plain GEMV against the in-place residual add with its sums of
squares (ADD).

    python3 benchmarks/probe_norm_gemv.py --out $OUT/norm_gemv.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from llm_anatomy.kernels.gemv import gemv, new_squares
from llm_anatomy.kernels.norm import rmsnorm
from llm_anatomy.kernels.pdl import enable_pdl


def graph_us(fn, layers: int) -> float:
    """Microseconds per layer: fn(i) for every layer i in one CUDA graph, median of 20 replays."""
    for i in range(2):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            fn(i)
    times = []
    for _ in range(23):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times[3:])[10] * 1e3 / layers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    dev, bf, layers, hidden = torch.device("cuda"), torch.bfloat16, 36, 4096
    enable_pdl(dev)
    out = {}
    stream = torch.randn(1, hidden, device=dev, dtype=bf)
    delta = torch.randn(1, hidden, device=dev, dtype=bf)
    g = torch.rand(hidden, device=dev, dtype=bf) + 0.5
    squares = new_squares(hidden, dev)
    squares[0] = (stream.float() ** 2).reshape(-1, 16).sum(-1)
    for name, n, gated in (("qkv", 6144, False), ("gate_up", 24576, True)):
        weights = [torch.randn(n, hidden, device=dev, dtype=bf) * 0.02 for _ in range(layers)]
        row = {"plain_gemv": graph_us(lambda i: gemv(stream, weights[i], gated=gated), layers),
               "norm_kernel": graph_us(lambda i: gemv(rmsnorm(delta, g, 1e-6, residual=stream), weights[i],
                                                      gated=gated), layers)}
        for label, mode in (("fused_loop", 1), ("fused_g_loop", 2), ("fused_epilogue", 3)):
            row[label] = graph_us(lambda i, mode=mode: gemv(stream, weights[i], gated=gated, norm=g, eps=1e-6,
                                                            squares=squares, norm_mode=mode), layers)
        out[name] = row
        print(name, {k: round(v, 2) for k, v in row.items()}, flush=True)
        del weights
        torch.cuda.empty_cache()
    for name, k in (("o_proj", 4096), ("down", 12288)):
        weights = [torch.randn(hidden, k, device=dev, dtype=bf) * 0.02 for _ in range(layers)]
        x = torch.randn(1, k, device=dev, dtype=bf)
        row = {"plain_gemv": graph_us(lambda i: gemv(x, weights[i]), layers),
               "add_to_stream": graph_us(lambda i: gemv(x, weights[i], add_to=stream, squares=squares), layers)}
        out[name] = row
        print(name, {k: round(v, 2) for k, v in row.items()}, flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
