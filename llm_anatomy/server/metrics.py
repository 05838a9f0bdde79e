"""GET /metrics: Prometheus metrics under vLLM's names, with the prefix llm_anatomy:, and the same series again
under vLLM's own prefix (vllm:) so that dashboards and load generators built for vLLM read them unchanged.

Latency histograms and token counters are fed from each finished call's trace as it finishes, with the same
instants its Anatomy reports (so /metrics and the anatomies agree, even when a busy server builds the
anatomy later): the engine core's process reads them off the trace (call_stats) and each HTTP process counts
them (Metrics.observe) for every call, its own or another's (`--api-server-count`), so that a scrape reaching any of
them reads the whole server. Energy is counted once the anatomy is built. Gauges (running and waiting requests, KV cache
usage, GPU power and energy) are the latest the engine core sent (core.Gauges, with every step).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from ..anatomy import Anatomy
from ..probe.call import Marks
from ..probe.recorder import RequestTrace

PREFIX = "llm_anatomy:"
VLLM_PREFIX = "vllm:"
# the series that vLLM exports under the same names (ours alone, such as energy, keep only our prefix)
VLLM_NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
              "generation_tokens", "request_success", "num_preemptions", "time_to_first_token_seconds",
              "time_per_output_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "iteration_tokens_total")
# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # tokens a step
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True, slots=True)
class CallStats:
    """A finished call's figures for the metrics, read off its trace where the engine runs (call_stats)."""

    id: str
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None = None  # None (and the rest empty): aborted before its prefill, nothing ran
    tpot_s: float | None = None  # None: a single token
    itl_s: tuple[float, ...] = ()
    e2e_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    preemptions: int = 0


def call_stats(call_id: str, trace: RequestTrace, marks: Marks, result) -> CallStats:
    """A finished call's latencies, from its trace: the instants build_anatomy reads (ttft_ms, itl_ms, tpot_ms,
    e2e_ms, batching.queue_ms, prefill.ms)."""
    prompt, output = len(result.prompt_token_ids), len(result.output_token_ids)
    if not trace.steps:
        return CallStats(call_id, result.finish_reason, prompt, output)
    clock = trace.clock
    token_ms = [clock.ms(r.step.t_end_ns) for r in trace.steps]
    return CallStats(
        call_id, result.finish_reason, prompt, output, token_ms[0] / 1e3,
        (token_ms[-1] - token_ms[0]) / (output - 1) / 1e3 if output > 1 else None,
        tuple((b - a) / 1e3 for a, b in zip(token_ms, token_ms[1:])), clock.ms(marks.end) / 1e3,
        (clock.ms(trace.steps[0].step.t_start_ns) - clock.ms(marks.queue)) / 1e3,
        sum(trace.device_ms(r) for r in trace.chunks + trace.steps[:1]) / 1e3,
        trace.seq.num_preemptions if trace.seq is not None else 0)


class _Live:
    """The engine core's latest gauges (core.Gauges), exported when scraped."""

    def __init__(self, model: str):
        self.model = model
        self.gauges = None  # none yet: exported as an idle engine's
        self.energy0: float | None = None  # mJ on the device counter when the server started

    def collect(self):
        labels = ["model_name"]
        g = self.gauges
        for name, doc, value in (
                ("num_requests_running", "Requests in the running batch.", g.running if g else 0),
                ("num_requests_waiting", "Requests queued for admission.", g.waiting if g else 0),
                ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", g.kv_usage if g else 0.0)):
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric([self.model], value)
            yield family
        if g is not None and g.power_mw is not None:
            family = GaugeMetricFamily(PREFIX + "gpu_power_watts", "GPU power draw (NVML), latest sample.",
                                       labels=labels)
            family.add_metric([self.model], g.power_mw / 1e3)
            yield family
        if g is not None and g.energy_mj is not None:
            if self.energy0 is None:
                self.energy0 = g.energy_mj
            c = CounterMetricFamily(PREFIX + "gpu_energy_joules", "GPU energy since the server started (NVML).",
                                    labels=labels)
            c.add_metric([self.model], (g.energy_mj - self.energy0) / 1e3)
            yield c


class _ManyHistogram:
    """A histogram fed many values at once (a request's gaps between tokens: one per token) under one lock;
    prometheus_client's Histogram takes a lock per value, which at thousands of tokens a second costs the
    interpreter time the event loop needs."""

    def __init__(self, name: str, documentation: str, model: str, buckets: tuple[float, ...]):
        self.name, self.documentation, self.model = name, documentation, model
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.total = 0.0
        self.lock = threading.Lock()

    def observe_many(self, values: list[float]) -> None:
        slots = [bisect_left(self.bounds, v) for v in values]  # the first bucket whose bound is >= v
        with self.lock:
            for i in slots:
                self.counts[i] += 1
            self.total += sum(values)

    def collect(self):
        with self.lock:
            counts, total = list(self.counts), self.total
        cumulative, running = [], 0
        for bound, n in zip(self.bounds + [float("inf")], counts):
            running += n
            cumulative.append((floatToGoString(bound), running))
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        family.add_metric([self.model], cumulative, sum_value=total)
        yield family


class _VllmNames:
    """The registry's vLLM-named series again, under the vllm: prefix."""

    def __init__(self, source: CollectorRegistry):
        self.source = source
        self.names = {PREFIX + n for n in VLLM_NAMES}

    def collect(self):
        for family in self.source.collect():
            if family.name not in self.names:
                continue
            renamed = Metric(VLLM_PREFIX + family.name[len(PREFIX):], family.documentation, family.type, family.unit)
            renamed.samples = [s._replace(name=VLLM_PREFIX + s.name[len(PREFIX):]) for s in family.samples]
            yield renamed


class Metrics:
    def __init__(self, model: str):
        disable_created_metrics()  # no *_created series (vLLM exports none either)
        self.model = model
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token (request received to "
                              "first token on the host).", m, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Time per output token after the first, "
                              "per request.", m, buckets=TPOT_BUCKETS, registry=r)
        self.itl = _ManyHistogram(PREFIX + "inter_token_latency_seconds", "Gaps between consecutive output tokens.",
                                  model, TPOT_BUCKETS)
        r.register(self.itl)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, received to last token.", m,
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "Time queued before the first step.", m,
                               buckets=REQUEST_BUCKETS, registry=r)
        self.prefill = Histogram(PREFIX + "request_prefill_time_seconds", "Prefill step time (device).", m,
                                 buckets=REQUEST_BUCKETS, registry=r)
        # a histogram despite its name (vLLM's): steps and the tokens each forwarded (prompt tokens and decoded ones)
        self.iteration_tokens = Histogram(PREFIX + "iteration_tokens_total", "Histogram of number of tokens per "
                                          "engine step.", m, buckets=ITERATION_BUCKETS, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", m, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", m, registry=r)
        self.success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                               m + ["finished_reason"], registry=r)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Requests preempted (KV blocks taken back).", m,
                                   registry=r)
        self.energy = Counter(PREFIX + "request_energy_joules", "Requests' energy: each batched request's share "
                              "of the device's (by its tokens' fraction of each step), else the device's over its "
                              "span.", m, registry=r)
        self.anatomy_build = Histogram(PREFIX + "anatomy_build_seconds", "Time to build a finished call's anatomy "
                                       "(off the step loop; includes waiting for the energy counter's next "
                                       "update).", m, buckets=TPOT_BUCKETS, registry=r)
        self.anatomies_dropped = Counter(PREFIX + "anatomies_dropped", "Anatomies not built: the server was too busy "
                                         "to build them before newer ones pushed them out.", m, registry=r)
        self.anatomy_builder_restarts = Counter(
            PREFIX + "anatomy_builder_restarts", "Times the anatomy builder's process died and a new one was started "
            "(the anatomies it was building were lost: their calls got an error summary).", m, registry=r)
        self.live = _Live(model)
        r.register(self.live)
        self.vllm_registry = CollectorRegistry()
        self.vllm_registry.register(_VllmNames(r))
        for family in (self.prompt_tokens, self.generation_tokens, self.preemptions, self.anatomies_dropped,
                       self.anatomy_builder_restarts):
            family.labels(model)  # exported at 0 from the start

    def observe_steps(self, tokens: tuple[int, ...]) -> None:
        """Engine steps since the last message: the tokens each forwarded."""
        histogram = self.iteration_tokens.labels(self.model)
        for n in tokens:
            histogram.observe(n)

    def observe(self, s: CallStats) -> None:
        """A finished call (with or without an anatomy): its tokens, how it ended, and its latencies if it ran."""
        m = self.model
        self.finished(s.finish_reason, s.prompt_tokens, s.output_tokens)
        if s.ttft_s is None:
            return
        self.ttft.labels(m).observe(s.ttft_s)
        if s.tpot_s is not None:
            self.tpot.labels(m).observe(s.tpot_s)
        self.itl.observe_many(s.itl_s)
        self.e2e.labels(m).observe(s.e2e_s)
        self.queue.labels(m).observe(s.queue_s)
        self.prefill.labels(m).observe(s.prefill_s)
        if s.preemptions:
            self.preemptions.labels(m).inc(s.preemptions)

    def observe_energy(self, a: Anatomy) -> None:
        """A built anatomy: its energy (the device's, or its share of it when batched)."""
        self.observe_joules(call_joules(a))

    def observe_joules(self, joules: float | None) -> None:
        """A built anatomy's call_joules (taken where it was built)."""
        if joules is not None and joules > 0:
            self.energy.labels(self.model).inc(joules)

    def finished(self, reason: str, prompt_tokens: int, output_tokens: int) -> None:
        """A finished call's tokens and how it ended."""
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.generation_tokens.labels(self.model).inc(output_tokens)
        self.success.labels(self.model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.vllm_registry)


def call_joules(a: Anatomy) -> float | None:
    """What a built anatomy adds to the energy counter: its call's energy (the device's, or its share when
    batched)."""
    energy = {e.phase: e for e in a.telemetry.energy}
    call = energy.get("call_attributed") or energy.get("call")
    return call.joules if call is not None else None
