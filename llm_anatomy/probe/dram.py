"""DRAM bytes measured by Nsight Compute: the call's prefill and one decode step replayed in a child process.

`llm-anatomy call --dram` runs, when `ncu` is on PATH,

    ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum --profile-from-start off --clock-control none
        --csv --print-units base python -m llm_anatomy.probe.dram SPEC.json

The child builds the same engine (its EngineConfig, with a KV pool just large enough for the replay), warms the
replay's kernels up, then, inside `engine.eager()` (no CUDA graphs, no programmatic dependent launch, no
lookahead: each kernel its own launch), between cudaProfilerStart and cudaProfilerStop: the prompt's prefill,
a marker kernel (torch.cuda._sleep's `spin_kernel`) and one decode step. Nsight Compute counts each kernel's DRAM
reads and writes, starting each from a cold L2 (its default cache control); the parent parses the CSV, splits it
at the marker and sets the bytes by kernel category beside the cost model's.
"""

from __future__ import annotations

import csv
import gc
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ..anatomy import Anatomy, DramCategory, DramPhase, DramRecord, Roofline

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
MARKER = re.compile(r"\bspin_kernel\b")
UNITS = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
         "kibyte": 1 << 10, "mibyte": 1 << 20, "gibyte": 1 << 30}
REQUIRED_COLUMNS = ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")
TIMEOUT_S = 1800


@dataclass
class KernelBytes:
    name: str
    read: float = 0.0
    write: float = 0.0


def parse_ncu_csv(text: str) -> list[KernelBytes]:
    """Nsight Compute's --csv output (one row per kernel launch and metric; the application's own output and
    ==PROF== lines around it) -> each launch's DRAM bytes, in launch order."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if not lines:
        raise ValueError("no CSV rows in Nsight Compute's output")
    rows = csv.DictReader(lines)
    missing = [c for c in REQUIRED_COLUMNS if c not in (rows.fieldnames or [])]
    if missing:
        raise ValueError(f"Nsight Compute's CSV has no column {missing[0]!r}")
    launches: dict[str, KernelBytes] = {}
    for row in rows:
        metric = row["Metric Name"]
        if metric not in METRICS:
            continue
        launch = launches.setdefault(row["ID"], KernelBytes(row["Kernel Name"]))
        value = _bytes(row["Metric Value"], row["Metric Unit"])
        if metric == METRICS[0]:
            launch.read += value
        else:
            launch.write += value
    return list(launches.values())


def _bytes(value: str, unit: str) -> float:
    scale = UNITS.get(unit.strip().lower())
    if scale is None:
        raise ValueError(f"unknown unit {unit!r} for a DRAM byte count")
    try:
        return float(value.replace(",", "")) * scale
    except ValueError:
        raise ValueError(f"DRAM byte count {value!r} is not a number") from None


def split_at_marker(launches: list[KernelBytes]) -> tuple[list[KernelBytes], list[KernelBytes]]:
    """(prefill's kernels, the decode step's) on either side of the one marker kernel."""
    marks = [i for i, k in enumerate(launches) if MARKER.search(k.name)]
    if len(marks) != 1:
        raise ValueError(f"expected one marker kernel between the prefill and the decode step, found {len(marks)}")
    return launches[:marks[0]], launches[marks[0] + 1:]


def phase_record(phase: str, tokens: int, context_len: int, kernels: list[KernelBytes], modelled: dict[str, float]
                 ) -> DramPhase:
    """Measured bytes by kernel category (probe/kernels.py) beside the model's (`modelled`: category -> bytes)."""
    from .kernels import categorize

    read, write, count = defaultdict(float), defaultdict(float), defaultdict(int)
    by_name: dict[str, list] = {}
    for k in kernels:
        category = categorize(k.name)
        read[category] += k.read
        write[category] += k.write
        count[category] += 1
        entry = by_name.setdefault(k.name, [category, 0.0, 0.0, 0])
        entry[1] += k.read
        entry[2] += k.write
        entry[3] += 1
    categories = [DramCategory(c, count[c], read[c], write[c], modelled.get(c, 0.0))
                  for c in sorted(set(read) | set(modelled), key=lambda c: -(read[c] + write[c] + modelled.get(c, 0)))]
    top = sorted(by_name.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:12]
    return DramPhase(phase, tokens, context_len, sum(read.values()), sum(write.values()), sum(modelled.values()),
                     categories, [{"name": n[:160], "category": c, "read_bytes": r, "write_bytes": w, "count": n_}
                                  for n, (c, r, w, n_) in top])


def ncu_command(ncu: str, spec: Path) -> list[str]:
    return [ncu, "--metrics", ",".join(METRICS), "--profile-from-start", "off", "--clock-control", "none", "--csv",
            "--print-units", "base", sys.executable, "-m", "llm_anatomy.probe.dram", str(spec)]


@dataclass
class DramReplay:
    """What the child needs to replay a call, taken from the engine before it is let go (the child builds its own,
    and the device must hold both the parent's process and the child's copy of the weights)."""

    engine_settings: dict | None  # the engine's EngineConfig, as a dict (None: an engine built without one)
    prompt_token_ids: list[int]
    sampling: dict
    config: object  # the model's ModelConfig
    dtype: object  # torch.dtype
    shapes: object  # cost.KernelShapes
    device_type: str

    @classmethod
    def of(cls, engine, prompt_token_ids: list[int], sampling: dict) -> "DramReplay":
        from .cost import device_shapes

        config = getattr(engine, "engine_config", None)
        settings = dict(config.describe()) if config is not None else None
        if settings is not None:  # a pool for the replay alone: the prompt, its decode step, a block to spare
            settings["kv_cache_tokens"] = len(prompt_token_ids) + 2 * settings.get("block_size", 16)
        return cls(settings, list(prompt_token_ids), dict(sampling), engine.config, engine.dtype,
                   device_shapes(engine.device, engine.plan), engine.device.type)

    def measure(self, ncu: str | None = None, timeout_s: float = TIMEOUT_S, progress=None) -> DramRecord:
        """Run the replay under Nsight Compute; a record that says why not where it cannot. `progress(line)` is
        told when the (minutes long) replay starts."""
        ncu = ncu or shutil.which("ncu")
        if self.device_type != "cuda":
            return DramRecord(False, "DRAM bytes not measured: the call ran on the host, and Nsight Compute "
                                     "measures CUDA kernels; the bytes shown are the cost model's")
        if self.engine_settings is None:
            return DramRecord(False, "DRAM bytes not measured: this engine has no EngineConfig to rebuild it from in "
                                     "the replay's process; the bytes shown are the cost model's")
        if ncu is None:
            return DramRecord(False, "DRAM bytes not measured: Nsight Compute (ncu) is not on PATH; the bytes shown "
                                     "are the cost model's")
        free_device_memory()
        with tempfile.TemporaryDirectory(prefix="llm-anatomy-dram-") as tmp:
            spec = Path(tmp) / "replay.json"
            spec.write_text(json.dumps({"engine": self.engine_settings, "prompt_token_ids": self.prompt_token_ids,
                                        "sampling": self.sampling}))
            command = ncu_command(ncu, spec)
            shown = " ".join(command[:-1] + ["SPEC.json"])
            if progress is not None:
                progress("replaying the prefill and one decode step under Nsight Compute (minutes)")
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return DramRecord(False, f"DRAM bytes not measured: Nsight Compute's replay took over {timeout_s:.0f} "
                                         f"s", shown)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]
            return DramRecord(False, f"DRAM bytes not measured: Nsight Compute's replay failed (exit "
                                     f"{done.returncode}): {last[:300]}", shown)
        try:
            prefill, decode = split_at_marker(parse_ncu_csv(done.stdout))
        except ValueError as e:
            return DramRecord(False, f"DRAM bytes not measured: {e}", shown)
        return DramRecord(True, "Nsight Compute's DRAM read and write counters, kernel by kernel, each kernel from a "
                                "cold L2 (its default cache control), over an eager replay of the prefill and of "
                                "the decode step after it (no CUDA graphs, no programmatic dependent launch)", shown,
                          self.phases(prefill, decode))

    def phases(self, prefill: list[KernelBytes], decode: list[KernelBytes]) -> list[DramPhase]:
        from .cost import decode_cost, prefill_cost

        n = len(self.prompt_token_ids)
        modelled_prefill = prefill_cost(self.config, self.dtype, [(n, 0)], shapes=self.shapes)
        modelled_decode = decode_cost(self.config, self.dtype, [n + 1], shapes=self.shapes)
        return [phase_record("prefill", n, n, prefill, modelled_prefill.bytes_by_category()),
                phase_record("decode", 1, n + 1, decode, modelled_decode.bytes_by_category())]


def free_device_memory() -> None:
    """Give the caching allocator's memory back to the device once the engine is gone (start-up's heap was frozen,
    cli.settle_heap: collect it too), so that the child's engine fits."""
    import torch

    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def apply_dram(anatomy: Anatomy, record: DramRecord) -> None:
    """Put the measurement in the record and place the call's roofline points by measured bytes: the prefill by
    its replay's; the decode steps by the replayed step's, adjusted by the model for each step's context (its
    bytes + the steps x (measured - modelled) of the replayed step)."""
    anatomy.dram = record
    if not record.available:
        anatomy.notes.append(record.note)
        return
    phases = {p.phase: p for p in record.phases}
    if anatomy.prefill.batch_size == 1 and "prefill" in phases:
        _place(anatomy.prefill.roofline, phases["prefill"].measured_bytes, anatomy.ceilings.read_gbps)
    d = anatomy.decode
    if d is not None and d.roofline is not None and "decode" in phases and d.steps:
        step = phases["decode"]
        _place(d.roofline, d.roofline.bytes + d.steps * (step.measured_bytes - step.modelled_bytes),
               anatomy.ceilings.read_gbps)


def _place(line: Roofline, dram_bytes: float, read_gbps: float | None) -> None:
    line.dram_bytes = dram_bytes
    line.dram_intensity = line.flops / dram_bytes if dram_bytes else None
    line.dram_gbps = line.achieved_gbps * dram_bytes / line.bytes if line.bytes else None
    line.dram_mbu = line.dram_gbps / read_gbps if read_gbps and line.dram_gbps is not None else None


def _replay(spec_path: str) -> None:
    """The child: build the engine, warm the replay up, then replay it between cudaProfilerStart and Stop."""
    import torch

    from .. import Engine
    from ..engine.config import EngineConfig

    spec = json.loads(Path(spec_path).read_text())
    engine = Engine.from_config(EngineConfig(**spec["engine"]))
    params = engine.sampling_params(**{**spec["sampling"], "max_tokens": 2, "ignore_eos": True, "stop": ()})
    ids = spec["prompt_token_ids"]

    def run(profiled: bool) -> None:
        seq = engine.add_request(ids, params)
        if profiled:
            torch.cuda.synchronize(engine.device)
            torch.cuda.profiler.start()
        while not seq.output_token_ids:  # the prefill (its chunks, with a prompt longer than a step's budget)
            engine.step()
        if profiled:
            torch.cuda._sleep(1000)  # the marker between the phases (spin_kernel)
        while not seq.finished:  # the decode step
            engine.step()
        torch.cuda.synchronize(engine.device)
        if profiled:
            torch.cuda.profiler.stop()

    with engine.eager():
        run(profiled=False)  # compiles and plans for these shapes, outside the profiled region
        run(profiled=True)


if __name__ == "__main__":
    _replay(sys.argv[1])
