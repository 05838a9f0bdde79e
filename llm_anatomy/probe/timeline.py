"""A window of a running engine's work under torch.profiler: what the GPU ran, and how long it had nothing to run.

A served call's anatomy times its own steps; what it cannot see is the device between steps while hundreds of calls
come and go (the host's per-step work, intake, prefills cut into decode). `ProfileWindow` records whatever the
engine does between `start` and `stop` (the server's POST /start_profile and /stop_profile, vLLM's names), writes
the Chrome trace (chrome://tracing, Perfetto) and sums it up: the device's busy time as the union of its kernels'
and copies' intervals, its idle time and the part of it in gaps long enough to be the host's, kernel time by
category (kernels.categorize). A window is cut at `max_s`: the profiler keeps every event in memory. On a GPU only
the device's activity is recorded (and the runtime calls that launched it); on a CPU, the host's ops.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ..errors import AnatomyError
from .kernels import categorize

PROFILE_MAX_S = 30.0  # a longer window is cut here (tens of thousands of kernels a second, all held in memory)
HOST_GAP_US = 50.0  # idle stretches at least this long count as gaps (a launch's own latency is a few us)


class ProfileError(AnatomyError):
    """A profile asked for in the wrong state (one already running, none to stop)."""


def device_summary(intervals: list[tuple[int, int, str]], window_ns: int) -> dict:
    """The device's share of a window from its activities' (start_ns, end_ns, name): busy time as the union of the
    intervals (concurrent kernels count once), idle time, the idle time in gaps of at least HOST_GAP_US and how
    many, and each category's summed kernel time (concurrent kernels each count: it can exceed busy)."""
    busy_ns = gaps_ns = gaps = 0
    end = None
    for start, stop, _ in sorted(intervals):
        if end is None or start > end:
            if end is not None and start - end >= HOST_GAP_US * 1e3:
                gaps_ns += start - end
                gaps += 1
            busy_ns += stop - start
            end = stop
        elif stop > end:
            busy_ns += stop - end
            end = stop
    by_category: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for start, stop, name in intervals:
        kind = categorize(name)
        by_category[kind] += (stop - start) / 1e6
        counts[kind] += 1
    busy_ms, window_ms = busy_ns / 1e6, window_ns / 1e6
    return {"window_ms": window_ms, "activities": len(intervals), "busy_ms": busy_ms,
            "idle_ms": max(0.0, window_ms - busy_ms), "busy_share": busy_ms / window_ms if window_ms > 0 else None,
            "idle_in_gaps_ms": gaps_ns / 1e6, "gaps": gaps, "gap_min_us": HOST_GAP_US,
            "category_ms": {c: round(ms, 3) for c, ms in sorted(by_category.items(), key=lambda kv: -kv[1])},
            "category_count": dict(counts)}


class ProfileWindow:
    """torch.profiler over whatever this process runs between `start` and `stop`, one window at a time; each stop
    writes `directory/NAME-TIME.json.gz` and returns the summary."""

    def __init__(self, directory: str | Path, device: torch.device, name: str = "engine",
                 max_s: float = PROFILE_MAX_S):
        if not max_s > 0:
            raise ValueError(f"a profile window needs max_s > 0, got {max_s}")
        self.directory, self.device, self.name, self.max_s = Path(directory), torch.device(device), name, max_s
        self._prof: profile | None = None
        self._started_ns = self._ended_ns = 0

    @property
    def running(self) -> bool:
        """Collecting now (started, not stopped, not cut at max_s)."""
        return self._prof is not None and not self._ended_ns

    @property
    def has_window(self) -> bool:
        """Started and not yet stopped (collecting, or cut and waiting for `stop`)."""
        return self._prof is not None

    @property
    def expired(self) -> bool:
        return self.running and time.perf_counter_ns() - self._started_ns > self.max_s * 1e9

    def start(self) -> dict:
        if self._prof is not None:
            raise ProfileError("a profile is already running: POST /stop_profile first")
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)  # the window holds what is launched from now on
        # On a GPU the device's activity alone (kernels, copies, and the CUDA runtime's calls that launched them):
        # recording every host op too lengthens the host's work a step (benchmarks/README.md), and the device
        # waiting for the host is what a window is there to see.
        prof = profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU])
        prof.start()
        self._prof, self._started_ns, self._ended_ns = prof, time.perf_counter_ns(), 0
        return {"status": "started", "max_s": self.max_s}

    def cut(self) -> None:
        """Stop collecting (the window is over) and keep what was collected for `stop`."""
        if self.running:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the window's kernels end inside it
            self._ended_ns = time.perf_counter_ns()  # before the profiler's own flush, which can take seconds
            self._prof.stop()

    def discard(self) -> None:
        """Forget the window (after a failure): collection stopped if it can be, nothing written."""
        prof, self._prof, self._ended_ns = self._prof, None, 0
        if prof is not None:
            try:
                prof.stop()
            except Exception:  # noqa: BLE001 - stopped already, or the profiler is broken: nothing to keep
                pass

    def stop(self) -> dict:
        """End the window (if max_s has not), write its trace and sum it up: the slow part (seconds for a busy
        window), which may run on another thread than start's and cut's."""
        if self._prof is None:
            raise ProfileError("no profile is running: POST /start_profile first")
        self.cut()
        prof, started, ended = self._prof, self._started_ns, self._ended_ns
        self._prof = None
        return self._summary(prof, started, ended)

    def _summary(self, prof: profile, started: int, ended: int) -> dict:
        events = prof.profiler.kineto_results.events() if prof.profiler is not None else []
        device = [(e.start_ns(), e.start_ns() + e.duration_ns(), e.name()) for e in events
                  if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0]
        host_events = sum(1 for e in events if e.device_type() == torch.autograd.DeviceType.CPU)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}-{started % 10**6:06d}.json.gz"
        prof.export_chrome_trace(str(path))
        window_ns = ended - started
        return {"trace": str(path), "seconds": window_ns / 1e9, "cut_at_max": window_ns > self.max_s * 1e9,
                "host_events": host_events,
                "device": device_summary(device, window_ns) if self.device.type == "cuda" else None}
