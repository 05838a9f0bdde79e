"""The batch-1 decode step with o_proj, the norm and the MLP as one streaming CUDA kernel (kernels/stream_block.py)
(stream_block), with o_proj left to the Triton GEMV (stream_mlp), and with the Triton kernels it replaces, interleaved on one engine (synthetic Qwen3-8B) at 512 tokens (the short
graph's attention) and at 32k.

    python3 benchmarks/probe_stream_block.py --rounds 7 --out $OUT/stream_block.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from unittest import mock

import torch

from bench_h200 import make_engine, positive_int
from llm_anatomy.engine.runner import SHORT_BLOCK_N, SHORT_SPLITS
from llm_anatomy.kernels import stream_block
from probe_decode_parts import decode_forward, interleaved


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=positive_int, default=5)
    args = parser.parse_args(argv)
    engine = make_engine({"model": "Qwen/Qwen3-8B"}, kv_cache_tokens=32768 + 256, max_num_seqs=1)
    variants = {"stream_block": contextlib.nullcontext, "stream_mlp": lambda: mock.patch.object(
        stream_block.STREAM, "with_o_proj", False), "kernels": stream_block.disabled}
    out = {}
    with torch.inference_mode():
        for context, splits, block_n in ((512, SHORT_SPLITS, SHORT_BLOCK_N), (32768, None, None)):
            forward = decode_forward(engine, context, splits, block_n)
            out[context] = interleaved(engine, forward, variants, args.rounds)
            print("step", context, {n: round(r["ms"], 4) for n, r in out[context].items()}, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
