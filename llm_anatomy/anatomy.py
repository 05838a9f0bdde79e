"""The Anatomy record: everything measured about one call, as one dataclass tree.

Every command writes and reads this record (the CLI report, the HTML and trace files, the server's
per-call endpoints, sweeps). It serialises to JSON with `schema_version`; docs/anatomy.md documents it.
Times are milliseconds since the call began (`started_at_unix` is that instant on the wall clock).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin, get_type_hints

SCHEMA_VERSION = "2.0"

# How the field defines the latency metrics (after vLLM's benchmarks/serve.py); kept in every record, and the same
# in docs/anatomy.md.
METRIC_DEFINITIONS = {
    "ttft_ms": "time to first token: from the call's start (request received) to the first output token "
               "being available on the host, detokenized; includes parsing, template, tokenization, queueing and "
               "prefill (vLLM's TTFT, measured where the request arrives)",
    "tpot_ms": "time per output token: (e2e - ttft) / (output tokens - 1), vLLM's TPOT (AIPerf calls it ITL); "
               "null with one output token",
    "itl_ms": "inter-token latencies: the gaps between consecutive output tokens after the first (vLLM's ITL)",
    "e2e_ms": "end to end: from the call's start to the last output token on the host, detokenized (vLLM's E2EL)",
    "decode_tokens_per_s": "decode throughput of one request: (output tokens - 1) / (e2e - ttft) = 1000 / TPOT; "
                           "the decode phase runs from the first token's emission to the last's, so it excludes "
                           "the prefill",
    "percentile": "pN of n values: sorted x, h = (n - 1) N / 100, x[floor(h)] + (h - floor(h)) (x[floor(h) + 1] - "
                  "x[floor(h)]): linear interpolation between the closest ranks, numpy.percentile's default, as "
                  "vLLM's benchmark computes its percentiles",
    "energy_j": "from NVML's total-energy counter: the estimate interpolates it between its updates; low_j is "
                "what was certainly spent inside the span, high_j what may have been",
    "bytes": "a model of the device-memory traffic of the step's kernels (docs/anatomy.md); measured ones only "
             "in `dram` (Nsight Compute)",
}


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between the closest ranks (METRIC_DEFINITIONS); None
    for no values."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in 0..100, got {q}")
    h = (len(xs) - 1) * q / 100
    lo = int(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


@dataclass
class Phase:
    name: str  # parse | template | tokenize | queue | prefill | decode | detokenize | e2e
    start_ms: float
    end_ms: float
    note: str = ""


@dataclass
class Bound:
    kind: str  # "compute" | "memory" | "overhead"
    why: str


@dataclass
class Roofline:
    """Achieved rates against the ceilings: measured on this device, and the datasheet's."""

    flops: float
    bytes: float
    arithmetic_intensity: float  # FLOP per byte
    achieved_tflops: float
    achieved_gbps: float
    mfu: float | None  # vs measured matmul ceiling
    mbu: float | None  # vs measured read bandwidth
    mfu_datasheet: float | None
    mbu_datasheet: float | None
    bound: Bound
    # With `llm-anatomy call --dram`: the same point placed by the bytes Nsight Compute counted (the `dram` record)
    dram_bytes: float | None = None
    dram_intensity: float | None = None
    dram_gbps: float | None = None
    dram_mbu: float | None = None  # against the measured read bandwidth


@dataclass
class PrefillRecord:
    tokens: int
    ms: float  # GPU time of the forward (device events), or host time where there is no GPU
    host_ms: float  # host wall time of the whole step (prepare, launch, sample, sync)
    start_ms: float
    flops: float
    bytes: float
    mfu: float | None
    mbu: float | None
    roofline: Roofline
    cost_breakdown: dict[str, dict[str, float]] = field(default_factory=dict)
    batch_size: int = 1  # sequences in the same step (flops, bytes and times are the whole step's)
    others: list[str] = field(default_factory=list)  # the other requests in that step (the last, if chunked)
    steps: int = 1  # >1: the prompt was prefilled in chunks over several steps (then summed over them)


@dataclass
class DecodeStep:
    index: int  # 1 for the step that produced the second output token
    start_ms: float
    end_ms: float  # when the token was on the host and detokenized
    gpu_ms: float
    host_ms: float
    context_len: int  # tokens attended to (this request), new token included
    batch_size: int
    token_id: int
    token_text: str
    flops: float
    bytes: float
    kv_bytes_read: float
    mbu: float | None
    mfu: float | None
    bound: str
    # The batch as it changed since this request's previous step (its prefill for step 1): other requests that
    # joined it and that left it. Who else was in each step follows from PrefillRecord.others and these.
    joined: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    step_tokens: int = 1  # tokens the whole step forwarded: above batch_size, it also prefilled others' prompts
    # start_ms is the previous token's emission (steps tile the decode phase); with lookahead the step was
    # scheduled and launched earlier, at launch_ms, and its device work began at gpu_start_ms
    launch_ms: float | None = None
    gpu_start_ms: float | None = None


@dataclass
class DecodeSummary:
    steps: int
    gpu_ms_median: float
    host_ms_median: float
    itl_ms_median: float
    itl_ms_p90: float
    tokens_per_s: float
    bytes_per_step_median: float
    kv_share_of_bytes: float  # fraction of a median step's bytes that are KV reads
    roofline: Roofline | None


@dataclass
class Stall:
    """A step that ran other requests' prefill while this request was running and so got no token."""

    start_ms: float
    gpu_ms: float
    requests: list[str]
    tokens: int


@dataclass
class BatchingRecord:
    """How the request shared the engine: continuous batching puts several requests in one step."""

    queue_ms: float  # from being queued to its first step
    max_batch_size: int
    mean_batch_size: float  # over the steps that produced its tokens
    preemptions: int  # times its KV blocks were taken back and it was recomputed
    co_scheduled: dict[str, int] = field(default_factory=dict)  # other request id -> steps shared, most first
    stalls: list[Stall] = field(default_factory=list)
    stall_ms: float = 0.0  # device time of those stalls: added to its latency by others


@dataclass
class KVCacheRecord:
    bytes_per_token: int
    formula: str
    dtype: str
    block_size: int
    pool_blocks: int
    pool_bytes: int
    pool_share_of_device: float | None
    blocks_allocated: int  # by this request at its end
    tokens: int  # positions cached at its end
    bytes_used: int  # tokens x bytes_per_token
    bytes_allocated: int  # blocks x block bytes
    bytes_after_step: list[int] = field(default_factory=list)  # used bytes after prefill and each decode step
    fits_sequences_this_length: int = 0  # in the memory left (pool free + device free)
    fits_sequences_full_context: int = 0
    full_context: int = 0


@dataclass
class MemoryCensus:
    """A snapshot that sums to the device total: each byte is in exactly one row."""

    total: int
    weights: int
    kv_pool: int
    cuda_graphs: int
    other_allocated: int  # tensors torch holds besides the above (buffers, workspaces)
    allocator_free: int  # reserved by the caching allocator, not in use
    context_and_other: int  # used by the device (NVML) beyond torch's reservation: CUDA context, libraries
    free: int
    activation_peak: int | None  # transient: peak allocated above the resident tensors during the call (None: not measured)
    source: str  # how it was measured
    kind: str = "device"  # device (a GPU's memory) | host (RAM: the engine ran on the CPU)
    activation_peak_note: str = ""  # what activation_peak covers (CUDA graphs' steps draw on their own pool)


@dataclass
class GpuSample:
    t_ms: float
    power_w: float | None
    energy_j: float | None  # the device's total-energy counter, relative to the call's start
    sm_clock_mhz: int | None
    mem_clock_mhz: int | None
    gpu_util: int | None
    mem_util: int | None
    mem_used: int | None
    temperature_c: int | None
    throttle: list[str] = field(default_factory=list)


@dataclass
class EnergyRecord:
    """Energy over one span of the call (probe/energy.py): an estimate and an interval that is one-sided where the
    span is shorter than the counter's update interval."""

    phase: str
    joules: float  # the counter interpolated between its updates
    low_j: float  # certainly spent inside the span (0 when no whole update interval lies inside it)
    high_j: float | None  # at most this (None: the counter did not update on both sides of the span)
    per_token_j: float | None  # joules per token of the span (null for a whole-device span of a batched request)
    method: str
    start_ms: float = 0.0
    end_ms: float = 0.0
    shorter_than_update: bool = False  # the span is shorter than the counter's update interval

    @property
    def uncertainty_j(self) -> float:
        """The interval's larger side, for renderers that show one number; low_j and high_j are the record's."""
        return max(self.joules - self.low_j, (self.high_j if self.high_j is not None else self.joules) - self.joules)


@dataclass
class Telemetry:
    available: bool
    note: str  # why not, or how it was sampled
    sample_hz: float = 0.0
    counter_update_ms: float | None = None  # observed update interval of the energy counter
    energy: list[EnergyRecord] = field(default_factory=list)


@dataclass
class SteadyEnergy:
    """`llm-anatomy call --repeat N`: energy per token of one phase in steady state, from its work repeated back to
    back for whole update intervals of the energy counter (probe/energy.py steady_rate)."""

    phase: str  # prefill | decode
    repeats: int  # prefills run, or decode steps
    tokens_per_repeat: int  # prompt tokens per prefill; 1 per decode step
    context_start: int  # decode: the context of the first step and of the last; prefill: the prompt's length
    context_end: int
    seconds: float  # the run, start to end
    window_ms: float  # between the counter updates the figure uses
    counter_updates: int  # inside the run
    joules: float  # over the window
    j_per_token: float
    j_per_token_low: float
    j_per_token_high: float | None  # None: no repeat lay wholly inside the window
    spread: float  # standard deviation of the per-interval J/token over their mean
    standard_error: float  # of the mean, relative: spread / sqrt(intervals)
    within_target: bool  # interval half-width and standard error both within `target`
    target: float = 0.05
    intervals_j_per_token: list[float] = field(default_factory=list)
    method: str = ""


@dataclass
class DramCategory:
    category: str  # probe/kernels.py's categories
    kernels: int
    read_bytes: float
    write_bytes: float
    modelled_bytes: float  # the cost model's parts in this category (probe/cost.py PART_CATEGORY)

    @property
    def measured_bytes(self) -> float:
        return self.read_bytes + self.write_bytes


@dataclass
class DramPhase:
    """One replayed step under Nsight Compute: DRAM bytes read and written by its kernels, against the model."""

    phase: str  # prefill | decode
    tokens: int  # forwarded by the step
    context_len: int  # the sequence's context after the step
    read_bytes: float
    write_bytes: float
    modelled_bytes: float
    categories: list[DramCategory] = field(default_factory=list)
    top_kernels: list[dict[str, Any]] = field(default_factory=list)  # name, category, read_bytes, write_bytes, count

    @property
    def measured_bytes(self) -> float:
        return self.read_bytes + self.write_bytes


@dataclass
class DramRecord:
    """`llm-anatomy call --dram`: the call's prefill and one decode step replayed under Nsight Compute."""

    available: bool
    note: str  # how it was measured, or why not
    command: str = ""
    phases: list[DramPhase] = field(default_factory=list)


@dataclass
class Ceilings:
    device: str
    read_gbps: float | None  # measured
    gemv_gbps: float | None
    matmul_tflops: float | None  # sustained: seconds of products back to back, under the power limit (MFU's)
    datasheet_gbps: float | None
    datasheet_tflops: float | None
    datasheet_source: str = ""
    measured_at: str = ""  # date of the calibration, or "" if not calibrated
    matmul_burst_tflops: float | None = None  # the first 0.1 s of the same products, before the clocks drop

    @property
    def ridge(self) -> float | None:
        """FLOP per byte above which work is compute-bound (measured ceilings, else the datasheet's)."""
        tflops = self.matmul_tflops or self.datasheet_tflops
        gbps = self.read_gbps or self.datasheet_gbps
        return tflops * 1e12 / (gbps * 1e9) if tflops and gbps else None


@dataclass
class KernelCategory:
    category: str
    ms: float
    count: int


@dataclass
class KernelBreakdown:
    phase: str  # prefill | decode (over `steps` steps)
    steps: int
    total_ms: float
    categories: list[KernelCategory] = field(default_factory=list)
    top_kernels: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ModelRecord:
    name: str
    config: dict  # HF config.json field names
    dtype: str  # the activations' (and the unquantized weights')
    parameters: int
    weight_bytes: int
    precision: str | None = None  # the fp8 layers in words (--quantization fp8 or an fp8 checkpoint); None: all dtype
    kv_cache_dtype: str | None = None  # what the KV cache stores


@dataclass
class WeightsRecord:
    kind: str  # checkpoint | synthetic
    source: str
    label: str
    seed: int | None = None


@dataclass
class DeviceRecord:
    name: str
    type: str  # cuda | cpu
    total_memory: int
    why: str  # why this device (asked for, default...)
    torch: str = ""
    cuda: str | None = None
    driver: str | None = None


@dataclass
class StartupRecord:
    """What the process spent once, before its first call: not part of this call's timings."""
    total_s: float  # Engine.from_pretrained: config, tokenizer, weights, KV pool, and what follows
    compile_and_capture_s: float  # Triton compiles, GEMV tile tuning, CUDA-graph capture, prefill warm-up
    cuda_graphs: int  # decode batch buckets, prefill lengths and batch-prefill sizes captured (0: eager, e.g. CPU)
    programmatic_dependent_launch: bool
    streaming_gemv: bool = False  # batch-1 GEMVs by the CUDA kernel that reads weights before its wait
    tile_tuning_s: float = 0.0  # of compile_and_capture_s: the decode GEMVs' tiles, timed in the decode step
    tiles_from_cache: bool = False  # the tiles were read back, not tuned: from the disk cache or the package's table
    plan: dict = field(default_factory=dict)  # the engine's execution plan (engine/plan.py ExecutionPlan.describe)


@dataclass
class Anatomy:
    model: ModelRecord
    weights: WeightsRecord
    device: DeviceRecord
    request: dict  # what was asked: messages or prompt, sampling values
    prompt_text: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str
    phases: list[Phase]
    ttft_ms: float
    tpot_ms: float | None
    itl_ms: list[float]
    e2e_ms: float
    prefill: PrefillRecord
    decode_steps: list[DecodeStep]
    decode: DecodeSummary | None
    kv_cache: KVCacheRecord
    memory: MemoryCensus
    ceilings: Ceilings
    telemetry: Telemetry
    gpu_samples: list[GpuSample]  # telemetry samples (empty when telemetry.available is false)
    host_ms: dict[str, float] = field(default_factory=dict)  # host work summed over the call's steps
    kernels: list[KernelBreakdown] = field(default_factory=list)
    batching: BatchingRecord | None = None
    startup: StartupRecord | None = None
    steady_energy: list[SteadyEnergy] = field(default_factory=list)  # with --repeat
    dram: DramRecord | None = None  # with --dram
    notes: list[str] = field(default_factory=list)
    id: str = ""
    started_at_unix: float = 0.0
    tool_version: str = ""
    definitions: dict[str, str] = field(default_factory=lambda: dict(METRIC_DEFINITIONS))
    schema_version: str = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return _plain(self)

    def others_at(self, step: int) -> list[str]:
        """The other requests in decode step `step` (1-based, as DecodeStep.index; 0 is the prefill's last
        step), rebuilt from the prefill's list and each step's joined and left."""
        if not 0 <= step <= len(self.decode_steps):
            raise IndexError(f"step {step} is not in 0..{len(self.decode_steps)}")
        batch = set(self.prefill.others)
        for s in self.decode_steps[:step]:
            batch = (batch | set(s.joined)) - set(s.left)
        return sorted(batch)

    def summary(self) -> dict:
        """The headline numbers, small enough to ride along with an API response (the server's `anatomy`
        field); the full record is at `url`."""
        d, b = self.decode, self.batching
        energy = {e.phase: e for e in self.telemetry.energy}
        call_energy = energy.get("call_attributed") or energy.get("call")  # its share, when batched
        return {
            "id": self.id, "url": f"/v1/anatomy/{self.id}", "html": f"/anatomy/{self.id}",
            "started_at_unix": self.started_at_unix, "weights": self.weights.kind, "notes": self.notes,
            "prompt_tokens": len(self.prompt_token_ids), "output_tokens": len(self.output_token_ids),
            "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms,
            "queue_ms": next((p.end_ms - p.start_ms for p in self.phases if p.name == "queue"), None),
            "prefill": {"tokens": self.prefill.tokens, "gpu_ms": self.prefill.ms, "mfu": self.prefill.mfu,
                        "batch_size": self.prefill.batch_size, "bound": self.prefill.roofline.bound.kind},
            "decode": None if d is None else {
                "steps": d.steps, "tokens_per_s": d.tokens_per_s, "gpu_ms_median": d.gpu_ms_median,
                "itl_ms_median": d.itl_ms_median, "mbu": d.roofline.mbu if d.roofline else None,
                "bound": d.roofline.bound.kind if d.roofline else None},
            "kv_cache": {"bytes_per_token": self.kv_cache.bytes_per_token, "tokens": self.kv_cache.tokens,
                         "bytes_used": self.kv_cache.bytes_used},
            "batching": None if b is None else {
                "max_batch_size": b.max_batch_size, "mean_batch_size": b.mean_batch_size,
                "co_scheduled_requests": len(b.co_scheduled), "stall_ms": b.stall_ms, "preemptions": b.preemptions},
            "energy_j": call_energy.joules if call_energy else None,
            "energy_interval_j": [call_energy.low_j, call_energy.high_j] if call_energy else None,
            "steady_j_per_token": {r.phase: r.j_per_token for r in self.steady_energy} or None,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: dict) -> "Anatomy":
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"anatomy schema_version {version!r} is not {SCHEMA_VERSION!r}, the version this "
                             f"llm-anatomy reads; re-run the call with this version to get a record it can show")
        return _build(cls, data)

    @classmethod
    def from_json(cls, text: str) -> "Anatomy":
        return cls.from_dict(json.loads(text))


_LEAVES = (str, int, float, bool, type(None))
_LEAF_FIELDS: dict[type, tuple[tuple[str, bool], ...]] = {}  # per dataclass: (field name, annotated as a leaf)


def _is_leaf(hint) -> bool:
    """float, str | None, ...: a value of this type is plain already."""
    return all(a in _LEAVES for a in (get_args(hint) if get_origin(hint) is not None else (hint,)))


def _field_plan(tp: type) -> tuple[tuple[str, bool], ...]:
    plan = _LEAF_FIELDS.get(tp)
    if plan is None:
        try:
            hints = get_type_hints(tp)
        except NameError:  # an annotation this module cannot resolve: every value is looked at
            hints = {}
        plan = _LEAF_FIELDS[tp] = tuple((f.name, f.name in hints and _is_leaf(hints[f.name]))
                                        for f in dataclasses.fields(tp))
    return plan


def _plain(x):
    """dataclasses.asdict without its deep copies of every leaf (a served anatomy has thousands of them): a field
    annotated as a leaf is taken as it is, without looking at its value."""
    if type(x) in _LEAVES:
        return x
    if hasattr(x, "__dataclass_fields__"):
        out = {}
        for name, leaf in _field_plan(type(x)):
            value = getattr(x, name)
            out[name] = value if leaf else _plain(value)
        return out
    if isinstance(x, (list, tuple)):
        if all(type(v) in _LEAVES for v in x):  # token ids, request ids
            return list(x)
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        if all(type(v) in _LEAVES for v in x.values()):  # e.g. co_scheduled: hundreds of ids -> counts
            return dict(x)
        return {k: _plain(v) for k, v in x.items()}
    return x


def _build(tp, value):
    """Rebuild dataclasses (nested, in lists, optional) from plain JSON values."""
    if value is None:
        return None
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        hints = get_type_hints(tp)
        return tp(**{f.name: _build(hints[f.name], value[f.name]) for f in dataclasses.fields(tp) if f.name in value})
    if origin is list:
        (item,) = get_args(tp)
        return [_build(item, v) for v in value]
    if origin is not None and type(None) in get_args(tp):  # X | None
        (inner,) = [a for a in get_args(tp) if a is not type(None)]
        return _build(inner, value)
    return value
