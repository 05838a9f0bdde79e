"""The anatomy builder's process: it builds what this process would, builds at once what someone asks for,
drops the oldest unbuilt past its backlog (their metrics still counted), finishes what is queued at stop, and
its death costs the calls it held, not the server. What the builder sends is taken here as the HTTP process
takes it (EngineClient._handle): into the store, the metrics and the calls' mailboxes."""

import json
import pickle
import time
from types import SimpleNamespace

import pytest
import torch

from llm_anatomy.probe.call import Marks, build_anatomy
from llm_anatomy.probe.clock import Clock
from llm_anatomy.engine.sampling import SamplingParams
from llm_anatomy.probe.recorder import Recorder
from llm_anatomy.server.anatomies import AnatomyBuilder, AnatomyBuilders, Child, default_builders
from llm_anatomy.server.anatomy_process import SERVED_NOTES, Builder
from llm_anatomy.server.core import CoreCall
from llm_anatomy.server.loop import Call, EngineClient
from llm_anatomy.server.metrics import Metrics
from llm_anatomy.server.store import AnatomyStore
from test_server import CEILINGS


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from conftest import tiny_hf_model
    from llm_anatomy import Engine

    directory = tmp_path_factory.mktemp("tiny")
    tiny_hf_model(initializer_range=0.2).save_pretrained(directory)
    return Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=512, block_size=4,
                                  lookahead=True)


class NowLoop:
    """Stands in for the event loop: runs what the builder posts at once."""

    @staticmethod
    def call_soon_threadsafe(fn, *args):
        fn(*args)


def finished_calls(engine, count: int):
    """`count` calls served together, joining one every other step (so that steps are shared, batches change
    and prefills stall the others): [(call, trace, result)], each call as the core holds it."""
    recorder = Recorder(Clock(engine.device))
    engine.observers.append(recorder)
    t0 = time.perf_counter_ns()
    seqs, traces, step = {}, {}, 0
    try:
        while len(seqs) < count or engine.has_work():
            if step % 2 == 0 and len(seqs) < count:
                rid = f"call{len(seqs):02d}"
                traces[rid] = recorder.watch(rid, t0)
                seqs[rid] = engine.add_request(list(range(5, 9 + len(seqs))), engine.sampling_params(
                    max_tokens=3 + 2 * len(seqs), temperature=0, ignore_eos=True), request_id=rid)
            engine.step()
            step += 1
    finally:
        engine.observers.remove(recorder)
    out = []
    for rid, trace in traces.items():
        request = SimpleNamespace(want_anatomy=False, shown={"prompt_token_ids": [5]}, chat=False)
        call = CoreCall(rid, request, Marks(t0, t0, t0, t0, trace.finished_ns), [5], None,
                        SamplingParams(temperature=0.0, max_tokens=3))
        out.append((call, trace, engine.result(seqs[rid])))
    return out


class Receiving(EngineClient):
    """The HTTP process's side of what the builder sends, without a core: `calls` are the HTTP side's calls (by the
    core's calls' ids)."""

    def __init__(self, store, core_calls):
        super().__init__(store, Metrics("m"))
        self.calls = {c.id: Call(c.id, c.request, c.marks, [5], None, c.params) for c, _, _ in core_calls}
        self._calls = dict(self.calls)
        self._event_loop = NowLoop()

    def __call__(self, message) -> None:
        self._handle(message)


def builder_for(engine, store, calls=(), **kw) -> tuple[AnatomyBuilder, Receiving]:
    http = Receiving(store, calls)
    return AnatomyBuilder(engine, CEILINGS, http, None, "off", "test", **kw), http


def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_builders_process_builds_the_anatomy_this_process_would(engine, tmp_path):
    """What travels (step snapshots once, each call's trace by index, pickled) rebuilds every field."""
    calls = finished_calls(engine, 4)
    builder, _ = builder_for(engine, AnatomyStore(tmp_path))
    far = Builder(pickle.loads(pickle.dumps(builder.setup)))
    sent: set[int] = set()
    shared_facts = []
    for call, trace, result in calls:
        job = builder._job(call, trace, result)
        here = build_anatomy(engine, job.request, result, trace, CEILINGS, job.window, "test", call.marks,
                             notes=list(SERVED_NOTES), state=job.state)
        new = {i: m.snapshot(s, trace.clock) for i, (s, m) in trace.shared_steps().items() if i not in sent}
        sent.update(new)
        built = far.take(*pickle.loads(pickle.dumps((new, job, trace.first_step()))))
        assert built.failure is None
        there = json.loads(built.json)
        mine = json.loads(here.to_json())
        assert there.pop("started_at_unix") == pytest.approx(mine.pop("started_at_unix"), abs=5)
        assert there == mine
        summary, expected = dict(built.summary), here.summary()
        summary.pop("started_at_unix", None), expected.pop("started_at_unix", None)
        assert summary == expected
        shared_facts.append(there["batching"]["stalls"] or any(d["joined"] or d["left"]
                                                               for d in there["decode_steps"]))
    assert any(shared_facts)  # batches changed and prefills stalled others: the shared step facts were exercised


def test_a_job_naming_a_step_never_sent_is_an_error_summary_and_the_builder_goes_on(engine, tmp_path):
    calls = finished_calls(engine, 2)
    builder, _ = builder_for(engine, AnatomyStore(tmp_path))
    far = Builder(builder.setup)
    call, trace, result = calls[0]
    broken = far.take({}, builder._job(call, trace, result), 0)  # its steps never sent
    assert broken.json is None and "KeyError" in broken.summary["error"] and broken.summary["id"] == call.id
    call, trace, result = calls[1]
    new = {i: m.snapshot(s, trace.clock) for i, (s, m) in trace.shared_steps().items()}
    assert far.take(new, builder._job(call, trace, result), 0).json is not None
    with pytest.raises(ValueError, match="in_flight"):
        builder_for(engine, AnatomyStore(tmp_path / "x"), in_flight=0)


def test_backlog_drops_the_oldest_wanted_goes_first_stop_builds_the_rest(engine, tmp_path):
    calls = finished_calls(engine, 5)
    store = AnatomyStore(tmp_path, keep=10)
    builder, http = builder_for(engine, store, calls, backlog=3, in_flight=1)
    for item in calls:
        builder.add(*item)  # not started: they wait, and the two oldest are pushed out
    # said by the sending thread, not by the step loop that adds (a report waits until it is written)
    assert not any(http.calls[c.id].anatomy_built for c, _, _ in calls)
    assert [c.id for c in builder._dropped] == ["call00", "call01"]
    builder.want("call04")
    builder.start()
    builder.stop()
    assert "too busy" in http.calls["call00"].anatomy["error"] and "too busy" in http.calls["call01"].anatomy["error"]
    assert http.metrics.anatomies_dropped.labels("m")._value.get() == 2
    assert store.ids()[0] == "call04" and sorted(store.ids()) == ["call02", "call03", "call04"]
    assert all(http.calls[c.id].anatomy_built and "error" not in http.calls[c.id].anatomy for c, _, _ in calls[2:])
    assert http.metrics.generation_tokens.labels("m")._value.get() == sum(3 + 2 * i for i in range(5))
    assert builder._child is None and builder._sender.is_alive() is False and builder._receiver.is_alive() is False
    store.close()


def test_the_step_loop_pushing_calls_out_of_the_backlog_sends_nothing_itself(engine):
    """A send waits until the HTTP process has the message; the step loop (add) must never wait for that pipe."""
    sent = []
    builder = AnatomyBuilder(engine, CEILINGS, sent.append, None, "off", "test", backlog=1)
    for item in finished_calls(engine, 4):
        builder.add(*item)
    assert sent == [] and len(builder._dropped) == 3 and len(builder._waiting) == 1


def test_the_oldest_step_a_waiting_call_reads_is_kept_without_scanning_them(engine, tmp_path):
    """The steps the child must keep: from the lowest first step among the calls still waiting, found through a
    heap whose entries of calls no longer waiting are skipped (and dropped wholesale when they pile up)."""
    calls = finished_calls(engine, 5)
    builder, _ = builder_for(engine, AnatomyStore(tmp_path, keep=10), calls, backlog=3)
    for item in calls:
        builder.add(*item)  # the two oldest are pushed out
    firsts = {c.id: t.first_step() for c, t, _ in calls}
    assert len(set(firsts.values())) > 1
    with builder._lock:
        assert builder._oldest_waiting_step() == min(firsts[i] for i in builder._waiting)
        builder._waiting.popitem(last=False)  # the oldest waiting goes to the child (as _pick takes it)
        assert builder._oldest_waiting_step() == min(firsts[i] for i in builder._waiting)
        builder._waiting.clear()
        assert builder._oldest_waiting_step() is None and builder._first_steps == []
    for n in range(200):  # a busy server: calls come and go, the heap does not grow past its bound
        call, trace, result = calls[n % 5]
        builder.add(CoreCall(f"again{n}", call.request, call.marks, [5], None, call.params), trace, result)
        with builder._lock:
            builder._oldest_waiting_step()
            assert len(builder._first_steps) <= 2 * len(builder._waiting) + 64


def test_the_child_forgets_the_steps_before_the_oldest_still_needed():
    child = Child.__new__(Child)  # its bookkeeping alone: no process
    child.sent_steps, child._sent_heap = set(), []
    child.hold({5: None, 3: None, 9: None}, keep_from=0)
    child.hold({4: None, 9: None}, keep_from=4)
    assert child.sent_steps == {4, 5, 9}
    child.hold({}, keep_from=9)
    assert child.sent_steps == {9} and child._sent_heap == [9]


def test_several_builders_take_calls_in_turn_each_with_its_process_and_share_of_the_backlog(engine, tmp_path):
    calls = finished_calls(engine, 6)
    store = AnatomyStore(tmp_path, keep=10)
    http = Receiving(store, calls)
    builders = AnatomyBuilders(engine, CEILINGS, http, None, "off", "test", backlog=5, processes=2)
    first, second = builders.builders
    assert (first.backlog, second.backlog) == (3, 3)
    builders.add(*calls[0])  # none ready yet: to the first, which the server's start waits for
    assert list(first._waiting) == ["call00"] and not second._waiting
    first._waiting.clear()
    first.ready = second.ready = True
    for item in calls:
        builders.add(*item)  # not started: they wait, in turn
    assert list(first._waiting) == ["call00", "call02", "call04"] and list(second._waiting) == ["call01", "call03",
                                                                                                   "call05"]
    builders.want("call03")
    assert second._wanted == {"call03"} and first._wanted == set()
    first.ready = second.ready = False
    builders.start()
    try:
        assert first.ready and first._child.process.pid != second._child.process.pid
        wait_for(lambda: second.ready)  # said by its own child, through its receiving thread
        wait_for(lambda: all(c.anatomy_built for c in http.calls.values()))
        assert all("error" not in c.anatomy for c in http.calls.values())
        assert sorted(store.ids()) == [c.id for c, _, _ in calls]
    finally:
        builders.stop()
        store.close()
    assert first._child is None and second._child is None
    with pytest.raises(ValueError, match="processes must be an integer >= 1"):
        AnatomyBuilders(engine, CEILINGS, http, None, "off", "test", processes=0)
    assert 1 <= default_builders() <= 4


def test_a_builder_started_without_waiting_whose_child_dies_first_gets_ready_with_the_next(engine, tmp_path):
    """The setup of a restarted child is sent at once by the sending thread, not with a first job that a builder
    not yet ready would never get."""
    calls = finished_calls(engine, 1)
    store = AnatomyStore(tmp_path, keep=10)
    builder, http = builder_for(engine, store, calls)
    builder.start(wait=False)
    try:
        first = builder._child.process
        first.kill()  # long before its imports are done
        wait_for(lambda: builder.restarts == 1 and builder.ready)
        builder.add(*calls[0])
        wait_for(lambda: http.calls["call00"].anatomy_built)
        assert "error" not in http.calls["call00"].anatomy
    finally:
        builder.stop()
        store.close()


def test_default_builders_one_per_four_cpus_up_to_four(monkeypatch):
    import os

    for cpus, expected in ((1, 1), (2, 1), (8, 2), (16, 4), (128, 4)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)), raising=False)
        assert default_builders() == expected
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # as on macOS
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    assert default_builders() == 3


def test_the_builders_process_dying_loses_its_calls_alone(engine, tmp_path):
    calls = finished_calls(engine, 4)
    store = AnatomyStore(tmp_path, keep=10)
    builder, http = builder_for(engine, store, calls)
    built = lambda i: http.calls[f"call{i:02d}"]  # noqa: E731
    builder.start()
    try:
        first = builder._child.process
        first.kill()
        for item in calls[:3]:
            builder.add(*item)
        wait_for(lambda: builder.restarts == 1 and all(built(i).anatomy_built for i in range(3)))
        assert not first.is_alive()
        for i in range(3):  # lost with the process, or built by the new one
            assert "died" in built(i).anatomy.get("error", "died") or store.get(built(i).id, wait_s=0) is not None
        builder.add(*calls[3])
        wait_for(lambda: built(3).anatomy_built)
        assert "error" not in built(3).anatomy and store.get("call03", wait_s=0) is not None
        assert http.metrics.anatomy_builder_restarts.labels("m")._value.get() == 1
    finally:
        builder.stop()
        store.close()
    assert builder._child is None and first.exitcode is not None


def test_a_signal_to_the_servers_process_group_leaves_the_builders_process_alone(engine, tmp_path):
    """Ctrl-C in a terminal (SIGINT) or a supervisor's SIGTERM reaches every process of the server's group: the
    builder's process stays, builds what it is sent, and ends when the server stops it."""
    import os
    import signal

    calls = finished_calls(engine, 2)
    store = AnatomyStore(tmp_path, keep=10)
    builder, http = builder_for(engine, store, calls)
    builder.start()
    try:
        child = builder._child.process
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(child.pid, sig)
        for item in calls:
            builder.add(*item)
        wait_for(lambda: all(c.anatomy_built for c in http.calls.values()))
        assert child.is_alive() and builder.restarts == 0
        assert all("error" not in c.anatomy for c in http.calls.values())
    finally:
        builder.stop()
        store.close()
    assert child.exitcode == 0


def test_many_values_histogram_exports_what_prometheus_client_would():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from llm_anatomy.server.metrics import TPOT_BUCKETS, _ManyHistogram

    ours, reference = CollectorRegistry(), CollectorRegistry()
    many = _ManyHistogram("gap_seconds", "Gaps.", "m", TPOT_BUCKETS)
    ours.register(many)
    one_by_one = Histogram("gap_seconds", "Gaps.", ["model_name"], buckets=TPOT_BUCKETS, registry=reference)
    values = [0.0005, 0.001, 0.0025, 0.003, 0.02, 1.0, 100.0]  # on bounds, between, above all
    many.observe_many(values)
    for v in values:
        one_by_one.labels("m").observe(v)
    expected = [line for line in generate_latest(reference).decode().splitlines() if "_created" not in line]
    assert generate_latest(ours).decode().splitlines() == expected


def test_the_device_memory_census_is_taken_again_only_once_it_is_half_a_second_old(engine, tmp_path, monkeypatch):
    """Calls finishing by the hundred a second share one census of the device's memory until it is older than
    STATE_MAX_AGE_S; then the next call's job takes a fresh one."""
    from llm_anatomy.probe.call import DeviceState
    from llm_anatomy.server import anatomies

    taken = []
    real = DeviceState.of
    monkeypatch.setattr(DeviceState, "of", classmethod(lambda cls, e: taken.append(1) or real(e)))
    builder, _ = builder_for(engine, None)
    first = builder._device_state()
    assert builder._device_state() is first and len(taken) == 1
    builder._state_at -= anatomies.STATE_MAX_AGE_S + 0.01
    assert builder._device_state() is not first and len(taken) == 2


@pytest.mark.parametrize("field,value", [("anatomy_processes", 0), ("anatomy_processes", 1.5),
                                         ("stream_interval", 0), ("stream_interval", "2")])
def test_core_options_refuse_a_bad_count(field, value):
    from llm_anatomy.server.core import CoreOptions

    with pytest.raises(ValueError, match=f"{field} must be an integer >= 1"):
        CoreOptions(**{field: value})


def test_the_builders_threads_wait_for_the_step_loops_turn(engine, tmp_path):
    """While the step loop works, the builder sends nothing (not its metrics, not an anatomy) until the loop waits,
    or until a helper's longest wait is over; at stop the loop's turn ends."""
    from llm_anatomy.server.turn import LoopTurn

    calls = finished_calls(engine, 2)
    store = AnatomyStore(tmp_path)
    turn = LoopTurn(max_wait_s=30)
    builder, http = builder_for(engine, store, calls, turn=turn)
    builder.start()
    try:
        turn.works()
        builder.add(*calls[0])
        time.sleep(0.5)
        assert not http.calls["call00"].anatomy_built
        assert http.metrics.generation_tokens.labels("m")._value.get() == 0
        turn.waits()
        wait_for(lambda: http.calls["call00"].anatomy_built)
        assert "error" not in http.calls["call00"].anatomy
        turn.max_wait_s = 0.2  # a loop that never waits (a CPU's) does not starve the helpers
        turn.works()
        started = time.monotonic()
        builder.add(*calls[1])
        wait_for(lambda: http.calls["call01"].anatomy_built, timeout=10)
        assert time.monotonic() - started >= 0.2
    finally:
        turn.waits()
        builder.stop()
        store.close()
