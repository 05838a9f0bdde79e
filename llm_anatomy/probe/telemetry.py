"""GPU counters through NVML (nvidia-ml-py), sampled in a separate process.

A separate process, not a thread: a Python thread polling ~10 NVML calls at 100 Hz would contend for the
engine's GIL and slow the very decode steps it watches. Timestamps are time.perf_counter_ns(), which is
CLOCK_MONOTONIC on Linux and so shared with the engine's clock across processes.

This module must not import torch at the top: the sampler process imports it and should start fast.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass

THROTTLE_REASONS = {  # nvmlClocksEventReason* bits
    0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
    0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks",
}


@dataclass(frozen=True)
class RawSample:
    t_ns: int
    power_mw: int | None
    energy_mj: int | None
    sm_mhz: int | None
    mem_mhz: int | None
    gpu_util: int | None
    mem_util: int | None
    mem_used: int | None
    temperature_c: int | None
    throttle_mask: int | None

    @property
    def throttle(self) -> list[str]:
        mask = self.throttle_mask or 0
        return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


def _read(nvml, handle) -> RawSample:
    def get(fn, *args):
        try:
            return fn(handle, *args)
        except nvml.NVMLError:
            return None

    util = get(nvml.nvmlDeviceGetUtilizationRates)
    memory = get(nvml.nvmlDeviceGetMemoryInfo)
    reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return RawSample(
        time.perf_counter_ns(),
        get(nvml.nvmlDeviceGetPowerUsage),
        get(nvml.nvmlDeviceGetTotalEnergyConsumption),
        get(nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM),
        get(nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_MEM),
        util.gpu if util else None, util.memory if util else None,
        memory.used if memory else None,
        get(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU),
        get(reasons),
    )


def _open(nvml, uuid: str | None, index: int):
    if uuid:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(uuid)
        except nvml.NVMLError:
            pass
    return nvml.nvmlDeviceGetHandleByIndex(index)


# Before a measured window and after it the sampler waits for two updates of the energy counter: one on each
# side of the window, and a whole update interval outside it, which gives the idle power the energy model uses
# (probe/energy.py PowerModel). At most COUNTER_WAIT_S each: a few update intervals (~100 ms on an H200).
COUNTER_WAIT_S = 1.0
UPDATES_AROUND = 2


def _sample_until_updates(nvml, handle, samples: list, interval_s: float, after_ns: int, deadline: float,
                          updates: int = UPDATES_AROUND) -> None:
    """Append samples until `updates` changes of the energy counter are seen between samples taken at or after
    `after_ns` (so each surely happened after that instant), or until `deadline` (perf_counter seconds)."""
    seen = 0
    while seen < updates and time.perf_counter() < deadline:
        last = samples[-1]
        time.sleep(interval_s)
        samples.append(_read(nvml, handle))
        if last.energy_mj is None or samples[-1].energy_mj is None:
            return  # no counter on this device: nothing to wait for
        if last.t_ns >= after_ns and samples[-1].energy_mj != last.energy_mj:
            seen += 1


def _sampler_main(conn, uuid: str | None, index: int, interval_s: float) -> None:
    """Sample until told to stop. Before saying ready, wait for counter updates (the window then starts after
    known ones); when told to stop at an instant, keep sampling until the counter has updated after it (a tail)."""
    import pynvml as nvml

    nvml.nvmlInit()
    handle = _open(nvml, uuid, index)
    samples = [_read(nvml, handle)]
    _sample_until_updates(nvml, handle, samples, interval_s, samples[0].t_ns, time.perf_counter() + COUNTER_WAIT_S)
    conn.send("ready")
    next_t = time.perf_counter()
    while not conn.poll():
        next_t += interval_s
        time.sleep(max(0.0, next_t - time.perf_counter()))
        samples.append(_read(nvml, handle))
    _, end_ns = conn.recv()
    _sample_until_updates(nvml, handle, samples, interval_s, end_ns, time.perf_counter() + COUNTER_WAIT_S)
    conn.send(samples)
    nvml.nvmlShutdown()


def _stream_main(conn, uuid: str | None, index: int, interval_s: float, send_every_s: float) -> None:
    """Sample until told to stop, sending the samples in small batches as they come."""
    import pynvml as nvml

    nvml.nvmlInit()
    handle = _open(nvml, uuid, index)
    conn.send("ready")
    batch, next_t = [], time.perf_counter()
    next_send = next_t + send_every_s
    while not conn.poll():
        batch.append(_read(nvml, handle))
        if time.perf_counter() >= next_send:
            conn.send(batch)
            batch, next_send = [], next_send + send_every_s
        next_t += interval_s
        time.sleep(max(0.0, next_t - time.perf_counter()))
    nvml.nvmlShutdown()


def nvml_status(device) -> tuple[bool, str]:
    """Whether NVML can watch this torch device, and if not, why (said in the report instead of zeros)."""
    if device.type != "cuda":
        return False, f"no GPU counters: the call ran on the {device.type}, which NVML does not see"
    try:
        import pynvml as nvml

        nvml.nvmlInit()
        nvml.nvmlShutdown()
    except Exception as e:  # ImportError, NVMLError_LibraryNotFound, driver mismatch...
        return False, f"no GPU counters: NVML is not available ({type(e).__name__}: {e})"
    return True, ""


def _device_ids(device) -> tuple[int, str | None]:
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    return index, (f"GPU-{uuid}" if uuid and not uuid.startswith("GPU-") else (uuid or None))


def _spawn(target, args: tuple):
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(child, *args), daemon=True, name="llm-anatomy-nvml")
    process.start()
    if not conn.poll(60) or conn.recv() != "ready":
        process.kill()
        raise RuntimeError("the NVML sampler process did not start")
    return process, conn


class GpuTelemetry:
    """Samples one GPU at `hz` from start() to stop(), in a child process, with energy-counter updates before the
    window (start returns after them) and after it (stop waits for them)."""

    def __init__(self, device, hz: float = 100.0):
        self.hz = hz
        self.index, self.uuid = _device_ids(device)
        self._process = None
        self._conn = None

    def start(self) -> None:
        self._process, self._conn = _spawn(_sampler_main, (self.uuid, self.index, 1.0 / self.hz))

    def stop(self, end_ns: int | None = None) -> list[RawSample]:
        """The samples, through the first counter update after `end_ns` (default: now), the window's end."""
        if self._process is None:
            return []
        self._conn.send(("stop", end_ns if end_ns is not None else time.perf_counter_ns()))
        samples = self._conn.recv() if self._conn.poll(30) else []
        self._process.join(5)
        self._process = None
        return samples


class TelemetryStream:
    """Samples one GPU for as long as a server runs, keeping the last `keep_s` seconds: each request's
    anatomy takes the samples of its own time window, and /metrics the latest."""

    def __init__(self, device, hz: float = 50.0, keep_s: float = 600.0):
        self.hz = hz
        self.index, self.uuid = _device_ids(device)
        self._samples: collections.deque[RawSample] = collections.deque(maxlen=int(hz * keep_s))
        self._lock = threading.Lock()
        self._process = None
        self._conn = None

    def start(self) -> None:
        self._process, self._conn = _spawn(_stream_main, (self.uuid, self.index, 1.0 / self.hz, 0.05))
        threading.Thread(target=self._receive, daemon=True, name="llm-anatomy-nvml-reader").start()

    def _receive(self) -> None:
        while True:
            try:
                batch = self._conn.recv()  # blocks without holding the GIL
            except (EOFError, OSError):
                return
            with self._lock:
                self._samples.extend(batch)

    def latest_ns(self) -> int:
        with self._lock:
            return self._samples[-1].t_ns if self._samples else 0

    def latest(self) -> RawSample | None:
        with self._lock:
            return self._samples[-1] if self._samples else None

    def window(self, t0_ns: int, t1_ns: int, margin_ns: int = 300_000_000) -> list[RawSample]:
        """Samples from `margin_ns` before t0 to `margin_ns` after t1 (the energy counter is interpolated
        between its updates, so each end needs an update beyond it)."""
        low, high = t0_ns - margin_ns, t1_ns + margin_ns
        out = []
        with self._lock:  # newest first, stopping at the window's start: the deque holds `keep_s` of samples
            # (30,000 at 50 Hz), and a busy server takes a window for each of a hundred calls a second, under the
            # interpreter lock its step loop needs
            for s in reversed(self._samples):
                if s.t_ns < low:
                    break
                if s.t_ns <= high:
                    out.append(s)
        out.reverse()
        return out

    def stop(self) -> None:
        if self._process is None:
            return
        try:
            self._conn.send("stop")
        except OSError:
            pass
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
        self._process = None
