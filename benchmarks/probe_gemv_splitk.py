"""Would split-K make the small decode GEMVs faster? A candidate kernel measured against the engine's, on the H200.

The engine's batch-1 GEMVs lose a fixed few microseconds each: o_proj (4096 x 4096) reads at 2.95 TB/s and
down (4096 x 12288) at 3.62, against 4.15-4.41 for gate_up and lm_head (RESULTS.md). With BLOCK_N = 32 the
o_proj grid is 128 programs, one per SM and four SMs idle. Here each program takes 1/SPLIT_K of K; the
partial sums go to a workspace, and the last program to arrive on an N tile (an atomic counter, acq_rel) adds
them, writes the output and resets the counter, so one kernel does it all and a CUDA graph can replay it.

For each projection shape: the engine's GEMV (at its untuned default tile, since nothing here tunes it; this
probe ran on the autotuned kernel of the fourth session) and every split-K variant, each over 36 layers'
weights in one CUDA graph with programmatic dependent launch as the engine runs it, checked against F.linear.

    python3 benchmarks/probe_gemv_splitk.py --out $OUT/gemv_splitk.json

On the CPU (TRITON_INTERPRET=1) `--check` runs only the correctness checks, on small shapes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # the interpreter, set before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from llm_anatomy.kernels.gemv import gemv  # noqa: E402
from llm_anatomy.kernels.pdl import PDL, enable_pdl, gdc_enter  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "down": (4096, 12288)}
VARIANTS = [(split, bn, bk, stages) for split in (2, 4) for bn in (16, 32, 64) for bk in (128, 256) for stages in (3, 4)]


@triton.jit
def _gemv_splitk_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, stride_xm, stride_wn, stride_ym,
                        K: tl.constexpr, M_PAD: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_per: tl.constexpr = K // SPLIT_K
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_PAD)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + pid_k * k_per + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + pid_k * k_per + rk[None, :]
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for _ in range(0, k_per // BLOCK_K):
        x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
        acc += tl.dot(x, tl.trans(tl.load(w_ptrs, mask=rn[:, None] < N, other=0.0)))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tile = rm[:, None] * N + rn[None, :]
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(part_ptr + pid_k * M_PAD * N + tile, acc, mask=inside)
    tl.debug_barrier()  # every thread's share of the partial is written before the one atomic releases it
    arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")  # releases this partial, acquires the others
    if arrived == SPLIT_K - 1:  # the last one here: sum the partials, write y, reset the counter for next time
        total = tl.zeros([M_PAD, BLOCK_N], tl.float32)
        for s in range(SPLIT_K):
            total += tl.load(part_ptr + s * M_PAD * N + tile, mask=inside, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], total.to(y_ptr.dtype.element_ty), mask=inside)
        tl.atomic_xchg(count_ptr + pid_n, 0)


_COUNTERS: dict = {}


def gemv_splitk(x: torch.Tensor, weight: torch.Tensor, split: int, block_n: int, block_k: int,
                stages: int) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    assert k % (split * block_k) == 0 and m <= 16
    tiles = triton.cdiv(n, block_n)
    key = (x.device, tiles)
    if key not in _COUNTERS:  # zero once; the kernel leaves them zero
        _COUNTERS[key] = torch.zeros(tiles, dtype=torch.int32, device=x.device)
    part = torch.empty(split, 16, n, dtype=torch.float32, device=x.device)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_splitk_kernel[(tiles, split)](x, weight, y, part, _COUNTERS[key], m, n, x.stride(0), weight.stride(0),
                                        y.stride(0), K=k, M_PAD=16, SPLIT_K=split, BLOCK_N=block_n, BLOCK_K=block_k,
                                        USE_PDL=PDL.on, launch_pdl=PDL.on, num_warps=4, num_stages=stages)
    return y


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(device: torch.device, dtype: torch.dtype, shapes: dict, variants: list) -> dict:
    """Each variant against F.linear, twice in a row (the counters must come back to zero)."""
    out = {}
    for name, (n, k) in shapes.items():
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(n, k, generator=g) * 0.02).to(dtype).to(device)
        for rows in (1, 3):
            x = torch.randn(rows, k, generator=g).to(dtype).to(device)
            ref = F.linear(x.float(), w.float())
            for v in variants:
                errors = [rel(gemv_splitk(x, w, *v), ref) for _ in range(2)]
                out[f"{name}_rows{rows}_{v}"] = max(errors)
    return out


def timed(fn, weights, x) -> float:
    """Microseconds per layer: fn over every layer's weight, in one CUDA graph, median of 20 replays."""
    for w in weights[:2]:
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    times = []
    for _ in range(23):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times[3:])[len(times[3:]) // 2] * 1e3 / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="correctness only (what the CPU can run)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.check or not torch.cuda.is_available():
        small = {"small": (96, 1024)}
        errors = check(torch.device("cpu"), torch.float32, small, [(2, 16, 128, 3), (4, 32, 256, 3)])
        print(json.dumps(errors, indent=1))
        assert max(errors.values()) < 1e-4, errors
        return
    device = torch.device("cuda")
    enable_pdl(device)
    out = {"pdl": PDL.on, "errors": check(device, torch.bfloat16, SHAPES, VARIANTS), "us_per_layer": {}}
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(36)]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        row = {"engine": timed(gemv, weights, x)}
        for v in VARIANTS:
            row[str(v)] = timed(lambda x, w, v=v: gemv_splitk(x, w, *v), weights, x)
        out["us_per_layer"][name] = row
        best = min((t, v) for v, t in row.items())
        print(f"{name:7s} engine {row['engine']:6.2f} us ({n * k * 2 / row['engine'] / 1e6:.2f} TB/s); "
              f"best {best[1]} {best[0]:6.2f} us ({n * k * 2 / best[0] / 1e6:.2f} TB/s)", flush=True)
        del weights
        torch.cuda.empty_cache()
    print(f"largest error against F.linear (bf16): {max(out['errors'].values()):.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
