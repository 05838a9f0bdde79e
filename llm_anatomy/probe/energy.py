"""Energy from NVML's total-energy counter, with intervals that say what the counter can and cannot tell.

The counter (nvmlDeviceGetTotalEnergyConsumption, mJ) changes only every ~20-100 ms (about 100 ms on an H200).
A sample whose value differs from the sample before it shows an update, and the update happened between those
two samples: its instant is known to one polling interval. The first sample is not an update: its value may
have been set any time before it.

Energy over a span [a, b] is then read three ways:
- `joules`: the integral over the span of a power model consistent with the counter (PowerModel: each update
  interval's energy spread evenly over it, or, where the device is known to start or stop working inside an
  interval, at the idle power over its idle part and the rest over its busy part);
- `low_j`: the energy between the first update surely after a and the last surely before b (certainly spent
  inside the span; 0 when no whole update interval lies inside it);
- `high_j`: between the last update surely before a and the first surely after b (everything that may have
  been spent in it); None when the counter did not update on both sides of the span.
The interval is one-sided where the span is short: a phase shorter than the update interval has low 0.

Steady-state energy per token (`steady_rate`) uses the counter where it is exact: over a run of repeated work,
the energy between two of its updates divided by the work done between them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Update:
    """The counter read `joules` from some instant in [earliest_ms, latest_ms] on (the two samples around it)."""

    earliest_ms: float
    latest_ms: float
    joules: float

    @property
    def ms(self) -> float:
        return (self.earliest_ms + self.latest_ms) / 2


def counter_updates(points: list[tuple[float, float]]) -> list[Update]:
    """Updates from (t_ms, joules) samples in time order: each sample whose value differs from the one before."""
    return [Update(prev[0], cur[0], cur[1]) for prev, cur in zip(points, points[1:]) if cur[1] != prev[1]]


def update_period_ms(updates: list[Update]) -> float | None:
    """The median interval between consecutive updates (None with fewer than two)."""
    if len(updates) < 2:
        return None
    return statistics.median(b.ms - a.ms for a, b in zip(updates, updates[1:]))


@dataclass(frozen=True)
class SpanEnergy:
    joules: float
    low_j: float
    high_j: float | None


@dataclass(frozen=True)
class PowerModel:
    """Power over time, consistent with the counter: piecewise constant, each update interval's energy spread over
    it evenly, or, where the device's busy window is known and begins or ends inside an interval, at the idle
    power over its idle part and the rest over its busy part (the idle power from the intervals wholly outside the
    busy window). Before the first update and after the last, the power of the piece next to them. Every span's
    energy is an integral of this one function, so spans that tile a window add up to it."""

    pieces: tuple[tuple[float, float, float], ...]  # (start_ms, end_ms, watts), contiguous
    idle_w: float | None = None

    @classmethod
    def build(cls, updates: list[Update], busy: tuple[float, float] | None = None) -> "PowerModel":
        intervals = [(a.ms, b.ms, b.joules - a.joules) for a, b in zip(updates, updates[1:])]
        idle_w = None
        if busy is not None:
            idle = [(t0, t1, e) for t0, t1, e in intervals if t1 <= busy[0] or t0 >= busy[1]]
            if idle:
                idle_w = sum(e for _, _, e in idle) / sum(t1 - t0 for t0, t1, _ in idle) * 1e3
        pieces = []
        for t0, t1, e in intervals:
            pieces.extend(_split(t0, t1, e, busy, idle_w))
        return cls(tuple(pieces), idle_w)

    def joules(self, a: float, b: float) -> float:
        if b <= a or not self.pieces:
            return 0.0
        total = sum(w * (min(b, t1) - max(a, t0)) for t0, t1, w in self.pieces if t1 > a and t0 < b)
        first, last = self.pieces[0], self.pieces[-1]
        total += first[2] * max(0.0, min(b, first[0]) - a)  # before the first update
        total += last[2] * max(0.0, b - max(a, last[1]))  # after the last
        return total / 1e3


def _split(t0: float, t1: float, joules: float, busy: tuple[float, float] | None, idle_w: float | None
           ) -> list[tuple[float, float, float]]:
    """One update interval as pieces of constant power (see PowerModel)."""
    even = [(t0, t1, joules / (t1 - t0) * 1e3)]
    if busy is None or idle_w is None:
        return even
    b0, b1 = max(t0, busy[0]), min(t1, busy[1])
    busy_ms = max(0.0, b1 - b0)
    if busy_ms in (0.0, t1 - t0):
        return even
    busy_w = (joules * 1e3 - idle_w * (t1 - t0 - busy_ms)) / busy_ms
    if busy_w < idle_w:  # the interval spent less than its idle part alone would: nothing to tell apart
        return even
    cuts = sorted({t0, b0, b1, t1})
    return [(x, y, busy_w if b0 <= x and y <= b1 else idle_w) for x, y in zip(cuts, cuts[1:]) if y > x]


def span_energy(updates: list[Update], a: float, b: float, model: PowerModel | None = None) -> SpanEnergy | None:
    """Energy over [a, b] ms with its bounds (see the module's docstring); None with fewer than two updates. The
    estimate is `model`'s integral (by default, power even over each update interval), kept inside the bounds."""
    if len(updates) < 2:
        return None
    model = model or PowerModel.build(updates)
    estimate = model.joules(a, b)
    inner_start = next((u for u in updates if u.earliest_ms >= a), None)
    inner_end = next((u for u in reversed(updates) if u.latest_ms <= b), None)
    low = 0.0
    if inner_start is not None and inner_end is not None and inner_end.joules > inner_start.joules:
        low = inner_end.joules - inner_start.joules
    outer_start = next((u for u in reversed(updates) if u.latest_ms <= a), None)
    outer_end = next((u for u in updates if u.earliest_ms >= b), None)
    high = outer_end.joules - outer_start.joules if outer_start is not None and outer_end is not None else None
    if high is not None:
        estimate = min(estimate, high)
    return SpanEnergy(max(estimate, low), low, high)


@dataclass(frozen=True)
class Work:
    """One unit of repeated work (a prefill, a decode step) and its tokens. Its span runs from the end of the unit
    before it to its own end, so that spans tile the run and the host's gaps count with the work they precede."""

    start_ms: float
    end_ms: float
    tokens: int


def _tokens_in(work: list[Work], a: float, b: float, mode: str) -> float:
    """Tokens done in [a, b]: "mid" assumes each unit progresses evenly over its span; "inside" counts only units
    wholly inside; "touching" every unit that overlaps it."""
    total = 0.0
    for w in work:
        if w.end_ms <= a or w.start_ms >= b:
            continue
        if mode == "touching":
            total += w.tokens
        elif mode == "inside":
            total += w.tokens if a <= w.start_ms and w.end_ms <= b else 0
        else:
            total += w.tokens * (min(b, w.end_ms) - max(a, w.start_ms)) / (w.end_ms - w.start_ms)
    return total


@dataclass(frozen=True)
class Rate:
    """Steady-state joules per token over whole counter intervals of a run of repeated work."""

    j_per_token: float
    low: float
    high: float | None  # None: no unit of work lies wholly inside the window
    joules: float  # over the window
    tokens: float  # done in the window (even progress within each unit)
    window_ms: tuple[float, float]
    intervals: list[float]  # joules per token in each counter interval of the window

    @property
    def rel_halfwidth(self) -> float:
        return (self.high - self.low) / 2 / self.j_per_token if self.high is not None else float("inf")

    @property
    def rel_spread(self) -> float:
        """Standard deviation of the per-interval values over their mean."""
        if len(self.intervals) < 2:
            return 0.0
        return statistics.stdev(self.intervals) / statistics.fmean(self.intervals)

    @property
    def rel_standard_error(self) -> float:
        return self.rel_spread / len(self.intervals) ** 0.5 if self.intervals else float("inf")


def steady_rate(updates: list[Update], work: list[Work]) -> Rate | None:
    """Joules per token of repeated work: the counter's difference between its first update surely after the work
    began and its last surely before it ended, over the tokens done between them. The bounds take the updates'
    instants anywhere in their sampling windows and count only the units wholly inside (high) or every unit
    touching (low). None when fewer than two updates lie inside the work."""
    if not work:
        return None
    inside = [u for u in updates if u.earliest_ms >= work[0].start_ms and u.latest_ms <= work[-1].end_ms]
    if len(inside) < 2:
        return None
    first, last = inside[0], inside[-1]
    joules = last.joules - first.joules
    tokens = _tokens_in(work, first.ms, last.ms, "mid")
    most = _tokens_in(work, first.earliest_ms, last.latest_ms, "touching")
    least = _tokens_in(work, first.latest_ms, last.earliest_ms, "inside")
    if tokens <= 0 or joules <= 0:
        return None
    per_interval = []
    for a, b in zip(inside, inside[1:]):
        n = _tokens_in(work, a.ms, b.ms, "mid")
        if n > 0:
            per_interval.append((b.joules - a.joules) / n)
    return Rate(joules / tokens, joules / most, joules / least if least > 0 else None, joules, tokens,
                (first.ms, last.ms), per_interval)


# --repeat: a steady-state run spans at least this many of the counter's update intervals (about 2 s on an H200), so
# that the instants of its two end updates (known to one polling interval) weigh little, and stops after MAX_S.
MIN_UPDATES = 20
TARGET = 0.05
MAX_S = 120.0
DEFAULT_PERIOD_MS = 100.0


def _run_prefills(engine, prompt: list[int], sampling: dict, repeats: int, min_s: float, now_ms) -> list[Work]:
    """The prompt prefilled alone (one output token), again and again, back to back."""
    params = engine.sampling_params(**{**sampling, "max_tokens": 1, "ignore_eos": True, "stop": ()})
    work, start = [], now_ms()
    previous = start
    while len(work) < repeats or (previous - start) / 1e3 < min_s:
        seq = engine.add_request(prompt, params)
        while not seq.finished:
            engine.step()
        end = now_ms()
        work.append(Work(previous, end, len(prompt)))
        previous = end
        if (end - start) / 1e3 > MAX_S:
            break
    return work


def _run_decode(engine, context: list[int], sampling: dict, steps: int, now_ms) -> list[Work]:
    """One sequence decoding `steps` tokens after `context`; each step's span runs from the token before it (the
    prefill's first) to its own, on the host."""
    params = engine.sampling_params(**{**sampling, "max_tokens": steps + 1, "ignore_eos": True, "stop": ()})
    seq = engine.add_request(context, params)
    while not seq.output_token_ids:
        engine.step()
    work, previous, seen = [], now_ms(), len(seq.output_token_ids)
    while not seq.finished:
        engine.step()
        now, n = now_ms(), len(seq.output_token_ids)
        if n > seen:
            work.append(Work(previous, now, n - seen))
            previous, seen = now, n
    return work


def _steady_record(phase: str, rate: Rate | None, work: list[Work], updates: int, context: tuple[int, int],
                   method: str):
    from ..anatomy import SteadyEnergy

    if rate is None:
        return None
    within = rate.rel_halfwidth <= TARGET and rate.rel_standard_error <= TARGET
    tokens = work[0].tokens
    return SteadyEnergy(phase, len(work), tokens, context[0], context[1], (work[-1].end_ms - work[0].start_ms) / 1e3,
                        rate.window_ms[1] - rate.window_ms[0], updates, rate.joules, rate.j_per_token, rate.low,
                        rate.high, rate.rel_spread, rate.rel_standard_error, within, TARGET, rate.intervals, method)


def measure_steady_energy(engine, prompt: list[int], context: list[int], sampling: dict, repeats: int,
                          period_ms: float | None, itl_ms: float | None, sampler) -> tuple[list, list[str]]:
    """`--repeat N`: J per prefill token and J per decode token in steady state. The prompt is prefilled N times
    back to back (and more, until the run spans MIN_UPDATES counter updates); then one sequence decodes from
    `context` (the call's prompt and output) at least N steps, as many as those updates take at the call's
    inter-token latency. `sampler` is a started-and-stoppable telemetry (GpuTelemetry). Returns the records and
    notes on what fell short."""
    import time

    period = period_ms or DEFAULT_PERIOD_MS
    min_s = (MIN_UPDATES + 2) * period / 1e3
    t0 = time.perf_counter_ns()

    def now_ms() -> float:
        return (time.perf_counter_ns() - t0) / 1e6

    notes = []
    room = min(engine.max_model_len, engine.pool.capacity_tokens) - len(context) - 1
    steps = max(repeats, int(min_s * 1e3 / itl_ms) + 1 if itl_ms else repeats)
    if steps > room:
        notes.append(f"--repeat: the decode run stops at {room} steps, the room left in the context and the KV pool "
                     f"after the call's {len(context)} tokens")
        steps = room
    sampler.start()
    prefills = _run_prefills(engine, prompt, sampling, repeats, min_s, now_ms)
    decodes = _run_decode(engine, context, sampling, steps, now_ms) if steps >= 1 else []
    samples = sampler.stop(t0 + int(now_ms() * 1e6))
    updates = counter_updates([((s.t_ns - t0) / 1e6, s.energy_mj / 1e3) for s in samples if s.energy_mj is not None])
    out = []
    for phase, work, ctx, method in (
            ("prefill", prefills, (len(prompt), len(prompt)),
             f"the prompt ({len(prompt)} tokens) prefilled alone, {len(prefills)} times back to back; the energy "
             f"counter's difference between its first update surely inside the run and its last, over the prompt "
             f"tokens prefilled between them (each prefill's span from the previous one's end, host gaps included)"),
            ("decode", decodes, (len(context) + 1, len(context) + len(decodes)),
             f"one sequence decoding {len(decodes)} steps from the call's context ({len(context)} tokens); the energy "
             f"counter's difference between its first update surely after the first token and its last surely "
             f"before the last token, over the steps between them")):
        inside = sum(1 for u in updates
                     if work and u.earliest_ms >= work[0].start_ms and u.latest_ms <= work[-1].end_ms)
        record = _steady_record(phase, steady_rate(updates, work), work, inside, ctx, method) if work else None
        if record is None:
            notes.append(f"--repeat: no steady-state {phase} figure: fewer than two energy-counter updates inside "
                         f"its run")
            continue
        if not record.within_target:
            width = ("unbounded above" if record.j_per_token_high is None else
                     f"+-{(record.j_per_token_high - record.j_per_token_low) / 2 / record.j_per_token:.1%}")
            notes.append(f"--repeat: the {phase} figure is not within {TARGET:.0%} (interval {width}, standard "
                         f"error {record.standard_error:.1%}): repeat with a larger N")
        out.append(record)
    return out, notes
