"""The GPU datasheet table the planner predicts for (gpus.json, each number with its source)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from ..errors import AnatomyError

GIB = 1 << 30


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    memory_gb: float  # the vendor's figure, binary GB (see memory_bytes)
    memory_gbps: float  # GB/s, 1e9 B/s
    bf16_tflops: float  # dense
    fp8_tflops: float | None  # dense; None: no fp8 tensor cores
    power_w: float
    source: str
    aliases: tuple[str, ...] = ()
    ceilings_key: str | None = None  # the same GPU in probe/ceilings.py's DATASHEETS

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes: vendors sell it in binary GB (an H200's 141 GB are 150.1e9 B to torch,
        less the little the driver keeps)."""
        return int(self.memory_gb * GIB)

    def matmul_tflops(self, quantization: str | None) -> float:
        """The dense rate the linear layers run at: fp8 tensor cores for fp8 weights and activations."""
        if quantization == "fp8":
            if self.fp8_tflops is None:
                raise AnatomyError(f"{self.name} has no fp8 tensor cores: plan it with --quantization bf16")
            return self.fp8_tflops
        return self.bf16_tflops

    def describe(self) -> dict:
        return {"key": self.key, "name": self.name, "memory_gb": self.memory_gb, "memory_gbps": self.memory_gbps,
                "bf16_tflops": self.bf16_tflops, "fp8_tflops": self.fp8_tflops, "power_w": self.power_w,
                "source": self.source}


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "", name.lower())


@cache
def gpus() -> dict[str, Gpu]:
    text = resources.files("llm_anatomy.sweep").joinpath("gpus.json").read_text()
    table = {}
    for key, v in json.loads(text).items():
        if key.startswith("_"):
            continue
        table[key] = Gpu(key, v["name"], float(v["memory_gb"]), float(v["memory_gbps"]), float(v["bf16_tflops"]),
                         None if v["fp8_tflops"] is None else float(v["fp8_tflops"]), float(v["power_w"]),
                         v["source"], tuple(v.get("aliases", ())), v.get("ceilings_key"))
    return table


def lookup_gpu(name: str) -> Gpu:
    """A GPU by its key or an alias, case, spaces and dashes ignored; refused with the known list."""
    wanted = _norm(name)
    for gpu in gpus().values():
        if wanted in {_norm(gpu.key), *map(_norm, gpu.aliases)}:
            return gpu
    raise AnatomyError(f"unknown GPU {name!r}; known: {', '.join(gpus())}")


def gpu_for_device(device_name: str | None) -> Gpu | None:
    """The table's entry for a device as torch names it (through the ceilings' name matching), or None."""
    from ..probe.ceilings import lookup_datasheet

    sheet = lookup_datasheet(device_name)
    if sheet is None:
        return None
    return next((g for g in gpus().values() if g.ceilings_key == sheet.key), None)
