"""Where does a batch-1 decode step's time go beyond the weights' bytes, and which GEMV tiles are best inside
the real step?  Three parts, one engine (synthetic Qwen3-8B), all on the H200:

- knockout: the decode step's graph captured again with one family of small kernels replaced by a no-op
  (the norms, the QK-norm + RoPE + store, the attention), timed interleaved with the full step. The outputs
  are garbage; the time each family adds to the step is the difference. An upper bound on what fusing it
  into a neighbour could save.
- tiles: for each GEMV shape in turn, every candidate tile and a wider set, the whole step captured and timed
  (coordinate descent from the tiles start-up chose), to check start-up's tuning (engine/tuning.py).
- prefill: a profiled eager 2048-token prefill, device time per kernel.

    python3 benchmarks/probe_decode_parts.py --out $OUT/decode_parts.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import types
from collections import defaultdict
from pathlib import Path

import torch

from bench_h200 import cuda_ms, make_engine, names_from, one_prefill_ms, positive_int
from llm_anatomy.kernels import gemv as gemv_module
from llm_anatomy.models import qwen3
from llm_anatomy.engine.runner import LONG_SPLITS
from llm_anatomy.probe.kernels import categorize

CONTEXT = 512


def decode_forward(engine, context: int = CONTEXT, splits: int | None = None, block_n: int | None = None):
    """The engine's batch-1 decode step at `context` tokens (nothing stored), over the graphs' static inputs;
    attention with these splits and tile (default: the long-context graph's)."""
    runner = engine.runner
    blocks = -(-context // engine.block_size)
    runner.static_ids[:1] = 1
    runner.static_pos[:1] = context - 1
    runner.static_slots[:1] = -1
    runner.static_lens[:1] = context
    runner.static_tables[0, :blocks] = torch.arange(blocks, dtype=torch.int32)
    if splits is None and block_n is None:
        splits = LONG_SPLITS
    return runner._decode_forward(1, splits, block_n)


def step_ms(engine, forward, iters: int = 40) -> float:
    graph, out = engine.runner._capture_one(forward)
    ms = cuda_ms(graph.replay, iters=iters, warmup=5)
    del graph, out
    return ms


def interleaved(engine, forward, variants: dict, rounds: int) -> dict:
    """The step timed under each variant (name -> a function giving a context manager to time it in), the
    variants taking turns over the rounds, so that a drift of the machine falls on all of them: medians, in ms."""
    times = defaultdict(list)
    for _ in range(rounds):
        for name, variant in variants.items():
            with variant():
                times[name].append(step_ms(engine, forward))
    return {name: {"ms": statistics.median(t), "all": t} for name, t in times.items()}


# ---- knockout ----------------------------------------------------------------------------------------------
def no_norm(x, weight, eps, residual=None):
    return x


def no_rope(qkv, n_heads, n_kv_heads, head_dim, *args, **kwargs):
    return qkv[:, :n_heads * head_dim].view(qkv.shape[0], n_heads, head_dim)


def no_attention(q, *args, **kwargs):
    return q


FAKES = {"norm": types.SimpleNamespace(rmsnorm=no_norm), "qk_norm_rope_store": no_rope,
         "paged_decode_attention": no_attention}


@contextlib.contextmanager
def fakes_for(families):
    """The model's kernel families named (keys of FAKES) replaced by no-ops inside the block."""
    real = {key: getattr(qwen3, key) for key in FAKES}
    norm_in_gemv = qwen3.NORM_IN_GEMV
    qwen3.NORM_IN_GEMV = norm_in_gemv and "norm" not in families  # a norm inside its GEMV is not its own kernel
    for key in families:
        setattr(qwen3, key, FAKES[key])
    try:
        yield
    finally:
        qwen3.NORM_IN_GEMV = norm_in_gemv
        for key, value in real.items():
            setattr(qwen3, key, value)


def knockout(engine, rounds: int) -> dict:
    forward = decode_forward(engine)
    variants = {"full": [], "no_norms": ["norm"], "no_rope": ["qk_norm_rope_store"],
                "no_attention": ["paged_decode_attention"],
                "no_rope_no_attention": ["qk_norm_rope_store", "paged_decode_attention"],
                "gemvs_only": ["norm", "qk_norm_rope_store", "paged_decode_attention"]}
    out = interleaved(engine, forward, {name: lambda off=off: fakes_for(off) for name, off in variants.items()},
                      rounds)
    full = out["full"]["ms"]
    for name in out:
        out[name]["saves_ms"] = full - out[name]["ms"]
    return out


# ---- tiles -------------------------------------------------------------------------------------------------
WIDER_TILES = [(16, 256, 4, 3), (16, 256, 4, 4), (16, 256, 4, 5), (16, 512, 4, 5), (32, 256, 4, 3), (32, 128, 4, 5),
               (64, 128, 4, 3), (16, 512, 8, 4), (16, 128, 4, 4), (128, 128, 4, 4), (64, 64, 4, 4), (32, 128, 2, 3)]


def tiles(engine) -> dict:
    """Every shape swept again over the start-up candidates and a wider set, from the tiles start-up chose."""
    forward = decode_forward(engine)
    chosen = dict(gemv_module.TILES)
    candidates = list(dict.fromkeys(gemv_module.CANDIDATE_TILES + [gemv_module.Tile(*t) for t in WIDER_TILES]))
    out = {"startup": {str(k): str(t) for k, t in chosen.items()}, "sweeps": {}}
    out["startup_step_ms"] = step_ms(engine, forward)
    for key in engine.runner._gemv_keys():
        rows = {}
        for tile in candidates:
            gemv_module.TILES[key] = tile
            try:
                rows[str(tile)] = step_ms(engine, forward, iters=30)
            except Exception as e:  # a tile that does not fit (shared memory)
                rows[str(tile)] = str(e)[:120]
        timed = {n: t for n, t in rows.items() if isinstance(t, float)}
        best = min(timed, key=timed.get)
        gemv_module.TILES[key] = next(t for t in candidates if str(t) == best)
        out["sweeps"][str(key)] = {"startup": str(chosen[key]), "startup_ms": timed.get(str(chosen[key])),
                                   "best": best, "best_ms": timed[best], "all": rows}
        print(key, "start-up", chosen[key], timed.get(str(chosen[key])), "best", best, timed[best], flush=True)
    out["swept_step_ms"] = step_ms(engine, forward)
    gemv_module.TILES.update(chosen)
    out["startup_again_ms"] = step_ms(engine, forward)
    return out


# ---- prefill -----------------------------------------------------------------------------------------------
def prefill_profile(engine, n: int = 2048) -> dict:
    from torch.profiler import ProfilerActivity, profile

    graphs, engine.runner.prefill_graphs = engine.runner.prefill_graphs, {}
    try:
        one_prefill_ms(engine, n, 0)
        eager = one_prefill_ms(engine, n, 1)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            one_prefill_ms(engine, n, 2)
    finally:
        engine.runner.prefill_graphs = graphs
    per_kernel, categories = defaultdict(lambda: [0.0, 0]), defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.name][0] += evt.device_time / 1e3
            per_kernel[evt.name][1] += 1
            categories[categorize(evt.name)] += evt.device_time / 1e3
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:20]
    return {"eager_ms": eager, "kernel_ms": sum(categories.values()),
            "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
            "top": [(name[:100], round(t, 3), c) for name, (t, c) in top]}


PARTS = ["knockout", "tiles", "prefill"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--parts", type=names_from(PARTS, "part"), default=PARTS)
    parser.add_argument("--rounds", type=positive_int, default=5)
    args = parser.parse_args(argv)
    ctx = {"model": "Qwen/Qwen3-8B"}
    engine = make_engine(ctx, kv_cache_tokens=8192, max_num_seqs=1, max_model_len=4096)
    print(f"load {ctx['engine_load_s']:.1f} s", flush=True)
    out = {}
    parts = args.parts
    with torch.inference_mode():
        if "knockout" in parts:
            out["knockout"] = knockout(engine, args.rounds)
            print(json.dumps({k: round(v["ms"], 4) for k, v in out["knockout"].items()}), flush=True)
        if "prefill" in parts:
            out["prefill"] = prefill_profile(engine)
            print(json.dumps(out["prefill"], indent=0)[:3000], flush=True)
        if "tiles" in parts:
            out["tiles"] = tiles(engine)
            t = out["tiles"]
            print({k: (v["startup"], v["best"], round(v["best_ms"], 4)) for k, v in t["sweeps"].items()},
                  t["startup_step_ms"], t["swept_step_ms"], t["startup_again_ms"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
