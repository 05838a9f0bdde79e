"""The anatomy builder: finished calls become anatomies on their own thread, without slowing a busy engine.

Each finished call's latencies go to the metrics at once (a few subtractions on its trace). Building its full
Anatomy costs milliseconds of Python, and Python threads share one interpreter lock with the engine thread: at
hundreds of requests a second, building every one as it finishes would take host time the engine's steps
need. So while the engine has work the builder spends at most `duty` of its time building; what waits is
built oldest first (the newest `backlog` are kept: older unbuilt ones are dropped and counted), and everything
left is built as soon as the engine is idle or the server stops. A call whose anatomy someone asks for
(`anatomy: true`, or GET /v1/anatomy/{id}) is built next, whatever the load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from ..anatomy import Anatomy, Ceilings
from ..probe.call import TelemetryWindow, build_anatomy
from ..probe.recorder import RequestTrace
from ..probe.telemetry import TelemetryStream
from .metrics import Metrics
from .store import AnatomyStore

if TYPE_CHECKING:
    from .loop import Call

log = logging.getLogger("llm_anatomy.server")


class AnatomyBuilder:
    def __init__(self, engine, ceilings: Ceilings, store: AnatomyStore, metrics: Metrics,
                 telemetry: TelemetryStream | None, telemetry_note: str, device_why: str, duty: float = 0.25,
                 backlog: int | None = None):
        if not 0 < duty <= 1:
            raise ValueError(f"duty must be in (0, 1], got {duty}")
        self.engine, self.ceilings, self.store, self.metrics = engine, ceilings, store, metrics
        self.telemetry, self.telemetry_note, self.device_why = telemetry, telemetry_note, device_why
        self.duty = duty
        self.backlog = backlog or store.keep
        self._waiting: OrderedDict[str, tuple] = OrderedDict()  # id -> (call, trace, result), oldest first
        self._wanted: set[str] = set()
        self._fresh: list[tuple] = []  # finished calls whose metrics are not recorded yet
        self._lock = threading.Condition()
        self._stopping = False
        self._next_build = 0.0  # time.monotonic() before which a busy engine's builder rests
        self._thread = threading.Thread(target=self._run, name="llm-anatomy-anatomy", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Build what is left (the engine has stopped), then end the thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._thread.join(timeout)

    # ---- from other threads ---------------------------------------------------------------------------
    def add(self, call: "Call", trace: RequestTrace, result) -> None:
        """A finished call (engine thread): its metrics now, its anatomy when the budget allows."""
        self.store.expect(call.id, call.owner)
        with self._lock:
            item = (call, trace, result)
            self._waiting[call.id] = item
            self._fresh.append(item)
            if call.request.want_anatomy:
                self._wanted.add(call.id)
            dropped = []
            while len(self._waiting) > self.backlog:
                dropped.append(self._waiting.popitem(last=False)[1][0])
            self._lock.notify_all()
        for old in dropped:
            self._give_up(old, "dropped")

    def want(self, anatomy_id: str) -> None:
        """Someone waits for this anatomy: build it next."""
        with self._lock:
            if anatomy_id in self._waiting:
                self._wanted.add(anatomy_id)
                self._lock.notify_all()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # ---- the builder thread ---------------------------------------------------------------------------
    def _pick(self) -> tuple | None:
        """The call to build now, if any (called with the lock held)."""
        self._wanted &= self._waiting.keys()
        if self._wanted:
            return self._waiting.pop(self._wanted.pop())
        if self._waiting and (self._stopping or time.monotonic() >= self._next_build or not self.engine.has_work()):
            return self._waiting.popitem(last=False)[1]
        return None

    def _next(self) -> tuple[list, tuple | None, bool]:
        """(finished calls whose metrics are due, the call to build next or None, whether to stop)."""
        with self._lock:
            while True:
                fresh, self._fresh = self._fresh, []
                item = self._pick()
                if fresh or item is not None:
                    return fresh, item, False
                if self._stopping and not self._waiting:
                    return [], None, True
                # with calls waiting, look again soon: the budget frees up, or the engine goes idle
                self._lock.wait(min(max(self._next_build - time.monotonic(), 0.001), 0.05) if self._waiting else None)

    def _run(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.set_device(self.engine.device)
        while True:
            fresh, item, stop = self._next()
            if stop:
                return
            for call, trace, result in fresh:
                self._metrics(call, trace, result)
            if item is not None:
                cpu0 = time.thread_time()  # the interpreter time it took (waits for telemetry do not count)
                self._build(*item)
                self._next_build = time.monotonic() + (time.thread_time() - cpu0) * (1 / self.duty - 1)

    def _metrics(self, call: "Call", trace: RequestTrace, result) -> None:
        try:
            self.metrics.finished(result.finish_reason, len(result.prompt_token_ids), len(result.output_token_ids))
            if trace.steps:
                self.metrics.observe_trace(trace, call.marks, len(result.output_token_ids))
        except Exception:  # noqa: BLE001 - a bad record must not take the server down
            log.exception("the metrics of %s could not be recorded", call.id)

    def _build(self, call: "Call", trace: RequestTrace, result) -> None:
        summary = None
        t0 = time.perf_counter()
        try:
            anatomy = self._anatomy(call, trace, result)
            self.metrics.anatomy_build.labels(self.metrics.model).observe(time.perf_counter() - t0)
            if anatomy is not None:
                self.store.add(anatomy, call.owner)
                self.metrics.observe_energy(anatomy)
                summary = anatomy.summary()
            else:
                self.store.give_up(call.id)
        except Exception as e:  # noqa: BLE001 - a bad record must not take the server down
            log.exception("building the anatomy of %s failed", call.id)
            self.store.give_up(call.id)
            summary = {"id": call.id, "error": f"the anatomy could not be built: {type(e).__name__}: {e}"}
        call.anatomy, call.anatomy_built = summary, True
        call.post(("anatomy", summary))

    def _give_up(self, call: "Call", why: str) -> None:
        """An unbuilt anatomy pushed out of the backlog: its metrics still count."""
        self.metrics.anatomies_dropped.labels(self.metrics.model).inc()
        self.store.give_up(call.id)
        call.anatomy, call.anatomy_built = {"id": call.id, "error": f"the anatomy was {why}: the server was too "
                                                                   f"busy to build it"}, True
        call.post(("anatomy", call.anatomy))

    def _anatomy(self, call: "Call", trace: RequestTrace, result) -> Anatomy | None:
        if not trace.steps:  # aborted before its prefill: nothing ran for it
            return None
        samples = []
        if self.telemetry is not None:
            deadline = time.monotonic() + 0.5  # the energy counter needs an update after the call's end
            while self.telemetry.latest_ns() < call.marks.end + 150_000_000 and time.monotonic() < deadline:
                time.sleep(0.02)
            samples = self.telemetry.window(call.marks.received, call.marks.end)
        window = TelemetryWindow(samples, self.telemetry is not None, self.telemetry_note,
                                 self.telemetry.hz if self.telemetry else 0.0)
        request = call.request
        shown = {**request.shown, "endpoint": "/v1/chat/completions" if request.chat else "/v1/completions",
                 "sampling": {k: v for k, v in vars(call.params).items() if k != "extra"}}
        notes = ["Served: activation peak not measured (requests share the device)."]
        return build_anatomy(self.engine, shown, result, trace, self.ceilings, window, self.device_why, call.marks,
                             notes=notes)
