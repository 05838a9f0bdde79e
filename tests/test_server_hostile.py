"""`llm-anatomy serve` against a hostile client: values at and past every limit, malformed and deeply nested
bodies, faults inside the engine, a drain. After each bad request a good one still succeeds, and streams that
run while bad requests arrive all complete."""

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest
import torch

from llm_anatomy import Engine
from llm_anatomy.engine.sampling import INT64_MAX, INT64_MIN, SamplingParams, seed_for_choice
from llm_anatomy.errors import RequestError
from test_server import (HELLO, MODEL, NO_EOS, Running, checkpoint,  # noqa: F401 - checkpoint is a fixture
                         streamed_completion_tokens)

GOOD = {"model": MODEL, "messages": HELLO, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
COMPLETION = {"model": MODEL, "prompt": "The KV cache", "max_tokens": 2, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=1024,
                                    block_size=16, max_num_seqs=16)
    running = Running(engine, tmp_path_factory.mktemp("run"))
    yield running
    running.stop()


def post(server, body, path="/v1/chat/completions", **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def still_serves(server) -> None:
    r = post(server, GOOD)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


HOSTILE = [  # (name, body, param); every one must be a 400 invalid_request_error naming `param`
    ("seed 2**64", {**GOOD, "seed": 2 ** 64}, "seed"),
    ("seed below int64", {**GOOD, "seed": INT64_MIN - 1}, "seed"),
    ("seed just above int64", {**GOOD, "seed": INT64_MAX + 1}, "seed"),
    ("top_k 2**63", {**GOOD, "top_k": 2 ** 63}, "top_k"),
    ("top_k -2", {**GOOD, "top_k": -2}, "top_k"),
    ("top_p < 0", {**GOOD, "top_p": -0.5}, "top_p"),
    ("min_p > 1", {**GOOD, "min_p": 2}, "min_p"),
    ("temperature overflowing to inf", b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "x"}], '
                                       b'"temperature": 1e400}', "temperature"),
    ("penalty overflowing to -inf", b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "x"}], '
                                    b'"frequency_penalty": -1e400}', "frequency_penalty"),
    ("n 10**20", {**GOOD, "n": 10 ** 20}, "n"),
    ("max_tokens 2**64", {**GOOD, "max_tokens": 2 ** 64}, "max_tokens"),
    ("max_completion_tokens 0", {**GOOD, "max_tokens": None, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("min_tokens < 0", {**GOOD, "min_tokens": -1}, "min_tokens"),
    ("min_tokens > max_tokens", {**GOOD, "min_tokens": 3}, "min_tokens"),
    ("top_logprobs 2**70", {**GOOD, "logprobs": True, "top_logprobs": 2 ** 70}, "top_logprobs"),
    ("logit_bias key of 5000 digits", {**GOOD, "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ("logit_bias key a unicode digit", {**GOOD, "logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ("logit_bias key negative", {**GOOD, "logit_bias": {"-1": 1}}, "logit_bias"),
    ("logit_bias value 1e308", {**GOOD, "logit_bias": {"5": 1e308}}, "logit_bias"),
    ("stop of 5 strings", {**GOOD, "stop": list("abcde")}, "stop"),
    ("stop string of 2000 characters", {**GOOD, "stop": "x" * 2000}, "stop"),
    ("stop_token_ids past int32", {**GOOD, "stop_token_ids": [2 ** 40]}, "stop_token_ids"),
    ("stop_token_ids negative", {**GOOD, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("stop_token_ids 2000 of them", {**GOOD, "stop_token_ids": list(range(2000))}, "stop_token_ids"),
    ("repetition_penalty not 1", {**GOOD, "repetition_penalty": 1.2}, "repetition_penalty"),
    ("guided_json", {**GOOD, "guided_json": {"type": "object"}}, "guided_json"),
    ("a custom chat template", {**GOOD, "chat_template": "{{ 7 * 7 }}"}, "chat_template"),
    ("n = 0", {**GOOD, "n": 0}, "n"),
    ("messages of the wrong type", {**GOOD, "messages": "hello"}, "messages"),
    ("stream_options of the wrong type", {**GOOD, "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options"),
    ("model of 10k characters", {**GOOD, "model": "m" * 10000}, "model"),
]


@pytest.mark.parametrize("body,param", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_every_hostile_value_gets_a_400_and_the_server_goes_on(server, body, param):
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and len(error["message"]) > 10
    still_serves(server)


@pytest.mark.parametrize("pad", [0, 9000], ids=["prepared on the event loop", "prepared in a worker thread"])
def test_small_and_large_bodies_are_checked_alike(server, pad, monkeypatch):
    """A body up to INLINE_BODY_BYTES is prepared on the event loop, a larger one in a worker thread: the same
    checks, the same answers."""
    from llm_anatomy.server import completions

    where = []

    def prepare(*args):
        where.append(threading.current_thread() is server.thread)  # uvicorn's event loop runs on that thread
        return real_prepare(*args)

    real_prepare = completions.prepare
    monkeypatch.setattr(completions, "prepare", prepare)
    extra = {"user": "u" * pad} if pad else {}
    bad = {**GOOD, **extra, "top_k": -2}
    assert (len(json.dumps(bad)) > completions.INLINE_BODY_BYTES) == bool(pad)
    r = post(server, bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
    r = post(server, {**GOOD, **extra})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert where == [not pad] * 2


TOKEN_ID_PROMPTS = [  # (name, prompt); every one a 400 naming `prompt`, among many good ids
    ("a boolean", [1, 2, True]),
    ("a float", [1, 2.0]),
    ("a negative id", [5] * 300 + [-1]),
    ("an id past the vocabulary", [5] * 300 + [10 ** 9]),
    ("an id of 70 bits", [2 ** 70, 5]),
    ("a string among ids", [5, "6"]),
    ("ids nested in a list", [5, [6]]),
]


@pytest.mark.parametrize("prompt", [p[1] for p in TOKEN_ID_PROMPTS], ids=[p[0] for p in TOKEN_ID_PROMPTS])
def test_bad_token_ids_get_a_400_and_the_server_goes_on(server, prompt):
    r = post(server, {**COMPLETION, "prompt": prompt}, path="/v1/completions")
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "prompt", error
    r = post(server, {**COMPLETION, "prompt": [5] * 300}, path="/v1/completions")
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 300, r.text


MALFORMED = [
    ("JSON nested 100k deep", b"[" * 100_000 + b"]" * 100_000),
    ("an object nested 100k deep", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
    ("messages nested 70 deep", json.dumps({**GOOD, "messages": [[[]]]}).replace("[[[]]]", "[" * 70 + "]" * 70)),
    ("NaN", b'{"model": "tiny-qwen3", "messages": [], "temperature": NaN}'),
    ("invalid UTF-8", b'{"model": "\xff\xfe"}'),
    ("a bare string", b'"hello"'),
    ("empty", b""),
]


@pytest.mark.parametrize("body", [m[1] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_bodies_get_a_json_400(server, body):
    r = post(server, body)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    still_serves(server)


def test_sampling_params_refuse_what_torch_cannot_take():
    """The Python API and the CLI go through SamplingParams: a seed outside int64 never reaches manual_seed."""
    for field, value in (("seed", 2 ** 64), ("seed", INT64_MIN - 1), ("top_k", 2 ** 63), ("stop", ("x" * 2000,)),
                         ("stop_token_ids", tuple(range(2000))), ("logit_bias", ((5, 1.0), (5, 2.0))),
                         ("min_tokens", 300), ("max_tokens", 2 ** 40)):
        with pytest.raises(RequestError) as info:
            SamplingParams(**{field: value})
        assert info.value.param == field
    assert SamplingParams(seed=INT64_MIN).seed == INT64_MIN and SamplingParams(seed=INT64_MAX).seed == INT64_MAX
    assert seed_for_choice(INT64_MAX, 1) == INT64_MIN and seed_for_choice(5, 2) == 7
    assert SamplingParams(temperature=1e-9).greedy  # dividing logits by it would overflow


def test_seed_at_the_edge_of_int64_with_several_choices(server):
    r = post(server, {**GOOD, "n": 3, "seed": INT64_MAX, "temperature": 0.8})
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    r = post(server, {**GOOD, "seed": INT64_MIN, "temperature": 0.8})
    assert r.status_code == 200


def test_unknown_fields_are_ignored_and_recorded(server):
    r = post(server, {**GOOD, "temprature": 0.5, "vendor_extension": {"a": [1, 2]}, "repetition_penalty": 1.0,
                      "use_beam_search": False, "stream_options": None, "chat_template_kwargs":
                      {"enable_thinking": False, "custom": 1}})
    assert r.status_code == 200, r.text
    anatomy = httpx.get(f"{server.url}/v1/anatomy/{r.headers['x-anatomy-id']}").json()
    assert sorted(anatomy["request"]["ignored_fields"]) == ["chat_template_kwargs.custom", "temprature",
                                                            "vendor_extension"]


def test_good_streams_complete_while_bad_requests_arrive(server):
    lengths = [6 + i for i in range(6)]

    async def good(client, n):
        stream = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=n, temperature=0,
                                                      stream=True, extra_body=NO_EOS,
                                                      stream_options={"include_usage": True})
        finish, usage = None, None
        async for c in stream:
            if c.choices and c.choices[0].finish_reason:
                finish = c.choices[0].finish_reason
            usage = c.usage or usage
        return finish, usage.completion_tokens

    async def bad(http, body):
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
            {"json": body}
        return (await http.post(f"{server.url}/v1/chat/completions", **kw)).status_code

    async def go():
        client = server.async_client()
        async with httpx.AsyncClient(timeout=60) as http:
            goods = [asyncio.create_task(good(client, n)) for n in lengths]
            bads = [asyncio.create_task(bad(http, h[1])) for h in HOSTILE[::3]] + \
                   [asyncio.create_task(bad(http, m[1])) for m in MALFORMED[:2]]
            out = await asyncio.gather(*goods), await asyncio.gather(*bads)
        await client.close()
        return out

    goods, bads = asyncio.run(go())
    assert goods == [("length", n) for n in lengths]
    assert set(bads) == {400}
    server.wait_idle()


# ---- the load generators' request shapes -------------------------------------------------------------------------
def sse_events(server, path, body):
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


# guidellm (backends/openai/request_handlers.py): streams ask for continuous usage, stop: null, ignore_eos,
# and chat content as a list of text parts; vllm bench serve's openai backends add repetition_penalty 1.0
GUIDELLM_CHAT = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True,
                                                                    "continuous_usage_stats": True},
                 "max_completion_tokens": 5, "stop": None, "ignore_eos": True,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]}
GUIDELLM_COMPLETION = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True,
                                                                          "continuous_usage_stats": True},
                       "max_tokens": 5, "stop": None, "ignore_eos": True, "prompt": "The KV cache"}
VLLM_BENCH_COMPLETION = {"model": MODEL, "prompt": "The KV cache", "temperature": 0.0, "repetition_penalty": 1.0,
                         "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                         "max_tokens": 5, "ignore_eos": True}


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", GUIDELLM_CHAT),
                                       ("/v1/completions", GUIDELLM_COMPLETION),
                                       ("/v1/completions", VLLM_BENCH_COMPLETION)],
                         ids=["guidellm-chat", "guidellm-completions", "vllm-bench-completions"])
def test_load_generators_continuous_usage(server, path, body):
    events = sse_events(server, path, body)
    with_choices = [e for e in events if e["choices"]]
    prompt = with_choices[0]["usage"]["prompt_tokens"]
    counts = [e["usage"]["completion_tokens"] for e in with_choices]
    assert all(e["usage"]["total_tokens"] == prompt + e["usage"]["completion_tokens"] for e in with_choices)
    assert counts == sorted(counts) and counts[-1] == 5
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    assert with_choices[-1]["choices"][0]["finish_reason"] == "length"


def test_aiperf_request_shape(server):
    # AIPerf's openai chat: a `name` on the message, max_completion_tokens, no stream_options
    body = {"model": MODEL, "stream": True, "max_completion_tokens": 3, "ignore_eos": True,
            "messages": [{"role": "user", "name": "text", "content": "Hello there"}]}
    events = sse_events(server, "/v1/chat/completions", body)
    assert "usage" not in events[1] and events[-1]["choices"][0]["finish_reason"] == "length"


def test_min_tokens_holds_back_stop_ids(server):
    forced = {**GOOD, "max_tokens": 10, "logit_bias": {"1234": 100}, "stop_token_ids": [1234], "ignore_eos": False}
    assert post(server, forced).json()["usage"]["completion_tokens"] == 1  # the stop id at once
    held = post(server, {**forced, "min_tokens": 5}).json()
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "stop"


def test_models_reports_the_length_the_server_accepts(checkpoint, tmp_path):
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=256,
                                    block_size=16)
    running = Running(engine, tmp_path)
    try:
        accepted = running.client().models.list().data[0].model_extra["max_model_len"]
        assert accepted == 256 < engine.max_model_len  # the KV pool, not the model's context
        ids = engine.tokenizer.encode("The KV cache")
        r = post(running, {**COMPLETION, "prompt": ids, "max_tokens": accepted - len(ids) + 1}, "/v1/completions")
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        request = running.loop.prepare  # exactly the reported length passes every check
        from llm_anatomy.server.protocol import CompletionRequest, completion_request

        req = completion_request(CompletionRequest.model_validate({**COMPLETION, "prompt": ids,
                                                                   "max_tokens": accepted - len(ids)}))
        assert request(req, time.perf_counter_ns()).params.max_tokens == accepted - len(ids)
    finally:
        running.stop()


def test_metrics_under_vllm_names_agree_with_the_anatomy(server):
    def series(prefix):
        return {line.split(" ")[0][len(prefix):]: float(line.rsplit(" ", 1)[1])
                for line in httpx.get(f"{server.url}/metrics").text.splitlines() if line.startswith(prefix)}

    server.wait_idle()
    time.sleep(0.3)
    before = series("llm_anatomy:")
    r = post(server, GOOD)
    anatomy = httpx.get(f"{server.url}/v1/anatomy/{r.headers['x-anatomy-id']}").json()
    time.sleep(0.3)
    ours, theirs = series("llm_anatomy:"), series("vllm:")
    key = 'time_to_first_token_seconds_sum{model_name="tiny-qwen3"}'
    assert ours[key] - before[key] == pytest.approx(anatomy["ttft_ms"] / 1e3, rel=1e-6)
    shared = {k: v for k, v in ours.items() if k in theirs}
    assert {k.split("{")[0].split("_bucket")[0] for k in shared} >= {
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "generation_tokens_total",
        "time_to_first_token_seconds", "e2e_request_latency_seconds", "request_success_total"}
    for k in shared:
        if "num_requests" not in k and "kv_cache" not in k:
            assert theirs[k] == ours[k], k
    assert not any(k.startswith("anatomy_build") or k.startswith("gpu_") for k in theirs)


def test_iteration_tokens_count_the_engines_steps_and_what_each_forwarded(server):
    """vLLM's iteration_tokens_total (a histogram): one observation a step, its value the tokens the step
    forwarded: a lone request of P prompt tokens and T output tokens takes one prefill of P and T - 1 decode
    steps of one token."""
    def histogram(prefix):
        text = httpx.get(f"{server.url}/metrics").text
        found = {}
        for line in text.splitlines():
            if line.startswith(prefix + "iteration_tokens_total_"):
                name, value = line.rsplit(" ", 1)
                found[name[len(prefix + "iteration_tokens_total_"):]] = float(value)
        return found

    server.wait_idle()
    time.sleep(0.3)
    before = histogram("llm_anatomy:")
    ids = list(range(100, 107))
    r = post(server, {"model": MODEL, "prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
             path="/v1/completions")
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    time.sleep(0.3)
    after, theirs = histogram("llm_anatomy:"), histogram("vllm:")
    grew = {k: v - before.get(k, 0.0) for k, v in after.items()}  # a fresh server has no series before its first step
    label = '{model_name="tiny-qwen3"}'
    assert grew["count" + label] == 5 and grew["sum" + label] == len(ids) + 4
    bucket = 'bucket{{le="{}",model_name="tiny-qwen3"}}'.format
    assert grew[bucket("1.0")] == 4 and grew[bucket("8.0")] == 5
    assert theirs == after


# ---- faults inside the engine --------------------------------------------------------------------------------------
@pytest.fixture
def own_server(checkpoint, tmp_path):
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=1024,
                                    block_size=16)
    running = Running(engine, tmp_path)
    yield running
    running.stop()


POISON = [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]  # a prompt whose steps the tests make fail


def test_a_failing_prefill_ends_only_its_request(own_server):
    server, engine = own_server, own_server.engine
    run = engine.runner.run

    def poisoned(batch, *args, **kwargs):
        if any(s.prompt_token_ids == POISON for s in batch.seqs):
            raise RuntimeError("injected fault")
        return run(batch, *args, **kwargs)

    engine.runner.run = poisoned
    try:
        body = {**COMPLETION, "max_tokens": 30, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as s:
            lines = s.iter_lines()
            next(lines)  # the long stream is decoding
            r = post(server, {**COMPLETION, "prompt": POISON}, "/v1/completions")
            rest = [json.loads(line[6:]) for line in lines if line and line != "data: [DONE]"]
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
        server.wait_idle()
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    finally:
        engine.runner.run = run


def test_every_step_failing_makes_health_say_so_until_one_succeeds(own_server):
    server, engine = own_server, own_server.engine
    run = engine.runner.run

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    engine.runner.run = broken
    try:
        for _ in range(3):
            assert post(server, GOOD).status_code == 500
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "injected fault" in health.json()["error"]
    finally:
        engine.runner.run = run
    server.wait_idle()
    still_serves(server)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_failures_confined_to_one_call_end_only_that_call(own_server):
    """A failure admitting a call, and a sequence the engine ends with finish_reason "error" (its failure
    contract): that call gets a 500, the others are answered."""
    server, engine = own_server, own_server.engine
    add, step = engine.add_request, engine.step

    def add_request(ids, params, request_id=None):
        if ids == POISON:
            raise ValueError("injected admission fault")
        return add(ids, params, request_id=request_id)

    engine.add_request = add_request
    try:
        r = post(server, {**COMPLETION, "prompt": POISON}, "/v1/completions")
        assert r.status_code == 500 and "injected admission fault" in r.json()["error"]["message"]
        still_serves(server)
    finally:
        engine.add_request = add

    def step_with_a_failed_sequence():
        seqs = step()
        for seq in seqs:
            if seq.prompt_token_ids == POISON and not seq.finished:
                engine._finish(seq, "error")  # as the engine will report a failure confined to one sequence
                seq.error = "injected sequence fault"
        return seqs

    engine.step = step_with_a_failed_sequence
    try:
        poisoned = threading.Thread(target=lambda: results.append(
            post(server, {**COMPLETION, "prompt": POISON, "max_tokens": 8}, "/v1/completions")))
        results = []
        poisoned.start()
        good = post(server, {**COMPLETION, "max_tokens": 8}, "/v1/completions")
        poisoned.join()
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8
        assert results[0].status_code == 500 and "injected sequence fault" in results[0].json()["error"]["message"]
    finally:
        engine.step = step
    server.wait_idle()


def test_a_drain_answers_health_and_refuses_new_work_until_in_flight_ends(own_server):
    server, engine = own_server, own_server.engine
    step = engine.step

    def slow_step():  # the stream must still be running while the test looks
        time.sleep(0.05)
        return step()

    engine.step = slow_step
    body = {**COMPLETION, "max_tokens": 40, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()
        next(lines)
        server.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = post(server, GOOD)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert httpx.get(server.url + "/v1/models").status_code == 200  # reads still answer
        rest = [json.loads(line[6:]) for line in lines if line and line != "data: [DONE]"]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    server.thread.join(30)
    assert not server.thread.is_alive()  # then it stopped by itself
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")


def test_openai_client_sees_400_not_422(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model=MODEL, messages=HELLO, seed=2 ** 64)
    assert info.value.status_code == 400 and info.value.body["param"] == "seed"
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt="x", logprobs=6)
    r = httpx.get(f"{server.url}/v1/anatomy", params={"limit": "many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    still_serves(server)


def test_512_concurrent_streams_queue_and_none_is_dropped(server):
    """Far past max_num_seqs (16): the requests queue in the scheduler; every connection is served."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300,
                                http_client=openai.DefaultAsyncHttpxClient(
                                    limits=httpx.Limits(max_connections=512, max_keepalive_connections=512)))
    results = streamed_completion_tokens(client, [dict(model=MODEL, prompt=[100 + i % 50, 7, 8], max_tokens=2,
                                                       temperature=0, extra_body=NO_EOS) for i in range(512)])
    assert results == [2] * 512, [r for r in results if r != 2][:3]
    server.wait_idle()


def test_stream_interval_sends_fewer_larger_chunks(checkpoint, tmp_path):
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=256)
    running = Running(engine, tmp_path, stream_interval=4)
    try:
        body = {**COMPLETION, "max_tokens": 10, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        events = sse_events(running, "/v1/completions", body)
        counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
        assert counts == [1, 5, 9, 10, 10]  # the first token at once, then 4 a chunk, the rest, the finish reason
        plain = post(running, {**COMPLETION, "max_tokens": 10}, "/v1/completions").json()["choices"][0]["text"]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == plain
    finally:
        running.stop()
    with pytest.raises(ValueError, match="stream_interval"):
        Running(engine, tmp_path, stream_interval=0)


@pytest.mark.parametrize("lookahead", [False, True], ids=["step-by-step", "lookahead"])
def test_min_tokens_through_the_python_api(checkpoint, lookahead):
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=256,
                                    lookahead=lookahead)
    forced = dict(prompt_token_ids=[5, 6, 7], max_tokens=12, temperature=0, logit_bias=((1234, 100.0),),
                  stop_token_ids=(1234,))
    assert engine.generate(**forced).output_token_ids == [1234]
    held = engine.generate(**forced, min_tokens=5)
    assert len(held.output_token_ids) == 6 and held.output_token_ids[-1] == 1234
    assert 1234 not in held.output_token_ids[:5] and held.finish_reason == "stop"
