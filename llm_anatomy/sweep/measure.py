"""One sweep point, measured with the project's own machinery: the engine's observer hooks and the Recorder
(one clock, device events per step), the cost model for FLOPs and bytes, NVML telemetry for energy, and one
Anatomy record of the point's first sequence."""

from __future__ import annotations

import math
import statistics
import time
import uuid
from dataclasses import dataclass, field

import torch

from ..anatomy import Anatomy, Ceilings
from ..engine.scheduler import Sequence
from ..probe.call import Marks, TelemetryWindow, build_anatomy
from ..probe.clock import Clock
from ..probe.cost import Cost
from ..probe.recorder import Recorder, RequestTrace, StepRecord, roofline, step_cost
from .energy import TokenClock, phase_energy, wait_for_update_after
from .grid import Point

# Prompt ids are drawn below the first special token (151643 in the Qwen vocabulary), so that no prompt holds
# an end-of-text or chat-template token by chance.
FIRST_SPECIAL_TOKEN = 151643


class KVPoolExhausted(RuntimeError):
    """The engine could schedule nothing while sequences were waiting."""


@dataclass
class Run:
    """B sequences run together to completion: their traces (one Recorder, one clock) and the run's instants."""

    t0_ns: int
    t_end_ns: int
    traces: list[RequestTrace]
    seqs: list[Sequence]
    steps: list[StepRecord] = field(default_factory=list)  # one record per engine step, in order

    def __post_init__(self):
        seen: dict[int, StepRecord] = {}
        for trace in self.traces:
            for r in trace.chunks + trace.steps:
                seen.setdefault(r.step.index, r)
        self.steps = [seen[i] for i in sorted(seen)]

    @property
    def prefill_steps(self) -> list[StepRecord]:
        return [r for r in self.steps if r.step.is_prefill]

    @property
    def decode_steps(self) -> list[StepRecord]:
        return [r for r in self.steps if not r.step.is_prefill]

    @property
    def prefill_end_ns(self) -> int:
        return max(r.step.t_end_ns for r in self.prefill_steps)

    def walls_ms(self) -> dict[int, float]:
        """Each step's wall time: from the previous step's end (the run's start for the first) to its own, what
        time to first token and time per output token are made of."""
        out, previous = {}, self.t0_ns
        for r in self.steps:
            out[r.step.index] = (r.step.t_end_ns - previous) / 1e6
            previous = r.step.t_end_ns
        return out


def prompts_for(point: Point, vocab_size: int, seed: int) -> list[list[int]]:
    """B different prompts of the point's length, the same for every run of the point (seeded)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + point.prompt_tokens * 7919 + point.batch)
    high = min(vocab_size, FIRST_SPECIAL_TOKEN)
    return torch.randint(0, high, (point.batch, point.prompt_tokens), generator=gen).tolist()


def run_batch(engine, prompts: list[list[int]], max_tokens: int) -> Run:
    """Run the prompts together to `max_tokens` each (greedy, EOS ignored), traced by a Recorder. On any
    exception (out of memory, an interrupt) the sequences are aborted, so their KV blocks go back to the pool."""
    recorder = Recorder(Clock(engine.device))
    params = engine.sampling_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tag = uuid.uuid4().hex[:8]
    ids = [f"sweep-{tag}-{i}" for i in range(len(prompts))]
    t0 = time.perf_counter_ns()
    traces = [recorder.watch(rid, t0_ns=t0) for rid in ids]
    seqs: list[Sequence] = []
    engine.observers.append(recorder)
    try:
        for rid, ids_ in zip(ids, prompts):
            seqs.append(engine.add_request(ids_, params, request_id=rid))
        while not all(s.finished for s in seqs):
            if not engine.step():  # nothing could be scheduled: the KV pool cannot hold what waits
                raise KVPoolExhausted(f"the KV pool ({engine.pool.num_free_blocks} of {engine.pool.num_blocks} "
                                      f"blocks free) cannot admit the {len(prompts)} sequences")
    except BaseException:
        engine.reset_pipeline()
        for s in seqs:
            engine.abort(s)
        raise
    finally:
        engine.observers.remove(recorder)
    return Run(t0, time.perf_counter_ns(), traces, seqs)


def _total(costs: list[Cost]) -> Cost:
    parts: dict[str, dict[str, float]] = {}
    for c in costs:
        for name, p in c.parts.items():
            mine = parts.setdefault(name, {"flops": 0.0, "bytes": 0.0})
            mine["flops"] += p.get("flops", 0.0)
            mine["bytes"] += p.get("bytes", 0.0)
    return Cost(sum(c.flops for c in costs), sum(c.bytes for c in costs), parts)


def _scaled_parts(cost: Cost, factor: float) -> dict[str, dict[str, float]]:
    return {name: {k: v * factor for k, v in p.items()} for name, p in cost.parts.items()}


def latency_figures(engine, point: Point, run: Run, ceilings: Ceilings) -> dict:
    """TTFT, TPOT, throughput, prefill FLOP rate and MFU, decode bandwidth and MBU, from the run's steps."""
    walls = run.walls_ms()
    prefill, decode = run.prefill_steps, run.decode_steps
    first = [(t.steps[0].step.t_end_ns - run.t0_ns) / 1e6 for t in run.traces]
    tpots = [(t.steps[-1].step.t_end_ns - t.steps[0].step.t_end_ns) / 1e6 / (len(t.steps) - 1)
             for t in run.traces if len(t.steps) > 1]
    elapsed_s = (max(t.steps[-1].step.t_end_ns for t in run.traces) - run.t0_ns) / 1e9
    pcost = _total([step_cost(engine, r) for r in prefill])
    p_device_ms = sum(r.timing.ms() for r in prefill)
    p_wall_ms = (run.prefill_end_ns - run.t0_ns) / 1e6
    pline = roofline(pcost, p_device_ms / 1e3, p_wall_ms / 1e3, ceilings)
    out = {
        "ttft_ms": statistics.median(first), "ttft_ms_max": max(first),
        "prefill_ms": p_device_ms, "prefill_wall_ms": p_wall_ms, "prefill_flops": pcost.flops,
        "prefill_bytes": pcost.bytes, "prefill_tflops": pline.achieved_tflops, "prefill_mfu": pline.mfu,
        "prefill_mfu_datasheet": pline.mfu_datasheet, "prefill_bound": pline.bound.kind,
        "tpot_ms": statistics.median(tpots) if tpots else None,
        "output_tokens_per_s": point.batch * point.output_tokens / elapsed_s,
        "total_tokens_per_s": point.batch * point.tokens_per_sequence / elapsed_s,
        "elapsed_ms": elapsed_s * 1e3,
        "steps": {"prefill": [{"tokens": r.step.num_tokens, "seqs": len(r.step.seqs),
                               "first_tokens": sum(t is not None for t in r.step.tokens),
                               "wall_ms": walls[r.step.index], "device_ms": r.timing.ms(),
                               "parts": step_cost(engine, r).parts} for r in prefill]},
    }
    if decode:
        dcost = _total([step_cost(engine, r) for r in decode])
        d_device_ms = sum(r.timing.ms() for r in decode)
        d_wall_ms = sum(walls[r.step.index] for r in decode)
        dline = roofline(dcost, d_device_ms / 1e3, d_wall_ms / 1e3, ceilings)
        n = len(decode)
        out.update({
            "decode_steps": n, "decode_step_ms": d_device_ms / n, "decode_step_wall_ms": d_wall_ms / n,
            "decode_context_mean": statistics.fmean(statistics.fmean(r.step.context_lens) for r in decode),
            "decode_bytes_per_step": dcost.bytes / n, "decode_flops_per_step": dcost.flops / n,
            "decode_kv_share": dcost.part("kv_read", "bytes") / dcost.bytes if dcost.bytes else None,
            "decode_gbps": dline.achieved_gbps, "decode_mbu": dline.mbu, "decode_mbu_datasheet": dline.mbu_datasheet,
            "decode_bound": dline.bound.kind,
        })
        out["steps"]["decode"] = {"steps": n, "wall_ms": d_wall_ms, "device_ms": d_device_ms,
                                  "batch": statistics.fmean(len(r.step.seqs) for r in decode),
                                  "parts": _scaled_parts(dcost, 1 / n)}
    return out


@dataclass(frozen=True)
class Telemetry:
    """The sweep's NVML stream (one for the whole sweep), or why there is none."""

    stream: object | None
    note: str
    hz: float = 100.0


def _repeat_prefill(engine, prompts: list[list[int]], seconds: float) -> list[Run]:
    """The point's prefill (its prompts, one token each) again and again, until the repeats last `seconds`."""
    runs = [run_batch(engine, prompts, 1)]
    while (runs[-1].prefill_end_ns - runs[0].t0_ns) / 1e9 < seconds and len(runs) < 100_000:
        runs.append(run_batch(engine, prompts, 1))
    return runs


def _decode_block(engine, point: Point, prompts: list[list[int]], seconds: float, step_s: float) -> tuple[Run, int]:
    """A run whose decode lasts `seconds`: as many steps as that takes at the point's step time, more if it fell
    short, but no more than the pool and the context allow."""
    pool = engine.pool
    most = min(pool.num_blocks // point.batch * pool.block_size, engine.max_model_len) - point.prompt_tokens
    steps = max(point.output_tokens, min(math.ceil(seconds / max(step_s, 1e-6)) + 1, most))
    while True:
        run = run_batch(engine, prompts, steps)
        lasted = (run.t_end_ns - run.prefill_end_ns) / 1e9
        if lasted >= seconds or steps >= most:
            return run, steps
        steps = min(most, math.ceil(steps * 1.2 * seconds / max(lasted, 1e-6)))


def energy_figures(engine, point: Point, prompts: list[list[int]], run: Run, telemetry: Telemetry,
                   seconds: float) -> dict:
    """Steady-state J per prompt token and per output token. A phase that lasts at least `seconds` in the
    point's run is measured there; a shorter one is repeated back to back until it does."""
    if telemetry.stream is None:
        return {"prefill": None, "decode": None, "note": telemetry.note}
    period = 1 / telemetry.hz
    prefill_s = (run.prefill_end_ns - run.t0_ns) / 1e9
    if prefill_s >= seconds:
        p_runs, how = [run], "the point's own prefill"
    else:
        p_runs = _repeat_prefill(engine, prompts, seconds)
        how = (f"the point's prefill repeated {len(p_runs)} times back to back (the point's own lasted "
               f"{prefill_s * 1e3:.1f} ms)")
    p_steps = [(r.step.t_end_ns, r.step.num_tokens) for x in p_runs for r in x.prefill_steps]
    p_span = (p_runs[0].t0_ns, p_runs[-1].prefill_end_ns)
    decode_s = (run.t_end_ns - run.prefill_end_ns) / 1e9 if run.decode_steps else 0.0
    d_run, d_how = run, "the point's own decode"
    if run.decode_steps and decode_s < seconds:
        step_s = decode_s / len(run.decode_steps)
        d_run, steps = _decode_block(engine, point, prompts, seconds, step_s)
        d_how = (f"a block of {steps - 1} decode steps from the point's prompt (the point's own {len(run.decode_steps)} "
                 f"last {decode_s * 1e3:.1f} ms): contexts {point.prompt_tokens + 1}..{point.prompt_tokens + steps - 1}")
    end = max(p_runs[-1].t_end_ns, d_run.t_end_ns)
    wait_for_update_after(telemetry.stream, end)
    samples = telemetry.stream.window(min(run.t0_ns, p_runs[0].t0_ns), end)
    prefill = phase_energy(samples, [p_span], TokenClock(p_span[0], p_steps), period, how)
    decode = None
    if run.decode_steps:
        d_start = d_run.prefill_end_ns
        d_steps = [(r.step.t_end_ns, len(r.step.seqs)) for r in d_run.decode_steps]
        decode = phase_energy(samples, [(d_start, d_run.t_end_ns)], TokenClock(d_start, d_steps), period, d_how)
    note = "" if prefill and (decode or not run.decode_steps) else (
        "a phase spanned fewer than two energy-counter updates, even repeated: no figure for it")
    return {"prefill": prefill.describe() if prefill else None, "decode": decode.describe() if decode else None,
            "note": note}


def point_anatomy(engine, point: Point, run: Run, ceilings: Ceilings, telemetry: Telemetry, device_why: str,
                  activation_peak: int | None) -> Anatomy:
    """The Anatomy of the point's first sequence, as `call` would record it (batched: shares shown as such)."""
    trace, seq = run.traces[0], run.seqs[0]
    samples = telemetry.stream.window(run.t0_ns, run.t_end_ns) if telemetry.stream is not None else []
    window = TelemetryWindow(samples, telemetry.stream is not None, telemetry.note, telemetry.hz)
    marks = Marks(run.t0_ns, run.t0_ns, run.t0_ns, run.t0_ns, trace.finished_ns or run.t_end_ns)
    request = {"sweep_point": point.key, "prompt_tokens": point.prompt_tokens, "batch": point.batch,
               "sampling": {"max_tokens": point.output_tokens, "temperature": 0.0, "ignore_eos": True}}
    notes = [f"Sweep point: {point.label}; this is the first of its {point.batch} sequences."]
    return build_anatomy(engine, request, engine.result(seq), trace, ceilings, window, device_why, marks,
                         activation_peak, notes)
