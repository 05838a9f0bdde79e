"""Several HTTP processes over one engine core (`--api-server-count`): each serves calls on the one socket with its
own pipes to the core, which routes each call's outputs to the process that took it in; anatomies and metrics
answer for the whole server from any of them; a process that dies takes only its own calls with it."""

import json
import os
import signal
import threading
import time
from multiprocessing import Pipe

import httpx
import pytest
import torch

from llm_anatomy import Engine
from llm_anatomy.server.core import Frontends, Gauges
from test_server import (GOOD, HELLO, MODEL, NO_EOS, Running, checkpoint, free_port,  # noqa: F401 - a fixture
                         start_process)

GAUGES = Gauges(1, 0, 0.5, 0, None)


# ---- the core's routing ------------------------------------------------------------------------------------------
def pipes(n):
    """n frontends' pipes: (the core's inboxes, the core's outboxes, the frontends' ends to send, to read)."""
    to_core = [Pipe(duplex=False) for _ in range(n)]
    from_core = [Pipe(duplex=False) for _ in range(n)]
    return [r for r, _ in to_core], [w for _, w in from_core], [w for _, w in to_core], [r for r, _ in from_core]


def test_each_frontend_hears_of_its_own_calls_and_everyone_of_the_figures():
    inboxes, outboxes, sends, reads = pipes(2)
    frontends = Frontends.of_pipes(inboxes, outboxes)
    try:
        frontends.adopt("a", 0)
        frontends.adopt("b", 1)
        output = lambda i: (i, "text", 1, None, None, None)  # noqa: E731
        frontends.post_step([output("a"), output("b")], [("b", 500, "failed", "server_error", None, True)], GAUGES,
                            (3, 2))
        assert reads[0].recv() == ("step", [output("a")], [], GAUGES, (3, 2))
        assert reads[1].recv() == ("step", [output("b")], [("b", 500, "failed", "server_error", None, True)], GAUGES,
                                   (3, 2))
        assert frontends.owner == {"a": 0}  # b failed for good: no anatomy follows
        frontends(("finished", ["stats"]))
        assert reads[0].recv() == reads[1].recv() == ("finished", ["stats"])
        frontends(("anatomy", "a", {"id": "a"}, b"{}", 1.5, 0.01, False))
        assert reads[0].recv() == ("anatomy", "a", {"id": "a"}, b"{}", 1.5, 0.01, False)
        assert reads[1].recv() == ("built", 1.5, 0.01, False) and frontends.owner == {}
        frontends.reply(1, ("profiled", 7, 200, {"status": "started"}))  # an answer goes to the one that asked
        assert reads[1].recv() == ("profiled", 7, 200, {"status": "started"}) and not reads[0].poll(0.05)
        sends[1].send(("add", None))
        assert frontends.ready(1.0) == [1] and frontends.recv(1) == ("add", None)
        sends[0].send(None)
        assert frontends.ready(1.0) == [0] and frontends.recv(0) is None and not frontends.stopped(0)
        frontends.adopt("c", 1)
        assert frontends.calls_of(1) == {"c"}
        sends[1].close()
        assert frontends.ready(1.0) == [1]
        with pytest.raises(EOFError):
            frontends.recv(1)
        frontends.gone(1)
        assert frontends.live == {0} and frontends.stopping == {0}  # the one left has said stop: the core may go
        frontends.reply(1, ("profiled", 8, 200, {}))  # to one gone: lost, nothing raised
        frontends(("stopped",))
        assert reads[0].recv() == ("stopped",)
        with pytest.raises(EOFError, match="every HTTP process is gone"):
            frontends.gone(0)
    finally:
        frontends.close()


def test_frontends_need_a_pipe_pair_each():
    inboxes, outboxes, _, _ = pipes(2)
    with pytest.raises(ValueError, match="one inbox and one outbox"):
        Frontends.of_pipes(inboxes, outboxes[:1])
    with pytest.raises(ValueError, match="one inbox and one outbox"):
        Frontends.of_pipes([], [])


# ---- a server of two HTTP processes, the engine on a thread of this one ---------------------------------------------
@pytest.fixture
def two(checkpoint, tmp_path):
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=1024,
                                    block_size=16, max_num_seqs=16)
    running = Running(engine, tmp_path, api_server_count=2)
    yield running
    running.stop()


class Frozen:
    """This process's HTTP server held still (its event loop asleep): whatever answers meanwhile is the other
    process, which takes every connection from the shared socket while this one cannot."""

    def __init__(self, running, seconds: float):
        self.running, self.seconds = running, seconds

    def __enter__(self):
        asleep = threading.Event()

        def sleep():
            asleep.set()
            time.sleep(self.seconds)

        self.until = time.monotonic() + self.seconds
        self.running.loop._event_loop.call_soon_threadsafe(sleep)
        assert asleep.wait(5)
        return self

    def __exit__(self, *exc):
        assert time.monotonic() < self.until, "the request took longer than the freeze: who answered is unknown"


def success(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", headers={"connection": "close"}).text.splitlines():
        if line.startswith("llm_anatomy:request_success_total{") and 'finished_reason="length"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_second_http_process_serves_calls_anatomies_and_metrics(two):
    url, fresh = two.url, {"connection": "close"}  # a connection a request: either process may take it
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "anatomy": True, **NO_EOS}
    made_here = httpx.post(f"{url}/v1/chat/completions", json=body).headers["x-anatomy-id"]
    with Frozen(two, 4):
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=fresh, timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        made_there = r.headers["x-anatomy-id"]
        assert r.json()["anatomy"]["id"] == made_there
        # the other process reads the anatomy this one stored, and counts both calls
        seen = httpx.get(f"{url}/v1/anatomy/{made_here}", headers=fresh, timeout=10)
        assert seen.status_code == 200 and json.loads(seen.text)["id"] == made_here
        assert success(url) == 2
        assert httpx.get(f"{url}/health", headers=fresh).json() == {"status": "ok"}
    assert json.loads(httpx.get(f"{url}/v1/anatomy/{made_there}").text)["id"] == made_there
    assert {a["id"] for a in httpx.get(f"{url}/v1/anatomy").json()["data"]} == {made_here, made_there}
    assert success(url) == 2
    two.wait_idle()


def test_a_profile_started_by_one_http_process_is_stopped_by_the_other(checkpoint, tmp_path):
    """The profiler is the engine core's: whichever process takes POST /start_profile, the other can stop it, and
    each answer goes to the process that asked."""
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=256)
    running = Running(engine, tmp_path / "run", api_server_count=2, profile_dir=tmp_path / "traces")
    try:
        fresh = {"connection": "close"}
        with Frozen(running, 4):  # the other process answers
            r = httpx.post(f"{running.url}/start_profile", headers=fresh, timeout=10)
            assert r.status_code == 200 and r.json()["status"] == "started"
        r = httpx.post(f"{running.url}/v1/chat/completions", headers=fresh,
                       json={"model": MODEL, "messages": HELLO, "max_tokens": 2, **NO_EOS})
        assert r.status_code == 200
        with Frozen(running, 4):  # a start there, with the window open: refused, to that process
            assert httpx.post(f"{running.url}/start_profile", headers=fresh, timeout=10).status_code == 409
        r = httpx.post(f"{running.url}/stop_profile", headers=fresh, timeout=60)  # this one, or the other: either
        assert r.status_code == 200 and r.json()["host_events"] > 0
        assert (tmp_path / "traces" / r.json()["trace"].rsplit("/", 1)[1]).is_file()
    finally:
        running.stop()


def test_an_http_process_that_dies_takes_only_its_calls(two, monkeypatch):
    url = two.url
    child = two.server.api_servers.processes[0]
    step = two.engine.step

    def slow_step():  # 400 tokens take seconds: the call still runs when its process dies
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(two.engine, "step", slow_step)
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 400, "stream": True, **NO_EOS}
    with Frozen(two, 4):
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"connection": "close"},
                          timeout=10) as r:
            lines = r.iter_lines()
            first = [next(lines) for _ in range(4)]  # the role's chunk, then tokens: it runs, in the other process
            assert r.status_code == 200 and two.engine.has_work(), first
            child.kill()
            with pytest.raises(httpx.HTTPError):
                for _ in lines:
                    pass
    two.wait_idle()  # the core aborted its call: every KV block is free again
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 3, "stream": False})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_sigterm_to_the_group_drains_every_http_process(checkpoint, tmp_path):
    """Ctrl-C or a supervisor's SIGTERM reaches every process of the group: the others ignore it and drain when the
    first says so, so a stream in flight in any of them finishes, and every process exits."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_process(checkpoint, tmp_path, port, "--api-server-count", "3")
    try:
        ids = {httpx.post(f"{url}/v1/chat/completions", json={**GOOD, "ignore_eos": True},
                          headers={"connection": "close"}).headers["x-anatomy-id"] for _ in range(6)}
        body = {**GOOD, "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            os.killpg(proc.pid, signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) in (0, -signal.SIGTERM)
        deadline = time.monotonic() + 30
        while True:  # the core, the anatomy builders and the other HTTP processes are gone too
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "a process of the server outlived it"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
    proc = start_process(checkpoint, tmp_path, port)
    try:
        for anatomy_id in ids:  # every process's anatomies were kept
            assert httpx.get(f"{url}/v1/anatomy/{anatomy_id}").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)


def test_an_http_process_that_cannot_start_leaves_nothing_running(checkpoint, tmp_path, monkeypatch):
    import multiprocessing
    import socket

    from llm_anatomy.errors import AnatomyError
    from llm_anatomy.server import api_servers
    from llm_anatomy.server.app import build_server
    from test_server import CEILINGS

    def fails(self, timeout=None):
        raise AnatomyError("llm-anatomy-http-1 exited while starting (exit code 1)")

    monkeypatch.setattr(api_servers.ApiServers, "wait_ready", fails)
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=1024,
                                    block_size=16, max_num_seqs=16)
    port, before = free_port(), set(threading.enumerate())
    with pytest.raises(AnatomyError, match="exited while starting"):
        build_server(engine, host="127.0.0.1", port=port, model_names=(MODEL,), ceilings=CEILINGS, run_dir=tmp_path,
                     telemetry_hz=None, device_why="test", api_server_count=2)
    deadline = time.monotonic() + 30
    while any(t.name == "llm-anatomy-engine" for t in set(threading.enumerate()) - before):  # told to stop
        assert time.monotonic() < deadline, "the engine core still runs"
        time.sleep(0.05)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("llm-anatomy-http")]
    socket.create_server(("127.0.0.1", port)).close()  # the port is free again
