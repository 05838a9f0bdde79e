"""Where do the batch-1 decode step's GEMVs lose time against the weights' bytes: in the transitions between
dependent kernels (the drain of one and the ramp of the next) or in their steady rate?  And is the gap between
the decode step and the TPOT the host's?  One engine (synthetic Qwen3-8B), on the H200:

Variants: wait (the engine's GEMV, tiles as tuned at start-up, no prefetch), no_wait (the GEMVs do not wait
for the kernel before: timing only) and prefetch 1 or 2 (the first 1 or 2 K tiles of weights loaded before the
wait: Tile.prefetch).

- chain: for each GEMV shape, the launches of the model's layers' weights (36 for a layer shape) captured in one
  graph, timed as the engine runs them (each waits for the one before: programmatic dependent launch), with the
  wait taken out (timing only: consecutive kernels then overlap as far as the GPU lets them, which is the
  steady rate), and the others.
- step: the batch-1 step at 512 tokens, whole and with its GEMVs alone, with the same GEMV variants,
  interleaved over rounds. The difference between the wait and no-wait steps bounds what overlapping the
  transitions could save.
- tune: the tiles tuned again inside the step with prefetch 0, 1 and 2 as candidates (coordinate descent).
- shape: the whole step with one shape's GEMVs not waiting, at 512 and 32k tokens: per shape, what hiding its
  transitions could save at most.
- tpot: timed generation at 384 + 128 tokens (bench_h200.timed_generate), with the heap as it is, frozen, and
  with the collector off: where TPOT and the median step differ.

    python3 benchmarks/probe_gemv_overlap.py --out $OUT/gemv_overlap.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import time
import types
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from bench_h200 import make_engine, names_from, positive_int, prompt_ids, timed_generate
from llm_anatomy.engine.tuning import coordinate_descent
from llm_anatomy.kernels import gemv as gemv_module
from probe_decode_parts import decode_forward, fakes_for, interleaved, step_ms

SECTIONS = ["chain", "step", "tune", "tpot", "shape"]
PREFETCHES = (1, 2)


@triton.jit
def launch_only(USE_PDL: tl.constexpr, LAUNCH_FIRST: tl.constexpr = False):
    """gdc_enter without its wait: the kernel no longer waits for the one before (timing only)."""
    if USE_PDL:
        gdc_launch_dependents()


def clone_kernel(kernel, **replaced):
    """The jitted kernel compiled again with some of its module's globals replaced (e.g. gdc_enter)."""
    fn = kernel.fn
    clone = types.FunctionType(fn.__code__, dict(fn.__globals__, **replaced), fn.__name__, fn.__defaults__,
                               fn.__closure__)
    clone.__annotations__ = fn.__annotations__  # the constexpr parameters
    # the original's specialisation (the interpreter keeps its jit keywords in .kwargs)
    jit = {k: getattr(kernel, k, None) or getattr(kernel, "kwargs", {}).get(k) or []
           for k in ("do_not_specialize", "do_not_specialize_on_alignment")}
    return triton.jit(clone, **jit)


def no_wait_kernel():
    """The engine's GEMV kernel compiled with launch_only in place of gdc_enter."""
    return clone_kernel(gemv_module._gemv_kernel, gdc_enter=launch_only)


class Variant:
    """A GEMV variant in force for a `with` block: the kernel (no wait) and/or every tile's prefetch."""

    def __init__(self, kernel=None, prefetch: int | None = None):
        self.kernel, self.prefetch = kernel, prefetch

    def __enter__(self):
        self.saved = (gemv_module._gemv_kernel, dict(gemv_module.TILES))
        if self.kernel is not None:
            gemv_module._gemv_kernel = self.kernel
        if self.prefetch is not None:
            for key, tile in self.saved[1].items():
                # the tile's variant reading that many K tiles ahead (none where K is too short for it)
                gemv_module.TILES[key] = next((t for t in gemv_module.prefetch_variants(tile, key[1])
                                               if t.prefetch == self.prefetch), tile)

    def __exit__(self, *exc):
        gemv_module._gemv_kernel = self.saved[0]
        gemv_module.TILES.clear()
        gemv_module.TILES.update(self.saved[1])


def variants() -> dict[str, Variant]:
    out = {"wait": Variant(), "no_wait": Variant(kernel=no_wait_kernel())}
    out.update({f"prefetch{p}": Variant(prefetch=p) for p in PREFETCHES})
    return out


# ---- chain -------------------------------------------------------------------------------------------------
def weights_of(engine, key) -> list[torch.Tensor]:
    n, k, gated, _ = key
    rows = 2 * n if gated else n
    found = [m.weight for name, m in engine.runner.model.named_modules()
             if isinstance(m, torch.nn.Linear) and tuple(m.weight.shape) == (rows, k)
             and name.endswith("gate_up_proj") == gated]
    return found[:36]


def chain(engine, rounds: int) -> dict:
    out = {}
    for key in engine.runner._gemv_keys():
        weights = weights_of(engine, key)
        x = torch.randn(1, key[1], dtype=weights[0].dtype, device=weights[0].device)
        gated = key[2]
        forward = lambda: [gemv_module.gemv(x, w, gated=gated) for w in weights]  # noqa: E731
        times = defaultdict(list)
        for _ in range(rounds):
            for name, variant in variants().items():
                with variant:
                    times[name].append(step_ms(engine, forward, iters=20) * 1e3 / len(weights))
        nbytes = weights[0].numel() * weights[0].element_size()
        row = {name: {"us": statistics.median(t), "tb_s": nbytes / statistics.median(t) / 1e6}
               for name, t in times.items()}
        row["kernels"], row["mb_each"], row["tile"] = len(weights), nbytes / 1e6, str(gemv_module.TILES.get(key))
        out[str(key)] = row
        print("chain", key, {n: round(r["us"], 2) for n, r in row.items() if isinstance(r, dict)}, flush=True)
    return out


# ---- step --------------------------------------------------------------------------------------------------
def step(engine, rounds: int) -> dict:
    def gemvs_only(variant):
        stack = contextlib.ExitStack()
        stack.enter_context(variant)
        stack.enter_context(fakes_for(["norm", "qk_norm_rope_store", "paged_decode_attention"]))
        return stack

    timed = {}
    for name, variant in variants().items():
        timed[name] = lambda variant=variant: variant
        timed[name + "_gemvs_only"] = lambda variant=variant: gemvs_only(variant)
    out = interleaved(engine, decode_forward(engine), timed, rounds)
    print("step", {n: round(r["ms"], 4) for n, r in out.items()}, flush=True)
    return out


# ---- shape -------------------------------------------------------------------------------------------------
def shape(engine, rounds: int) -> dict:
    """The whole step with one shape's GEMVs not waiting (timing only), the rest as the engine runs them: an upper
    bound on what hiding that shape's transitions (e.g. reading its weights while the kernels before it run)
    could save, per shape, at 512 tokens (the short graph's attention) and at 32k."""
    no_wait, real_gemv = no_wait_kernel(), gemv_module.gemv
    engine_kernel = gemv_module._gemv_kernel

    def gemv_with(target):
        def gemv(x, weight, gated=False, tile=None):
            n = weight.shape[0] // 2 if gated else weight.shape[0]
            if gemv_module.tile_key(n, x.shape[1], gated, weight.dtype) == target:
                gemv_module._gemv_kernel = no_wait
            try:
                return real_gemv(x, weight, gated, tile)
            finally:
                gemv_module._gemv_kernel = engine_kernel
        return gemv

    from llm_anatomy.engine.runner import SHORT_BLOCK_N, SHORT_SPLITS

    variants = {"engine": contextlib.nullcontext}
    variants.update({str(key): lambda key=key: mock.patch.object(gemv_module, "gemv", gemv_with(key))
                     for key in engine.runner._gemv_keys()})
    out = {}
    for context, splits, block_n in ((512, SHORT_SPLITS, SHORT_BLOCK_N), (32768, None, None)):
        out[context] = interleaved(engine, decode_forward(engine, context, splits, block_n), variants, rounds)
        print("shape", context, {n: round(r["ms"], 4) for n, r in out[context].items()}, flush=True)
    return out


# ---- tune --------------------------------------------------------------------------------------------------
def tune(engine) -> dict:
    """The tiles tuned again with every candidate's prefetch variants among the candidates."""
    forward = decode_forward(engine)
    keys = engine.runner._gemv_keys()
    before = dict(gemv_module.TILES)
    start_ms = step_ms(engine, forward)
    candidates = list(gemv_module.CANDIDATE_TILES)
    candidates += [dataclasses.replace(t, prefetch=p) for p in PREFETCHES for t in gemv_module.CANDIDATE_TILES]
    t0 = time.perf_counter()
    best_ms = coordinate_descent(keys, gemv_module.TILES, lambda: step_ms(engine, forward, iters=10), candidates)
    tuned = {str(k): str(gemv_module.TILES[k]) for k in keys}
    tuned_ms = [step_ms(engine, forward) for _ in range(3)]
    gemv_module.TILES.update(before)
    start_again = [step_ms(engine, forward) for _ in range(3)]
    out = {"startup_tiles": {str(k): str(t) for k, t in before.items()}, "startup_ms": start_ms,
           "tuned_tiles": tuned, "tune_best_ms": best_ms, "tuned_ms": tuned_ms, "startup_again_ms": start_again,
           "seconds": time.perf_counter() - t0}
    print("tune", json.dumps(out), flush=True)
    return out


# ---- tpot --------------------------------------------------------------------------------------------------
def tpot(engine) -> dict:
    timed_generate(engine, prompt_ids(128), 16)  # warm-up
    out = {"plain": [timed_generate(engine, prompt_ids(384, 1), 128) for _ in range(3)]}
    gc.collect()
    gc.freeze()
    out["gc_frozen"] = [timed_generate(engine, prompt_ids(384, 1), 128) for _ in range(3)]
    gc.disable()
    out["gc_disabled"] = [timed_generate(engine, prompt_ids(384, 1), 128) for _ in range(3)]
    gc.enable()
    for name, runs in out.items():
        print("tpot", name, runs, flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--sections", type=names_from(SECTIONS, "section"), default=SECTIONS)
    parser.add_argument("--rounds", type=positive_int, default=3)
    args = parser.parse_args(argv)
    engine = make_engine({"model": "Qwen/Qwen3-8B"}, kv_cache_tokens=32768 + 256, max_num_seqs=1)
    out = {"tiles": {str(k): str(t) for k, t in gemv_module.TILES.items()}}
    with torch.inference_mode():
        for name in args.sections:
            if name == "chain":
                out[name] = chain(engine, args.rounds)
            elif name == "step":
                out[name] = step(engine, args.rounds)
            elif name == "tune":
                out[name] = tune(engine)
            elif name == "shape":
                out[name] = shape(engine, args.rounds)
            else:
                out[name] = tpot(engine)
            if args.out:
                Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
