"""Energy from synthetic NVML sample streams: a total-energy counter that publishes every 100 ms the energy spent up
to that instant, polled every 10 ms; figures and intervals against hand-computed values."""

import time

import pytest
import torch

from llm_anatomy import Engine
from llm_anatomy.probe.clock import Clock
from llm_anatomy.probe.energy import (PowerModel, Update, Work, counter_updates, measure_steady_energy, span_energy,
                                      steady_rate, update_period_ms)
from llm_anatomy.probe.recorder import energy_records
from llm_anatomy.probe.telemetry import RawSample


def energy(power, t_ms: float) -> float:
    """Joules spent from 0 to t_ms by `power`: a list of (from_ms, watts), from -inf, in time order."""
    total = 0.0
    for i, (t0, watts) in enumerate(power):
        t1 = power[i + 1][0] if i + 1 < len(power) else float("inf")
        total += watts * max(0.0, min(t_ms, t1) - max(0.0, t0)) / 1e3
    if t_ms < 0:  # before 0: the first segment's power, negative energy
        total = power[0][1] * t_ms / 1e3
    return total


def stream(power, t_from=0.0, t_to=1000.0, period=100.0, phase=95.0, poll=10.0, base=1000.0):
    """(t_ms, counter J) samples every `poll` ms; the counter publishes at phase + k period the energy up to then."""
    points, t = [], t_from
    while t <= t_to + 1e-9:
        published = phase + ((t - phase) // period) * period
        points.append((t, base + energy(power, published)))
        t += poll
    return points


def test_the_first_sample_is_not_an_update():
    points = [(0.0, 5.0), (10.0, 5.0), (20.0, 6.0), (30.0, 6.0), (40.0, 7.5)]
    assert counter_updates(points) == [Update(10.0, 20.0, 6.0), Update(30.0, 40.0, 7.5)]
    assert update_period_ms(counter_updates(points)) == 20.0


def test_constant_power_span_and_its_bounds():
    """500 W; updates published at 95, 195, ... and seen one poll later. [250, 720]: 235 J spent; certainly
    inside: 295..695 (200 J); at most: 195..795 (300 J)."""
    updates = counter_updates(stream([(float("-inf"), 500.0)]))
    assert [u.ms for u in updates[:3]] == [95.0, 195.0, 295.0]
    e = span_energy(updates, 250.0, 720.0)
    assert (e.joules, e.low_j, e.high_j) == pytest.approx((235.0, 200.0, 300.0))


def test_a_span_shorter_than_the_update_interval_has_a_one_sided_interval():
    updates = counter_updates(stream([(float("-inf"), 500.0)]))
    e = span_energy(updates, 310.0, 340.0)  # 15 J spent; no update inside; 295..395 around it
    assert (e.joules, e.low_j, e.high_j) == pytest.approx((15.0, 0.0, 50.0))


def test_a_power_step_inside_an_interval():
    """200 W until 400 ms, 600 W after. [350, 460] spent 10 + 36 = 46 J. The even spread reads 70 J at 350 (59 at
    295, 79 at 395) and 116.7 at 460 (79 at 395, 137 at 495): 46.7 J; no whole interval inside; 59..137 around."""
    updates = counter_updates(stream([(float("-inf"), 200.0), (400.0, 600.0)], base=0.0))
    e = span_energy(updates, 350.0, 460.0)
    assert (e.joules, e.low_j, e.high_j) == pytest.approx((46.7, 0.0, 78.0))
    assert e.low_j <= 46.0 <= e.high_j


def test_no_update_after_the_span_leaves_it_without_an_upper_bound():
    updates = counter_updates(stream([(float("-inf"), 500.0)], t_to=750.0))
    e = span_energy(updates, 600.0, 740.0)
    assert e.high_j is None and e.joules == pytest.approx(70.0)


def test_a_call_between_idle_stretches_is_measured_whole():
    """60 W idle, 540 W from 45 to 1045 ms: 540 J. Spread evenly, the two intervals the call begins and ends in
    (each half idle) would give it 12 J too little at each end; with the idle power from the whole intervals
    outside it, nothing is lost."""
    power = [(float("-inf"), 60.0), (45.0, 540.0), (1045.0, 60.0)]
    updates = counter_updates(stream(power, t_from=-200.0, t_to=1300.0))
    even = span_energy(updates, 45.0, 1045.0)
    assert even.joules == pytest.approx(516.0)
    model = PowerModel.build(updates, busy=(45.0, 1045.0))
    assert model.idle_w == pytest.approx(60.0)
    e = span_energy(updates, 45.0, 1045.0, model)
    assert e.joules == pytest.approx(540.0)
    assert (e.low_j, e.high_j) == pytest.approx((486.0, 546.0))  # 95..995 inside; -5..1095 around


def samples_of(points, t0_ns: int) -> list[RawSample]:
    return [RawSample(t0_ns + int(t * 1e6), 500_000, int(round(j * 1e3)), None, None, None, None, None, None, None)
            for t, j in points]


def test_phase_energies_add_up_to_the_call_and_flag_short_phases():
    """A 1-s call: front 0-2 ms, a 6-ms prefill, then decode; idle 80 W around, 500 W while busy."""
    clock = Clock(torch.device("cpu"), t0_ns=10**12)
    power = [(float("-inf"), 80.0), (2.0, 500.0), (1002.0, 80.0)]
    points = stream(power, t_from=-250.0, t_to=1250.0)
    spans = {"before_prefill": (0.0, 2.0, 0), "prefill": (2.0, 8.0, 16), "decode": (8.0, 1002.0, 200),
             "call": (0.0, 1002.0, 201)}
    records, period = energy_records(samples_of(points, clock.t0_ns), clock, spans, busy=(2.0, 1002.0))
    e = {r.phase: r for r in records}
    assert period == pytest.approx(100.0)
    assert e["before_prefill"].joules + e["prefill"].joules + e["decode"].joules == pytest.approx(e["call"].joules)
    assert e["call"].joules == pytest.approx(0.002 * 80 + 500.0, rel=1e-6)
    assert e["prefill"].joules == pytest.approx(3.0) and e["prefill"].per_token_j == pytest.approx(3.0 / 16)
    assert e["prefill"].shorter_than_update and e["prefill"].low_j == 0 and "--repeat" in e["prefill"].method
    assert not e["decode"].shorter_than_update and e["decode"].low_j <= e["decode"].joules <= e["decode"].high_j
    assert e["before_prefill"].per_token_j is None
    assert e["call"].uncertainty_j == pytest.approx(max(e["call"].joules - e["call"].low_j,
                                                        e["call"].high_j - e["call"].joules))


def test_steady_rate_over_whole_counter_intervals():
    """Prefills of 16 tokens every 7 ms at 400 W: 2.8 J each, 0.175 J per token in every interval."""
    work = [Work(7.0 * i, 7.0 * (i + 1), 16) for i in range(300)]  # 0..2100 ms
    updates = counter_updates(stream([(float("-inf"), 400.0)], t_to=2300.0))
    rate = steady_rate(updates, work)
    assert rate.j_per_token == pytest.approx(0.175)
    assert rate.low <= 0.175 <= rate.high and rate.rel_halfwidth < 0.02
    assert rate.window_ms == (95.0, 2095.0) and rate.joules == pytest.approx(800.0)  # 2095 seen at 2100: inside
    assert len(rate.intervals) == 20 and rate.intervals == pytest.approx([0.175] * 20)
    assert rate.rel_spread == pytest.approx(0.0, abs=1e-9)


def test_steady_rate_spread_and_too_short_a_run():
    # power alternating 300 / 500 W every 100 ms, in step with the counter: intervals read 0.13125 and 0.21875
    power = [(float("-inf"), 300.0)] + [(95.0 + 100 * k, 500.0 if k % 2 == 0 else 300.0) for k in range(30)]
    work = [Work(7.0 * i, 7.0 * (i + 1), 16) for i in range(400)]
    rate = steady_rate(counter_updates(stream(power, t_to=3000.0)), work)
    assert set(round(x, 6) for x in rate.intervals) == {0.13125, 0.21875}
    assert rate.rel_spread > 0.2 and rate.j_per_token == pytest.approx(0.175, rel=0.03)
    assert steady_rate(counter_updates(stream(power, t_to=3000.0)), work[:20]) is None  # 140 ms: one update inside


class FakeSampler:
    """GpuTelemetry's start/stop over a synthetic counter at `watts`, publishing every `period` ms, polled every ms."""

    def __init__(self, watts: float, period: float):
        self.watts, self.period = watts, period

    def start(self):
        self.t0 = time.perf_counter_ns() - 50_000_000

    def stop(self, end_ns):
        out, t = [], self.t0
        while t <= end_ns + 3 * self.period * 1e6:
            published = (t - self.t0) // int(self.period * 1e6) * self.period  # ms since t0
            out.append(RawSample(t, None, int(self.watts * published), None, None, None, None, None, None, None))
            t += 1_000_000
        return out


def test_repeat_runs_give_steady_figures(save_tiny):
    directory, _ = save_tiny()
    engine = Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=4096)
    prompt, output = list(range(10, 30)), list(range(40, 44))
    records, notes = measure_steady_energy(engine, prompt, prompt + output, {"temperature": 0}, 3, period_ms=5.0,
                                           itl_ms=1.0, sampler=FakeSampler(100.0, 5.0))
    by = {r.phase: r for r in records}
    assert set(by) == {"prefill", "decode"}, notes
    p, d = by["prefill"], by["decode"]
    assert p.repeats >= 3 and p.tokens_per_repeat == 20 and p.context_start == p.context_end == 20
    assert d.tokens_per_repeat == 1 and d.context_start == 25 and d.context_end == 24 + d.repeats
    # The prefills run until they span the updates wanted (22 periods); the decode run takes as many steps as those
    # periods at the given inter-token latency (1 ms), however long this machine's steps really take
    assert p.counter_updates >= 20 and p.seconds >= 22 * 5.0 / 1e3
    assert d.repeats >= 22 * 5.0 / 1.0
    for r in (p, d):
        assert r.joules == pytest.approx(100.0 * r.window_ms / 1e3)  # constant power: the window's energy exactly
        assert r.j_per_token_low <= r.j_per_token <= r.j_per_token_high
        halfwidth = (r.j_per_token_high - r.j_per_token_low) / 2 / r.j_per_token
        assert r.within_target == (halfwidth <= 0.05 and r.standard_error <= 0.05)
        assert "back to back" in r.method or "decoding" in r.method
    assert engine.pool.num_free_blocks == engine.pool.num_blocks  # every repeat's blocks given back


@pytest.mark.parametrize("argv,message", [
    (["--repeat", "0"], "--repeat must be >= 1, got 0"),
    (["--repeat", "100001"], "--repeat must be <= 100000"),
    (["--repeat", "5", "--device", "cpu"], "it needs a CUDA GPU and telemetry"),
])
def test_cli_repeat_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    from llm_anatomy.cli import main

    code = main(["call", "hi", "--no-calibrate", "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


class FakeNvml:
    """The calls telemetry._read makes; the energy counter steps by 1 J every `every` reads (None: no counter)."""

    class NVMLError(Exception):
        pass

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 0, 1, 0

    def __init__(self, every: int | None):
        self.every, self.reads = every, 0

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        self.reads += 1
        if self.every is None:
            raise self.NVMLError("not supported")
        return self.reads // self.every * 1000

    def _unsupported(self, *args):
        raise self.NVMLError("not supported")

    nvmlDeviceGetPowerUsage = nvmlDeviceGetClockInfo = nvmlDeviceGetUtilizationRates = _unsupported
    nvmlDeviceGetMemoryInfo = nvmlDeviceGetTemperature = nvmlDeviceGetCurrentClocksEventReasons = _unsupported


def test_the_sampler_waits_for_counter_updates_around_the_window():
    from llm_anatomy.probe.telemetry import UPDATES_AROUND, _read, _sample_until_updates

    nvml = FakeNvml(every=3)
    samples = [_read(nvml, None)]
    _sample_until_updates(nvml, None, samples, 0.0, samples[0].t_ns, time.perf_counter() + 5)
    assert len(counter_updates([(s.t_ns / 1e6, s.energy_mj) for s in samples])) == UPDATES_AROUND == 2
    # after an instant: only changes between samples taken from then on count
    end_ns = time.perf_counter_ns()
    before = len(samples)
    _sample_until_updates(nvml, None, samples, 0.0, end_ns, time.perf_counter() + 5)
    after = [(s.t_ns / 1e6, s.energy_mj) for s in samples[before - 1:]]
    assert [u for u in counter_updates(after) if u.earliest_ms >= end_ns / 1e6][:2] == counter_updates(after)[-2:]
    # a counter that never moves: gives up at the deadline; no counter at all: does not wait
    still = FakeNvml(every=10**9)
    samples = [_read(still, None)]
    t = time.perf_counter()
    _sample_until_updates(still, None, samples, 0.001, samples[0].t_ns, t + 0.05)
    assert 0.05 <= time.perf_counter() - t < 1.0
    none = FakeNvml(every=None)
    samples = [_read(none, None)]
    _sample_until_updates(none, None, samples, 0.0, samples[0].t_ns, time.perf_counter() + 5)
    assert len(samples) == 2 and samples[-1].energy_mj is None


def test_a_window_with_no_whole_unit_inside_has_no_upper_bound():
    work = [Work(0.0, 400.0, 16), Work(400.0, 800.0, 16)]  # two long units; updates at 95..795 inside
    rate = steady_rate(counter_updates(stream([(float("-inf"), 400.0)], t_to=900.0)), work)
    assert rate.high is None and rate.rel_halfwidth == float("inf") and rate.j_per_token == pytest.approx(10.0)


def test_the_servers_telemetry_window_holds_the_calls_samples_and_margins_only():
    """A call's window from the stream's deque: every sample within the margins, in order, none outside (the
    deque scanned from its newest end)."""
    import collections
    import threading

    from llm_anatomy.probe.telemetry import TelemetryStream

    stream = object.__new__(TelemetryStream)  # its samples only: no device, no sampling process
    stream._lock = threading.Lock()
    stream._samples = collections.deque(RawSample(t * 20, None, None, None, None, None, None, None, None, None)
                                        for t in range(1000))  # every 20 ns, 0 .. 19,980
    times = [s.t_ns for s in stream.window(5_000, 6_000, margin_ns=100)]
    assert times == list(range(4_900, 6_101, 20))
    assert [s.t_ns for s in stream.window(0, 10, margin_ns=0)] == [0]
    assert [s.t_ns for s in stream.window(19_990, 30_000, margin_ns=5)] == []
    assert [s.t_ns for s in stream.window(19_970, 30_000, margin_ns=0)] == [19_980]
    assert stream.window(30_000, 40_000, margin_ns=0) == [] and len(stream.window(-10, 10**9, margin_ns=0)) == 1000
