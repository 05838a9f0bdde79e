"""A local GPU's energy over a level, from NVML's energy counter (nvmlDeviceGetTotalEnergyConsumption, mJ
since the driver loaded, Volta and later): read at the level's start and end, so nothing is sampled in
between and no thread competes with the client's event loop. The counter updates every few tens of ms, a
small error against a level of seconds.

Only meaningful when the server runs on this machine: the runner reads it only then, or when --gpus names
devices explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnergyReading:
    t_s: float
    millijoules: dict[int, int]  # NVML index -> counter


class GpuEnergyMeter:
    """NVML's energy counters of some GPUs (NVML indices, not CUDA_VISIBLE_DEVICES' numbering)."""

    def __init__(self, nvml, handles: dict[int, object], names: dict[int, str]):
        self.nvml, self.handles, self.names = nvml, handles, names

    @classmethod
    def open(cls, indices: tuple[int, ...] | None) -> tuple[GpuEnergyMeter | None, str]:
        """The meter for `indices` (None: every GPU NVML sees), or None and why not."""
        try:
            import pynvml as nvml

            nvml.nvmlInit()
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, a driver mismatch...
            return None, f"no GPU energy: NVML is not available ({type(e).__name__}: {e})"
        try:
            count = nvml.nvmlDeviceGetCount()
            wanted = tuple(range(count)) if indices is None else indices
            missing = [i for i in wanted if not 0 <= i < count]
            if missing:
                nvml.nvmlShutdown()
                return None, f"no GPU energy: NVML sees {count} GPUs, not index {missing[0]} (--gpus)"
            handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in wanted}
            names = {i: _text(nvml.nvmlDeviceGetName(h)) for i, h in handles.items()}
            for i, h in handles.items():
                nvml.nvmlDeviceGetTotalEnergyConsumption(h)  # refuse now if a device has no counter
        except nvml.NVMLError as e:
            nvml.nvmlShutdown()
            return None, f"no GPU energy: NVML's energy counter is not readable ({e})"
        if not handles:
            nvml.nvmlShutdown()
            return None, "no GPU energy: NVML sees no GPU"
        return cls(nvml, handles, names), ""

    def read(self, t_s: float) -> EnergyReading:
        return EnergyReading(t_s, {i: self.nvml.nvmlDeviceGetTotalEnergyConsumption(h)
                                   for i, h in self.handles.items()})

    def close(self) -> None:
        self.nvml.nvmlShutdown()


def energy_view(start: EnergyReading, end: EnergyReading, names: dict[int, str], output_tokens: int) -> dict:
    """Joules per device and in all, mean power, and joules per output token over a level."""
    per_device = {i: (end.millijoules[i] - start.millijoules[i]) / 1e3 for i in start.millijoules}
    joules = sum(per_device.values())
    seconds = end.t_s - start.t_s
    return {
        "devices": [{"index": i, "name": names.get(i, ""), "energy_j": j} for i, j in per_device.items()],
        "energy_j": joules,
        "mean_power_w": joules / seconds if seconds > 0 else None,
        "j_per_output_token": joules / output_tokens if output_tokens else None,
    }


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
