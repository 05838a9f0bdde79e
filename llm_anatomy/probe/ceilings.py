"""The device's ceilings: what its datasheet promises, and what it does when measured.

Three ceilings bound one LLM call (see `anatomy.Ceilings`):

- read bandwidth: a read-only reduction over a buffer several times the last-level cache;
- GEMV bandwidth: batch-1 `F.linear` over bf16 weights that rotate so the cache cannot serve them,
  which is what a decode step does with every weight matrix;
- matmul rate: a large bf16 matrix product on random data (never zeros: they run faster).

`calibrate` measures them; `load_or_calibrate` keeps them per device in a JSON cache, since they
only change with the GPU, its driver or the torch build. The datasheet table gives the vendor's
figures (dense bf16, not the sparsity figure) for known GPUs; an unknown GPU or a CPU has none,
never a guess.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import platform
import re
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from ..anatomy import Ceilings
from ..disk_cache import cache_file, read_entries, write_entry

__all__ = [
    "DATASHEETS", "GpuDatasheet", "cache_path", "cached_ceilings", "calibrate", "datasheet_ceilings",
    "device_key", "device_name", "format_ceilings", "load_or_calibrate", "lookup_datasheet", "store_ceilings",
]

CACHE_FORMAT = 1
_GiB = 1 << 30
_MiB = 1 << 20


# ---------------------------------------------------------------------------------------------------
# Datasheets
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuDatasheet:
    """One GPU's vendor figures.

    `aliases` are token sets: an entry matches a device name when every token of one alias appears
    among the name's tokens (upper-cased, split on anything not a letter or digit), and none of
    `excludes` does. The most specific match (the alias with the most tokens) wins; a tie between
    two entries is ambiguous and gives no datasheet.
    """

    key: str
    name: str
    aliases: tuple[str, ...]
    memory_gbps: float  # GB/s, 1e9 bytes per second
    bf16_dense_tflops: float  # dense bf16 tensor-core rate with fp32 accumulation, no sparsity
    memory_gb: float
    source: str
    excludes: tuple[str, ...] = ()


DATASHEETS: tuple[GpuDatasheet, ...] = (
    GpuDatasheet(
        "h100-sxm", "NVIDIA H100 SXM5 80GB", ("H100 80GB HBM3", "H100 SXM5 80GB", "H100 SXM 80GB"),
        3350.0, 989.4, 80.0,
        "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): 80 GB HBM3, 3.35 TB/s; BF16 Tensor Core "
        "1,979 TFLOPS with sparsity, so 989 dense (989.4 in the NVIDIA H100 architecture whitepaper)",
        excludes=("PCIE", "NVL")),
    GpuDatasheet(
        "h100-pcie", "NVIDIA H100 PCIe", ("H100 PCIE",),
        2000.0, 756.5, 80.0,
        "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe): 80 GB HBM2e, 2 TB/s; BF16 Tensor Core "
        "1,513 TFLOPS with sparsity, so 756.5 dense"),
    GpuDatasheet(
        "h100-nvl", "NVIDIA H100 NVL", ("H100 NVL",),
        3900.0, 835.5, 94.0,
        "NVIDIA H100 Tensor Core GPU datasheet (H100 NVL, per GPU): 94 GB HBM3, 3.9 TB/s; BF16 Tensor "
        "Core 1,671 TFLOPS with sparsity, so 835.5 dense"),
    GpuDatasheet(
        "h200-sxm", "NVIDIA H200 SXM", ("H200", "H200 SXM"),
        4800.0, 989.4, 141.0,
        "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): 141 GB HBM3e, 4.8 TB/s; BF16 Tensor Core "
        "1,979 TFLOPS with sparsity, so 989 dense (the H100 SXM's compute)",
        excludes=("NVL", "PCIE")),
    GpuDatasheet(
        "h200-nvl", "NVIDIA H200 NVL", ("H200 NVL",),
        4800.0, 835.5, 141.0,
        "NVIDIA H200 Tensor Core GPU datasheet (H200 NVL): 141 GB HBM3e, 4.8 TB/s; BF16 Tensor Core "
        "1,671 TFLOPS with sparsity, so 835.5 dense"),
    GpuDatasheet(
        "a100-sxm-40gb", "NVIDIA A100 SXM4 40GB", ("A100 SXM4 40GB", "A100 SXM 40GB"),
        1555.0, 312.0, 40.0,
        "NVIDIA A100 Tensor Core GPU datasheet (A100 40GB SXM): 40 GB HBM2, 1,555 GB/s; BF16 Tensor "
        "Core 312 TFLOPS dense (624 with sparsity)"),
    GpuDatasheet(
        "a100-sxm-80gb", "NVIDIA A100 SXM4 80GB", ("A100 SXM4 80GB", "A100 SXM 80GB"),
        2039.0, 312.0, 80.0,
        "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): 80 GB HBM2e, 2,039 GB/s; BF16 Tensor "
        "Core 312 TFLOPS dense (624 with sparsity)"),
    GpuDatasheet(
        "a100-pcie-40gb", "NVIDIA A100 PCIe 40GB", ("A100 PCIE 40GB",),
        1555.0, 312.0, 40.0,
        "NVIDIA A100 Tensor Core GPU datasheet (A100 40GB PCIe): 40 GB HBM2, 1,555 GB/s; BF16 Tensor "
        "Core 312 TFLOPS dense (624 with sparsity)"),
    GpuDatasheet(
        "a100-pcie-80gb", "NVIDIA A100 PCIe 80GB", ("A100 PCIE 80GB",),
        1935.0, 312.0, 80.0,
        "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB PCIe): 80 GB HBM2e, 1,935 GB/s; BF16 Tensor "
        "Core 312 TFLOPS dense (624 with sparsity)"),
    GpuDatasheet(
        "l40s", "NVIDIA L40S", ("L40S",),
        864.0, 362.05, 48.0,
        "NVIDIA L40S GPU datasheet: 48 GB GDDR6, 864 GB/s; BF16 Tensor Core 362.05 TFLOPS dense "
        "(733 with sparsity)"),
    GpuDatasheet(
        "l4", "NVIDIA L4", ("L4",),
        300.0, 121.0, 24.0,
        "NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6, 300 GB/s; BF16 Tensor Core 242 TFLOPS with "
        "sparsity, so 121 dense"),
    GpuDatasheet(
        "rtx-4090", "NVIDIA GeForce RTX 4090", ("RTX 4090",),
        1008.0, 165.2, 24.0,
        "NVIDIA Ada Lovelace GPU architecture whitepaper (GeForce RTX 4090): 24 GB GDDR6X, 1,008 GB/s; "
        "peak BF16 Tensor TFLOPS with FP32 accumulate 165.2 dense (330.4 with sparsity)",
        excludes=("D", "LAPTOP", "MOBILE")),
    GpuDatasheet(
        "b200", "NVIDIA B200", ("B200",),
        8000.0, 2250.0, 180.0,
        "NVIDIA DGX B200 / HGX B200 datasheets, per GPU (the 8-GPU system's figures divided by 8): "
        "1,440 GB HBM3e and 64 TB/s in all, so 180 GB and 8 TB/s; FP16/BF16 Tensor Core 36 PFLOPS "
        "with sparsity, so 2,250 TFLOPS dense per GPU"),
    GpuDatasheet(
        "mi300x", "AMD Instinct MI300X", ("MI300X",),
        5300.0, 1307.4, 192.0,
        "AMD Instinct MI300X accelerator data sheet: 192 GB HBM3, 5.3 TB/s peak; peak BF16 matrix "
        "1,307.4 TFLOPS dense (2,614.9 with sparsity)"),
)

# Tokens that make any match wrong: a MIG slice has a fraction of the whole GPU's ceilings.
_GLOBAL_EXCLUDES = frozenset({"MIG"})


def _tokens(name: str) -> frozenset[str]:
    return frozenset(t for t in re.split(r"[^A-Z0-9]+", name.upper()) if t)


def lookup_datasheet(name: str | None) -> GpuDatasheet | None:
    """The table entry for a device name as `torch.cuda.get_device_name()` gives it, or None.

    None when nothing matches, when the name is a MIG slice, or when two entries match equally well.
    """
    if not name:
        return None
    tokens = _tokens(name)
    if tokens & _GLOBAL_EXCLUDES:
        return None
    best: list[tuple[int, GpuDatasheet]] = []
    for sheet in DATASHEETS:
        if tokens & set(sheet.excludes):
            continue
        scores = [len(a) for a in map(_tokens, sheet.aliases) if a <= tokens]
        if scores:
            best.append((max(scores), sheet))
    if not best:
        return None
    top = max(score for score, _ in best)
    winners = {sheet.key: sheet for score, sheet in best if score == top}
    return next(iter(winners.values())) if len(winners) == 1 else None


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


def _describe(device: torch.device, matmul_dtype: torch.dtype | None = None) -> str:
    if device.type != "cpu":
        return device_name(device)
    text = f"cpu: {_cpu_model()}, {torch.get_num_threads()} threads"
    if matmul_dtype is not None:
        text += f" ({_dtype_name(matmul_dtype)} matmul)"
    return text


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))


@functools.lru_cache(maxsize=1)
def _driver_version() -> str | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML (ROCm, a container without the library): the runtime version stands in
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def device_key(device: torch.device | str) -> str:
    """What the cached ceilings are keyed by: the hardware, its driver or runtime, and torch."""
    dev = _as_device(device)
    if dev.type == "cuda":
        runtime = f"hip {torch.version.hip}" if getattr(torch.version, "hip", None) else f"cuda {torch.version.cuda}"
        driver = _driver_version() or "unknown"
        return f"cuda | {device_name(dev)} | driver {driver} | {runtime} | torch {torch.__version__}"
    if dev.type == "cpu":
        return (f"cpu | {_cpu_model()} | {os.cpu_count()} cores | {torch.get_num_threads()} threads "
                f"| torch {torch.__version__}")
    return f"{dev.type} | torch {torch.__version__}"


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], object], device: torch.device, *, warmup_s: float, min_warmup: int,
                    repeats: int, budget_s: float, min_repeats: int = 3) -> float:
    """Median time of one `fn()` after warm-up, in seconds.

    CUDA: each call sits between two events recorded back to back on the current stream, so a call
    is timed on the device and the host never waits inside the timed loop. CPU: perf_counter.
    The number of timed calls is `repeats`, fewer when the warm-up says they would exceed budget_s.
    """
    _sync(device)
    start = time.perf_counter()
    done, chunk = 0, 1
    while True:
        for _ in range(chunk):
            fn()
        _sync(device)
        done += chunk
        elapsed = time.perf_counter() - start
        if done >= min_warmup and elapsed >= warmup_s:
            break
        chunk = min(chunk * 2, 64)
    per_call = elapsed / done
    n = max(min_repeats, min(repeats, int(budget_s / max(per_call, 1e-9))))

    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record()
        for i in range(n):
            fn()
            events[i + 1].record()
        torch.cuda.synchronize(device)
        times = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(n)]
    else:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    warmup_s: float
    budget_s: float  # per measurement's timed calls


def _plan(device: torch.device, quick: bool, read_bytes: int | None, gemv_bytes: int | None,
          matmul_n: int | None) -> _Plan:
    llc = _llc_bytes(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cap = max(64 * _MiB, free // 4)  # never take most of what is free
        read = read_bytes or min(max(512 * _MiB if quick else 2 * _GiB, 8 * llc), cap)
        shape = (12288, 4096)  # [out, in]: a fused QKV or gate/up projection of a 4096-wide model
        mat = shape[0] * shape[1] * 2
        target = gemv_bytes or min(max(384 * _MiB if quick else _GiB, 4 * llc), cap)
        sizes = (matmul_n,) if matmul_n else (8192,)
        return _Plan(read, shape, max(1, math.ceil(target / mat)), sizes, (torch.bfloat16,),
                     0.05 if quick else 0.2, 0.15 if quick else 0.5)
    read = read_bytes or min(max(256 * _MiB, 8 * llc) if quick else max(512 * _MiB, 16 * llc), 2 * _GiB)
    shape = (4096, 4096)
    mat = shape[0] * shape[1] * 2
    target = gemv_bytes or min(max(128 * _MiB if quick else 256 * _MiB, 4 * llc), 2 * _GiB)
    if gemv_bytes and gemv_bytes < 4 * mat:  # small sizes asked for (tests): smaller matrices
        side = max(64, int(math.sqrt(gemv_bytes / 8)) // 64 * 64)
        shape, mat = (side, side), side * side * 2
    sizes = (matmul_n,) if matmul_n else ((512, 1024) if quick else (512, 1024, 2048))
    return _Plan(read, shape, max(1, math.ceil(target / mat)), sizes, (torch.bfloat16, torch.float32),
                 0.03 if quick else 0.1, 0.25 if quick else 0.8)


def _measure_read(device: torch.device, plan: _Plan) -> float:
    numel = max(1 << 20, plan.read_bytes // 2 // (1 << 19) * (1 << 19))
    x = _random((numel,), torch.bfloat16, device, seed=1)
    words = x.view(torch.float32)  # the same bytes; a float32 sum streams them a little faster than bf16
    seconds = _median_seconds(words.sum, device, warmup_s=plan.warmup_s, min_warmup=3,
                              repeats=50, budget_s=plan.budget_s)
    return x.numel() * x.element_size() / seconds / 1e9  # the buffers go with this frame


def _measure_gemv(device: torch.device, plan: _Plan) -> float:
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

    seconds = _median_seconds(fn, device, warmup_s=plan.warmup_s, min_warmup=2, repeats=30,
                              budget_s=plan.budget_s)
    return sum(w.numel() * w.element_size() for w in weights) / seconds / 1e9


def _measure_matmul(device: torch.device, plan: _Plan) -> tuple[float, torch.dtype]:
    """Best (TFLOP/s, dtype) over the plan's dtypes; on the CPU the size comes from a pilot run."""
    best: tuple[float, torch.dtype] = (0.0, plan.matmul_dtypes[0])
    target_call_s = 0.03 if plan.budget_s < 0.5 else 0.1
    for dtype in plan.matmul_dtypes:
        n = plan.matmul_sizes[-1]
        if device.type == "cpu" and len(plan.matmul_sizes) > 1:
            pilot = plan.matmul_sizes[0]
            a = _random((pilot, pilot), dtype, device, seed=3)
            b = _random((pilot, pilot), dtype, device, seed=4)
            torch.mm(a, b)
            t0 = time.perf_counter()
            torch.mm(a, b)
            rate = 2 * pilot ** 3 / max(time.perf_counter() - t0, 1e-9)
            n = pilot
            for size in plan.matmul_sizes:
                if 2 * size ** 3 / rate <= target_call_s:
                    n = size
        a = _random((n, n), dtype, device, seed=3)
        b = _random((n, n), dtype, device, seed=4)
        if device.type == "cuda":
            # A burst, as a call's prefill is: after ~0.1 s of back-to-back products a GPU can drop its
            # clocks under its power limit (an H200: 1980 -> ~1440 MHz, 770 -> 660 TFLOP/s).
            seconds = _median_seconds(functools.partial(torch.mm, a, b), device, warmup_s=0.03, min_warmup=3,
                                      repeats=10, budget_s=1.0)
        else:
            seconds = _median_seconds(functools.partial(torch.mm, a, b), device, warmup_s=plan.warmup_s,
                                      min_warmup=3,
                                      repeats=20, budget_s=plan.budget_s)
        a = b = None  # free before the next dtype's
        tflops = 2 * n ** 3 / seconds / 1e12
        if tflops > best[0]:
            best = (tflops, dtype)
    return best


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _finite_positive(value: float) -> float | None:
    return value if math.isfinite(value) and value > 0 else None


def calibrate(device: torch.device | str, quick: bool = False, *, read_bytes: int | None = None,
              gemv_bytes: int | None = None, matmul_n: int | None = None) -> Ceilings:
    """Measure this device's read bandwidth, GEMV bandwidth and matmul rate.

    GPU: bf16 throughout, timed with CUDA events after warm-up, median of repeats (under a second
    on an H200 once CUDA is up); the matmul is a short burst (an 8192^3 product, 10 timed), the
    GEMV pass a replayed CUDA graph. CPU: perf_counter; the matmul is measured in bf16 and fp32 and
    the faster is kept, named in `device` (e.g. "cpu: ..., 2 threads (fp32 matmul)").
    `quick` uses smaller buffers and shorter budgets; read_bytes, gemv_bytes and matmul_n override
    the sizes (tests).
    """
    dev = _as_device(device)
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"cannot calibrate a {dev.type!r} device: only cuda and cpu")
    plan = _plan(dev, quick, read_bytes, gemv_bytes, matmul_n)
    ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with ctx, torch.inference_mode():
        try:
            # The matmul first, while the GPU is cool (its clocks ramp within the warm-up), then the
            # memory-bound measurements, which its raised clocks serve.
            tflops, dtype = _measure_matmul(dev, plan)
            read = _measure_read(dev, plan)
            gemv = _measure_gemv(dev, plan)
        finally:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.empty_cache()  # give back the buffers' memory
    sheet = lookup_datasheet(device_name(dev)) if dev.type == "cuda" else None
    return Ceilings(
        device=_describe(dev, dtype if dev.type == "cpu" else None),
        read_gbps=_finite_positive(read),
        gemv_gbps=_finite_positive(gemv),
        matmul_tflops=_finite_positive(tflops),
        datasheet_gbps=sheet.memory_gbps if sheet else None,
        datasheet_tflops=sheet.bf16_dense_tflops if sheet else None,
        datasheet_source=sheet.source if sheet else "",
        measured_at=_now(),
    )


def datasheet_ceilings(device: torch.device | str) -> Ceilings:
    """A record with the datasheet's figures only (None where the device has no datasheet)."""
    dev = _as_device(device)
    sheet = lookup_datasheet(device_name(dev)) if dev.type == "cuda" else None
    return Ceilings(device=_describe(dev), read_gbps=None, gemv_gbps=None, matmul_tflops=None,
                    datasheet_gbps=sheet.memory_gbps if sheet else None,
                    datasheet_tflops=sheet.bf16_dense_tflops if sheet else None,
                    datasheet_source=sheet.source if sheet else "", measured_at="")


# ---------------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------------


def cache_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """$XDG_CACHE_HOME/llm-anatomy/ceilings.json (~/.cache when unset), or cache_dir/ceilings.json."""
    return cache_file("ceilings.json", cache_dir)


_NUMBER_FIELDS = ("read_gbps", "gemv_gbps", "matmul_tflops", "datasheet_gbps", "datasheet_tflops")


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


def _with_current_datasheet(c: Ceilings, device: torch.device) -> Ceilings:
    """Datasheet fields come from this version's table, not from the cache (the table may be fixed)."""
    sheet = lookup_datasheet(device_name(device)) if device.type == "cuda" else None
    return dataclasses.replace(c, datasheet_gbps=sheet.memory_gbps if sheet else None,
                               datasheet_tflops=sheet.bf16_dense_tflops if sheet else None,
                               datasheet_source=sheet.source if sheet else "")


def _cached_entry(device: torch.device, cache_dir) -> tuple[Ceilings, bool] | None:
    entry = read_entries(cache_path(cache_dir), CACHE_FORMAT).get(device_key(device))
    if entry is None:
        return None
    c = _entry_to_ceilings(entry)
    if c is None:
        return None
    return _with_current_datasheet(c, device), bool(entry.get("quick", False))


def cached_ceilings(device: torch.device | str, cache_dir: str | os.PathLike | None = None) -> Ceilings | None:
    """The cached calibration of this device, or None; never measures."""
    found = _cached_entry(_as_device(device), cache_dir)
    return found[0] if found else None


def store_ceilings(device: torch.device | str, ceilings: Ceilings, cache_dir: str | os.PathLike | None = None,
                   *, quick: bool = False) -> Path:
    """Write one device's ceilings into the cache (other devices' entries kept; a corrupt file replaced)."""
    dev = _as_device(device)
    return write_entry(cache_path(cache_dir), CACHE_FORMAT, device_key(dev),
                       {"ceilings": dataclasses.asdict(ceilings), "quick": quick})


def load_or_calibrate(device: torch.device | str, cache_dir: str | os.PathLike | None = None,
                      recalibrate: bool = False, quick: bool = False) -> Ceilings:
    """The cached ceilings of this device, else a fresh calibration, saved for next time.

    A quick calibration in the cache serves only quick requests; a full one serves both.
    A cache that cannot be written costs a warning, not the result.
    """
    dev = _as_device(device)
    if not recalibrate:
        found = _cached_entry(dev, cache_dir)
        if found is not None and (quick or not found[1]):
            return found[0]
    c = calibrate(dev, quick=quick)
    try:
        store_ceilings(dev, c, cache_dir, quick=quick)
    except OSError as e:
        warnings.warn(f"could not save the ceilings to {cache_path(cache_dir)}: {e}", stacklevel=2)
    return c


# ---------------------------------------------------------------------------------------------------
# Display
# ---------------------------------------------------------------------------------------------------


def _gbps(v: float) -> str:
    return f"{v / 1000:.2f} TB/s" if v >= 1000 else f"{v:.1f} GB/s" if v >= 10 else f"{v:.2f} GB/s"


def _tflops(v: float) -> str:
    if v >= 100:
        return f"{v:.0f} TFLOP/s"
    if v >= 1:
        return f"{v:.1f} TFLOP/s"
    return f"{v * 1000:.0f} GFLOP/s"


def _line(label: str, measured: float | None, datasheet: float | None, fmt: Callable[[float], str]) -> str:
    if measured is None and datasheet is None:
        return f"  {label:<16}not measured"
    if measured is None:
        return f"  {label:<16}not measured (datasheet {fmt(datasheet)})"
    text = f"  {label:<16}{fmt(measured):<14}"
    if datasheet:
        text += f"({measured / datasheet:.0%} of datasheet {fmt(datasheet)})"
    return text.rstrip()


def format_ceilings(c: Ceilings) -> str:
    """A few lines for `llm-anatomy calibrate`: each measured ceiling against the datasheet's."""
    when = f"calibrated {c.measured_at}" if c.measured_at else "not calibrated: datasheet only"
    lines = [f"Ceilings of {c.device} ({when})",
             _line("read", c.read_gbps, c.datasheet_gbps, _gbps),
             _line("GEMV (batch 1)", c.gemv_gbps, c.datasheet_gbps, _gbps)]
    matmul = "fp32 matmul" if "fp32 matmul" in c.device else "bf16 matmul"
    lines.append(_line(matmul, c.matmul_tflops, c.datasheet_tflops, _tflops))
    ridge = c.ridge
    if ridge is not None:
        text = f"  {'ridge point':<16}{ridge:.0f} FLOP/byte"
        if c.read_gbps and c.matmul_tflops and c.datasheet_gbps and c.datasheet_tflops:
            text += f" (datasheet {c.datasheet_tflops * 1e3 / c.datasheet_gbps:.0f})"
        elif not (c.read_gbps and c.matmul_tflops):
            text += " (from the datasheet)"
        lines.append(text)
    lines.append(f"  datasheet: {c.datasheet_source}" if c.datasheet_source
                 else "  datasheet: none for this device (only measured ceilings)")
    return "\n".join(lines)

