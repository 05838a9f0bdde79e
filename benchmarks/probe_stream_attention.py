"""Does a decode attention split kernel that reads the KV cache before its PDL wait (llm_anatomy/kernels/
stream_attention.py) shorten the batch-1 decode step?

- check: its split + the Triton merge against the Triton split + merge, random caches over a shuffled block table,
  at contexts from 1 token to 32k, for each configuration (max abs difference, relative error).
- chain: 36 layers' attention alone (one cache per layer, as in the step) in a CUDA graph, Triton against each
  configuration, at 512, 8192 and 32768 tokens.
- step: the engine's batch-1 decode step (Qwen3-8B, synthetic) at 512 tokens and 32k, each variant's graph
  captured again and timed interleaved over rounds; logits against the engine's.

A configuration is (splits per KV head, tokens a stage, stages): CONFIGS.

    python3 benchmarks/probe_stream_attention.py --out $OUT/stream_attention.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from bench_h200 import cuda_ms, make_engine, names_from, positive_int
from llm_anatomy.engine.runner import LONG_SPLITS, SHORT_BLOCK_N, SHORT_CONTEXT, SHORT_SPLITS
from llm_anatomy.kernels import stream_attention as sa
from llm_anatomy.kernels.decode_attention import paged_decode_attention
from probe_decode_parts import decode_forward, step_ms
from probe_early_launch import logits_of

CONFIGS = {"s16_t64_x4": (16, 64, 4), "s16_t64_x6": (16, 64, 6), "s33_t64_x3": (33, 64, 3),
           "s16_t128_x3": (16, 128, 3), "s8_t64_x4": (8, 64, 4), "s32_t64_x2": (32, 64, 2)}
LAYERS, HEADS, KV_HEADS, PAGE = 36, 32, 8, 16


@contextlib.contextmanager
def stream(on: bool, stages: int | None = None):
    saved = sa.STREAM.on, sa.STAGES
    sa.STREAM.on, sa.STAGES = on, stages or saved[1]
    try:
        yield
    finally:
        sa.STREAM.on, sa.STAGES = saved


def caches(context: int, layers: int, g: torch.Generator):
    pages = -(-context // PAGE) + 1
    k = torch.randn(layers, pages, PAGE, KV_HEADS, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn(layers, pages, PAGE, KV_HEADS, 128, device="cuda", generator=g).bfloat16()
    table = torch.randperm(pages, device="cuda", generator=g).int()[None]
    return k, v, table


def section_check(configs: list[str]) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for context in (1, 5, 63, 64, 65, 200, 512, 2047, 8192, 32768):
        k, v, table = caches(context, 1, g)
        q = torch.randn(1, HEADS, 128, device="cuda", generator=g).bfloat16()
        lens = torch.tensor([context], device="cuda", dtype=torch.int32)
        ref = paged_decode_attention(q, k[0], v[0], table, lens, 128 ** -0.5, splits=LONG_SPLITS).float()
        row = {}
        for name in configs:
            splits, tile, stages = CONFIGS[name]
            with stream(True, stages):
                assert sa.supports(q, k[0], v[0], table, splits, tile, stages), name
                got = paged_decode_attention(q, k[0], v[0], table, lens, 128 ** -0.5, splits=splits, block_n=tile)
            row[name] = {"max_abs_diff": (got.float() - ref).abs().max().item(),
                         "rel_err": ((got.float() - ref).norm() / ref.norm()).item()}
        out[context] = row
        print("check", context, {n: round(r["max_abs_diff"], 5) for n, r in row.items()}, flush=True)
        del k, v
    return out


def section_chain(configs: list[str]) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    out = {}
    for context in (512, 8192, 32768):
        k, v, table = caches(context, LAYERS, g)
        q = torch.randn(1, HEADS, 128, device="cuda", generator=g).bfloat16()
        lens = torch.tensor([context], device="cuda", dtype=torch.int32)
        short = context <= SHORT_CONTEXT
        variants = {"triton": (False, SHORT_SPLITS if short else LONG_SPLITS, SHORT_BLOCK_N if short else None, None)}
        variants |= {n: (True, *CONFIGS[n]) for n in configs}
        row = {}
        for name, (on, splits, tile, stages) in variants.items():
            def chain(on=on, splits=splits, tile=tile, stages=stages, k=k, v=v):
                with stream(on, stages):
                    x = q
                    for layer in range(LAYERS):
                        x = paged_decode_attention(x, k[layer], v[layer], table, lens, 128 ** -0.5, splits=splits,
                                                   block_n=tile)
            chain()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain()
            ms = cuda_ms(graph.replay, iters=20, warmup=3)
            row[name] = {"ms": ms, "tb_s": 2 * LAYERS * context * KV_HEADS * 256 / ms / 1e9}
            del graph
        out[context] = row
        print("chain", context, {n: (round(r["ms"], 4), round(r["tb_s"], 2)) for n, r in row.items()}, flush=True)
        del k, v
    return out


def section_step(engine, contexts: list[int], configs: list[str], rounds: int) -> dict:
    out = {}
    with torch.inference_mode():
        for context in contexts:
            short = context <= SHORT_CONTEXT
            variants = {"engine": (False, SHORT_SPLITS if short else None, SHORT_BLOCK_N if short else None, None)}
            variants |= {n: (True, *CONFIGS[n]) for n in configs}
            forwards = {n: decode_forward(engine, context, splits, tile) for n, (_, splits, tile, _) in variants.items()}
            ref = logits_of(engine, forwards["engine"], stream(False))
            times, check = defaultdict(list), {}
            for name, (on, _, _, stages) in variants.items():
                logits = logits_of(engine, forwards[name], stream(on, stages))
                check[name] = {"max_abs_diff": (logits - ref).abs().max().item(),
                               "argmax_equal": bool((logits.argmax(-1) == ref.argmax(-1)).all())}
            for _ in range(rounds):
                for name, (on, _, _, stages) in variants.items():
                    with stream(on, stages):
                        times[name].append(step_ms(engine, forwards[name]))
            out[context] = {n: {"ms": statistics.median(t), "all": t, **check[n]} for n, t in times.items()}
            print("step", context, {n: (round(r["ms"], 4), round(r["max_abs_diff"], 4)) for n, r in out[context].items()},
                  flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--sections", type=names_from(["check", "chain", "step"], "section"),
                        default=["check", "chain", "step"])
    parser.add_argument("--configs", type=names_from(list(CONFIGS), "config"), default=list(CONFIGS))
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--contexts", type=names_from(["512", "2048", "8192", "32768"], "context"),
                        default=["512", "32768"])
    args = parser.parse_args(argv)
    out = {}
    if "check" in args.sections:
        out["check"] = section_check(args.configs)
    if "chain" in args.sections:
        out["chain"] = section_chain(args.configs)
    if "step" in args.sections:
        engine = make_engine({"model": "Qwen/Qwen3-8B"}, kv_cache_tokens=32768 + 256, max_num_seqs=1)
        out["step"] = section_step(engine, list(map(int, args.contexts)), args.configs, args.rounds)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
