"""Qwen3-8B on one GPU, in one go: this engine against HF transformers (same synthetic weights, same prompts)
and against the device's measured ceilings. Sections can be picked with --sections.

    python benchmarks/bench_h200.py --out $OUT/bench                      # every section
    python benchmarks/bench_h200.py --sections env,ours --out $OUT/bench  # a part

Before and after a change, in one run on one GPU: --baseline DIR names another checkout of the project (e.g.
`git worktree add /tmp/before main`); the same sections then run for it and for this checkout, each in its own
process with PYTHONPATH at its checkout, --rounds times with the order alternating, and the headline figures
are printed side by side with the difference in %:

    python benchmarks/bench_h200.py --baseline /tmp/before --sections env,ours,overhead --rounds 2 --out $OUT/ab

Results: OUT/bench.json and OUT/anatomy.json (one call's anatomy, from section ours); with --baseline,
OUT/{current,baseline}-ROUND/ hold each run's and OUT/comparison.json the table. Timings are medians over
repeated steps after warm-up; device time from CUDA events, host time from perf_counter with a sync.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_args import Parser, checkout, names_from, output_dir, positive_int

THIS_CHECKOUT = Path(__file__).resolve().parents[1]
QWEN_PROTOCOL_INPUTS = (1, 6144, 14336, 30720)
# Published by Qwen (speed_benchmark.md), Qwen3-8B BF16 on one H20, batch 1, 2048 generated tokens: tok/s
QWEN_PUBLISHED_H20 = {1: (81.73, 45.32), 6144: (296.25, 146.12), 14336: (524.70, 183.29), 30720: (832.67, 208.98)}
KV_CACHE_TOKENS = 40960  # every section's engine: the protocol's longest input plus its 2048 tokens fit


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sync():
    torch.cuda.synchronize()


def cuda_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151643, (n,), generator=g).tolist()  # below Qwen's special tokens


def timed_generate(engine, ids: list[int], new_tokens: int, watch_clocks: bool = False) -> dict:
    """Greedy generation with no observer attached: host times of the prefill step and each decode step. With
    watch_clocks, NVML is sampled at 100 Hz from another process (as the anatomy does), and the SM clock and
    power during the first EARLY_STEPS decode steps and during the rest are reported."""
    telemetry = None
    if watch_clocks:
        from llm_anatomy.probe.telemetry import GpuTelemetry

        telemetry = GpuTelemetry(torch.device("cuda"))
        telemetry.start()
    seq = engine.add_request(ids, engine.sampling_params(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    sync()
    t0 = time.perf_counter()
    while not seq.output_token_ids:  # the prefill: one step, or chunks of a prompt longer than the budget
        engine.step()
    t1 = time.perf_counter()
    steps, starts_ns = [], []
    while not seq.finished:
        starts_ns.append(time.perf_counter_ns())
        t = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t) * 1e3)
    total = time.perf_counter() - t0
    slowest = sorted(range(len(steps)), key=lambda i: -steps[i])[:5]  # where TPOT and the median step part
    out = {"prefill_ms": (t1 - t0) * 1e3, "decode_step_ms_median": statistics.median(steps) if steps else None,
           "tpot_ms": (total - (t1 - t0)) * 1e3 / max(1, len(steps)), "total_s": total, "steps": len(steps),
           "slowest_steps": [(i, round(steps[i], 3)) for i in slowest]}
    if telemetry is not None:
        out["clocks"] = clocks_by_phase(telemetry.stop(), starts_ns, time.perf_counter_ns())
    return out


EARLY_STEPS = 20


def clocks_by_phase(samples, starts_ns: list[int], end_ns: int) -> dict:
    """Median SM clock and power, and the throttle reasons seen, in the first EARLY_STEPS decode steps and after."""
    split_ns = starts_ns[EARLY_STEPS] if len(starts_ns) > EARLY_STEPS else end_ns
    out = {}
    for name, lo, hi in (("early", starts_ns[0] if starts_ns else end_ns, split_ns), ("rest", split_ns, end_ns)):
        inside = [s for s in samples if lo <= s.t_ns < hi]
        sm = [s.sm_mhz for s in inside if s.sm_mhz is not None]
        power = [s.power_mw / 1e3 for s in inside if s.power_mw is not None]
        out[name] = {"samples": len(inside), "sm_mhz_median": statistics.median(sm) if sm else None,
                     "power_w_median": statistics.median(power) if power else None,
                     "throttle": sorted({r for s in inside for r in s.throttle})}
    return out


def one_prefill_ms(engine, n: int, seed: int) -> float:
    """Device time of one engine step that prefills n fresh tokens (forward + last-token logits)."""
    seq = engine.add_request(prompt_ids(n, seed=seed), engine.sampling_params(temperature=0, max_tokens=1))
    sync()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    engine.step()
    b.record()
    b.synchronize()
    assert seq.finished
    return a.elapsed_time(b)


def prefill_ms(engine, n: int, repeats: int = 3) -> float:
    """The median of `repeats` prefills of n tokens, after one for warm-up, back to back: under the power limit,
    which takes an H200's clocks from 1980 to about 1560 MHz within 0.1 s of such load."""
    return statistics.median([one_prefill_ms(engine, n, seed=r) for r in range(repeats + 1)][1:])


def rested_prefill_ms(engine, n: int, repeats: int = 5, rest_s: float = 1.0) -> list[float]:
    """Prefills of n tokens, each after rest_s of an idle device: one API call as it finds a GPU that was not
    just busy, its clocks at their burst rate (the rate the floors assume)."""
    times = []
    for r in range(repeats):
        sync()
        time.sleep(rest_s)
        times.append(one_prefill_ms(engine, n, seed=100 + r))
    return times


def make_engine(ctx, **settings):
    """The engine the sections share (Qwen3-8B, synthetic bf16 weights), built again when the settings change."""
    from llm_anatomy import Engine

    key = tuple(sorted(settings.items()))
    if ctx.get("engine_key") != key:
        ctx.pop("engine", None)
        gc.unfreeze()  # the engine before was frozen with the heap (main): let it go
        gc.collect()
        torch.cuda.empty_cache()
        t = time.perf_counter()
        ctx["engine"] = Engine.from_pretrained(ctx["model"], device="cuda", dtype="bfloat16", weights="synthetic",
                                               **settings)
        ctx["engine_load_s"] = time.perf_counter() - t
        ctx["engine_key"] = key
        gc.collect()
        gc.freeze()
    return ctx["engine"]


def describe_engine(engine) -> dict:
    """The engine's own account of its execution plan and captured CUDA graphs. A checkout from before the
    engine described them (a --baseline) has neither."""
    plan, graphs = getattr(engine, "plan", None), getattr(engine, "graphs", None)
    return {"plan": plan.describe() if plan is not None else None,
            "graphs": graphs.describe() if graphs is not None else None}


# ---- sections -------------------------------------------------------------------------------------------------
def section_env(ctx) -> dict:
    import transformers
    import triton

    from llm_anatomy.probe.ceilings import calibrate

    ceilings = calibrate(torch.device("cuda"))
    ctx["ceilings"] = ceilings
    sustained = sustained_matmul()
    ctx["sustained_tflops"] = sustained["tflops"]
    props = torch.cuda.get_device_properties(0)
    return {"date": time.strftime("%Y-%m-%d"), "device": props.name, "sm_count": props.multi_processor_count,
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "ceilings": {"read_gbps": ceilings.read_gbps, "gemv_gbps": ceilings.gemv_gbps,
                         "matmul_tflops": ceilings.matmul_tflops,
                         "matmul_burst_tflops": getattr(ceilings, "matmul_burst_tflops", None),
                         "datasheet_gbps": ceilings.datasheet_gbps,
                         "datasheet_tflops": ceilings.datasheet_tflops},
            "sustained_matmul": sustained}


def sustained_matmul(n: int = 8192, seconds: float = 2.0, batch: int = 60) -> dict:
    """bf16 n^3 products on random data back to back for `seconds`, timed in batches (~0.1 s each on the H200):
    the median rate of the second half, once the power limit has taken the clocks down. calibrate's matmul rate
    is a burst of a few ms, above what a prefill of more than a few tens of ms gets."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)
    rates = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            torch.matmul(a, b, out=out)
        stop.record()
        stop.synchronize()
        rates.append(2 * n ** 3 * batch / (start.elapsed_time(stop) / 1e3) / 1e12)
    return {"tflops": statistics.median(rates[len(rates) // 2:]), "first_batch_tflops": rates[0],
            "batches_tflops": rates, "n": n, "seconds": seconds}


def section_gemv(ctx) -> dict:
    """Each Qwen3-8B projection at batch 1: cuBLAS vs this project's Triton GEMV, inside CUDA graphs over all
    36 layers' weights (so L2 cannot serve them)."""
    from llm_anatomy.kernels.gemv import gemv

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
              "lm_head": (151936, 4096)}
    out = {}
    for name, (n, k) in shapes.items():
        layers = 1 if name == "lm_head" else 36
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        assert rel(gemv(x, weights[0]), torch.nn.functional.linear(x, weights[0])) < 1e-2
        row = {}
        for impl, fn in (("cublas", torch.nn.functional.linear), ("triton", gemv)):
            for w in weights[:2]:
                fn(x, w)
            sync()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for w in weights:
                    fn(x, w)
            ms = cuda_ms(graph.replay, iters=20)
            row[impl] = {"ms": ms, "tbps": layers * n * k * 2 / ms / 1e9}
        out[name] = row
        del weights
        torch.cuda.empty_cache()
    return out


def section_attn(ctx) -> dict:
    """The paged decode-attention kernel over 36 layers' caches (one CUDA graph), batch 1, per tile config."""
    from llm_anatomy.kernels.decode_attention import paged_decode_attention

    out = {}
    page, kv_heads, d = 16, 8, 128
    for context in (512, 32768):
        pages = context // page
        caches = [(torch.randn(pages, page, kv_heads, d, device="cuda", dtype=torch.bfloat16),
                   torch.randn(pages, page, kv_heads, d, device="cuda", dtype=torch.bfloat16)) for _ in range(36)]
        q = torch.randn(1, 32, d, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(pages, device="cuda", dtype=torch.int32)[None]
        lens = torch.tensor([context], device="cuda", dtype=torch.int32)
        kv_bytes = 36 * 2 * context * kv_heads * d * 2
        variants = [(bn, w, st, None) for bn, w, st in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3), (32, 4, 3),
                                                        (64, 8, 4))]
        variants += [(bn, 4, 2, splits) for bn in (64, 128) for splits in (66, 132)]  # None: default_splits
        for block_n, warps, stages, splits in variants:
            def run():
                for k, v in caches:
                    paged_decode_attention(q, k, v, table, lens, d ** -0.5, block_n=block_n, num_warps=warps,
                                           num_stages=stages, splits=splits)
            name = f"ctx{context}_bn{block_n}_w{warps}_s{stages}_splits{splits or 'default'}"
            try:
                run()
                sync()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                ms = cuda_ms(graph.replay, iters=20)
                out[name] = {"ms_36_layers": ms, "tbps": kv_bytes / ms / 1e9}
            except Exception as e:  # a tile this GPU cannot run (shared memory): recorded, the others go on
                out[name] = {"error": str(e)[:200]}
        caches = run = graph = None  # the last graph's pool holds the caches' memory until it goes
        torch.cuda.empty_cache()
    return out


def section_correctness(ctx) -> dict:
    """The fast path's greedy decode against HF transformers' Qwen3 on the same weights, in bf16 and float32
    (check_core.py): a 512-token prompt and 64 tokens, and a 16k-token prompt and 16 tokens."""
    import check_core

    engine = make_engine(ctx, kv_cache_tokens=KV_CACHE_TOKENS)
    return {f"prefill{p}+decode{s}": check_core.parity(engine, torch.bfloat16, torch.device("cuda"), p, s)
            for p, s in ((512, 64), (16384, 16))}


def section_ours(ctx) -> dict:
    from llm_anatomy.probe.call import CallRequest, measure_call
    from llm_anatomy.probe.ceilings import calibrate
    from llm_anatomy.probe.cost import decode_cost, prefill_cost

    engine = make_engine(ctx, kv_cache_tokens=KV_CACHE_TOKENS)
    out = {"load_s": ctx["engine_load_s"], "engine": describe_engine(engine)}
    timed_generate(engine, prompt_ids(128), 16)  # warm-up
    out["decode_ctx512"] = timed_generate(engine, prompt_ids(384, 1), 128, watch_clocks=True)
    out["decode_ctx32k"] = timed_generate(engine, prompt_ids(32640, 2), 64, watch_clocks=True)
    for n in (128, 2048, 8192):
        out[f"prefill_{n}_ms"] = prefill_ms(engine, n)
    rested = rested_prefill_ms(engine, 2048)
    out["prefill_2048_rested_ms"], out["prefill_2048_rested_all_ms"] = statistics.median(rested), rested
    ceilings = ctx.get("ceilings") or calibrate(torch.device("cuda"), quick=True)
    request = CallRequest(messages=[{"role": "user", "content": "word " * 115}],
                          sampling=dict(temperature=0, max_tokens=64, ignore_eos=True))
    measure_call(engine, request, ceilings)  # warm-up
    _, anatomy = measure_call(engine, request, ceilings)
    ctx["anatomy"] = anatomy
    out["ttft_chat_prompt"] = {"prompt_tokens": len(anatomy.prompt_token_ids), "ttft_ms": anatomy.ttft_ms,
                               "tpot_ms": anatomy.tpot_ms, "phases": {p.name: p.end_ms - p.start_ms
                                                                      for p in anatomy.phases}}
    cfg = engine.config
    for key, ctx_len in (("decode_ctx512", 448), ("decode_ctx32k", 32672)):
        cost = decode_cost(cfg, torch.bfloat16, [ctx_len])
        out[key]["floor_ms"] = cost.bytes / (ceilings.read_gbps * 1e9) * 1e3
    for n in (2048, 8192):
        cost = prefill_cost(cfg, torch.bfloat16, [(n, 0)])
        out[f"prefill_{n}_floor_ms"] = cost.flops / (ceilings.matmul_tflops * 1e12) * 1e3
        if ctx.get("sustained_tflops"):  # the same FLOPs at the rate the power limit allows (section env)
            out[f"prefill_{n}_sustained_floor_ms"] = cost.flops / (ctx["sustained_tflops"] * 1e12) * 1e3
    return out


def section_overhead(ctx) -> dict:
    """TPOT with the anatomy attached (measure_call: observer, CUDA events, NVML sampler process) and without,
    alternating, same prompt."""
    from llm_anatomy.probe.call import CallRequest, measure_call
    from llm_anatomy.probe.ceilings import calibrate

    engine = make_engine(ctx, kv_cache_tokens=KV_CACHE_TOKENS)
    ceilings = ctx.get("ceilings") or calibrate(torch.device("cuda"), quick=True)
    ids = prompt_ids(256, 3)
    on, off = [], []
    for _ in range(5):
        off.append(timed_generate(engine, ids, 256)["tpot_ms"])
        _, a = measure_call(engine, CallRequest(prompt_token_ids=ids,
                                                sampling=dict(temperature=0, max_tokens=256, ignore_eos=True)),
                            ceilings)
        on.append(a.tpot_ms)
    return {"tpot_off_ms": off, "tpot_on_ms": on,
            "overhead": statistics.median(on) / statistics.median(off) - 1}


def section_hf(ctx) -> dict:
    """HF transformers on the same weights: prefill (last-token logits) and a decode loop with DynamicCache."""
    from transformers import DynamicCache

    import check_core

    engine = make_engine(ctx, kv_cache_tokens=KV_CACHE_TOKENS)
    model = check_core.hf_model(engine, torch.bfloat16, torch.device("cuda"))
    out = {}
    with torch.inference_mode():
        for n in (128, 2048, 8192):
            ids = torch.tensor([prompt_ids(n)], device="cuda")
            out[f"prefill_{n}_ms"] = cuda_ms(lambda: model(ids, logits_to_keep=1), iters=5, warmup=2)
        ids = torch.tensor([prompt_ids(448)], device="cuda")
        cache = DynamicCache()
        logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
        steps = []
        for _ in range(40):
            token = logits.argmax(-1, keepdim=True)
            sync()
            t = time.perf_counter()
            logits = model(token, past_key_values=cache, use_cache=True).logits[:, -1]
            logits.argmax(-1).item()  # the token on the host, as an engine needs it
            steps.append((time.perf_counter() - t) * 1e3)
        out["decode_step_ms_median"] = statistics.median(steps[5:])
    del model, cache, logits
    torch.cuda.empty_cache()
    return out


def section_protocol(ctx) -> dict:
    """Qwen's speed benchmark: batch 1, 2048 generated tokens, speed = (input + output) / time, peak memory.
    This engine runs it whole (before HF's copy of the weights is loaded, so the peak is its own); HF runs the
    prefill and 32 decode steps per input, extrapolated to 2048."""
    from transformers import DynamicCache

    import check_core

    engine = make_engine(ctx, kv_cache_tokens=KV_CACHE_TOKENS)
    torch.cuda.empty_cache()
    ours = {}
    for n in QWEN_PROTOCOL_INPUTS:
        torch.cuda.reset_peak_memory_stats()
        r = timed_generate(engine, prompt_ids(n, 11), 2048)
        ours[n] = {"tok_s": (n + 2048) / r["total_s"], "seconds": r["total_s"],
                   "peak_mib": torch.cuda.max_memory_allocated() / 2**20}
    model = check_core.hf_model(engine, torch.bfloat16, torch.device("cuda"))
    out = {}
    for n in QWEN_PROTOCOL_INPUTS:
        ids = torch.tensor([prompt_ids(n, 11)], device="cuda")
        with torch.inference_mode():
            sync()
            t = time.perf_counter()
            cache = DynamicCache()
            logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            token = logits.argmax(-1, keepdim=True)
            token.item()
            prefill_s = time.perf_counter() - t
            steps = []
            for _ in range(32):
                t = time.perf_counter()
                logits = model(token, past_key_values=cache, use_cache=True).logits[:, -1]
                token = logits.argmax(-1, keepdim=True)
                token.item()
                steps.append(time.perf_counter() - t)
        hf_total = prefill_s + statistics.median(steps) * 2047
        out[str(n)] = {"ours": ours[n], "hf_extrapolated": {"tok_s": (n + 2048) / hf_total, "prefill_s": prefill_s,
                                                         "decode_step_s_median": statistics.median(steps)},
                       "published_h20_sglang_tok_s": QWEN_PUBLISHED_H20[n][0],
                       "published_h20_transformers_tok_s": QWEN_PUBLISHED_H20[n][1]}
        del cache
        torch.cuda.empty_cache()
    return out


def section_pdl(ctx) -> dict:
    """The same decode on an engine built with programmatic dependent launch off (pdl=False)."""
    engine = make_engine(ctx, kv_cache_tokens=KV_CACHE_TOKENS, pdl=False)
    timed_generate(engine, prompt_ids(128), 16)  # warm-up
    return {"engine": describe_engine(engine),
            "decode_ctx512_no_pdl": timed_generate(engine, prompt_ids(384, 1), 128),
            "decode_ctx32k_no_pdl": timed_generate(engine, prompt_ids(32640, 2), 64)}


def section_prefill_graphs(ctx) -> dict:
    """Prefills replayed from a CUDA graph (padded up to their bucket) against the same prefills on an engine
    built without graphs (cuda_graphs=False, which also leaves PDL off), at lengths that pad the most (1025: to
    1152), some and not at all (2048); and whether an eager prefill at a new length pays a one-time cost (cuDNN
    building its attention plan, a kernel compiled): 3001 tokens twice, then 3002."""
    lengths = (1025, 1536, 2048)
    engine = make_engine(ctx, kv_cache_tokens=KV_CACHE_TOKENS)
    graphed = {n: prefill_ms(engine, n) for n in lengths}
    new_length = {"3001_first": one_prefill_ms(engine, 3001, 0), "3001_again": one_prefill_ms(engine, 3001, 1),
                  "3002_first": one_prefill_ms(engine, 3002, 2)}  # above the graphs' 2048: eager either way
    del engine  # so that make_engine can free it before it builds the next
    eager = make_engine(ctx, kv_cache_tokens=KV_CACHE_TOKENS, cuda_graphs=False)
    out = {str(n): {"graph_ms": graphed[n], "eager_ms": prefill_ms(eager, n)} for n in lengths}
    out["new_length_eager_ms"] = new_length
    return out


def section_kernels(ctx) -> dict:
    """GPU time by kernel category and the top kernels of a profiled prefill and decode (probe.kernels)."""
    from llm_anatomy.probe.kernels import profile_kernels

    engine = make_engine(ctx, kv_cache_tokens=KV_CACHE_TOKENS)
    out = {}
    for b in profile_kernels(engine, prompt_ids(512, 5), {"temperature": 0}, decode_steps=8):
        out[b.phase] = {"total_ms": b.total_ms, "steps": b.steps,
                        "categories": {c.category: round(c.ms, 4) for c in b.categories},
                        "top": [(k["name"][:90], round(k["ms"], 4), k["count"]) for k in b.top_kernels[:10]]}
    return out


def batch_decode_ms(engine, sequences: int, prompt_tokens: int, new_tokens: int) -> float:
    """The median host time of a decode step of `sequences` sequences (greedy, prompts of `prompt_tokens`)."""
    params = engine.sampling_params(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    seqs = [engine.add_request(prompt_ids(prompt_tokens, 10 + i), params) for i in range(sequences)]
    while not all(s.output_token_ids for s in seqs):
        engine.step()
    steps = []
    while not all(s.finished for s in seqs):
        t = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t) * 1e3)
    return statistics.median(steps)


def offline_throughput(engine, sequences: int, prompt_tokens: int, output_tokens: int) -> dict:
    """Output tok/s of `sequences` prompts of random tokens decoded together to `output_tokens` each (greedy,
    ignore_eos), wall clock of generate_many including the prefills, after a warm-up run of the same shape."""
    prompts = [prompt_ids(prompt_tokens, seed=1000 + i) for i in range(sequences)]
    engine.generate_many(prompts[:max(1, sequences // 8)], temperature=0, max_tokens=8, ignore_eos=True)
    sync()
    t = time.perf_counter()
    outs = engine.generate_many(prompts, temperature=0, max_tokens=output_tokens, ignore_eos=True)
    sync()
    seconds = time.perf_counter() - t
    tokens = sum(len(o.output_token_ids) for o in outs)
    return {"sequences": sequences, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "seconds": seconds, "output_tok_s": tokens / seconds}


def section_precision(ctx) -> dict:
    """bf16 beside fp8 (weights quantized at load, per output channel; with the fp8 KV cache; with lm_head in fp8
    too), one engine each in turn: batch-1 TPOT at 512 and at 32k context, a decode step of 8 sequences at 512,
    prefill of 8192 tokens back to back, offline throughput of 512 sequences of 128 prompt / 128 output tokens."""
    out = {}
    for name, settings in (("bf16", {}), ("fp8_weights", {"quantization": "fp8"}),
                           ("fp8_weights_kv", {"quantization": "fp8", "kv_cache_dtype": "fp8"}),
                           ("fp8_weights_kv_head", {"quantization": "fp8", "kv_cache_dtype": "fp8",
                                                    "quantize_lm_head": True})):
        engine = make_engine(ctx, kv_cache_tokens=140_000, max_num_seqs=512, **settings)
        row = {"load_s": ctx["engine_load_s"], "engine": describe_engine(engine),
               "weight_bytes": engine.weights.bytes, "kv_bytes_per_token": engine.pool.bytes_per_token}
        timed_generate(engine, prompt_ids(128), 16)  # warm-up
        row["decode_ctx512"] = timed_generate(engine, prompt_ids(384, 1), 128)
        row["decode_ctx32k"] = timed_generate(engine, prompt_ids(32640, 2), 64)
        row["decode_batch8_ctx512"] = batch_decode_ms(engine, 8, 384, 64)
        row["prefill_8192_ms"] = prefill_ms(engine, 8192)
        row["throughput_512x128x128"] = offline_throughput(engine, 512, 128, 128)
        out[name] = row
        print(f"  {name}: TPOT {row['decode_ctx512']['tpot_ms']:.3f} ms at 512, "
              f"{row['decode_ctx32k']['tpot_ms']:.3f} at 32k, batch 8 {row['decode_batch8_ctx512']:.3f} ms a step; prefill 8192 {row['prefill_8192_ms']:.1f} ms; "
              f"{row['throughput_512x128x128']['output_tok_s']:.0f} output tok/s at 512 sequences", flush=True)
    return out


SECTIONS = {"env": section_env, "correctness": section_correctness, "gemv": section_gemv, "attn": section_attn,
            "ours": section_ours, "overhead": section_overhead, "kernels": section_kernels, "hf": section_hf,
            "protocol": section_protocol, "pdl": section_pdl, "prefill_graphs": section_prefill_graphs,
            "precision": section_precision}
ALL = list(SECTIONS)


# ---- tables ---------------------------------------------------------------------------------------------------
def render_tables(results: dict) -> str:
    """The targets' table (each target: this engine, HF, their ratio, the floor and the fraction of it reached)
    and Qwen's protocol beside its published figures, as markdown, from whichever sections ran."""
    ours, hf, protocol, env, overhead = ({} if "error" in results.get(name, {}) else results.get(name, {})
                                         for name in ("ours", "hf", "protocol", "env", "overhead"))  # failed: none
    hf_32k = protocol.get("30720", {}).get("hf_extrapolated", {}).get("decode_step_s_median")
    rows = []
    if "decode_ctx512" in ours:
        rows += [("decode TPOT, context <= 512", 4.0, ours["decode_ctx512"]["tpot_ms"], hf.get("decode_step_ms_median"),
                  ours["decode_ctx512"]["floor_ms"]),
                 ("decode TPOT at 32k context", 5.0, ours["decode_ctx32k"]["tpot_ms"],
                  hf_32k * 1e3 if hf_32k else None, ours["decode_ctx32k"]["floor_ms"]),
                 ("prefill, 2048 tokens, back to back", 45.0, ours["prefill_2048_ms"], hf.get("prefill_2048_ms"),
                  ours["prefill_2048_floor_ms"])]
        if "prefill_2048_rested_ms" in ours:  # not in results written before the rested prefill was timed
            rows.append(("prefill, 2048 tokens, each after 1 s idle (a call on a rested GPU)", 45.0,
                         ours["prefill_2048_rested_ms"], None, ours["prefill_2048_floor_ms"]))
        rows += [("prefill, 8192 tokens, back to back", 200.0, ours["prefill_8192_ms"], hf.get("prefill_8192_ms"),
                  ours["prefill_8192_floor_ms"]),
                 ("TTFT, chat prompt (HF: a 128-token prefill alone)", 8.0, ours["ttft_chat_prompt"]["ttft_ms"],
                  hf.get("prefill_128_ms"), None)]
    fmt = lambda v, unit=" ms": "" if v is None else f"{v:.2f}{unit}"  # noqa: E731
    lines = ["| target | goal | this engine | HF transformers | HF / this | floor | of the floor | met |",
             "|---|---|---|---|---|---|---|---|"]
    for name, goal, value, ref, floor in rows:
        lines.append(f"| {name} | <= {goal:g} ms | {fmt(value)} | {fmt(ref)} | {fmt(ref and ref / value, 'x')} | "
                     f"{fmt(floor)} | {'' if floor is None else f'{floor / value:.0%}'} | "
                     f"{'yes' if value <= goal else 'no'} |")
    overhead = overhead.get("overhead")
    if overhead is not None:
        lines.append(f"| anatomy on vs off | <= 2 % of TPOT | {overhead:+.2%} | | | | | "
                     f"{'yes' if overhead <= 0.02 else 'no'} |")
    sustained = env.get("sustained_matmul")
    if sustained and "prefill_8192_sustained_floor_ms" in ours:
        floors = [(n, ours[f"prefill_{n}_sustained_floor_ms"], ours[f"prefill_{n}_ms"]) for n in (2048, 8192)]
        lines += ["", f"The floor column is at the burst matmul rate. Under the power limit (bf16 {sustained['n']}^3 "
                  f"products back to back: {sustained['tflops']:.0f} TFLOP/s after the first "
                  f"{sustained['seconds'] / 2:g} s) the back-to-back prefills' floors are "
                  + " and ".join(f"{floor:.2f} ms ({n} tokens, this engine at {floor / ms:.0%})"
                                 for n, floor, ms in floors) + "."]
    if protocol:
        lines += ["", "Qwen's speed benchmark (batch 1, 2048 tokens generated; tok/s = (input + output) / time)", "",
                  "| input | this engine | peak MiB | HF, this GPU (extrapolated) | SGLang, H20 (published) | "
                  "Transformers, H20 (published) |", "|---|---|---|---|---|---|"]
        for n, r in protocol.items():
            lines.append(f"| {n} | {r['ours']['tok_s']:.1f} | {r['ours']['peak_mib']:,.0f} | "
                         f"{r['hf_extrapolated']['tok_s']:.1f} | {r['published_h20_sglang_tok_s']} | "
                         f"{r['published_h20_transformers_tok_s']} |")
    return "\n".join(lines) if len(lines) > 2 else "(no section with a target ran)"


def headline(results: dict) -> dict[str, tuple[float, str]]:
    """The figures a before/after comparison looks at, label -> (value, unit), from whichever sections ran (a
    section that failed has none). Percentages are in percent."""
    figures = {}

    def put(label: str, unit: str, *path, scale: float = 1.0):
        value = results
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            figures[label] = (value * scale, unit)

    for label, key in (("<= 512", "decode_ctx512"), ("at 32k", "decode_ctx32k")):
        put(f"decode TPOT, context {label}", "ms", "ours", key, "tpot_ms")
        put(f"decode step median, context {label}", "ms", "ours", key, "decode_step_ms_median")
    for n in (128, 2048, 8192):
        put(f"prefill, {n} tokens, back to back", "ms", "ours", f"prefill_{n}_ms")
    put("prefill, 2048 tokens, each after 1 s idle", "ms", "ours", "prefill_2048_rested_ms")
    put("TTFT, chat prompt", "ms", "ours", "ttft_chat_prompt", "ttft_ms")
    put("engine start-up", "s", "ours", "load_s")
    put("anatomy on vs off, of TPOT", "%", "overhead", "overhead", scale=100)
    put("read bandwidth (calibrate)", "GB/s", "env", "ceilings", "read_gbps")
    put("bf16 matmul (calibrate's MFU denominator)", "TFLOP/s", "env", "ceilings", "matmul_tflops")
    put("bf16 matmul, burst (calibrate)", "TFLOP/s", "env", "ceilings", "matmul_burst_tflops")
    put("bf16 matmul, sustained", "TFLOP/s", "env", "sustained_matmul", "tflops")
    for case in results.get("correctness", {}):
        put(f"argmax agreement with HF bf16, {case}", "%", "correctness", case, "argmax_agreement_with_hf", scale=100)
        put(f"largest |logprob - HF bf16's|, {case}", "nats", "correctness", case, "vs_hf",
            "chosen_logprob_abs_err_max")
    for n in results.get("protocol", {}):
        put(f"Qwen's protocol, input {n}", "tok/s", "protocol", n, "ours", "tok_s")
    for label, key in (("<= 512", "decode_ctx512_no_pdl"), ("at 32k", "decode_ctx32k_no_pdl")):
        put(f"decode TPOT without PDL, context {label}", "ms", "pdl", key, "tpot_ms")
    for n, row in results.get("prefill_graphs", {}).items():
        for how in ("graph", "eager"):
            put(f"prefill {n} tokens, {how}", "ms", "prefill_graphs", n, f"{how}_ms")
    for shape in results.get("gemv", {}):
        for impl in ("triton", "cublas"):
            put(f"GEMV {shape}, {impl}", "ms", "gemv", shape, impl, "ms")
    for variant in results.get("attn", {}):
        put(f"decode attention {variant}, 36 layers", "ms", "attn", variant, "ms_36_layers")
    for phase in results.get("kernels", {}):
        put(f"kernels, {phase}", "ms", "kernels", phase, "total_ms")
    put("HF: decode step, context 448", "ms", "hf", "decode_step_ms_median")
    for n in (128, 2048, 8192):
        put(f"HF: prefill, {n} tokens", "ms", "hf", f"prefill_{n}_ms")
    return figures


def comparison_rows(baseline_runs: list[dict], current_runs: list[dict]) -> list[dict]:
    """Each headline figure of either side: the median over its runs, the runs' range, and the change from the
    baseline (relative; in points for percentages)."""
    sides = {"baseline": [headline(r) for r in baseline_runs], "current": [headline(r) for r in current_runs]}
    labels = list(dict.fromkeys(label for runs in sides.values() for figures in runs for label in figures))
    rows = []
    for label in labels:
        unit = next(figures[label][1] for runs in sides.values() for figures in runs if label in figures)
        row = {"figure": label, "unit": unit}
        for side, runs in sides.items():
            values = [figures[label][0] for figures in runs if label in figures]
            row[side] = statistics.median(values) if values else None
            row[f"{side}_range"] = (min(values), max(values)) if values else None
        base, cur = row["baseline"], row["current"]
        if base is None or cur is None or (unit != "%" and not base):
            row["change"] = None
        else:
            row["change"] = cur - base if unit == "%" else cur / base - 1
        rows.append(row)
    return rows


def number(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def render_comparison(rows: list[dict], rounds: int) -> str:
    """The side-by-side table as markdown: medians (and, over several rounds, their range) and the change."""
    def cell(row, side):
        value, spread = row[side], row[f"{side}_range"]
        if value is None or rounds == 1 or spread[0] == spread[1]:
            return number(value)
        return f"{number(value)} ({number(spread[0])}-{number(spread[1])})"

    lines = ["| figure | unit | baseline | this checkout | change |", "|---|---|---|---|---|"]
    for row in rows:
        change = row["change"]
        shown = "" if change is None else f"{change:+.2f} pt" if row["unit"] == "%" else f"{change:+.1%}"
        lines.append(f"| {row['figure']} | {row['unit']} | {cell(row, 'baseline')} | {cell(row, 'current')} | "
                     f"{shown} |")
    return "\n".join(lines)


# ---- running ---------------------------------------------------------------------------------------------------
def import_package(root: Path):
    """Imports llm_anatomy from the checkout at root, and makes sure that is where it came from."""
    sys.path.insert(0, str(root))
    import llm_anatomy

    where = Path(llm_anatomy.__file__).resolve().parent
    if where != root / "llm_anatomy":
        sys.exit(f"bench_h200.py: error: llm_anatomy was imported from {where}, not from {root}")
    return llm_anatomy


def package_info(root: Path) -> dict:
    """Which checkout ran: its directory and, when it is a git checkout of its own (not a directory inside
    another one), its commit and whether llm_anatomy/ had uncommitted changes."""
    def git(*args) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    info = {"root": str(root), "commit": None, "uncommitted_changes": None}
    top = git("rev-parse", "--show-toplevel")
    if top and Path(top).resolve() == root:
        info["commit"] = git("rev-parse", "HEAD")
        info["uncommitted_changes"] = bool(git("status", "--porcelain", "--", "llm_anatomy"))
    return info


def run_sections(root: Path, model: str, sections: list[str], out: Path | None) -> dict:
    """Every section asked for, in this process, on the checkout at root; a section that fails is recorded as
    such and the others still run. Writes OUT/bench.json after each section and OUT/anatomy.json."""
    results = {"package": package_info(root), "model": model}
    ctx = {"model": model}
    if out:
        out.mkdir(parents=True, exist_ok=True)
    for name in sections:
        # What the sections before left (HF models, logits) is collected and what lives on is frozen, as `call`
        # and `serve` freeze start-up's heap, so that no collection of it lands in a timed step.
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        t = time.perf_counter()
        try:
            results[name] = SECTIONS[name](ctx)
        except Exception as e:  # keep the other sections' results
            import traceback

            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results[name + "_seconds"] = time.perf_counter() - t
        print(f"[{name}] {time.perf_counter() - t:.1f} s", flush=True)
        if out:
            (out / "bench.json").write_text(json.dumps(results, indent=1, default=str))
    if "anatomy" in ctx and out:
        (out / "anatomy.json").write_text(ctx["anatomy"].to_json(indent=1))
    if not out:
        print(json.dumps(results, indent=1, default=str))
    print(render_tables(results))
    return results


def child_command(root: Path, model: str, sections: list[str], out: Path) -> tuple[list[str], dict]:
    """The command and environment that run the sections for the checkout at root in a process of their own."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    return ([sys.executable, str(Path(__file__).resolve()), "--package", str(root), "--model", model,
             "--sections", ",".join(sections), "--out", str(out)], env)


def compare_checkouts(current: Path, baseline: Path, model: str, sections: list[str], rounds: int, out: Path,
                      run=subprocess.run) -> list[dict]:
    """The sections for this checkout and the baseline, each run in a child process on the same GPU, `rounds`
    times with the order alternating (this checkout first in odd rounds); then both side by side. `run` runs a
    child (subprocess.run's signature)."""
    roots, runs = {"current": current, "baseline": baseline}, {"current": [], "baseline": []}
    for r in range(1, rounds + 1):
        for side in ("current", "baseline") if r % 2 else ("baseline", "current"):
            directory = out / f"{side}-{r}"
            command, env = child_command(roots[side], model, sections, directory)
            print(f"[{side}, round {r} of {rounds}] {roots[side]}", flush=True)
            done = run(command, env=env)
            if done.returncode != 0:
                sys.exit(f"bench_h200.py: error: the {side} run ({roots[side]}) failed with exit status "
                         f"{done.returncode}; its output is above")
            runs[side].append(json.loads((directory / "bench.json").read_text()))
    rows = comparison_rows(runs["baseline"], runs["current"])
    table = render_comparison(rows, rounds)
    (out / "comparison.json").write_text(json.dumps(
        {"baseline": [r["package"] for r in runs["baseline"]], "current": [r["package"] for r in runs["current"]],
         "model": model, "sections": sections, "rounds": rounds, "rows": rows, "table": table}, indent=1))
    print(f"\nbaseline: {baseline}\nthis checkout: {current}\n{table}")
    return rows


def parse_args(argv: list[str] | None):
    parser = Parser(description="this engine against HF transformers and the device's ceilings; with --baseline, "
                                "against another checkout in the same run")
    parser.add_argument("--model", default="Qwen/Qwen3-8B")
    parser.add_argument("--sections", type=names_from(ALL, "section"), default=ALL,
                        help=f"comma-separated, of {','.join(ALL)} (default: all)")
    parser.add_argument("--out", type=output_dir, help="a directory for the results (JSON)")
    parser.add_argument("--package", type=checkout, default=THIS_CHECKOUT,
                        help="the checkout whose llm_anatomy is measured (default: the one holding this script)")
    parser.add_argument("--baseline", type=checkout, help="another checkout, measured beside --package")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="with --baseline: how many times each checkout runs, the order alternating")
    args = parser.parse_args(argv)
    if args.rounds > 1 and args.baseline is None:
        parser.error("--rounds alternates runs of two checkouts: give --baseline too")
    if args.baseline is not None and args.baseline == args.package:
        parser.error(f"--baseline is the checkout being measured ({args.package}); give another checkout")
    return parser, args


def main(argv: list[str] | None = None):
    parser, args = parse_args(argv)
    import_package(args.package)
    from llm_anatomy.errors import AnatomyError
    from llm_anatomy.hub import resolve

    try:
        resolve(args.model)  # an unknown model is refused now, not after the first section
    except AnatomyError as e:
        parser.error(str(e))
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU, and this machine has none")
    if args.baseline is None:
        return run_sections(args.package, args.model, args.sections, args.out)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_h200-"))
    out.mkdir(parents=True, exist_ok=True)
    return compare_checkouts(args.package, args.baseline, args.model, args.sections, args.rounds, out)


if __name__ == "__main__":
    main()
