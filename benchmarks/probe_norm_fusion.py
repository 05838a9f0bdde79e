"""A/B of RMSNorm riding in the decode GEMVs against a norm kernel of its own before each, on the H200.

One engine (synthetic Qwen3-8B). The unfused variant puts back the kernel sequence the engine had before
(`rmsnorm` with the residual add, then the GEMV); for each variant the decode CUDA graphs are captured again
and the decode TPOT measured in interleaved rounds. Greedy tokens of both are compared.

    python3 benchmarks/probe_norm_fusion.py --out $OUT/norm_fusion.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench_h200 import prompt_ids, timed_generate
from llm_anatomy import Engine
from llm_anatomy.kernels import gemv
from llm_anatomy.models import qwen3

FUSED = qwen3.norm_linear


def unfused(x, residual, norm, layer, gated=False):
    if residual is None:
        h, residual = norm(x), x
    else:
        h, residual = norm.add_forward(x, residual)
    y = gemv.gemv(h, layer.weight, gated)
    return (y if layer.bias is None else y + layer.bias), residual


def use(engine: Engine, fn) -> None:
    qwen3.norm_linear = fn
    runner = engine.runner
    runner.graphs.clear()
    runner.prefill_graphs.clear()
    runner._mempool = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    runner.capture(runner.max_graph_batch, engine.max_model_len)


def greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    return engine.generate_many([ids], temperature=0, max_tokens=n, ignore_eos=True)[0].output_token_ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out")
    args = parser.parse_args()
    engine = Engine.from_pretrained("Qwen/Qwen3-8B", device="cuda", weights="synthetic", kv_cache_tokens=40960)
    variants = {"fused": FUSED, "unfused": unfused}
    short, long_ids = prompt_ids(384, 1), prompt_ids(32640, 2)
    out = {"tpot_ctx512_ms": {v: [] for v in variants}, "tpot_ctx32k_ms": {}, "tokens": {}}
    for r in range(args.rounds):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            use(engine, variants[name])
            timed_generate(engine, prompt_ids(128), 16)  # warm-up
            out["tpot_ctx512_ms"][name].append(timed_generate(engine, short, 128)["tpot_ms"])
            if r == 0:
                out["tokens"][name] = greedy(engine, short, 48)
                out["tpot_ctx32k_ms"][name] = timed_generate(engine, long_ids, 64)["tpot_ms"]
    tokens = out.pop("tokens")
    out["greedy_tokens_agree"] = sum(a == b for a, b in zip(tokens["fused"], tokens["unfused"])) / 48
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    for name in variants:
        t = out["tpot_ctx512_ms"][name]
        print(f"{name:>8}: TPOT ctx512 median {statistics.median(t):.3f} ms {[round(x, 3) for x in t]}, "
              f"ctx32k {out['tpot_ctx32k_ms'][name]:.3f} ms")
    print(f"greedy tokens agree: {out['greedy_tokens_agree']:.2%}")


if __name__ == "__main__":
    main()
