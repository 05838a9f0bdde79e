"""What does the decode attention cost inside the batch-1 decode step, by context length, and what would a
different split of its work cost?  The step's graph is captured with the attention swapped for variants of
the engine's kernels (tile, number of splits, the merge kernel left out: timing only, the output then is
wrong) and timed interleaved, at several context lengths.

    python3 benchmarks/probe_decode_attention.py --out $OUT/decode_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources

from bench_h200 import make_engine, names_from, positive_int
from llm_anatomy.kernels import decode_attention as da
from llm_anatomy.kernels.pdl import PDL
from llm_anatomy.models import qwen3
from probe_decode_parts import decode_forward, step_ms
from probe_new_length import prompt_lengths


def split_only(q, k_cache, v_cache, tables, lens, scale, splits=None, block_n=None):
    """The first kernel alone (the merge left out): what the attention would cost without a second launch."""
    batch, n_heads, head_dim = q.shape
    block_n = block_n or da.BLOCK_N
    n_kv, page = k_cache.shape[2], k_cache.shape[1]
    splits = splits or da.default_splits(batch, n_kv, torch.cuda.get_device_properties(q.device).multi_processor_count)
    acc = torch.empty(batch, n_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(batch, n_heads, splits, 2, dtype=torch.float32, device=q.device)
    da._decode_attention_split_kernel[(batch, n_kv, splits)](
        q, k_cache, v_cache, tables, lens, acc, ml, scale, q.stride(0), q.stride(1), tables.stride(0), n_kv, page,
        splits, GROUP=n_heads // n_kv, GROUP_PAD=max(16, triton.next_power_of_2(n_heads // n_kv)), HEAD_DIM=head_dim,
        BLOCK_N=block_n, IEEE=False, USE_PDL=PDL.on, launch_pdl=PDL.on, num_warps=da.NUM_WARPS,
        num_stages=da.NUM_STAGES)
    return q


def variant(fn=None, **fixed):
    """The attention as the step calls it (with the graph's splits and tile), those given here taking over."""
    fn = fn or da.paged_decode_attention
    return lambda *a, splits=None, block_n=None: fn(*a, **{"splits": splits, "block_n": block_n, **fixed})


VARIANTS = {
    "engine": variant(),
    "bn64": variant(block_n=64),
    "splits8": variant(splits=8),
    "splits16": variant(splits=16),
    "splits4": variant(splits=4),
    "bn64_splits4": variant(splits=4, block_n=64),
    "bn64_splits8": variant(splits=8, block_n=64),
    "bn64_splits16": variant(splits=16, block_n=64),
    "bn32_splits8": variant(splits=8, block_n=32),
    "no_merge": variant(split_only),
    "one_split_no_merge": variant(split_only, splits=1),
    "one_split_no_merge_bn64": variant(split_only, splits=1, block_n=64),
    "none": lambda q, *a, **kw: q,
}
# Pipelining and warps, for the long contexts (where the cache's bytes dominate): sNwM = num_stages N, num_warps M.
for _bn in (64, 128):
    for _splits in (None, 16, 24, 48):
        for _stages, _warps in ((2, 8), (3, 4), (3, 8), (4, 4)):
            VARIANTS[f"bn{_bn}_splits{_splits or 'default'}_s{_stages}w{_warps}"] = variant(
                splits=_splits, block_n=_bn, num_stages=_stages, num_warps=_warps)


MAX_CONTEXT = 36864


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--contexts", type=prompt_lengths, default=[128, 512, 2048, 8192, 32768])
    parser.add_argument("--variants", type=names_from(list(VARIANTS), "variant"), default=list(VARIANTS))
    args = parser.parse_args(argv)
    if max(args.contexts) > MAX_CONTEXT:
        parser.error(f"--contexts: at most {MAX_CONTEXT} tokens (the KV pool this probe allocates)")
    engine = make_engine({"model": "Qwen/Qwen3-8B"}, kv_cache_tokens=MAX_CONTEXT, max_num_seqs=1,
                         max_model_len=MAX_CONTEXT)
    real = qwen3.paged_decode_attention
    out = {}
    with torch.inference_mode():
        for context in args.contexts:
            forward = decode_forward(engine, context)
            times = defaultdict(list)
            for _ in range(args.rounds):
                for name in args.variants:
                    qwen3.paged_decode_attention = VARIANTS[name]
                    try:
                        times[name].append(step_ms(engine, forward, iters=30))
                    except OutOfResources:  # the tile does not fit in shared memory
                        pass
                    finally:
                        qwen3.paged_decode_attention = real
            out[context] = {name: statistics.median(t) for name, t in times.items() if t}
            print(context, {k: round(v, 4) for k, v in out[context].items()}, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
