"""One call's Anatomy as a Chrome trace-event / Perfetto JSON file (open it in ui.perfetto.dev or chrome://tracing).

Tracks, all in one process ("llm-anatomy call"):
  host      the call's phases (parse, template, tokenize, queue, prefill, decode, e2e) and, inside prefill and
            decode, each step's host span; spans that would overlap without nesting go to extra "host" lanes
  GPU       the prefill forward and each decode step's forward (start_ms, gpu_ms), with token, context, bytes
            (modelled, and measured DRAM bytes where read) and FLOPs in args; named "CPU" for a call on the CPU
  counters  power (W), SM clock, memory clock (MHz), energy since the call began (J) and this request's KV cache
            bytes after prefill and after each decode step
Times in the file are microseconds since the call began ("ts"/"dur"); `displayTimeUnit` is ms.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from llm_anatomy.anatomy import Anatomy
from llm_anatomy.report import finite
from llm_anatomy.report.readings import bytes_reading, energy_reading, memory_words

PID = 1
TID_HOST = 1
TID_GPU = 2
TID_COUNTERS = 0  # counters are per process; tid is ignored by viewers but kept for validity


_finite = finite


def _us(ms: Any) -> float | None:
    v = _finite(ms)
    return None if v is None else round(v * 1000.0, 3)


def _clean(value: Any) -> Any:
    """Args that are valid JSON: non-finite numbers become None, tuples become lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _lanes(spans: list[dict]) -> list[list[dict]]:
    """Split complete events into lanes in which they nest properly (the trace format needs that per thread)."""
    lanes: list[list[dict]] = []  # each lane keeps a stack of open (end) times
    stacks: list[list[float]] = []
    for ev in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        start, end = ev["ts"], ev["ts"] + ev["dur"]
        for lane, stack in zip(lanes, stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                lane.append(ev)
                stack.append(end)
                break
        else:
            lanes.append([ev])
            stacks.append([end])
    return lanes


def _host_spans(a: Anatomy) -> list[dict]:
    """The call's phases, with their energy where measured, and each step's host span inside its phase."""
    energy = {e.phase: energy_reading(e) for e in a.telemetry.energy}
    host: list[dict] = []
    for p in a.phases:
        ts, end = _us(p.start_ms), _us(p.end_ms)
        if ts is None or end is None:
            continue
        args: dict[str, Any] = {"start_ms": p.start_ms, "end_ms": p.end_ms, "ms": p.end_ms - p.start_ms}
        if p.note:
            args["note"] = p.note
        e = energy.get(p.name) or (energy.get("call") if p.name == "e2e" else None)
        if e is not None:
            args.update(energy_j=e.joules, energy_per_token_j=e.per_token)
            if e.low is not None:
                args.update(energy_low_j=e.low, energy_high_j=e.high)
            elif e.plus_minus is not None:
                args.update(energy_uncertainty_j=e.plus_minus)
        host.append({"name": p.name, "cat": "phase", "ph": "X", "ts": max(0.0, ts), "dur": max(0.0, end - ts),
                     "pid": PID, "args": args})
    pf = a.prefill
    ts, dur = _us(pf.start_ms), _us(pf.host_ms)
    if ts is not None and dur is not None:
        host.append({"name": "prefill step (host)", "cat": "step", "ph": "X", "ts": max(0.0, ts),
                     "dur": max(0.0, dur), "pid": PID, "args": {"tokens": pf.tokens, "host_ms": pf.host_ms}})
    for s in a.decode_steps:
        ts, end = _us(s.start_ms), _us(s.end_ms)
        if ts is None or end is None:
            continue
        host.append({"name": f"step {s.index} (host)", "cat": "step", "ph": "X", "ts": max(0.0, ts),
                     "dur": max(0.0, end - ts), "pid": PID,
                     "args": {"index": s.index, "host_ms": s.host_ms, "token": s.token_text}})
    return host


def _bytes_args(record: Any) -> dict[str, Any]:
    """The step's bytes: the cost model's, and the DRAM counters' where they were read."""
    reading = bytes_reading(record)
    args: dict[str, Any] = {"bytes": reading.modelled, "bytes_source": reading.source}
    if reading.measured is not None:
        args["dram_bytes"] = reading.measured
    return args


def _forward_spans(a: Anatomy) -> list[dict]:
    """The forward of the prefill and of each decode step (on the GPU, or the CPU's forward time)."""
    spans: list[dict] = []
    pf = a.prefill
    ts, dur = _us(pf.start_ms), _us(pf.ms)
    if ts is not None and dur is not None:
        rl = pf.roofline
        spans.append({"name": "prefill", "cat": "gpu", "ph": "X", "ts": max(0.0, ts), "dur": max(0.0, dur), "pid": PID,
                      "args": {"tokens": pf.tokens, "gpu_ms": pf.ms, "flops": pf.flops, **_bytes_args(pf),
                               "arithmetic_intensity": rl.arithmetic_intensity, "tflops": rl.achieved_tflops,
                               "gbps": rl.achieved_gbps, "mfu": pf.mfu, "mbu": pf.mbu, "bound": rl.bound.kind}})
    for s in a.decode_steps:
        ts, dur = _us(s.start_ms), _us(s.gpu_ms)
        if ts is None or dur is None:
            continue
        spans.append({"name": f"decode step {s.index}", "cat": "gpu", "ph": "X", "ts": max(0.0, ts),
                      "dur": max(0.0, dur), "pid": PID,
                      "args": {"index": s.index, "token": s.token_text, "token_id": s.token_id,
                               "context_len": s.context_len, "batch_size": s.batch_size, "gpu_ms": s.gpu_ms,
                               "host_ms": s.host_ms, "flops": s.flops, **_bytes_args(s),
                               "kv_bytes_read": s.kv_bytes_read, "mbu": s.mbu, "mfu": s.mfu, "bound": s.bound,
                               "joined": list(s.joined), "left": list(s.left)}})
    return spans


def _counters(a: Anatomy) -> list[dict]:
    """Power, clocks, energy and utilization samples, and this request's KV cache bytes after each step."""
    events: list[dict] = []

    def counter(name: str, ts_ms: Any, series: str, value: Any) -> None:
        ts, v = _us(ts_ms), _finite(value)
        if ts is not None and v is not None:
            events.append({"name": name, "cat": "counter", "ph": "C", "ts": max(0.0, ts), "pid": PID,
                           "tid": TID_COUNTERS, "args": {series: v}})

    for g in a.gpu_samples:
        counter("power (W)", g.t_ms, "W", g.power_w)
        counter("SM clock (MHz)", g.t_ms, "MHz", g.sm_clock_mhz)
        counter("memory clock (MHz)", g.t_ms, "MHz", g.mem_clock_mhz)
        counter("energy since call start (J)", g.t_ms, "J", g.energy_j)
        counter("GPU utilization (%)", g.t_ms, "%", g.gpu_util)
    pf = a.prefill
    kv_times = [pf.start_ms + pf.host_ms if _finite(pf.host_ms) is not None else a.ttft_ms]
    kv_times += [s.end_ms for s in a.decode_steps]
    for t_ms, nbytes in zip(kv_times, a.kv_cache.bytes_after_step):
        counter("KV cache of this request (bytes)", t_ms, "bytes", nbytes)
    return events


def build_trace(anatomy: Anatomy) -> dict:
    """The trace-event JSON object for one call: {"traceEvents": [...], "displayTimeUnit": "ms", ...}."""
    a = anatomy
    events: list[dict] = []

    def meta(name: str, tid: int, args: dict) -> None:
        events.append({"name": name, "ph": "M", "ts": 0, "pid": PID, "tid": tid, "args": args})

    # thread metadata; overlapping spans get extra lanes (tid 1, 11, 12, ... for host; 2, 21, ... for the forward)
    meta("process_name", 0, {"name": f"llm-anatomy call {a.id}".strip()})
    synthetic = " (SYNTHETIC weights)" if a.weights.kind == "synthetic" else ""
    meta("process_labels", 0, {"labels": f"{a.model.name}{synthetic} on {a.device.name}"})
    forward_label = memory_words(a).processor
    for base, label, spans, order in ((TID_HOST, "host", _host_spans(a), 0),
                                      (TID_GPU, forward_label, _forward_spans(a), 1)):
        for i, lane in enumerate(_lanes(spans) or [[]]):
            tid = base if i == 0 else base * 10 + i
            meta("thread_name", tid, {"name": label if i == 0 else f"{label} ({i + 1})"})
            meta("thread_sort_index", tid, {"sort_index": order * 100 + i})
            for ev in lane:
                ev["tid"] = tid
                events.append(ev)

    ttft = _us(a.ttft_ms)
    if ttft is not None:
        events.append({"name": "first token", "cat": "marker", "ph": "i", "s": "p", "ts": max(0.0, ttft),
                       "pid": PID, "tid": TID_HOST, "args": {"ttft_ms": a.ttft_ms}})
    events += _counters(a)

    return {
        "traceEvents": [_clean(e) for e in events],
        "displayTimeUnit": "ms",
        "otherData": _clean({
            "tool": "llm-anatomy", "tool_version": a.tool_version, "schema_version": a.schema_version,
            "call_id": a.id, "model": a.model.name, "weights": a.weights.label, "weights_kind": a.weights.kind,
            "device": a.device.name, "device_type": a.device.type, "started_at_unix": a.started_at_unix,
            "ttft_ms": a.ttft_ms, "tpot_ms": a.tpot_ms, "e2e_ms": a.e2e_ms, "prompt_tokens": len(a.prompt_token_ids),
            "output_tokens": len(a.output_token_ids), "finish_reason": a.finish_reason,
            "telemetry": a.telemetry.note,
        }),
    }


def write_trace(anatomy: Anatomy, path: str | Path) -> Path:
    """Write `build_trace(anatomy)` as JSON to `path` and return the path."""
    path = Path(path)
    path.write_text(json.dumps(build_trace(anatomy), ensure_ascii=False, allow_nan=False), encoding="utf-8")
    return path
