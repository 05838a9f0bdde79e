"""`llm-anatomy serve`: a real uvicorn on a loopback port, driven by the official openai client and httpx."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from conftest import tiny_hf_model
from llm_anatomy import Engine
from llm_anatomy.anatomy import Anatomy, Ceilings
from llm_anatomy.server.app import build_server
from llm_anatomy.server.core import EngineSpec
from llm_anatomy.server.responses import before_tool_call, split_tool_calls
from llm_anatomy.server.store import AnatomyStore

MODEL = "tiny-qwen3"
CEILINGS = Ceilings("cpu", read_gbps=20.0, gemv_gbps=15.0, matmul_tflops=0.5, datasheet_gbps=None,
                    datasheet_tflops=None, measured_at="2026-11-29")
HELLO = [{"role": "user", "content": "Hello there"}]
NO_EOS = {"ignore_eos": True}  # an extension field: the openai client sends it through extra_body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt") / "tiny"
    tiny_hf_model(initializer_range=0.2, vocab_size=151936).save_pretrained(directory)  # Qwen-sized vocabulary
    return directory


def streamed_completion_tokens(client: openai.AsyncOpenAI, requests: list[dict]) -> list:
    """Every request (completions.create's arguments) streamed at once through `client` (closed after): per request
    the completion tokens of its final usage chunk, or what it raised."""

    async def one(kw):
        stream = await client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
        usage = None
        async for c in stream:
            usage = c.usage or usage
        return usage.completion_tokens

    async def go():
        try:
            return await asyncio.gather(*(one(kw) for kw in requests), return_exceptions=True)
        finally:
            await client.close()

    return asyncio.run(go())


class Running:
    """A server on a thread of this process, so tests can look into its engine."""

    def __init__(self, engine, run_dir, **options):
        self.engine = engine
        self.port = free_port()
        self.server, self.loop = build_server(
            engine, host="127.0.0.1", port=self.port, model_names=(MODEL,), ceilings=CEILINGS, run_dir=run_dir,
            telemetry_hz=None, device_why="test", drain_timeout_s=10, **options)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine has nothing running or waiting and every KV block is free again."""
        deadline = time.monotonic() + timeout
        pool = self.engine.pool
        while self.engine.has_work() or pool.num_free_blocks != pool.num_blocks:
            assert time.monotonic() < deadline, (len(self.engine.scheduler.running), pool.num_free_blocks)
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    # A small pool (64 blocks of 16 tokens) so that the load test has to queue and preempt.
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=1024,
                                    block_size=16, max_num_seqs=32)
    running = Running(engine, tmp_path_factory.mktemp("run"))
    yield running
    running.stop()


def metric(server, series: str) -> float:
    """One series' value from /metrics (0 if not exported yet)."""
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("llm_anatomy:" + series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def chat(server, **kw):
    return server.client().chat.completions.create(model=MODEL, messages=kw.pop("messages", HELLO), **kw)


# ---- the openai client ------------------------------------------------------------------------------------------------
def test_chat_with_the_anatomy_extension(server):
    raw = server.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=9, temperature=0, extra_body={"anatomy": True, "ignore_eos": True})
    anatomy_id = raw.headers["x-anatomy-id"]
    r = raw.parse()
    assert r.object == "chat.completion" and r.model == MODEL and r.id.endswith(anatomy_id)
    assert r.system_fingerprint.endswith("-checkpoint") and raw.headers["x-llm-anatomy-weights"] == "checkpoint"
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 9 and r.usage.total_tokens == r.usage.prompt_tokens + 9
    summary = r.model_extra["anatomy"]
    assert summary["id"] == anatomy_id and summary["output_tokens"] == 9
    assert summary["prompt_tokens"] == r.usage.prompt_tokens
    assert summary["ttft_ms"] <= summary["e2e_ms"] and summary["decode"]["steps"] == 8

    full = Anatomy.from_json(httpx.get(f"{server.url}/v1/anatomy/{anatomy_id}").text)
    assert full.id == anatomy_id and full.text == r.choices[0].message.content
    assert full.request["endpoint"] == "/v1/chat/completions" and full.request["messages"][0]["content"] == "Hello there"
    assert full.batching is not None and full.batching.max_batch_size >= 1
    listed = httpx.get(f"{server.url}/v1/anatomy", params={"limit": 5}).json()["data"]
    assert listed[0]["id"] == anatomy_id and len(listed) <= 5
    assert httpx.get(f"{server.url}/v1/anatomy", params={"limit": 0}).status_code == 400
    html = httpx.get(f"{server.url}/anatomy/{anatomy_id}")
    assert html.status_code == 200 and "Content-Security-Policy" in html.text and anatomy_id in html.text


def test_stream_matches_the_non_streamed_answer(server):
    expected = chat(server, max_tokens=12, temperature=0, extra_body=NO_EOS).choices[0].message.content
    stream = server.client().chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"anatomy": True, "ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.model_extra["anatomy"]["output_tokens"] == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream") and r.headers["x-anatomy-id"]
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_async_client_stream_and_not(server):
    async def go():
        client = server.async_client()
        r = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0,
                                                 extra_body=NO_EOS)
        stream = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0,
                                                      extra_body=NO_EOS, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        await client.close()
        return r.choices[0].message.content, text

    plain, streamed = asyncio.run(go())
    assert plain == streamed


def test_completions_prompt_text_ids_and_echo(server):
    client = server.client()
    r = client.completions.create(model=MODEL, prompt="The KV cache", max_tokens=6, temperature=0, extra_body=NO_EOS)
    assert r.object == "text_completion" and r.usage.completion_tokens == 6
    ids = server.engine.tokenizer.encode("The KV cache")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, extra_body=NO_EOS)
    assert by_ids.choices[0].text == r.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    echoed = client.completions.create(model=MODEL, prompt="The KV cache", max_tokens=6, temperature=0,
                                       extra_body=NO_EOS, echo=True)
    assert echoed.choices[0].text == "The KV cache" + r.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt="The KV cache", max_tokens=6, temperature=0,
                                         extra_body=NO_EOS, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert client.completions.create(model=MODEL, prompt="x").usage.completion_tokens <= 16  # the API's default


def test_stop_strings_are_never_streamed(server):
    text = chat(server, max_tokens=24, temperature=0, extra_body=NO_EOS).choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip() and text.find(stop) > 0
    want = text[:text.find(stop)]
    plain = chat(server, max_tokens=24, temperature=0, extra_body=NO_EOS, stop=stop).choices[0]
    assert plain.message.content == want and plain.finish_reason == "stop"
    stream = server.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0,
                                                     extra_body=NO_EOS, stop=[stop], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_logprobs_chat_and_completions(server):
    r = chat(server, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == tops[0]  # greedy: the best one
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    stream = server.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                                     logprobs=True, top_logprobs=3, stream=True, extra_body=NO_EOS)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]
    assert chat(server, max_tokens=2, extra_body=NO_EOS).choices[0].logprobs is None  # not asked, not sent

    c = server.client().completions.create(model=MODEL, prompt="The KV cache", max_tokens=5, temperature=0,
                                           logprobs=2, extra_body=NO_EOS)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 2, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_logit_bias_steers_the_tokens(server):
    r = chat(server, max_tokens=5, temperature=0, logit_bias={"1234": 100}, extra_body=NO_EOS)
    a = Anatomy.from_json(httpx.get(f"{server.url}/v1/anatomy/{r.id.split('-', 1)[1]}").text)
    assert a.output_token_ids == [1234] * 5


def test_n_choices_streamed_and_not(server):
    raw = server.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, n=3, max_tokens=6, temperature=0.9, seed=11,
        extra_body={"ignore_eos": True, "anatomy": True})
    ids = raw.headers["x-anatomy-id"].split(",")
    r = raw.parse()
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(ids)) == 3
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == len(Anatomy.from_json(
        httpx.get(f"{server.url}/v1/anatomy/{ids[0]}").text).prompt_token_ids)
    assert [a["id"] for a in r.model_extra["anatomy"]] == ids
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # seed + i: the choices differ...
    again = chat(server, n=3, max_tokens=6, temperature=0.9, seed=11, extra_body=NO_EOS)
    assert [c.message.content for c in again.choices] == texts  # ...and repeat
    stream = server.client().chat.completions.create(model=MODEL, messages=HELLO, n=3, max_tokens=6, temperature=0.9,
                                                     seed=11, stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True, "anatomy": True})
    chunks = list(stream)
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == texts
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 18 and len(chunks[-1].model_extra["anatomy"]) == 3
    completions = server.client().completions.create(model=MODEL, prompt="The KV", n=2, max_tokens=4,
                                                     temperature=0, extra_body=NO_EOS)
    assert [c.index for c in completions.choices] == [0, 1]
    assert completions.choices[0].text == completions.choices[1].text  # greedy: the same twice
    server.wait_idle()


def test_seeded_sampling_repeats(server):
    a, b = (chat(server, max_tokens=8, temperature=0.9, top_p=0.95, seed=7,
                 extra_body={"top_k": 50, "min_p": 0.01, "ignore_eos": True}).choices[0].message.content for _ in range(2))
    assert a == b


def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    before = httpx.get(f"{server.url}/metrics").text
    chat(server, max_tokens=4, extra_body=NO_EOS, temperature=0)
    server.wait_idle()
    time.sleep(0.2)  # the anatomy thread feeds the counters after the response
    after = httpx.get(f"{server.url}/metrics").text

    def value(text, name):
        line = next(x for x in text.splitlines() if x.startswith(f"llm_anatomy:{name}{{"))
        return float(line.rsplit(" ", 1)[1])

    assert value(after, "generation_tokens_total") - value(before, "generation_tokens_total") == 4
    assert value(after, "time_to_first_token_seconds_count") == value(before, "time_to_first_token_seconds_count") + 1
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_sum", "prompt_tokens_total",
                 "inter_token_latency_seconds_count", 'request_success_total'):
        assert f"llm_anatomy:{name}" in after
    assert value(after, "num_requests_running") == 0 and value(after, "kv_cache_usage_perc") == 0


# ---- continuous batching under load -----------------------------------------------------------------------------------
def test_64_concurrent_streams_all_complete_and_the_pool_empties(server):
    """More demand than the 1024-token pool and 32 slots hold at once: requests queue (and may be preempted), and
    every one still gets all its tokens."""
    lengths = [4 + (i * 7) % 37 for i in range(64)]
    prompts = [[{"role": "user", "content": "word " * (1 + (i * 5) % 23)}] for i in range(64)]

    async def one(client, i):
        stream = await client.chat.completions.create(model=MODEL, messages=prompts[i], max_tokens=lengths[i],
                                                      temperature=0, extra_body=NO_EOS, stream=True,
                                                      stream_options={"include_usage": True})
        text, usage, finish = "", None, None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
            usage = c.usage or usage
        return text, usage, finish

    async def go():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                    http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=64)))
        out = await asyncio.gather(*(one(client, i) for i in range(64)))
        await client.close()
        return out

    results = asyncio.run(go())
    for (text, usage, finish), n in zip(results, lengths):
        assert finish == "length" and usage.completion_tokens == n
    server.wait_idle()
    # the same prompts alone give the same greedy text: batching changed nothing
    alone = chat(server, messages=prompts[5], max_tokens=lengths[5], temperature=0, extra_body=NO_EOS)
    assert alone.choices[0].message.content == results[5][0]


@pytest.fixture(params=[False, True], ids=["prefill-first", "mixed-steps"])
def batching_server(request, checkpoint, tmp_path):
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=1024,
                                    block_size=16, mixed_steps=request.param)
    running = Running(engine, tmp_path)
    yield running
    running.stop()


def test_batched_anatomy_names_who_shared_the_steps(batching_server):
    server = batching_server
    mixed = server.engine.scheduler.mixed_steps
    client = server.client()
    ids = []

    def run(n):
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=n,
                                                               temperature=0, extra_body=NO_EOS)
        ids.append(raw.headers["x-anatomy-id"])

    threads = [threading.Thread(target=run, args=(40,))]
    threads[0].start()
    time.sleep(0.05)
    threads += [threading.Thread(target=run, args=(10,)) for _ in range(3)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join()
    anatomies = [Anatomy.from_json(httpx.get(f"{server.url}/v1/anatomy/{i}").text) for i in ids]
    longest = max(anatomies, key=lambda a: len(a.output_token_ids))
    assert longest.batching.max_batch_size > 1
    assert set(longest.batching.co_scheduled) & set(ids)
    shared = [s for s in longest.decode_steps if s.batch_size > 1]
    assert shared and all(set(s.joined + s.left) <= set(ids) for s in shared)
    # the batch at each step, rebuilt from the prefill's and the changes, matches its size
    for s in longest.decode_steps:
        others = longest.others_at(s.index)
        assert len(others) + 1 == s.batch_size and set(others) <= set(ids)
    carried = [s for s in longest.decode_steps if s.step_tokens > s.batch_size]
    if mixed:  # the later prompts were prefilled in steps this one decoded in: no stalls, longer steps
        assert carried and not longest.batching.stalls
        assert all(set(s.joined) <= set(ids) for s in carried)
    else:  # their prefill steps held this one back, and its anatomy says whose they were
        assert not carried and longest.batching.stalls
        assert all(set(st.requests) <= set(ids) and st.gpu_ms >= 0 for st in longest.batching.stalls)


# ---- bad input ------------------------------------------------------------------------------------------------------
GOOD = {"model": MODEL, "messages": HELLO, "max_tokens": 4}
BAD = [
    ("invalid JSON", b"{nope", 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("unknown model", {**GOOD, "model": "gpt-4o"}, 404, "model"),
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("empty messages", {**GOOD, "messages": []}, 400, "messages"),
    ("message without role", {**GOOD, "messages": [{"content": "hi"}]}, 400, "messages"),
    ("content of the wrong type", {**GOOD, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("temperature as a string", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("max_tokens as a float", {**GOOD, "max_tokens": 2.5}, 400, "max_tokens"),
    ("temperature < 0", {**GOOD, "temperature": -0.1}, 400, "temperature"),
    ("top_p = 0", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("top_p > 1", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("max_tokens < 1", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("presence_penalty > 2", {**GOOD, "presence_penalty": 3}, 400, "presence_penalty"),
    ("n > 16", {**GOOD, "n": 17}, 400, "n"),
    ("n = 0", {**GOOD, "n": 0}, 400, "n"),
    ("top_logprobs without logprobs", {**GOOD, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs > 20", {**GOOD, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("logit_bias key not a token id", {**GOOD, "logit_bias": {"hello": 5}}, 400, "logit_bias"),
    ("logit_bias value > 100", {**GOOD, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias token outside the vocabulary", {**GOOD, "logit_bias": {"99999999": 5}}, 400, "logit_bias"),
    ("json mode", {**GOOD, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("forced tool choice", {**GOOD, "tool_choice": "required"}, 400, "tool_choice"),
    ("stream_options without stream", {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("image content", {**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages"),
    ("prompt past the context", {**GOOD, "messages": [{"role": "user", "content": "word " * 600}]}, 400, "prompt"),
    ("max_tokens past the context", {**GOOD, "max_tokens": 600}, 400, "max_tokens"),
]


@pytest.mark.parametrize("body,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error(server, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}/v1/chat/completions", **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert len(error["message"]) > 10


def test_other_bad_requests_and_the_server_keeps_serving(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "suffix": "y"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [999999999]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/nothing").status_code == 404
    assert httpx.get(f"{server.url}/v1/chat/completions").status_code == 405
    assert httpx.get(f"{server.url}/v1/anatomy/0123456789abcdef").json()["error"]["code"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=HELLO)
    assert chat(server, max_tokens=2, extra_body=NO_EOS).usage.completion_tokens == 2


def test_body_size_limit_and_api_key(checkpoint, tmp_path):
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=256,
                                    weights="synthetic")
    running = Running(engine, tmp_path, api_key="sekret", max_body_bytes=2000)
    try:
        assert httpx.get(f"{running.url}/health").status_code == 200  # open to probes
        for path in ("/v1/models", "/metrics", "/v1/anatomy/x"):
            r = httpx.get(running.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for path in ("/start_profile", "/stop_profile"):  # the profiler is the operator's
            assert httpx.post(running.url + path).status_code == 401
        assert httpx.get(running.url + "/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            running.client(api_key="wrong").models.list()
        client = running.client(api_key="sekret")
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=2)
        r = raw.parse()
        assert r.usage.completion_tokens <= 2
        # synthetic weights say so on every response: their text is not the model's
        assert raw.headers["x-llm-anatomy-weights"] == "synthetic" and r.system_fingerprint.endswith("-synthetic")
        big = {**GOOD, "messages": [{"role": "user", "content": "x" * 5000}]}
        r = httpx.post(f"{running.url}/v1/chat/completions", json=big, headers={"authorization": "Bearer sekret"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked():  # no Content-Length: the limit is enforced while reading
            yield json.dumps(big).encode()

        r = httpx.post(f"{running.url}/v1/chat/completions", content=chunked(),
                       headers={"authorization": "Bearer sekret", "content-type": "application/json"})
        assert r.status_code == 413
    finally:
        running.stop()


def test_profile_windows_of_the_engine_core(checkpoint, tmp_path):
    """POST /start_profile and /stop_profile (serve --profile-dir): a window's trace written and summed up, the
    wrong order refused with OpenAI's error shape, the server serving throughout."""
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=256)
    running = Running(engine, tmp_path / "run", profile_dir=tmp_path / "traces")
    try:
        r = httpx.post(f"{running.url}/stop_profile")
        assert r.status_code == 409 and r.json()["error"]["code"] == "profile_state"
        assert "POST /start_profile first" in r.json()["error"]["message"]
        r = httpx.post(f"{running.url}/start_profile")
        assert r.status_code == 200 and r.json()["status"] == "started"
        r = httpx.post(f"{running.url}/start_profile")
        assert r.status_code == 409 and "already running" in r.json()["error"]["message"]
        assert chat(running, max_tokens=3, extra_body=NO_EOS).usage.completion_tokens == 3
        r = httpx.post(f"{running.url}/stop_profile", timeout=60)
        assert r.status_code == 200, r.text
        window = r.json()
        assert window["host_events"] > 0 and window["device"] is None and window["seconds"] > 0
        trace = tmp_path / "traces" / window["trace"].rsplit("/", 1)[1]
        assert trace.is_file() and trace.name.startswith("engine-core-")
        assert httpx.post(f"{running.url}/stop_profile").status_code == 409
        assert httpx.get(f"{running.url}/v1/start_profile").status_code == 404
        assert httpx.get(f"{running.url}/start_profile").status_code == 405
        assert chat(running, max_tokens=2, extra_body=NO_EOS).usage.completion_tokens == 2
        # `llm-anatomy bench --profile` brackets its level with the two, the window's answer in the level
        from llm_anatomy.bench.cli import main as bench

        out = tmp_path / "bench.json"
        assert bench([running.url, "--concurrency", "1", "--num-prompts", "2", "--input-tokens", "8",
                      "--output-tokens", "3", "--gpus", "none", "--profile", "--json", str(out)]) == 0
        level = json.loads(out.read_text())["levels"][0]
        assert level["completed"] == 2 and level["profile"]["host_events"] > 0
        assert (tmp_path / "traces" / level["profile"]["trace"].rsplit("/", 1)[1]).is_file()
    finally:
        running.stop()


def test_a_profiler_that_fails_answers_500_and_the_server_serves_on(checkpoint, tmp_path, monkeypatch):
    from llm_anatomy.probe.timeline import ProfileWindow

    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=256)
    running = Running(engine, tmp_path / "run", profile_dir=tmp_path / "traces")
    try:
        start = ProfileWindow.start

        def taken(self):
            raise RuntimeError("CUPTI is in use by another profiler")

        monkeypatch.setattr(ProfileWindow, "start", taken)
        r = httpx.post(f"{running.url}/start_profile")
        assert r.status_code == 500 and r.json()["error"]["code"] == "profile_failed"
        assert "CUPTI is in use" in r.json()["error"]["message"] and r.json()["error"]["type"] == "server_error"
        assert chat(running, max_tokens=2, extra_body=NO_EOS).usage.completion_tokens == 2
        monkeypatch.setattr(ProfileWindow, "start", start)
        assert httpx.post(f"{running.url}/start_profile").status_code == 200  # nothing was left open
        monkeypatch.setattr(ProfileWindow, "_summary", lambda *a: 1 / 0)  # writing the trace fails
        r = httpx.post(f"{running.url}/stop_profile", timeout=60)
        assert r.status_code == 500 and "ZeroDivisionError" in r.json()["error"]["message"]
        assert httpx.post(f"{running.url}/stop_profile").status_code == 409  # the window is gone
        assert chat(running, max_tokens=2, extra_body=NO_EOS).usage.completion_tokens == 2
    finally:
        running.stop()


def test_profile_is_off_without_a_profile_dir(server):
    for path in ("/start_profile", "/stop_profile"):
        r = httpx.post(server.url + path)
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["code"] == "profiler_off" and "--profile-dir" in error["message"]
        assert error["type"] == "invalid_request_error"


# ---- faults -----------------------------------------------------------------------------------------------------------
def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    server.wait_idle()
    body = {**GOOD, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
        anatomy_id = r.headers["x-anatomy-id"]
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    server.wait_idle(timeout=20)  # aborted long before its 400 tokens
    a = Anatomy.from_json(httpx.get(f"{server.url}/v1/anatomy/{anatomy_id}").text)
    assert a.finish_reason == "abort" and 0 < len(a.output_token_ids) < 400


def test_a_client_that_disconnects_while_waiting_for_a_whole_answer(server):
    server.wait_idle()
    body = {**GOOD, "max_tokens": 400, "ignore_eos": True}
    before = metric(server, 'request_success_total{finished_reason="abort",model_name="tiny-qwen3"}')
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=0.3)
    server.wait_idle(timeout=20)
    time.sleep(0.2)  # counted by the anatomy thread
    assert metric(server, 'request_success_total{finished_reason="abort",model_name="tiny-qwen3"}') == before + 1


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(checkpoint, tmp_path):
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=256)
    running = Running(engine, tmp_path)
    run = engine.runner.run
    try:
        def broken(*args, **kwargs):
            raise RuntimeError("injected fault")

        engine.runner.run = broken
        r = httpx.post(f"{running.url}/v1/chat/completions", json={**GOOD, "ignore_eos": True})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "injected fault" in r.json()["error"]["message"]
        body = {**GOOD, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{running.url}/v1/chat/completions", json=body) as s:
            lines = [line for line in s.iter_lines() if line]
        assert "injected fault" in lines[-2] and lines[-1] == "data: [DONE]"
        running.wait_idle()
        engine.runner.run = run
        assert httpx.get(f"{running.url}/health").json() == {"status": "ok"}
        assert running.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                                        extra_body=NO_EOS).usage.completion_tokens == 3
    finally:
        engine.runner.run = run
        running.stop()


def test_store_keeps_the_newest_across_restarts(tmp_path):
    from sample_anatomy import sample_anatomy

    store = AnatomyStore(tmp_path, keep=4)
    for i in range(11):
        a = sample_anatomy()
        a.id = f"id{i:02d}"
        store.add(a)
    assert store.ids() == ["id07", "id08", "id09", "id10"] and len(store) == 4
    assert json.loads(store.get("id09"))["id"] == "id09" and store.get("id02", wait_s=0) is None
    store.expect("pending")  # a server that stops before building it: forgotten at the next start
    store.close()
    again = AnatomyStore(tmp_path, keep=4)
    assert again.ids() == ["id07", "id08", "id09", "id10"] and again.owner_of("pending") == (False, None)
    a = sample_anatomy()
    a.id = "after"
    again.add(a)
    assert json.loads(again.get("after"))["id"] == "after" and again.ids()[0] == "id08"
    again.close()


def test_store_is_shared_by_processes_of_one_server(tmp_path):
    """Two stores on one run directory, as two HTTP processes hold them: what one stores or is building, the other
    reads, lists and waits for."""
    from sample_anatomy import sample_anatomy

    first, second = AnatomyStore(tmp_path, keep=3), AnatomyStore(tmp_path, keep=3, clear_pending=False)
    a = sample_anatomy()
    a.id = "made-by-first"
    first.add(a, owner="key-a")
    assert second.ids() == ["made-by-first"] and second.ids("key-a") == ["made-by-first"] and second.ids("b") == []
    assert json.loads(second.get("made-by-first"))["id"] == "made-by-first"
    first.expect("building", owner="key-b")
    assert second.owner_of("building") == (True, "key-b") and second.get("building", wait_s=0.05) is None
    b = sample_anatomy()
    b.id = "building"
    later = threading.Timer(0.2, first.add, (b, "key-b"))
    later.start()
    assert json.loads(second.get("building", wait_s=10))["id"] == "building"  # waited for the other's write
    first.expect("abandoned")
    first.give_up("abandoned")
    assert second.get("abandoned", wait_s=5) is None and second.owner_of("abandoned") == (False, None)
    for i in range(4):
        c = sample_anatomy()
        c.id = f"more{i}"
        second.add(c)
    assert first.ids() == ["more1", "more2", "more3"]  # the newest 3, whoever wrote them
    first.close()
    second.close()


def test_store_takes_in_an_earlier_versions_jsonl_once(tmp_path):
    from sample_anatomy import sample_anatomy

    a, b = sample_anatomy(), sample_anatomy()
    a.id, b.id = "bare", "wrapped"
    lines = [a.to_json(), json.dumps({"id": "wrapped", "owner": "hash", "anatomy": json.loads(b.to_json())}),
             '{"id": "torn", "model"']
    (tmp_path / "anatomies.jsonl").write_text("\n".join(lines))
    store = AnatomyStore(tmp_path, keep=10)
    assert store.ids() == ["bare", "wrapped"] and store.owner_of("wrapped") == (True, "hash")
    assert json.loads(store.get("wrapped"))["id"] == "wrapped"
    assert json.loads(store.get("bare")) == json.loads(a.to_json())
    assert not (tmp_path / "anatomies.jsonl").exists() and (tmp_path / "anatomies.jsonl.imported").exists()
    store.close()
    assert AnatomyStore(tmp_path, keep=10).ids() == ["bare", "wrapped"]


@pytest.mark.parametrize("keep", [0, -1, 1.5, "3"])
def test_store_refuses_a_bad_keep(tmp_path, keep):
    with pytest.raises(ValueError, match="keep"):
        AnatomyStore(tmp_path, keep=keep)


def test_tool_calls_are_parsed_from_qwen3_output():
    text = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = split_tool_calls(text, "r1")
    assert content == "Let me look." and len(calls) == 1
    assert calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert split_tool_calls("<tool_call>not json</tool_call>", "r2") == ("<tool_call>not json</tool_call>", [])
    assert before_tool_call("abc <tool_") == 4 and before_tool_call("abc <tool_call>{") == 4
    assert before_tool_call("plain") == 5
    two = text + '<tool_call>{"name": "time", "arguments": {}}</tool_call> done'
    content, calls = split_tool_calls(two, "r3")
    assert [c["function"]["name"] for c in calls] == ["weather", "time"] and content == "Let me look.\n done"
    _, first = split_tool_calls(two, "r4", most=1)
    assert [c["function"]["name"] for c in first] == ["weather"]


def test_tools_reach_the_template(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {}}}}]
    raw = server.client().chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, tools=tools,
                                                                    max_tokens=3)
    a = Anatomy.from_json(httpx.get(f"{server.url}/v1/anatomy/{raw.headers['x-anatomy-id']}").text)
    assert "get_weather" in a.prompt_text and "<tools>" in a.prompt_text
    raw = server.client().chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, tools=tools,
                                                                    tool_choice="none", max_tokens=3)
    a = Anatomy.from_json(httpx.get(f"{server.url}/v1/anatomy/{raw.headers['x-anatomy-id']}").text)
    assert "get_weather" not in a.prompt_text


@pytest.mark.parametrize("argv,message", [
    (["--port", "-1"], "--port must be >= 0"),
    (["--port", "70000"], "--port must be <= 65535"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
    (["--keep-anatomies", "0"], "--keep-anatomies must be >= 1"),
    (["--anatomy-processes", "0"], "--anatomy-processes must be >= 1"),
    (["--anatomy-processes", "17"], "--anatomy-processes must be <= 16"),
    (["--anatomy-processes", "two"], "--anatomy-processes must be an integer"),
    (["--api-server-count", "0"], "--api-server-count must be >= 1"),
    (["--api-server-count", "65"], "--api-server-count must be <= 64"),
    (["--api-server-count", "2.5"], "--api-server-count must be an integer"),
    (["--max-body-bytes", "0"], "--max-body-bytes must be >= 1"),
    (["--profile-dir", __file__], "--profile-dir is not a directory"),
    (["--profile-dir", ""], "--profile-dir is empty"),
    (["--kv-cache-tokens", "0"], "--kv-cache-tokens must be >= 1"),
    (["--gpu-memory-utilization", "0.5"], "cannot be used on the CPU"),
    (["--api-key", " "], "--api-key is empty"),
    (["--model", "Qwen/Qwen3-0.6B"], "give the model once"),
    (["--device", "cuda:7"], "cuda"),
])
def test_serve_bad_flags_fail_before_loading(capsys, checkpoint, argv, message):
    from llm_anatomy.cli import main

    assert main(["serve", str(checkpoint), "--device", "cpu", "--no-calibrate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_serve_on_a_port_in_use_says_so_before_loading(capsys, checkpoint, monkeypatch):
    from llm_anatomy.cli import main
    from llm_anatomy.server import core

    monkeypatch.setattr(core.EngineSpec, "build", lambda *a, **k: pytest.fail("the engine was built"))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", str(checkpoint), "--device", "cpu", "--no-calibrate", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("count", [0, 65, 1.0, "2"])
def test_build_server_refuses_a_bad_api_server_count(tmp_path, count):
    with pytest.raises(ValueError, match="api_server_count"):
        build_server(EngineSpec.of("unused"), host="127.0.0.1", port=0, model_names=(MODEL,), run_dir=tmp_path,
                     api_server_count=count)


# ---- the command, as a process: SIGTERM drains, a restart keeps the anatomies ------------------------------------------
def start_process(checkpoint, run_dir, port, *more):
    """`llm-anatomy serve` as a process (a session of its own, so that a test may signal its whole group)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "llm_anatomy.cli", "serve", str(checkpoint), "--device", "cpu",
                             "--dtype", "float32", "--port", str(port), "--run-dir", str(run_dir),
                             "--kv-cache-tokens", "1024", "--served-model-name", MODEL, "--no-calibrate",
                             "--log-level", "warning", *more], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)


def test_sigterm_drains_and_a_restart_keeps_anatomies(checkpoint, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_process(checkpoint, tmp_path, port)
    try:
        first = httpx.post(f"{url}/v1/chat/completions", json={**GOOD, "ignore_eos": True}).headers["x-anatomy-id"]
        body = {**GOOD, "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)  # mid-stream: it must still finish
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest[:-1]]
        assert finish[-1] == "length"
        # drained, then exits; uvicorn re-raises the signal after a graceful shutdown
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    proc = start_process(checkpoint, tmp_path, port)
    try:
        r = httpx.get(f"{url}/v1/anatomy/{first}")
        assert r.status_code == 200 and Anatomy.from_json(r.text).id == first
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)


def test_a_calls_last_tokens_reach_it_before_its_anatomy_however_fast_that_is_built(checkpoint, tmp_path,
                                                                                       monkeypatch):
    """The core posts a step's outputs before it hands that step's finished calls to the anatomy builders: an
    anatomy sent at once (here by `add` itself, as a builder that wins the race against the step loop does) never
    overtakes its call's last tokens, which the HTTP side, where the anatomy ends the call, would drop, leaving the
    stream waiting for them."""
    from llm_anatomy.server import anatomies

    def built_at_once(self, call, trace, result, live_from=None):
        self.builders[0]._emit(("anatomy", call.id, {"id": call.id}, None, None, None, False))

    monkeypatch.setattr(anatomies.AnatomyBuilders, "add", built_at_once)
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=1024,
                                    block_size=16, max_num_seqs=8)
    running = Running(engine, tmp_path)
    try:
        client = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        results = streamed_completion_tokens(client, [
            dict(model=MODEL, prompt="word " * (1 + i), max_tokens=2 + i, temperature=0, extra_body=NO_EOS)
            for i in range(6)])
        assert results == [2 + i for i in range(6)]
    finally:
        running.stop()
