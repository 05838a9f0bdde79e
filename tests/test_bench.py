"""`llm-anatomy bench` end to end against a fake OpenAI-compatible server whose timing the test sets: it waits
TTFT before its first chunk and ITL between chunks, so the figures bench reports have known lower bounds
(a server cannot answer sooner than it waits) and generous upper bounds."""

import asyncio
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from llm_anatomy.bench.cli import main
from llm_anatomy.report.html import plotly_js
from llm_anatomy.tokenizer import Tokenizer
from sample_anatomy import sample_anatomy

MODEL = "fake-model"


@dataclass
class Behaviour:
    ttft_s: float = 0.2
    itl_s: float = 0.02
    chunks: int = 8  # output tokens, one per chunk
    fail_every: int = 0  # every k-th completion request answers 500
    usage: bool = True
    role_chunk: bool = True  # chat: a role-only chunk at once, before the wait (as llm-anatomy's server does)
    refuse_ignore_eos: bool = False  # 422 for a body with ignore_eos (as OpenAI's own API refuses it)
    anatomy: bool = False  # x-anatomy-id headers and GET /v1/anatomy/{id}
    metrics: bool = True
    models_status: int = 200
    slow_from_call: int = 0  # from this completion request on, the first chunk waits slow_ttft_s instead
    slow_ttft_s: float = 0.0
    profiler: str = "off"  # POST /start_profile and /stop_profile: "off" (404), "vllm" (200, empty), "anatomy"
    # (200, a JSON answer, as llm-anatomy's), "broken-stop" (the stop answers 500)


@dataclass
class Fake:
    behaviour: Behaviour = field(default_factory=Behaviour)
    bodies: list = field(default_factory=list)
    calls: int = 0
    in_flight: int = 0
    counters: dict = field(default_factory=lambda: dict(preemptions=0, hits=0, queries=0, generated=0,
                                                        ttft_sum=0.0, ttft_count=0))
    arrivals: dict = field(default_factory=dict)  # anatomy id -> the wall clock when its request arrived
    profiles: list = field(default_factory=list)  # (action, completion requests received by then)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            if self.behaviour.models_status != 200:
                return PlainTextResponse("not here", status_code=self.behaviour.models_status)
            return {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 4096}]}

        @app.get("/metrics")
        async def metrics():
            if not self.behaviour.metrics:
                return PlainTextResponse("no", status_code=404)
            c = self.counters
            lines = [f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.in_flight}',
                     f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0',
                     f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} {self.in_flight / 100}',
                     f'vllm:num_preemptions_total{{model_name="{MODEL}"}} {c["preemptions"]}',
                     f'vllm:prefix_cache_hits_total{{model_name="{MODEL}"}} {c["hits"]}',
                     f'vllm:prefix_cache_queries_total{{model_name="{MODEL}"}} {c["queries"]}',
                     f'vllm:generation_tokens_total{{model_name="{MODEL}"}} {c["generated"]}',
                     f'vllm:time_to_first_token_seconds_sum{{model_name="{MODEL}"}} {c["ttft_sum"]}',
                     f'vllm:time_to_first_token_seconds_count{{model_name="{MODEL}"}} {c["ttft_count"]}']
            return PlainTextResponse("\n".join(lines) + "\n")

        @app.post("/{action}_profile")
        async def profile(action: str):
            if self.behaviour.profiler == "off" or action not in ("start", "stop"):
                return JSONResponse({"error": {"message": "the profiler is off", "type": "invalid_request_error",
                                               "param": None, "code": "profiler_off"}}, 404)
            self.profiles.append((action, self.calls))
            if self.behaviour.profiler == "broken-stop" and action == "stop":
                return JSONResponse({"error": {"message": "trace lost", "type": "server_error", "param": None,
                                               "code": None}}, 500)
            if self.behaviour.profiler == "vllm":
                return Response(status_code=200)
            answer = {"status": "started"} if action == "start" else {"trace": f"/tmp/trace-{len(self.profiles)}",
                                                                       "device": {"busy_share": 0.9}}
            return answer

        @app.get("/v1/anatomy/{anatomy_id}")
        async def anatomy(anatomy_id: str):
            anatomy = sample_anatomy(id=anatomy_id, started_at_unix=self.arrivals.get(anatomy_id, 0.0))
            return Response(anatomy.to_json(), media_type="application/json")

        async def complete(request: Request, chat: bool):
            arrived = time.time()
            body = await request.json()
            self.bodies.append(body)
            b = self.behaviour
            self.calls += 1
            self.arrivals[f"cmpl-{self.calls}"] = arrived
            if b.refuse_ignore_eos and "ignore_eos" in body:
                return JSONResponse({"error": {"message": "Unrecognized request argument supplied: ignore_eos",
                                               "type": "invalid_request_error", "param": None, "code": None}}, 422)
            if b.fail_every and self.calls % b.fail_every == 0:
                return JSONResponse({"error": {"message": "boom", "type": "server_error", "param": None,
                                               "code": None}}, 500)
            n = min(b.chunks, body["max_tokens"])
            ttft = b.slow_ttft_s if b.slow_from_call and self.calls >= b.slow_from_call else b.ttft_s
            headers = {"x-anatomy-id": f"cmpl-{self.calls}"} if b.anatomy else {}
            return StreamingResponse(self.stream(chat, n, ttft, body), media_type="text/event-stream", headers=headers)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await complete(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await complete(request, chat=True)

        return app

    async def stream(self, chat: bool, n: int, ttft_s: float, body: dict):
        b = self.behaviour

        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        def piece(i: int, finish: str | None = None) -> str:
            choice = ({"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": finish} if chat
                      else {"index": 0, "text": f" t{i}", "finish_reason": finish})
            return sse({"id": "x", "choices": [choice]})

        self.in_flight += 1
        try:
            if chat and b.role_chunk:
                yield sse({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
            await asyncio.sleep(ttft_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(b.itl_s)
                yield piece(i, "length" if i == n - 1 else None)
            c = self.counters
            c["preemptions"] += 1
            c["hits"] += 5
            c["queries"] += 10
            c["generated"] += n
            c["ttft_sum"] += ttft_s
            c["ttft_count"] += 1
            if b.usage and (body.get("stream_options") or {}).get("include_usage"):
                yield sse({"id": "x", "choices": [], "usage": {"prompt_tokens": 16, "completion_tokens": n,
                                                              "total_tokens": 16 + n}})
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake():
    state = Fake()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(state.app(), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the fake server did not start"
        time.sleep(0.02)
    state.url = f"http://127.0.0.1:{port}"
    yield state
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def server(fake):
    """The fake with default behaviour and nothing recorded."""
    fake.behaviour, fake.bodies, fake.calls, fake.profiles = Behaviour(), [], 0, []
    return fake


SLACK_MS = 400  # see test_closed_loop_figures_match_the_servers_timing


def bench(server, tmp_path, *flags) -> dict:
    out = tmp_path / "bench.json"
    rc = main([server.url, "--json", str(out), "--gpus", "none", *flags])
    assert rc == 0
    return json.loads(out.read_text())


def test_closed_loop_figures_match_the_servers_timing(server, tmp_path, capsys):
    html = tmp_path / "bench.html"
    run = bench(server, tmp_path, "--concurrency", "1,2", "--num-prompts", "4", "--input-tokens", "12",
                "--output-tokens", "8", "--scrape-interval", "0.05", "--html", str(html))
    assert run["model"] == MODEL and [lv["concurrency"] for lv in run["levels"]] == [1, 2]
    ttft, itl = server.behaviour.ttft_s * 1e3, server.behaviour.itl_s * 1e3
    for lv in run["levels"]:
        assert (lv["requests"], lv["completed"], lv["errors"]) == (4, 4, {"count": 0, "reasons": {}})
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(lv[key]) == {"mean", "p50", "p90", "p99"}
        # Below: what the server waited, which no figure can undercut. Above: slack for a busy 2-core machine, where
        # the fake (a thread of this process) has taken 41 ms for its 20 ms gaps and 497 ms for a 340 ms answer;
        # a figure in the wrong unit or from the wrong instant is off by far more.
        assert ttft <= lv["ttft_ms"]["p50"] <= lv["ttft_ms"]["p99"] <= ttft + SLACK_MS
        assert 0.9 * itl <= lv["itl_ms"]["mean"] <= itl + SLACK_MS / 4  # single gaps jitter; their mean cannot undercut
        assert 0.9 * itl <= lv["tpot_ms"]["mean"] <= itl + SLACK_MS / 4
        assert ttft + 7 * itl <= lv["e2e_ms"]["p50"] <= ttft + 7 * itl + SLACK_MS
        assert lv["output_tokens"] == 32 and lv["output_tokens_from"] == "usage" and lv["input_tokens"] == 64
        assert lv["finish_reasons"] == {"length": 4}
        # each stream sends its requests one after another, so the level lasts at least that long
        shortest = (4 / lv["concurrency"]) * (ttft + 7 * itl) / 1e3
        assert 0.4 * 32 / shortest <= lv["output_tok_s"] <= 32 / shortest
        assert lv["request_s"] == pytest.approx(4 / lv["duration_s"])
        assert 1 <= lv["max_in_flight"] <= lv["concurrency"]
        s = lv["server"]
        assert s["metrics"] == "vllm" and s["settled"]
        assert (s["preemptions"], s["generation_tokens"], s["prefix_cache_hit_rate"]) == (4, 32, 0.5)
        assert s["ttft_ms_mean"] == pytest.approx(ttft)
        assert 1 <= s["requests_running"]["max"] <= lv["concurrency"]
    sent = server.bodies[-1]
    assert sent["max_tokens"] == 8 and sent["stream"] and sent["ignore_eos"] is True
    assert sent["stream_options"] == {"include_usage": True} and sent["model"] == MODEL
    assert len(sent["prompt"]) == 12 and all(1000 <= t < 30000 for t in sent["prompt"])
    first_prompts = [tuple(b["prompt"]) for b in server.bodies]
    assert len(set(first_prompts)) == len(first_prompts)  # every prompt differs (the probe's too)
    page = html.read_text()
    assert plotly_js() in page  # inlined: the page works offline
    page = page.replace(plotly_js(), "")
    assert "Plotly.newPlot" in page and "chart-ttft_ms" in page and "chart-throughput" in page
    assert "chart-server" in page and not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", page)
    shown = capsys.readouterr().out
    assert "TTFT p50 (ms)" in shown and "concurrency 2" in shown and "running requests" in shown


def test_chat_role_chunk_is_not_the_first_token(server, tmp_path):
    run = bench(server, tmp_path, "--endpoint", "chat", "--concurrency", "2", "--num-prompts", "2",
                "--input-tokens", "20", "--output-tokens", "4")
    lv = run["levels"][0]
    assert lv["ttft_ms"]["p50"] >= server.behaviour.ttft_s * 1e3
    text = server.bodies[-1]["messages"][0]["content"]
    assert server.bodies[-1]["messages"][0]["role"] == "user" and len(text.split()) == 20


def test_errors_are_counted_with_their_reasons(server, tmp_path):
    server.behaviour = Behaviour(ttft_s=0.01, itl_s=0.005, fail_every=3)
    run = bench(server, tmp_path, "--concurrency", "2", "--num-prompts", "6", "--output-tokens", "4")
    lv = run["levels"][0]
    # the probe was call 1: calls 2..7 are the level's, and 3 and 6 fail
    assert lv["errors"] == {"count": 2, "reasons": {"HTTP 500: boom": 2}}
    assert lv["completed"] == 4 and lv["output_tokens"] == 16


def test_goodput_counts_the_requests_inside_the_slo(server, tmp_path):
    server.behaviour = Behaviour(ttft_s=0.2, itl_s=0.005, chunks=4)
    common = ("--concurrency", "2", "--num-prompts", "2", "--output-tokens", "4")
    tight = bench(server, tmp_path, *common, "--slo", "ttft_ms=100")["levels"][0]
    assert tight["goodput"]["good_requests"] == 0 and tight["goodput"]["request_s"] == 0
    loose = bench(server, tmp_path, *common, "--slo", "ttft_ms=5000,tpot_ms=1000,e2e_ms=9000")["levels"][0]
    assert loose["goodput"]["good_requests"] == 2 and loose["goodput"]["fraction"] == 1.0
    assert loose["goodput"]["slo"] == {"ttft_ms": 5000.0, "tpot_ms": 1000.0, "e2e_ms": 9000.0}


def test_open_loop_sends_every_request(server, tmp_path):
    server.behaviour = Behaviour(ttft_s=0.01, itl_s=0.005, chunks=3)
    run = bench(server, tmp_path, "--request-rate", "40", "--num-prompts", "6", "--output-tokens", "3")
    lv = run["levels"][0]
    assert lv["request_rate"] == 40 and lv["concurrency"] is None
    assert lv["completed"] == 6 and lv["achieved_request_rate"] > 0 and lv["max_in_flight"] >= 1


def test_a_refused_ignore_eos_is_dropped_and_said(server, tmp_path):
    server.behaviour = Behaviour(ttft_s=0.01, itl_s=0.005, refuse_ignore_eos=True, usage=False)
    run = bench(server, tmp_path, "--concurrency", "1", "--num-prompts", "2", "--output-tokens", "3")
    assert any("refused ignore_eos" in n for n in run["notes"]) and not run["settings"]["ignore_eos"]
    assert all("ignore_eos" not in b for b in server.bodies[-2:])
    lv = run["levels"][0]
    assert lv["completed"] == 2 and lv["output_tokens_from"] == "chunks" and lv["output_tokens"] == 6


def test_a_request_that_outlasts_the_timeout_fails_with_its_reason(server, tmp_path, capsys):
    # the probe (call 1) answers at once, the level's requests after 0.6 s: past --timeout 0.3
    server.behaviour = Behaviour(ttft_s=0.01, itl_s=0.005, chunks=2, slow_from_call=2, slow_ttft_s=0.6)
    out = tmp_path / "t.json"
    rc = main([server.url, "--json", str(out), "--gpus", "none", "--concurrency", "2", "--num-prompts", "2",
               "--output-tokens", "2", "--timeout", "0.3"])
    assert rc == 1 and "every request failed" in capsys.readouterr().err  # nothing succeeded: not a success
    lv = json.loads(out.read_text())["levels"][0]
    assert lv["errors"] == {"count": 2, "reasons": {"timeout: no byte from the server for 0.3 s": 2}}
    assert lv["completed"] == 0 and lv["ttft_ms"]["p50"] is None and lv["output_tok_s"] == 0


def test_a_probe_that_times_out_stops_the_run(server, capsys):
    server.behaviour = Behaviour(ttft_s=0.6)
    assert main([server.url, "--gpus", "none", "--concurrency", "1", "--timeout", "0.3"]) == 2
    assert "no byte from the server for 0.3 s" in capsys.readouterr().err


def test_anatomy_join(server, tmp_path):
    server.behaviour = Behaviour(ttft_s=0.01, itl_s=0.005, chunks=3, anatomy=True)
    lv = bench(server, tmp_path, "--anatomy", "--concurrency", "2", "--num-prompts", "2",
               "--output-tokens", "3")["levels"][0]["anatomy"]
    expected = sample_anatomy().summary()
    assert lv["joined"] == 2 and lv["missing"] == {}
    assert lv["queue_ms"]["p50"] == pytest.approx(expected["queue_ms"])
    assert lv["server_ttft_ms"]["p50"] == pytest.approx(expected["ttft_ms"])
    assert lv["mean_batch_size"] == pytest.approx(expected["batching"]["mean_batch_size"])
    row = lv["requests"][0]
    assert row["id"].startswith("cmpl-") and row["client_ttft_ms"] >= 10
    assert row["prefill_ms"] == pytest.approx(expected["prefill"]["gpu_ms"])
    for row in lv["requests"]:  # the gap by the wall clock: the send to the server's start, then the way back
        assert 0 <= row["arrival_ms"] < 1000
        assert row["arrival_ms"] + row["server_ttft_ms"] + row["delivery_ms"] == pytest.approx(row["client_ttft_ms"])
        # the arrival cut where the client wrote the request to its connection (aiohttp's trace)
        assert 0 <= row["client_send_ms"] <= row["arrival_ms"]
        assert row["client_send_ms"] + row["to_server_ms"] == pytest.approx(row["arrival_ms"])
    assert lv["arrival_ms"]["p50"] is not None and lv["delivery_ms"]["p50"] is not None
    assert lv["client_send_ms"]["p50"] is not None and lv["to_server_ms"]["p50"] is not None


def test_arrival_split_cuts_where_the_client_handed_the_request_over():
    from llm_anatomy.bench.join import arrival_split

    assert arrival_split(100.0, 100.004, 30.0) == (pytest.approx(4.0), pytest.approx(26.0))
    assert arrival_split(100.0, None, 30.0) == (None, None)  # no hand-over seen (a failed send): the arrival whole
    assert arrival_split(None, 100.004, 30.0) == arrival_split(100.0, 100.004, None) == (None, None)


@pytest.mark.parametrize("profiler", ["anatomy", "vllm"])
def test_profile_brackets_each_level_with_the_servers_profiler(server, tmp_path, profiler):
    """--profile: POST /start_profile before a level's first request and /stop_profile after its last, the
    server's answer (llm-anatomy's summary, vLLM's empty body) in the level, with a note that it was profiled."""
    server.behaviour = Behaviour(ttft_s=0.01, itl_s=0.002, chunks=2, profiler=profiler)
    run = bench(server, tmp_path, "--concurrency", "1,2", "--num-prompts", "3", "--output-tokens", "2",
                "--scrape-interval", "0", "--profile")
    # the probe request is number 1; each level sends 3
    assert server.profiles == [("start", 1), ("stop", 4), ("start", 4), ("stop", 7)]
    assert run["settings"]["profile"] is True
    for i, lv in enumerate(run["levels"]):
        assert lv["completed"] == 3
        if profiler == "anatomy":
            assert lv["profile"] == {"trace": f"/tmp/trace-{2 * i + 2}", "device": {"busy_share": 0.9}}
            assert any(n.endswith(f"; trace: /tmp/trace-{2 * i + 2}") for n in lv["notes"])
        else:
            assert lv["profile"] == {"answer": None} and any("profiler ran through" in n for n in lv["notes"])


def test_profile_whose_stop_fails_keeps_the_levels_figures(server, tmp_path):
    server.behaviour = Behaviour(ttft_s=0.01, itl_s=0.002, chunks=2, profiler="broken-stop")
    run = bench(server, tmp_path, "--concurrency", "2", "--num-prompts", "2", "--output-tokens", "2",
                "--scrape-interval", "0", "--profile")
    lv = run["levels"][0]
    assert lv["completed"] == 2 and lv["profile"] == {"error": "POST /stop_profile answered 500: trace lost"}
    assert "POST /stop_profile answered 500: trace lost" in lv["notes"]


def test_profile_against_a_server_without_a_profiler_stops_before_the_load(server, capsys):
    server.behaviour = Behaviour(ttft_s=0.01, itl_s=0.002, chunks=2)
    assert main([server.url, "--gpus", "none", "--concurrency", "1", "--num-prompts", "2", "--profile"]) == 2
    err = capsys.readouterr().err
    assert "--profile: POST /start_profile answered 404 (the profiler is off)" in err and "--profile-dir" in err
    assert len(err.strip().splitlines()) == 1 and server.calls == 1  # the probe alone, no level's request


def test_anatomy_against_another_server_is_refused(server, tmp_path, capsys):
    rc = main([server.url, "--gpus", "none", "--anatomy", "--concurrency", "1", "--num-prompts", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "x-anatomy-id" in err[-1]


def test_an_unreachable_url_exits_2_within_seconds(capsys):
    t0 = time.monotonic()
    rc = main([f"http://127.0.0.1:{free_port()}", "--gpus", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "cannot reach" in err[0] and "connection refused" in err[0], err
    assert time.monotonic() - t0 < 10
    # a host that does not answer at all (TEST-NET-1: packets go nowhere): the pre-flight's timeout
    t0 = time.monotonic()
    assert main(["http://192.0.2.1:8000", "--gpus", "none"]) == 2
    assert "cannot reach" in capsys.readouterr().err and time.monotonic() - t0 < 10


def test_a_server_that_does_not_speak_the_api_exits_2(server, capsys):
    server.behaviour = Behaviour(models_status=404)
    assert main([server.url, "--gpus", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "HTTP 404" in err[-1] and "OpenAI-compatible" in err[-1]


@pytest.mark.parametrize("flags, says", [
    (["--concurrency", "0"], "--concurrency values must be integers in 1..100000"),
    (["--concurrency", "4,4"], "lists a value twice"),
    (["--concurrency", "4", "--num-prompts", "2"], "--num-prompts 2 is below --concurrency 4"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--slo", "ttft=3"], "--slo takes ttft_ms=MS"),
    (["--slo", "ttft_ms=-5"], "--slo ttft_ms must be > 0 ms"),
    (["--request-rate", "-1"], "--request-rate values must be requests/s > 0"),
    (["--request-rate", "inf"], "--request-rate values must be requests/s > 0"),
    (["--concurrency", "2", "--request-rate", "1"], "not both"),
    (["--timeout", "0"], "--timeout must be > 0 seconds"),
    (["--scrape-interval", "nan"], "--scrape-interval must be >= 0 seconds"),
    (["--token-id-range", "5,5"], "--token-id-range takes LO,HI with LO < HI"),
    (["--gpus", "x"], "--gpus takes a comma-separated list"),
    (["--json", "/nonexistent-dir/x.json"], "does not exist"),
    (["--html", "."], "is a directory"),
    (["--endpoint", "embeddings"], "invalid choice"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--input-tokens", "many"], "--input-tokens must be an integer"),
    (["--output-tokens", "0"], "--output-tokens must be >= 1"),
    (["--dataset", "/nonexistent.jsonl"], "is not a file"),
    (["--dataset", "x.jsonl", "--input-tokens", "5"], "cannot be used with --dataset"),
    (["--api-key", " "], "--api-key is empty"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--output", "5"], "unrecognized arguments: --output"),  # a prefix of --output-tokens is not taken for it
])
def test_bad_flags_are_one_line_and_exit_2(flags, says, capsys):
    try:
        rc = main(["http://127.0.0.1:9", *flags])
    except SystemExit as e:  # argparse's own checks
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("llm-anatomy bench: error:") and says in err[0], err


@pytest.mark.parametrize("url", ["ftp://host/x", "127.0.0.1:8000", "http://host:99999", "http://h/v1?x=1"])
def test_bad_urls(url, capsys):
    assert main([url]) == 2
    assert "URL" in capsys.readouterr().err


def test_dataset_in_both_shapes(server, tmp_path, capsys):
    server.behaviour = Behaviour(ttft_s=0.01, itl_s=0.001, chunks=400)
    reply = "A KV cache keeps the keys and values of past tokens."
    lines = [{"prompt": "plain prompt one", "output_tokens": 5},
             {"conversations": [{"from": "human", "value": "sharegpt question"}, {"from": "gpt", "value": reply}]},
             {"conversations": [{"from": "gpt", "value": "an answer with no question: skipped"}]}]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    run = bench(server, tmp_path, "--dataset", str(data), "--concurrency", "1", "--num-prompts", "2")
    sent = {b["prompt"]: b["max_tokens"] for b in server.bodies[1:]}  # [0] is the probe
    assert sent == {"plain prompt one": 5, "sharegpt question": len(Tokenizer.embedded().encode(reply))}
    assert run["levels"][0]["completed"] == 2
    server.bodies.clear()
    bench(server, tmp_path, "--dataset", str(data), "--concurrency", "1", "--num-prompts", "2",
          "--output-tokens", "7", "--endpoint", "chat")
    assert {b["messages"][0]["content"] for b in server.bodies[1:]} == {"plain prompt one", "sharegpt question"}
    assert {b["max_tokens"] for b in server.bodies[1:]} == {7}
    capsys.readouterr()
    assert main([server.url, "--dataset", str(data), "--concurrency", "1"]) == 2  # before any request is sent
    assert "the dataset has 2 usable prompts and a level needs 100" in capsys.readouterr().err
    assert len(server.bodies) == 3  # the chat run's probe and 2: nothing more
