"""A benchmark run: pre-flight (model list, one probe request, /metrics, NVML), then each level in turn with
its prompts, its own client, the server's metrics around it, a local GPU's energy and (--anatomy) the join."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .client import BenchError, RequestShape, list_models, new_session, probe, stream_request
from .datasets import dataset_prompts, load_dataset, random_text_prompts, random_token_prompts
from .join import fetch_summaries, joined_view
from .load import Level, run_level
from .metrics import level_metrics
from .power import GpuEnergyMeter, energy_view
from .scrape import PREFIXES, Scraper, ServerWatch, flavour, scrape

CLIENT_BUSY = 0.9  # client CPU share above which its own timing may be what limits the figures


@dataclass(frozen=True)
class BenchConfig:
    url: str  # base URL, without /v1
    levels: tuple[Level, ...]
    model: str | None = None
    endpoint: str = "completions"  # or "chat"
    num_prompts: int | None = None  # per level; None: default_num_prompts
    input_tokens: int = 128
    output_tokens: int | None = None  # None: 128 for random prompts, the dataset's own lengths for a dataset
    dataset: Path | None = None
    token_id_range: tuple[int, int] = (1000, 30000)
    seed: int = 0
    slo: dict | None = None
    timeout_s: float = 600.0
    api_key: str | None = None
    ignore_eos: bool = True
    anatomy: bool = False
    gpus: tuple[int, ...] | None = None  # NVML indices; None: all, if the server is on this machine
    gpu_energy: bool = True  # False: --gpus none
    local_server: bool = True  # whether the URL's host is this machine
    scrape_interval_s: float = 1.0
    profile: bool = False  # the server's profiler on during each level (vLLM's POST /start_profile, /stop_profile)


def default_num_prompts(level: Level) -> int:
    """4 x the concurrency (so most of a level runs at full concurrency), at least 100; for an open loop,
    30 s of arrivals, at least 50."""
    if level.concurrency is not None:
        return max(100, 4 * level.concurrency)
    return max(50, math.ceil(30 * level.request_rate))


@dataclass
class BenchRun:
    config: BenchConfig
    model: str
    shape: RequestShape | None = None
    notes: list[str] = field(default_factory=list)
    levels: list[dict] = field(default_factory=list)


def make_prompts(config: BenchConfig, n: int, seed: str, entries=None):
    """n prompts; `seed` names the stream of random numbers (the probe's and each level's differ)."""
    if entries is not None:
        return dataset_prompts(entries, n, config.output_tokens, seed)
    out = config.output_tokens or 128
    if config.endpoint == "chat":
        return random_text_prompts(n, config.input_tokens, out, seed)
    return random_token_prompts(n, config.input_tokens, out, config.token_id_range, seed)


async def _preflight(config: BenchConfig, run: BenchRun, entries) -> tuple[Scraper | None, object]:
    """Model, probe, metrics and energy meter; BenchError before any load if the server cannot be used."""
    models = await list_models(config.url, config.api_key)
    names = [m["id"] for m in models]
    if config.model is not None and config.model not in names:
        raise BenchError(f"the server serves {', '.join(names)}; --model {config.model} is not one of them")
    run.model = config.model or names[0]
    limit = next((m.get("max_model_len") for m in models if m["id"] == run.model), None)
    if isinstance(limit, int) and entries is None and config.input_tokens + (config.output_tokens or 128) > limit:
        raise BenchError(f"--input-tokens {config.input_tokens} + --output-tokens {config.output_tokens or 128} "
                         f"exceeds the served model's max_model_len ({limit})")
    shape = RequestShape(config.endpoint, run.model, config.ignore_eos)
    probe_prompt = make_prompts(config, 1, f"{config.seed}/probe", entries)[0]
    run.shape, result, notes = await probe(config.url, shape, probe_prompt, config.api_key, config.timeout_s)
    run.notes += notes
    if config.anatomy and not result.anatomy_id:
        raise BenchError("--anatomy: the server sent no x-anatomy-id header, so it is not llm-anatomy")
    if result.anatomy_id and not config.anatomy:
        run.notes.append("the server is llm-anatomy: --anatomy joins each request's server-side anatomy")

    scraper = None
    metrics_session = new_session(2, 5.0, config.api_key)  # its own: never one of the run's connections
    samples = await scrape(metrics_session, config.url)
    prefix = flavour(samples) if isinstance(samples, dict) else None
    if prefix is None:
        why = samples if isinstance(samples, str) else f"no {', '.join(PREFIXES)} series in GET /metrics"
        run.notes.append(f"no server view: {why}")
        await metrics_session.close()
    else:
        scraper = Scraper(metrics_session, config.url, prefix, config.scrape_interval_s)

    meter = None
    if not config.gpu_energy:
        pass
    elif config.local_server or config.gpus is not None:
        meter, why = GpuEnergyMeter.open(config.gpus)
        if meter is None:
            run.notes.append(why)
    else:
        run.notes.append("no GPU energy: the server is not on this machine (name its GPUs with --gpus if it is)")
    return scraper, meter


async def _server_profile(config: BenchConfig, action: str) -> tuple[int, object]:
    """POST /start_profile or /stop_profile (vLLM's routes, llm-anatomy's with --profile-dir): the status and the
    answer (JSON where it is; vLLM's is empty); (0, why) if the server could not be reached."""
    async with new_session(1, config.timeout_s, config.api_key) as session:
        try:
            async with session.post(f"{config.url}/{action}_profile") as r:
                text = await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 0, f"{type(e).__name__}: {e}"
    try:
        answer = json.loads(text) if text.strip() else None
    except ValueError:
        answer = text[:500]
    return r.status, answer


def _why(answer) -> str:
    """The message of an OpenAI-shaped error, else the answer as it came."""
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return str(answer["error"].get("message"))
    return str(answer)[:300]


async def _level(config: BenchConfig, run: BenchRun, i: int, level: Level, entries, scraper, meter,
                 progress: Progress) -> dict:
    n = config.num_prompts or default_num_prompts(level)
    prompts = make_prompts(config, n, f"{config.seed}/level{i}", entries)
    if config.profile:  # before the level's first request: a server that cannot profile stops the run here
        status, answer = await _server_profile(config, "start")
        if status != 200:
            raise BenchError(f"--profile: POST /start_profile answered {status or 'nothing'} ({_why(answer)}); "
                             f"start llm-anatomy with --profile-dir DIR, or vLLM with its profiler on "
                             f"(VLLM_TORCH_PROFILER_DIR)")
    task = progress.add_task(level.label, total=n, errors=0)
    errors = 0

    def done(result) -> None:
        nonlocal errors
        errors += not result.ok
        progress.update(task, advance=1, errors=errors)

    connections = level.concurrency or 0  # an open loop: as many as requests in flight
    watch = None
    if scraper is not None and (before := await scraper.snapshot()) is not None:
        watch = ServerWatch(scraper.prefix, before)
    poller = asyncio.create_task(scraper.poll(watch)) if watch is not None and config.scrape_interval_s > 0 else None
    e0 = meter.read(time.perf_counter()) if meter is not None else None
    async with new_session(connections, config.timeout_s, config.api_key) as session:
        async def send(prompt):
            return await stream_request(session, config.url, run.shape, prompt, config.timeout_s)

        ran = await run_level(level, prompts, send, f"{config.seed}/arrivals{i}", done)
    e1 = meter.read(time.perf_counter()) if meter is not None else None
    if poller is not None:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
    # after the poller: the stop's answer waits for the trace's writing (seconds), the server idle meanwhile
    profiled = await _server_profile(config, "stop") if config.profile else None
    out = {"level": level.label, "concurrency": level.concurrency, "request_rate": level.request_rate,
           **level_metrics(ran.results, ran.duration_s, config.slo),
           "max_in_flight": ran.max_in_flight, "client_cpu": ran.client_cpu,
           "achieved_request_rate": (n - 1) / ran.send_span_s if level.request_rate and ran.send_span_s > 0 else None}
    out["gpu"] = energy_view(e0, e1, meter.names, out["output_tokens"]) if meter is not None else None
    out["server"] = None
    if watch is not None:
        await scraper.finish(watch, out["completed"])
        out["server"] = watch.view(ran.duration_s) if watch.after is not None else None
    out["anatomy"] = None
    if config.anatomy:
        ids = [r.anatomy_id for r in ran.results if r.ok and r.anatomy_id]
        async with new_session(16, config.timeout_s, config.api_key) as session:
            out["anatomy"] = joined_view(ran.results, await fetch_summaries(session, config.url, ids))
    out["notes"] = [] if watch is None or watch.after is not None else ["GET /metrics failed after the level: "
                                                                        "no server view for it"]
    out["profile"] = None
    if profiled is not None:
        status, answer = profiled
        if status == 200:
            out["profile"] = answer if isinstance(answer, dict) else {"answer": answer}  # vLLM's: empty
            trace = out["profile"].get("trace")
            out["notes"].append("the server's profiler ran through this level: its figures include the profiler's "
                                "cost" + (f"; trace: {trace}" if trace else ""))
        else:
            out["profile"] = {"error": f"POST /stop_profile answered {status or 'nothing'}: {_why(answer)}"}
            out["notes"].append(out["profile"]["error"])
    if ran.client_cpu > CLIENT_BUSY:
        out["notes"].append(f"the client's CPU was {ran.client_cpu:.0%} busy: its own pace may limit these figures")
    if watch is not None and not watch.settled:
        out["notes"].append(f"the server had not counted all {out['completed']} requests when last scraped: "
                            "its histograms may miss the last ones")
    return out


async def run_bench(config: BenchConfig, console: Console | None = None) -> BenchRun:
    """Run every level; BenchError (before any load) if the server cannot be benchmarked as asked."""
    entries = load_dataset(config.dataset) if config.dataset is not None else None
    most = max(config.num_prompts or default_num_prompts(level) for level in config.levels)
    if entries is not None and most > len(entries):
        raise BenchError(f"the dataset has {len(entries)} usable prompts and a level needs {most}: give "
                         f"--num-prompts <= {len(entries)}")
    run = BenchRun(config, model=config.model or "")
    scraper, meter = await _preflight(config, run, entries)
    progress = Progress(TextColumn("{task.description:>18}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("errors {task.fields[errors]}"), TimeElapsedColumn(),
                        console=console or Console(stderr=True), refresh_per_second=4, transient=False)
    try:
        with progress:
            for i, level in enumerate(config.levels):
                run.levels.append(await _level(config, run, i, level, entries, scraper, meter, progress))
    finally:
        if scraper is not None:
            await scraper.session.close()
        if meter is not None:
            meter.close()
    return run
