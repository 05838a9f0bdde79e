"""The server's own view of a level, from its Prometheus /metrics: scraped before and after the level
(counters and histograms: their differences) and every --scrape-interval seconds during it (gauges: running
and waiting requests, KV cache usage, which are back at rest once the level ends).

Three families of names are read: vLLM's (`vllm:`), SGLang's (`sglang:`) and llm-anatomy's (`llm_anatomy:`,
vLLM's names under its own prefix, plus the GPU's energy). Counters and histograms cover every request the
server saw in the window, including any other client's.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .client import get_text

SETTLE_S = 3.0  # after a level, how long to wait for the server to count its last requests
PREFIXES = ("llm_anatomy:", "vllm:", "sglang:")  # the first one present is read (ours also has energy)

# role -> names to look for (without prefix), first found wins
_VLLM = {
    "running": ("num_requests_running",), "waiting": ("num_requests_waiting",),
    "kv_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "preemptions": ("num_preemptions_total",),
    "prefix_hits": ("prefix_cache_hits_total", "gpu_prefix_cache_hits_total"),
    "prefix_queries": ("prefix_cache_queries_total", "gpu_prefix_cache_queries_total"),
    "generation_tokens": ("generation_tokens_total",), "prompt_tokens": ("prompt_tokens_total",),
    "queue_time": ("request_queue_time_seconds",), "ttft": ("time_to_first_token_seconds",),
    "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e": ("e2e_request_latency_seconds",), "prefill_time": ("request_prefill_time_seconds",),
    "iteration_tokens": ("iteration_tokens_total",),  # a histogram: one observation an engine step
}
NAMES = {
    "vllm:": _VLLM,
    "llm_anatomy:": {**_VLLM, "gpu_energy": ("gpu_energy_joules_total",)},
    "sglang:": {
        "running": ("num_running_reqs",), "waiting": ("num_queue_reqs",), "kv_usage": ("token_usage",),
        "cache_hit_rate": ("cache_hit_rate",), "preemptions": ("num_retracted_requests_total",),
        # SGLang counts the prompt tokens found in its radix cache: hits / prompt tokens is its hit rate
        "prefix_hits": ("cached_tokens_total",), "prefix_queries": ("prompt_tokens_total",),
        "generation_tokens": ("generation_tokens_total",), "prompt_tokens": ("prompt_tokens_total",),
        "queue_time": ("queue_time_seconds",), "ttft": ("time_to_first_token_seconds",),
        "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
        "e2e": ("e2e_request_latency_seconds",),
    },
}
GAUGES = ("running", "waiting", "kv_usage", "cache_hit_rate")
HISTOGRAMS = ("queue_time", "ttft", "itl", "e2e", "prefill_time")
COUNTERS = ("preemptions", "prefix_hits", "prefix_queries", "generation_tokens", "prompt_tokens", "gpu_energy")


def parse(text: str) -> dict[str, list[float]]:
    """Prometheus text -> sample name -> its values over label sets (bucket series left out)."""
    samples: dict[str, list[float]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith(("_bucket", "_created")):
                samples[s.name].append(s.value)
    return dict(samples)


def flavour(samples: dict[str, list[float]]) -> str | None:
    """Which family of names the server exports, by prefix; None if none we know."""
    return next((p for p in PREFIXES if any(name.startswith(p) for name in samples)), None)


class Snapshot:
    """One scrape, read through one family's names."""

    def __init__(self, samples: dict[str, list[float]], prefix: str, t: float):
        self.samples, self.prefix, self.t = samples, prefix, t

    def _find(self, role: str, suffix: str = "") -> list[float] | None:
        for name in NAMES[self.prefix].get(role, ()):
            values = self.samples.get(self.prefix + name + suffix)
            if values is not None:
                return values
        return None

    def total(self, role: str, suffix: str = "") -> float | None:
        values = self._find(role, suffix)
        return sum(values) if values is not None else None

    def gauge(self, role: str) -> float | None:
        """Summed over label sets for counts of requests, averaged for fractions (one per model or rank)."""
        values = self._find(role)
        if not values:
            return None
        return sum(values) if role in ("running", "waiting") else sum(values) / len(values)


def _delta(before: Snapshot, after: Snapshot, role: str, suffix: str = "") -> float | None:
    """A counter's growth; a series that first appears after `before` grew from 0 (servers create labelled
    series on first use)."""
    a, b = before.total(role, suffix), after.total(role, suffix)
    return None if b is None else b - (a or 0.0)


def _mean_max(values: list[float]) -> dict | None:
    return {"mean": sum(values) / len(values), "max": max(values)} if values else None


@dataclass
class ServerWatch:
    """Scrapes of one level: before, during (gauges) and after."""

    prefix: str
    before: Snapshot
    during: list[Snapshot] = field(default_factory=list)
    after: Snapshot | None = None
    settled: bool = True  # whether the server had counted every completed request when last scraped

    def view(self, duration_s: float | None = None) -> dict:
        """The server's own figures for the level; `duration_s`: the level's (the client's clock, as its tok/s),
        what the engine's steps a second are over (the scrapes bracket more: the settling, a profile's stop)."""
        b, a = self.before, self.after
        out: dict = {"metrics": self.prefix.rstrip(":"), "scrapes": 2 + len(self.during), "settled": self.settled}
        for role in ("running", "waiting", "kv_usage"):
            out[{"running": "requests_running", "waiting": "requests_waiting",
                 "kv_usage": "kv_cache_usage"}[role]] = _mean_max(
                [v for s in self.during if (v := s.gauge(role)) is not None])
        for role in HISTOGRAMS:
            total, count = _delta(b, a, role, "_sum"), _delta(b, a, role, "_count")
            out[f"{role.replace('_time', '')}_ms_mean"] = total / count * 1e3 if total is not None and count else None
        out["requests_counted"] = _delta(b, a, "ttft", "_count")
        # the engine's steps (vLLM's and ours): how many, and what each carried; a server that keeps up with its
        # engine makes as many steps per second as the bare engine, each as full
        steps, stepped = _delta(b, a, "iteration_tokens", "_count"), _delta(b, a, "iteration_tokens", "_sum")
        out["engine_steps"] = steps
        out["engine_steps_per_s"] = steps / duration_s if steps is not None and duration_s else None
        out["tokens_per_step_mean"] = stepped / steps if stepped is not None and steps else None
        for role in ("preemptions", "generation_tokens", "prompt_tokens"):
            out[role] = _delta(b, a, role)
        hits, queries = _delta(b, a, "prefix_hits"), _delta(b, a, "prefix_queries")
        out["prefix_cache_hit_rate"] = hits / queries if hits is not None and queries else None
        if out["prefix_cache_hit_rate"] is None:  # SGLang without its counter: the gauge, averaged
            rates = [v for s in self.during if (v := s.gauge("cache_hit_rate")) is not None]
            out["prefix_cache_hit_rate"] = sum(rates) / len(rates) if rates else None
        energy, tokens = _delta(b, a, "gpu_energy"), out["generation_tokens"]
        out["gpu_energy_j"] = energy
        out["j_per_output_token"] = energy / tokens if energy is not None and tokens else None
        return out


async def scrape(session: aiohttp.ClientSession, base_url: str) -> dict[str, list[float]] | str:
    """The parsed /metrics, or why not (a string)."""
    text, why = await get_text(session, base_url + "/metrics", "GET /metrics")
    if text is None:
        return why
    try:
        return parse(text)
    except (ValueError, TypeError) as e:
        return f"GET /metrics is not Prometheus text ({e})"


class Scraper:
    """Scrapes one server through its own small client (never taking one of the benchmark's connections)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, prefix: str, interval_s: float):
        self.session, self.base_url, self.prefix, self.interval_s = session, base_url, prefix, interval_s

    async def snapshot(self) -> Snapshot | None:
        samples = await scrape(self.session, self.base_url)
        return Snapshot(samples, self.prefix, time.perf_counter()) if isinstance(samples, dict) else None

    async def poll(self, watch: ServerWatch) -> None:
        """Gauges every interval until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            snap = await self.snapshot()
            if snap is not None:
                watch.during.append(snap)

    async def finish(self, watch: ServerWatch, completed: int) -> None:
        """The after-scrape, retried until the server's TTFT histogram has counted the level's completed
        requests (servers record a request when it finishes, some a little after), at most SETTLE_S."""
        deadline = time.perf_counter() + SETTLE_S
        while True:
            watch.after = await self.snapshot() or watch.after
            counted = _delta(watch.before, watch.after, "ttft", "_count") if watch.after else None
            watch.settled = counted is None or counted >= completed
            if watch.settled or time.perf_counter() >= deadline:
                return
            await asyncio.sleep(0.1)
