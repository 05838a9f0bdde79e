"""Watches the engine for the requests it is asked to trace, and turns what it saw into Anatomy parts.

`Recorder` is an engine observer: during a step it only reads the host clock and records one pair of device
events per step, shared by every traced request in that step (a server traces every request; a pair per
request would cost host time that grows with the batch). Everything else (event times, costs, rooflines,
energy) is computed after a request has finished.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..anatomy import (BatchingRecord, Bound, Stall, Ceilings, DecodeStep, DecodeSummary, EnergyRecord, GpuSample,
                       KVCacheRecord, PrefillRecord, Roofline, Telemetry, percentile)
from ..engine.events import Step
from ..engine.scheduler import Sequence, Status
from .clock import Clock
from .cost import Cost, KernelShapes, decode_cost, device_shapes, kv_formula, prefill_cost
from .energy import PowerModel, counter_updates, span_energy, update_period_ms
from .telemetry import RawSample


@dataclass(eq=False)
class StepMeasure:
    """What is measured once per step, however many traced requests share it: its device interval
    (torch.cuda.Events, or host ns on the CPU, where the host is the device), its cost, and (computed once, when
    the first anatomy that needs it is built) who was in it and how that changed since an earlier step. Each
    request's record refers to this one object, so per-step facts cost O(batch) once, never once per request."""

    start: object = None
    end: object = None
    _ms: float | None = None
    cost: Cost | None = None
    _ids: frozenset[str] | None = None
    _requests: list[str] | None = None
    _changes: dict[int, tuple[list[str], list[str]]] = field(default_factory=dict)
    _facts: dict[tuple[int, int], "DecodeFacts"] = field(default_factory=dict)
    _num_tokens: int | None = None
    _from_reference: dict[int, float] = field(default_factory=dict)

    def num_tokens(self, step: Step) -> int:
        """step.num_tokens (a sum over the batch), once."""
        if self._num_tokens is None:
            self._num_tokens = step.num_tokens
        return self._num_tokens

    def start_ms(self, clock: Clock) -> float:
        """The step's device start on `clock` (ms since its zero). On CUDA the interval from the clock's device
        reference is read once per step and reference, not once per request (each read is a driver call)."""
        if not clock.cuda:
            return clock.ms(self.start)
        found = self._from_reference.get(clock.reference_ns)
        if found is None:
            found = self._from_reference[clock.reference_ns] = clock.from_reference_ms(self.start)
        return clock.ms(clock.reference_ns) + found

    def ids(self, step: Step) -> frozenset[str]:
        if self._ids is None:
            self._ids = frozenset(self.requests(step))
        return self._ids

    def requests(self, step: Step) -> list[str]:
        """The step's request ids in batch order (one list, shared by every anatomy that names them)."""
        if self._requests is None:
            self._requests = [s.request_id for s in step.seqs]
        return self._requests

    def changes_since(self, step: Step, before: "StepRecord") -> tuple[list[str], list[str]]:
        """(joined, left): the requests in this step and not in `before`'s, and the reverse, sorted. For a
        request in both steps these are exactly its batch's changes; computed once per pair of steps."""
        key = before.step.index
        found = self._changes.get(key)
        if found is None:
            now, then = self.ids(step), before.timing.ids(before.step)
            found = self._changes[key] = (sorted(now - then), sorted(then - now))
        return found

    @property
    def completed(self) -> bool:
        """The step's device work was launched to its end (a snapshot's was, or it would not exist)."""
        return self.end is not None or self._ms is not None

    def snapshot(self, step: Step, clock: Clock) -> tuple[Step, "StepMeasure"]:
        """A picklable copy of the step and of this measure, for building anatomies in another process: the step
        without its sequences (their ids are in the measure), the device interval and the start already read
        (against `clock`'s device reference, the one every trace of the step shares)."""
        host = isinstance(self.start, int)
        found = {} if host or not clock.cuda else {clock.reference_ns: clock.from_reference_ms(self.start)}
        measure = StepMeasure(self.start if host else None, self.end if host else None, self.ms(),
                              _requests=self.requests(step), _num_tokens=self.num_tokens(step),
                              _from_reference=found)
        return dataclasses.replace(step, seqs=[]), measure

    def ms(self) -> float:
        if self._ms is None:
            if isinstance(self.start, int):
                self._ms = (self.end - self.start) / 1e6
            else:
                self.end.synchronize()  # already done in practice: the step's tokens were read after it
                self._ms = self.start.elapsed_time(self.end)
        return self._ms


@dataclass(slots=True)
class StepRecord:
    """One step, seen by one request in it: a reference to the step and its shared measure, and where the
    request sits in it (a step of a batch of 512 makes 512 of these, so nothing else is kept per request)."""

    step: Step
    position: int  # of this request in step.seqs
    timing: StepMeasure
    kv_tokens: int = 0

    @property
    def context_len(self) -> int:  # this request's context after the step
        return self.step.context_lens[self.position]

    @property
    def batch_size(self) -> int:
        return len(self.timing.requests(self.step))

    def others(self) -> list[str]:
        """The other requests in this step, sorted."""
        me = self.timing.requests(self.step)[self.position]
        return sorted(r for r in self.timing.ids(self.step) if r != me)


@dataclass
class RequestTrace:
    """What one request went through: each step that produced one of its tokens, on its own clock."""

    clock: Clock
    request_id: str
    added_ns: int = 0
    finished_ns: int = 0
    steps: list[StepRecord] = field(default_factory=list)  # the steps that made its tokens
    chunks: list[StepRecord] = field(default_factory=list)  # its prompt's chunks before its first token
    stalls: list[tuple[Step, StepMeasure]] = field(default_factory=list)  # others' prefills while it was running
    seq: Sequence | None = None
    since_step: int = 0  # no step before this index can be among its steps, chunks or stalls

    @staticmethod
    def device_ms(r: StepRecord | StepMeasure) -> float:
        return (r.timing if isinstance(r, StepRecord) else r).ms()

    def device_start_ms(self, r: StepRecord) -> float:
        return r.timing.start_ms(self.clock)

    def first_step(self) -> int:
        """The lowest index among its steps, chunks and stalls (its since_step when it has none)."""
        firsts = [records[0].step.index for records in (self.chunks, self.steps) if records]
        if self.stalls:
            firsts.append(self.stalls[0][0].index)
        return min(firsts, default=self.since_step)

    def shared_steps(self) -> dict[int, tuple[Step, StepMeasure]]:
        """index -> (step, measure) of every step its anatomy reads (those a snapshot can be taken of)."""
        found = {r.step.index: (r.step, r.timing) for r in self.chunks + self.steps}
        found.update((step.index, (step, timing)) for step, timing in self.stalls if timing.completed)
        return found


@dataclass(frozen=True)
class SequenceFacts:
    """What an anatomy reads of a finished request's sequence."""

    num_cached: int
    num_tokens: int
    num_preemptions: int


@dataclass(frozen=True)
class TraceFacts:
    """A finished request's trace as it travels to another process (pickled): the steps by index, with where the
    request sat in each (the steps themselves travel once, as StepMeasure snapshots shared by all their
    requests), and its sequence's facts. `trace` rebuilds the RequestTrace over those snapshots."""

    clock: Clock
    request_id: str
    added_ns: int
    finished_ns: int
    steps: list[tuple[int, int, int]]  # (step index, position, kv_tokens)
    chunks: list[tuple[int, int, int]]
    stalls: list[int]
    seq: SequenceFacts | None

    @classmethod
    def of(cls, rec: RequestTrace) -> "TraceFacts":
        seq = rec.seq
        return cls(rec.clock, rec.request_id, rec.added_ns, rec.finished_ns,
                   [(r.step.index, r.position, r.kv_tokens) for r in rec.steps],
                   [(r.step.index, r.position, r.kv_tokens) for r in rec.chunks],
                   [step.index for step, timing in rec.stalls if timing.completed],
                   SequenceFacts(seq.num_cached, seq.num_tokens, seq.num_preemptions) if seq is not None else None)

    def trace(self, shared: dict[int, tuple[Step, StepMeasure]]) -> RequestTrace:
        def records(where):
            return [StepRecord(shared[i][0], position, shared[i][1], kv) for i, position, kv in where]
        return RequestTrace(self.clock, self.request_id, self.added_ns, self.finished_ns, records(self.steps),
                            records(self.chunks), [shared[i] for i in self.stalls], self.seq)


class Recorder:
    """Engine observer that traces the requests registered with `watch` (before they are added).

    With lookahead the next step is launched before the current one completes, so open steps are kept by
    their index. A request's trace is complete once it has finished and the step that finished it has been
    seen; `take_finished` hands such traces over (the server builds their anatomies away from its step loop).
    """

    def __init__(self, clock: Clock):
        self.clock = clock
        self.traces: dict[str, RequestTrace] = {}
        self._open: dict[int, tuple[StepMeasure, list[tuple[RequestTrace, Sequence, StepRecord]]]] = {}
        self._finished: list[RequestTrace] = []
        self._launched = -1  # the index of the latest step launched
        self._start: tuple[int, object] | None = None  # (step index, its start mark) between on_launch and on_launched
        # the oldest step a watched request may still come to name (None: none is watched); kept up to date on
        # the engine thread, read by others (the anatomy builder forgets the steps before it)
        self.oldest_step: int | None = None

    def watch(self, request_id: str, t0_ns: int | None = None, clock: Clock | None = None) -> RequestTrace:
        clock = clock or self.clock
        trace = RequestTrace(clock.at(t0_ns) if t0_ns is not None else clock, request_id,
                             since_step=self._launched + 1)
        self.traces[request_id] = trace
        self._update_oldest()
        return trace

    def _update_oldest(self) -> None:
        # watched in step order, so the first trace left is the oldest
        self.oldest_step = next(iter(self.traces.values())).since_step if self.traces else None

    def _now(self) -> object:
        return self.clock.event() if self.clock.cuda else time.perf_counter_ns()

    def on_add(self, seq: Sequence, t_ns: int) -> None:
        trace = self.traces.get(seq.request_id)
        if trace is not None:
            trace.added_ns, trace.seq = t_ns, seq

    def on_launch(self, step: Step) -> None:
        """The step's start mark, before its launch; who it concerns is worked out once it is launched (at
        hundreds of requests a record each, which would delay the launch while the device may be waiting)."""
        self._launched = step.index
        self._start = (step.index, self._now()) if self.traces else None

    def on_launched(self, step: Step) -> None:
        start, self._start = self._start, None
        if start is None or start[0] != step.index:  # nothing traced: no end mark (on a GPU, an event a step)
            return
        end = self._now()
        traces, finished = self.traces, Status.FINISHED
        timing = StepMeasure()
        # one pass, one small record per traced request: a reference to the step and its shared measure (nothing
        # between the launch and here changes a sequence's status: tokens are appended when a step completes)
        mine = [(trace, seq, StepRecord(step, i, timing)) for i, seq in enumerate(step.seqs)
                if (trace := traces.get(seq.request_id)) is not None and seq.status is not finished]
        # A prefill step holds back every running request not in it: that is who slowed them down.
        stalled = []
        if step.is_prefill:
            ids = timing.ids(step)
            stalled = [t for t in traces.values() if t.seq is not None and t.seq.status is Status.RUNNING
                       and t.request_id not in ids]
        if not mine and not stalled:
            return
        timing.start, timing.end = start[1], end
        for trace in stalled:
            trace.stalls.append((step, timing))
        self._open[step.index] = (timing, mine)

    def on_step(self, step: Step) -> None:
        opened = self._open.pop(step.index, None)
        if opened is None:
            return
        context_lens, tokens = step.context_lens, step.tokens
        for trace, seq, record in opened[1]:
            # a step launched ahead for a request that had already finished produced nothing for it
            if seq.num_cached != context_lens[record.position]:
                continue
            record.kv_tokens = seq.num_cached
            if tokens[record.position] is not None:
                trace.steps.append(record)
            elif not trace.steps:  # a chunk of its prompt (later ones, recomputing after a preemption, show
                trace.chunks.append(record)  # in the inter-token latency of the step after them)

    def on_finish(self, seq: Sequence, t_ns: int) -> None:
        trace = self.traces.pop(seq.request_id, None)
        if trace is not None:
            trace.finished_ns = t_ns
            self._finished.append(trace)
            self._update_oldest()

    def take_finished(self) -> list[RequestTrace]:
        """Traces of requests that finished since the last call (call it between steps)."""
        done, self._finished = self._finished, []
        return done


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


def energy_records(samples: list[RawSample], clock: Clock, spans: dict[str, tuple[float, float, int]],
                   busy: tuple[float, float] | None = None) -> tuple[list[EnergyRecord], float | None]:
    """Energy per span (name -> (start_ms, end_ms, tokens)) from the device's energy counter (probe/energy.py),
    and the counter's update interval. `busy`: when the device worked for this call alone (ms), if known."""
    updates = counter_updates([(clock.ms(s.t_ns), s.energy_mj / 1e3) for s in samples if s.energy_mj is not None])
    period = update_period_ms(updates)
    if period is None:
        return [], None
    model = PowerModel.build(updates, busy)
    spread = ("the device's idle power ({:.0f} W, from the update intervals before and after its work) over the "
              "idle part of the intervals where its work began and ended, the rest over their busy part; elsewhere "
              "evenly over each interval".format(model.idle_w) if model.idle_w is not None
              else "each update interval's energy spread evenly over it")
    out = []
    for name, (a, b, tokens) in spans.items():
        e = span_energy(updates, a, b, model)
        short = b - a < period
        method = (f"NVML total-energy counter (updates every ~{period:.0f} ms): {spread}; low: between the first "
                  f"update surely after the span's start and the last surely before its end; high: between the "
                  f"last update surely before it and the first surely after it")
        if short:
            method += (f"; the span ({b - a:.1f} ms) is shorter than the counter's update interval, so its figure "
                       f"is an interpolation and its low bound is not informative: `llm-anatomy call --repeat N` "
                       f"measures energy per token in steady state")
        if e.high_j is None:
            method += "; the counter did not update on both sides of the span: no upper bound"
        out.append(EnergyRecord(name, e.joules, e.low_j, e.high_j, e.joules / tokens if tokens else None, method,
                                a, b, short))
    return out, period


def telemetry(samples: list[RawSample], clock: Clock, available: bool, note: str, hz: float,
              spans: dict[str, tuple[float, float, int]], busy: tuple[float, float] | None = None
              ) -> tuple[Telemetry, list[GpuSample]]:
    if not available:
        return Telemetry(False, note), []
    energy0 = next((s.energy_mj for s in samples if s.energy_mj is not None), None)
    converted = [GpuSample(clock.ms(s.t_ns), s.power_mw / 1e3 if s.power_mw is not None else None,
                           (s.energy_mj - energy0) / 1e3 if s.energy_mj is not None and energy0 is not None else None,
                           s.sm_mhz, s.mem_mhz, s.gpu_util, s.mem_util, s.mem_used, s.temperature_c, s.throttle)
                 for s in samples]
    energy, interval = energy_records(samples, clock, spans, busy)
    duration = (samples[-1].t_ns - samples[0].t_ns) / 1e9 if len(samples) > 1 else 0
    rate = (len(samples) - 1) / duration if duration else 0.0
    return Telemetry(True, f"NVML sampled from a separate process at {rate:.0f} Hz (asked {hz:.0f} Hz)", rate,
                     interval, energy), converted


def step_cost(engine, r: StepRecord, shapes: KernelShapes | None = None) -> Cost:
    """The whole step's work (every sequence in it), as the cost model counts it for this engine's device and plan
    (its precision: fp8 weights read a byte a parameter; `shapes` to give them); computed once per step."""
    if r.timing.cost is None:
        shapes = shapes or device_shapes(engine.device, engine.plan)
        step = r.step
        if step.is_prefill:
            seqs = [(q, c - q) for q, c in zip(step.query_lens, step.context_lens)]
            # the rows it sampled (a prompt's chunk samples none), where the step's tokens are known
            sampled = sum(t is not None for t in step.tokens) if step.tokens else None
            r.timing.cost = prefill_cost(engine.config, engine.dtype, seqs, sampled, shapes=shapes)
        else:
            r.timing.cost = decode_cost(engine.config, engine.dtype, step.context_lens, shapes=shapes)
    return r.timing.cost


def prefill_record(rec: RequestTrace, r: StepRecord, engine, ceilings: Ceilings,
                   shapes: KernelShapes | None = None) -> PrefillRecord:
    """The steps that prefilled the prompt (one, or its chunks then the step that completed it), together.
    FLOPs, bytes and times are those of whole steps: with others in them, theirs too."""
    records = rec.chunks + [r]
    costs = [step_cost(engine, x, shapes) for x in records]
    cost = Cost(sum(c.flops for c in costs), sum(c.bytes for c in costs))
    parts = costs[0].parts if len(costs) == 1 else {
        name: {key: sum(c.parts.get(name, {}).get(key, 0.0) for c in costs) for key in ("flops", "bytes")}
        for name in costs[0].parts}
    device_ms = sum(rec.device_ms(x) for x in records)
    wall_ms = (r.step.t_sampled_ns - records[0].step.t_start_ns) / 1e6
    line = roofline(cost, device_ms / 1e3, wall_ms / 1e3, ceilings)
    others = r.others()  # of the step that completed it: the decode steps' changes start from these
    return PrefillRecord(sum(x.step.num_tokens for x in records), device_ms,
                         sum(x.step.host_work_ns for x in records) / 1e6, rec.clock.ms(records[0].step.t_start_ns),
                         cost.flops, cost.bytes, line.mfu, line.mbu, line, parts,
                         max(x.batch_size for x in records), others, len(records))


@dataclass(frozen=True, slots=True)
class DecodeFacts:
    """What every request in both a decode step and an earlier one sees alike in its DecodeStep for that step
    (the earlier one being its previous step): computed once per pair of steps, shared by all of them."""

    cost: Cost
    device_ms: float
    host_ms: float
    batch_size: int
    kv_bytes_read: float
    line: Roofline
    joined: list[str]
    left: list[str]
    step_tokens: int


def decode_facts(engine, r: StepRecord, previous: StepRecord, ceilings: Ceilings,
                 shapes: KernelShapes | None = None) -> DecodeFacts:
    """`r`'s step as a request whose previous step was `previous`'s sees it; the roofline spans the time since
    that previous step ended."""
    timing = r.timing
    key = (previous.step.index, id(ceilings))
    found = timing._facts.get(key)
    if found is None:
        step = r.step
        cost = step_cost(engine, r, shapes)
        device_ms = timing.ms()
        wall_ms = (step.t_end_ns - previous.step.t_end_ns) / 1e6
        joined, left = timing.changes_since(step, previous)
        found = timing._facts[key] = DecodeFacts(
            cost, device_ms, step.host_work_ns / 1e6, len(timing.requests(step)), cost.part("kv_read", "bytes"),
            roofline(cost, device_ms / 1e3, wall_ms / 1e3, ceilings), joined, left, timing.num_tokens(step))
    return found


def decode_records(rec: RequestTrace, records: list[StepRecord], engine, ceilings: Ceilings,
                   token_text, previous: StepRecord, shapes: KernelShapes | None = None
                   ) -> tuple[list[DecodeStep], list[Cost]]:
    """A step spans its inter-token latency: from the previous token on the host to its own, so that steps tile
    the decode phase and the first starts when the prefill's token is emitted. (With lookahead a step is
    scheduled and launched before the one ahead of it completes: that instant is kept as launch_ms, and
    launch-to-end would count the overlap twice.) A step that recomputes the request after a preemption is a
    prefill, and is costed as one. What the step's other requests see alike comes from `decode_facts`, once."""
    steps, costs = [], []
    ms = rec.clock.ms
    previous_end_ms = ms(previous.step.t_end_ns)
    for i, r in enumerate(records, start=1):
        f = decode_facts(engine, r, previous, ceilings, shapes)
        step, position = r.step, r.position
        token = step.tokens[position]
        end_ms = ms(step.t_end_ns)
        line = f.line
        steps.append(DecodeStep(i, previous_end_ms, end_ms, f.device_ms, f.host_ms, step.context_lens[position],
                                f.batch_size, token, token_text(token), f.cost.flops, f.cost.bytes, f.kv_bytes_read,
                                line.mbu, line.mfu, line.bound.kind, f.joined, f.left, f.step_tokens,
                                ms(step.t_start_ns), r.timing.start_ms(rec.clock)))
        previous_end_ms = end_ms
        previous = r
        costs.append(f.cost)
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
    return DecodeSummary(len(steps), statistics.median(s.gpu_ms for s in steps),
                         statistics.median(s.host_ms for s in steps), percentile(itl, 50) or 0.0,
                         percentile(itl, 90) or 0.0, len(steps) / wall_s if wall_s > 0 else 0.0, middle, kv_share,
                         roofline(total, device_s, wall_s, ceilings))


@dataclass(frozen=True)
class PoolFacts:
    """What an anatomy reads of the engine's KV pool that does not change while it serves."""

    bytes_per_token: int
    formula: str
    dtype: str
    block_size: int
    num_blocks: int
    total_bytes: int
    bytes_per_block: int
    device_total: int | None  # the device's memory (None on the host)

    @classmethod
    def of(cls, engine) -> "PoolFacts":
        pool = engine.pool
        device_total = torch.cuda.mem_get_info(engine.device)[1] if engine.device.type == "cuda" else None
        return cls(pool.bytes_per_token, kv_formula(engine.config, pool.dtype), str(pool.dtype).split(".")[-1],
                   pool.block_size, pool.num_blocks, pool.total_bytes, pool.bytes_per_block, device_total)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


def kv_room(engine) -> int:
    """Bytes a new request's KV could take now: the pool's free blocks and the device's free memory."""
    device_free = torch.cuda.mem_get_info(engine.device)[0] if engine.device.type == "cuda" else 0
    return engine.pool.num_free_blocks * engine.pool.bytes_per_block + device_free


def kv_record(pool: PoolFacts, room: int, max_model_len: int, rec: RequestTrace, seq) -> KVCacheRecord:
    """`room`: kv_room() when the request finished."""
    bpt = pool.bytes_per_token
    tokens = seq.num_cached
    blocks = pool.blocks_for(tokens)

    def fits(length: int) -> int:
        return room // (pool.blocks_for(length) * pool.bytes_per_block) if length else 0

    return KVCacheRecord(
        bytes_per_token=bpt, formula=pool.formula, dtype=pool.dtype,
        block_size=pool.block_size, pool_blocks=pool.num_blocks, pool_bytes=pool.total_bytes,
        pool_share_of_device=pool.total_bytes / pool.device_total if pool.device_total else None,
        blocks_allocated=blocks, tokens=tokens, bytes_used=tokens * bpt, bytes_allocated=blocks * pool.bytes_per_block,
        bytes_after_step=[r.kv_tokens * bpt for r in rec.steps],
        fits_sequences_this_length=fits(seq.num_tokens), fits_sequences_full_context=fits(max_model_len),
        full_context=max_model_len)


def co_scheduled(rec: RequestTrace) -> dict[str, int]:
    """Other request id -> steps it shared with this one (of those that made this one's tokens), most first.
    Walks the batch's changes from step to step (each pair's computed once, shared by every request in both), so
    a request costs the size of its batch plus the changes, not its batch size times its steps."""
    if not rec.steps:
        return {}
    first = rec.steps[0]
    entered = dict.fromkeys(first.others(), 0)  # other -> index (in rec.steps) of the step it was last seen join
    shared: dict[str, int] = {}
    for i in range(1, len(rec.steps)):
        r = rec.steps[i]
        joined, left = r.timing.changes_since(r.step, rec.steps[i - 1])
        for other in left:
            shared[other] = shared.get(other, 0) + i - entered.pop(other)
        for other in joined:
            entered[other] = i
    for other, since in entered.items():
        shared[other] = shared.get(other, 0) + len(rec.steps) - since
    return dict(sorted(shared.items(), key=lambda kv: -kv[1]))


def batching_record(rec: RequestTrace, queue_ms: float) -> BatchingRecord:
    sizes = [r.batch_size for r in rec.steps] or [1]
    stalls = [Stall(rec.clock.ms(step.t_start_ns), rec.device_ms(timing), timing.requests(step),
                    timing.num_tokens(step))
              for step, timing in rec.stalls if timing.completed]
    return BatchingRecord(queue_ms, max(sizes), sum(sizes) / len(sizes),
                          rec.seq.num_preemptions if rec.seq is not None else 0,
                          co_scheduled(rec), stalls, sum(s.gpu_ms for s in stalls))
