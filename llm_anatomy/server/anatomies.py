"""The anatomy builder: finished calls become anatomies in a process of their own, never holding the engine
core's interpreter lock.

It lives beside the engine, in the engine core (core.py), and reports over the core's pipe to the HTTP process,
which keeps the store and the metrics: each finished call's latencies at once (a few subtractions on its trace:
("finished", [CallStats])), then its anatomy (("anatomy", id, summary, json, joules, seconds, dropped)). The full
Anatomy costs milliseconds of Python: at hundreds of requests a second, built beside the step loop it would take
the interpreter lock the loop needs. So it is built in a child process (anatomy_process.py), started with
"spawn" (it never touches the device): the core's process sends it what the build reads (each step's facts
once, shared by the calls in it; per call its place in those steps and its own facts) and gets back the JSON
line, the summary and the energy. A sending thread and a receiving thread mostly wait (on the pipe, on the
telemetry's next update).

At most `in_flight` calls are in the child at once; the others wait here, oldest first (the newest `backlog`
are kept: older unbuilt ones are dropped, and said to be). A call whose anatomy someone asks for (`anatomy:
true`, or GET /v1/anatomy/{id}) is sent next, whatever waits. If the child dies, the calls it held get an error
summary, a restart is reported (("restarted",)), and a new child is started. At stop, everything waiting is
built, then the child exits. A busy server runs several builders (AnatomyBuilders), each with its own child,
finished calls going to them in turn.
"""

from __future__ import annotations

import heapq
import logging
import multiprocessing
import os
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from ..anatomy import Ceilings
from ..probe.call import DeviceState, EngineFacts, TelemetryWindow
from ..probe.recorder import RequestTrace, TraceFacts
from ..probe.telemetry import TelemetryStream
from . import anatomy_process
from .anatomy_process import Built, Job, Setup
from .metrics import call_stats
from .turn import LoopTurn

STATE_MAX_AGE_S = 0.5  # see AnatomyBuilder._device_state

if TYPE_CHECKING:
    from .core import CoreCall as Call

log = logging.getLogger("llm_anatomy.server")


class Child:
    """One anatomy_process: its process, the pipe to it, the pipe from it, and which steps it holds."""

    def __init__(self, setup: Setup):
        spawn = multiprocessing.get_context("spawn")
        their_inbox, self.inbox = spawn.Pipe(duplex=False)
        self.outbox, their_outbox = spawn.Pipe(duplex=False)
        self.process = spawn.Process(target=anatomy_process.main, args=(their_inbox, their_outbox),
                                     name="llm-anatomy-builder", daemon=True)
        self.process.start()
        their_inbox.close()  # the child's ends: closed here, so that the pipes break when it dies
        their_outbox.close()
        self.sent_steps: set[int] = set()  # the step snapshots it holds
        self._sent_heap: list[int] = []  # the same indices, oldest first (both under the builder's lock)
        # sent by the sending thread as soon as it sees this child (the send waits until the child, its imports
        # done, reads it), or by AnatomyBuilder.start when it waits for the child
        self.setup: Setup | None = setup

    def send_setup(self) -> None:
        """Once (an OSError: the child died; it is not sent again)."""
        setup, self.setup = self.setup, None
        if setup is not None:
            self.inbox.send(setup)

    def hold(self, snapshots, keep_from: int) -> None:
        """The child now holds these snapshots and forgets those before keep_from. The oldest go first: with
        a backlog of a thousand calls it holds hundreds of steps, too many to scan at every call."""
        for i in snapshots:
            if i not in self.sent_steps:
                self.sent_steps.add(i)
                heapq.heappush(self._sent_heap, i)
        while self._sent_heap and self._sent_heap[0] < keep_from:
            self.sent_steps.discard(heapq.heappop(self._sent_heap))

    def end(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            log.error("the anatomy builder's process did not exit in %.0f s: killing it", timeout)
            self.process.kill()  # it ignores SIGTERM (anatomy_process.main)
            self.process.join(5)
        for conn in (self.inbox, self.outbox):
            conn.close()


class AnatomyBuilder:
    def __init__(self, engine, ceilings: Ceilings, send, telemetry: TelemetryStream | None, telemetry_note: str,
                 device_why: str, backlog: int = 1000, in_flight: int = 2, turn: LoopTurn | None = None):
        """`send(message)`: to the HTTP process (thread-safe: the core's Sender). `turn`: the engine core's step
        loop's (turn.py); this builder's threads take it before each unit of their work."""
        if not isinstance(in_flight, int) or in_flight < 1:
            raise ValueError(f"in_flight must be an integer >= 1, got {in_flight!r}")
        self.engine, self.send = engine, send
        self.setup = Setup(EngineFacts.of(engine), ceilings, device_why)
        self.telemetry, self.telemetry_note = telemetry, telemetry_note
        self.backlog = backlog
        self.in_flight = in_flight
        self.turn = turn or LoopTurn()  # alone: a loop that never says it works
        self._waiting: OrderedDict[str, tuple] = OrderedDict()  # id -> (call, trace, result), oldest first
        # (first step, id) of the waiting calls, lowest first; entries of calls no longer waiting are skipped when
        # they come to the top (see _oldest_waiting_step)
        self._first_steps: list[tuple[int, str]] = []
        self._wanted: set[str] = set()
        self._fresh: list[tuple] = []  # finished calls whose metrics are not recorded yet
        # calls pushed out of the backlog, for the sending thread to report: a report waits until it is written to
        # the HTTP process, and the step loop, which pushes them out, must not wait for that
        self._dropped: list = []
        self._building: dict[str, tuple] = {}  # id -> (call, seconds waited here) of the calls in the child
        self._lock = threading.Condition()
        self._stopping = False
        self._child: Child | None = None
        self._stale: list = []  # inboxes of dead children, for the sending thread to close
        self._live_from: int | None = None  # the oldest step a call still running may need (Recorder.oldest_step)
        self.restarts = 0
        self.ready = False  # its first child has said so
        self._state: DeviceState | None = None  # see _device_state
        self._state_at = 0.0
        self._sender = threading.Thread(target=self._send_loop, name="llm-anatomy-anatomy-send", daemon=True)
        self._receiver = threading.Thread(target=self._receive_loop, name="llm-anatomy-anatomy-receive",
                                          daemon=True)

    def start(self, ready_timeout: float = 300.0, wait: bool = True) -> None:
        """Start the child and, with `wait`, wait until it is ready: the first calls' anatomies should not wait for
        its imports. Without, the sending thread sends it the setup (which waits until the child reads it, after its
        imports) and `ready` turns true when the child says so."""
        self._child = Child(self.setup)
        if wait:
            self._child.send_setup()
            if not self._child.outbox.poll(ready_timeout):
                raise RuntimeError(f"the anatomy builder's process was not ready in {ready_timeout:.0f} s")
            self._child.outbox.recv()
            self.ready = True
        self._sender.start()
        self._receiver.start()

    def begin_stop(self) -> None:
        """Build what is left (the engine has stopped) and end: `stop` waits for it."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()

    def stop(self, timeout: float = 30.0) -> None:
        """Build what is left (the engine has stopped), then end the child and the threads."""
        self.begin_stop()
        for thread in (self._sender, self._receiver):
            if thread.ident is not None:  # started
                thread.join(timeout)
        with self._lock:
            child, self._child = self._child, None
        if child is not None:
            child.end(timeout)

    # ---- from other threads ---------------------------------------------------------------------------
    def add(self, call: "Call", trace: RequestTrace, result, live_from: int | None = None) -> None:
        """A finished call (the step loop): its metrics now, its anatomy when the child can take it. `live_from`:
        the oldest step the calls still running may come to need (the child forgets those before it)."""
        with self._lock:
            self._live_from = live_from
            item = (call, trace, result)
            self._waiting[call.id] = item
            heapq.heappush(self._first_steps, (trace.first_step(), call.id))
            self._fresh.append(item)
            if call.request.want_anatomy:
                self._wanted.add(call.id)
            while len(self._waiting) > self.backlog:
                self._dropped.append(self._waiting.popitem(last=False)[1][0])
            self._lock.notify_all()

    def want(self, anatomy_id: str) -> None:
        """Someone waits for this anatomy: build it next."""
        with self._lock:
            if anatomy_id in self._waiting:
                self._wanted.add(anatomy_id)
                self._lock.notify_all()

    def _oldest_waiting_step(self) -> int | None:
        """The lowest step index a waiting call's anatomy reads (with the lock held). A busy server keeps a
        thousand calls waiting and sends more than a hundred a second: a scan of them all at every send held the
        engine core's interpreter lock, which its step loop needs."""
        heap = self._first_steps
        if len(heap) > 2 * len(self._waiting) + 64:  # mostly entries of calls gone: start again from those left
            heap[:] = [(t.first_step(), i) for i, (_, t, _) in self._waiting.items()]
            heapq.heapify(heap)
        while heap and heap[0][1] not in self._waiting:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # ---- the sending thread ---------------------------------------------------------------------------
    def _pick(self) -> tuple | None:
        """The call to send now, if the child has room (called with the lock held)."""
        if len(self._building) >= self.in_flight or self._child is None:
            return None
        self._wanted &= self._waiting.keys()
        if self._wanted:
            return self._waiting.pop(self._wanted.pop())
        if self._waiting:
            return self._waiting.popitem(last=False)[1]
        return None

    def _next(self) -> tuple[list, list, tuple | None, bool]:
        """(finished calls whose metrics are due, calls dropped unbuilt, the call to send next or None, whether to
        stop)."""
        with self._lock:
            while True:
                fresh, self._fresh = self._fresh, []
                dropped, self._dropped = self._dropped, []
                item = self._pick()
                setup_due = self._child is not None and self._child.setup is not None  # a new child, not ready
                if fresh or dropped or item is not None or setup_due:
                    return fresh, dropped, item, False
                if self._stopping and not self._waiting:
                    return [], [], None, True
                self._lock.wait()

    def _send_loop(self) -> None:
        if self.engine.device.type == "cuda":  # reading the steps' device events
            torch.cuda.set_device(self.engine.device)
        while True:
            fresh, dropped, item, stop = self._next()
            if stop:
                break
            with self._lock:
                child = self._child
            try:
                if child is not None:
                    child.send_setup()  # a child started without waiting, or restarted: it says "ready" after it
            except OSError:  # it died first: the receiving thread starts another
                pass
            if fresh:
                self._metrics(fresh)
            for old in dropped:
                self._give_up(old, "dropped")
            if item is not None:
                self.turn.take()
                self._send(*item)
        with self._lock:  # everything is in the child: let it finish and exit
            while self._building and self._child is not None:
                self._lock.wait()
            child = self._child
        if child is not None:
            try:
                child.inbox.send(None)
            except OSError:  # it died meanwhile: the receiving thread reports it
                pass

    def _metrics(self, fresh: list[tuple]) -> None:
        stats = []
        for call, trace, result in fresh:
            self.turn.take()
            try:
                stats.append(call_stats(call.id, trace, call.marks, result))
            except Exception:  # noqa: BLE001 - a bad record must not take the server down
                log.exception("the metrics of %s could not be recorded", call.id)
        self._emit(("finished", stats))

    def _send(self, call: "Call", trace: RequestTrace, result) -> None:
        if not trace.steps:  # aborted before its prefill: nothing ran for it
            self._finish(call, None)
            return
        t0 = time.perf_counter()
        try:
            job = self._job(call, trace, result)
            shared = trace.shared_steps()
        except Exception as e:  # noqa: BLE001 - a bad record must not take the server down
            log.exception("preparing the anatomy of %s failed", call.id)
            self._failed(call, f"the anatomy could not be built: {type(e).__name__}: {e}")
            return
        with self._lock:
            stale, self._stale = self._stale, []
            child = self._child
            if child is not None:
                self._building[call.id] = (call, time.perf_counter() - t0)
                new = {i: step_and_measure for i, step_and_measure in shared.items() if i not in child.sent_steps}
                keep_from = min(i for i in (min(shared), self._oldest_waiting_step(), self._live_from)
                                if i is not None)
        for conn in stale:
            conn.close()
        if child is None:  # the child died as the server stopped: no new one is started then
            self._failed(call, "the anatomy could not be built: the anatomy builder's process died at shutdown")
            return
        try:
            child.send_setup()
            snapshots = {i: measure.snapshot(step, trace.clock) for i, (step, measure) in new.items()}
            child.inbox.send((snapshots, job, keep_from))
            with self._lock:
                child.hold(snapshots, keep_from)
        except OSError:  # the child died: the receiving thread answers the calls it held and starts another
            pass
        except Exception as e:  # noqa: BLE001 - this call's record could not be sent
            log.exception("sending the anatomy of %s to the builder failed", call.id)
            with self._lock:
                self._building.pop(call.id, None)
                self._lock.notify_all()
            self._failed(call, f"the anatomy could not be built: {type(e).__name__}: {e}")

    def _job(self, call: "Call", trace: RequestTrace, result) -> Job:
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
                 "sampling": call.params.record()}
        return Job(shown, result, TraceFacts.of(trace), call.marks, window, self._device_state())

    def _device_state(self) -> DeviceState:
        """The device's memory census for a call that just finished, taken again once the last is older than
        STATE_MAX_AGE_S: the driver's memory query is slow, and a busy server finishes calls by the hundred a
        second (at 512 streams this thread spent more of its time in that query than anywhere else)."""
        now = time.monotonic()
        if self._state is None or now - self._state_at > STATE_MAX_AGE_S:
            self._state, self._state_at = DeviceState.of(self.engine), now
        return self._state

    # ---- the receiving thread -------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        while True:
            with self._lock:
                child = self._child
            if child is None:
                return
            try:
                built: Built | str = child.outbox.recv()
            except (EOFError, OSError):
                if not self._child_ended(child):
                    return
                continue
            if built == "ready":  # a child started without waiting, or a restarted one
                self.ready = True
                continue
            with self._lock:
                call, waited = self._building.pop(built.id, (None, 0.0))
                self._lock.notify_all()
            if call is not None:
                self.turn.take()
                self._take(call, built, waited)

    def _take(self, call: "Call", built: Built, waited: float) -> None:
        if built.json is None:
            log.error("building the anatomy of %s failed:\n%s", call.id, built.failure)
        self._finish(call, built.summary, built.json, built.joules, waited + built.seconds)

    def _child_ended(self, child: Child) -> bool:
        """The child's pipe closed: it exited after a stop, or died. Whether to go on receiving (from a new one)."""
        child.process.join(5)
        with self._lock:
            done = self._stopping and not self._waiting
        fresh = None if done else Child(self.setup)  # started outside the lock: the step loop takes it
        with self._lock:
            lost = list(self._building.values())
            self._building.clear()
            self._child = fresh
            if fresh is not None:
                self.restarts += 1
            self._lock.notify_all()
        child.outbox.close()  # its inbox is the sending thread's: closed there (a send may be under way)
        with self._lock:
            self._stale.append(child.inbox)
        if done:
            return False
        why = f"the anatomy builder's process died (exit code {child.process.exitcode})"
        log.error("%s with %d anatomies in it; a new one was started", why, len(lost))
        self._emit(("restarted",))
        for call, _ in lost:
            self._finish(call, {"id": call.id, "error": f"the anatomy could not be built: {why}"})
        return True

    def _failed(self, call: "Call", error: str) -> None:
        self._finish(call, {"id": call.id, "error": error})

    def _finish(self, call: "Call", summary: dict | None, json: bytes | None = None, joules: float | None = None,
                seconds: float | None = None, dropped: bool = False) -> None:
        """The call's anatomy is done with: built (`json`), or not (`summary` says why; None: nothing ran)."""
        self._emit(("anatomy", call.id, summary, json, joules, seconds, dropped))

    def _give_up(self, call: "Call", why: str) -> None:
        """An unbuilt anatomy pushed out of the backlog: its metrics still count."""
        self._finish(call, {"id": call.id, "error": f"the anatomy was {why}: the server was too busy to build it"},
                     dropped=True)

    def _emit(self, message) -> None:
        try:
            self.send(message)
        except OSError:  # the HTTP process is gone: nobody to tell
            pass


def default_builders() -> int:
    """Anatomy processes for this machine: one per four CPUs this process may run on, from one to four. At
    hundreds of streams a GPU finishes calls faster than one process builds their anatomies (milliseconds of
    Python each); the engine core, the HTTP process and the clients need CPUs too."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)  # macOS
    return max(1, min(4, len(usable) // 4))


class AnatomyBuilders:
    """Several AnatomyBuilders, each with its own process, taking finished calls in turn: a busy server finishes
    more calls than one process builds. Each keeps its share of the backlog."""

    def __init__(self, engine, ceilings: Ceilings, send, telemetry: TelemetryStream | None, telemetry_note: str,
                 device_why: str, backlog: int = 1000, processes: int = 1, turn: LoopTurn | None = None):
        if not isinstance(processes, int) or processes < 1:
            raise ValueError(f"processes must be an integer >= 1, got {processes!r}")
        share = -(-backlog // processes)
        self.builders = [AnatomyBuilder(engine, ceilings, send, telemetry, telemetry_note, device_why, backlog=share,
                                        turn=turn) for _ in range(processes)]
        self._next = 0  # the builder the next call goes to

    def start(self, ready_timeout: float = 300.0) -> None:
        """Ready when the first is; the others' children are started then, without waiting (a child's imports take
        seconds, several at once on few CPUs longer: the server's start waits for one). Calls go to them once they
        are ready."""
        self.builders[0].start(ready_timeout)
        for builder in self.builders[1:]:
            builder.start(wait=False)

    def stop(self, timeout: float = 30.0) -> None:
        for builder in self.builders:  # all of them finish what they hold at once, then each is waited for
            builder.begin_stop()
        for builder in self.builders:
            builder.stop(timeout)

    def add(self, call: "Call", trace: RequestTrace, result, live_from: int | None = None) -> None:
        """To the next ready builder in turn (the first, started ready, if none is)."""
        for _ in self.builders:
            builder = self.builders[self._next]
            self._next = (self._next + 1) % len(self.builders)
            if builder.ready:
                break
        else:
            builder = self.builders[0]
        builder.add(call, trace, result, live_from)

    def want(self, anatomy_id: str) -> None:
        for builder in self.builders:  # the one that holds it takes it first
            builder.want(anatomy_id)
