"""Energy per token of one phase, from NVML's total-energy counter read between its own updates.

The counter changes only every ~20-100 ms. Between two updates it is exact, so a phase's energy is taken
over the intervals between consecutive updates that both fall inside the phase, and divided by the tokens
the phase processed between those same instants (tokens accrue linearly over each step). A phase shorter
than a couple of update periods has no such interval: the sweep then repeats it back to back (the same
prefill again and again, or a longer block of decode steps) until it lasts long enough. What remains
uncertain is when each update happened: it is seen at the first sample after it, up to one sampling period
late at each end of each stretch.
"""

from __future__ import annotations

import bisect
import statistics
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PhaseEnergy:
    joules_per_token: float
    uncertainty_j_per_token: float  # from the update instants' sampling lag (one sampling period per end)
    spread: float | None  # relative standard deviation of the per-interval J/token (None below 3 intervals)
    intervals: int  # counter intervals used
    seconds: float  # time they cover
    tokens: float  # tokens processed in them
    mean_power_w: float
    method: str

    def describe(self) -> dict:
        return asdict(self)


class TokenClock:
    """Tokens processed by a run as a function of host time: each step's tokens accrue evenly between the
    previous step's end (or the run's start) and its own end."""

    def __init__(self, start_ns: int, steps: list[tuple[int, int]]):
        """steps: (end_ns, tokens) in order of their ends."""
        self.ends = [start_ns] + [end for end, _ in steps]
        self.totals = [0]
        for _, tokens in steps:
            self.totals.append(self.totals[-1] + tokens)

    def at(self, t_ns: int) -> float:
        ends = self.ends
        if t_ns <= ends[0]:
            return 0.0
        if t_ns >= ends[-1]:
            return float(self.totals[-1])
        i = bisect.bisect_left(ends, t_ns)
        a, b = ends[i - 1], ends[i]
        f = (t_ns - a) / (b - a) if b > a else 1.0
        return self.totals[i - 1] + f * (self.totals[i] - self.totals[i - 1])


def counter_updates(samples) -> list[tuple[int, int]]:
    """(t_ns, mJ) at each sample where the counter had changed since the one before (the first sample is a
    reading, not an observed update)."""
    points = [(s.t_ns, s.energy_mj) for s in samples if s.energy_mj is not None]
    return [b for a, b in zip(points, points[1:]) if b[1] != a[1]]


def phase_energy(samples, spans: list[tuple[int, int]], tokens: TokenClock, sample_period_s: float,
                 what: str) -> PhaseEnergy | None:
    """J per token over the counter intervals lying wholly inside `spans` (host ns); None if there is none."""
    updates = counter_updates(samples)
    joules = seconds = processed = 0.0
    per_interval: list[float] = []
    stretches = 0
    for a, b in spans:
        inside = [u for u in updates if a <= u[0] <= b]
        if len(inside) < 2:
            continue
        stretches += 1
        for (t0, e0), (t1, e1) in zip(inside, inside[1:]):
            n = tokens.at(t1) - tokens.at(t0)
            j = (e1 - e0) / 1e3
            joules, seconds, processed = joules + j, seconds + (t1 - t0) / 1e9, processed + n
            if n > 0:
                per_interval.append(j / n)
    if processed <= 0 or seconds <= 0:
        return None
    per_token = joules / processed
    # each stretch's two ends are each seen up to one sampling period late: independent, so they add in quadrature
    relative = sample_period_s * (2 * stretches) ** 0.5 / seconds
    spread = (statistics.pstdev(per_interval) / statistics.fmean(per_interval)
              if len(per_interval) >= 3 and statistics.fmean(per_interval) > 0 else None)
    n = len(per_interval)
    return PhaseEnergy(per_token, per_token * relative, spread, n, seconds, processed, joules / seconds,
                       f"NVML total-energy counter between its updates inside the phase: {n} intervals over "
                       f"{seconds:.2f} s, {processed:.0f} tokens; {what}")


def wait_for_update_after(stream, t_ns: int, timeout_s: float = 0.6) -> None:
    """Let the telemetry stream see the energy counter change after `t_ns` (or give up after timeout_s), so that
    a window ending at t_ns has an update beyond its end."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        after = [s for s in stream.window(t_ns, t_ns + int(timeout_s * 1e9), margin_ns=0) if s.t_ns > t_ns]
        if len({s.energy_mj for s in after}) > 1:
            return
        time.sleep(0.02)
