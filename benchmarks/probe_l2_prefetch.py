"""Does asking o_proj's weights into L2 while the decode attention runs shorten the batch-1 decode step?

At short contexts the attention (QK-norm/RoPE, split, merge) takes ~8 us a layer with DRAM nearly idle. The
split kernel's programs can ask for the next GEMV's weights (o_proj, 32 MB of the H200's 50 MB L2) before their
PDL wait (kernels/l2.py); o_proj then reads them from L2. One engine (synthetic Qwen3-8B), the batch-1 step
captured and timed interleaved over rounds, at contexts with the short graph's attention (<= 2048 tokens) and
at 32k with the long one's (where the cache's reads might evict the weights first), under three variants:
  off: no prefetch; o_proj: all of o_proj's weight; o_proj_half: its first half.
  (each as bulk prefetches, l2.BULK, and as one prefetch per line, l2.LINES). The logits of the variants are
compared (a prefetch changes no result).

pair: 36 layers of [attention at 512 tokens (the short graph's), o_proj's GEMV] alone, in a CUDA graph with
PDL, each layer with its own weight: without the prefetch, with it (both modes), and the attention alone with
and without it (does issuing the prefetch slow the attention?).

    python3 benchmarks/probe_l2_prefetch.py --rounds 7 --out $OUT/l2_prefetch.json
    python3 benchmarks/probe_l2_prefetch.py --pair --rounds 7 --out $OUT/l2_pair.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch

from bench_h200 import cuda_ms, make_engine, positive_int
from llm_anatomy.engine.runner import SHORT_BLOCK_N, SHORT_SPLITS
from llm_anatomy.kernels import decode_attention, gemv, l2
from llm_anatomy.kernels.pdl import enable_pdl
from llm_anatomy.models import qwen3
from probe_decode_parts import decode_forward, interleaved

LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 36, 32, 8, 128, 4096  # Qwen3-8B
CONTEXTS = {128: True, 512: True, 2048: True, 32768: False}  # context -> the short graph's attention


@contextlib.contextmanager
def prefetching(fraction: float | None, mode: int = l2.BULK):
    """A context in which the decode attention asks for `fraction` of o_proj's weight (None: as the forward
    says), issued as `mode` says."""
    attend = qwen3.paged_decode_attention

    def patched(*args, prefetch=None, **kwargs):
        if prefetch is not None:
            flat = prefetch.view(-1)
            prefetch = flat[:int(len(flat) * fraction)] if fraction > 0 else None
        return attend(*args, prefetch=prefetch, **kwargs)
    with mock.patch.object(l2, "MODE", mode):
        if fraction is None:
            yield
        else:
            with mock.patch.object(qwen3, "paged_decode_attention", patched):
                yield


VARIANTS = {"off": (0.0, l2.BULK), "bulk": (None, l2.BULK), "lines": (None, l2.LINES),
            "lines_half": (0.5, l2.LINES)}


def pair(rounds: int) -> dict:
    """36 layers of attention and o_proj, with and without the prefetch (see the module's docstring), in ms."""
    dev = torch.device("cuda")
    context, page = 512, 16
    k = torch.randn(LAYERS, context // page, page, KV_HEADS, HEAD_DIM, device=dev).bfloat16()
    v = torch.randn_like(k)
    weights = [torch.randn(HIDDEN, HEADS * HEAD_DIM, device=dev).bfloat16() * 0.02 for _ in range(LAYERS)]
    q = torch.randn(1, HEADS, HEAD_DIM, device=dev).bfloat16()
    table = torch.arange(context // page, dtype=torch.int32, device=dev)[None]
    lens = torch.tensor([context], dtype=torch.int32, device=dev)

    def chain(mode: int, prefetch: bool, project: bool):
        def run():
            with mock.patch.object(l2, "MODE", mode):
                for i in range(LAYERS):
                    out = decode_attention.paged_decode_attention(
                        q, k[i], v[i], table, lens, HEAD_DIM ** -0.5, splits=SHORT_SPLITS, block_n=SHORT_BLOCK_N,
                        prefetch=weights[i] if prefetch else None)
                    if project:
                        gemv.gemv(out.view(1, -1), weights[i])
        return run

    runs = {"attn_oproj": chain(l2.BULK, False, True), "attn_oproj_bulk": chain(l2.BULK, True, True),
            "attn_oproj_lines": chain(l2.LINES, True, True), "attn": chain(l2.BULK, False, False),
            "attn_bulk": chain(l2.BULK, True, False), "attn_lines": chain(l2.LINES, True, False)}
    graphs = {}
    for name, run in runs.items():
        run()
        torch.cuda.synchronize()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            run()
    times = defaultdict(list)
    for _ in range(rounds):
        for name, graph in graphs.items():
            times[name].append(cuda_ms(graph.replay, iters=20, warmup=3))
    return {name: {"ms": statistics.median(t), "all": t} for name, t in times.items()}


def logits_diff(engine, forward) -> float:
    """Largest difference between the logits with the prefetch and without (expected: 0)."""
    outs = []
    for fraction in (None, 0.0):  # the engine's mode
        with prefetching(fraction):
            outs.append(forward().float())
    return (outs[0] - outs[1]).abs().max().item()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--pair", action="store_true", help="only the 36 layers of attention and o_proj")
    args = parser.parse_args(argv)
    enable_pdl(torch.device("cuda"))
    if args.pair:
        with torch.inference_mode():
            out = {"pair": pair(args.rounds)}
        print({n: round(r["ms"], 4) for n, r in out["pair"].items()})
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
        return
    engine = make_engine({"model": "Qwen/Qwen3-8B"}, kv_cache_tokens=32768 + 256, max_num_seqs=1)
    out = {}
    with torch.inference_mode():
        for context, short in CONTEXTS.items():
            splits, block_n = (SHORT_SPLITS, SHORT_BLOCK_N) if short else (None, None)
            forward = decode_forward(engine, context, splits, block_n, prefetch=True)
            variants = {name: (lambda f=f, m=m: prefetching(f, m)) for name, (f, m) in VARIANTS.items()}
            out[context] = interleaved(engine, forward, variants, args.rounds)
            out[context]["logits_max_abs_diff"] = logits_diff(engine, forward)
            print("step", context, {n: round(r["ms"], 4) for n, r in out[context].items() if isinstance(r, dict)},
                  "logits diff", out[context]["logits_max_abs_diff"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
