"""The HTTP process's side of the engine core (core.py): requests prepared here, handed to the core, its outputs
delivered to the calls' handlers.

Request handlers (asyncio) parse, template, tokenize and check a call in a worker thread (`prepare`), then
`submit` it: a writing thread sends it to the core (a send never blocks the event loop, however long the prompt).
A reading thread receives the core's messages: each step's outputs for all its calls go to the event loop with
one wake-up (`call_soon_threadsafe`), where each call's text is put together and its Progress put in its
mailbox; the finished calls' figures and anatomies go to the metrics and the store from the reading thread. If
the core stops (its process died, or its loop failed), every call in flight gets a 500 at once and /health says
why.

The core runs in a process of its own from an EngineSpec (`llm-anatomy serve`), or, for tests that build an
Engine in their own process and reach into it, on a thread of this process: the same core, the same pipes. With
several HTTP processes (api_servers.py), each has its own EngineClient and pipes: `connect` builds the others'.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import logging
import multiprocessing
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..engine.engine import Engine
from ..engine.sampling import seed_for_choice
from ..errors import AnatomyError, RequestError
from ..probe.call import Marks
from ..prompt import render_prompt
from . import core
from .core import UNHEALTHY_AFTER_FAILED_STEPS, CallSpec, CoreOptions, EngineInfo, EngineSpec, Gauges
from .errors import APIError, unavailable
from .metrics import Metrics
from .protocol import Request
from .store import AnatomyStore

log = logging.getLogger("llm_anatomy.server")


@dataclass(slots=True)
class Progress:
    text: str  # the call's whole output text so far
    tokens: int  # output tokens so far
    finish_reason: str | None = None  # set on the last one
    token_ids: list[int] | None = None  # the call's own lists (read only up to `tokens`), with logprobs only
    logprobs: list | None = None


class Mailbox:
    """A call's events, from the engine core to its handler on the event loop: the handler takes everything
    that arrived since it last looked at once (so a stream that fell behind sends one chunk for all of it).
    One list and one future: lighter than an asyncio.Queue, and this runs per call per step."""

    __slots__ = ("_items", "_waiter")

    def __init__(self):
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        """On the event loop."""
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
class Call(CallSpec):
    """One request in flight, on the HTTP side."""

    owner: str | None = None  # the salted hash of the API key that made it (None without keys)
    events: Mailbox = field(default_factory=Mailbox)
    text: str = ""  # the output so far, put together from the core's deltas
    token_ids: list[int] | None = None  # with logprobs: the output's ids and their logprobs so far
    logprobs: list | None = None
    done: bool = False  # its last output or error has arrived
    anatomy: dict | None = None  # its summary, once built (None also when there is none: aborted before its prefill)
    anatomy_built: bool = False  # set (before the "anatomy" event is posted) once the builder is done with it


class EngineClient:
    """The engine core, as the routes see it. Built by `spawn` (the core in its own process, from an EngineSpec)
    or `in_thread` (around an Engine of this process); `start` waits until the core is ready, `attach` (in the
    app's lifespan) starts delivering to the event loop, `stop` (after the drain) ends the core."""

    def __init__(self, store: AnatomyStore, metrics: Metrics):
        self.store, self.metrics = store, metrics
        self.info: EngineInfo | None = None
        self.started_at = time.time()
        self.error: str | None = None  # why the core stopped serving (set once)
        self._calls: dict[str, Call] = {}  # from submit until its anatomy is done with (or it failed for good)
        self._profiles: dict[int, asyncio.Future] = {}  # /start_profile and /stop_profile waiting for the core
        self._profile_tokens = itertools.count()
        self._gauges: Gauges | None = None
        self._stopping = False
        self._worker = None  # the core's process or thread
        self._to_core = self._from_core = None
        self.others: list[tuple] = []  # the other HTTP processes' ends of their pipes to the core, to hand on
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # what the writing thread sends to the core
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._reader = threading.Thread(target=self._read, name="llm-anatomy-core-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="llm-anatomy-core-writer", daemon=True)

    @classmethod
    def spawn(cls, spec: EngineSpec, options: CoreOptions, store: AnatomyStore, metrics: Metrics,
              switch_interval_s: float | None = 0.001, gc_threshold: int | None = None, frontends: int = 1
              ) -> "EngineClient":
        """The core in a process of its own. `frontends`: the HTTP processes it serves, this one the first; the
        others' pipes wait in `others` (api_servers.py hands them on)."""
        client = cls(store, metrics)
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot fork
        theirs = client._pipes(ctx, frontends)
        # Not a daemon: it starts the anatomy builder's process itself. It ends when told to (stop) or when its
        # inboxes close: at the HTTP processes' exit (before multiprocessing joins its children), or with them.
        client._worker = ctx.Process(target=core.main, name="llm-anatomy-engine",
                                     args=(spec, options, *theirs, switch_interval_s, gc_threshold))
        client._worker.start()
        for end in theirs[0] + theirs[1]:
            end.close()  # the core's ends: closed here, so that the pipes break when it dies
        atexit.register(client._abandon)
        return client

    @classmethod
    def in_thread(cls, engine: Engine, options: CoreOptions, store: AnatomyStore, metrics: Metrics,
                  frontends: int = 1) -> "EngineClient":
        client = cls(store, metrics)
        theirs = client._pipes(multiprocessing, frontends)
        client._worker = threading.Thread(target=core.run_with_pipes, name="llm-anatomy-engine", daemon=True,
                                          args=(engine, options, *theirs))
        client._worker.start()
        return client

    @classmethod
    def connect(cls, to_core, from_core, store: AnatomyStore, metrics: Metrics) -> "EngineClient":
        """Another HTTP process's client of a core already started (api_servers.py), over the pipes it was given."""
        client = cls(store, metrics)
        client._to_core, client._from_core = to_core, from_core
        return client

    def _pipes(self, ctx, frontends: int) -> tuple[list, list]:
        """A pair of pipes a frontend: this one's ends kept, the other frontends' in `others`; returns the core's
        ends (its inboxes, its outboxes)."""
        if not isinstance(frontends, int) or frontends < 1:
            raise ValueError(f"frontends must be an integer >= 1, got {frontends!r}")
        inboxes, outboxes = [], []
        for i in range(frontends):
            their_inbox, to_core = ctx.Pipe(duplex=False)
            from_core, their_outbox = ctx.Pipe(duplex=False)
            inboxes.append(their_inbox)
            outboxes.append(their_outbox)
            if i == 0:
                self._to_core, self._from_core = to_core, from_core
            else:
                self.others.append((to_core, from_core))
        return inboxes, outboxes

    def start(self, progress=None, timeout: float = 3600.0) -> EngineInfo:
        """Wait until the core is ready (its load stages to `progress`); AnatomyError if it could not start."""
        deadline = time.monotonic() + timeout
        while True:
            if not self._from_core.poll(max(0.0, min(1.0, deadline - time.monotonic()))):
                if self._worker is not None and not self._worker.is_alive() and not self._from_core.poll():
                    # a thread's end closes no pipe
                    self._end_worker()
                    raise AnatomyError(f"the engine core ended while loading (exit code {self._exitcode()})")
                if time.monotonic() > deadline:
                    self._end_worker()
                    raise AnatomyError(f"the engine was not ready in {timeout:.0f} s")
                continue
            try:
                message = self._from_core.recv()
            except (EOFError, OSError):
                self._end_worker()
                raise AnatomyError(f"the engine's process exited while loading (exit code {self._exitcode()})"
                                   ) from None
            if message[0] == "progress":
                if progress is not None:
                    progress(message[1])
            elif message[0] == "failed":
                self._end_worker()
                raise AnatomyError(f"the engine could not start: {message[1]}")
            elif message[0] == "ready":
                self.info = message[1]
                self._writer.start()
                return self.info

    def attach(self, event_loop: asyncio.AbstractEventLoop) -> None:
        """Deliver to this event loop from now on (the app's lifespan, on the loop)."""
        self._event_loop = event_loop
        self._reader.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Let the core finish what runs and build what is left, then end it (no requests come any more)."""
        self._stopping = True
        self._outbox.put(None)
        if self._reader.is_alive():
            self._reader.join(timeout)  # until ("stopped",): every anatomy is in the store
        self._outbox.put(StopIteration)  # the writing thread's end
        self._end_worker(timeout)
        atexit.unregister(self._abandon)

    def _abandon(self) -> None:
        """At exit without a stop: the core's inbox closed, so that it ends (and multiprocessing's join returns)."""
        self._to_core.close()

    def _end_worker(self, timeout: float = 10.0) -> None:
        worker = self._worker
        if worker is None:
            return
        worker.join(timeout)
        if isinstance(worker, multiprocessing.process.BaseProcess) and worker.is_alive():
            log.error("the engine's process did not exit in %.0f s: killing it", timeout)
            worker.kill()
            worker.join(5)

    def _exitcode(self):
        return getattr(self._worker, "exitcode", None)

    # ---- for the routes -------------------------------------------------------------------------------
    @property
    def accepted_len(self) -> int:
        return self.info.accepted_len

    def unhealthy(self) -> str | None:
        """Why the engine cannot serve now (its core stopped, or every recent step failed), else None."""
        if self.error is not None:
            return f"the engine stopped: {self.error}"
        g = self._gauges
        if g is not None and g.failed_steps >= UNHEALTHY_AFTER_FAILED_STEPS:
            return f"the last {g.failed_steps} engine steps failed; the latest: {g.last_failure}"
        return None

    def prepare(self, request: Request, received_ns: int, owner: str | None = None) -> Call:
        """Template, tokenize and check a request (in a worker thread): every error a user can fix is raised
        here, before the call reaches the engine."""
        admission = self.info.admission
        sampling = dict(request.sampling)
        given_max = sampling.pop("max_tokens")
        try:
            admission.sampling_params(**{**sampling, "min_tokens": 0}, max_tokens=1)  # the values alone, first
            rendered = render_prompt(self.info.tokenizer, messages=request.messages, prompt=request.prompt,
                                     prompt_token_ids=request.prompt_token_ids,
                                     enable_thinking=request.enable_thinking, tools=request.tools)
            ids, prompt_text = rendered.token_ids, rendered.text
            room = self.accepted_len - len(ids)
            if given_max is None and room >= 1:
                given_max = max(room, sampling.get("min_tokens") or 0)  # to the end of the context, as OpenAI does
            params = admission.sampling_params(**sampling, max_tokens=given_max if given_max is not None else 1)
            admission.check_request(ids, params)
        except RequestError as e:
            code = "context_length_exceeded" if "context" in str(e) or "KV cache" in str(e) else None
            raise APIError(400, str(e), param=e.param, code=code) from None
        marks = Marks(received_ns, rendered.template_ns, rendered.tokenize_ns, time.perf_counter_ns())
        return Call(uuid.uuid4().hex[:16], request, marks, ids, prompt_text, params, owner)

    def another_choice(self, call: Call, index: int) -> Call:
        """Choice `index` of a request with n > 1: the same prompt, its own sequence and anatomy; with a seed,
        seed + index (wrapped to 64 bits), so that the choices differ and each can be reproduced."""
        params = call.params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=seed_for_choice(params.seed, index))
        return Call(uuid.uuid4().hex[:16], call.request, dataclasses.replace(call.marks), call.prompt_token_ids,
                    call.prompt_text, params, call.owner)

    def submit(self, call: Call) -> None:
        if self._stopping:
            raise unavailable("the server is shutting down")
        if self.error is not None:
            raise unavailable(f"the engine stopped: {self.error}")
        self._calls[call.id] = call
        self._outbox.put(("add", call.spec()))

    def abort(self, call: Call) -> None:
        """The client went away: stop decoding for it and free its KV blocks (in the core)."""
        if not call.done and call.id in self._calls:
            self._outbox.put(("abort", call.id))

    async def profile(self, action: str) -> tuple[int, object]:
        """The core's profiler ("start" or "stop", core.EngineCore._profile): (HTTP status, its answer)."""
        if self.error is not None:
            raise unavailable(f"the engine stopped: {self.error}")
        token = next(self._profile_tokens)
        answer = self._profiles[token] = asyncio.get_running_loop().create_future()
        self._outbox.put(("profile", token, action))
        try:
            return await answer
        finally:
            self._profiles.pop(token, None)

    def want(self, anatomy_id: str) -> None:
        """Someone waits for this anatomy: the builder takes it next."""
        self._outbox.put(("want", anatomy_id))

    # ---- the writing thread ---------------------------------------------------------------------------
    def _write(self) -> None:
        while (message := self._outbox.get()) is not StopIteration:
            try:
                self._to_core.send(message)
            except OSError:  # the core is gone: the reading thread says so
                return

    # ---- the reading thread ---------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                message = self._from_core.recv()
            except (EOFError, OSError):
                if self.error is None:
                    if self._worker is None:
                        self._core_stopped("the engine core's pipe closed")
                    elif isinstance(self._worker, threading.Thread):
                        self._core_stopped("the engine's thread ended")
                    else:
                        self._worker.join(2)  # its pipe closed as it died: its exit code comes with its end
                        self._core_stopped(f"the engine's process exited (exit code {self._exitcode()})")
                return
            try:
                if not self._handle(message):
                    return
            except Exception:  # noqa: BLE001 - a bad message must not stop the deliveries
                log.exception("handling the engine's %r message failed", message[0])

    def _handle(self, message: tuple) -> bool:
        """One message from the core (core.py lists them); False once the core has stopped."""
        what = message[0]
        if what == "step":
            _, outputs, failures, gauges, steps = message
            self._gauges = self.metrics.live.gauges = gauges
            self.metrics.observe_steps(steps)
            if outputs or failures:
                self._on_loop(self._deliver, outputs, failures)
        elif what == "finished":
            self._finished(message[1])
        elif what == "anatomy":
            self._anatomy(*message[1:])
        elif what == "built":  # a call of another HTTP process: its figures alone
            self._built(*message[1:])
        elif what == "profiled":
            self._on_loop(self._profiled, *message[1:])
        elif what == "restarted":
            self.metrics.anatomy_builder_restarts.labels(self.metrics.model).inc()
        elif what == "died":
            self._core_stopped(f"the engine loop failed: {message[1]}")
            return False
        elif what == "stopped":
            self._core_stopped("the server stopped")
            return False
        return True

    def _deliver(self, outputs: list[tuple], failures: list[tuple]) -> None:
        """On the event loop: a step's outputs, one Progress per call (its text put together here)."""
        calls = self._calls
        for call_id, delta, tokens, reason, ids, logprobs in outputs:
            call = calls.get(call_id)
            if call is None or call.done:
                continue
            if delta:
                call.text += delta
            if ids is not None:
                if call.token_ids is None:
                    call.token_ids, call.logprobs = [], []
                call.token_ids += ids
                call.logprobs += logprobs
            if reason is not None:
                call.done = True
            call.events.put(Progress(call.text, tokens, reason, call.token_ids, call.logprobs))
        for call_id, status, message, kind, param, final in failures:
            call = calls.pop(call_id, None) if final else calls.get(call_id)  # final: no anatomy will follow
            if call is not None and not call.done:
                call.done = True
                call.events.put(APIError(status, message, type=kind, param=param))

    def _finished(self, stats: list) -> None:
        for s in stats:
            self.metrics.observe(s)
            call = self._calls.get(s.id)
            if call is not None and not call.anatomy_built:
                self.store.expect(s.id, call.owner)  # GET /v1/anatomy/{id} waits for it from now on

    def _anatomy(self, call_id: str, summary: dict | None, json: bytes | None, joules: float | None,
                 seconds: float | None, dropped: bool) -> None:
        call = self._calls.get(call_id)
        if json is not None:
            self.store.add_json(call_id, json, call.owner if call is not None else None)
        else:
            self.store.give_up(call_id)
        self._built(joules, seconds if json is not None else None, dropped)
        self._on_loop(self._anatomy_done, call_id, summary)

    def _built(self, joules: float | None, seconds: float | None, dropped: bool) -> None:
        """An anatomy done with (this process's call or another's): the metrics."""
        if seconds is not None:
            self.metrics.anatomy_build.labels(self.metrics.model).observe(seconds)
        self.metrics.observe_joules(joules)
        if dropped:
            self.metrics.anatomies_dropped.labels(self.metrics.model).inc()

    def _profiled(self, token: int, status: int, result) -> None:
        answer = self._profiles.get(token)
        if answer is not None and not answer.done():
            answer.set_result((status, result))

    def _anatomy_done(self, call_id: str, summary: dict | None) -> None:
        """On the event loop, after the step messages before it: the call is over."""
        call = self._calls.pop(call_id, None)
        if call is not None:
            call.anatomy, call.anatomy_built = summary, True
            call.events.put(("anatomy", summary))

    def _on_loop(self, fn, *args) -> None:
        """Run `fn` on the event loop, after what was sent there before: the calls (`_calls`) change only there,
        so that a step's outputs are delivered before the same call's anatomy ends it."""
        try:
            self._event_loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is gone (the server has shut down): nobody to answer
            pass

    def _core_stopped(self, why: str) -> None:
        """The core is gone: /health says so at once, and every call still waiting for something gets its answer."""
        if self.error is None:
            self.error = why
        if not self._stopping:
            log.error("%s: failing the calls in flight", why)
        if self._event_loop is not None:
            self._on_loop(self._fail_all, why)

    def _fail_all(self, why: str) -> None:
        for answer in self._profiles.values():
            if not answer.done():
                answer.set_exception(unavailable(f"the engine stopped: {why}"))
        calls, self._calls = self._calls, {}
        for call in calls.values():
            self.store.give_up(call.id)
            call.anatomy, call.anatomy_built = {"id": call.id, "error": f"the anatomy was lost: {why}"}, True
            if not call.done:
                call.done = True
                call.events.put(APIError(500, f"the engine failed: {why}", type="server_error"))
            call.events.put(("anatomy", call.anatomy))
