"""The engine core in a process of its own (what `llm-anatomy serve` runs): a real uvicorn in this process, the
engine in a spawned one, driven by the official openai client. What crosses the pipes (each step's text deltas,
logprobs, errors, gauges, anatomies) gives what the in-thread core gives; a call that fails in the engine's
process fails alone; the engine's process dying answers every call in flight and /health at once; a load that
fails is one clear line."""

import asyncio
import json
import time

import httpx
import openai
import pytest

from llm_anatomy.errors import AnatomyError
from llm_anatomy.server.app import build_server
from llm_anatomy.server.core import EngineSpec
from llm_anatomy.server.errors import APIError
from llm_anatomy.server.protocol import ChatCompletionRequest, chat_request
from test_server import (CEILINGS, HELLO, MODEL, NO_EOS, Running, checkpoint,  # noqa: F401 - a fixture
                         streamed_completion_tokens)

SETTINGS = dict(device="cpu", dtype="float32", kv_cache_tokens=1024, block_size=16, max_num_seqs=16)


class Spawned(Running):
    """A server whose engine core runs in a spawned process: the engine is out of reach, its state is read from
    /metrics."""

    def __init__(self, checkpoint, run_dir, **settings):
        super().__init__(EngineSpec.of(str(checkpoint), **{**SETTINGS, **settings}), run_dir)
        self.process = self.loop._worker

    def gauge(self, name: str) -> float:
        line = next(x for x in httpx.get(f"{self.url}/metrics").text.splitlines()
                    if x.startswith(f"llm_anatomy:{name}{{"))
        return float(line.rsplit(" ", 1)[1])

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while any(self.gauge(n) for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")):
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    running = Spawned(checkpoint, tmp_path_factory.mktemp("run"))
    yield running
    running.stop()
    assert running.process.exitcode == 0  # told to stop, it built what was left and exited


def chat(server, **kw):
    return server.client().chat.completions.create(model=MODEL, messages=kw.pop("messages", HELLO), **kw)


def test_the_engine_runs_in_another_process(server):
    import os

    assert server.process.pid != os.getpid() and server.process.is_alive()
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    model = server.client().models.list().data[0]
    assert model.id == MODEL and model.model_extra["max_model_len"] == 512 and model.model_extra["weights"] == \
        "checkpoint"


def test_streamed_and_whole_answers_and_their_anatomy(server):
    raw = server.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=12, temperature=0, extra_body={"anatomy": True, **NO_EOS})
    whole = raw.parse()
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    summary = whole.model_extra["anatomy"]
    assert summary["id"] == raw.headers["x-anatomy-id"] and summary["output_tokens"] == 12
    stream = server.client().chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"anatomy": True, **NO_EOS})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # the deltas put together: the same text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].model_extra["anatomy"]["output_tokens"] == 12
    stored = httpx.get(f"{server.url}/v1/anatomy/{summary['id']}").json()
    assert stored["text"] == text and stored["request"]["endpoint"] == "/v1/chat/completions"


def test_logprobs_stop_strings_and_n_choices_cross_the_pipe(server):
    r = chat(server, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(e.top_logprobs) == 2 for e in content)
    streamed = [e for c in server.client().chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, stream=True,
        extra_body=NO_EOS) if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]

    free = chat(server, max_tokens=24, temperature=0, extra_body=NO_EOS).choices[0].message.content
    stop = free[8:11]
    cut = free[:free.index(stop)]
    stream = server.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0,
                                                     stop=[stop], stream=True, extra_body=NO_EOS)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == cut  # never sent, then cut

    r = chat(server, max_tokens=5, n=3, temperature=0.8, seed=11, extra_body=NO_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 15


def test_concurrent_streams_all_complete(server):
    results = streamed_completion_tokens(server.async_client(), [
        dict(model=MODEL, prompt="word " * (1 + i % 7), max_tokens=4 + i % 9, temperature=0, extra_body=NO_EOS)
        for i in range(40)])
    assert results == [4 + i % 9 for i in range(40)]
    server.wait_idle()


def test_a_client_that_disconnects_frees_its_sequence(server):
    server.wait_idle()
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
        anatomy_id = r.headers["x-anatomy-id"]
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        assert server.gauge("num_requests_running") == 1
    server.wait_idle(timeout=20)  # aborted long before its 400 tokens, its KV blocks free
    a = httpx.get(f"{server.url}/v1/anatomy/{anatomy_id}").json()
    assert a["finish_reason"] == "abort" and 0 < len(a["output_token_ids"]) < 400


def test_a_call_that_fails_in_the_engines_process_fails_alone(server):
    """A call past the HTTP side's checks that the engine refuses when it admits it (here: a prompt token past the
    vocabulary, put in after `prepare`) gets its error; a stream running meanwhile completes."""
    client = server.loop

    async def poisoned():
        req = chat_request(ChatCompletionRequest.model_validate({"model": MODEL, "messages": HELLO, "max_tokens": 3}))
        call = client.prepare(req, time.perf_counter_ns())
        call.prompt_token_ids = [10 ** 9]
        client.submit(call)
        while True:
            for event in await call.events.take():
                if isinstance(event, APIError):
                    return event

    body = {"model": MODEL, "prompt": "The KV cache", "max_tokens": 30, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()
        next(lines)  # decoding
        error = asyncio.run_coroutine_threadsafe(poisoned(), client._event_loop).result(30)
        rest = [json.loads(line[6:]) for line in lines if line and line != "data: [DONE]"]
    assert error.status == 400 and "vocabulary" in error.message and error.param == "prompt"
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_the_engines_process_dying_ends_every_call_in_flight_and_health(checkpoint, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    running = Spawned(checkpoint, tmp_path)
    try:  # two calls of 480 tokens fit the pool (1024 tokens) together; the model's context is 512
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 480, "ignore_eos": True}
        with httpx.stream("POST", f"{running.url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=30) as s, ThreadPoolExecutor(1) as pool:
            lines = s.iter_lines()
            next(lines)
            whole = pool.submit(httpx.post, f"{running.url}/v1/chat/completions", json=body, timeout=30)
            while running.gauge("num_requests_running") < 2:
                time.sleep(0.02)
            t0 = time.monotonic()
            running.process.kill()
            rest = [line for line in lines if line]
            r = whole.result()
        assert time.monotonic() - t0 < 10  # at once, not after some timeout
        assert "the engine failed" in rest[-2] and rest[-1] == "data: [DONE]"
        assert r.status_code == 500 and "exit code -9" in r.json()["error"]["message"]
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 503 and "exited" in health.json()["error"]
        with pytest.raises(openai.InternalServerError):  # 503: new calls are refused
            chat(running, max_tokens=2)
    finally:
        running.stop()


def test_an_engine_that_cannot_load_is_one_clear_error(checkpoint, tmp_path, capsys):
    empty = tmp_path / "no-weights"
    empty.mkdir()
    with pytest.raises(AnatomyError, match="the engine could not start: .*safetensors"):
        build_server(EngineSpec.of(str(checkpoint), weights=str(empty), **SETTINGS), host="127.0.0.1", port=0,
                     model_names=(MODEL,), ceilings=CEILINGS, run_dir=tmp_path / "run", telemetry_hz=None)
    from llm_anatomy.cli import main

    capsys.readouterr()
    assert main(["serve", str(checkpoint), "--weights", str(empty), "--device", "cpu", "--no-calibrate",
                 "--port", "0", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("llm-anatomy: error: the engine could not start") and "Traceback" not in "".join(err)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_core_that_cannot_say_ready_or_ends_silently_fails_the_start_at_once(checkpoint, tmp_path, monkeypatch):
    """An engine whose description cannot cross the pipe is a start failure that says why, and a core (here, on a
    thread: no pipe closes when it ends) that ends without a word is one too: neither waits for the timeout."""
    import torch

    from llm_anatomy import Engine
    from llm_anatomy.server import core

    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=256, block_size=16,
                                    max_num_seqs=2)
    args = dict(host="127.0.0.1", port=0, model_names=(MODEL,), ceilings=CEILINGS, telemetry_hz=None)
    monkeypatch.setattr(core.EngineInfo, "of", classmethod(lambda cls, engine: (lambda: None)))  # pickles not
    t = time.monotonic()
    with pytest.raises(AnatomyError, match="the engine could not start: .*pickle"):
        build_server(engine, run_dir=tmp_path / "a", **args)
    for ending in (None, RuntimeError("a bug")):  # a raised error's traceback keeps the core's end of the pipe open
        monkeypatch.setattr(core, "run_core", lambda *a, ending=ending, **kw: _end(ending))
        with pytest.raises(AnatomyError, match="the engine(.s process exited| core ended) while loading"):
            build_server(engine, run_dir=tmp_path / str(ending), **args)
    assert time.monotonic() - t < 30


def _end(error):
    if error is not None:
        raise error


def test_build_server_takes_a_spec_or_an_engine_and_nothing_else(tmp_path):
    with pytest.raises(TypeError, match="EngineSpec or an Engine"):
        build_server(str(tmp_path), host="127.0.0.1", port=0, model_names=(MODEL,), ceilings=CEILINGS,
                     run_dir=tmp_path / "run", telemetry_hz=None)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_http_process_never_touches_the_device(tmp_path):
    """The engine's process holds the device (graphs, telemetry, the measured anatomy); this one none of it."""
    import torch

    before = torch.cuda.is_initialized()  # other tests of the session may have
    spec = EngineSpec.of("Qwen/Qwen3-0.6B", device="cuda", weights="synthetic", max_model_len=4096, max_num_seqs=8)
    running = Running(spec, tmp_path)
    try:
        r = chat(running, max_tokens=16, temperature=0, extra_body={"anatomy": True, **NO_EOS})
        assert r.usage.completion_tokens == 16 and r.model_extra["anatomy"]["output_tokens"] == 16
        stored = httpx.get(f"{running.url}/v1/anatomy/{r.model_extra['anatomy']['id']}").json()
        assert stored["device"]["type"] == "cuda"
        assert torch.cuda.is_initialized() == before  # serving did not
    finally:
        running.stop()


def test_the_cores_sender_posts_without_waiting_for_the_reader_and_keeps_the_order():
    """The step loop posts its messages while another thread's large message waits for a reader that is not
    reading (the pipe full): it does not wait. Messages arrive in the order they came; one that does not pickle
    sends nothing and is raised (at once when sent; when posted, at the next post)."""
    import multiprocessing
    import threading

    from llm_anatomy.server.core import Sender

    reading, writing = multiprocessing.Pipe(duplex=False)
    send = Sender(writing)
    big = threading.Thread(target=send, args=(("anatomy", b"x" * (8 << 20)),), daemon=True)  # > any pipe buffer
    big.start()
    t = time.monotonic()
    for i in range(100):
        send.post(("step", i))
    assert time.monotonic() - t < 1.0 and big.is_alive()
    assert reading.recv() == ("anatomy", b"x" * (8 << 20))
    assert [reading.recv() for _ in range(100)] == [("step", i) for i in range(100)]
    big.join(5)
    with pytest.raises(Exception, match="pickle"):
        send(("ready", lambda: None))
    send.post(("step", lambda: None))
    send(("died", "after a failed post"))  # written after it: the loop's last word still goes out
    assert reading.recv() == ("died", "after a failed post") and not reading.poll(0.1)
    with pytest.raises(Exception, match="pickle"):
        send.post(("step", 1))
    send.close()
