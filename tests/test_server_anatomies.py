"""The anatomy builder's budget: while the engine is busy it builds little, builds at once what someone asks
for, drops the oldest unbuilt past its backlog (their metrics still counted), and catches up when idle."""

import time
from types import SimpleNamespace

import pytest
import torch

from llm_anatomy.engine.engine import GenerationResult
from llm_anatomy.probe.call import Marks
from llm_anatomy.probe.clock import Clock
from llm_anatomy.probe.recorder import RequestTrace
from llm_anatomy.server.anatomies import AnatomyBuilder
from llm_anatomy.server.metrics import Metrics
from llm_anatomy.server.store import AnatomyStore
from sample_anatomy import sample_anatomy
from test_server import CEILINGS


class Engine:
    device = torch.device("cpu")
    busy = True

    def has_work(self) -> bool:
        return self.busy


class NowLoop:
    """Stands in for the event loop: runs what the builder posts at once."""

    @staticmethod
    def call_soon_threadsafe(fn, *args):
        fn(*args)


def finished_call(i: int):
    from llm_anatomy.server.loop import Call

    request = SimpleNamespace(want_anatomy=False)
    call = Call(f"call{i:02d}", request, Marks(0, 0, 0, 0), [1, 2], None, None, NowLoop(), owner=None)
    result = GenerationResult(call.id, [1, 2], [3] * (i + 1), "text", "length")
    return call, RequestTrace(Clock(Engine.device), call.id), result


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_busy_engine_defers_anatomies_that_nobody_asks_for(tmp_path):
    engine = Engine()
    store = AnatomyStore(tmp_path, keep=3)
    metrics = Metrics("m", engine)
    builder = AnatomyBuilder(engine, CEILINGS, store, metrics, None, "", "", duty=1e-4)
    builder._anatomy = lambda call, trace, result: sample_anatomy(id=call.id)  # the build itself is probe's
    calls = [finished_call(i) for i in range(5)]
    builder.start()
    try:
        builder.add(*calls[0])
        wait_for(lambda: store.get("call00", wait_s=0) is not None)  # the first goes at once...
        for item in calls[1:]:
            builder.add(*item)  # ...then the budget is spent: these wait, and the oldest is pushed out
        assert calls[1][0].anatomy_built and "too busy" in calls[1][0].anatomy["error"]
        assert metrics.anatomies_dropped.labels("m")._value.get() == 1
        builder.want("call03")
        wait_for(lambda: store.get("call03", wait_s=0) is not None)  # asked for: built now
        assert store.get("call02", wait_s=0) is None and store.get("call04", wait_s=0) is None
        wait_for(lambda: metrics.generation_tokens.labels("m")._value.get() == 1 + 2 + 3 + 4 + 5)  # all counted
        engine.busy = False
        wait_for(lambda: store.get("call04", wait_s=0) is not None and store.get("call02", wait_s=0) is not None)
        assert store.get("call01", wait_s=0) is None and builder.waiting == 0
    finally:
        builder.stop()
        store.close()


def test_stopping_builds_what_is_left(tmp_path):
    store = AnatomyStore(tmp_path, keep=10)
    builder = AnatomyBuilder(Engine(), CEILINGS, store, Metrics("m", Engine()), None, "", "", duty=1e-4)
    builder._anatomy = lambda call, trace, result: sample_anatomy(id=call.id)
    builder.start()
    for i in range(4):
        builder.add(*finished_call(i))
    builder.stop()
    assert store.ids() == [f"call{i:02d}" for i in range(4)]
    store.close()


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


def test_the_builders_budget_is_a_fraction(tmp_path):
    store = AnatomyStore(tmp_path)
    for duty in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="duty"):
            AnatomyBuilder(Engine(), CEILINGS, store, Metrics("m", Engine()), None, "", "", duty=duty)
    store.close()
