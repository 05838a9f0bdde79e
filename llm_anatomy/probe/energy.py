"""Energy from NVML's total-energy counter, with intervals that say what the counter can and cannot tell.

The counter (nvmlDeviceGetTotalEnergyConsumption, mJ) changes only every ~20-100 ms (about 100 ms on an H200).
A sample whose value differs from the sample before it shows an update, and the update happened between those
two samples: its instant is known to one polling interval. The first sample is not an update: its value may
have been set any time before it.

Energy over a span [a, b] is then read three ways:
- `joules`: the counter as a piecewise-linear function through its updates (power constant between two
  updates, interpolated at a and b);
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


def energy_at(updates: list[Update], t: float) -> float:
    """The counter at t, linear between updates; beyond the first or the last update, extended at the power of
    the interval next to it."""
    if len(updates) == 1:
        return updates[0].joules
    i = next((i for i, u in enumerate(updates) if u.ms >= t), len(updates) - 1)
    i = max(1, i)
    a, b = updates[i - 1], updates[i]
    return a.joules + (b.joules - a.joules) * (t - a.ms) / (b.ms - a.ms)


def span_energy(updates: list[Update], a: float, b: float) -> SpanEnergy | None:
    """Energy over [a, b] ms with its bounds (see the module's docstring); None with fewer than two updates."""
    if len(updates) < 2:
        return None
    estimate = max(0.0, energy_at(updates, b) - energy_at(updates, a))
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
    high: float
    joules: float  # over the window
    tokens: float  # done in the window (even progress within each unit)
    window_ms: tuple[float, float]
    intervals: list[float]  # joules per token in each counter interval of the window

    @property
    def rel_halfwidth(self) -> float:
        return (self.high - self.low) / 2 / self.j_per_token

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
    return Rate(joules / tokens, joules / most, joules / least if least > 0 else float("inf"), joules, tokens,
                (first.ms, last.ms), per_interval)
