"""Why does an eager prefill at a prompt length not seen before cost ~0.5 s more (bench section prefill_graphs)?
Times eager prefills (the prefill graphs hidden) at repeated and new lengths, then profiles the first prefill
at a new length and a repeated one: the host ops and the device kernels that take the time.

    python3 benchmarks/probe_new_length.py --out $OUT/new_length.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from bench_h200 import make_engine, one_prefill_ms


def top(prof, key: str, n: int = 12) -> list:
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:n]
    return [(e.key[:90], round(getattr(e, key) / 1e3, 3), e.count) for e in rows]


def prompt_lengths(text: str) -> list[int]:
    try:
        lengths = [int(n) for n in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"want comma-separated positive token counts, got {text!r}")
    return lengths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--lengths", type=prompt_lengths, default=prompt_lengths("1025,1025,1025,1100,1100,3001,3001,3002,1025"),
                        help="comma-separated prompt lengths, timed in this order")
    parser.add_argument("--gc-freeze", action="store_true", help="collect, then freeze the heap before timing")
    parser.add_argument("--profile", action="store_true", help="also profile a new length and a repeated one")
    args = parser.parse_args(argv)
    ctx = {"model": "Qwen/Qwen3-8B"}
    engine = make_engine(ctx, kv_cache_tokens=40960)
    print(f"load {ctx['engine_load_s']:.1f} s, of which compile, capture and warm-up "
          f"{engine.runner.capture_seconds:.1f} s", flush=True)
    engine.runner.prefill_graphs = {}  # every prefill eager
    if args.gc_freeze:  # is the one-time cost Python's collector walking the start-up heap?
        import gc
        import time

        t = time.perf_counter()
        gc.collect()
        print(f"gc.collect {1e3 * (time.perf_counter() - t):.0f} ms, {len(gc.get_objects())} objects", flush=True)
        gc.freeze()
    lengths = args.lengths
    out = {"load_s": ctx["engine_load_s"], "capture_s": engine.runner.capture_seconds,
           "eager_ms": [(n, one_prefill_ms(engine, n, seed)) for seed, n in enumerate(lengths)]}
    print(out, flush=True)
    if not args.profile:
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
        return
    for label, n, seed in (("new_length_3003", 3003, 50), ("repeat_1025", 1025, 51)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ms = one_prefill_ms(engine, n, seed)
        out[label] = {"ms": ms, "host_self": top(prof, "self_cpu_time_total"),
                      "host_total": top(prof, "cpu_time_total"), "device": top(prof, "self_device_time_total")}
        print(label, json.dumps(out[label], indent=0)[:2500], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
