"""Prefill's products through the persistent Triton GEMM (llm_anatomy/kernels/matmul.py) against cuBLAS, at
Qwen3-8B's shapes in bf16: the plain products (qkv, o_proj, down, and gate_up alone as gate_up_product), and gate_up
with SiLU*up in the kernel's epilogue against cuBLAS followed by silu_mul, as the engine ran it before.

Each part is timed as a CUDA graph of LAYERS calls, each on its own weights (as in a forward, where no weight is in
L2), over several interleaved rounds, for every candidate tile; the layer's four parts are then summed, cuBLAS's
against the best of each, and multiplied by 36.

Section engine: the engine's prefill (synthetic Qwen3-8B, eager: the prefill graphs hidden) with its gated
product through the Triton kernel (from GATED_MIN_ROWS rows) and through cuBLAS + silu_mul, interleaved over
rounds on one engine.

An epilogue adding the product into the residual stream (o_proj, down; then RMSNorm without its add) was measured
with this probe at commit 28ad9bc and lost (results/2026-11-30_probe_prefill_gemm_run2_interleaved.json).

    python3 benchmarks/probe_prefill_gemm.py --out $OUT/prefill_gemm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from unittest import mock

import torch

from bench_h200 import cuda_ms, graph_of, make_engine, names_from, one_prefill_ms, positive_int
from llm_anatomy.kernels import matmul as matmul_module
from llm_anatomy.kernels.activation import silu_mul
from llm_anatomy.kernels.matmul import GemmTile, matmul

HIDDEN, INTER, QKV, LAYERS_8B = 4096, 12288, 6144, 36
LAYERS = 8  # weights per graph: more than L2 holds for every shape
PLAIN_TILES = [GemmTile(*t) for t in ((128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 5, 8),
                                      (256, 128, 64, 3, 8), (128, 128, 128, 3, 8), (128, 128, 64, 4, 4),
                                      (128, 256, 64, 3, 8, 16))]
# BN is per half: a gated tile multiplies 2 x BN weight rows (gate and up)
GATED_TILES = [GemmTile(*t) for t in ((128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 64, 64, 4, 8),
                                      (128, 64, 64, 4, 4), (256, 64, 64, 3, 8), (128, 128, 64, 3, 8, 16))]
# part -> (weight rows, K, gated)
PARTS = {"qkv": (QKV, HIDDEN, False), "o": (HIDDEN, HIDDEN, False), "gate_up": (2 * INTER, HIDDEN, True),
         "down": (HIDDEN, INTER, False), "gate_up_product": (2 * INTER, HIDDEN, False)}
LAYER_PARTS = ("qkv", "o", "gate_up", "down")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def part_variants(name: str, tokens: int, g: torch.Generator) -> tuple[dict, dict]:
    """{variant: zero-argument function running LAYERS calls}, {tile: relative error against cuBLAS (+ silu_mul)
    on the first weight, or why the tile could not run}."""
    rows, k, gated = PARTS[name]
    dev = torch.device("cuda")
    x = torch.randn(tokens, k, generator=g, device=dev).bfloat16()
    ws = [(torch.randn(rows, k, generator=g, device=dev) / k ** 0.5).bfloat16() for _ in range(LAYERS)]
    prod = torch.empty(tokens, rows, dtype=torch.bfloat16, device=dev)

    def unfused():
        for w in ws:
            torch.mm(x, w.t(), out=prod)
            if gated:
                silu_mul(prod)
    variants = {"cublas": unfused}
    ref = torch.mm(x, ws[0].t())
    ref = silu_mul(ref) if gated else ref
    errors = {}
    for tile in GATED_TILES if gated else PLAIN_TILES:
        def fused(tile=tile):
            for w in ws:
                matmul(x, w, tile, gated=gated)
        try:
            y = matmul(x, ws[0], tile, gated=gated)
            torch.cuda.synchronize()
        except Exception as e:  # a tile that does not fit in shared memory
            errors[str(tile)] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        errors[str(tile)] = rel(y, ref)
        variants[str(tile)] = fused
    return variants, errors


def engine_prefills(tokens: list[int], rounds: int) -> dict:
    """Eager prefills of the engine with the gated product in the Triton kernel and in cuBLAS + silu_mul."""
    engine = make_engine({"model": "Qwen/Qwen3-8B"}, kv_cache_tokens=max(tokens) + 256, max_num_seqs=1)
    engine.runner.prefill_graphs = {}  # eager at every length, so that both paths run the same way
    variants = {"triton": matmul_module.GATED_MIN_ROWS, "cublas": 1 << 62}
    out = {}
    for n in tokens:
        times = {v: [] for v in variants}
        for r in range(rounds + 1):
            for v, min_rows in variants.items():
                with mock.patch.object(matmul_module, "GATED_MIN_ROWS", min_rows):
                    ms = one_prefill_ms(engine, n, seed=r)
                if r:  # the first round warms up (compiles, cuDNN plans)
                    times[v].append(ms)
        out[n] = {v: {"ms": statistics.median(t), "all": t} for v, t in times.items()}
        print(f"engine prefill {n:5d}: " + ", ".join(f"{v} {r['ms']:.2f} ms" for v, r in out[n].items()), flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--tokens", type=names_from(["512", "1024", "2048", "4096", "8192"], "token count"),
                        default=["2048", "8192"])
    parser.add_argument("--parts", type=names_from(list(PARTS), "part"), default=list(PARTS))
    parser.add_argument("--engine-tokens", type=names_from(["1024", "2048", "4096", "8192"], "token count"),
                        default=[], help="also time the engine's eager prefill at these lengths, both ways")
    args = parser.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {"torch": torch.__version__, "layers_per_graph": LAYERS, "results": {}}
    for tokens in map(int, args.tokens):
        summary = {}
        for name in args.parts:
            variants, errors = part_variants(name, tokens, g)
            graphs = {v: graph_of(fn) for v, fn in variants.items()}
            times = {v: [] for v in graphs}
            for _ in range(args.rounds):
                for v, graph in graphs.items():
                    times[v].append(cuda_ms(graph.replay, iters=5, warmup=1) / LAYERS)
            med = {v: statistics.median(t) for v, t in times.items()}
            best = min((v for v in med if v != "cublas"), key=med.get, default=None)
            rows, k, gated = PARTS[name]
            flops = 2 * tokens * rows * k
            out["results"][f"{name} {tokens}"] = {
                "ms": med, "spread_ms": {v: max(t) - min(t) for v, t in times.items()},
                "tflops_product": {v: flops / (m * 1e9) for v, m in med.items()}, "rel_err": errors, "best": best}
            if name in LAYER_PARTS:
                summary[name] = (med["cublas"], med[best] if best else None)
            del graphs
            torch.cuda.empty_cache()
            print(f"{tokens:5d} {name:15s} cublas {med['cublas'] * 1e3:8.1f} us | best {best} "
                  f"{med[best] * 1e3 if best else float('nan'):8.1f} us | err {errors.get(best)}", flush=True)
        if len(summary) == len(LAYER_PARTS):
            now = sum(a for a, _ in summary.values()) * LAYERS_8B
            fused = sum(min(a, b or a) for a, b in summary.values()) * LAYERS_8B
            out["results"][f"layers {tokens}"] = {"cublas_ms": now, "best_of_each_ms": fused}
            print(f"{tokens:5d} 36 layers' products (and SiLU*up): cuBLAS {now:.2f} ms, the best of each "
                  f"{fused:.2f} ms", flush=True)
    if args.engine_tokens:
        out["engine"] = engine_prefills(list(map(int, args.engine_tokens)), args.rounds)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
