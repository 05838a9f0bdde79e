"""Watches the engine for one request and turns what it saw into an Anatomy.

`RequestRecorder` is an engine observer: during the call it only reads the host clock and records device
events (no syncs, no allocation beyond small records). Everything else (event times, costs, rooflines,
energy) is computed in `build` after the request has finished.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from ..anatomy import (Bound, Ceilings, DecodeStep, DecodeSummary, EnergyRecord, GpuSample, KVCacheRecord,
                       PrefillRecord, Roofline, Telemetry)
from ..engine.events import Step
from ..engine.scheduler import Sequence
from .clock import Clock
from .cost import Cost, decode_cost, kv_formula, prefill_cost
from .telemetry import RawSample


@dataclass
class StepRecord:
    step: Step
    context_len: int  # this request's context after the step
    batch_size: int
    others: list[str]
    gpu_start: object = None  # torch.cuda.Event, or host ns on the CPU
    gpu_end: object = None
    kv_tokens: int = 0


@dataclass
class RequestRecorder:
    """Engine observer for one request (the first one added after attaching, unless request_id is given).
    With lookahead the next step is launched before the current one completes, so open steps are kept by
    their index."""

    clock: Clock
    request_id: str | None = None
    added_ns: int = 0
    finished_ns: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    _open: dict[int, StepRecord] = field(default_factory=dict)

    def _mine(self, step: Step) -> Sequence | None:
        for s in step.seqs:
            if s.request_id == self.request_id:
                return s
        return None

    def on_add(self, seq: Sequence, t_ns: int) -> None:
        if self.request_id is None:
            self.request_id = seq.request_id
        if seq.request_id == self.request_id:
            self.added_ns = t_ns

    def on_launch(self, step: Step) -> None:
        seq = self._mine(step)
        if seq is None or seq.finished:
            return
        i = step.seqs.index(seq)
        record = StepRecord(step, step.context_lens[i], len(step.seqs),
                            [s.request_id for s in step.seqs if s is not seq])
        record.gpu_start = self.clock.event() if self.clock.cuda else time.perf_counter_ns()
        self._open[step.index] = record

    def on_launched(self, step: Step) -> None:
        record = self._open.get(step.index)
        if record is not None:
            record.gpu_end = self.clock.event() if self.clock.cuda else time.perf_counter_ns()

    def on_step(self, step: Step) -> None:
        record = self._open.pop(step.index, None)
        seq = self._mine(step)
        # a step launched ahead for a request that had already finished produced nothing for it
        if record is not None and seq is not None and seq.num_cached == record.context_len:
            record.kv_tokens = seq.num_cached
            self.steps.append(record)

    def on_finish(self, seq: Sequence, t_ns: int) -> None:
        if seq.request_id == self.request_id:
            self.finished_ns = t_ns

    # ---- after the call -------------------------------------------------------------------------------
    def device_ms(self, r: StepRecord) -> float:
        if self.clock.cuda:
            return r.gpu_start.elapsed_time(r.gpu_end)
        return (r.gpu_end - r.gpu_start) / 1e6

    def device_start_ms(self, r: StepRecord) -> float:
        return self.clock.event_ms(r.gpu_start) if self.clock.cuda else self.clock.ms(r.gpu_start)


def roofline(cost: Cost, seconds: float, wall_seconds: float, ceilings: Ceilings) -> Roofline:
    """Achieved rates over the device time, against the ceilings, and which limit the step ran into."""
    tflops = cost.flops / seconds / 1e12 if seconds > 0 else 0.0
    gbps = cost.bytes / seconds / 1e9 if seconds > 0 else 0.0

    def frac(x, peak):
        return x / peak if peak else None

    mfu, mbu = frac(tflops, ceilings.matmul_tflops), frac(gbps, ceilings.read_gbps)
    return Roofline(cost.flops, cost.bytes, cost.intensity, tflops, gbps, mfu, mbu,
                    frac(tflops, ceilings.datasheet_tflops), frac(gbps, ceilings.datasheet_gbps),
                    classify(cost, mfu or frac(tflops, ceilings.datasheet_tflops),
                             mbu or frac(gbps, ceilings.datasheet_gbps), seconds, wall_seconds, ceilings))


def classify(cost: Cost, mfu: float | None, mbu: float | None, seconds: float, wall_seconds: float,
             ceilings: Ceilings) -> Bound:
    ridge = ceilings.ridge
    if ridge is None or mfu is None or mbu is None:
        return Bound("unknown", "no ceilings for this device: run `llm-anatomy calibrate`")
    which = "measured" if ceilings.read_gbps else "datasheet"
    expected = "compute" if cost.intensity >= ridge else "memory"
    fraction = mfu if expected == "compute" else mbu
    what = "matmul throughput" if expected == "compute" else "bandwidth"
    side = ">=" if expected == "compute" else "<"
    busy = seconds / wall_seconds if wall_seconds > 0 else 1.0
    if busy < 0.8:
        return Bound("overhead", f"the device is busy only {busy:.0%} of the step; the rest is host work "
                                 f"(scheduling, launches, Python) while it waits")
    if fraction < 0.5:
        return Bound("overhead", f"{cost.intensity:.1f} FLOP/B {side} ridge {ridge:.0f} makes it {expected}-limited, "
                                 f"yet it reaches only {fraction:.0%} of {which} {what}: launch gaps and "
                                 f"under-filled kernels")
    return Bound(expected, f"{cost.intensity:.1f} FLOP/B {side} ridge {ridge:.0f}; {fraction:.0%} of {which} {what}")


def energy_records(samples: list[RawSample], clock: Clock, spans: dict[str, tuple[float, float, int]]
                   ) -> tuple[list[EnergyRecord], float | None]:
    """Energy per span (name -> (start_ms, end_ms, tokens)) from the device's energy counter.

    The counter only changes every ~20-100 ms, so it is read as a piecewise-linear function through the
    instants where it changed; each end of a span is uncertain by about one update interval of power.
    """
    points = [(clock.ms(s.t_ns), s.energy_mj) for s in samples if s.energy_mj is not None]
    if len(points) < 2:
        return [], None
    updates = [points[0]] + [p for prev, p in zip(points, points[1:]) if p[1] != prev[1]]
    if len(updates) < 3:
        return [], None
    interval = statistics.median(b[0] - a[0] for a, b in zip(updates, updates[1:]))
    times = [t for t, _ in updates]
    values = [e / 1e3 for _, e in updates]

    def energy_at(t: float) -> float:
        if t <= times[0]:
            return values[0]
        if t >= times[-1]:
            return values[-1]
        i = next(i for i, x in enumerate(times) if x >= t)
        f = (t - times[i - 1]) / (times[i] - times[i - 1])
        return values[i - 1] + f * (values[i] - values[i - 1])

    mean_power = (values[-1] - values[0]) / ((times[-1] - times[0]) / 1e3)
    out = []
    for name, (a, b, tokens) in spans.items():
        joules = energy_at(b) - energy_at(a)
        uncertainty = mean_power * interval / 1e3 * 2 ** 0.5
        out.append(EnergyRecord(name, joules, uncertainty, joules / tokens if tokens else None,
                                f"NVML total-energy counter, interpolated between its updates "
                                f"(every ~{interval:.0f} ms); ± one update interval at each end"))
    return out, interval


def telemetry(samples: list[RawSample], clock: Clock, available: bool, note: str, hz: float,
              spans: dict[str, tuple[float, float, int]]) -> tuple[Telemetry, list[GpuSample]]:
    if not available:
        return Telemetry(False, note), []
    energy0 = next((s.energy_mj for s in samples if s.energy_mj is not None), None)
    converted = [GpuSample(clock.ms(s.t_ns), s.power_mw / 1e3 if s.power_mw is not None else None,
                           (s.energy_mj - energy0) / 1e3 if s.energy_mj is not None and energy0 is not None else None,
                           s.sm_mhz, s.mem_mhz, s.gpu_util, s.mem_util, s.mem_used, s.temperature_c, s.throttle)
                 for s in samples]
    energy, interval = energy_records(samples, clock, spans)
    duration = (samples[-1].t_ns - samples[0].t_ns) / 1e9 if len(samples) > 1 else 0
    rate = (len(samples) - 1) / duration if duration else 0.0
    return Telemetry(True, f"NVML sampled from a separate process at {rate:.0f} Hz (asked {hz:.0f} Hz)", rate,
                     interval, energy), converted


def prefill_record(rec: RequestRecorder, r: StepRecord, engine, ceilings: Ceilings) -> PrefillRecord:
    seqs = [(q, c - q) for q, c in zip(r.step.query_lens, r.step.context_lens)]
    cost = prefill_cost(engine.config, engine.dtype, seqs)
    device_ms = rec.device_ms(r)
    wall_ms = (r.step.t_sampled_ns - r.step.t_start_ns) / 1e6
    line = roofline(cost, device_ms / 1e3, wall_ms / 1e3, ceilings)
    return PrefillRecord(r.step.num_tokens, device_ms, r.step.host_work_ns / 1e6,
                         rec.clock.ms(r.step.t_start_ns), cost.flops, cost.bytes, line.mfu, line.mbu, line,
                         cost.parts)


def decode_records(rec: RequestRecorder, records: list[StepRecord], engine, ceilings: Ceilings,
                   token_text, previous_end_ns: int) -> tuple[list[DecodeStep], list[Cost]]:
    """A step's wall time is its inter-token latency: from the previous token on the host to its own (with
    lookahead a step is launched before the one ahead of it completes, so launch-to-end would count twice)."""
    steps, costs = [], []
    for i, r in enumerate(records, start=1):
        cost = decode_cost(engine.config, engine.dtype, r.step.context_lens)
        device_ms = rec.device_ms(r)
        wall_ms = (r.step.t_end_ns - previous_end_ns) / 1e6
        previous_end_ns = r.step.t_end_ns
        line = roofline(cost, device_ms / 1e3, wall_ms / 1e3, ceilings)
        token = r.step.tokens[[s.request_id for s in r.step.seqs].index(rec.request_id)]
        steps.append(DecodeStep(i, rec.clock.ms(r.step.t_start_ns), rec.clock.ms(r.step.t_end_ns), device_ms,
                                r.step.host_work_ns / 1e6, r.context_len, r.batch_size, token, token_text(token),
                                cost.flops, cost.bytes, cost.part("kv_read", "bytes"), line.mbu, line.mfu,
                                line.bound.kind, r.others))
        costs.append(cost)
    return steps, costs


def decode_summary(steps: list[DecodeStep], costs: list[Cost], itl: list[float], ceilings: Ceilings
                   ) -> DecodeSummary | None:
    if not steps:
        return None
    total = Cost(sum(c.flops for c in costs), sum(c.bytes for c in costs))
    device_s = sum(s.gpu_ms for s in steps) / 1e3
    wall_s = (steps[-1].end_ms - steps[0].start_ms) / 1e3
    middle = statistics.median(s.bytes for s in steps)
    kv_share = statistics.median(s.kv_bytes_read / s.bytes for s in steps)
    itl_sorted = sorted(itl) or [0.0]
    return DecodeSummary(len(steps), statistics.median(s.gpu_ms for s in steps),
                         statistics.median(s.host_ms for s in steps), statistics.median(itl_sorted),
                         itl_sorted[min(len(itl_sorted) - 1, int(0.9 * len(itl_sorted)))],
                         len(steps) / wall_s if wall_s > 0 else 0.0, middle, kv_share,
                         roofline(total, device_s, wall_s, ceilings))


def kv_record(engine, rec: RequestRecorder, seq: Sequence) -> KVCacheRecord:
    pool = engine.pool
    bpt = pool.bytes_per_token
    tokens = seq.num_cached
    blocks = pool.blocks_for(tokens)
    device_total = torch.cuda.mem_get_info(engine.device)[1] if engine.device.type == "cuda" else None
    device_free = torch.cuda.mem_get_info(engine.device)[0] if engine.device.type == "cuda" else 0
    room = pool.num_free_blocks * pool.bytes_per_block + device_free

    def fits(length: int) -> int:
        return room // (pool.blocks_for(length) * pool.bytes_per_block) if length else 0

    return KVCacheRecord(
        bytes_per_token=bpt, formula=kv_formula(engine.config, engine.dtype), dtype=str(engine.dtype).split(".")[-1],
        block_size=pool.block_size, pool_blocks=pool.num_blocks, pool_bytes=pool.total_bytes,
        pool_share_of_device=pool.total_bytes / device_total if device_total else None,
        blocks_allocated=blocks, tokens=tokens, bytes_used=tokens * bpt, bytes_allocated=blocks * pool.bytes_per_block,
        bytes_after_step=[r.kv_tokens * bpt for r in rec.steps],
        fits_sequences_this_length=fits(seq.num_tokens), fits_sequences_full_context=fits(engine.max_model_len),
        full_context=engine.max_model_len)
