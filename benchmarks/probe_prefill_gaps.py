"""Where a long prefill step's wall time goes that its kernels do not account for, on the H200.

One engine step per prompt length under torch.profiler (host and device): the step's span, the sum of its
kernels, and the device's idle gaps between them, the largest with the kernels around them and the host
op that was running. Chrome traces go to --trace-dir for a closer look. Then the clocks under sustained load:
ten prefills of each --sustained-lengths (8192 tokens by default) back to back, each with its own clocks, and
8192^3 bf16 matmuls for about a second, with NVML sampled at 100 Hz, against the first milliseconds of the same
matmuls (the burst rate `calibrate` measures).

    python3 benchmarks/probe_prefill_gaps.py --lengths 2048,8192 --sustained-lengths 2048,8192 --trace-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench_h200 import cuda_ms, one_prefill_ms, prefill_ms, prompt_ids, sustained_matmul
from llm_anatomy import Engine
from llm_anatomy.probe.telemetry import GpuTelemetry
from probe_new_length import prompt_lengths


def sampled(fn) -> tuple[object, dict, list]:
    """fn() with NVML sampling around it: median SM clock and power, the throttle reasons seen; and the samples."""
    telemetry = GpuTelemetry(torch.device("cuda"), hz=100)
    telemetry.start()
    time.sleep(0.3)  # the sampler process starts
    result = fn()
    samples = [s for s in telemetry.stop() if s.sm_mhz]
    busy = samples[len(samples) // 4:]  # past the ramp-up
    return result, {"sm_mhz_median": statistics.median(s.sm_mhz for s in busy),
                    "power_w_median": statistics.median(s.power_mw for s in busy) / 1e3,
                    "throttle": sorted({r for s in busy for r in s.throttle})}, samples


def per_interval(samples, starts_ns: list[int], end_ns: int) -> list[dict]:
    """Median SM clock and power in each interval [starts[i], starts[i + 1]) (the last ends at end_ns)."""
    out = []
    for lo, hi in zip(starts_ns, [*starts_ns[1:], end_ns]):
        inside = [s for s in samples if lo <= s.t_ns < hi]
        out.append({"samples": len(inside),
                    "sm_mhz_median": statistics.median(s.sm_mhz for s in inside) if inside else None,
                    "power_w_median": statistics.median(s.power_mw for s in inside) / 1e3 if inside else None,
                    "throttle": sorted({r for s in inside for r in s.throttle})})
    return out


def sustained(engine: Engine, lengths: list[int]) -> dict:
    """Ten prefills of each length back to back after a rest (each with its own clocks), then 8192^3 matmuls."""
    out = {}
    for n in lengths:
        starts = []

        def prefills():
            times = []
            for r in range(10):
                starts.append(time.perf_counter_ns())
                times.append(one_prefill_ms(engine, n, seed=20 + r))
            starts.append(time.perf_counter_ns())
            return times

        torch.cuda.synchronize()
        time.sleep(1.0)  # let the clocks recover
        times, clocks, samples = sampled(prefills)
        out[f"prefill_{n}_ms"] = times
        out[f"prefill_{n}_clocks"] = clocks
        out[f"prefill_{n}_clocks_each"] = per_interval(samples, starts[:-1], starts[-1])

    time.sleep(1.0)
    rates, during_matmul, _ = sampled(lambda: sustained_matmul(seconds=1.2)["batches_tflops"])  # 0.1 s each
    return out | {"matmul_tflops_per_0.1s": rates, "matmul_clocks": during_matmul}


def gaps(prof, top: int = 12) -> dict:
    """The device's work in one profiled step: kernels (and copies) against their span, the idle gaps between
    them, and the host's time in the step before the first and after the last (the device idles then too)."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    host = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    step = next(e for e in host if e.name == "engine.step")
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)
    idle, end = [], kernels[0].time_range.end
    for before, after in zip(kernels, kernels[1:]):
        if after.time_range.start > end:
            t0, t1 = end, after.time_range.start
            running = [h.name for h in host if h.time_range.start <= t1 <= h.time_range.end]
            idle.append((t1 - t0, before.name[:60], after.name[:60], running[-4:]))
        end = max(end, after.time_range.end)
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    idle.sort(key=lambda g: -g[0])
    return {"kernels": len(kernels), "span_ms": span / 1e3, "kernel_ms": busy / 1e3,
            "host_before_first_kernel_ms": (kernels[0].time_range.start - step.time_range.start) / 1e3,
            "host_after_last_kernel_ms": (step.time_range.end - kernels[-1].time_range.end) / 1e3,
            "idle_ms": sum(g[0] for g in idle) / 1e3, "idle_count": len(idle),
            "largest": [(round(g[0] / 1e3, 3), *g[1:]) for g in idle[:top]]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=prompt_lengths, default=[2048, 8192])
    parser.add_argument("--trace-dir")
    parser.add_argument("--out")
    parser.add_argument("--no-sustained", action="store_true", help="skip the sustained-load section")
    parser.add_argument("--sustained-lengths", type=prompt_lengths, default=[8192],
                        help="prompt lengths of the sustained-load section")
    args = parser.parse_args(argv)
    engine = Engine.from_pretrained("Qwen/Qwen3-8B", device="cuda", weights="synthetic", kv_cache_tokens=40960)
    out = {}
    for n in args.lengths:
        ms = prefill_ms(engine, n)
        seq = engine.add_request(prompt_ids(n, seed=9), engine.sampling_params(temperature=0, max_tokens=1))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("engine.step"):
                engine.step()
            torch.cuda.synchronize()
        assert seq.finished
        out[n] = {"prefill_ms": ms, **gaps(prof)}
        graphed = [t for t in engine.runner.prefill_graphs if t >= n]
        if graphed:  # the device time of the step's graph alone, replayed on the inputs it holds
            graph = engine.runner.prefill_graphs[min(graphed)][0]
            out[n]["graph_replay_ms"] = cuda_ms(graph.replay, iters=5, warmup=1)
        if args.trace_dir:
            prof.export_chrome_trace(str(Path(args.trace_dir) / f"prefill_{n}.json"))
    if not args.no_sustained:
        out["sustained"] = sustained(engine, args.sustained_lengths)
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    for n in args.lengths:
        r = out[n]
        print(f"prefill {n}: {r['prefill_ms']:.2f} ms; profiled step: kernels {r['kernel_ms']:.2f} ms, device idle "
              f"{r['idle_ms']:.2f} ms in {r['idle_count']} gaps, span {r['span_ms']:.2f} ms; host before the "
              f"first kernel {r['host_before_first_kernel_ms']:.2f} ms, after the last {r['host_after_last_kernel_ms']:.2f}; "
              f"graph alone {r.get('graph_replay_ms', float('nan')):.2f} ms")
    if "sustained" in out:
        print(json.dumps(out["sustained"]))


if __name__ == "__main__":
    main()
