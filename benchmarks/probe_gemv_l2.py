"""Can the decode GEMVs' transitions be hidden by asking for their weights into L2 before their PDL wait?

A GEMV's programs are made resident while the kernel before them drains (programmatic dependent launch), and
then wait. `Tile.l2` has each program issue bulk L2 prefetches (cp.async.bulk.prefetch.L2) for its next K
tiles of weights before that wait: no registers or shared memory are held, and the DRAM otherwise idle during
the drain fetches them; after the wait, the loop finds them in L2. One engine (synthetic Qwen3-8B) on the H200:

- step: the batch-1 step at 512 tokens and at 32k, with every shape's start-up tile given l2 = 1..16 K tiles,
  and with the small kernels between the GEMVs (norms, QK-norm/RoPE, attention, its merge) launching the next
  kernel before their own wait ("early"), so that a GEMV's programs become resident, and prefetch, while the
  GEMV two kernels before it still drains. Interleaved over rounds.
- tune: each shape's l2 tuned inside the step on top of the start-up tiles (coordinate descent, as start-up).

    python3 benchmarks/probe_gemv_l2.py --out $OUT/gemv_l2.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from bench_h200 import make_engine, names_from, positive_int
from llm_anatomy.kernels import decode_attention, gemv as gemv_module, norm, rope
from probe_decode_parts import decode_forward, step_ms
from probe_gemv_overlap import clone_kernel

SECTIONS = ["step", "tune"]
L2_TILES = (1, 2, 4, 8, 16)
CONTEXTS = (512, 32768)
# The kernels that run between the GEMVs
SMALL_KERNELS = [(norm, "_rmsnorm_kernel"), (rope, "_qk_norm_rope_store_kernel"),
                 (decode_attention, "_decode_attention_split_kernel"),
                 (decode_attention, "_decode_attention_merge_kernel")]


@triton.jit
def launch_then_wait(USE_PDL: tl.constexpr):
    """gdc_enter in the other order: the next kernel may launch before this one's wait is over."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()


def l2_tiles(tiles: dict, l2: int) -> dict:
    """Every tile with l2 K tiles asked into L2 (no more than its K has after its register prefetch)."""
    return {key: dataclasses.replace(t, l2=min(l2, triton.next_power_of_2(key[1] // t.block_k - t.prefetch)))
            for key, t in tiles.items()}


@contextlib.contextmanager
def variant(tiles: dict | None = None, early: bool = False, early_kernels: dict | None = None):
    saved_tiles = dict(gemv_module.TILES)
    saved_kernels = [(module, name, getattr(module, name)) for module, name in SMALL_KERNELS]
    if tiles is not None:
        gemv_module.TILES.update(tiles)
    if early:
        for module, name in SMALL_KERNELS:
            setattr(module, name, early_kernels[name])
    try:
        yield
    finally:
        gemv_module.TILES.clear()
        gemv_module.TILES.update(saved_tiles)
        for module, name, kernel in saved_kernels:
            setattr(module, name, kernel)


def step(engine, rounds: int) -> dict:
    early_kernels = {name: clone_kernel(getattr(module, name), gdc_enter=launch_then_wait)
                     for module, name in SMALL_KERNELS}
    start = dict(gemv_module.TILES)
    variants = {"startup": {}, "early": {"early": True}}
    variants.update({f"l2_{n}": {"tiles": l2_tiles(start, n)} for n in L2_TILES})
    variants.update({f"early_l2_{n}": {"tiles": l2_tiles(start, n), "early": True} for n in (2, 8)})
    out = {}
    for context in CONTEXTS:
        forward = decode_forward(engine, context)
        times = defaultdict(list)
        for _ in range(rounds):
            for name, kw in variants.items():
                with variant(early_kernels=early_kernels, **kw):
                    times[name].append(step_ms(engine, forward))
        out[context] = {name: {"ms": statistics.median(t), "all": t} for name, t in times.items()}
        print("step", context, {n: round(r["ms"], 4) for n, r in out[context].items()}, flush=True)
    return out


def tune(engine) -> dict:
    """Each shape's l2 picked inside the 512-token step, largest shape first, the others held."""
    forward = decode_forward(engine)
    before = dict(gemv_module.TILES)
    start_ms = [step_ms(engine, forward) for _ in range(3)]
    t0 = time.perf_counter()
    for key in engine.runner._gemv_keys():
        tile = gemv_module.TILES[key]
        best = (tile, step_ms(engine, forward, iters=20))
        for n in L2_TILES:
            if n <= key[1] // tile.block_k - tile.prefetch:
                gemv_module.TILES[key] = dataclasses.replace(tile, l2=n)
                ms = step_ms(engine, forward, iters=20)
                if ms < best[1]:
                    best = (gemv_module.TILES[key], ms)
        gemv_module.TILES[key] = best[0]
    tuned = dict(gemv_module.TILES)
    tuned_ms, startup_ms = [], []
    for _ in range(3):  # interleaved
        tuned_ms.append(step_ms(engine, forward))
        gemv_module.TILES.update(before)
        startup_ms.append(step_ms(engine, forward))
        gemv_module.TILES.update(tuned)
    gemv_module.TILES.update(before)
    out = {"startup_tiles": {str(k): str(t) for k, t in before.items()}, "startup_ms_first": start_ms,
           "tuned_tiles": {str(k): str(t) for k, t in tuned.items()}, "tuned_ms": tuned_ms,
           "startup_ms": startup_ms, "seconds": time.perf_counter() - t0}
    print("tune", json.dumps(out), flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--sections", type=names_from(SECTIONS, "section"), default=SECTIONS)
    parser.add_argument("--rounds", type=positive_int, default=3)
    args = parser.parse_args(argv)
    engine = make_engine({"model": "Qwen/Qwen3-8B"}, kv_cache_tokens=max(CONTEXTS) + 256, max_num_seqs=1)
    out = {"tiles": {str(k): str(t) for k, t in gemv_module.TILES.items()}}
    with torch.inference_mode():
        for name in args.sections:
            out[name] = step(engine, args.rounds) if name == "step" else tune(engine)
            if args.out:
                Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
