"""The record's fields whose meaning the reports must state: energy with its interval, bytes modelled or measured,
and whether the memory is a GPU's or the host's. Read in one place, so both reports say the same thing.

Fields read beyond the required ones (each optional; absent or non-finite means "not in the record"):
  EnergyRecord.low_j, .high_j              the interval on `joules` (when the error is one-sided)
  EnergyRecord.per_token_low_j, _high_j    the same for `per_token_j` (else scaled from the call's interval)
  EnergyRecord.note                        e.g. that the phase is shorter than the counter's update period
  PrefillRecord.dram_bytes, DecodeStep.dram_bytes
                                           bytes measured by DRAM counters; `bytes` stays the cost model's
  MemoryCensus.kind                        "device" or "host"; else taken from DeviceRecord.type
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import finite
from . import units


@dataclass(frozen=True)
class EnergyReading:
    """One energy figure: its value and, where known, either a symmetric uncertainty or an interval."""

    phase: str
    joules: float | None
    low: float | None  # interval on joules, when one-sided or wider than the value
    high: float | None
    plus_minus: float | None  # symmetric uncertainty, used only where it is smaller than the value
    per_token: float | None
    per_token_low: float | None
    per_token_high: float | None
    method: str
    note: str  # e.g. that the phase is shorter than the counter's update period ("" when none)

    @property
    def range_text(self) -> str:
        if self.low is not None:
            return units.interval(self.low, self.high, "J")
        if self.plus_minus is not None:
            return f"± {units.sig(self.plus_minus, 2)} J"
        return ""

    @property
    def per_token_range_text(self) -> str:
        if self.per_token_low is not None:
            return units.interval(self.per_token_low, self.per_token_high, "J")
        return ""

    def text(self) -> str:
        """"539.8 J ± 1.6 J" or "3.58 J in [0, 81.3] J"."""
        value = units.joules(self.joules)
        if self.low is not None:
            return f"{value} in {self.range_text}"
        return f"{value} {self.range_text}".rstrip()


def energy_reading(e: Any) -> EnergyReading:
    j = finite(e.joules)
    per = finite(e.per_token_j)
    low, high = finite(getattr(e, "low_j", None)), finite(getattr(e, "high_j", None))
    u = finite(getattr(e, "uncertainty_j", None))
    plus_minus = None
    if low is None or high is None:
        low = high = None
        if u is not None and u > 0 and j is not None:
            if u < abs(j):
                plus_minus = u
            else:  # the error is larger than the value: energy is not negative, so the interval is one-sided
                low, high = max(0.0, j - u), j + u
    pt_low, pt_high = finite(getattr(e, "per_token_low_j", None)), finite(getattr(e, "per_token_high_j", None))
    if (pt_low is None or pt_high is None) and low is not None and per is not None and j:
        pt_low, pt_high = low * per / j, high * per / j  # per token = joules / tokens: the same scale
    if pt_low is None or pt_high is None:
        pt_low = pt_high = None
    return EnergyReading(e.phase, j, low, high, plus_minus, per, pt_low, pt_high, e.method,
                         str(getattr(e, "note", "") or ""))


@dataclass(frozen=True)
class BytesReading:
    """Bytes of a step: the cost model's always, the DRAM counters' where they were read."""

    modelled: float | None
    measured: float | None

    @property
    def source(self) -> str:
        return "measured" if self.measured is not None else "modelled"

    @property
    def value(self) -> float | None:
        return self.measured if self.measured is not None else self.modelled

    def text(self) -> str:
        """"15.22 GB modelled", or "15.23 GB measured (DRAM counters; 15.22 GB modelled)"."""
        if self.measured is None:
            return f"{units.size(self.modelled)} modelled"
        return f"{units.size(self.measured)} measured (DRAM counters; {units.size(self.modelled)} modelled)"


def bytes_reading(record: Any) -> BytesReading:
    return BytesReading(finite(record.bytes), finite(getattr(record, "dram_bytes", None)))


@dataclass(frozen=True)
class MemoryWords:
    """How to name the memory of the call's device: a GPU's own, or the host's RAM on the CPU."""

    host: bool
    noun: str  # "GPU memory" | "host memory"
    processor: str  # who ran the forward: "GPU" | "CPU"
    rows: tuple[tuple[str, str, int], ...]  # the census: (field, label, bytes), summing to the total


_DEVICE_ROWS = (("weights", "weights"), ("kv_pool", "KV pool"), ("cuda_graphs", "CUDA graphs"),
                ("other_allocated", "other tensors"), ("allocator_free", "allocator reserved, free"),
                ("context_and_other", "CUDA context, libraries and other processes"), ("free", "free"))
_HOST_ROWS = (("weights", "weights"), ("kv_pool", "KV pool"), ("cuda_graphs", "CUDA graphs"),
              ("other_allocated", "rest of this process"), ("allocator_free", "allocator reserved, free"),
              ("context_and_other", "other processes and the OS"), ("free", "available"))
_HOST_ONLY_IF_NONZERO = {"cuda_graphs", "allocator_free"}  # always 0 in a host census: no rows for them


def memory_words(a: Any) -> MemoryWords:
    kind = getattr(a.memory, "kind", None)
    host = kind == "host" if kind in ("host", "device") else a.device.type != "cuda"
    processor = "GPU" if a.device.type == "cuda" else (a.device.type or "host").upper()
    names = _HOST_ROWS if host else _DEVICE_ROWS
    rows = tuple((key, label, getattr(a.memory, key)) for key, label in names
                 if not (host and key in _HOST_ONLY_IF_NONZERO and not finite(getattr(a.memory, key))))
    return MemoryWords(host, "host memory" if host else "GPU memory", processor, rows)
