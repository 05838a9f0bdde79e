"""The HTTP side: an OpenAI-compatible FastAPI app over the engine core (core.py, in a process of its own, reached
through loop.py's EngineClient), and `serve` to run it with uvicorn.

Routes (docs/server.md has the details): completions.py (POST /v1/chat/completions, /v1/completions),
anatomy_routes.py (GET /v1/anatomy, /v1/anatomy/{id}, /anatomy/{id}), ops.py (GET /v1/models, /health,
/metrics). auth.py checks keys and body sizes, errors.py shapes every error as OpenAI does.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import sys
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from .. import __version__
from ..anatomy import Ceilings
from ..engine.engine import Engine
from ..errors import AnatomyError
from . import anatomy_routes, completions, ops
from .auth import Guard, Keys, load_salt
from .context import MAX_API_SERVERS, Drain, ServeOptions, ServerContext
from .core import CoreOptions, EngineSpec
from .errors import install_error_handlers
from .loop import EngineClient
from .metrics import Metrics
from .store import AnatomyStore

if TYPE_CHECKING:
    from .api_servers import ApiServers

KEEP_ALIVE_S = 75  # longer than clients' idle pools keep a connection (httpx: 5 s), so the client closes it first
SHUTDOWN_GRACE_S = 5  # after a drain, for responses still being written
SERVING_GC_THRESHOLD = 20_000  # allocations between the collector's young passes while serving (Python's: 700)
LISTEN_BACKLOG = 2048  # connections waiting to be taken in (uvicorn's default): holds a burst of hundreds of streams
SWITCH_INTERVAL_S = 0.001  # the interpreter's switch interval while serving, in both processes (Python's: 0.005)


def create_app(ctx: ServerContext, on_start=None, before_stop=None, on_shutdown=None) -> FastAPI:
    """The app over `ctx`; `on_start` once it serves, `before_stop` after its drain (before its client of the engine
    core stops), `on_shutdown` last."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.loop.attach(asyncio.get_running_loop())
        if on_start is not None:
            on_start()
        yield
        if before_stop is not None:
            before_stop()
        ctx.loop.stop()  # the drain has let the in-flight requests finish by now
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="llm-anatomy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(Guard, keys=ctx.keys, max_body_bytes=ctx.options.max_body_bytes, drain=ctx.drain)
    for module in (completions, anatomy_routes, ops):
        app.include_router(module.routes(ctx))
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain in front of its shutdown. On the first SIGTERM or SIGINT it keeps listening
    (so /health can say it is draining, and new completions get a 503 rather than a refused connection) until
    the requests in flight have finished or the drain timeout has passed; then it shuts down as uvicorn does
    (and re-raises the signal, so that the exit status says what ended it). A second signal skips the drain."""

    def __init__(self, config: uvicorn.Config, drain: Drain, sock: socket.socket | None = None,
                 api_servers: ApiServers | None = None):
        super().__init__(config)
        self.drain = drain
        self.drain_signal: int | None = None
        self.socket = sock  # listening already (build_server): served unless `run` is given others
        self.api_servers = api_servers  # the server's other HTTP processes, told to drain and to go with this one

    @property
    def port(self) -> int:
        return self.socket.getsockname()[1] if self.socket is not None else self.config.port

    async def serve(self, sockets=None) -> None:
        await super().serve(sockets if sockets is not None or self.socket is None else [self.socket])

    def handle_exit(self, sig, frame) -> None:
        if self.drain.draining or self.should_exit:
            if self.api_servers is not None:
                self.api_servers.exit()
            return super().handle_exit(sig, frame)
        self.drain_signal = sig
        self.drain.begin()
        if self.api_servers is not None:
            self.api_servers.drain()

    async def on_tick(self, counter: int) -> bool:
        if self.drain_signal is not None and not self.should_exit and self.drain.finished():
            super().handle_exit(self.drain_signal, None)
        return await super().on_tick(counter)


@dataclass(frozen=True)
class FrontendSettings:
    """What each HTTP process of a server builds its app from (picklable: the other processes are sent it)."""

    model_names: tuple[str, ...]
    run_dir: Path
    keep_anatomies: int = 1000
    keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 << 20
    drain_timeout_s: float = 120.0
    log_level: str = "warning"
    switch_interval_s: float | None = SWITCH_INTERVAL_S
    gc_threshold: int | None = SERVING_GC_THRESHOLD


def http_server(settings: FrontendSettings, client: EngineClient, sock: socket.socket, on_start=None,
                before_stop=None, on_shutdown=None, server_class=None, **server_args) -> "DrainingServer":
    """One HTTP process's uvicorn server over its client of the engine core (started), on `sock`."""
    info = client.info
    drain = Drain(settings.drain_timeout_s)
    # Every response says which weights wrote it: synthetic ones write text that is not the model's.
    ctx = ServerContext(client, ServeOptions(settings.model_names, settings.max_body_bytes),
                        Keys(settings.keys, load_salt(settings.run_dir)), drain,
                        f"llm-anatomy-{__version__}-{info.weights_kind}")
    app = create_app(ctx, on_start, before_stop, on_shutdown)
    # No limit_concurrency: past the engine's max_num_seqs requests queue in the scheduler, they are never
    # refused; the listen backlog holds bursts of connections.
    config = uvicorn.Config(app, log_level=settings.log_level, timeout_keep_alive=KEEP_ALIVE_S,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S, backlog=LISTEN_BACKLOG)
    return (server_class or DrainingServer)(config, drain, sock, **server_args)


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything loads (a port in use is said at once, in one line)."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=LISTEN_BACKLOG)
    except OSError as e:
        raise AnatomyError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --host or --port"
                           ) from None


def build_server(engine: Engine | EngineSpec, *, host: str, port: int, model_names: tuple[str, ...], run_dir,
                 ceilings: Ceilings | None = None, calibrate: bool = True, keep_anatomies: int = 1000,
                 api_keys: tuple[str, ...] = (), api_key: str | None = None, max_body_bytes: int = 4 << 20,
                 device_why: str = "", telemetry_hz: float | None = 50.0, drain_timeout_s: float = 120.0,
                 stream_interval: int = 1, anatomy_processes: int = 1, api_server_count: int = 1,
                 profile_dir: str | Path | None = None, log_level: str = "warning", progress=None,
                 switch_interval_s: float | None = SWITCH_INTERVAL_S,
                 gc_threshold: int | None = SERVING_GC_THRESHOLD) -> tuple[DrainingServer, EngineClient]:
    """The uvicorn server and its engine client, the engine core started and ready (AnatomyError if it could not
    start). `engine`: an EngineSpec runs the core in a process of its own (what `llm-anatomy serve` does; its
    load stages go to `progress`, and `switch_interval_s` and `gc_threshold` hold there as in `serve`); an
    Engine already built in this process runs it on a thread here (tests that reach into the engine).
    `ceilings`: None measures them (or reads the cache) where the engine runs, or takes the datasheet's without
    `calibrate`. `api_keys`: the accepted keys (`api_key`, one more); none: no key needed. `stream_interval`:
    tokens per streamed chunk at most (core.py). `anatomy_processes`: the anatomy builders' processes
    (anatomies.py). `api_server_count`: HTTP processes taking requests in on the one socket (this one and
    api_servers.py's others). `profile_dir`: POST /start_profile and /stop_profile profile the engine core and
    write their traces there (None: they answer 404)."""
    if not isinstance(engine, (EngineSpec, Engine)):
        raise TypeError(f"engine must be an EngineSpec or an Engine, got {type(engine).__name__}")
    if not isinstance(api_server_count, int) or not 1 <= api_server_count <= MAX_API_SERVERS:
        raise ValueError(f"api_server_count must be an integer in 1..{MAX_API_SERVERS}, got {api_server_count!r}")
    keys = tuple(api_keys) + ((api_key,) if api_key else ())
    settings = FrontendSettings(tuple(model_names), Path(run_dir).expanduser(), keep_anatomies, keys, max_body_bytes,
                                drain_timeout_s, log_level, switch_interval_s, gc_threshold)
    options = CoreOptions(ceilings=ceilings, calibrate=calibrate, device_why=device_why, telemetry_hz=telemetry_hz,
                          keep_anatomies=keep_anatomies, anatomy_processes=anatomy_processes,
                          stream_interval=stream_interval,
                          profile_dir=str(Path(profile_dir).expanduser()) if profile_dir is not None else None)
    sock = listen(host, port)
    store = client = api_servers = None
    ready = False
    try:
        store = AnatomyStore(settings.run_dir, keep_anatomies)
        metrics = Metrics(model_names[0])
        if isinstance(engine, EngineSpec):
            client = EngineClient.spawn(engine, options, store, metrics, switch_interval_s, gc_threshold,
                                        frontends=api_server_count)
        else:
            client = EngineClient.in_thread(engine, options, store, metrics, frontends=api_server_count)
        if client.others:  # started now, so that they read the core's "ready" as this one does
            from .api_servers import ApiServers

            api_servers = ApiServers(settings, client.others, sock)
        client.start(progress)
        ready = True
        if api_servers is not None:
            api_servers.wait_ready()
    except BaseException:
        if api_servers is not None:
            api_servers.exit()
            api_servers.join(10)  # their pipes close: the core stops waiting for them
        if ready:
            client.stop(30)  # the core started: it ends once told (a load that failed ended it already)
        if store is not None:
            store.close()
        sock.close()
        raise

    def before_stop():
        if api_servers is not None and not server.drain.draining:  # told to go without a drain: they go too
            api_servers.exit()

    def on_shutdown():
        if api_servers is not None:
            api_servers.join()
        store.close()

    server = http_server(settings, client, sock, before_stop=before_stop, on_shutdown=on_shutdown,
                         api_servers=api_servers)
    return server, client


@contextmanager
def collector_while_serving(threshold: int | None = SERVING_GC_THRESHOLD):
    """The cyclic collector's young passes every `threshold` allocations in this block (None: as they are). Each
    decode step allocates thousands of objects that live for a while (its streams' progress, its calls' step
    records, the futures and messages of hundreds of chunks): with Python's 700, a young pass, and every tenth an
    older one, runs every step or two, each re-walking the objects still alive, in the step loop and the event loop
    alike (each in its own process)."""
    before = gc.get_threshold()
    if threshold is not None:
        gc.set_threshold(threshold, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def serve(server: DrainingServer, sockets=None, switch_interval_s: float | None = SWITCH_INTERVAL_S,
          gc_threshold: int | None = SERVING_GC_THRESHOLD) -> None:
    """Run a built server (build_server) until SIGINT or SIGTERM: the drain lets in-flight requests finish (up to
    `drain_timeout_s`), then the engine core stops and the files close.

    `switch_interval_s`: this process's interpreter switch interval while it serves. The event loop, the engine
    client's reading thread (which waits on the pipe with the interpreter lock released) and the workers that
    tokenize take turns; taking the lock back, a thread waits for the one holding it to let go, which Python
    forces only after the switch interval (5 ms by default, a sizeable part of a decode step). None keeps
    Python's default. `gc_threshold`: the collector's young threshold while it serves (collector_while_serving)."""
    before = sys.getswitchinterval()
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)
    try:
        with collector_while_serving(gc_threshold):
            server.run(sockets=sockets)
    finally:
        sys.setswitchinterval(before)
