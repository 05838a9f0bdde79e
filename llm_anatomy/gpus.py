"""The GPU datasheet table (data/gpus.json, each figure with its source), read by both of its users: the probe
(the datasheet ceilings of the device a call runs on, found by the name torch gives it) and the planner (the GPU
`llm-anatomy plan --gpu` names). An unknown GPU has no entry, never a guess.

Units are decimal: memory_gbps in GB/s (1e9 B/s), rates in TFLOP/s (1e12 FLOP/s), dense (never the sparsity figure).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from .errors import AnatomyError

__all__ = ["GIB", "Gpu", "gpu_for_device", "gpus", "lookup_gpu"]

GIB = 1 << 30
# Tokens that make any device-name match wrong: a MIG slice has a fraction of the whole GPU's ceilings.
_GLOBAL_EXCLUDES = frozenset({"MIG"})


@dataclass(frozen=True)
class Gpu:
    """One GPU's vendor figures.

    `aliases`: what `plan --gpu` accepts besides the key. `device_names`: token sets matched against the name torch
    gives the device (see `gpu_for_device`), with `device_excludes` the tokens that rule the entry out.
    """

    key: str
    name: str
    memory_gb: float  # the vendor's figure, binary GB (see memory_bytes)
    memory_gbps: float  # GB/s, 1e9 B/s
    bf16_tflops: float  # dense bf16 tensor-core rate with fp32 accumulation
    fp8_tflops: float | None  # dense; None: no fp8 tensor cores
    power_w: float  # the board's maximum power
    source: str
    aliases: tuple[str, ...] = ()
    device_names: tuple[str, ...] = ()
    device_excludes: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes: vendors sell it in binary GB (an H200's 141 GB are 141 x 2^30 bytes; torch
        sees a little less, which the driver keeps)."""
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


@cache
def gpus() -> dict[str, Gpu]:
    """The table, by key, in the file's order."""
    text = resources.files("llm_anatomy").joinpath("data/gpus.json").read_text()
    return {key: Gpu(key, v["name"], float(v["memory_gb"]), float(v["memory_gbps"]), float(v["bf16_tflops"]),
                     None if v["fp8_tflops"] is None else float(v["fp8_tflops"]), float(v["power_w"]), v["source"],
                     tuple(v["aliases"]), tuple(v["device_names"]), tuple(v.get("device_excludes", ())))
            for key, v in json.loads(text).items() if not key.startswith("_")}


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "", name.lower())


def lookup_gpu(name: str) -> Gpu:
    """A GPU by its key or an alias, case, spaces and dashes ignored; refused with the known list."""
    wanted = _norm(name)
    for gpu in gpus().values():
        if wanted in {_norm(gpu.key), *map(_norm, gpu.aliases)}:
            return gpu
    raise AnatomyError(f"unknown GPU {name!r}; known: {', '.join(gpus())}")


def _tokens(name: str) -> frozenset[str]:
    return frozenset(t for t in re.split(r"[^A-Z0-9]+", name.upper()) if t)


def gpu_for_device(device_name: str | None) -> Gpu | None:
    """The entry for a device name as `torch.cuda.get_device_name()` gives it, or None.

    An entry matches when every token of one of its `device_names` appears among the name's tokens (upper-cased,
    split on anything not a letter or digit) and none of its `device_excludes` does. The most specific match (the
    most tokens) wins; None when nothing matches, when two entries tie, or when the name is a MIG slice.
    """
    if not device_name:
        return None
    tokens = _tokens(device_name)
    if tokens & _GLOBAL_EXCLUDES:
        return None
    scored = []
    for gpu in gpus().values():
        if tokens & set(gpu.device_excludes):
            continue
        scores = [len(names) for names in map(_tokens, gpu.device_names) if names <= tokens]
        if scores:
            scored.append((max(scores), gpu))
    if not scored:
        return None
    top = max(score for score, _ in scored)
    winners = [gpu for score, gpu in scored if score == top]
    return winners[0] if len(winners) == 1 else None
