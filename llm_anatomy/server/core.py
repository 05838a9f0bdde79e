"""The engine core: the engine and everything that touches it, in a process of its own (vLLM's "engine core").

The server's HTTP process (FastAPI, uvicorn, parsing, templating, tokenizing, SSE, the anatomy store, metrics)
and the engine's step loop each have an interpreter lock of their own: the loop's per-step host work (scheduling,
detokenizing, the Recorder, the calls' outputs) no longer waits for the event loop writing hundreds of streams,
nor the event loop for it. `llm-anatomy serve` always runs the core in a process (`main`, started with "spawn":
CUDA cannot fork) from an EngineSpec; tests that build an Engine in their own process and reach into it run the
same core on a thread of that process (`run_core`). Either way the two sides speak over the same two pipes
(loop.py is the HTTP side). With several HTTP processes (`--api-server-count`, vLLM's API servers) each has
its own pair, and `Frontends` routes the core's messages (who gets what: its docstring):

  HTTP -> core  ("add", CallSpec), ("abort", id),
                ("want", id) (build this anatomy next), ("profile", token, "start" | "stop") (the profiler,
                answered by ("profiled", token, status, result)), None (stop once what runs has finished)
  core -> HTTP  ("progress", stage) while the engine loads, then ("ready", EngineInfo) or ("failed", why);
                ("step", outputs, failures, Gauges, step token counts): one message per step for all its calls;
                ("finished", [CallStats]) and ("anatomy", id, summary, json, joules, seconds, dropped) from the
                anatomy builder (anatomies.py), ("built", joules, seconds, dropped) to the HTTP processes that do not
                own the call; ("restarted",) when its process was replaced;
                ("died", why) if the loop itself failed; ("stopped",) after a stop, everything built.

A step's output per call is (id, new text, output tokens so far, finish reason, new token ids, their logprobs):
the text since the last one (never the whole text), ids and logprobs only for a call that asked for logprobs.
Text that could still become a stop string is held back until the call ends (the engine cuts a stop string
from the text, so what was sent never has to be taken back). Host instants (Marks) are perf_counter_ns values,
which on Linux read CLOCK_MONOTONIC: the same clock in both processes.
"""

from __future__ import annotations

import gc
import logging
import queue
import signal
import sys
import threading
from multiprocessing.connection import wait
from dataclasses import dataclass, field

import torch

from ..anatomy import Ceilings
from ..engine.engine import Admission, Engine
from ..engine.sampling import SamplingParams
from ..engine.scheduler import Sequence
from ..errors import AnatomyError, RequestError
from ..probe.call import Marks
from ..probe.clock import Clock
from ..probe.recorder import Recorder
from ..probe.timeline import ProfileError, ProfileWindow
from ..tokenizer import Tokenizer
from .anatomies import AnatomyBuilders
from .protocol import Request
from .turn import MAX_WAIT_S, LoopTurn

log = logging.getLogger("llm_anatomy.server")
UNHEALTHY_AFTER_FAILED_STEPS = 3  # consecutive failed steps after which /health says the engine cannot serve
IDLE_POLL_S = 1.0  # an idle core wakes this often: the stop flag, the clock's re-anchoring, fresh gauges


@dataclass(frozen=True)
class EngineSpec:
    """How to build the engine: Engine.from_pretrained's arguments, picklable (the core's process builds it)."""

    model: str
    settings: tuple[tuple[str, object], ...] = ()  # from_pretrained's keyword arguments, as pairs

    @classmethod
    def of(cls, model: str, **settings) -> "EngineSpec":
        return cls(str(model), tuple(sorted(settings.items())))

    def build(self, progress=None) -> Engine:
        return Engine.from_pretrained(self.model, progress=progress, **dict(self.settings))


@dataclass(frozen=True)
class CoreOptions:
    """What the core needs besides the engine."""

    ceilings: Ceilings | None = None  # None: measured in the core's process (or the cached ones), see `calibrate`
    calibrate: bool = True  # with no ceilings given: measure (or read the cache); False: the datasheet's
    device_why: str = ""
    telemetry_hz: float | None = 50.0  # None: no GPU telemetry
    keep_anatomies: int = 1000  # the anatomy builders' backlog, all together
    anatomy_processes: int = 1  # anatomy builders, each a process (anatomies.default_builders() for this machine)
    stream_interval: int = 1  # a stream hears of its first token at once, then of new ones every this many (and
    # at its end); above 1, fewer chunks to write per step at large batches, in larger pieces (SGLang's
    # --stream-interval)
    profile_dir: str | None = None  # where POST /stop_profile writes its traces; None: no profiling (404)

    def __post_init__(self):
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {self.stream_interval!r}")
        if not isinstance(self.anatomy_processes, int) or self.anatomy_processes < 1:
            raise ValueError(f"anatomy_processes must be an integer >= 1, got {self.anatomy_processes!r}")


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP process knows of the engine: sent once, when the core is ready."""

    admission: Admission  # fills in and checks requests as the engine will
    tokenizer: Tokenizer  # the HTTP process templates and tokenizes (and names logprobs' tokens) itself
    name: str  # the model's name (its source)
    weights_kind: str  # "checkpoint" | "synthetic"
    weights_label: str
    device: str

    @classmethod
    def of(cls, engine: Engine) -> "EngineInfo":
        return cls(engine.admission, engine.tokenizer, engine.source.name, engine.weights.kind, engine.weights.label,
                   str(engine.device))

    @property
    def accepted_len(self) -> int:
        """The longest prompt + max_tokens a request may have: the context, or the KV pool if smaller."""
        return min(self.admission.max_model_len, self.admission.capacity_tokens)


@dataclass(frozen=True, slots=True)
class Gauges:
    """The engine's state after a step, for /metrics and /health."""

    running: int
    waiting: int
    kv_usage: float  # fraction of KV blocks in use
    failed_steps: int  # consecutive
    last_failure: str | None
    power_mw: float | None = None  # the GPU's latest telemetry sample
    energy_mj: float | None = None


@dataclass
class CallSpec:
    """A checked, tokenized request: what both sides hold of a call, and what the HTTP side sends the core of it
    (("add", CallSpec), pickled)."""

    id: str
    request: Request
    marks: Marks
    prompt_token_ids: list[int]
    prompt_text: str | None
    params: SamplingParams

    def spec(self) -> "CallSpec":
        """This call's CallSpec alone (a subclass's own state, e.g. the HTTP side's mailbox, stays home)."""
        return CallSpec(self.id, self.request, self.marks, self.prompt_token_ids, self.prompt_text, self.params)


@dataclass
class CoreCall(CallSpec):
    """One request, on the core's side."""

    seq: Sequence | None = None
    done: bool = False  # its last output or error is sent
    sent_tokens: int = 0  # output tokens the HTTP side has been told of
    sent_chars: int = 0
    hold: int = field(init=False)  # characters held back while the text could still become a stop string
    want_logprobs: bool = field(init=False)

    def __post_init__(self):
        self.hold = max(0, max((len(s) for s in self.params.stop), default=0) - 1)
        self.want_logprobs = self.params.logprobs is not None

    def output(self, seq: Sequence, tokens: int, reason: str | None) -> tuple:
        text = seq.text
        upto = len(text) if reason is not None else len(text) - self.hold
        delta = text[self.sent_chars:upto] if upto > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, upto)
        ids = logprobs = None
        if self.want_logprobs:
            ids, logprobs = seq.output_token_ids[self.sent_tokens:tokens], seq.logprobs[self.sent_tokens:tokens]
        self.sent_tokens = tokens
        return self.id, delta, tokens, reason, ids, logprobs


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


class StepTokens:
    """Engine observer: the tokens each completed step forwarded, for the HTTP processes' /metrics
    (iteration_tokens_total), sent with the next step's message."""

    def __init__(self):
        self.tokens: list[int] = []

    def on_add(self, seq, t_ns): pass

    def on_launch(self, step): pass

    def on_launched(self, step): pass

    def on_step(self, step):
        self.tokens.append(step.num_tokens)

    def on_finish(self, seq, t_ns): pass

    def take(self) -> tuple[int, ...]:
        tokens, self.tokens = tuple(self.tokens), []
        return tokens


class Sender:
    """One end of a pipe that several threads send on (the step loop, the anatomy builder's threads), written by a
    thread of its own in the order the messages come. The step loop posts its messages and goes on: sending them
    itself, it waited behind the builder's large anatomies whenever the HTTP side was slow to read. The others
    wait until theirs is written."""

    def __init__(self, conn):
        self.conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None  # why a posted message was not sent: raised at the next post
        self._writer = threading.Thread(target=self._write, name="llm-anatomy-core-send", daemon=True)
        self._writer.start()

    def __call__(self, message) -> None:
        """Send `message` once what came before is sent, and wait until it is. Raises why it was not (one that
        does not pickle sends nothing)."""
        done = threading.Event()
        outcome: list[BaseException] = []
        self._queue.put((message, done, outcome))
        done.wait()
        if outcome:
            raise outcome[0]

    def post(self, message) -> None:
        """Send `message` once what came before is sent, without waiting. Raises why a message posted before it
        was not sent, once the writing thread has found out."""
        if self._error is not None:
            raise self._error
        self._queue.put((message, None, None))

    def close(self) -> None:
        """The writing thread ends after what was sent before."""
        self._queue.put(None)

    def _write(self) -> None:
        while (item := self._queue.get()) is not None:
            message, done, outcome = item
            try:
                self.conn.send(message)
            except BaseException as e:  # noqa: BLE001 - the sender learns it (now, or at its next message)
                if done is None:
                    self._error = e
                else:
                    outcome.append(e)
            if done is not None:
                done.set()


class Frontends:
    """The HTTP processes the core serves (vLLM's API servers, `--api-server-count`), a pair of pipes each. A call
    belongs to the process that sent it: its outputs, its failure and its anatomy go there alone. The gauges and
    every finished call's figures go to all of them, so that each answers /health and /metrics for the whole
    server; the others hear of an anatomy's figures alone (("built", joules, seconds, dropped)). A process whose
    pipe closes is gone: the core aborts its calls and serves the others, and ends when none is left."""

    def __init__(self, inboxes: list, senders: list):
        """`senders`: Senders (or anything with their `__call__`, `post` and `close`), one a frontend."""
        if not inboxes or len(inboxes) != len(senders):
            raise ValueError(f"one inbox and one outbox a frontend, got {len(inboxes)} and {len(senders)}")
        self.inboxes = list(inboxes)
        self.senders = list(senders)
        self.live = set(range(len(inboxes)))
        self.stopping: set[int] = set()  # said they send nothing more
        self.owner: dict[str, int] = {}  # call id -> its frontend, until its anatomy (or its failure) is sent

    @classmethod
    def of_pipes(cls, inboxes: list, outboxes: list) -> "Frontends":
        return cls(inboxes, [Sender(outbox) for outbox in outboxes])

    def ready(self, timeout: float) -> list[int]:
        """The frontends with something to read, waiting up to `timeout` seconds for one."""
        live = sorted(self.live)
        if len(live) == 1:  # one pipe's poll is cheaper than a selector built for each step
            return live if self.inboxes[live[0]].poll(timeout) else []
        ready = set(wait([self.inboxes[i] for i in live], timeout))
        return [i for i in live if self.inboxes[i] in ready]

    def recv(self, index: int):
        """The next message from this frontend; EOFError or OSError once it is gone."""
        return self.inboxes[index].recv()

    def adopt(self, call_id: str, index: int) -> None:
        """A call that this frontend sent (with one frontend, every call is its)."""
        if len(self.senders) > 1:
            self.owner[call_id] = index

    def calls_of(self, index: int) -> set[str]:
        return {call_id for call_id, i in self.owner.items() if i == index}

    def gone(self, index: int) -> None:
        """Its pipe closed. EOFError once none is left (the core's run ends)."""
        self.live.discard(index)
        self.stopping.discard(index)
        if not self.live:
            raise EOFError("every HTTP process is gone")

    def stopped(self, index: int) -> bool:
        """This frontend sends nothing more. True once every live one has said so."""
        self.stopping.add(index)
        return self.all_stopped

    @property
    def all_stopped(self) -> bool:
        """Every frontend left has said it sends nothing more (False once none is left: the core ends then)."""
        return bool(self.live) and self.live <= self.stopping

    def post_step(self, outputs: list[tuple], failures: list[tuple], gauges: "Gauges",
                  steps: tuple[int, ...] = ()) -> None:
        """A step's outputs and failures (each led by its call's id) to their calls' frontends, the gauges and the
        completed steps' token counts to all (each counts the whole server's), without waiting."""
        if len(self.senders) == 1:
            self._post(0, ("step", outputs, failures, gauges, steps))
            return
        mine = {i: ([], []) for i in self.live}
        for output in outputs:
            if (i := self.owner.get(output[0])) in mine:
                mine[i][0].append(output)
        for failure in failures:
            final = failure[5]  # no anatomy follows
            i = self.owner.pop(failure[0], None) if final else self.owner.get(failure[0])
            if i in mine:
                mine[i][1].append(failure)
        for i, (its_outputs, its_failures) in mine.items():
            self._post(i, ("step", its_outputs, its_failures, gauges, steps))

    def __call__(self, message) -> None:
        """Send one of the other messages (run_core's, the anatomy builder's) where it goes, waiting until it is
        sent. OSError only if no frontend could take it."""
        if message[0] == "anatomy":
            owner = self.owner.pop(message[1], 0 if len(self.senders) == 1 else None)
            figures = ("built",) + tuple(message[4:])
            sent = [self._send(i, message if i == owner else figures) for i in sorted(self.live)]
        else:
            sent = [self._send(i, message) for i in sorted(self.live)]
        if not any(sent):
            raise OSError("no HTTP process took the engine core's message")

    def reply(self, index: int, message) -> None:
        """An answer to what frontend `index` asked, to it alone, without waiting (lost if it is gone)."""
        if index in self.live:
            self._post(index, message)

    def _send(self, index: int, message) -> bool:
        try:
            self.senders[index](message)
            return True
        except OSError:  # gone: the step loop finds out from its inbox
            return False

    def _post(self, index: int, message) -> None:
        try:
            self.senders[index].post(message)
        except OSError:
            if len(self.senders) == 1:
                raise

    def close(self) -> None:
        for sender in self.senders:
            sender.close()


def run_with_pipes(engine: Engine, options: CoreOptions, inboxes: list, outboxes: list) -> None:
    """run_core from a thread of the HTTP side's process (EngineClient.in_thread)."""
    frontends = Frontends.of_pipes(inboxes, outboxes)
    try:
        run_core(engine, options, frontends)
    finally:
        frontends.close()


class EngineCore:
    """The step loop: admits calls, steps, aborts, and sends each step's outputs as one message. Nothing one request
    does stops it: every per-call operation is guarded so that its failure ends that call alone (HTTP 500, or 400
    for a RequestError), and a step that fails ends the requests that were in it (their KV blocks freed) while the
    loop goes on with the others. Finished calls go to the anatomy builder."""

    def __init__(self, engine: Engine, options: CoreOptions, ceilings: Ceilings, frontends: Frontends, telemetry,
                 telemetry_note: str):
        self.engine, self.options, self.frontends, self.telemetry = engine, options, frontends, telemetry
        self.recorder = Recorder(Clock(engine.device))
        self.open_steps = OpenSteps()
        self.step_tokens = StepTokens()
        # the builders' threads work while this loop waits for the device; on a CPU the forward is the loop's own
        # work, there is no such wait, and they go on at once
        self.turn = LoopTurn(max_wait_s=MAX_WAIT_S if engine.device.type == "cuda" else 0.0)
        self._observers = (self.recorder, self.open_steps, self.step_tokens, self.turn)
        engine.observers += self._observers
        self.anatomy_builders = AnatomyBuilders(engine, ceilings, frontends, telemetry, telemetry_note,
                                                options.device_why, backlog=options.keep_anatomies,
                                                processes=options.anatomy_processes, turn=self.turn)
        self._calls: dict[str, CoreCall] = {}
        self._outputs: list[tuple] = []  # for the next message
        self._failures: list[tuple] = []
        self._gauges: Gauges | None = None  # the last sent
        self._stopping = False
        self.failed_steps = 0
        self.last_failure: str | None = None
        self.profile = (ProfileWindow(options.profile_dir, engine.device, name="engine-core")
                        if options.profile_dir else None)
        self._profile_writer: threading.Thread | None = None  # writing the last window's trace

    def detach(self) -> None:
        """Take this core's observers off its engine (after its loop has ended)."""
        for observer in self._observers:
            self.engine.observers.remove(observer)

    def run(self) -> None:
        """Until told to stop by every HTTP process (and what runs has finished), or until their pipes close."""
        engine = self.engine
        try:
            with torch.inference_mode():
                while self._take_inbox(block=not engine.has_work()):
                    if engine.has_work():
                        self._step()
                    self._post_and_hand_over()
                    self._cut_expired_profile()
        finally:
            self.turn.waits()  # the builders finish what is left without waiting for their turn

    def _take_inbox(self, block: bool) -> bool:
        """Admit new calls and process aborts. False once told to stop and nothing is left to run."""
        frontends = self.frontends
        while True:
            if block and self._stopping:  # told to stop, and nothing runs
                return False
            if block:
                self.turn.waits()
            ready = frontends.ready(IDLE_POLL_S if block else 0)
            if not ready:
                if block:
                    self._reanchor_clock()
                    if self._stopping:
                        return False
                    self._flush(idle=True)
                    self._cut_expired_profile()
                    continue
                return True
            block = False
            self.turn.works()
            for index in ready:
                try:
                    item = frontends.recv(index)
                except (EOFError, OSError):
                    self._frontend_gone(index)  # EOFError once none is left: run's caller ends
                    continue
                if item is None:
                    self._stopping = frontends.stopped(index)
                    if self._stopping and not self.engine.has_work():
                        return False
                    continue
                self._take(index, item)

    def _take(self, index: int, item: tuple) -> None:
        what = item[0]
        if what == "want":
            self.anatomy_builders.want(item[1])
            return
        if what == "profile":
            self._profile(index, *item[1:])
            return
        call = CoreCall(**vars(item[1])) if what == "add" else self._calls.get(item[1])
        if call is None:  # an abort for a call already over
            return
        try:
            if what == "add":
                self.frontends.adopt(call.id, index)
                self._add(call)
            elif call.seq is not None and not call.seq.finished:
                self.engine.abort(call.seq)
        except Exception as e:  # noqa: BLE001 - this call alone fails
            self._fail(call, e, "admitting" if what == "add" else "aborting")

    def _cut_expired_profile(self) -> None:
        if self.profile is not None and self.profile.expired:
            try:
                self.profile.cut()  # kept for /stop_profile
            except Exception:  # noqa: BLE001 - the window is lost (its stop answers 409), serving goes on
                log.exception("cutting the profile window failed")
                self.profile.discard()

    def _profile(self, index: int, token: int, action: str) -> None:
        """POST /start_profile and /stop_profile from frontend `index`. A window's trace is written by a thread
        (seconds for a busy one) while the loop serves on; its answer follows from that thread."""
        def answer(status: int, result) -> None:
            try:
                self.frontends.reply(index, ("profiled", token, status, result))
            except OSError:  # the HTTP side is gone (the step loop finds out from its inbox): nobody asks any more
                pass

        if self.profile is None:
            answer(404, "the profiler is off: start the server with --profile-dir DIR")
        elif self._profile_writer is not None and self._profile_writer.is_alive():
            answer(409, "the last profile's trace is still being written: try again in a few seconds")
        elif action not in ("start", "stop"):
            answer(400, f"unknown profile action {action!r}")
        elif action == "stop" and not self.profile.has_window:
            answer(409, "no profile is running: POST /start_profile first")
        else:
            try:
                if action == "start":
                    answer(200, self.profile.start())
                    return
                self.profile.cut()  # on this thread: the window ends here, between steps
            except ProfileError as e:
                answer(409, str(e))
                return
            except Exception as e:  # noqa: BLE001 - the profiler failed (CUPTI taken, ...): the window is dropped
                log.exception("the profiler failed")
                self.profile.discard()
                answer(500, f"the profiler failed: {type(e).__name__}: {e}")
                return

            def write() -> None:
                try:
                    answer(200, self.profile.stop())
                except Exception as e:  # noqa: BLE001 - the profile is lost, nothing else
                    log.exception("writing the profile failed")
                    self.profile.discard()
                    answer(500, f"writing the profile failed: {type(e).__name__}: {e}")

            self._profile_writer = threading.Thread(target=write, name="llm-anatomy-profile-writer", daemon=True)
            self._profile_writer.start()

    def _frontend_gone(self, index: int) -> None:
        """An HTTP process is gone (its pipe closed): nobody waits for its calls any more, their KV blocks are
        freed. The others go on."""
        log.error("HTTP process %d is gone: aborting its calls", index)
        for call_id in self.frontends.calls_of(index):
            call = self._calls.get(call_id)
            if call is not None and call.seq is not None and not call.seq.finished:
                try:
                    self.engine.abort(call.seq)
                except Exception:  # noqa: BLE001
                    log.exception("aborting %s after its HTTP process went failed", call_id)
        self.frontends.gone(index)
        self._stopping = self.frontends.all_stopped

    def _reanchor_clock(self) -> None:
        """While idle (a sync costs nothing), take a fresh device reference: host and device clocks drift."""
        if self.recorder.clock.age_s > 60 and not self._calls:
            self.recorder.clock = Clock(self.engine.device)

    def _add(self, call: CoreCall) -> None:
        self._calls[call.id] = call
        self.recorder.watch(call.id, call.marks.received)
        call.seq = self.engine.add_request(call.prompt_token_ids, call.params, request_id=call.id)

    def _fail(self, call: CoreCall, e: Exception, doing: str) -> None:
        """One call failed here: end it (freeing its blocks) and answer it with an error (no anatomy follows)."""
        log.exception("%s request %s failed", doing, call.id)
        self._calls.pop(call.id, None)
        if call.seq is None:
            self.recorder.traces.pop(call.id, None)  # watched, never added: nothing will finish it
        elif not call.seq.finished:
            try:
                self.engine.abort(call.seq)
            except Exception:  # noqa: BLE001
                log.exception("aborting request %s after its failure failed too", call.id)
        call.done = True
        status = 400 if isinstance(e, RequestError) else 500
        self._failures.append((call.id, status, f"{doing} this request failed: {type(e).__name__}: {e}",
                               "invalid_request_error" if status == 400 else "server_error",
                               getattr(e, "param", None), True))

    def _step(self) -> None:
        try:
            seqs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the step's calls, keep serving the others
            self._step_failed(e)
            return
        outputs, errors = self._outputs, 0
        calls, interval = self._calls, self.options.stream_interval
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
                self._failures.append((call.id, 500, f"the engine failed on this request: {self.last_failure}",
                                       "server_error", None, False))
            elif reason is not None or (call.request.stream and (  # a whole-answer call needs only its end
                    call.sent_tokens == 0 or tokens - call.sent_tokens >= interval)):
                outputs.append(call.output(seq, tokens, reason))
        self.failed_steps = self.failed_steps + 1 if seqs and errors == len(seqs) else 0

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
        for seq in self.open_steps.take() or list(self.engine.scheduler.running):
            call = self._calls.get(seq.request_id)
            try:
                self.engine.abort(seq)  # frees its KV blocks
            except Exception:  # noqa: BLE001
                log.exception("aborting %s after a failed step failed", seq.request_id)
            if call is not None and not call.done:
                call.done = True
                self._failures.append((call.id, 500, why, "server_error", None, False))

    def _post_and_hand_over(self) -> None:
        """The step's outputs posted (with the gauges), then its finished calls handed to the anatomy builders, in
        that order: a builder may send a call's anatomy at once, and the HTTP side, where the anatomy ends the call,
        would drop last tokens that came after it and leave the stream waiting."""
        finished = []
        for trace in self.recorder.take_finished():
            call = self._calls.pop(trace.request_id, None)
            if call is None:
                continue
            try:
                call.marks.end = trace.finished_ns
                seq = call.seq
                if not call.done:  # aborted
                    call.done = True
                    self._outputs.append(call.output(seq, len(seq.output_token_ids), seq.finish_reason))
                finished.append((call, trace, self.engine.result(seq, call.prompt_text)))
            except Exception as e:  # noqa: BLE001 - this call's record is lost, nothing else
                self._fail(call, e, "recording")
        self._flush()
        for call, trace, result in finished:
            try:
                self.anatomy_builders.add(call, trace, result, self.recorder.oldest_step)
            except Exception as e:  # noqa: BLE001 - this call's record is lost, nothing else
                self._fail(call, e, "recording")
        if self._failures:  # the calls whose handing over failed: answered now, not at the next step
            self._flush()

    def gauges(self) -> Gauges:
        scheduler, pool = self.engine.scheduler, self.engine.pool
        sample = self.telemetry.latest() if self.telemetry is not None else None
        return Gauges(len(scheduler.running), len(scheduler.waiting), 1 - pool.num_free_blocks / pool.num_blocks,
                      self.failed_steps, self.last_failure, sample.power_mw if sample else None,
                      sample.energy_mj if sample else None)

    def _flush(self, idle: bool = False) -> None:
        """The step's outputs and failures in one message, with the gauges (alone when they changed, or when idle,
        for the telemetry's)."""
        gauges = self.gauges()
        if self._outputs or self._failures or self.step_tokens.tokens or gauges != self._gauges or idle:
            self.frontends.post_step(self._outputs, self._failures, gauges, self.step_tokens.take())
            self._outputs, self._failures, self._gauges = [], [], gauges


def _ceilings(engine: Engine, options: CoreOptions, progress) -> Ceilings:
    if options.ceilings is not None:
        return options.ceilings
    from ..probe.ceilings import datasheet_ceilings, load_or_calibrate

    if not options.calibrate:
        return datasheet_ceilings(engine.device)
    return load_or_calibrate(engine.device, quick=True, progress=progress).ceilings  # a busy one warns


def run_core(engine: Engine, options: CoreOptions, frontends: Frontends, progress=None) -> None:
    """Serve `engine` from this thread: the anatomy builder and the telemetry started, ("ready", EngineInfo)
    sent (or ("failed", why)), the step loop until stopped, then what is left built and ("stopped",) sent. A
    failure of the loop itself is sent as ("died", why) (the HTTP side then fails what is in flight)."""
    from ..probe.telemetry import TelemetryStream, nvml_status

    telemetry, core = None, None
    try:
        try:
            if engine.device.type == "cuda":
                torch.cuda.set_device(engine.device)
            ceilings = _ceilings(engine, options, progress)
            available, note = nvml_status(engine.device) if options.telemetry_hz else (False, "telemetry turned off")
            telemetry = TelemetryStream(engine.device, options.telemetry_hz) if available else None
            core = EngineCore(engine, options, ceilings, frontends, telemetry, note)
            if telemetry is not None:
                telemetry.start()
            core.anatomy_builders.start()
            frontends(("ready", EngineInfo.of(engine)))  # pickled before a byte is written: a failure sends nothing
        except Exception as e:  # noqa: BLE001 - the HTTP side says it and does not start
            log.exception("the engine core could not start")
            frontends(("failed", str(e) if isinstance(e, AnatomyError) else f"{type(e).__name__}: {e}"))
            return
        try:
            core.run()
        except (EOFError, OSError):  # the HTTP side is gone: nobody to answer
            return
        except BaseException as e:  # noqa: BLE001 - a bug of the loop itself: say so, the HTTP side answers
            log.exception("the engine loop stopped")
            frontends(("died", f"{type(e).__name__}: {e}"))
            return
        core.anatomy_builders.stop()
        frontends(("stopped",))
    finally:
        if core is not None:
            core.anatomy_builders.stop(timeout=5)  # a no-op after a stop; else its process ends with this one
            core.detach()
        if telemetry is not None:
            telemetry.stop()


def main(spec: EngineSpec, options: CoreOptions, inboxes: list, outboxes: list, switch_interval_s: float | None,
         gc_threshold: int | None) -> None:
    """The core's process: build the engine (its load stages sent as ("progress", stage)), then run_core. A load
    that fails is sent as ("failed", why), one line."""
    # The HTTP process stops this one through the pipe, after its drain: a Ctrl-C or a SIGTERM sent to the whole
    # process group must not end it first. An HTTP process that dies closes the pipe, which ends it too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="llm-anatomy engine: %(message)s", stream=sys.stderr)
    frontends = Frontends.of_pipes(inboxes, outboxes)
    try:
        _load_and_serve(spec, options, frontends, switch_interval_s, gc_threshold)
    finally:
        frontends.close()


def _load_and_serve(spec: EngineSpec, options: CoreOptions, frontends: Frontends, switch_interval_s: float | None,
                    gc_threshold: int | None) -> None:
    try:
        engine = spec.build(progress=lambda stage: frontends(("progress", stage)))
    except Exception as e:  # noqa: BLE001 - the HTTP process says it in one line and exits
        frontends(("failed", str(e) if isinstance(e, AnatomyError) else f"{type(e).__name__}: {e}"))
        return
    # As the HTTP process does (app.serve): out of the way of the collector, and a short switch interval for the
    # builder's threads (the step loop waits for the device with the lock released).
    gc.collect()
    gc.freeze()
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)
    if gc_threshold is not None:
        gc.set_threshold(gc_threshold, *gc.get_threshold()[1:])
    try:
        run_core(engine, options, frontends, progress=lambda stage: frontends(("progress", stage)))
    except (EOFError, OSError):  # the HTTP process is gone
        pass
