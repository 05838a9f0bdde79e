"""Does the batch-1 decode step get faster if down's GEMV starts on each chunk of the activation as soon as gate_up
has written it (gemv.mlp_chunked), rather than waiting for the whole gate_up kernel?

With programmatic dependent launch down's programs launch while gate_up's last ones still run (gate_up lets its
successor launch first); with chunk flags they stream the chunks already written instead of waiting at the
kernel boundary. The sixth session measured down at 25.3 us a layer waiting and 22.0 not waiting at all (timing
only): up to 0.12 ms a step. Each variant's step is captured again and timed interleaved with the others over
rounds, at 512 tokens (the short graph's attention) and 32k; its logits are compared with the plain GEMVs' (the
same products in the same order: they should be equal bit for bit).

    python3 benchmarks/probe_mlp_chunks.py --out $OUT/mlp_chunks.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from unittest import mock

import torch

from bench_h200 import make_engine, names_from, positive_int
from llm_anatomy.kernels import gemv
from probe_decode_parts import decode_forward, interleaved

VARIANTS = {"plain": (False, gemv.CHUNKS), "chunks 2": (True, 2), "chunks 4": (True, 4)}  # (chunked, chunks)


@contextlib.contextmanager
def as_variant(name: str):
    chunked, chunks = VARIANTS[name]
    with mock.patch.object(gemv, "CHUNKED_MLP", chunked), mock.patch.object(gemv, "CHUNKS", chunks):
        yield


def logits_of(engine, forward, variant: str) -> torch.Tensor:
    with as_variant(variant):
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
    out = {"tiles": {str(k): str(t) for k, t in engine.runner.tile_tuning.tiles.items()}}
    with torch.inference_mode():
        for context in map(int, args.contexts):
            short = context <= 2048
            forward = decode_forward(engine, context, SHORT_SPLITS if short else None, SHORT_BLOCK_N if short else None)
            ref = logits_of(engine, forward, "plain")
            same = {v: bool(torch.equal(logits_of(engine, forward, v), ref)) for v in args.variants}
            timed = interleaved(engine, forward, {v: lambda v=v: as_variant(v) for v in args.variants}, args.rounds)
            out[context] = {v: {**timed[v], "logits_equal": same[v]} for v in args.variants}
            print(context, {v: (round(r["ms"], 4), r["logits_equal"]) for v, r in out[context].items()}, flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
