"""The anatomy builder's process: finished calls' anatomies are built here, away from the step loop's interpreter
lock.

It is started by the engine core's process (core.py) with multiprocessing's "spawn" (a fresh interpreter: the
engine's process holds the device, this one never touches it) and receives, in order on one pipe:
  1. once, the Setup: the engine's facts (probe/call.py EngineFacts), the ceilings, why this device (it answers
     "ready");
  2. per call, a Job: the call's trace by step index (probe/recorder.py TraceFacts), what it asked, its result,
     its marks, its telemetry samples, the device's memory when it finished; with it the snapshots of the steps
     it needs that were not sent before (a step's facts travel once, shared by every call in it), and the
     index below which no later call will need a step (those are forgotten);
  3. None: everything sent has been built; exit.
For each Job it sends back a Built: the anatomy's JSON line, its summary, its energy for the metrics, or why it
could not be built. Nothing here is shared with the engine's process but the two pipes.
"""

from __future__ import annotations

import signal
import time
import traceback
from dataclasses import dataclass

from ..anatomy import Ceilings
from ..engine.engine import GenerationResult
from ..probe.call import DeviceState, EngineFacts, Marks, TelemetryWindow, build_anatomy
from ..probe.recorder import TraceFacts

SERVED_NOTES = ("Served: activation peak not measured (requests share the device); the memory census is the "
                "device's within half a second of the call's end.",)


@dataclass(frozen=True)
class Setup:
    engine: EngineFacts
    ceilings: Ceilings
    device_why: str


@dataclass(frozen=True)
class Job:
    request: dict  # what was asked, as the anatomy shows it
    result: GenerationResult
    trace: TraceFacts
    marks: Marks
    window: TelemetryWindow
    state: DeviceState


@dataclass(frozen=True)
class Built:
    id: str
    json: bytes | None  # the anatomy's JSON (Anatomy.to_json, encoded); None when it could not be built
    summary: dict  # Anatomy.summary(), or {"id", "error"}
    joules: float | None  # metrics.call_joules of the anatomy
    seconds: float  # building it here
    failure: str | None = None  # the traceback, when it could not be built


class Builder:
    """The steps the calls still to come need, and the build of one call over them (also used in-process by
    tests and benchmarks, to compare and to measure)."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.steps: dict[int, tuple] = {}  # step index -> (Step without its sequences, StepMeasure snapshot)

    def take(self, new_steps: dict[int, tuple], job: Job, keep_from: int) -> Built:
        self.steps.update(new_steps)
        built = self.build(job)
        for index in [i for i in self.steps if i < keep_from]:
            del self.steps[index]
        return built

    def build(self, job: Job) -> Built:
        from .metrics import call_joules

        t0 = time.perf_counter()
        call_id = job.trace.request_id
        try:
            setup = self.setup
            anatomy = build_anatomy(setup.engine, job.request, job.result, job.trace.trace(self.steps),
                                    setup.ceilings, job.window, setup.device_why, job.marks,
                                    notes=list(SERVED_NOTES), state=job.state)
            return Built(call_id, anatomy.to_json().encode(), anatomy.summary(), call_joules(anatomy),
                         time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - one call's record is lost, the builder goes on
            return Built(call_id, None, {"id": call_id, "error": f"the anatomy could not be built: "
                                                                 f"{type(e).__name__}: {e}"},
                         None, time.perf_counter() - t0, traceback.format_exc())


def main(inbox, outbox) -> None:
    """The process's body: Jobs in, Builts out, until None (or the server's end of the pipe closes)."""
    # The engine's process ends this one through the pipe, once what it queued is built: a Ctrl-C or a SIGTERM sent
    # to the server's whole process group must not end it first (the calls in it would lose their anatomies, and
    # another would be started while the server drains). A parent that dies closes the pipe, which ends it too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        setup = inbox.recv()  # None: stopped before any call was sent
        builder = Builder(setup) if setup is not None else None
        outbox.send("ready")
        while builder is not None and (message := inbox.recv()) is not None:
            outbox.send(builder.take(*message))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):  # the server went away or is stopping: nothing to say
        pass
    finally:
        outbox.close()
