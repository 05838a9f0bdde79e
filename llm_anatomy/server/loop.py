"""The engine thread behind the server, and the thread that turns finished requests into anatomies.

Request handlers (asyncio) validate, template and tokenize a call in a worker thread, then hand it to the
engine thread through a queue. The engine thread alone touches the engine: it admits calls, runs steps
(continuous batching: calls join and leave between steps), aborts calls whose clients went away, and pushes
each call's text to its asyncio queue. Finished traces go to the anatomy thread, which builds the Anatomy
off the engine thread (so it costs the running batch almost nothing), stores it and updates the metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from ..anatomy import Anatomy, Ceilings
from ..engine.engine import Engine
from ..engine.sampling import SamplingParams
from ..engine.scheduler import Sequence
from ..errors import RequestError
from ..probe.call import Marks, TelemetryWindow, build_anatomy
from ..probe.clock import Clock
from ..probe.recorder import Recorder, RequestTrace
from ..prompt import render_prompt
from ..probe.telemetry import TelemetryStream
from .metrics import Metrics
from .protocol import APIError, Request
from .store import AnatomyStore

log = logging.getLogger("llm_anatomy.server")


@dataclass
class Progress:
    text: str  # the call's whole output text so far
    tokens: int  # output tokens so far
    finish_reason: str | None = None  # set on the last one
    token_ids: list[int] | None = None  # the sequence's own lists (read only up to `tokens`)
    logprobs: list | None = None


@dataclass
class Call:
    """One request in flight, from the handler's side and the engine thread's."""

    id: str
    request: Request
    marks: Marks
    prompt_token_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None
    done: bool = False  # finished or aborted (engine thread)
    anatomy: dict | None = None  # its summary, once built (None also when there is none: aborted before its prefill)
    anatomy_built: bool = False  # set (before the "anatomy" event is posted) once the anatomy thread is done with it

    def post(self, event) -> None:
        """From another thread: put an event on the handler's queue."""
        post_all([(self, event)])


def _deliver(items: list[tuple[Call, object]]) -> None:
    for call, event in items:
        call.events.put_nowait(event)


def post_all(items: list[tuple[Call, object]]) -> None:
    """From another thread: deliver many calls' events with one wake-up of their event loop (each wake-up is a
    syscall; one per call per step would cost the engine thread real time at large batches)."""
    if not items:
        return
    try:
        items[0][0].loop.call_soon_threadsafe(_deliver, items)  # one server, one event loop
    except RuntimeError:  # the event loop is gone (server shutting down)
        pass


class EngineLoop:
    def __init__(self, engine: Engine, ceilings: Ceilings, store: AnatomyStore, metrics: Metrics,
                 telemetry: TelemetryStream | None, telemetry_note: str, device_why: str):
        self.engine = engine
        self.ceilings = ceilings
        self.store = store
        self.metrics = metrics
        self.telemetry = telemetry
        self.telemetry_note = telemetry_note
        self.device_why = device_why
        self.recorder = Recorder(Clock(engine.device))
        engine.observers.append(self.recorder)
        self._inbox: queue.Queue = queue.Queue()
        self._builds: queue.Queue = queue.Queue()
        self._calls: dict[str, Call] = {}
        self._stopping = threading.Event()
        self.error: str | None = None  # set if the engine thread died
        self.started_at = time.time()
        self._engine_thread = threading.Thread(target=self._run, name="llm-anatomy-engine", daemon=True)
        self._anatomy_thread = threading.Thread(target=self._build_anatomies, name="llm-anatomy-anatomy", daemon=True)

    def start(self) -> None:
        self._engine_thread.start()
        self._anatomy_thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what is running, then stop both threads (the server has stopped taking requests)."""
        self._stopping.set()
        self._inbox.put(None)
        self._engine_thread.join(timeout)
        self._builds.put(None)
        self._anatomy_thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._engine_thread.is_alive() and self.error is None

    # ---- handler side -------------------------------------------------------------------------------
    def prepare(self, request: Request, received_ns: int, loop: asyncio.AbstractEventLoop) -> Call:
        """Template, tokenize and check a request (in a worker thread, not the engine's): every error a user
        can fix is raised here, before the call reaches the engine."""
        engine = self.engine
        sampling = dict(request.sampling)
        given_max = sampling.pop("max_tokens")
        try:
            engine.sampling_params(**sampling, max_tokens=1)  # the values alone, before any work
            rendered = render_prompt(engine.tokenizer, messages=request.messages, prompt=request.prompt,
                                     prompt_token_ids=request.prompt_token_ids,
                                     enable_thinking=request.enable_thinking, tools=request.tools)
            ids, prompt_text = rendered.token_ids, rendered.text
            room = min(engine.max_model_len, engine.pool.capacity_tokens) - len(ids)
            if given_max is None and room >= 1:
                given_max = room  # up to the end of the context (or of the KV pool), as OpenAI does
            params = engine.sampling_params(**sampling, max_tokens=given_max if given_max is not None else 1)
            engine.check_request(ids, params)
        except RequestError as e:
            code = "context_length_exceeded" if "context" in str(e) or "KV cache" in str(e) else None
            raise APIError(400, str(e), param=e.param, code=code) from None
        marks = Marks(received_ns, rendered.template_ns, rendered.tokenize_ns, time.perf_counter_ns())
        return Call(uuid.uuid4().hex[:16], request, marks, ids, prompt_text, params, loop)

    def another_choice(self, call: Call, index: int) -> Call:
        """Choice `index` of a request with n > 1: the same prompt, its own sequence and anatomy; with a seed,
        seed + index, so that the choices differ and each can be reproduced."""
        params = call.params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + index)
        return Call(uuid.uuid4().hex[:16], call.request, dataclasses.replace(call.marks), call.prompt_token_ids,
                    call.prompt_text, params, call.loop)

    def submit(self, call: Call) -> None:
        if self._stopping.is_set() or not self.alive:
            raise APIError(503, "the server is shutting down" if self._stopping.is_set() else
                           f"the engine stopped: {self.error}", type="server_error", code="unavailable")
        self._inbox.put(("add", call))

    def abort(self, call: Call) -> None:
        """The client went away: stop decoding for it and free its KV blocks (done on the engine thread)."""
        if not call.done:
            self._inbox.put(("abort", call))

    # ---- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        if engine.device.type == "cuda":
            torch.cuda.set_device(engine.device)
        try:
            with torch.inference_mode():
                while True:
                    if not self._take_inbox(block=not engine.has_work()):
                        break
                    if engine.has_work():
                        self._step()
                    self._hand_over_finished()
        except BaseException as e:  # noqa: BLE001 - the server must answer what is in flight, not hang
            self.error = f"{type(e).__name__}: {e}"
            log.exception("the engine thread stopped")
            for call in list(self._calls.values()):
                call.post(APIError(500, f"the engine failed: {self.error}", type="server_error"))

    def _take_inbox(self, block: bool) -> bool:
        """Admit new calls and process aborts. False once told to stop and nothing is left to run."""
        while True:
            try:
                item = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    self._reanchor_clock()
                    if self._stopping.is_set():
                        return False
                    continue
                return True
            block = False
            if item is None:
                if not self.engine.has_work():
                    return False
                continue
            what, call = item
            if what == "add":
                self._add(call)
            elif call.seq is not None and not call.seq.finished:
                self.engine.abort(call.seq)

    def _reanchor_clock(self) -> None:
        """While idle (a sync costs nothing), take a fresh device reference: host and device clocks drift."""
        if self.recorder.clock.age_s > 60 and not self._calls:
            self.recorder.clock = Clock(self.engine.device)

    def _add(self, call: Call) -> None:
        self.recorder.watch(call.id, call.marks.received)
        # prepare() ran the same checks (Engine.check_request) on the same fixed pool: this cannot refuse it
        call.seq = self.engine.add_request(call.prompt_token_ids, call.params, request_id=call.id)
        self._calls[call.id] = call

    def _step(self) -> None:
        try:
            seqs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the running calls, keep serving the others
            log.exception("a step failed")
            why = ("out of device memory while running this request; retry, or lower max_tokens or concurrency"
                   if isinstance(e, torch.cuda.OutOfMemoryError) else f"the step running this request failed: "
                                                                     f"{type(e).__name__}: {e}")
            self.engine.reset_pipeline()
            for seq in list(self.engine.scheduler.running):
                call = self._calls.get(seq.request_id)
                self.engine.abort(seq)
                if call is not None:
                    call.done = True
                    call.post(APIError(500, why, type="server_error"))
            return
        events = []
        for seq in seqs:
            call = self._calls.get(seq.request_id)
            if call is None or call.done:
                continue
            if seq.finished:
                call.done = True
            if seq.finished or call.request.stream:  # a whole-answer call needs only its end
                events.append((call, Progress(seq.text, len(seq.output_token_ids), seq.finish_reason,
                                              seq.output_token_ids, seq.logprobs)))
        post_all(events)

    def _hand_over_finished(self) -> None:
        for trace in self.recorder.take_finished():
            call = self._calls.pop(trace.request_id, None)
            if call is None:
                continue
            call.marks.end = trace.finished_ns
            if not call.done:  # aborted
                call.done = True
                seq = call.seq
                call.post(Progress(seq.text, len(seq.output_token_ids), seq.finish_reason, seq.output_token_ids,
                                   seq.logprobs))
            self.store.expect(call.id)
            self._builds.put((call, trace, self.engine.result(call.seq, call.prompt_text)))

    # ---- the anatomy thread -------------------------------------------------------------------------
    def _build_anatomies(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.set_device(self.engine.device)
        while True:
            item = self._builds.get()
            if item is None:
                return
            call, trace, result = item
            summary = None
            t0 = time.perf_counter()
            try:
                anatomy = self._anatomy(call, trace, result)
                self.metrics.anatomy_build.labels(self.metrics.model).observe(time.perf_counter() - t0)
                if anatomy is not None:
                    self.store.add(anatomy)
                    self.metrics.observe(anatomy)
                    summary = anatomy.summary()
                else:
                    self.store.give_up(call.id)
            except Exception as e:  # noqa: BLE001 - a bad record must not take the server down
                log.exception("building the anatomy of %s failed", call.id)
                self.store.give_up(call.id)
                summary = {"id": call.id, "error": f"the anatomy could not be built: {type(e).__name__}: {e}"}
            self.metrics.finished(result.finish_reason, len(result.prompt_token_ids), len(result.output_token_ids))
            call.anatomy, call.anatomy_built = summary, True
            call.post(("anatomy", summary))

    def _anatomy(self, call: Call, trace: RequestTrace, result) -> Anatomy | None:
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
        shown = {**call.request.shown, "endpoint": "/v1/chat/completions" if call.request.chat else "/v1/completions",
                 "sampling": {k: v for k, v in vars(call.params).items() if k != "extra"}}
        notes = ["Served: activation peak not measured (requests share the device)."]
        return build_anatomy(self.engine, shown, result, trace, self.ceilings, window, self.device_why, call.marks,
                             notes=notes)
