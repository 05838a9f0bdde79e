"""The engine thread behind the server.

Request handlers (asyncio) parse, template and tokenize a call in a worker thread, then hand it to the engine
thread through a queue. The engine thread alone touches the engine: it admits calls, runs steps (continuous
batching: calls join and leave between steps), aborts calls whose clients went away, and pushes each call's
progress to its asyncio queue, one wake-up of the event loop per step for all of them. Finished calls go to
the anatomy builder (anatomies.py), off this thread.

Nothing one request does can stop the loop: every per-call operation (admit, abort, hand over) is guarded so
that its failure ends that call alone (HTTP 500), and a step that fails ends the requests that were in it
(their KV blocks freed) while the loop goes on with the others.
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

from ..engine.engine import Engine
from ..engine.sampling import SamplingParams, seed_for_choice
from ..engine.scheduler import Sequence
from ..errors import RequestError
from ..probe.call import Marks
from ..probe.clock import Clock
from ..probe.recorder import Recorder
from ..prompt import render_prompt
from .anatomies import AnatomyBuilder
from .errors import APIError, unavailable
from .protocol import Request

log = logging.getLogger("llm_anatomy.server")
UNHEALTHY_AFTER_FAILED_STEPS = 3  # consecutive failed steps after which /health says the engine cannot serve


@dataclass(slots=True)
class Progress:
    text: str  # the call's whole output text so far
    tokens: int  # output tokens so far
    finish_reason: str | None = None  # set on the last one
    token_ids: list[int] | None = None  # the sequence's own lists (read only up to `tokens`)
    logprobs: list | None = None


class Mailbox:
    """A call's events, from the engine thread to its handler on the event loop: the handler takes everything
    that arrived since it last looked at once (so a stream that fell behind sends one chunk for all of it).
    One list and one future: lighter than an asyncio.Queue, and this runs per call per step."""

    __slots__ = ("_items", "_waiter")

    def __init__(self):
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        """On the event loop (post_all gets it there)."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self, timeout: float | None = None) -> list:
        """What arrived, waiting for something if nothing has (an empty list after `timeout` seconds)."""
        if not self._items:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(timeout, _wake, waiter) if timeout is not None else None
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        items, self._items = self._items, []
        return items


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


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
    owner: str | None = None  # the salted hash of the API key that made it (None without keys)
    events: Mailbox = field(default_factory=Mailbox)
    seq: Sequence | None = None
    done: bool = False  # finished, failed or aborted (engine thread)
    posted_tokens: int = 0  # output tokens its stream has been told of (engine thread)
    anatomy: dict | None = None  # its summary, once built (None also when there is none: aborted before its prefill)
    anatomy_built: bool = False  # set (before the "anatomy" event is posted) once the builder is done with it

    def post(self, event) -> None:
        """From another thread: put an event in the handler's mailbox."""
        post_all([(self, event)])


def _deliver(items: list[tuple[Call, object]]) -> None:
    for call, event in items:
        call.events.put(event)


def post_all(items: list[tuple[Call, object]]) -> None:
    """From another thread: deliver many calls' events with one wake-up of their event loop (each wake-up is a
    syscall; one per call per step would cost the engine thread real time at large batches)."""
    if not items:
        return
    try:
        items[0][0].loop.call_soon_threadsafe(_deliver, items)  # one server, one event loop
    except RuntimeError:  # the event loop is gone (server shutting down)
        pass


class OpenSteps:
    """Engine observer: the sequences of the steps launched and not yet completed, i.e. those a failing step
    concerns."""

    def __init__(self):
        self.open: dict[int, list[Sequence]] = {}

    def on_add(self, seq, t_ns): pass

    def on_launch(self, step):
        self.open[step.index] = step.seqs

    def on_launched(self, step): pass

    def on_step(self, step):
        for index in [i for i in self.open if i <= step.index]:  # steps complete in order: older ones are over
            del self.open[index]

    def on_finish(self, seq, t_ns): pass

    def take(self) -> list[Sequence]:
        seqs = list({id(s): s for seqs in self.open.values() for s in seqs}.values())
        self.open.clear()
        return seqs


class EngineLoop:
    def __init__(self, engine: Engine, builder: AnatomyBuilder, stream_interval: int = 1):
        """`stream_interval`: a stream hears of its first token at once, then of new tokens every this many (and
        at its end); above 1, fewer chunks to write per step at large batches, in larger pieces (SGLang's
        --stream-interval)."""
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
        self.stream_interval = stream_interval
        self.engine = engine
        self.builder = builder
        self.store, self.metrics = builder.store, builder.metrics
        self.recorder = Recorder(Clock(engine.device))
        self.open_steps = OpenSteps()
        engine.observers += [self.recorder, self.open_steps]
        self._inbox: queue.Queue = queue.Queue()
        self._calls: dict[str, Call] = {}
        self._stopping = threading.Event()
        self.error: str | None = None  # set if the engine thread died
        self.failed_steps = 0  # consecutive
        self.last_failure: str | None = None
        self.started_at = time.time()
        self._thread = threading.Thread(target=self._run, name="llm-anatomy-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.builder.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what is running, then stop the engine thread and the builder (no requests come any more)."""
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout)
        self.builder.stop(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def unhealthy(self) -> str | None:
        """Why the engine cannot serve now (its thread stopped, or every recent step failed), else None."""
        if not self.alive:
            return f"the engine loop stopped: {self.error or 'not running'}"
        if self.failed_steps >= UNHEALTHY_AFTER_FAILED_STEPS:
            return f"the last {self.failed_steps} engine steps failed; the latest: {self.last_failure}"
        return None

    @property
    def accepted_len(self) -> int:
        """The longest prompt + max_tokens a request may have: the context, or the KV pool if smaller."""
        return min(self.engine.max_model_len, self.engine.pool.capacity_tokens)

    # ---- handler side -------------------------------------------------------------------------------
    def prepare(self, request: Request, received_ns: int, loop: asyncio.AbstractEventLoop,
                owner: str | None = None) -> Call:
        """Template, tokenize and check a request (in a worker thread, not the engine's): every error a user
        can fix is raised here, before the call reaches the engine."""
        engine = self.engine
        sampling = dict(request.sampling)
        given_max = sampling.pop("max_tokens")
        try:
            engine.sampling_params(**{**sampling, "min_tokens": 0}, max_tokens=1)  # the values alone, before any work
            rendered = render_prompt(engine.tokenizer, messages=request.messages, prompt=request.prompt,
                                     prompt_token_ids=request.prompt_token_ids,
                                     enable_thinking=request.enable_thinking, tools=request.tools)
            ids, prompt_text = rendered.token_ids, rendered.text
            room = self.accepted_len - len(ids)
            if given_max is None and room >= 1:
                given_max = max(room, sampling.get("min_tokens") or 0)  # to the end of the context, as OpenAI does
            params = engine.sampling_params(**sampling, max_tokens=given_max if given_max is not None else 1)
            engine.check_request(ids, params)
        except RequestError as e:
            code = "context_length_exceeded" if "context" in str(e) or "KV cache" in str(e) else None
            raise APIError(400, str(e), param=e.param, code=code) from None
        marks = Marks(received_ns, rendered.template_ns, rendered.tokenize_ns, time.perf_counter_ns())
        return Call(uuid.uuid4().hex[:16], request, marks, ids, prompt_text, params, loop, owner)

    def another_choice(self, call: Call, index: int) -> Call:
        """Choice `index` of a request with n > 1: the same prompt, its own sequence and anatomy; with a seed,
        seed + index (wrapped to 64 bits), so that the choices differ and each can be reproduced."""
        params = call.params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=seed_for_choice(params.seed, index))
        return Call(uuid.uuid4().hex[:16], call.request, dataclasses.replace(call.marks), call.prompt_token_ids,
                    call.prompt_text, params, call.loop, call.owner)

    def submit(self, call: Call) -> None:
        if self._stopping.is_set():
            raise unavailable("the server is shutting down")
        if not self.alive:
            raise unavailable(f"the engine stopped: {self.error}")
        self._inbox.put(("add", call))

    def abort(self, call: Call) -> None:
        """The client went away: stop decoding for it and free its KV blocks (done on the engine thread)."""
        if not call.done:
            self._inbox.put(("abort", call))

    # ---- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            if engine.device.type == "cuda":
                torch.cuda.set_device(engine.device)
            with torch.inference_mode():
                while self._take_inbox(block=not engine.has_work()):
                    if engine.has_work():
                        self._step()
                    self._hand_over_finished()
        except BaseException as e:  # noqa: BLE001 - a bug of the loop itself: answer what is in flight, not hang
            self.error = f"{type(e).__name__}: {e}"
            log.exception("the engine thread stopped")
            post_all([(call, APIError(500, f"the engine failed: {self.error}", type="server_error"))
                      for call in self._calls.values()])

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
            try:
                if what == "add":
                    self._add(call)
                elif call.seq is not None and not call.seq.finished:
                    self.engine.abort(call.seq)
            except Exception as e:  # noqa: BLE001 - this call alone fails
                self._fail(call, e, "admitting" if what == "add" else "aborting")

    def _reanchor_clock(self) -> None:
        """While idle (a sync costs nothing), take a fresh device reference: host and device clocks drift."""
        if self.recorder.clock.age_s > 60 and not self._calls:
            self.recorder.clock = Clock(self.engine.device)

    def _add(self, call: Call) -> None:
        self._calls[call.id] = call
        self.recorder.watch(call.id, call.marks.received)
        call.seq = self.engine.add_request(call.prompt_token_ids, call.params, request_id=call.id)

    def _fail(self, call: Call, e: Exception, doing: str) -> None:
        """One call failed on the engine thread: end it (freeing its blocks) and answer it with an error."""
        log.exception("%s request %s failed", doing, call.id)
        self._calls.pop(call.id, None)
        if call.seq is None:
            self.recorder.traces.pop(call.id, None)  # watched, never added: nothing will finish it
        elif not call.seq.finished:
            try:
                self.engine.abort(call.seq)
            except Exception:  # noqa: BLE001
                log.exception("aborting request %s after its failure failed too", call.id)
        if not call.done:
            call.done = True
            status = 400 if isinstance(e, RequestError) else 500
            call.post(APIError(status, f"{doing} this request failed: {type(e).__name__}: {e}",
                               type="invalid_request_error" if status == 400 else "server_error",
                               param=getattr(e, "param", None)))

    def _step(self) -> None:
        try:
            seqs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the step's calls, keep serving the others
            self._step_failed(e)
            return
        events = []
        errors = 0
        calls, interval = self._calls, self.stream_interval
        for seq in seqs:  # runs per sequence per step: locals, and finish_reason (set exactly when it finished)
            call = calls.get(seq.request_id)
            reason = seq.finish_reason
            if reason == "error":  # the engine ended it (a failure confined to it), blocks freed
                errors += 1
                self.last_failure = getattr(seq, "error", None) or "unknown error"
            if call is None or call.done:
                continue
            if reason is not None:
                call.done = True
            tokens = len(seq.output_token_ids)
            if reason == "error":
                events.append((call, APIError(500, f"the engine failed on this request: {self.last_failure}",
                                              type="server_error")))
            elif reason is not None or (call.request.stream and (  # a whole-answer call needs only its end
                    call.posted_tokens == 0 or tokens - call.posted_tokens >= interval)):
                call.posted_tokens = tokens
                events.append((call, Progress(seq.text, tokens, reason, seq.output_token_ids, seq.logprobs)))
        self.failed_steps = self.failed_steps + 1 if seqs and errors == len(seqs) else 0
        post_all(events)

    def _step_failed(self, e: Exception) -> None:
        log.exception("a step failed")
        self.failed_steps += 1
        self.last_failure = f"{type(e).__name__}: {e}"
        why = ("out of device memory while running this request; retry, or lower max_tokens or concurrency"
               if isinstance(e, torch.cuda.OutOfMemoryError) else f"the step running this request failed: "
                                                                 f"{self.last_failure}")
        try:
            self.engine.reset_pipeline()
        except Exception:  # noqa: BLE001
            log.exception("resetting the engine's pipeline failed")
        concerned = self.open_steps.take() or list(self.engine.scheduler.running)
        events = []
        for seq in concerned:
            call = self._calls.get(seq.request_id)
            try:
                self.engine.abort(seq)  # frees its KV blocks
            except Exception:  # noqa: BLE001
                log.exception("aborting %s after a failed step failed", seq.request_id)
            if call is not None and not call.done:
                call.done = True
                events.append((call, APIError(500, why, type="server_error")))
        post_all(events)

    def _hand_over_finished(self) -> None:
        for trace in self.recorder.take_finished():
            call = self._calls.pop(trace.request_id, None)
            if call is None:
                continue
            try:
                call.marks.end = trace.finished_ns
                seq = call.seq
                if not call.done:  # aborted
                    call.done = True
                    call.post(Progress(seq.text, len(seq.output_token_ids), seq.finish_reason, seq.output_token_ids,
                                       seq.logprobs))
                self.builder.add(call, trace, self.engine.result(seq, call.prompt_text), self.recorder.oldest_step)
            except Exception as e:  # noqa: BLE001 - this call's record is lost, nothing else
                self._fail(call, e, "recording")
