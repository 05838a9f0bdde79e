"""Is a GEMV that directly follows a GEMV slower than one that follows a small kernel?

Two measurements hint so. 36 layers of gate_up then down took 3.169 ms as 72 launches (probe_persistent_mlp.py,
run of the sixth session) but 2.728 ms with a residual-add RMSNorm after each down, 108 launches
(probe_fused_mlp.py), though the norm adds work. And the step's GEMVs alone, without the small kernels between
them, took longer than the whole step (probe_gemv_overlap.py: 4.365 ms against 4.257). In the step only
gate_up -> down is such a direct pair. Here a spacer (a one-CTA kernel that only waits for the one before and
lets the next launch: programmatic dependent launch) goes between them:

- chain: 36 layers of gate_up, down (and the norm, or not), with and without the spacer;
- step: the engine's batch-1 decode step at 512 and at 32k tokens, with and without it, interleaved.

    python3 benchmarks/probe_spacer.py --out $OUT/spacer.json
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch
import triton
import triton.language as tl

from bench_h200 import cuda_ms, make_engine
from llm_anatomy.kernels import gemv as gemv_module, norm
from llm_anatomy.kernels.pdl import PDL, gdc_enter
from llm_anatomy.models import qwen3
from probe_decode_parts import decode_forward, interleaved
from probe_fused_mlp import EPS, SESSION7_TILES
from probe_persistent_mlp import HIDDEN, mlp_probe_args, mlp_weights, use_tiles

CONTEXTS = (512, 32768)


@triton.jit
def _spacer_kernel(USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)


def spacer():
    _spacer_kernel[(1,)](USE_PDL=PDL.on, launch_pdl=PDL.on, num_warps=1)


def mlp(x, gate_up, down, with_spacer: bool):
    act = gemv_module.gemv(x, gate_up, gated=True)
    if with_spacer:
        spacer()
    return gemv_module.gemv(act, down)


def chain(rounds: int, layers: int) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up, down = mlp_weights(layers, g)
    norm_w = torch.ones(HIDDEN, dtype=torch.bfloat16, device=dev)
    x0 = torch.randn(1, HIDDEN, generator=g, device=dev).bfloat16()
    residual = torch.zeros(1, HIDDEN, dtype=torch.bfloat16, device=dev)

    def layers_fn(with_spacer, with_norm):
        x = x0
        for layer in range(layers):
            x = mlp(x, gate_up[layer], down[layer], with_spacer)
            if with_norm:
                x = norm.rmsnorm(x, norm_w, EPS, residual=residual)
        return x

    graphs = {}
    for with_norm in (False, True):
        for with_spacer in (False, True):
            fn = lambda s=with_spacer, n=with_norm: layers_fn(s, n)  # noqa: E731
            fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graphs[f"{'norm' if with_norm else 'no_norm'}_{'spacer' if with_spacer else 'direct'}"] = graph
    times = defaultdict(list)
    for _ in range(rounds):
        for name, graph in graphs.items():
            residual.zero_()
            times[name].append(cuda_ms(graph.replay, iters=10, warmup=2))
    out = {name: {"ms": statistics.median(t), "all": t} for name, t in times.items()}
    print("chain", {n: round(r["ms"], 4) for n, r in out.items()}, flush=True)
    return out


def step(rounds: int) -> dict:
    engine = make_engine({"model": "Qwen/Qwen3-8B"}, kv_cache_tokens=max(CONTEXTS) + 256, max_num_seqs=1)
    real_forward = qwen3.MLP.forward

    def spaced_forward(self, x):
        if self.fast and gemv_module.supports(x, self.gate_up_proj.weight):
            return qwen3.linear(mlp_act(x, self.gate_up_proj.weight), self.down_proj, True)
        return real_forward(self, x)

    def mlp_act(x, weight):
        act = gemv_module.gemv(x, weight, gated=True)
        spacer()
        return act

    variants = {"direct": contextlib.nullcontext,
                "spacer": lambda: mock.patch.object(qwen3.MLP, "forward", spaced_forward)}
    out = {"tiles": {str(k): str(t) for k, t in gemv_module.TILES.items()}}
    for context in CONTEXTS:
        out[context] = interleaved(engine, decode_forward(engine, context), variants, rounds)
        print("step", context, {n: round(r["ms"], 4) for n, r in out[context].items()}, flush=True)
    return out


def main(argv=None):
    args = mlp_probe_args(argv, rounds=5)
    use_tiles(*SESSION7_TILES)
    out = {}
    with torch.inference_mode():
        out["chain"] = chain(args.rounds, args.layers)
        torch.cuda.empty_cache()  # the chain's weights, before the engine's
        out["step"] = step(args.rounds)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
