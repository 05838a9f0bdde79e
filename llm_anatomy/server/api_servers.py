"""More HTTP processes for one engine core (`llm-anatomy serve --api-server-count N`, vLLM's API servers).

One interpreter takes requests in one after the other: at hundreds of streams that end together, parsing,
templating, tokenizing and answering them is serial work that keeps the engine waiting for its next batch. With N
HTTP processes, each accepts connections on the one listening socket (bound by the first, before anything loads),
has its own pair of pipes to the engine core (which routes each call's outputs to the process that took it in:
core.Frontends), and writes the anatomies of its calls to the run directory's database, where every process reads
them (store.py); every process hears of every finished call, so /metrics and /health answer for the whole server
whichever process a scrape reaches.

The first process (the one `serve` runs in) starts the others with the engine core and tells them when to drain
and when to go: they ignore signals themselves, so that a Ctrl-C or a SIGTERM to the process group drains once,
as the first one does. One that finds its parent gone exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time

import uvicorn

from ..errors import AnatomyError
from .app import DrainingServer, http_server, serve
from .loop import EngineClient
from .metrics import Metrics
from .store import AnatomyStore

log = logging.getLogger("llm_anatomy.server")
READY_TIMEOUT_S = 300.0  # for the other processes' imports and their copy of the engine's tokenizer


class ApiServers:
    """The server's other HTTP processes, as the first one sees them."""

    def __init__(self, settings, pipes: list[tuple], sock):
        """`pipes`: each process's ends of its pair (to the core, from the core), closed here once it has them."""
        ctx = multiprocessing.get_context("spawn")  # the first process may run a CUDA engine on a thread (tests)
        self._drain, self._exit = ctx.Event(), ctx.Event()
        self._ready = [ctx.Event() for _ in pipes]
        self.processes = [
            ctx.Process(target=main, name=f"llm-anatomy-http-{i + 1}", args=(
                i + 1, settings, to_core, from_core, sock, self._drain, self._exit, ready, os.getpid()))
            for i, ((to_core, from_core), ready) in enumerate(zip(pipes, self._ready))]
        for process in self.processes:
            process.start()
        for to_core, from_core in pipes:
            to_core.close()
            from_core.close()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until each serves (AnatomyError if one exits first or takes longer than `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        for process, ready in zip(self.processes, self._ready):
            while not ready.wait(0.2):
                if not process.is_alive():
                    raise AnatomyError(f"{process.name} exited while starting (exit code {process.exitcode})")
                if time.monotonic() > deadline:
                    raise AnatomyError(f"{process.name} did not start in {timeout:.0f} s")

    def drain(self) -> None:
        """Finish the requests in flight, take no new ones, then go (each within the drain timeout)."""
        if self._drain is not None:
            self._drain.set()

    def exit(self) -> None:
        """Go now (the requests in flight get what uvicorn's shutdown gives them)."""
        if self._exit is not None:
            self._exit.set()

    def join(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("%s did not exit in %.0f s: killing it", process.name, timeout)
                process.kill()
                process.join(5)
        # the events' semaphores, released now: alive at this process's exit, the resource tracker warns of them
        self._drain = self._exit = None
        self._ready = []


def main(index: int, settings, to_core, from_core, sock, drain, exit_now, ready, parent_pid: int) -> None:
    """Another HTTP process: its client of the engine core over its pipes, its app, uvicorn on the shared socket."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # the first process says when to go (FollowerServer, once serving)
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"llm-anatomy http {index}: %(message)s", stream=sys.stderr)
    store = AnatomyStore(settings.run_dir, settings.keep_anatomies, clear_pending=False)
    client = EngineClient.connect(to_core, from_core, store, Metrics(settings.model_names[0]))
    try:
        client.start()
    except AnatomyError as e:  # the first process says why too
        log.error("%s", e)
        store.close()
        sys.exit(1)
    server = http_server(settings, client, sock, on_start=ready.set, on_shutdown=store.close,
                         server_class=FollowerServer, control=(drain, exit_now, parent_pid))
    serve(server, switch_interval_s=settings.switch_interval_s, gc_threshold=settings.gc_threshold)


class FollowerServer(DrainingServer):
    """An HTTP process that drains and goes when the first one says so, not on signals of its own."""

    def __init__(self, config: uvicorn.Config, drain, sock, control: tuple):
        super().__init__(config, drain, sock)
        self.drain_asked, self.exit_asked, self.parent_pid = control

    def handle_exit(self, sig, frame) -> None:
        pass

    async def on_tick(self, counter: int) -> bool:
        if self.drain_asked.is_set() and not self.drain.draining:
            self.drain.begin()
        if self.exit_asked.is_set() or os.getppid() != self.parent_pid or self.drain.finished():
            self.should_exit = True
        return await uvicorn.Server.on_tick(self, counter)
