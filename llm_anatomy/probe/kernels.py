"""Kernel time by category, from torch.profiler over a replay of the call's prefill and a few decode steps.

The replay is separate from the measured call, so the profiler's own cost never lands in its timings.
Kernels are put in categories by name: this project's own kernels carry names that say what they do;
library kernels (cuBLAS, cuDNN, ATen elementwise) are matched by the patterns below, first match wins.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from ..anatomy import KernelBreakdown, KernelCategory
from ..engine.engine import Engine

CATEGORIES = [
    ("attention", r"attention|attn|flash|fmha|sdpa|paged|cudnn|_scaled_dot_product|bmm_softmax"),
    ("sampling", r"argmax|topk|sort|exponential|cumsum|multinomial|sampl|gumbel|greedy"),
    ("rope", r"rope|rotary|rotate|\bcos\b|\bsin\b"),  # before norm: the fused QK-norm + RoPE + store is rope's
    ("norm", r"rms|norm|rsqrt|pow_tensor|mean|reduce_kernel"),
    ("activation", r"silu|gelu|swiglu|act_and_mul"),
    ("gemm", r"gemm|gemv|cutlass|xmma|cublas|matmul|\bmm\b|addmm|linear|sm90|splitk|nvjet"),
    ("copy", r"copy|memcpy|memset|index|gather|scatter|\bcat\b|fill|embedding|cat_|unrolled_elementwise"),
]
_PATTERNS = [(name, re.compile(p, re.IGNORECASE)) for name, p in CATEGORIES]


def categorize(kernel_name: str) -> str:
    for name, pattern in _PATTERNS:
        if pattern.search(kernel_name):
            return name
    return "other"


def _breakdown(prof, phase: str, steps: int, cuda: bool) -> KernelBreakdown:
    times: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    per_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if cuda:
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = evt.device_time
        else:  # on the host, every ATen op's own time (children excluded, so nothing counts twice)
            if not evt.name.startswith("aten::"):
                continue
            us = evt.self_cpu_time_total
        category = categorize(evt.name)
        times[category] += us / 1e3
        counts[category] += 1
        per_kernel[evt.name][0] += us / 1e3
        per_kernel[evt.name][1] += 1
    categories = sorted((KernelCategory(c, times[c], counts[c]) for c in times), key=lambda k: -k.ms)
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:12]
    return KernelBreakdown(phase, steps, sum(times.values()), categories,
                           [{"name": n[:160], "ms": t, "count": c, "category": categorize(n)} for n, (t, c) in top])


REPLAY_NOTE = ("Kernel times come from a profiled replay of the prompt (prefill + 8 decode steps), launched eagerly: "
               "no CUDA graphs and no programmatic dependent launch, so that each kernel's time is its own (with "
               "early launch a kernel's span would include waiting for its predecessor); the gaps between "
               "launches are not in these figures.")


def profile_kernels(engine: Engine, prompt_token_ids: list[int], sampling: dict, decode_steps: int = 8
                    ) -> list[KernelBreakdown]:
    """Replay the prompt, each kernel launched on its own (Engine.eager): profile the prefill step, then
    `decode_steps` decode steps."""
    with engine.eager():
        return _profile(engine, prompt_token_ids, sampling, decode_steps)


def _profile(engine: Engine, prompt_token_ids: list[int], sampling: dict, decode_steps: int
             ) -> list[KernelBreakdown]:
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    params = engine.sampling_params(**{**sampling, "max_tokens": decode_steps + 1, "ignore_eos": True})
    seq = engine.add_request(list(prompt_token_ids), params)
    out = []
    try:
        with profile(activities=activities) as prof:
            engine.step()
            if cuda:
                torch.cuda.synchronize(engine.device)
        out.append(_breakdown(prof, "prefill", 1, cuda))
        with profile(activities=activities) as prof:
            steps = 0
            while not seq.finished:
                engine.step()
                steps += 1
            if cuda:
                torch.cuda.synchronize(engine.device)
        out.append(_breakdown(prof, "decode", steps, cuda))
    finally:
        engine.abort(seq)
    return out
