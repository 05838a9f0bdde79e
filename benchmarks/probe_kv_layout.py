"""Does decode attention read a long context faster when each KV head's tokens are contiguous?

The KV cache is laid out [layers, pages, page_size, kv_heads, head_dim]: a token's heads sit together, so one
(KV head, split) program reads 256-byte pieces 2 KB apart. Head-major, [layers, kv_heads, pages, page_size,
head_dim], a page of one head is one contiguous run. The decode attention kernel reads either (it takes the
slot and head strides), so here the same kernel runs over both layouts (with --layouts; else token-major
only): 36 layers of batch-1 attention (split + merge) at 512, 2k, 8k and 32k tokens, in a CUDA graph with
programmatic dependent launch, with the engine's tile and splits and others (more splits, the merge's warps, the
short graph's attention); pages in order (a fresh pool) and, with --layouts, shuffled (a long-running server's).

    python3 benchmarks/probe_kv_layout.py --out $OUT/kv_layout.json
    python3 benchmarks/probe_kv_layout.py --step --rounds 7 --out $OUT/kv_merge_step.json  # the merge, in the step
    python3 benchmarks/probe_kv_layout.py --tiles engine,short --out $OUT/kv.json  # only these tiles
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

from bench_h200 import cuda_ms, make_engine, names_from, positive_int
from llm_anatomy.kernels import decode_attention
from llm_anatomy.engine.runner import SHORT_BLOCK_N, SHORT_SPLITS
from llm_anatomy.kernels.pdl import enable_pdl
from probe_decode_parts import decode_forward, interleaved

LAYERS, HEADS, KV_HEADS, HEAD_DIM, PAGE = 36, 32, 8, 128, 16  # the engine's page (block_size)
CONTEXTS = (512, 2048, 8192, 32768)
TILES = {"engine": {}, "w8": {"num_warps": 8}, "n64": {"block_n": 64}, "s3": {"num_stages": 3},
         "n64_w8_s3": {"block_n": 64, "num_warps": 8, "num_stages": 3},
         # more programs than the engine's two per multiprocessor (33 splits at batch 1)
         "splits66": {"splits": 66}, "splits99": {"splits": 99}, "splits132": {"splits": 132},
         "splits66_s3": {"splits": 66, "num_stages": 3}, "splits66_w8": {"splits": 66, "num_warps": 8},
         "splits66_n64": {"splits": 66, "block_n": 64},
         # the merge kernel's warps (decode_attention.merge_warps: two at 33 splits; one before, which spilled)
         "merge_w1": {"merge_warps": 1}, "merge_w2": {"merge_warps": 2}, "merge_w4": {"merge_warps": 4},
         "merge_w8": {"merge_warps": 8}, "splits66_merge_w1": {"splits": 66, "merge_warps": 1},
         # the engine's short-context graph (runner.SHORT_CONTEXT: 16 splits of 64 tokens) and its neighbours
         "short": {"splits": 16, "block_n": 64}, "short_merge_w2": {"splits": 16, "block_n": 64, "merge_warps": 2},
         "short_splits8": {"splits": 8, "block_n": 64}, "short_splits24": {"splits": 24, "block_n": 64},
         "splits66_merge_w4": {"splits": 66, "merge_warps": 4}, "splits16_merge_w4": {"splits": 16, "merge_warps": 4}}


def caches(layout: str, pages: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, [layers, pages, page, kv_heads, head_dim] as views, stored token-major or head-major."""
    if layout == "token_major":
        shape = (LAYERS, pages, PAGE, KV_HEADS, HEAD_DIM)
        return torch.randn(shape, device=dev).bfloat16(), torch.randn(shape, device=dev).bfloat16()
    shape = (LAYERS, KV_HEADS, pages, PAGE, HEAD_DIM)
    k, v = torch.randn(shape, device=dev).bfloat16(), torch.randn(shape, device=dev).bfloat16()
    return k.permute(0, 2, 3, 1, 4), v.permute(0, 2, 3, 1, 4)


def merge_warps(warps: int | None):
    """A context in which the merge kernel is launched with `warps` warps (None: the engine's rule)."""
    if warps is None:
        return contextlib.nullcontext()
    return mock.patch.object(decode_attention, "merge_warps", lambda splits_pad, d_block: warps)


def merge_chunks(chunks: int):
    """A context in which the merge cuts each head into `chunks` pieces (decode_attention.merge_chunks)."""
    return mock.patch.object(decode_attention, "merge_chunks", lambda programs, head_dim, sm_count: chunks)


def step(rounds: int) -> dict:
    """The engine's batch-1 decode step at 512 tokens (its short graph's attention) and at 32k, with the merge
    kernel by the engine's rules (its warps, its pieces of a head), with one warp, and with each head in 1, 2 or
    8 pieces, interleaved."""
    engine = make_engine({"model": "Qwen/Qwen3-8B"}, kv_cache_tokens=32768 + 256, max_num_seqs=1)
    variants = {"rule": lambda: merge_warps(None), "one_warp": lambda: merge_warps(1),
                "whole_heads": lambda: merge_chunks(1), "pieces2": lambda: merge_chunks(2),
                "pieces8": lambda: merge_chunks(8)}
    out = {}
    for context, splits, block_n in ((512, SHORT_SPLITS, SHORT_BLOCK_N), (32768, None, None)):
        out[context] = interleaved(engine, decode_forward(engine, context, splits, block_n), variants, rounds)
        print("step", context, {n: round(r["ms"], 4) for n, r in out[context].items()}, flush=True)
    return out


tile_list = names_from(TILES, "tile")


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--layouts", action="store_true", help="also head-major storage and shuffled pages")
    parser.add_argument("--step", action="store_true", help="only the engine's decode step, the merge's variants")
    parser.add_argument("--tiles", type=tile_list, default=list(TILES), help=f"comma-separated, of {','.join(TILES)}")
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    enable_pdl(dev)
    if args.step:
        with torch.inference_mode():
            out = {"step": step(args.rounds)}
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
        return
    out = {}
    for context in CONTEXTS:
        pages = -(-context // PAGE)
        q = torch.randn(1, HEADS, HEAD_DIM, device=dev).bfloat16()
        lens = torch.tensor([context], dtype=torch.int32, device=dev)
        tables = {"in_order": torch.arange(pages, dtype=torch.int32, device=dev)[None],
                  "shuffled": torch.randperm(pages, device=dev).int()[None]}
        graphs, outputs = {}, {}
        token_k, token_v = caches("token_major", pages, dev)
        head_k, head_v = caches("head_major", pages, dev)
        head_k.copy_(token_k)  # the same values, for the check
        head_v.copy_(token_v)
        layouts = (("token_major", (token_k, token_v)), ("head_major", (head_k, head_v)))
        for layout, (k, v) in layouts if args.layouts else layouts[:1]:
            for order, table in tables.items() if args.layouts else [("in_order", tables["in_order"])]:
                for tile_name in args.tiles:
                    tile = dict(TILES[tile_name])
                    warps = tile.pop("merge_warps", None)
                    fn = lambda k=k, v=v, table=table, tile=tile: [  # noqa: E731
                        decode_attention.paged_decode_attention(q, k[i], v[i], table, lens, HEAD_DIM ** -0.5, **tile)
                        for i in range(LAYERS)]
                    with merge_warps(warps):
                        outputs[(layout, order, tile_name)] = fn()[-1]
                        torch.cuda.synchronize()
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            fn()
                    graphs[f"{layout}/{order}/{tile_name}"] = (graph, k, v)
        ref = outputs[("token_major", "in_order", args.tiles[0])].float()
        diff = max(((o.float() - ref).abs().max().item()) for key, o in outputs.items() if key[1] == "in_order")
        times = defaultdict(list)
        for _ in range(args.rounds):
            for name, (graph, _, _) in graphs.items():
                times[name].append(cuda_ms(graph.replay, iters=10, warmup=2))
        nbytes = 2 * LAYERS * context * KV_HEADS * HEAD_DIM * 2
        out[context] = {"max_abs_diff_in_order": diff, "gb": nbytes / 1e9,
                        "variants": {n: {"ms": statistics.median(t), "tb_s": nbytes / statistics.median(t) / 1e9,
                                         "all": t} for n, t in times.items()}}
        print(context, "max diff", diff, flush=True)
        for n, r in out[context]["variants"].items():
            print(f"  {n:36s} {r['ms']:.3f} ms {r['tb_s']:.2f} TB/s", flush=True)
        del graphs, token_k, token_v, head_k, head_v
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
