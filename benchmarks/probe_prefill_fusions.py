"""Prefill's elementwise work moved into its products' epilogues, at Qwen3-8B's shapes in bf16 on the H200: the
residual adds in cuBLAS's epilogue (qwen3.RESIDUAL_IN_GEMM) against the add fused into the norm after the
product; at commit 5f0abdc also QK-norm + RoPE + the KV store in a Triton qkv GEMM's epilogue against cuBLAS and
the kernel after it (rope.qk_norm_rope_store), slower and removed.

Section residual: o_proj and down_proj (products that feed the residual stream), each followed by the RMSNorm that
reads the stream, as a CUDA graph of LAYERS layers on their own weights, rounds interleaved:
- `mm + norm(add)`: the product into a buffer, then the norm kernel adds it into the residual (reads two tensors,
  writes two) - the engine before;
- `addmm + norm`: residual.addmm_(x, W.T) (cuBLAS with beta = 1 reads the residual in its epilogue), then the
  norm alone (reads one tensor, writes one);
- the products alone, both ways, for what the epilogue costs.
And how far the two ways' residual and normed output are apart, and from the float32 sum.

Section qkv (at commit 5f0abdc, with the fused kernel; removed with it): the qkv product and QK-norm + RoPE +
store, LAYERS layers in a graph, cuBLAS + the kernel against the fused GEMM at each candidate tile.

Section engine: the engine's prefill, one engine, each way (the residual's add in the norm or in cuBLAS)
interleaved over rounds: at 2048 tokens through a CUDA graph captured for each way (as the engine replays it), at the --eager
lengths eagerly; and the logits of one 2048-token prompt each way.

    python3 benchmarks/probe_prefill_fusions.py --out $OUT/prefill_fusions.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from unittest import mock

import torch

from bench_h200 import cuda_ms, graph_of, make_engine, names_from, one_prefill_ms, positive_int, prompt_ids, rel
from llm_anatomy.kernels.norm import rmsnorm
from llm_anatomy.models import qwen3
from llm_anatomy.models.attention import AttentionBatch

HIDDEN, INTER = 4096, 12288
LAYERS = 8  # weights per graph: more than L2 holds
PARTS = {"o_proj": HIDDEN, "down": INTER}  # K of each product; N is the hidden size
EPS = 1e-6


def part_variants(k: int, tokens: int, g: torch.Generator) -> tuple[dict, dict]:
    dev = torch.device("cuda")
    x = torch.randn(tokens, k, generator=g, device=dev).bfloat16()
    ws = [(torch.randn(HIDDEN, k, generator=g, device=dev) / k ** 0.5).bfloat16() for _ in range(LAYERS)]
    norm_w = (1 + 0.1 * torch.randn(HIDDEN, generator=g, device=dev)).bfloat16()
    start = torch.randn(tokens, HIDDEN, generator=g, device=dev).bfloat16()
    res = start.clone()
    prod = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device=dev)

    def mm_norm_add():
        for w in ws:
            torch.mm(x, w.t(), out=prod)
            rmsnorm(prod, norm_w, EPS, residual=res)

    def addmm_norm():
        for w in ws:
            res.addmm_(x, w.t())
            rmsnorm(res, norm_w, EPS)

    def mm():
        for w in ws:
            torch.mm(x, w.t(), out=prod)

    def addmm():
        for w in ws:
            res.addmm_(x, w.t())

    # one layer each way from the same residual: the stream and the normed output
    r1 = start.clone()
    y1 = rmsnorm(torch.mm(x, ws[0].t()), norm_w, EPS, residual=r1)
    r2 = start.clone().addmm_(x, ws[0].t())
    y2 = rmsnorm(r2, norm_w, EPS)
    exact = start.float() + x.float() @ ws[0].float().t()
    errors = {"residual_rel": rel(r2, r1), "normed_rel": rel(y2, y1),
              "residual_vs_fp32": {"mm + norm(add)": rel(r1, exact), "addmm + norm": rel(r2, exact)}}
    return {"mm + norm(add)": mm_norm_add, "addmm + norm": addmm_norm, "mm": mm, "addmm": addmm}, errors


def timed_graphs(variants: dict, rounds: int) -> dict:
    """{variant: median us per layer} of each variant's graph, rounds interleaved."""
    graphs = {v: graph_of(fn) for v, fn in variants.items()}
    times = {v: [] for v in graphs}
    for _ in range(rounds):
        for v, graph in graphs.items():
            times[v].append(cuda_ms(graph.replay, iters=5, warmup=1) / LAYERS * 1e3)
    del graphs
    torch.cuda.empty_cache()
    return {"us": {v: statistics.median(t) for v, t in times.items()}, "all_us": times}


def section_residual(tokens_list: list[int], rounds: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for tokens in tokens_list:
        for name, k in PARTS.items():
            variants, errors = part_variants(k, tokens, g)
            res = timed_graphs(variants, rounds)
            out[f"{name} {tokens}"] = res | errors
            print(f"{tokens:5d} {name:7s} " + " | ".join(f"{v} {m:7.1f} us" for v, m in res["us"].items())
                  + f" | residual rel {errors['residual_rel']:.2e}", flush=True)
    return out


WAYS = {"neither": False, "residual": True}  # way -> qwen3.RESIDUAL_IN_GEMM


def as_way(way: str):
    return mock.patch.object(qwen3, "RESIDUAL_IN_GEMM", WAYS[way])


def prefill_graph(runner, tokens: int):
    """A graph of the runner's `tokens`-token prefill over its static inputs, as _capture_prefill makes it."""
    batch = AttentionBatch.fresh_prompt(runner.pool.k, runner.pool.v, runner.prefill_slots[:tokens])

    def forward():
        hidden = runner.model(runner.prefill_ids[:tokens], runner.prefill_pos[:tokens], batch)
        return runner.model.compute_logits(hidden[runner.prefill_last])
    return runner._capture_one(forward, shared_pool=False)


def section_engine(graphed: int, eager: list[int], rounds: int) -> dict:
    engine = make_engine({"model": "Qwen/Qwen3-8B"}, kv_cache_tokens=max([graphed, *eager]) + 256, max_num_seqs=1)
    runner = engine.runner
    graphs = {}
    for way in WAYS:
        with as_way(way), torch.inference_mode():
            graphs[way] = prefill_graph(runner, graphed)
    out = {}
    # The logits of one prompt both ways (the graph reads the ids and positions; slots -1 store nothing)
    with torch.inference_mode():  # the runner's static inputs are inference tensors
        runner.prefill_ids[:graphed] = torch.tensor(prompt_ids(graphed, seed=7), device="cuda")
        runner.prefill_pos[:graphed] = torch.arange(graphed, device="cuda")
        runner.prefill_slots[:graphed] = -1
        runner.prefill_last.fill_(graphed - 1)
    logits = {}
    for way, (graph, out_logits) in graphs.items():
        graph.replay()  # the flag is read at capture: each graph runs its own way
        logits[way] = out_logits.clone()
    base = logits[next(iter(WAYS))]
    out["logits_against_neither"] = {way: {"rel": rel(a, base), "max_abs": (a - base).abs().max().item(),
                                           "argmax_equal": bool((a.argmax(-1) == base.argmax(-1)).all())}
                                     for way, a in logits.items()}
    print(f"logits at {graphed} tokens against neither fusion: {out['logits_against_neither']}", flush=True)
    saved = runner.prefill_graphs.get(graphed)
    times = {f"{way} graph {graphed}": [] for way in WAYS} | {f"{way} eager {n}": [] for n in eager for way in WAYS}
    for r in range(rounds + 1):
        for way in WAYS:
            runner.prefill_graphs[graphed] = graphs[way]
            ms = one_prefill_ms(engine, graphed, seed=r)
            if r:
                times[f"{way} graph {graphed}"].append(ms)
        runner.prefill_graphs[graphed] = saved
        for n in eager:
            for way in WAYS:
                with as_way(way):
                    ms = one_prefill_ms(engine, n, seed=r)
                if r:  # the first round warms up
                    times[f"{way} eager {n}"].append(ms)
    out["ms"] = {k: statistics.median(v) for k, v in times.items()}
    out["all_ms"] = times
    for k, v in out["ms"].items():
        print(f"engine {k:28s} {v:8.2f} ms", flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--tokens", type=names_from(["512", "2048", "8192"], "token count"), default=["2048", "8192"])
    parser.add_argument("--eager", type=names_from(["4096", "8192"], "token count"), default=["8192"])
    parser.add_argument("--sections", type=names_from(["residual", "engine"], "section"),
                        default=["residual", "engine"])
    args = parser.parse_args(argv)
    out = {"torch": torch.__version__, "layers_per_graph": LAYERS}
    if "residual" in args.sections:
        out["residual"] = section_residual(list(map(int, args.tokens)), args.rounds)
    if "engine" in args.sections:
        out["engine"] = section_engine(2048, list(map(int, args.eager)), args.rounds)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
