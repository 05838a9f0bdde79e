"""The one clock: host perf_counter_ns, with CUDA events placed on it.

At start the device is synchronised and a reference event recorded; an event's time on the host clock is
then the reference's host time plus the GPU-measured interval between the two events. The alignment error
is the launch latency of the reference event (microseconds), far below anything reported.
"""

from __future__ import annotations

import time

import torch


class Clock:
    def __init__(self, device: torch.device, t0_ns: int | None = None):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record()
            self._ref_ns = time.perf_counter_ns()
        self.t0_ns = t0_ns if t0_ns is not None else time.perf_counter_ns()

    def at(self, t0_ns: int) -> "Clock":
        """The same clock (same device reference, no new sync) with its zero at `t0_ns`: one per request in a
        server, where a sync per request would stall the steps in flight."""
        other = Clock.__new__(Clock)
        other.__dict__.update(self.__dict__)
        other.t0_ns = t0_ns
        return other

    def __getstate__(self) -> dict:
        """A pickled copy (for the anatomy builder's process) keeps the host times and leaves the device reference
        event behind: a device event belongs to its process. The copy converts host times only; the device
        intervals it needs travel already read (StepMeasure.snapshot)."""
        state = dict(self.__dict__)
        state.pop("_ref", None)
        return state

    @property
    def age_s(self) -> float:
        """Seconds since the device reference was taken (host and device clocks drift apart by ppm)."""
        return (time.perf_counter_ns() - self._ref_ns) / 1e9 if self.cuda else 0.0

    def now_ns(self) -> int:
        return time.perf_counter_ns()

    def ms(self, t_ns: int) -> float:
        """Host time -> ms since the call began."""
        return (t_ns - self.t0_ns) / 1e6

    def event(self) -> torch.cuda.Event | None:
        """Record a device event now (None on the host: there the host clock is the device clock)."""
        if not self.cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    @property
    def reference_ns(self) -> int:
        """Host time of the device reference (shared by every `at` copy of this clock)."""
        return self._ref_ns

    def from_reference_ms(self, event: torch.cuda.Event) -> float:
        """Device ms from the reference to a recorded (and completed) event."""
        return self._ref.elapsed_time(event)

    def event_ms(self, event: torch.cuda.Event) -> float:
        """A recorded (and completed) event -> ms since the call began, on the host clock."""
        return self.ms(self._ref_ns) + self.from_reference_ms(event)
