"""An A/B of the L2 weight prefetch in the decode step, and where a long prefill's time goes, on the H200.

One engine (synthetic Qwen3-8B); for each prefetch setting the decode CUDA graphs are captured again and the
decode TPOT measured at a short context, in interleaved rounds so that drift hits every setting alike; the
greedy tokens must not change with the setting (a prefetch is a hint). Then torch.profiler tables of a
2048- and an 8192-token prefill, and their device times.

    python3 benchmarks/probe_prefetch.py --out $OUT/prefetch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench_h200 import prefill_ms, prompt_ids, timed_generate
from llm_anatomy import Engine
from llm_anatomy.kernels import decode_attention, gemv

# (GEMV bytes per program before its wait, attention prefetches o_proj up to this batch)
SETTINGS = {"none": (0, 0), "gemv64k": (64 << 10, 0), "attn": (0, 16), "gemv32k+attn": (32 << 10, 16),
            "gemv64k+attn": (64 << 10, 16), "gemv128k+attn": (128 << 10, 16), "gemv256k+attn": (256 << 10, 16)}


def apply(engine: Engine, name: str) -> None:
    gemv.PREFETCH_BYTES, decode_attention.PREFETCH_MAX_BATCH = SETTINGS[name]
    runner = engine.runner
    runner.graphs.clear()
    runner.prefill_graphs.clear()
    runner._mempool = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    runner.capture(runner.max_graph_batch, engine.max_model_len)


def greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    seq = engine.add_request(ids, engine.sampling_params(temperature=0, max_tokens=n, ignore_eos=True))
    while not seq.finished:
        engine.step()
    return seq.output_token_ids


def prefill_profile(engine: Engine, n: int) -> list:
    seq = engine.add_request(prompt_ids(n, seed=11), engine.sampling_params(temperature=0, max_tokens=1))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    assert seq.finished
    rows = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])
    return [(k[:100], round(ms, 3), c) for k, ms, c in rows[:16]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--long", default="none,gemv64k+attn", help="settings also timed at 32k context")
    parser.add_argument("--out")
    args = parser.parse_args()
    names = args.settings.split(",")
    out: dict = {"settings": {n: SETTINGS[n] for n in names}}
    engine = Engine.from_pretrained("Qwen/Qwen3-8B", device="cuda", weights="synthetic", kv_cache_tokens=40960)
    short, long_ids = prompt_ids(384, 1), prompt_ids(32640, 2)
    tpot = {n: [] for n in names}
    tokens = {}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            apply(engine, name)
            timed_generate(engine, prompt_ids(128), 16)  # warm-up
            tpot[name].append(timed_generate(engine, short, 128)["tpot_ms"])
            if r == 0:
                tokens[name] = greedy(engine, short, 32)
            print(f"round {r} {name}: {tpot[name][-1]:.3f} ms ({time.perf_counter() - t:.1f} s)", flush=True)
    out["tpot_ctx512_ms"] = tpot
    out["same_tokens"] = {n: tokens[n] == tokens[names[0]] for n in names}
    out["tpot_ctx32k_ms"] = {}
    for name in args.long.split(","):
        apply(engine, name)
        out["tpot_ctx32k_ms"][name] = timed_generate(engine, long_ids, 64)["tpot_ms"]
    apply(engine, names[0])
    out["prefill_ms"] = {n: prefill_ms(engine, n) for n in (128, 2048, 8192)}
    out["prefill_profile"] = {n: prefill_profile(engine, n) for n in (2048, 8192)}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    for n in (2048, 8192):
        print(f"\nprefill {n}: {out['prefill_ms'][n]:.2f} ms")
        for row in out["prefill_profile"][n]:
            print(f"  {row[1]:9.3f} ms {row[2]:5d}  {row[0]}")
    print(f"\n32k: {out['tpot_ctx32k_ms']}")
    print(f"{'setting':>16} {'TPOT ctx512 median':>20}  rounds  same tokens")
    for name in names:
        print(f"{name:>16} {statistics.median(tpot[name]):20.3f}  {[round(x, 3) for x in tpot[name]]}  "
              f"{out['same_tokens'][name]}")


if __name__ == "__main__":
    main()
