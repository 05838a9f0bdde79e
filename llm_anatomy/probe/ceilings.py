"""The device's ceilings: what its datasheet promises, and what it does when measured.

Three ceilings bound one LLM call (see `anatomy.Ceilings`):

- read bandwidth: a read-only reduction over a buffer several times the last-level cache;
- GEMV bandwidth: batch-1 `F.linear` over bf16 weights that rotate so the cache cannot serve them,
  which is what a decode step does with every weight matrix;
- matmul rate: large bf16 matrix products on random data (never zeros: they run faster), back to back for
  seconds. Two rates come out: the burst (the first 0.1 s, before a GPU's power limit lowers its clocks) and
  the sustained rate (the median of the run's second half), which is MFU's denominator: a prefill of more than
  a few tens of milliseconds runs under the power limit too.

`measure` also watches for a device that is not idle (other processes on the GPU, repeats that disagree,
figures far below the datasheet's) and says why; `load_or_calibrate` keeps idle measurements per device in a
JSON cache, since they only change with the GPU, its driver, its power limit or the torch build, and never
caches a busy one. The datasheet figures (dense bf16, not the sparsity figure) come from the project's one GPU
table (`llm_anatomy.gpus`); an unknown GPU or a CPU has none, never a guess.

Units are decimal throughout: 1 GB/s = 1e9 bytes/s, 1 TFLOP/s = 1e12 FLOP/s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from ..anatomy import Ceilings
from ..disk_cache import cache_file, read_entries, write_entry
from ..gpus import Gpu, gpu_for_device

__all__ = [
    "Calibration", "MatmulRates", "Readings", "busy_reasons", "cache_path", "cached_ceilings", "calibrate",
    "datasheet_ceilings", "device_key", "device_name", "format_ceilings", "load_or_calibrate",
    "matmul_rates", "measure", "other_processes", "spread", "store_ceilings",
]

log = logging.getLogger(__name__)

CACHE_FORMAT = 2  # 2: the matmul rate is the sustained one, the burst beside it; keys carry the power limit
MAX_AGE = timedelta(days=30)  # an older calibration is measured again
BURST_S = 0.1  # the burst rate: batches that start within this long of the (warmed-up) run's start
MAX_SPREAD = 0.15  # repeats whose interquartile range exceeds this fraction of their median disagree
MIN_OF_DATASHEET = 0.4  # a ceiling below this fraction of the datasheet's is suspect
_GiB = 1 << 30
_MiB = 1 << 20

# ---------------------------------------------------------------------------------------------------
# Device identity
# ---------------------------------------------------------------------------------------------------


def _as_device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name") and ":" in line:
                    model = line.split(":", 1)[1].strip()
                    if model:
                        return model
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def device_name(device: torch.device | str) -> str:
    """The device's own name: the GPU's marketing name, or the CPU's model."""
    dev = _as_device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    if dev.type == "cpu":
        return _cpu_model()
    return dev.type


def _datasheet(device: torch.device | str) -> Gpu | None:
    """The GPU table's entry for this device (by the name torch gives it); None for a CPU or an unknown GPU."""
    dev = _as_device(device)
    return gpu_for_device(device_name(dev)) if dev.type == "cuda" else None


def _describe(device: torch.device, matmul_dtype: torch.dtype | None = None) -> str:
    if device.type != "cpu":
        return device_name(device)
    text = f"cpu: {_cpu_model()}, {torch.get_num_threads()} threads"
    if matmul_dtype is not None:
        text += f" ({_dtype_name(matmul_dtype)} matmul)"
    return text


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))


@contextlib.contextmanager
def _nvml(device: torch.device | None = None) -> Iterator[tuple[object, object] | None]:
    """(pynvml, the device's handle or None) inside nvmlInit/nvmlShutdown; None without NVML (no library, ROCm,
    a container without the driver's library)."""
    try:
        import pynvml  # nvidia-ml-py
        pynvml.nvmlInit()
    except Exception:
        yield None
        return
    try:
        handle = None
        if device is not None and device.type == "cuda":
            from .telemetry import _device_ids, _open

            try:
                handle = _open(pynvml, *reversed(_device_ids(device)))
            except Exception:  # a GPU NVML cannot name (a MIG slice seen through CUDA_VISIBLE_DEVICES...)
                handle = None
        yield pynvml, handle
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


@functools.lru_cache(maxsize=1)
def _driver_version() -> str | None:
    with _nvml() as nvml:
        if nvml is None:
            return None
        try:
            version = nvml[0].nvmlSystemGetDriverVersion()
        except Exception:
            return None
    return version.decode() if isinstance(version, bytes) else str(version)


def _power_limit_w(device: torch.device) -> float | None:
    """The enforced power limit: it bounds the sustained matmul rate, and an administrator can change it."""
    with _nvml(device) as nvml:
        if nvml is None or nvml[1] is None:
            return None
        try:
            return nvml[0].nvmlDeviceGetEnforcedPowerLimit(nvml[1]) / 1000
        except Exception:
            return None


def device_key(device: torch.device | str) -> str:
    """What the cached ceilings are keyed by: the hardware, its power limit, its driver or runtime, and torch."""
    dev = _as_device(device)
    if dev.type == "cuda":
        runtime = f"hip {torch.version.hip}" if getattr(torch.version, "hip", None) else f"cuda {torch.version.cuda}"
        driver = _driver_version() or "unknown"
        limit = _power_limit_w(dev)
        power = f"{limit:g} W limit" if limit is not None else "power limit unknown"
        return f"cuda | {device_name(dev)} | {power} | driver {driver} | {runtime} | torch {torch.__version__}"
    if dev.type == "cpu":
        return (f"cpu | {_cpu_model()} | {os.cpu_count()} cores | {torch.get_num_threads()} threads "
                f"| torch {torch.__version__}")
    return f"{dev.type} | torch {torch.__version__}"


def _gpu_process_ids(device: torch.device) -> list[int] | None:
    """The pids NVML lists with a context on this GPU (compute and graphics), or None if it cannot say."""
    with _nvml(device) as nvml:
        if nvml is None or nvml[1] is None:
            return None
        pynvml, handle = nvml
        pids: list[int] = []
        try:
            for query in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
                pids += [p.pid for p in query(handle)]
        except Exception:
            return None
    return pids


def other_processes(listed_pids: list[int], own_pid: int) -> int:
    """How many processes besides this one NVML lists on the GPU. This process holds a context there while it
    measures, so it is listed: by its own pid, or, in a container with its own pid namespace, under a pid this
    process cannot know, in which case one of the listed is this one all the same."""
    distinct = set(listed_pids)
    return len(distinct - {own_pid}) if own_pid in distinct else max(0, len(distinct) - 1)


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(fn: Callable[[], object], device: torch.device, warmup_s: float, min_calls: int) -> float:
    """Call fn until warmup_s has passed and min_calls were made; the mean seconds of one call."""
    _sync(device)
    start = time.perf_counter()
    done, chunk = 0, 1
    while True:
        for _ in range(chunk):
            fn()
        _sync(device)
        done += chunk
        elapsed = time.perf_counter() - start
        if done >= min_calls and elapsed >= warmup_s:
            return elapsed / done
        chunk = min(chunk * 2, 64)


def _timings(fn: Callable[[], object], device: torch.device, *, warmup_s: float, min_warmup: int,
             repeats: int, budget_s: float, min_repeats: int = 3) -> list[float]:
    """Seconds of each of `repeats` calls after warm-up (fewer when they would exceed budget_s).

    CUDA: each call sits between two events recorded back to back on the current stream, so a call
    is timed on the device and the host never waits inside the timed loop. CPU: perf_counter.
    """
    per_call = _warm_up(fn, device, warmup_s, min_warmup)
    n = max(min_repeats, min(repeats, int(budget_s / max(per_call, 1e-9))))
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record()
        for i in range(n):
            fn()
            events[i + 1].record()
        torch.cuda.synchronize(device)
        return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(n)]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _batches(fn: Callable[[], object], device: torch.device, run_s: float, calls: int) -> list[float]:
    """Back to back for run_s seconds, in batches of `calls` calls: each batch's seconds per call, in order.

    CUDA: one batch stays queued behind the one the host waits for, so the device never idles between them."""
    seconds: list[float] = []
    end = time.perf_counter() + run_s
    if device.type == "cuda":
        pairs, previous = [], None
        while True:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            stop.record()
            pairs.append((start, stop))
            if previous is not None:
                previous.synchronize()
            previous = stop
            if time.perf_counter() >= end:
                break
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) / 1e3 / calls for a, b in pairs]
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        seconds.append((time.perf_counter() - t0) / calls)
        if time.perf_counter() >= end:
            return seconds


def spread(values: list[float]) -> float:
    """Interquartile range over median: how far repeats of one measurement disagree (0 for fewer than 4)."""
    if len(values) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4)
    middle = statistics.median(values)
    return (q3 - q1) / middle if middle > 0 else 0.0


# ---------------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------------


def _llc_bytes(device: torch.device) -> int:
    """The last-level cache, as far as it can be read (0 if not)."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for index in base.glob("index*"):
            text = (index / "size").read_text().strip().upper()
            m = re.fullmatch(r"(\d+)([KMG]?)", text)
            if m:
                best = max(best, int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])
    except OSError:
        pass
    return best


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Random normal values without touching the global RNG. On the CPU a large tensor repeats a block
    of 2^19 random values (filling hundreds of MiB with randn takes seconds on two cores; bandwidth
    doesn't care whether values repeat)."""
    numel = math.prod(shape)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    if device.type == "cuda":
        return torch.randn(shape, dtype=dtype, device=device, generator=gen)
    block = 1 << 19
    if numel <= block or numel % block:
        return torch.randn(shape, dtype=dtype, generator=gen)
    out = torch.empty(numel // block, block, dtype=dtype)
    out.copy_(torch.randn(block, dtype=dtype, generator=gen).expand_as(out))
    return out.view(shape)


@dataclass
class _Plan:
    read_bytes: int
    gemv_shape: tuple[int, int]  # (out_features, in_features) of each weight matrix
    gemv_count: int
    matmul_sizes: tuple[int, ...]  # candidates; the CPU picks by a pilot run, the GPU takes the largest
    matmul_dtypes: tuple[torch.dtype, ...]
    matmul_run_s: float  # each dtype's run of back-to-back products
    matmul_batch_s: float  # one timed batch of them
    warmup_s: float
    budget_s: float  # per measurement's timed calls


def _plan(device: torch.device, quick: bool, read_bytes: int | None, gemv_bytes: int | None,
          matmul_n: int | None, matmul_s: float | None) -> _Plan:
    llc = _llc_bytes(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cap = max(64 * _MiB, free // 4)  # never take most of what is free
        read = read_bytes or min(max(512 * _MiB if quick else 2 * _GiB, 8 * llc), cap)
        shape = (12288, 4096)  # [out, in]: a fused QKV or gate/up projection of a 4096-wide model
        mat = shape[0] * shape[1] * 2
        target = gemv_bytes or min(max(384 * _MiB if quick else _GiB, 4 * llc), cap)
        sizes = (matmul_n,) if matmul_n else (8192,)
        # Seconds, not a burst: an H200 holds its boost clock for ~0.1 s of products, then its power limit
        # takes the clocks (and the rate) down; the second half of a 2 s run has settled.
        run_s = matmul_s or (2.0 if quick else 6.0)
        return _Plan(read, shape, max(1, math.ceil(target / mat)), sizes, (torch.bfloat16,), run_s, 0.01,
                     0.05 if quick else 0.2, 0.15 if quick else 0.5)
    read = read_bytes or min(max(256 * _MiB, 8 * llc) if quick else max(512 * _MiB, 16 * llc), 2 * _GiB)
    shape = (4096, 4096)
    mat = shape[0] * shape[1] * 2
    target = gemv_bytes or min(max(128 * _MiB if quick else 256 * _MiB, 4 * llc), 2 * _GiB)
    if gemv_bytes and gemv_bytes < 4 * mat:  # small sizes asked for (tests): smaller matrices
        side = max(64, int(math.sqrt(gemv_bytes / 8)) // 64 * 64)
        shape, mat = (side, side), side * side * 2
    sizes = (matmul_n,) if matmul_n else ((512, 1024) if quick else (512, 1024, 2048))
    run_s = matmul_s or (0.5 if quick else 1.5)
    return _Plan(read, shape, max(1, math.ceil(target / mat)), sizes, (torch.bfloat16, torch.float32), run_s, 0.03,
                 0.03 if quick else 0.1, 0.25 if quick else 0.8)


def _measure_read(device: torch.device, plan: _Plan) -> tuple[float, list[float]]:
    """(GB/s, each repeat's seconds)."""
    numel = max(1 << 20, plan.read_bytes // 2 // (1 << 19) * (1 << 19))
    x = _random((numel,), torch.bfloat16, device, seed=1)
    words = x.view(torch.float32)  # the same bytes; a float32 sum streams them a little faster than bf16
    times = _timings(words.sum, device, warmup_s=plan.warmup_s, min_warmup=3, repeats=50, budget_s=plan.budget_s)
    return x.numel() * x.element_size() / statistics.median(times) / 1e9, times  # the buffers go with this frame


def _measure_gemv(device: torch.device, plan: _Plan) -> tuple[float, list[float]]:
    """(GB/s, each repeat's seconds)."""
    out_f, in_f = plan.gemv_shape
    weights = [_random((out_f, in_f), torch.bfloat16, device, seed=10 + i) for i in range(plan.gemv_count)]
    vector = _random((1, in_f), torch.bfloat16, device, seed=2)

    def one_pass(weights=weights, vector=vector):
        for w in weights:
            F.linear(vector, w)

    fn: Callable[[], object] = one_pass
    graph = None
    if device.type == "cuda":
        # Replay the pass as a CUDA graph: the kernels then run back to back, as in a captured decode
        # step, and the ceiling is the GEMV kernels' rather than the host's launch rate.
        try:
            one_pass()
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                one_pass()
            fn = graph.replay
        except Exception:  # capture unsupported here: eager launches (a lower bound)
            graph, fn = None, one_pass
            torch.cuda.synchronize(device)

    times = _timings(fn, device, warmup_s=plan.warmup_s, min_warmup=2, repeats=30, budget_s=plan.budget_s)
    return sum(w.numel() * w.element_size() for w in weights) / statistics.median(times) / 1e9, times


@dataclass(frozen=True)
class MatmulRates:
    """One run of n^3 products back to back, in TFLOP/s: the burst (batches starting in the first BURST_S
    seconds) and the sustained rate (the median of the batches of the run's second half, by device time)."""

    dtype: torch.dtype
    n: int
    burst_tflops: float
    sustained_tflops: float
    settled_tflops: tuple[float, ...]  # the second half's batches
    run_s: float


def matmul_rates(seconds_per_call: list[float], flops_per_call: float, calls_per_batch: int, dtype: torch.dtype,
                 n: int) -> MatmulRates:
    """Burst and sustained rates from each batch's seconds per call, in the order the batches ran."""
    rates, starts, elapsed = [], [], 0.0
    for s in seconds_per_call:
        rates.append(flops_per_call / s / 1e12)
        starts.append(elapsed)
        elapsed += s * calls_per_batch
    burst = [r for r, t in zip(rates, starts) if t < BURST_S] or rates[:1]
    settled = [r for r, t in zip(rates, starts) if t >= elapsed / 2] or rates[-1:]
    return MatmulRates(dtype, n, statistics.median(burst), statistics.median(settled), tuple(settled), elapsed)


def _cpu_matmul_size(dtype: torch.dtype, sizes: tuple[int, ...], target_call_s: float) -> int:
    """The largest candidate size whose product takes at most target_call_s, by a pilot product."""
    pilot = sizes[0]
    a = _random((pilot, pilot), dtype, torch.device("cpu"), seed=3)
    b = _random((pilot, pilot), dtype, torch.device("cpu"), seed=4)
    torch.mm(a, b)
    t0 = time.perf_counter()
    torch.mm(a, b)
    rate = 2 * pilot ** 3 / max(time.perf_counter() - t0, 1e-9)
    return max([s for s in sizes if 2 * s ** 3 / rate <= target_call_s], default=pilot)


def _measure_matmul(device: torch.device, plan: _Plan) -> MatmulRates:
    """The best sustained rate over the plan's dtypes (the CPU tries bf16 and fp32; the GPU runs bf16)."""
    best: MatmulRates | None = None
    for dtype in plan.matmul_dtypes:
        n = plan.matmul_sizes[-1]
        if device.type == "cpu" and len(plan.matmul_sizes) > 1:
            n = _cpu_matmul_size(dtype, plan.matmul_sizes, target_call_s=plan.matmul_batch_s)
        a = _random((n, n), dtype, device, seed=3)
        b = _random((n, n), dtype, device, seed=4)
        out = torch.empty(n, n, dtype=dtype, device=device)
        product = functools.partial(torch.mm, a, b, out=out)
        per_call = _warm_up(product, device, warmup_s=0.03, min_calls=3)  # clocks ramp up; kernels chosen
        calls = max(1, round(plan.matmul_batch_s / per_call))
        seconds = _batches(product, device, plan.matmul_run_s, calls)
        a = b = out = None  # free before the next dtype's
        rates = matmul_rates(seconds, 2 * n ** 3, calls, dtype, n)
        if best is None or rates.sustained_tflops > best.sustained_tflops:
            best = rates
    return best


@dataclass(frozen=True)
class Readings:
    """What a calibration saw besides its figures, from which `busy_reasons` judges whether the device was idle."""

    other_processes: int | None = None  # other processes on the GPU (NVML), the most seen; None: unknown
    spreads: dict[str, float] = field(default_factory=dict)  # measurement -> its repeats' spread (see `spread`)
    of_datasheet: dict[str, float] = field(default_factory=dict)  # measurement -> measured / datasheet figure


def busy_reasons(readings: Readings) -> tuple[str, ...]:
    """Why the figures may be low, one clause each; empty when the device looked idle."""
    reasons = []
    if readings.other_processes:
        reasons.append(f"{readings.other_processes} other process(es) on the GPU (NVML)")
    for what, value in readings.spreads.items():
        if value > MAX_SPREAD:
            reasons.append(f"the {what} repeats disagree: their interquartile range is {value:.0%} of the median")
    for what, value in readings.of_datasheet.items():
        if value < MIN_OF_DATASHEET:
            reasons.append(f"the {what} is {value:.0%} of the datasheet's")
    return tuple(reasons)


@dataclass(frozen=True)
class Calibration:
    """Ceilings and how they were got: measured now or read from the cache, and whether the device was busy."""

    ceilings: Ceilings
    busy: tuple[str, ...] = ()  # why the figures may be low (see busy_reasons); empty: the device looked idle
    from_cache: bool = False
    quick: bool = False


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _finite_positive(value: float) -> float | None:
    return value if math.isfinite(value) and value > 0 else None


def _other_processes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    pids = _gpu_process_ids(device)
    return None if pids is None else other_processes(pids, os.getpid())


def measure(device: torch.device | str, quick: bool = False, *, read_bytes: int | None = None,
            gemv_bytes: int | None = None, matmul_n: int | None = None, matmul_s: float | None = None,
            progress: Callable[[str], None] | None = None) -> Calibration:
    """Measure this device's read bandwidth, GEMV bandwidth and matmul rates, and judge whether it was idle.

    GPU: bf16 throughout, timed with CUDA events after warm-up; read and GEMV are medians of repeats (the GEMV
    pass a replayed CUDA graph); the matmul runs 8192^3 products back to back for 2 s (quick) or 6 s. CPU:
    perf_counter; the matmul is run in bf16 and in fp32 and the faster kept, named in `device` (e.g. "cpu: ...,
    2 threads (fp32 matmul)"). `quick` uses smaller buffers and shorter runs; read_bytes, gemv_bytes, matmul_n
    and matmul_s (seconds of products per dtype) override the sizes (tests). `progress(text)` hears each stage.
    """
    dev = _as_device(device)
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"cannot calibrate a {dev.type!r} device: only cuda and cpu")
    say = progress or (lambda text: None)
    plan = _plan(dev, quick, read_bytes, gemv_bytes, matmul_n, matmul_s)
    ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with ctx, torch.inference_mode():
        try:
            # The matmul first, while the GPU is cool (its clocks ramp within the warm-up), then the
            # memory-bound measurements, which its raised clocks serve.
            say(f"calibrating: matrix products back to back ({plan.matmul_run_s * len(plan.matmul_dtypes):g} s)")
            matmul = _measure_matmul(dev, plan)
            others = _other_processes(dev)  # now this process holds a context on the GPU: see other_processes
            say("calibrating: read bandwidth")
            read, read_times = _measure_read(dev, plan)
            say("calibrating: GEMV bandwidth")
            gemv, gemv_times = _measure_gemv(dev, plan)
            later = _other_processes(dev)
        finally:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.empty_cache()  # give back the buffers' memory
    sheet = _datasheet(dev)
    ceilings = Ceilings(
        device=_describe(dev, matmul.dtype if dev.type == "cpu" else None),
        read_gbps=_finite_positive(read),
        gemv_gbps=_finite_positive(gemv),
        matmul_tflops=_finite_positive(matmul.sustained_tflops),
        datasheet_gbps=sheet.memory_gbps if sheet else None,
        datasheet_tflops=sheet.bf16_tflops if sheet else None,
        datasheet_source=sheet.source if sheet else "",
        measured_at=_now(),
        matmul_burst_tflops=_finite_positive(matmul.burst_tflops),
    )
    seen = [n for n in (others, later) if n is not None]
    of_sheet = {} if sheet is None else {
        "read bandwidth": read / sheet.memory_gbps, "GEMV bandwidth": gemv / sheet.memory_gbps,
        "sustained matmul rate": matmul.sustained_tflops / sheet.bf16_tflops}
    readings = Readings(max(seen) if seen else None,
                        {"read": spread(read_times), "GEMV": spread(gemv_times),
                         "sustained matmul": spread(list(matmul.settled_tflops))}, of_sheet)
    return Calibration(ceilings, busy_reasons(readings), quick=quick)


def calibrate(device: torch.device | str, quick: bool = False, **sizes) -> Ceilings:
    """`measure(...).ceilings`: the figures alone, busy or not (for benchmarks that judge that themselves)."""
    return measure(device, quick, **sizes).ceilings


def datasheet_ceilings(device: torch.device | str) -> Ceilings:
    """A record with the datasheet's figures only (None where the device has no datasheet)."""
    dev = _as_device(device)
    sheet = _datasheet(dev)
    return Ceilings(device=_describe(dev), read_gbps=None, gemv_gbps=None, matmul_tflops=None,
                    datasheet_gbps=sheet.memory_gbps if sheet else None,
                    datasheet_tflops=sheet.bf16_tflops if sheet else None,
                    datasheet_source=sheet.source if sheet else "", measured_at="")


# ---------------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------------


def cache_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """$XDG_CACHE_HOME/llm-anatomy/ceilings.json (~/.cache when unset), or cache_dir/ceilings.json."""
    return cache_file("ceilings.json", cache_dir)


_NUMBER_FIELDS = ("read_gbps", "gemv_gbps", "matmul_tflops", "matmul_burst_tflops", "datasheet_gbps",
                  "datasheet_tflops")


def _entry_to_ceilings(entry: dict) -> Ceilings | None:
    record = entry.get("ceilings")
    if not isinstance(record, dict) or not isinstance(record.get("device"), str):
        return None
    values: dict = {"device": record["device"]}
    for name in _NUMBER_FIELDS:
        v = record.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
            return None
        values[name] = float(v) if v is not None else None
    for name in ("datasheet_source", "measured_at"):
        v = record.get(name, "")
        if not isinstance(v, str):
            return None
        values[name] = v
    return Ceilings(**values)


def _is_fresh(measured_at: str, now: datetime) -> bool:
    try:
        when = datetime.fromisoformat(measured_at)
    except ValueError:
        return False
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return now - when <= MAX_AGE


def _with_current_datasheet(c: Ceilings, device: torch.device) -> Ceilings:
    """Datasheet fields come from this version's table, not from the cache (the table may be fixed)."""
    sheet = _datasheet(device)
    return dataclasses.replace(c, datasheet_gbps=sheet.memory_gbps if sheet else None,
                               datasheet_tflops=sheet.bf16_tflops if sheet else None,
                               datasheet_source=sheet.source if sheet else "")


def _cached_entry(device: torch.device, cache_dir, now: datetime | None = None) -> tuple[Ceilings, bool] | None:
    """(ceilings, quick) of this device's cached calibration if it is valid and fresh (MAX_AGE), else None."""
    entry = read_entries(cache_path(cache_dir), CACHE_FORMAT).get(device_key(device))
    if entry is None:
        return None
    c = _entry_to_ceilings(entry)
    if c is None or c.matmul_tflops is None or not _is_fresh(c.measured_at, now or datetime.now(timezone.utc)):
        return None
    return _with_current_datasheet(c, device), bool(entry.get("quick", False))


def cached_ceilings(device: torch.device | str, cache_dir: str | os.PathLike | None = None) -> Ceilings | None:
    """The cached calibration of this device if valid and fresh, or None; never measures."""
    found = _cached_entry(_as_device(device), cache_dir)
    return found[0] if found else None


def store_ceilings(device: torch.device | str, ceilings: Ceilings, cache_dir: str | os.PathLike | None = None,
                   *, quick: bool = False) -> Path:
    """Write one device's ceilings into the cache (other devices' entries kept; a corrupt file replaced)."""
    dev = _as_device(device)
    return write_entry(cache_path(cache_dir), CACHE_FORMAT, device_key(dev),
                       {"ceilings": dataclasses.asdict(ceilings), "quick": quick})


def load_or_calibrate(device: torch.device | str, cache_dir: str | os.PathLike | None = None,
                      recalibrate: bool = False, quick: bool = False,
                      progress: Callable[[str], None] | None = None) -> Calibration:
    """The cached calibration of this device if valid and fresh, else a new one, saved for next time if the
    device was idle. A busy measurement is returned (its `busy` says why) but never cached: a low ceiling would
    then inflate every later MFU and MBU.

    A quick calibration in the cache serves only quick requests; a full one serves both. `recalibrate`
    measures whatever the cache holds. A cache that cannot be written costs a warning, not the result.
    """
    dev = _as_device(device)
    if not recalibrate:
        found = _cached_entry(dev, cache_dir)
        if found is not None and (quick or not found[1]):
            return Calibration(found[0], from_cache=True, quick=found[1])
    result = measure(dev, quick=quick, progress=progress)
    if result.busy:
        log.warning("the %s was busy while calibrating (%s): its ceilings are not cached and MFU/MBU against them "
                    "may read high; `llm-anatomy calibrate` measures again when it is idle",
                    "GPU" if dev.type == "cuda" else "CPU", "; ".join(result.busy))
        return result
    try:
        store_ceilings(dev, result.ceilings, cache_dir, quick=quick)
    except OSError as e:
        log.warning("could not save the ceilings to %s: %s", cache_path(cache_dir), e)
    return result


# ---------------------------------------------------------------------------------------------------
# Display
# ---------------------------------------------------------------------------------------------------


def _gbps(v: float) -> str:
    return f"{v / 1000:.2f} TB/s" if v >= 1000 else f"{v:.1f} GB/s" if v >= 10 else f"{v:.3g} GB/s"


def _tflops(v: float) -> str:
    """TFLOP/s with at least three significant digits, however small (a CPU's 0.0512, never "0.0")."""
    decimals = 0 if v >= 100 else max(1, 2 - math.floor(math.log10(v))) if v > 0 else 1
    return f"{v:.{decimals}f} TFLOP/s"


def _line(label: str, measured: float | None, datasheet: float | None, fmt: Callable[[float], str],
          what: str = "") -> str:
    if measured is None and datasheet is None:
        return f"  {label:<18}not measured"
    if measured is None:
        return f"  {label:<18}not measured (datasheet {fmt(datasheet)})"
    text = f"  {label:<18}{fmt(measured):<16}"
    if datasheet:
        text += f"{measured / datasheet:.0%} of datasheet {fmt(datasheet)}"
    if what:
        text += f"{'; ' if datasheet else ''}{what}"
    return text.rstrip()


def format_ceilings(c: Ceilings) -> str:
    """A few lines for `llm-anatomy calibrate`: each measured ceiling against the datasheet's."""
    when = f"calibrated {c.measured_at}" if c.measured_at else "not calibrated: datasheet only"
    lines = [f"Ceilings of {c.device} ({when})",
             _line("read", c.read_gbps, c.datasheet_gbps, _gbps),
             _line("GEMV (batch 1)", c.gemv_gbps, c.datasheet_gbps, _gbps)]
    matmul = "fp32 matmul" if "fp32 matmul" in c.device else "bf16 matmul"
    lines.append(_line(matmul, c.matmul_tflops, c.datasheet_tflops, _tflops,
                       "sustained, MFU's denominator" if c.matmul_tflops else ""))
    if c.matmul_burst_tflops:
        lines.append(_line("  first 0.1 s", c.matmul_burst_tflops, c.datasheet_tflops, _tflops,
                           "the burst (a GPU's power limit lowers its clocks after it)"))
    ridge = c.ridge
    if ridge is not None:
        text = f"  {'ridge point':<18}{ridge:.0f} FLOP/byte"
        if c.read_gbps and c.matmul_tflops and c.datasheet_gbps and c.datasheet_tflops:
            text += f" (datasheet {c.datasheet_tflops * 1e3 / c.datasheet_gbps:.0f})"
        elif not (c.read_gbps and c.matmul_tflops):
            text += " (from the datasheet)"
        lines.append(text)
    lines.append(f"  datasheet: {c.datasheet_source}" if c.datasheet_source
                 else "  datasheet: none for this device (only measured ceilings)")
    lines.append("  units: decimal, 1 GB/s = 1e9 bytes/s, 1 TB/s = 1e12 bytes/s, 1 TFLOP/s = 1e12 FLOP/s")
    return "\n".join(lines)
