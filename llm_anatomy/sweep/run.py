"""Running a sweep: one engine per precision, each point measured and appended to DIR/sweep.jsonl as it
finishes, so that an interrupted sweep resumes where it stopped; then the report."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import itertools
import json
import os
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .. import __version__
from ..errors import AnatomyError
from .grid import Grid, Point, Precision
from .measure import (KVPoolExhausted, Telemetry, energy_figures, latency_figures, point_anatomy, prompts_for,
                      run_batch)

RESULTS_FILE = "sweep.jsonl"
META_FILE = "sweep_meta.json"
ANATOMY_DIR = "anatomies"
TELEMETRY_HZ = 100.0


@dataclass(frozen=True)
class SweepOptions:
    """Everything about how the sweep runs, besides its grid."""

    model: str
    weights: str = "auto"
    device: str | None = None
    dtype: str | None = None
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int | None = None
    energy_seconds: float = 1.0  # the least time a phase's energy is measured over (0: not measured)
    telemetry: bool = True
    calibrate: bool = True
    seed: int = 0

    def check(self) -> None:
        for name, value, low in (("--kv-cache-tokens", self.kv_cache_tokens, 1),
                                 ("--max-num-batched-tokens", self.max_num_batched_tokens, 1)):
            if value is not None and value < low:
                raise AnatomyError(f"{name} must be >= {low}, got {value}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise AnatomyError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not (self.energy_seconds == 0 or 0.3 <= self.energy_seconds <= 60):
            raise AnatomyError(f"--energy-seconds must be 0 (no energy figures) or in 0.3..60, got "
                               f"{self.energy_seconds}: the energy counter updates every ~0.1 s")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def engine_accepts(name: str) -> bool:
    """Whether this engine has a setting `name` (EngineConfig's fields, else Engine's own keywords)."""
    try:
        from ..engine.config import EngineConfig
    except ImportError:
        from ..engine.engine import Engine

        return name in inspect.signature(Engine.__init__).parameters
    return name in {f.name for f in dataclasses.fields(EngineConfig)}


def check_precisions(grid: Grid) -> None:
    """Refuse, before any work, a precision this engine cannot run."""
    for p in grid.precisions:
        for setting, flag in (("quantization", "--quantization"), ("kv_cache_dtype", "--kv-cache-dtype")):
            if setting in p.engine_settings() and not engine_accepts(setting):
                raise AnatomyError(f"{flag} {p.engine_settings()[setting]}: this engine has no {setting} setting yet "
                                   f"(fp8 comes with issue 25); sweep bf16 and auto only")


class Results:
    """DIR/sweep.jsonl (one JSON object per finished point, appended and synced as each finishes) and
    DIR/sweep_meta.json (what was swept: model, device, ceilings, each engine)."""

    def __init__(self, out_dir: Path, identity: dict, fresh: bool):
        self.dir = Path(out_dir)
        self.path, self.meta_path = self.dir / RESULTS_FILE, self.dir / META_FILE
        if self.dir.exists() and not self.dir.is_dir():
            raise AnatomyError(f"--out {self.dir} is a file; give a directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            for path in (self.path, self.meta_path):
                path.unlink(missing_ok=True)
            shutil.rmtree(self.dir / ANATOMY_DIR, ignore_errors=True)
        self.meta = self._read_meta(identity)
        self.records = self._read_records()

    def _read_meta(self, identity: dict) -> dict:
        if not self.meta_path.exists():
            if self.path.exists():
                raise AnatomyError(f"{self.path} has no {META_FILE} beside it; use --fresh to start over")
            return {"identity": identity, "engines": {}}
        try:
            meta = json.loads(self.meta_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise AnatomyError(f"cannot read {self.meta_path}: {e}; use --fresh to start over") from None
        if meta.get("identity") != identity:
            raise AnatomyError(f"{self.dir} holds a sweep of {meta.get('identity')}, not {identity}: use --fresh to "
                               f"replace it, or another --out")
        return meta

    def _read_records(self) -> dict[str, dict]:
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        complete = data[:data.rfind(b"\n") + 1]
        if len(complete) != len(data):  # the last line was being written when the sweep stopped: drop it
            with open(self.path, "r+b") as f:
                f.truncate(len(complete))
        records = {}
        for n, line in enumerate(complete.decode().splitlines(), start=1):
            try:
                record = json.loads(line)
                records[record["key"]] = record
            except (json.JSONDecodeError, KeyError, TypeError):
                raise AnatomyError(f"{self.path}:{n} is not a sweep record; fix it or use --fresh") from None
        return records

    def append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records[record["key"]] = record

    def save_meta(self) -> None:
        tmp = self.meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.meta, indent=1))
        tmp.replace(self.meta_path)

    def pending(self, points: list[Point]) -> list[Point]:
        """Points not yet done (an "error" point is tried again; "ok" and "oom" ones are kept)."""
        return [p for p in points if self.records.get(p.key, {}).get("status") not in ("ok", "oom")]


def start_engine(options: SweepOptions, precision: Precision, grid: Grid, device: torch.device):
    """One engine for all of a precision's points: max_num_seqs is the largest batch; on the host the KV pool is
    sized for the largest point (on a GPU it takes the free memory, as the engine does by default)."""
    from ..engine.engine import Engine

    settings = {"max_num_seqs": grid.max_batch, **precision.engine_settings()}
    kv_tokens = options.kv_cache_tokens
    if kv_tokens is None and device.type == "cpu":
        block = 16
        kv_tokens = max(p.batch * -(-p.tokens_per_sequence // block) * block for p in grid.points())
    if kv_tokens is not None:
        settings["kv_cache_tokens"] = kv_tokens
    if options.gpu_memory_utilization is not None:
        settings["gpu_memory_utilization"] = options.gpu_memory_utilization
    if options.max_num_batched_tokens is not None:
        settings["max_num_batched_tokens"] = options.max_num_batched_tokens
    return Engine.from_pretrained(options.model, device=device, dtype=options.dtype, weights=options.weights,
                                  seed=options.seed, **settings)


def engine_record(engine, precision: Precision) -> dict:
    from ..probe.memory import engine_census

    pool = engine.pool
    memory = dataclasses.asdict(engine_census(engine)) if engine.device.type == "cuda" else None
    return {"label": precision.label, "quantization": precision.quantization,
            "kv_cache_dtype": precision.kv_cache_dtype, "kv_bytes_per_token": pool.bytes_per_token,
            "kv_pool_tokens": pool.capacity_tokens, "kv_pool_bytes": pool.total_bytes, "block_size": pool.block_size,
            "max_num_seqs": engine.max_num_seqs, "max_num_batched_tokens": engine.max_num_batched_tokens,
            "max_model_len": engine.max_model_len, "weights_bytes": engine.weights.bytes,
            "weights": engine.weights.label, "weights_kind": engine.weights.kind,
            "weights_source": engine.weights.source,
            "parameters": engine.weights.num_parameters, "startup_s": engine.startup_seconds, "memory": memory}


def measure_point(engine, point: Point, ceilings, telemetry: Telemetry, options: SweepOptions,
                  anatomy_dir: Path) -> dict:
    """One point: a warm-up run (its shapes compiled and planned), the measured run, energy, the anatomy. A point
    whose sequences cannot all hold their KV blocks at once, or that runs out of device memory, is recorded as
    "oom" and the sweep goes on."""
    record = {"key": point.key, "precision": point.precision.label, "quantization": point.precision.quantization,
              "kv_cache_dtype": point.precision.kv_cache_dtype, "prompt_tokens": point.prompt_tokens,
              "batch": point.batch, "output_tokens": point.output_tokens, "measured_at": _now()}
    pool = engine.pool
    need = point.batch * pool.blocks_for(point.tokens_per_sequence)
    if need > pool.num_blocks:
        return {**record, "status": "oom", "reason": (
            f"the KV pool holds {pool.num_blocks} blocks of {pool.block_size} tokens ({pool.capacity_tokens} "
            f"tokens); {point.batch} sequences of {point.prompt_tokens} + {point.output_tokens} tokens need {need}")}
    prompts = prompts_for(point, engine.config.vocab_size, options.seed)
    cuda = engine.device.type == "cuda"
    try:
        run_batch(engine, prompts, min(2, point.output_tokens))
        if cuda:
            torch.cuda.synchronize(engine.device)
            torch.cuda.reset_peak_memory_stats(engine.device)
            resident = torch.cuda.memory_allocated(engine.device)
        run = run_batch(engine, prompts, point.output_tokens)
        peak = torch.cuda.max_memory_allocated(engine.device) if cuda else None
        failed = [s for s in run.seqs if s.finish_reason == "error"]
        if failed:
            return {**record, "status": "error", "reason": str(getattr(failed[0], "error", "a step failed"))}
        figures = latency_figures(engine, point, run, ceilings)
        energy = (energy_figures(engine, point, prompts, run, telemetry, options.energy_seconds)
                  if options.energy_seconds > 0 else {"prefill": None, "decode": None,
                                                      "note": "energy not measured (--energy-seconds 0)"})
    except torch.OutOfMemoryError as e:
        if cuda:
            torch.cuda.empty_cache()
        return {**record, "status": "oom", "reason": f"out of device memory: {str(e).splitlines()[0]}"}
    except KVPoolExhausted as e:
        return {**record, "status": "oom", "reason": str(e)}
    activation_peak = peak - resident if cuda else None
    anatomy = point_anatomy(engine, point, run, ceilings, telemetry, "sweep", activation_peak)
    anatomy_dir.mkdir(parents=True, exist_ok=True)
    (anatomy_dir / f"{point.key}.json").write_text(anatomy.to_json())
    bpt = pool.bytes_per_token
    per_seq = point.tokens_per_sequence - 1  # the last token is sampled, never cached
    return {**record, "status": "ok", **figures, "energy": energy,
            "prefill_j_per_token": (energy["prefill"] or {}).get("joules_per_token"),
            "decode_j_per_token": (energy["decode"] or {}).get("joules_per_token"),
            "kv_bytes_per_token": bpt, "kv_bytes": point.batch * per_seq * bpt,
            "kv_bytes_allocated": point.batch * pool.blocks_for(per_seq) * pool.bytes_per_block,
            "peak_memory_bytes": peak, "activation_peak_bytes": activation_peak,
            "anatomy": f"{ANATOMY_DIR}/{point.key}.json"}


def start_telemetry(device: torch.device, options: SweepOptions) -> Telemetry:
    from ..probe.telemetry import TelemetryStream, nvml_status

    if not options.telemetry:
        return Telemetry(None, "telemetry turned off (--no-telemetry)")
    available, note = nvml_status(device)
    if not available:
        return Telemetry(None, note)
    stream = TelemetryStream(device, hz=TELEMETRY_HZ, keep_s=3600.0)
    stream.start()
    return Telemetry(stream, f"NVML sampled from a separate process at {TELEMETRY_HZ:.0f} Hz", TELEMETRY_HZ)


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                    TextColumn("{task.fields[done]}/{task.fields[count]} points"), TimeElapsedColumn(),
                    TextColumn("left"), TimeRemainingColumn(), console=console, transient=False)


def identity(options: SweepOptions) -> tuple[dict, object, torch.device]:
    """What makes two sweeps comparable (resuming one must not mix in another's points), and the model config."""
    from ..engine.engine import parse_device
    from ..hub import resolve
    from ..models.config import ModelConfig, dtype_name, parse_dtype
    from ..probe.ceilings import device_name

    source = resolve(options.model)
    config = ModelConfig.from_hf(source.config)
    device = parse_device(options.device)
    return ({"model": source.name, "weights": str(options.weights), "device": device_name(device),
             "dtype": dtype_name(parse_dtype(options.dtype or config.torch_dtype)), "seed": options.seed,
             "kv_cache_tokens": options.kv_cache_tokens, "gpu_memory_utilization": options.gpu_memory_utilization,
             "max_num_batched_tokens": options.max_num_batched_tokens}, config, device)


def run_sweep(grid: Grid, options: SweepOptions, out_dir: Path, *, fresh: bool = False, ceilings=None,
              telemetry: Telemetry | None = None, console: Console | None = None) -> tuple[dict, list[dict]]:
    """Measure every pending point of the grid into out_dir; returns (meta, all records in the file).
    `ceilings` and `telemetry` default to this device's (calibrated or datasheet; NVML when it sees the device)."""
    from ..probe.ceilings import datasheet_ceilings, load_or_calibrate
    from ..gpus import gpu_for_device

    options.check()
    ident, config, device = identity(options)
    grid.check_context(config.max_position_embeddings, ident["model"])
    check_precisions(grid)
    results = Results(out_dir, ident, fresh)
    console = console or Console(stderr=True)
    if ceilings is None:
        ceilings = (load_or_calibrate(device, quick=True).ceilings if options.calibrate
                    else datasheet_ceilings(device))
    gpu = gpu_for_device(ident["device"]) if device.type == "cuda" else None
    results.meta.update({"tool_version": __version__, "config": config.to_hf(), "grid": grid.describe(),
                         "ceilings": dataclasses.asdict(ceilings), "gpu": gpu.key if gpu else None,
                         "device_total_memory": (torch.cuda.get_device_properties(device).total_memory
                                                 if device.type == "cuda" else None),
                         "energy_seconds": options.energy_seconds, "updated_at": _now()})
    results.save_meta()
    todo = results.pending(grid.points())
    own = telemetry is None and bool(todo)
    if own:
        telemetry = start_telemetry(device, options)
    try:
        _measure_all(todo, grid, options, results, ceilings, telemetry or Telemetry(None, ""), device, console)
    finally:
        if own and telemetry.stream is not None:
            telemetry.stream.stop()
    return results.meta, list(results.records.values())


def _measure_all(todo: list[Point], grid: Grid, options: SweepOptions, results: Results, ceilings,
                 telemetry: Telemetry, device: torch.device, console: Console) -> None:
    weights = work_estimates(todo, results.meta, options)
    with _progress(console) as progress:
        task = progress.add_task("starting", total=sum(weights.values()) or 1, done=0, count=len(todo))
        for precision, points in itertools.groupby(todo, key=lambda p: p.precision):
            progress.update(task, description=f"starting the {precision.label} engine")
            engine = start_engine(options, precision, grid, device)
            before = {e.get("weights_source") for e in results.meta["engines"].values()}
            if before and engine.weights.source not in before:  # --weights auto found other weights this time
                raise AnatomyError(f"{results.dir} holds points measured with {before.pop()}, but the engine now "
                                   f"runs {engine.weights.source}: use --fresh or another --out")
            results.meta["engines"][precision.key] = engine_record(engine, precision)
            results.save_meta()
            for point in points:
                progress.update(task, description=point.label)
                record = measure_point(engine, point, ceilings, telemetry, options, results.dir / ANATOMY_DIR)
                results.append(record)
                done = progress.tasks[0].fields["done"] + 1
                progress.update(task, advance=weights[point.key], done=done)
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        progress.update(task, description="done")


def work_estimates(points: list[Point], meta: dict, options: SweepOptions) -> dict[str, float]:
    """Each point's expected seconds (the planner's defaults on this device's rates), so that the progress bar's
    time left weighs a 32k-token prefill more than a short one; tokens stand in where the device has no rates."""
    from ..models.config import ModelConfig, parse_dtype
    from .planner import Setup, predict_point
    from .report import sweep_hardware, sweep_prior

    hw = sweep_hardware(meta)
    prior = sweep_prior(meta, hw) if hw is not None else None
    out = {}
    for p in points:
        seconds = None
        if hw is not None:
            setup = Setup(ModelConfig.from_hf(meta["config"]), parse_dtype(meta["identity"]["dtype"]), Precision(),
                          hw, prior, options.max_num_batched_tokens or 8192, max(p.batch, 1))
            predicted = predict_point(setup, p.batch, p.prompt_tokens, p.output_tokens)
            seconds = 2 * predicted["prefill_ms"] / 1e3 + p.batch * p.output_tokens / predicted["output_tokens_per_s"]
            if options.telemetry and options.energy_seconds:
                seconds += 2 * options.energy_seconds
        out[p.key] = seconds if seconds is not None else float(p.batch * p.tokens_per_sequence)
    return out
