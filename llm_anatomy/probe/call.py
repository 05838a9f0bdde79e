"""One measured call: template, tokenize, queue, prefill, decode, detokenize, on one clock -> an Anatomy."""

from __future__ import annotations

import copy
import dataclasses
import os
import time
import uuid
from dataclasses import dataclass, field

import torch

from .. import __version__
from ..anatomy import (Anatomy, Ceilings, DeviceRecord, EnergyRecord, MemoryCensus, ModelRecord, Phase,
                       StartupRecord, WeightsRecord)
from ..engine.engine import Engine, GenerationResult
from .ceilings import device_name
from .clock import Clock
from .cost import KernelShapes, device_shapes
from .memory import engine_census
from .recorder import (PoolFacts, Recorder, RequestTrace, batching_record, decode_records, decode_summary, kv_record,
                       kv_room, prefill_record, telemetry)
from .energy import measure_steady_energy
from .telemetry import GpuTelemetry, nvml_status
from ..prompt import render_prompt


@dataclass
class CallRequest:
    """What the user asked: exactly one of messages, prompt (raw text, no template) or prompt_token_ids."""

    messages: list | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    enable_thinking: bool = True
    tools: list | None = None
    sampling: dict = field(default_factory=dict)

    def describe(self) -> dict:
        shown = {k: v for k, v in (("messages", self.messages), ("prompt", self.prompt),
                                   ("prompt_token_ids", self.prompt_token_ids), ("tools", self.tools)) if v is not None}
        return {**shown, "enable_thinking": self.enable_thinking, "sampling": dict(self.sampling)}


def device_record(engine: Engine, why: str) -> DeviceRecord:
    dev = engine.device
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        driver = None
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
        except Exception:
            pass
        return DeviceRecord(props.name, "cuda", props.total_memory, why, torch.__version__, torch.version.cuda, driver)
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return DeviceRecord(f"{device_name(dev)} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)", "cpu",
                        total, why, torch.__version__)


@dataclass(frozen=True)
class EngineFacts:
    """What building an anatomy reads of the engine, none of which changes while it serves: taken once
    (`of`), picklable, so that anatomies can be built in a process that never touches the device. Has the
    attributes the cost model reads of an engine (device, config, dtype), and the kernel shapes its plan
    implies in place of the plan (which holds the tuned tiles)."""

    device: torch.device
    config: object
    dtype: torch.dtype
    shapes: KernelShapes
    tokenizer: object  # its token_text names each decode step's token
    model: ModelRecord
    weights: WeightsRecord
    device_record: DeviceRecord  # its `why` left empty: each call says why
    pool: PoolFacts
    max_model_len: int
    startup: StartupRecord | None

    @classmethod
    def of(cls, engine: Engine) -> "EngineFacts":
        config, weights = engine.config, engine.weights
        return cls(engine.device, config, engine.dtype, device_shapes(engine.device, engine.plan),
                   engine.tokenizer,  # pickles without its compiled template (Tokenizer.__getstate__)
                   ModelRecord(engine.source.name, config.to_hf(), str(engine.dtype).split(".")[-1],
                               weights.num_parameters, weights.bytes, weights.quantization,
                               engine.plan.kv_cache_dtype),
                   WeightsRecord(weights.kind, weights.source, weights.label, weights.seed),
                   device_record(engine, ""), PoolFacts.of(engine), engine.max_model_len, startup_record(engine))


@dataclass(frozen=True)
class DeviceState:
    """The device's memory when a request finished: its census (no activation peak) and the room for KV."""

    census: MemoryCensus
    kv_room: int

    @classmethod
    def of(cls, engine: Engine) -> "DeviceState":
        return cls(engine_census(engine), kv_room(engine))


@dataclass
class Marks:
    """Host instants (perf_counter_ns) of one call's front half, and its end."""

    received: int  # the call arrived (parsing starts)
    template: int
    tokenize: int
    queue: int  # handed to the engine
    end: int = 0  # last token detokenized


@dataclass
class TelemetryWindow:
    samples: list
    available: bool
    note: str
    hz: float


def measure_call(engine: Engine, request: CallRequest, ceilings: Ceilings, *, t_start_ns: int | None = None,
                 device_why: str = "", telemetry_hz: float = 100.0, use_telemetry: bool = True
                 ) -> tuple[GenerationResult, Anatomy]:
    """Run the request alone on the engine and measure it. `t_start_ns` is when the call was received
    (parsing happened between then and now); by default, now."""
    available, note = nvml_status(engine.device) if use_telemetry else (False, "telemetry turned off")
    sampler = GpuTelemetry(engine.device, telemetry_hz) if available else None
    if sampler is not None:
        sampler.start()  # before the clock starts: the sampler's start-up is not part of the call
    cuda = engine.device.type == "cuda"
    if cuda:  # the measurement's own set-up (syncs, the device clock's reference) also precedes the clock
        torch.cuda.synchronize(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
        resident = torch.cuda.memory_allocated(engine.device)
    recorder = Recorder(Clock(engine.device))
    request_id = uuid.uuid4().hex[:16]
    t_parse_start = t_start_ns if t_start_ns is not None else time.perf_counter_ns()
    trace = recorder.watch(request_id, t0_ns=t_parse_start)
    engine.observers.append(recorder)
    try:
        params = engine.sampling_params(**request.sampling)
        rendered = render_prompt(engine.tokenizer, messages=request.messages, prompt=request.prompt,
                                 prompt_token_ids=request.prompt_token_ids, enable_thinking=request.enable_thinking,
                                 tools=request.tools)
        ids, prompt_text = rendered.token_ids, rendered.text
        marks = Marks(t_parse_start, rendered.template_ns, rendered.tokenize_ns, 0)
        marks.queue = time.perf_counter_ns()
        seq = engine.add_request(ids, params, request_id=request_id)
        while not seq.finished:
            engine.step()
        marks.end = time.perf_counter_ns()
    finally:
        engine.observers.remove(recorder)
    if cuda:
        torch.cuda.synchronize(engine.device)
        activation_peak = torch.cuda.max_memory_allocated(engine.device) - resident
        peak_note = ACTIVATION_PEAK_GRAPHS if uses_cuda_graphs(engine) else ACTIVATION_PEAK_EAGER
    else:
        activation_peak, peak_note = None, "not measured on the host (no device allocator)"
    samples = sampler.stop(marks.end) if sampler is not None else []
    result = engine.result(seq, prompt_text)
    return result, build_anatomy(engine, request.describe(), result, trace, ceilings,
                                 TelemetryWindow(samples, available, note, telemetry_hz), device_why, marks,
                                 activation_peak, activation_peak_note=peak_note, alone=True)


ACTIVATION_PEAK_EAGER = "the peak allocated above the resident tensors during the call; every step ran eagerly"
ACTIVATION_PEAK_GRAPHS = ("the peak allocated above the resident tensors during the call by the work launched "
                          "eagerly (sampling, a prompt longer than the captured lengths); steps replayed from CUDA "
                          "graphs run in the graphs' own memory pool (the cuda_graphs row), which this does not see")


def uses_cuda_graphs(engine: Engine) -> bool:
    """Whether the engine replays captured CUDA graphs (engine.graphs, or its runner's)."""
    if getattr(engine, "graphs", None) is not None:
        return True
    runner = getattr(engine, "runner", None)
    return bool(getattr(runner, "graphs", None))


def attributed_energy(rec: RequestTrace, energy: list[EnergyRecord], e2e_ms: float, tokens: int
                      ) -> EnergyRecord | None:
    """This request's share of the device's energy when it was batched: the call's mean power times the device
    time of its steps, each weighted by its tokens' fraction of the step (a decode step of 8 gives it 1/8)."""
    call = next((e for e in energy if e.phase == "call"), None)
    if call is None or e2e_ms <= 0:
        return None
    share_ms = sum(rec.device_ms(r) * r.step.query_lens[r.position] / r.timing.num_tokens(r.step)
                   for r in rec.chunks + rec.steps)
    fraction = share_ms / e2e_ms
    joules = call.joules * fraction
    return EnergyRecord("call_attributed", joules, call.low_j * fraction,
                        call.high_j * fraction if call.high_j is not None else None,
                        joules / tokens if tokens else None,
                        f"this request's share: the call's energy x (its share of the device time, {share_ms:.1f} ms "
                        f"of its {e2e_ms:.1f} ms, each step weighted by its tokens' fraction of the step); an "
                        f"estimate that splits each step's energy in proportion to tokens",
                        call.start_ms, call.end_ms, call.shorter_than_update)


def build_anatomy(engine: Engine | EngineFacts, request: dict, result: GenerationResult, rec: RequestTrace,
                  ceilings: Ceilings, window: TelemetryWindow, device_why: str, marks: Marks,
                  activation_peak: int | None = None, notes: list[str] | None = None,
                  activation_peak_note: str = "not measured for this call", alone: bool = False,
                  state: DeviceState | None = None) -> Anatomy:
    """The Anatomy of one finished request from its trace. `request` is what was asked (shown as is). The phases
    tile the call without overlapping: the decode phase starts when the prefill's token is emitted. `alone`: the
    request had the device to itself, idle before and after it (measure_call), which the energy model uses.
    `engine`: the engine, or its EngineFacts (then `state`, the DeviceState when the request finished, is
    needed: facts alone cannot read the device); with the engine, `state` is read now if not given."""
    if isinstance(engine, EngineFacts):
        if state is None:
            raise ValueError("build_anatomy from EngineFacts needs the DeviceState of when the request finished")
        facts = engine
    else:
        facts, state = EngineFacts.of(engine), state or DeviceState.of(engine)
    return _build(facts, state, request, result, rec, ceilings, window, device_why, marks, activation_peak, notes,
                  activation_peak_note, alone)


def _build(engine: EngineFacts, state: DeviceState, request: dict, result: GenerationResult, rec: RequestTrace,
           ceilings: Ceilings, window: TelemetryWindow, device_why: str, marks: Marks, activation_peak: int | None,
           notes: list[str] | None, activation_peak_note: str, alone: bool) -> Anatomy:
    clock = rec.clock
    t_parse, t_template, t_tokenize, t_queue = (clock.ms(t) for t in (
        marks.received, marks.template, marks.tokenize, marks.queue))
    prefill_step, decode_steps_raw = rec.steps[0], rec.steps[1:]
    shapes = engine.shapes
    prefill = prefill_record(rec, prefill_step, engine, ceilings, shapes)
    steps, costs = decode_records(rec, decode_steps_raw, engine, ceilings, engine.tokenizer.token_text, prefill_step,
                                  shapes)
    token_times = [clock.ms(r.step.t_end_ns) for r in rec.steps]
    ttft = token_times[0]
    e2e = token_times[-1]  # the last token on the host (vLLM's E2EL)
    n_out = len(result.output_token_ids)
    itl = [b - a for a, b in zip(token_times, token_times[1:])]
    tpot = (token_times[-1] - ttft) / (n_out - 1) if n_out > 1 else None
    prefill_start = clock.ms(prefill_step.step.t_start_ns)
    batching = batching_record(rec, prefill_start - t_queue)
    batched = batching.max_batch_size > 1 or bool(batching.stalls)
    phases = [
        Phase("parse", t_parse, t_template, "validating the request and its sampling values"),
        Phase("template", t_template, t_tokenize, "chat template (jinja2)" if request.get("messages") else "no template"),
        Phase("tokenize", t_tokenize, t_queue, f"{len(result.prompt_token_ids)} prompt tokens"),
        Phase("queue", t_queue, prefill_start, "waiting to be scheduled"),
        Phase("prefill", prefill_start, ttft, f"{prefill.tokens} tokens, first token sampled and detokenized"
              + (f" (a step of {prefill.batch_size} requests)" if prefill.batch_size > 1 else "")),
    ]
    if decode_steps_raw:
        phases.append(Phase("decode", ttft, e2e,
                            f"{len(steps)} steps, one token each"
                            + (f", in batches of up to {batching.max_batch_size}" if batched else "")))
    phases.append(Phase("e2e", 0.0, e2e, "the whole call"))
    detokenize_ms = sum(r.step.detokenize_ns for r in rec.steps) / 1e6
    # spans that tile the call, so that their energies add up to its own
    spans = {"before_prefill": (0.0, prefill_start, 0), "prefill": (prefill_start, ttft, prefill.tokens)}
    if steps:
        spans["decode"] = (ttft, e2e, len(steps))
    spans["call"] = (0.0, e2e, n_out)
    # alone on the device (a measured call), it worked from the prefill's start to the last token and idled around
    busy = (prefill_start, e2e) if alone and not batched else None
    tele, gpu_samples = telemetry(window.samples, clock, window.available, window.note, window.hz, spans, busy)
    if batched:  # the device's energy over this request's time was spent on the other requests too
        for record in tele.energy:
            record.per_token_j = None
            record.method += "; the whole device over this request's span, shared with the requests batched with it"
        share = attributed_energy(rec, tele.energy, e2e, n_out)
        if share is not None:
            tele.energy.append(share)
    kv = kv_record(engine.pool, state.kv_room, engine.max_model_len, rec, rec.seq)
    memory = dataclasses.replace(state.census, activation_peak=activation_peak,
                                 activation_peak_note=activation_peak_note)
    notes = list(notes or [])
    notes.append("FLOPs and bytes (and so MFU, MBU and the roofline) are the cost model's, not measured "
                 "(docs/anatomy.md); `llm-anatomy call --dram` measures DRAM bytes with Nsight Compute.")
    if engine.weights.kind == "synthetic":
        notes.append("Synthetic random weights: timings, memory and bytes are those of the real model; energy and "
                     "power are too on the assumption that random weights draw the power trained ones do (not "
                     "measured); the text is not.")
    if batched:
        notes.append("Batched with other requests: prefill and decode flops, bytes and device times are those of "
                     "whole steps, shared by every request in them (see batching).")
    return Anatomy(
        id=rec.request_id, started_at_unix=time.time() - (time.perf_counter_ns() - clock.t0_ns) / 1e9,
        tool_version=__version__,
        model=copy.deepcopy(engine.model), weights=dataclasses.replace(engine.weights),
        device=dataclasses.replace(engine.device_record, why=device_why),
        request=request, prompt_text=result.prompt_text, prompt_token_ids=result.prompt_token_ids,
        output_token_ids=result.output_token_ids, text=result.text, finish_reason=result.finish_reason,
        phases=phases, ttft_ms=ttft, tpot_ms=tpot, itl_ms=itl, e2e_ms=e2e,
        prefill=prefill, decode_steps=steps, decode=decode_summary(steps, costs, itl, ceilings), kv_cache=kv,
        memory=memory, ceilings=ceilings, telemetry=tele, gpu_samples=gpu_samples,
        host_ms={"schedule": sum(r.step.t_launch_ns - r.step.t_start_ns for r in rec.steps) / 1e6,
                 "prepare_and_launch": sum(r.step.t_launched_ns - r.step.t_launch_ns for r in rec.steps) / 1e6,
                 "detokenize": detokenize_ms,
                 "all_step_work": sum(r.step.host_work_ns for r in rec.steps) / 1e6},
        batching=batching, startup=copy.deepcopy(engine.startup), notes=notes,
    )


def startup_record(engine: Engine) -> StartupRecord | None:
    if engine.startup_seconds is None:  # an Engine built directly, not through from_pretrained
        return None
    graphs = engine.graphs.describe() if engine.graphs is not None else {"count": 0, "capture_seconds": 0.0}
    tuning = engine.tile_tuning
    return StartupRecord(total_s=engine.startup_seconds,
                         compile_and_capture_s=graphs["capture_seconds"] + (tuning.seconds if tuning else 0.0),
                         cuda_graphs=graphs["count"], programmatic_dependent_launch=engine.plan.pdl,
                         streaming_gemv=engine.plan.stream_gemv, tile_tuning_s=tuning.seconds if tuning else 0.0,
                         tiles_from_cache=bool(tuning and tuning.source in ("cache", "shipped")),
                         plan=engine.plan.describe())


def steady_energy(engine: Engine, anatomy: Anatomy, repeats: int, hz: float = 100.0) -> None:
    """`--repeat N` after a measured call: steady-state J per prefill token and per decode token (probe/energy.py),
    into anatomy.steady_energy, with notes on what fell short."""
    if not anatomy.telemetry.available:
        anatomy.notes.append(f"--repeat: no steady-state energy: {anatomy.telemetry.note}")
        return
    sampling = {k: v for k, v in anatomy.request.get("sampling", {}).items() if k != "max_tokens"}
    records, notes = measure_steady_energy(
        engine, anatomy.prompt_token_ids, anatomy.prompt_token_ids + anatomy.output_token_ids, sampling, repeats,
        anatomy.telemetry.counter_update_ms, anatomy.decode.itl_ms_median if anatomy.decode else None,
        GpuTelemetry(engine.device, hz))
    anatomy.steady_energy = records
    anatomy.notes.extend(notes)
