"""Does a GEMV that streams its weights before its PDL wait (llm_anatomy/kernels/stream_gemv.py) shorten the
batch-1 decode step?

- shapes: each of Qwen3-8B's decode GEMV shapes, the streaming kernel against the engine's Triton GEMV (its tuned
  tile): outputs against a float32 product (relative error) and against each other; the time of LAUNCHES
  launches back to back in a CUDA graph (each waits for the one before, as in the step).
- splits: the step with the attention split into other numbers of parts per KV head than the engine's.
- step: the engine's batch-1 decode step at 512 tokens (the short graph) and 32k, captured again and timed
  interleaved over rounds: the engine as it is (the streaming GEMV; the RMSNorms and the attention's merge, which
  feed one, launch it before they wait, so that its blocks land as the GEMV before leaves), `triton` (the Triton
  GEMV at batch 1, as before), variants of the launch order, the ring's size and the stage's size, and the
  norms before qkv and gate_up in kernels of their own again (VARIANTS). Logits against the engine's.

    python3 benchmarks/probe_stream_gemv.py --out $OUT/stream_gemv.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

import torch

from bench_h200 import cuda_ms, make_engine, names_from, positive_int
from llm_anatomy.kernels import gemv
from llm_anatomy.kernels import stream_gemv as sg
from llm_anatomy.models import qwen3
from probe_decode_parts import decode_forward, interleaved, step_ms
from probe_early_launch import early, logits_of

LAUNCHES = 36
SHAPES = {"qkv": (6144, 4096, False), "o_proj": (4096, 4096, False), "gate_up": (12288, 4096, True),
          "down": (4096, 12288, False), "lm_head": (151936, 4096, False)}
ENGINE_FIRST = ["gemv", "split", "norm", "merge"]  # the kernels that launch their successor first (pdl.py)
# name -> (streaming GEMV on, the kernel families that launch first (None: as the engine decides), the ring's
# bytes, a stage's bytes, and whether the norms before qkv and gate_up run in their GEMVs (qwen3.NORM_IN_GEMV))
VARIANTS = {"engine": (True, None, sg.RING_BYTES, sg.STAGE_BYTES, True), "triton": (False, None, None, None, True),
            "stream_norms_wait": (True, ["gemv", "split"], sg.RING_BYTES, sg.STAGE_BYTES, True),
            "rope_first": (True, ENGINE_FIRST + ["rope"], sg.RING_BYTES, sg.STAGE_BYTES, True),
            "split_waits": (True, ["gemv", "norm", "merge"], sg.RING_BYTES, sg.STAGE_BYTES, True),
            "ring_128k": (True, None, 128 * 1024, sg.STAGE_BYTES, True),
            "ring_224k": (True, None, 224 * 1024, sg.STAGE_BYTES, True),
            "stage_16k": (True, None, sg.RING_BYTES, 16 * 1024, True),
            "norms_apart": (True, None, sg.RING_BYTES, sg.STAGE_BYTES, False)}


@contextlib.contextmanager
def streaming(on: bool, ring: int | None, stage: int | None):
    saved = sg.STREAM.on, sg.RING_BYTES, sg.STAGE_BYTES
    sg.STREAM.on = on
    sg.RING_BYTES, sg.STAGE_BYTES = ring or saved[1], stage or saved[2]
    try:
        yield
    finally:
        sg.STREAM.on, sg.RING_BYTES, sg.STAGE_BYTES = saved


@contextlib.contextmanager
def norm_in_gemv(on: bool):
    saved = qwen3.NORM_IN_GEMV
    qwen3.NORM_IN_GEMV = on
    try:
        yield
    finally:
        qwen3.NORM_IN_GEMV = saved


@contextlib.contextmanager
def variant(name: str, clones: dict):
    on, families, ring, stage, norms_in = VARIANTS[name]
    with streaming(on, ring, stage), early(families, clones), norm_in_gemv(norms_in):
        yield


def section_shapes(dev) -> dict:
    out = {}
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k, gated) in SHAPES.items():
        w = (torch.randn(2 * n if gated else n, k, device=dev, generator=g) / k ** 0.5).bfloat16()
        x = torch.randn(1, k, device=dev, generator=g).bfloat16()
        ref = x.float() @ w.float().T
        if gated:
            gate, up = ref[:, :n].bfloat16().float(), ref[:, n:].bfloat16().float()
            ref = (torch.nn.functional.silu(gate).bfloat16().float() * up)
        streamed = sg.stream_gemv(x, w, gated)
        with streaming(False, None, None):
            triton_y = gemv.gemv(x, w, gated)
        torch.cuda.synchronize()
        row = {"rel_err_stream": ((streamed.float() - ref).norm() / ref.norm()).item(),
               "rel_err_triton": ((triton_y.float() - ref).norm() / ref.norm()).item(),
               "max_diff_stream_triton": (streamed.float() - triton_y.float()).abs().max().item(),
               "equal_fraction": (streamed == triton_y).float().mean().item()}
        for kind, on in (("triton", False), ("stream", True)):
            def chain(on=on):
                with streaming(on, None, None):
                    for _ in range(LAUNCHES):
                        gemv.gemv(x, w, gated)
            chain()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain()
            us = cuda_ms(graph.replay, iters=20, warmup=3) * 1e3 / LAUNCHES
            row[f"{kind}_us"] = us
            row[f"{kind}_tb_s"] = w.numel() * 2 / us / 1e6
            del graph
        out[name] = row
        print(name, {k: round(v, 5) for k, v in row.items()}, flush=True)
    return out


def section_step(engine, contexts: list[int], names: list[str], rounds: int) -> dict:
    from llm_anatomy.engine.runner import SHORT_BLOCK_N, SHORT_SPLITS

    clones: dict = {}
    out = {}
    with torch.inference_mode():
        for context in contexts:
            short = context <= 2048
            forward = decode_forward(engine, context, SHORT_SPLITS if short else None, SHORT_BLOCK_N if short else None)
            ref = logits_of(engine, forward, variant("engine", clones))
            check = {}
            for name in names:
                logits = logits_of(engine, forward, variant(name, clones))
                check[name] = {"max_abs_diff": (logits - ref).abs().max().item(),
                               "argmax_equal": bool((logits.argmax(-1) == ref.argmax(-1)).all())}
            timed = interleaved(engine, forward, {v: lambda v=v: variant(v, clones) for v in names}, rounds)
            out[context] = {v: {**timed[v], **check[v]} for v in names}
            print(context, {v: (round(r["ms"], 4), round(r["max_abs_diff"], 4)) for v, r in out[context].items()},
                  flush=True)
    return out


def section_splits(engine, contexts: list[int], splits: list[int], rounds: int) -> dict:
    """The step at each context with the attention's context split this many ways per KV head (128-token tiles),
    the engine's kernels otherwise, timed in turns over the rounds."""
    out = {}
    with torch.inference_mode():
        for context in contexts:
            times = {s: [] for s in splits}
            for _ in range(rounds):
                for s in splits:
                    times[s].append(step_ms(engine, decode_forward(engine, context, s, None)))
            out[context] = {s: {"ms": statistics.median(t), "all": t} for s, t in times.items()}
            print(context, {s: round(r["ms"], 4) for s, r in out[context].items()}, flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--sections", type=names_from(["shapes", "step", "splits"], "section"),
                        default=["shapes", "step"])
    parser.add_argument("--splits", type=lambda v: [positive_int(s) for s in v.split(",")], default=[24, 33, 48, 66],
                        help="section splits: the attention's splits per KV head to time")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--model", default="Qwen/Qwen3-8B", help="sections step and splits: the model (synthetic)")
    parser.add_argument("--variants", type=names_from(list(VARIANTS), "variant"), default=list(VARIANTS))
    parser.add_argument("--contexts", type=names_from(["512", "2048", "4096", "8192", "32768"], "context"),
                        default=["512", "32768"])
    args = parser.parse_args(argv)
    out = {}
    engine = make_engine({"model": args.model}, kv_cache_tokens=32768 + 256, max_num_seqs=1)
    dev = torch.device("cuda")
    if "shapes" in args.sections:
        out["shapes"] = section_shapes(dev)
    if "step" in args.sections:
        names = ["engine"] + [v for v in args.variants if v != "engine"]
        out["step"] = section_step(engine, list(map(int, args.contexts)), names, args.rounds)
    if "splits" in args.sections:
        out["splits"] = section_splits(engine, list(map(int, args.contexts)), args.splits, args.rounds)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
