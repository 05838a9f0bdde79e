"""Does the batch-1 decode step get faster if some kernels let their successor launch before they wait?

With programmatic dependent launch every kernel of the step first waits for the one before it, then lets the next
launch (llm_anatomy/kernels/pdl.py). So a GEMV that follows a small kernel (qkv after the input norm, gate_up
after the post-attention norm, o_proj after the attention merge) is launched only once the GEMV before that small
kernel has completed: its programs start reading weights after the whole drain of the one before. If the small
kernel lets the next launch first and then waits, the GEMV's programs can become resident on the multiprocessors
the GEMV before frees as it drains, and read their first weight tiles there (the tiles' prefetch) while it
finishes. Nothing else changes: each kernel still waits for the one before it, which waited for its own.

The seventh session tried this for every small kernel at once, with L2 prefetches: 4.90 ms a step against 4.33.
Here the early launch is given to one family of kernels at a time, and to some together, all other kernels
waiting first; `engine` is the engine as it is (since this probe: the GEMVs and the attention's split kernel
launch first). Each variant's step is captured again and timed interleaved with the others over rounds, at 512
tokens (the short graph's attention) and 32k, and its logits are compared with the engine's (the same kernels in
the same order: they should be equal bit for bit).

    python3 benchmarks/probe_early_launch.py --out $OUT/early_launch.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from bench_h200 import make_engine, names_from, positive_int
from llm_anatomy.kernels import decode_attention, gemv, norm, rope
from probe_decode_parts import decode_forward, interleaved
from probe_gemv_overlap import clone_kernel

# family -> (module, the kernel's name in it)
FAMILIES = {"norm": (norm, "_rmsnorm_kernel"), "merge": (decode_attention, "_decode_attention_merge_kernel"),
            "split": (decode_attention, "_decode_attention_split_kernel"),
            "rope": (rope, "_qk_norm_rope_store_kernel"), "gemv": (gemv, "_gemv_kernel")}
VARIANTS = {"engine": None, "none": [], "norm": ["norm"], "merge": ["merge"], "norm_merge": ["norm", "merge"],
            "gemv": ["gemv"], "norm_merge_gemv": ["norm", "merge", "gemv"],
            "all": ["norm", "merge", "split", "rope", "gemv"],
            "gemv_rope": ["gemv", "rope"], "gemv_split": ["gemv", "split"], "gemv_merge": ["gemv", "merge"],
            "gemv_rope_split": ["gemv", "rope", "split"], "gemv_rope_split_merge": ["gemv", "rope", "split", "merge"],
            "gemv_split_merge": ["gemv", "split", "merge"]}


@triton.jit
def launch_first(USE_PDL: tl.constexpr, LAUNCH_FIRST: tl.constexpr = False):
    """gdc_enter letting the next kernel launch before this one's wait returns, whatever the kernel asks."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def wait_first(USE_PDL: tl.constexpr, LAUNCH_FIRST: tl.constexpr = False):
    """gdc_enter waiting before the next kernel may launch, whatever the kernel asks."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@contextlib.contextmanager
def early(families: list[str] | None, clones: dict):
    """Every family's kernels replaced by clones that launch their successor first (the families named) or wait
    first (the others); None: the engine's kernels as they are. Clones are compiled once, kept in `clones`."""
    saved = {f: getattr(*FAMILIES[f]) for f in FAMILIES}
    for f in FAMILIES if families is not None else ():
        first = f in families
        if (f, first) not in clones:
            clones[f, first] = clone_kernel(saved[f], gdc_enter=launch_first if first else wait_first)
        setattr(*FAMILIES[f], clones[f, first])
    try:
        yield
    finally:
        for f, kernel in saved.items():
            setattr(*FAMILIES[f], kernel)


def logits_of(engine, forward, variant) -> torch.Tensor:
    """The step's logits with its graph captured again inside `variant` (a context manager)."""
    with variant:
        graph, out = engine.runner._capture_one(forward)
        graph.replay()
        torch.cuda.synchronize()
    return out.clone()


def main(argv=None):
    from llm_anatomy.engine.runner import SHORT_BLOCK_N, SHORT_SPLITS

    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--variants", type=names_from(list(VARIANTS), "variant"), default=list(VARIANTS))
    parser.add_argument("--contexts", type=names_from(["512", "32768"], "context"), default=["512", "32768"])
    args = parser.parse_args(argv)
    engine = make_engine({"model": "Qwen/Qwen3-8B"}, kv_cache_tokens=32768 + 256, max_num_seqs=1)
    variants = {"engine": None} | {v: VARIANTS[v] for v in args.variants}
    clones: dict = {}
    out = {}
    with torch.inference_mode():
        for context in map(int, args.contexts):
            short = context <= 2048
            forward = decode_forward(engine, context, SHORT_SPLITS if short else None, SHORT_BLOCK_N if short else None)
            ref = logits_of(engine, forward, early(None, clones))
            same = {v: bool(torch.equal(logits_of(engine, forward, early(f, clones)), ref))
                    for v, f in variants.items()}
            timed = interleaved(engine, forward, {v: lambda f=f: early(f, clones) for v, f in variants.items()},
                                args.rounds)
            out[context] = {v: {**timed[v], "logits_equal": same[v]} for v in variants}
            print(context, {v: (round(r["ms"], 4), r["logits_equal"]) for v, r in out[context].items()}, flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
