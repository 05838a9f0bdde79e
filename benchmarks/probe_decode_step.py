"""The whole batch-1 decode step as one streaming CUDA kernel (decode_step_kernel.py) against the
engine's CUDA graph of Triton kernels, on the same synthetic Qwen3-8B and the same KV cache.

Checked: after a real prefill, one decode step through the engine's graph and through the kernel, from the same
inputs: the logits (relative error, argmax) and the key and value each wrote into the cache for every layer.
Also the kernel cut to its first layer against the engine's own layers run eagerly, cut alike (where a wrong
result would show first). Phases: the kernel's timeline (each block's stamps at each phase's end) at each
context, and with no weights read at all (--no-weights). Timed: the engine's graph and the kernel's as CUDA graphs
at several contexts (nothing stored, as probe_decode_parts.py's step), interleaved over rounds; with --skips also
the kernel without parts of it, with --interleave the kernel taking interleaved items.

    python3 benchmarks/probe_decode_step.py --contexts 128,512,2048 --out $OUT/decode_step.json
    python3 benchmarks/probe_decode_step.py --no-check --no-timed --no-weights --contexts 512 --out $OUT/parts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench_h200 import cuda_ms, make_engine, names_from, positive_int, prompt_ids, rel
from decode_step_kernel import EVENTS, EVENTS_PER_LAYER, DecodeStepKernel
from llm_anatomy.engine.runner import SHORT_BLOCK_N, SHORT_CONTEXT, SHORT_SPLITS
from llm_anatomy.kernels.pdl import enable_pdl
from llm_anatomy.models.attention import AttentionBatch
from probe_decode_parts import decode_forward
from probe_new_length import prompt_lengths


def statics(runner):
    return (runner.static_ids[:1], runner.static_pos[:1], runner.static_slots[:1], runner.static_lens[:1],
            runner.static_tables[:1])


def eager_logits(engine, n_layers: int) -> torch.Tensor:
    """The engine's model over its first n_layers (then the final norm and LM head), eagerly, from the statics."""
    runner, model = engine.runner, engine.model
    ids, pos, slots, lens, tables = statics(runner)
    batch = AttentionBatch(runner.pool.k, runner.pool.v, slots, False, tables, lens)
    x, residual = model.model.embed_tokens(ids), None
    for layer in model.model.layers[:n_layers]:
        x, residual = layer(x, residual, pos, model.rotary, batch)
    x, _ = model.model.norm.add_forward(x, residual)
    return model.compute_logits(x)


def check(engine, kernel, kernel_one, prompt_len: int, other=None) -> dict:
    """One decode step after a real prefill, through the engine's graph and through the kernel (and `other`, a
    variant of it, if given), from the same inputs."""
    runner, pool = engine.runner, engine.runner.pool
    seq = engine.add_request(prompt_ids(prompt_len, seed=3), engine.sampling_params(temperature=0, max_tokens=2,
                                                                                    ignore_eos=True))
    engine.step()  # the prefill
    assert seq.block_table.ensure(seq.num_tokens)  # the decode step's block, as the scheduler would take it
    ours = runner._replay([seq], None).clone()  # fills the statics, stores this step's K/V
    slot = int(runner.static_slots[0])
    k_ref, v_ref = pool.k.flatten(1, 2)[:, slot].clone(), pool.v.flatten(1, 2)[:, slot].clone()
    pool.k.flatten(1, 2)[:, slot] = 0
    pool.v.flatten(1, 2)[:, slot] = 0
    fused = kernel(*statics(runner)).clone()
    out = {"context": prompt_len + 1, "logits_vs_engine": rel(fused, ours),
           "argmax_equal": bool(fused.argmax() == ours.argmax()),
           "k_vs_engine": rel(pool.k.flatten(1, 2)[:, slot], k_ref),
           "v_vs_engine": rel(pool.v.flatten(1, 2)[:, slot], v_ref)}
    one_ref = eager_logits(engine, 1)
    one = kernel_one(*statics(runner)).clone()
    out["one_layer_logits_vs_eager"] = rel(one, one_ref)
    if other is not None:
        out["variant_logits_vs_engine"] = rel(other(*statics(runner)), ours)
    out["counters_zero"] = bool((kernel.scratch.counter == 0).all())
    while not seq.finished:
        engine.step()
    return out


def timed(engine, kernels: dict, contexts, rounds: int) -> dict:
    runner = engine.runner
    out = {}
    for context in contexts:
        short = context <= SHORT_CONTEXT
        forward = decode_forward(engine, context, SHORT_SPLITS if short else None, SHORT_BLOCK_N if short else None)
        graphs = {"engine": runner._capture_one(forward, shared_pool=False)[0]}
        for name, kernel in kernels.items():
            graphs[name] = runner._capture_one(lambda k=kernel: k(*statics(runner)), shared_pool=False)[0]
        times = {name: [] for name in graphs}
        for _ in range(rounds):
            for name, graph in graphs.items():
                times[name].append(cuda_ms(graph.replay, iters=30, warmup=5))
        out[context] = {name: {"ms": statistics.median(t), "all": t} for name, t in times.items()}
        print("step", context, {n: round(r["ms"], 4) for n, r in out[context].items()}, flush=True)
        del graphs
    return out


def phases(engine, contexts, no_weights: bool = False) -> dict:
    """Where the kernel's time goes: its timeline (each block's stamps when its last warp ends a phase and when the
    wait after it releases the block); per phase the median over layers of the median and of the slowest block's
    duration, in us."""
    runner = engine.runner
    kernel = DecodeStepKernel(engine.model, runner.pool.k, runner.pool.v, timeline=True, no_weights=no_weights)
    out = {}
    for context in contexts:
        decode_forward(engine, context)
        kernel(*statics(runner))
        kernel(*statics(runner))
        torch.cuda.synchronize()
        t = kernel.timeline.double() / 1e3  # us
        g, layers = kernel.grid, kernel.n_layers
        stamps = t[:, :EVENTS_PER_LAYER * layers].view(g, layers, EVENTS_PER_LAYER)
        nxt = torch.cat([stamps[:, 1:, :1], t[:, -2:-1].view(g, 1, 1)], dim=1)  # the next layer's start
        ends = torch.cat([stamps[:, :, 1:], nxt], dim=2)
        dur = ends - stamps  # [blocks, layers, phase]: phase i runs from stamp i to stamp i + 1
        names = EVENTS[1:] + ("wait6",)
        row = {"step_us": (t[:, -1].max() - t[:, 0].min()).item(),
               "lm_head_us": (t[:, -1] - t[:, -2]).median().item()}
        for i, name in enumerate(names):
            row[name] = {"median": dur[:, :, i].median(0).values.median().item(),
                         "slowest": dur[:, :, i].max(0).values.median().item()}
        out[context] = row
        print("phases", context, "no_weights" if no_weights else "", json.dumps(row), flush=True)
    return out


MAX_CONTEXT = 32768 + 512  # the KV pool this probe allocates


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--contexts", type=prompt_lengths, default=[128, 512, 2048, 8192, 32768])
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--no-weights", action="store_true", help="also the phases with no weight read (timing only)")
    parser.add_argument("--no-timed", action="store_true")
    parser.add_argument("--interleave", action="store_true", help="also the kernel with interleaved items (and skips)")
    parser.add_argument("--skips", type=names_from(("1", "2", "3"), "skip"), default=[],
                        help="also time the kernel without parts (decode_step_kernel.source's skip, timing only)")
    args = parser.parse_args(argv)
    if max(args.contexts) > MAX_CONTEXT:
        parser.error(f"--contexts: at most {MAX_CONTEXT} tokens (the KV pool this probe allocates)")
    dev = torch.device("cuda")
    enable_pdl(dev)
    out = {}
    with torch.inference_mode():
        engine = make_engine({"model": "Qwen/Qwen3-8B"}, kv_cache_tokens=MAX_CONTEXT, max_num_seqs=1)
        engine.lookahead = False  # check() replays the first decode step itself
        pool = engine.runner.pool
        kernel = DecodeStepKernel(engine.model, pool.k, pool.v)
        interleaved = DecodeStepKernel(engine.model, pool.k, pool.v, interleave=True) if args.interleave else None
        if not args.no_check:
            kernel_one = DecodeStepKernel(engine.model, pool.k, pool.v, n_layers=1)
            out["check"] = [check(engine, kernel, kernel_one, n, interleaved) for n in (500, 4000)]
            print("check", json.dumps(out["check"]), flush=True)
        out["phases"] = phases(engine, args.contexts)
        if args.no_weights:
            out["phases_no_weights"] = phases(engine, args.contexts, no_weights=True)
        if not args.no_timed:
            kernels = {"kernel": kernel, "kernel_interleave": interleaved}
            for skip in map(int, args.skips):
                kernels[f"kernel_skip{skip}"] = DecodeStepKernel(engine.model, pool.k, pool.v, skip=skip)
                if args.interleave:
                    kernels[f"kernel_interleave_skip{skip}"] = DecodeStepKernel(engine.model, pool.k, pool.v,
                                                                                skip=skip, interleave=True)
            out["step"] = timed(engine, {k: v for k, v in kernels.items() if v is not None}, args.contexts,
                                args.rounds)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
