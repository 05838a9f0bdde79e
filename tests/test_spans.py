"""Phase spans that tile the call (decode starts when the first token is emitted, even with lookahead), their
energies adding up to the call's, and the metric definitions the record carries."""

import statistics
import time

import pytest
import torch

from llm_anatomy import Engine
from llm_anatomy.anatomy import METRIC_DEFINITIONS, Ceilings, percentile
from llm_anatomy.probe.call import CallRequest, Marks, TelemetryWindow, build_anatomy, measure_call
from llm_anatomy.probe.telemetry import RawSample

CEILINGS = Ceilings("cpu", read_gbps=20.0, gemv_gbps=15.0, matmul_tflops=0.5, datasheet_gbps=None,
                    datasheet_tflops=None, measured_at="2026-11-29")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from conftest import tiny_hf_model

    directory = tmp_path_factory.mktemp("tiny")
    tiny_hf_model(initializer_range=0.2).save_pretrained(directory)
    # lookahead on the CPU too: decode step 1 is launched before the prefill's token is read back, as on a GPU
    return Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=256, block_size=4,
                                  lookahead=True)


@pytest.fixture(scope="module")
def measured(engine):
    request = CallRequest(prompt_token_ids=list(range(5, 25)), sampling=dict(max_tokens=7, temperature=0,
                                                                             ignore_eos=True))
    return measure_call(engine, request, CEILINGS)[1]


def test_phases_tile_the_call_without_overlap(measured):
    a = measured
    phases = {p.name: p for p in a.phases}
    assert phases["prefill"].end_ms == phases["decode"].start_ms == a.ttft_ms
    assert phases["decode"].end_ms == phases["e2e"].end_ms == a.e2e_ms
    names = ["parse", "template", "tokenize", "queue", "prefill", "decode"]
    for before, after in zip(names, names[1:]):
        assert phases[before].end_ms == phases[after].start_ms


def test_decode_steps_tile_the_decode_phase_and_keep_their_launch(measured):
    a = measured
    steps = a.decode_steps
    assert steps[0].start_ms == a.ttft_ms
    assert all(s.start_ms == prev.end_ms for prev, s in zip(steps, steps[1:]))
    assert [s.end_ms - s.start_ms for s in steps] == pytest.approx(a.itl_ms)
    assert steps[0].launch_ms < steps[0].start_ms  # launched ahead, while the prefill's token was read back
    assert all(s.launch_ms is not None and s.gpu_start_ms is not None for s in steps)


def test_decode_throughput_is_one_over_tpot(measured):
    a = measured
    assert a.tpot_ms == pytest.approx((a.e2e_ms - a.ttft_ms) / (len(a.output_token_ids) - 1))
    assert a.decode.tokens_per_s == pytest.approx(1000 / a.tpot_ms)


def test_phase_energies_add_up_to_the_call(engine):
    """Synthetic counter, 400 W: the decode span starts at the first token, so its energy leaves the prefill out,
    and before-prefill + prefill + decode is the call's."""
    from llm_anatomy.probe.clock import Clock
    from llm_anatomy.probe.recorder import Recorder

    recorder = Recorder(Clock(engine.device))
    engine.observers.append(recorder)
    t0 = time.perf_counter_ns()
    trace = recorder.watch("r", t0)
    try:
        seq = engine.add_request(list(range(5, 25)), engine.sampling_params(max_tokens=6, temperature=0,
                                                                             ignore_eos=True), request_id="r")
        while not seq.finished:
            engine.step()
    finally:
        engine.observers.remove(recorder)
    end = trace.finished_ns
    # counter publishes every 20 ms the energy at 400 W (0.4 mJ per us), polled every 2 ms
    samples = [RawSample(t, None, (t - t0 + 10**9) // 20_000_000 * 8_000, None, None, None, None, None, None, None)
               for t in range(t0 - 100_000_000, end + 100_000_000, 2_000_000)]
    a = build_anatomy(engine, {}, engine.result(seq), trace, CEILINGS, TelemetryWindow(samples, True, "", 500.0), "",
                      Marks(t0, t0, t0, t0, end), alone=True)
    e = {r.phase: r for r in a.telemetry.energy}
    assert e["decode"].start_ms == a.ttft_ms and e["prefill"].end_ms == a.ttft_ms
    parts = e["before_prefill"].joules + e["prefill"].joules + e["decode"].joules
    assert parts == pytest.approx(e["call"].joules)
    assert e["call"].joules == pytest.approx(0.4 * a.e2e_ms, rel=1e-6)  # constant power: exact
    assert e["decode"].joules == pytest.approx(0.4 * (a.e2e_ms - a.ttft_ms), rel=1e-6)
    assert e["decode"].per_token_j == pytest.approx(e["decode"].joules / 5)


def test_one_percentile_definition():
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0, 3.5, 8.9, 7.9, 3.2]
    for q in (10, 50, 90, 99):
        assert percentile(values, q) == pytest.approx(statistics.quantiles(values, n=100, method="inclusive")[q - 1])
    assert percentile(values, 50) == statistics.median(values)
    assert percentile([], 90) is None and percentile([2.0], 90) == 2.0
    with pytest.raises(ValueError, match="0..100"):
        percentile(values, 101)


def test_the_record_defines_its_metrics(measured):
    a = measured
    assert a.definitions == METRIC_DEFINITIONS
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "decode_tokens_per_s", "percentile", "energy_j", "bytes"):
        assert key in a.definitions
    assert "linear interpolation" in a.definitions["percentile"]
    assert a.decode.itl_ms_p90 == percentile(a.itl_ms, 90) and a.decode.itl_ms_median == percentile(a.itl_ms, 50)


def test_activation_peak_is_labelled(measured):
    memory = measured.memory
    assert memory.activation_peak is None and "not measured on the host" in memory.activation_peak_note


def test_batched_decode_steps_share_step_facts_yet_each_sees_its_own_batch_changes(engine):
    """Requests that join and leave a batch at different steps: the facts computed once per pair of steps
    (batch size, step tokens, joined and left, cost, roofline) are those of each request's own previous step, and
    the record's plain form is dataclasses.asdict's."""
    import dataclasses

    from llm_anatomy.probe.clock import Clock
    from llm_anatomy.probe.cost import decode_cost, device_shapes
    from llm_anatomy.probe.recorder import Recorder, roofline

    recorder = Recorder(Clock(engine.device))
    engine.observers.append(recorder)
    t0 = time.perf_counter_ns()
    seqs, traces, step = {}, {}, 0
    try:
        while len(seqs) < 4 or engine.has_work():
            if step % 2 == 0 and len(seqs) < 4:  # one joins every other step, each wanting a different length
                rid = f"r{len(seqs)}"
                traces[rid] = recorder.watch(rid, t0)
                seqs[rid] = engine.add_request(list(range(5, 9 + len(seqs))), engine.sampling_params(
                    max_tokens=4 + 2 * len(seqs), temperature=0, ignore_eos=True), request_id=rid)
            engine.step()
            step += 1
    finally:
        engine.observers.remove(recorder)
    shapes = device_shapes(engine.device, engine.plan)
    changed = 0
    for rid, trace in traces.items():
        a = build_anatomy(engine, {}, engine.result(seqs[rid]), trace, CEILINGS,
                          TelemetryWindow([], False, "", 0.0), "", Marks(t0, t0, t0, t0, trace.finished_ns))
        assert a.to_dict() == dataclasses.asdict(a)
        for s, r, previous in zip(a.decode_steps, trace.steps[1:], trace.steps):
            members = {x.request_id for x in r.step.seqs}
            before = {x.request_id for x in previous.step.seqs}
            assert (s.joined, s.left) == (sorted(members - before), sorted(before - members))
            assert s.batch_size == len(r.step.seqs) and s.step_tokens == sum(r.step.query_lens)
            assert s.context_len == r.step.context_lens[r.position] and s.token_id == r.step.tokens[r.position]
            if not r.step.is_prefill:
                cost = decode_cost(engine.config, engine.dtype, r.step.context_lens, shapes=shapes)
                line = roofline(cost, s.gpu_ms / 1e3, (r.step.t_end_ns - previous.step.t_end_ns) / 1e9, CEILINGS)
                assert (s.flops, s.bytes, s.mbu, s.bound) == (cost.flops, cost.bytes, line.mbu, line.bound.kind)
            changed += bool(s.joined or s.left)
    assert changed  # the batch did change under some request's steps
