"""Qwen3-8B on one GPU, in one go: this engine against HF transformers (same synthetic weights, same prompts)
and against the device's measured ceilings. Sections can be picked with --sections.

    python benchmarks/bench_h200.py --out $OUT/bench.json            # everything
    python benchmarks/bench_h200.py --sections gemv,ours --out ...    # a part

Writes the full results as JSON and prints a table last. Timings are medians over repeated steps after
warm-up; device time from CUDA events, host time from perf_counter with a sync.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_anatomy import Engine  # noqa: E402
from llm_anatomy.models.loader import hf_state_dict  # noqa: E402
from llm_anatomy.probe.call import CallRequest, measure_call  # noqa: E402
from llm_anatomy.probe.ceilings import calibrate  # noqa: E402
from llm_anatomy.probe.cost import decode_cost, prefill_cost  # noqa: E402

ALL = ["env", "correctness", "gemv", "attn", "ours", "overhead", "kernels", "hf", "protocol", "pdl", "prefill_graphs"]
QWEN_PROTOCOL_INPUTS = (1, 6144, 14336, 30720)
# Published by Qwen (speed_benchmark.md), Qwen3-8B BF16 on one H20, batch 1, 2048 generated tokens: tok/s
QWEN_PUBLISHED_H20 = {1: (81.73, 45.32), 6144: (296.25, 146.12), 14336: (524.70, 183.29), 30720: (832.67, 208.98)}


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


def graph_of(fn) -> torch.cuda.CUDAGraph:
    """fn run once (compiles, allocates), then captured in a CUDA graph."""
    fn()
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151643, (n,), generator=g).tolist()


def timed_generate(engine: Engine, ids: list[int], new_tokens: int, watch_clocks: bool = False) -> dict:
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


def one_prefill_ms(engine: Engine, n: int, seed: int) -> float:
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


def prefill_ms(engine: Engine, n: int, repeats: int = 3) -> float:
    """The median of `repeats` prefills of n tokens, after one for warm-up, back to back: under the power cap
    (the clocks fall from 1980 to about 1560 MHz within 0.1 s of such load on the H200: RESULTS.md)."""
    return statistics.median([one_prefill_ms(engine, n, seed=r) for r in range(repeats + 1)][1:])


def rested_prefill_ms(engine: Engine, n: int, repeats: int = 5, rest_s: float = 1.0) -> list[float]:
    """Prefills of n tokens, each after rest_s of an idle device: one API call as it finds a GPU that was not
    just busy, its clocks at their burst rate (the rate the floors assume)."""
    times = []
    for r in range(repeats):
        sync()
        time.sleep(rest_s)
        times.append(one_prefill_ms(engine, n, seed=100 + r))
    return times


# ---- sections -------------------------------------------------------------------------------------------------
def section_env(ctx) -> dict:
    import transformers
    import triton

    ceilings = calibrate(torch.device("cuda"))
    ctx["ceilings"] = ceilings
    sustained = sustained_matmul()
    ctx["sustained_tflops"] = sustained["tflops"]
    props = torch.cuda.get_device_properties(0)
    return {"date": time.strftime("%Y-%m-%d"), "device": props.name, "sm_count": props.multi_processor_count,
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "ceilings": {"read_gbps": ceilings.read_gbps, "gemv_gbps": ceilings.gemv_gbps,
                         "matmul_tflops": ceilings.matmul_tflops, "datasheet_gbps": ceilings.datasheet_gbps,
                         "datasheet_tflops": ceilings.datasheet_tflops},
            "sustained_matmul": sustained}


def sustained_matmul(n: int = 8192, seconds: float = 2.0, batch: int = 60) -> dict:
    """bf16 n^3 products on random data back to back for `seconds`, timed in batches (~0.1 s each on the H200):
    the median rate of the second half, once the power limit has taken the clocks down. calibrate's matmul rate
    is a burst of a few ms, above what a prefill of more than a few tens of ms gets (RESULTS.md, third session)."""
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
        variants += [(bn, 4, 2, splits) for bn in (64, 128) for splits in (66, 132)]  # None: default_splits (33)
        for block_n, warps, stages, splits in variants:
            def run():
                for k, v in caches:
                    paged_decode_attention(q, k, v, table, lens, d ** -0.5, block_n=block_n, num_warps=warps,
                                           num_stages=stages, splits=splits)
            try:
                run()
                sync()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                ms = cuda_ms(graph.replay, iters=20)
                out[f"ctx{context}_bn{block_n}_w{warps}_s{stages}_splits{splits or 'default'}"] = {
                    "ms_36_layers": ms, "tbps": kv_bytes / ms / 1e9}
            except Exception as e:
                out[f"ctx{context}_bn{block_n}_w{warps}_s{stages}_splits{splits or 'default'}"] = {"error": str(e)[:200]}
        caches = run = graph = None  # the last graph's pool holds the caches' memory until it goes
        torch.cuda.empty_cache()
    return out


def make_engine(ctx, **kw) -> Engine:
    key = tuple(sorted(kw.items()))
    if ctx.get("engine_key") != key:
        ctx.pop("engine", None)
        torch.cuda.empty_cache()
        t = time.perf_counter()
        ctx["engine"] = Engine.from_pretrained(ctx["model"], device="cuda", weights="synthetic", **kw)
        ctx["engine_load_s"] = time.perf_counter() - t
        ctx["engine_key"] = key
    return ctx["engine"]


def section_correctness(ctx) -> dict:
    """Fast path (kernels + graphs) logits against HF transformers' Qwen3 on the same weights, bf16, and both
    against an fp32 HF copy: a 512-token prefill + 64 decode steps, and a 16k-token prefill + 16 steps."""
    engine = make_engine(ctx, kv_cache_tokens=40960)
    out = {}
    for prompt_len, steps in ((512, 64), (16384, 16)):
        ids = prompt_ids(prompt_len, seed=7)
        seq = engine.add_request(ids, engine.sampling_params(temperature=0, max_tokens=steps + 1, ignore_eos=True))
        rows = []
        run = engine.runner.run
        def recording(b, a=None, run=run, rows=rows):
            logits = run(b, a)
            if len(logits):  # a chunk of the prompt samples nothing
                rows.append(logits[0].clone())
            return logits

        engine.runner.run = recording
        try:
            while not seq.finished:
                engine.step()
        finally:
            engine.runner.run = run
        ours = torch.stack(rows)  # logits that chose output tokens 0..steps
        tokens = ids + seq.output_token_ids
        ref = {}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            model = hf_model(engine, dtype)
            with torch.inference_mode():
                logits = model(torch.tensor([tokens[:-1]], device="cuda"), logits_to_keep=steps + 1).logits[0]
            ref[name] = logits.float()
            del model
            torch.cuda.empty_cache()
        out[f"prefill{prompt_len}+decode{steps}"] = {
            "ours_vs_hf_bf16": rel(ours, ref["bf16"]), "ours_vs_fp32": rel(ours, ref["fp32"]),
            "hf_bf16_vs_fp32": rel(ref["bf16"], ref["fp32"]),
            "argmax_agreement_with_hf_bf16": (ours.argmax(-1) == ref["bf16"].argmax(-1)).float().mean().item()}
    return out


def hf_model(engine: Engine, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in engine.config.to_hf().items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in hf_state_dict(engine.model).items()},
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model.eval()


def section_ours(ctx) -> dict:
    engine = make_engine(ctx, kv_cache_tokens=40960)
    out = {"load_s": ctx["engine_load_s"], "graph_capture_s": engine.runner.capture_seconds,
           "graph_bytes": engine.runner.graph_bytes, "pdl": engine.pdl}
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
    tuning = engine.runner.tile_tuning  # the GEMV tiles this process uses, and whether it tuned them
    out["gemv_tiles"] = {"source": tuning.source, "seconds": tuning.seconds, "step_ms": tuning.step_ms,
                         "tiles": {str(k): str(t) for k, t in tuning.tiles.items()}}
    return out


def section_overhead(ctx) -> dict:
    """TPOT with the anatomy attached (measure_call: observer, CUDA events, NVML sampler process) and without,
    alternating, same prompt."""
    engine = make_engine(ctx, kv_cache_tokens=40960)
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
    """HF transformers 5 on the same weights: prefill (last-token logits) and a decode loop with DynamicCache."""
    from transformers import DynamicCache

    engine = make_engine(ctx, kv_cache_tokens=40960)
    model = hf_model(engine, torch.bfloat16)
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
    ctx["hf"] = model
    return out


def section_protocol(ctx) -> dict:
    """Qwen's speed benchmark: batch 1, 2048 generated tokens, speed = (input + output) / time, peak memory.
    This engine runs it whole; HF runs the prefill and 32 decode steps per input, extrapolated to 2048."""
    from transformers import DynamicCache

    engine = make_engine(ctx, kv_cache_tokens=40960)
    ctx.pop("hf", None)  # this engine first, with no HF copy of the weights in memory: its peak is its own
    torch.cuda.empty_cache()
    ours = {}
    for n in QWEN_PROTOCOL_INPUTS:
        torch.cuda.reset_peak_memory_stats()
        r = timed_generate(engine, prompt_ids(n, 11), 2048)
        ours[n] = {"tok_s": (n + 2048) / r["total_s"], "seconds": r["total_s"],
                   "peak_mib": torch.cuda.max_memory_allocated() / 2**20}
    model = hf_model(engine, torch.bfloat16)
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
    """The same decode with programmatic dependent launch turned off (an A/B of that one change)."""
    engine = make_engine(ctx, kv_cache_tokens=40960, pdl=False)
    assert not engine.pdl
    timed_generate(engine, prompt_ids(128), 16)  # warm-up
    return {"decode_ctx512_no_pdl": timed_generate(engine, prompt_ids(384, 1), 128),
            "decode_ctx32k_no_pdl": timed_generate(engine, prompt_ids(32640, 2), 64)}


def section_prefill_graphs(ctx) -> dict:
    """Prefill from a graph (padded up to its bucket) against the same prefill run eagerly (the graphs hidden),
    at lengths that pad the most (1025: to 1152) and not at all (2048); and whether an eager prefill at a new
    length pays a one-time cost (cuDNN building its attention plan): 3001 tokens twice, then 3002."""
    engine = make_engine(ctx, kv_cache_tokens=40960)
    runner = engine.runner
    out = {}
    for n in (1025, 1536, 2048):
        graphed = prefill_ms(engine, n)
        graphs, runner.prefill_graphs = runner.prefill_graphs, {}
        try:
            out[str(n)] = {"graph_ms": graphed, "eager_ms": prefill_ms(engine, n)}
        finally:
            runner.prefill_graphs = graphs
    out["new_length_eager_ms"] = {"3001_first": one_prefill_ms(engine, 3001, 0),
                                  "3001_again": one_prefill_ms(engine, 3001, 1),
                                  "3002_first": one_prefill_ms(engine, 3002, 2)}
    return out


def section_kernels(ctx) -> dict:
    from llm_anatomy.probe.kernels import profile_kernels

    engine = make_engine(ctx, kv_cache_tokens=40960)
    out = {}
    for b in profile_kernels(engine, prompt_ids(512, 5), {"temperature": 0}, decode_steps=8):
        out[b.phase] = {"total_ms": b.total_ms, "steps": b.steps,
                        "categories": {c.category: round(c.ms, 4) for c in b.categories},
                        "top": [(k["name"][:90], round(k["ms"], 4), k["count"]) for k in b.top_kernels[:10]]}
    return out


def render_tables(results: dict) -> str:
    """The issue's table (each target: this engine, HF, their ratio, the floor and the fraction of it reached)
    and Qwen's protocol beside its published figures, as markdown, from whichever sections ran."""
    ours, hf, protocol = results.get("ours", {}), results.get("hf", {}), results.get("protocol", {})
    hf_32k = protocol.get("30720", {}).get("hf_extrapolated", {}).get("decode_step_s_median")
    rows = []
    if "decode_ctx512" in ours:
        rows += [("decode TPOT, context <= 512", 4.0, ours["decode_ctx512"]["tpot_ms"], hf.get("decode_step_ms_median"),
                  ours["decode_ctx512"]["floor_ms"]),
                 ("decode TPOT at 32k context", 5.0, ours["decode_ctx32k"]["tpot_ms"],
                  hf_32k * 1e3 if hf_32k else None, ours["decode_ctx32k"]["floor_ms"]),
                 ("prefill, 2048 tokens, back to back", 45.0, ours["prefill_2048_ms"], hf.get("prefill_2048_ms"),
                  ours["prefill_2048_floor_ms"])]
        if "prefill_2048_rested_ms" in ours:  # not in runs before run 33
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
    overhead = results.get("overhead", {}).get("overhead")
    if overhead is not None:
        lines.append(f"| anatomy on vs off | <= 2 % of TPOT | {overhead:+.2%} | | | | | "
                     f"{'yes' if overhead <= 0.02 else 'no'} |")
    sustained = results.get("env", {}).get("sustained_matmul")
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
            peak = r["ours"].get("peak_mib", r["ours"].get("peak_mib_process"))
            lines.append(f"| {n} | {r['ours']['tok_s']:.1f} | {peak:,.0f} | {r['hf_extrapolated']['tok_s']:.1f} | "
                         f"{r['published_h20_sglang_tok_s']} | {r['published_h20_transformers_tok_s']} |")
    return "\n".join(lines) if len(lines) > 2 else "(no section with a target ran)"


def names_from(allowed, what: str):
    """An argparse type: a comma-separated list of names from `allowed`, refused with the choices otherwise."""
    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown) or '(none given)'}; "
                                             f"pick from {','.join(allowed)}")
        return names
    return parse


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"want a positive whole number, got {text!r}")
    return int(text)


section_list = names_from(ALL, "section")


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen/Qwen3-8B")
    parser.add_argument("--sections", type=section_list, default=ALL, help=f"comma-separated, of {','.join(ALL)}")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    ctx = {"model": args.model}
    results = {}
    for name in args.sections:
        # What the sections before left (HF models, logits) is collected and what lives on is frozen, as `call`
        # and `serve` freeze start-up's heap, so that no collection of it lands in a timed step.
        gc.collect()
        gc.freeze()
        t = time.perf_counter()
        try:
            results[name] = globals()[f"section_{name}"](ctx)
        except Exception as e:  # keep the other sections' results
            import traceback

            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results[name + "_seconds"] = time.perf_counter() - t
        print(f"[{name}] {time.perf_counter() - t:.1f} s", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    if "anatomy" in ctx and args.out:
        Path(args.out).with_name("anatomy_h200.json").write_text(ctx["anatomy"].to_json(indent=1))
    if not args.out:
        print(json.dumps(results, indent=1, default=str))
    print(render_tables(results))


if __name__ == "__main__":
    main()
