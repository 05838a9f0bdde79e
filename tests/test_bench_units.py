"""`llm-anatomy bench`'s parts without a server: SSE parsing, vLLM's metric definitions, prompts and datasets,
the Prometheus view, energy, the anatomy join and the reports."""

import json
import math
import socket

import numpy as np
import pytest
import torch

from llm_anatomy.bench.cli import _base_url, is_local
from llm_anatomy.bench.client import RequestResult, RequestShape, SSEBuffer, _error_reason
from llm_anatomy.bench.datasets import (WORDS, DatasetError, Prompt, dataset_prompts, load_dataset,
                                        random_text_prompts, random_token_prompts)
from llm_anatomy.bench.join import joined_view
from llm_anatomy.bench.load import Level, poisson_arrivals
from llm_anatomy.bench.metrics import distribution_ms, level_metrics, parse_slo
from llm_anatomy.bench.power import EnergyReading, GpuEnergyMeter, energy_view
from llm_anatomy.bench.report import fmt, print_report, render_html, table_cells, to_json
from llm_anatomy.bench.runner import BenchConfig, BenchRun, default_num_prompts
from llm_anatomy.bench.scrape import ServerWatch, Snapshot, flavour, parse
from llm_anatomy.errors import AnatomyError
from llm_anatomy.report.html import plotly_js
from llm_anatomy.server.core import Gauges
from llm_anatomy.server.metrics import Metrics
from llm_anatomy.tokenizer import Tokenizer
from sample_anatomy import sample_anatomy
from test_report_files import chromium, load_in_chromium  # noqa: F401 (chromium is a fixture)


# ----------------------------------------------------------------------------- the wire

def test_sse_events_split_across_reads_crlf_comments_and_multiline_data():
    sse = SSEBuffer()
    assert sse.feed(b'data: {"a": 1}\n\nda') == ['{"a": 1}']
    assert sse.feed(b"ta: [DONE]\n\n") == ["[DONE]"]
    assert sse.feed(b"data: x\r") == [] and sse.feed(b"\n\r\n") == ["x"]  # CRLF cut between reads
    assert sse.feed(b": ping\n\nevent: note\nid: 3\n\n") == []  # comments and other fields carry no data
    assert sse.feed(b"data: line one\ndata:line two\n\n") == ["line one\nline two"]


@pytest.mark.parametrize("body, reason", [
    (b'{"error": {"message": "boom", "type": "server_error"}}', "HTTP 500: boom"),  # OpenAI's shape
    (b'{"object": "error", "message": "too long", "code": 400}', "HTTP 500: too long"),  # vLLM's
    (b'{"detail": "Not Found"}', "HTTP 500: Not Found"),  # FastAPI's
    (b"<html>\n  bad gateway </html>", "HTTP 500: <html> bad gateway </html>"),
    (b"", "HTTP 500"),
    (b"x" * 1000, "HTTP 500: " + "x" * 160),
])
def test_error_reasons(body, reason):
    assert _error_reason(500, body) == reason


def test_request_payloads():
    ids, text = Prompt(7, token_ids=(5, 6)), Prompt(3, text="hello")
    assert RequestShape("completions", "m").payload(ids) == {
        "model": "m", "max_tokens": 7, "stream": True, "prompt": [5, 6], "stream_options": {"include_usage": True},
        "ignore_eos": True}
    chat = RequestShape("chat", "m", ignore_eos=False, include_usage=False)
    assert chat.payload(text) == {"model": "m", "max_tokens": 3, "stream": True,
                                  "messages": [{"role": "user", "content": "hello"}]}
    assert chat.path == "/v1/chat/completions" and RequestShape("completions", "m").path == "/v1/completions"


# ----------------------------------------------------------------------------- metrics

def test_percentiles_are_numpys_linear_interpolation():
    d = distribution_ms([0.1, 0.2, 0.3, 0.4])
    assert d == pytest.approx({"mean": 250.0, "p50": 250.0, "p90": 370.0, "p99": 397.0})
    assert d["p99"] == pytest.approx(float(np.percentile([100, 200, 300, 400], 99)))
    assert distribution_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def _ok(ttft, e2e, tokens, itl=(), usage=True, prompt=10):
    return RequestResult(ok=True, start_s=0.0, ttft_s=ttft, e2e_s=e2e, end_s=e2e, output_tokens=tokens,
                         itl_s=list(itl), tokens_from_usage=usage, prompt_tokens=prompt, finish_reason="length")


def test_level_metrics_follow_vllms_definitions():
    results = [_ok(0.1, 0.5, 5, itl=[0.1] * 4), _ok(0.2, 0.2, 1),
               RequestResult(ok=False, start_s=0, error="HTTP 500: x"),
               RequestResult(ok=False, start_s=0, error="HTTP 500: x")]
    m = level_metrics(results, 2.0, None)
    assert (m["requests"], m["completed"]) == (4, 2)
    assert m["errors"] == {"count": 2, "reasons": {"HTTP 500: x": 2}}
    assert m["request_s"] == 1.0 and m["output_tok_s"] == 3.0 and m["total_tok_s"] == (6 + 20) / 2
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0)  # (500 - 100) / (5 - 1); the 1-token request has none
    assert m["itl_ms"]["p50"] == pytest.approx(100.0) and m["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert m["e2e_ms"]["p50"] == pytest.approx(350.0) and m["output_tokens_from"] == "usage"
    assert m["goodput"] is None and m["finish_reasons"] == {"length": 2}
    good = level_metrics(results, 2.0, {"ttft_ms": 150.0})["goodput"]
    assert good == {"slo": {"ttft_ms": 150.0}, "good_requests": 1, "request_s": 0.5, "fraction": 0.5}
    # a one-token request's TPOT counts as 0 for goodput (as vLLM); the other's 100 ms misses 50
    assert level_metrics(results, 2.0, {"tpot_ms": 50.0})["goodput"]["good_requests"] == 1
    chunks = level_metrics([_ok(0.1, 0.3, 3, usage=False, prompt=None)], 1.0, None)
    assert chunks["output_tokens_from"] == "chunks" and chunks["input_tokens"] is None


@pytest.mark.parametrize("text, message", [
    ("ttft=1", "--slo takes"), ("ttft_ms", "--slo takes"), ("ttft_ms=1,ttft_ms=2", "twice"),
    ("tpot_ms=fast", "number of milliseconds"), ("e2e_ms=0", "> 0 ms"), ("e2e_ms=inf", "> 0 ms"), (",", "empty"),
])
def test_bad_slo(text, message):
    with pytest.raises(AnatomyError, match=message):
        parse_slo(text)
    assert parse_slo("ttft_ms=500, tpot_ms=50") == {"ttft_ms": 500.0, "tpot_ms": 50.0}


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    a = poisson_arrivals(20000, 8.0, "0/arrivals0")
    assert a == poisson_arrivals(20000, 8.0, "0/arrivals0") and a != poisson_arrivals(20000, 8.0, "1/arrivals0")
    assert a[0] == 0 and all(x < y for x, y in zip(a, a[1:]))
    assert a[-1] == pytest.approx((len(a) - 1) / 8.0)  # the mean rate is exact
    gaps = np.diff(a)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.03)  # exponential: its sd is its mean
    assert poisson_arrivals(6, 2.0, "x")[-1] == pytest.approx(2.5) and poisson_arrivals(1, 2.0, "x") == [0.0]


def test_default_prompt_counts():
    assert default_num_prompts(Level(concurrency=1)) == 100
    assert default_num_prompts(Level(concurrency=256)) == 1024
    assert default_num_prompts(Level(request_rate=0.5)) == 50
    assert default_num_prompts(Level(request_rate=10)) == 300


# ----------------------------------------------------------------------------- prompts

def test_words_are_single_tokens_so_text_prompts_have_the_asked_length():
    tok = Tokenizer.embedded()
    assert len(WORDS) == len(set(WORDS)) >= 200
    assert all(len(tok.encode(w)) == 1 and len(tok.encode(" " + w)) == 1 for w in WORDS)
    prompts = random_text_prompts(5, 64, 9, "s")
    assert all(len(tok.encode(p.text)) == 64 and p.output_tokens == 9 for p in prompts)
    assert len({p.text for p in prompts}) == 5 and prompts == random_text_prompts(5, 64, 9, "s")


def test_random_token_prompts():
    prompts = random_token_prompts(4, 32, 7, (10, 20), "s")
    assert all(len(p.token_ids) == 32 and p.input_tokens == 32 and set(p.token_ids) <= set(range(10, 20))
               for p in prompts)
    assert len({p.token_ids for p in prompts}) == 4 and prompts != random_token_prompts(4, 32, 7, (10, 20), "t")


def test_dataset_shapes_and_files(tmp_path):
    share = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "Q?"},
                               {"from": "gpt", "value": "one two three"}]}
    rows = [share, {"prompt": "P", "output_tokens": 4}, {"conversations": [{"from": "human", "value": "alone"}]}]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(map(json.dumps, rows)) + "\n\n")
    array = tmp_path / "d.json"
    array.write_text(json.dumps(rows, indent=2))
    for path in (jsonl, array):
        entries = load_dataset(path)
        assert [(e.prompt, e.output_tokens, e.reply) for e in entries] == [("Q?", None, "one two three"),
                                                                           ("P", 4, None)]
    prompts = {p.text: p.output_tokens for p in dataset_prompts(entries, 2, None, "s")}
    assert prompts == {"Q?": len(Tokenizer.embedded().encode("one two three")), "P": 4}
    assert {p.output_tokens for p in dataset_prompts(entries, 2, 11, "s")} == {11}
    with pytest.raises(DatasetError, match="has 2 usable prompts: ask for --num-prompts <= 2"):
        dataset_prompts(entries, 3, None, "s")
    with pytest.raises(DatasetError, match="line 1 gives no output length"):
        dataset_prompts(load_dataset(_write(tmp_path, '{"prompt": "no length"}')), 1, None, "s")


def _write(tmp_path, text: str):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "a"}\n{"prompt": \n', "line 2 is not JSON"),
    ('{"prompt": ""}\n', "line 1: `prompt` must be a non-empty string"),
    ('{"prompt": "a", "output_tokens": 0}\n', "`output_tokens` must be an integer >= 1"),
    ('{"prompt": "a", "output_tokens": true}\n', "`output_tokens` must be an integer >= 1"),
    ('{"text": "a"}\n', "no `prompt` or `conversations` field"),
    ('[1, 2]\n', "record 1: expected a JSON object"),
    ('{"conversations": "hi"}\n', "`conversations` must be a list"),
    ('{"conversations": [{"from": "gpt", "value": "x"}]}\n', "no usable prompt"),
    ("[\n{", "not a valid JSON array"),
    ("", "no usable prompt"),
])
def test_bad_datasets(tmp_path, text, message):
    with pytest.raises(DatasetError, match=message):
        load_dataset(_write(tmp_path, text))


def test_a_dataset_that_is_not_text(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DatasetError, match="not UTF-8"):
        load_dataset(path)


# ----------------------------------------------------------------------------- the server's view

VLLM_BEFORE = """# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="m"} 3
vllm:prefix_cache_hits_total{model_name="m"} 100
vllm:prefix_cache_queries_total{model_name="m"} 1000
vllm:generation_tokens_total{model_name="m"} 50
vllm:request_queue_time_seconds_sum{model_name="m"} 1.0
vllm:request_queue_time_seconds_count{model_name="m"} 10
vllm:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 10
vllm:time_to_first_token_seconds_sum{model_name="m"} 2.0
vllm:time_to_first_token_seconds_count{model_name="m"} 10
vllm:iteration_tokens_total_sum{model_name="m"} 7000
vllm:iteration_tokens_total_count{model_name="m"} 70
"""
VLLM_AFTER = VLLM_BEFORE.replace("} 3\n", "} 5\n").replace("} 100\n", "} 400\n").replace("} 1000\n", "} 2000\n") \
    .replace("} 50\n", "} 850\n").replace("seconds_sum{model_name=\"m\"} 1.0", "seconds_sum{model_name=\"m\"} 1.5") \
    .replace("seconds_count{model_name=\"m\"} 10", "seconds_count{model_name=\"m\"} 15") \
    .replace("seconds_sum{model_name=\"m\"} 2.0", "seconds_sum{model_name=\"m\"} 3.0") \
    .replace("} 7000\n", "} 17000\n").replace("} 70\n", "} 90\n")


def _gauges(prefix: str, running: list[float], waiting: float, usage: list[float]) -> Snapshot:
    names = {"vllm:": ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"),
             "sglang:": ("num_running_reqs", "num_queue_reqs", "token_usage")}[prefix]
    lines = [f'{prefix}{names[0]}{{rank="{i}"}} {v}' for i, v in enumerate(running)]
    lines += [f"{prefix}{names[1]} {waiting}"] + [f'{prefix}{names[2]}{{rank="{i}"}} {v}' for i, v in enumerate(usage)]
    return Snapshot(parse("\n".join(lines) + "\n"), prefix, 0.0)


def test_vllm_view_from_differences_and_polled_gauges():
    before, after = parse(VLLM_BEFORE), parse(VLLM_AFTER)
    assert flavour(before) == "vllm:" and "vllm:request_queue_time_seconds_bucket" not in before
    watch = ServerWatch("vllm:", Snapshot(before, "vllm:", 0), after=Snapshot(after, "vllm:", 9))
    watch.during = [_gauges("vllm:", [3, 4], 2, [0.5, 0.7]), _gauges("vllm:", [1, 1], 0, [0.1, 0.1])]
    assert watch.view()["engine_steps_per_s"] is None  # without the level's duration (not the scrapes' 9 s)
    v = watch.view(duration_s=4.0)
    assert v["metrics"] == "vllm" and v["scrapes"] == 4
    assert v["preemptions"] == 2 and v["generation_tokens"] == 800 and v["prefix_cache_hit_rate"] == 0.3
    assert v["queue_ms_mean"] == pytest.approx(100.0) and v["ttft_ms_mean"] == pytest.approx(200.0)
    assert v["requests_counted"] == 5 and v["itl_ms_mean"] is None
    assert v["engine_steps"] == 20 and v["engine_steps_per_s"] == 5 and v["tokens_per_step_mean"] == 500
    assert v["requests_running"] == {"mean": 4.5, "max": 7} and v["requests_waiting"] == {"mean": 1, "max": 2}
    assert v["kv_cache_usage"] == pytest.approx({"mean": 0.35, "max": 0.6})  # ranks averaged, then over scrapes


def test_sglang_view():
    b = parse("sglang:cached_tokens_total 10\nsglang:prompt_tokens_total 100\nsglang:num_retracted_requests_total 1\n")
    a = parse("sglang:cached_tokens_total 70\nsglang:prompt_tokens_total 300\nsglang:num_retracted_requests_total 4\n")
    assert flavour(a) == "sglang:"
    watch = ServerWatch("sglang:", Snapshot(b, "sglang:", 0), after=Snapshot(a, "sglang:", 1))
    watch.during = [_gauges("sglang:", [8], 3, [0.9])]
    v = watch.view()
    assert v["prefix_cache_hit_rate"] == pytest.approx(0.3) and v["preemptions"] == 3 and v["prompt_tokens"] == 200
    assert v["requests_running"] == {"mean": 8, "max": 8} and v["kv_cache_usage"]["max"] == 0.9
    gauge_only = ServerWatch("sglang:", Snapshot({}, "sglang:", 0), after=Snapshot({}, "sglang:", 1),
                             during=[Snapshot(parse("sglang:cache_hit_rate 0.25\n"), "sglang:", 0)])
    assert gauge_only.view()["prefix_cache_hit_rate"] == 0.25


def test_our_own_servers_metrics_are_read():
    """Guards against drift: the names llm_anatomy/server/metrics.py exports are the ones bench reads."""
    metrics = Metrics("m")
    metrics.live.gauges = Gauges(running=2, waiting=1, kv_usage=0.25, failed_steps=0, last_failure=None)
    before = Snapshot(parse(metrics.render().decode()), "llm_anatomy:", 0)
    assert flavour(before.samples) == "llm_anatomy:"
    metrics.finished("length", 16, 8)
    a = sample_anatomy()  # what the server observes from a finished call's trace (metrics.call_stats, Metrics.observe)
    metrics.ttft.labels("m").observe(a.ttft_ms / 1e3)
    metrics.queue.labels("m").observe(a.batching.queue_ms / 1e3)
    after = Snapshot(parse(metrics.render().decode()), "llm_anatomy:", 1)
    v = ServerWatch("llm_anatomy:", before, during=[after], after=after).view()
    assert v["requests_running"]["max"] == 2 and v["requests_waiting"]["max"] == 1
    assert v["kv_cache_usage"]["max"] == pytest.approx(0.25) and v["generation_tokens"] == 8
    assert v["ttft_ms_mean"] == pytest.approx(a.ttft_ms) and v["requests_counted"] == 1
    assert v["queue_ms_mean"] == pytest.approx(a.batching.queue_ms) and v["preemptions"] == 0
    assert v["engine_steps"] is None  # the histogram's labelled series appears with the first step
    metrics.observe_steps((512, 1, 1))
    later = Snapshot(parse(metrics.render().decode()), "llm_anatomy:", 7)
    v = ServerWatch("llm_anatomy:", before, after=later).view(duration_s=2.0)
    assert v["engine_steps"] == 3 and v["tokens_per_step_mean"] == pytest.approx(514 / 3)
    assert v["engine_steps_per_s"] == pytest.approx(1.5)


def test_our_servers_gpu_energy_counter_gives_joules_per_token():
    b = parse("llm_anatomy:gpu_energy_joules_total 100\nllm_anatomy:generation_tokens_total 0\n")
    a = parse("llm_anatomy:gpu_energy_joules_total 160\nllm_anatomy:generation_tokens_total 300\n")
    v = ServerWatch("llm_anatomy:", Snapshot(b, "llm_anatomy:", 0), after=Snapshot(a, "llm_anatomy:", 1)).view()
    assert v["gpu_energy_j"] == 60 and v["j_per_output_token"] == pytest.approx(0.2)


def test_metrics_without_known_names():
    assert flavour(parse("process_cpu_seconds_total 3\n")) is None


# ----------------------------------------------------------------------------- energy and the anatomy join

def test_energy_view():
    start, end = EnergyReading(10.0, {0: 1_000_000, 1: 5_000}), EnergyReading(12.0, {0: 1_500_000, 1: 105_000})
    v = energy_view(start, end, {0: "H200", 1: "H200"}, output_tokens=1200)
    assert v["energy_j"] == 600 and v["mean_power_w"] == 300 and v["j_per_output_token"] == 0.5
    assert v["devices"] == [{"index": 0, "name": "H200", "energy_j": 500}, {"index": 1, "name": "H200",
                                                                             "energy_j": 100}]
    assert energy_view(start, end, {}, 0)["j_per_output_token"] is None


def test_nvml_meter_opens_or_says_why():
    meter, why = GpuEnergyMeter.open(None)
    if meter is None:
        assert why.startswith("no GPU energy: ")
    else:
        meter.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nvml_energy_counter_reads_on_a_gpu():
    meter, why = GpuEnergyMeter.open(None)
    assert meter is not None, why
    try:
        a = meter.read(0.0)
        b = meter.read(1.0)
        assert set(a.millijoules) == set(meter.names)
        assert all(b.millijoules[i] >= a.millijoules[i] for i in a.millijoules)
    finally:
        meter.close()
    bad, why = GpuEnergyMeter.open((999,))
    assert bad is None and "not index 999" in why


def test_anatomy_join_rows_and_missing_reasons():
    s = sample_anatomy(id="a1").summary()
    results = [_ok(0.3, 0.9, 32), _ok(0.3, 0.9, 32), _ok(0.3, 0.9, 32), RequestResult(ok=False, start_s=0)]
    results[0].anatomy_id, results[1].anatomy_id = "a1", "gone"
    v = joined_view(results, {"a1": s, "gone": "not in the server's store (older than its --keep-anatomies newest)"})
    assert v["joined"] == 1
    assert v["missing"] == {"not in the server's store (older than its --keep-anatomies newest)": 1,
                            "no x-anatomy-id header": 1}
    row = v["requests"][0]
    assert row["client_ttft_ms"] == pytest.approx(300) and row["server_ttft_ms"] == s["ttft_ms"]
    assert v["ttft_gap_ms"]["p50"] == pytest.approx(300 - s["ttft_ms"])
    assert v["queue_ms"]["p50"] == pytest.approx(s["queue_ms"])


# ----------------------------------------------------------------------------- flags, URLs, reports

def test_open_file_limit_too_low_for_the_streams(monkeypatch):
    import resource

    from llm_anatomy.bench.cli import _allow_open_files

    config = BenchConfig(url="http://h", levels=(Level(concurrency=4000),))
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 2048))
    with pytest.raises(AnatomyError, match="4000 streams need about 4064 open files; this shell allows 2048"):
        _allow_open_files(config)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8192, 8192))
    _allow_open_files(config)  # enough already: nothing to do


def test_base_url_and_locality():
    assert _base_url("http://h:8000/v1/") == "http://h:8000" == _base_url("http://h:8000")
    assert _base_url("https://h/prefix/v1") == "https://h/prefix"
    assert is_local("127.0.0.1") and is_local("localhost") and is_local("::1") and is_local(socket.gethostname())
    assert not is_local("198.51.100.7")  # TEST-NET-2: nobody's


@pytest.mark.parametrize("x, text", [(None, "-"), (12345, "12,345"), (1234.5, "1,234"), (12.345, "12.3"),
                                     (1.2345, "1.23"), (0.012345, "0.0123"), (0.0, "0"), (math.nan, "-")])
def test_fmt(x, text):
    assert fmt(x) == text


def _run(model: str = "m", levels=(1, 8)) -> BenchRun:
    config = BenchConfig(url="http://127.0.0.1:8000", levels=tuple(Level(concurrency=c) for c in levels),
                         slo={"ttft_ms": 500.0})
    run = BenchRun(config, model, shape=RequestShape("completions", model), notes=["a <b>note</b>"])
    for c in levels:
        lv = {"level": f"concurrency {c}", "concurrency": c, "request_rate": None,
              **level_metrics([_ok(0.1 * c, 0.5 * c, 5, itl=[0.1] * 4)] * 3, 1.0, config.slo),
              "max_in_flight": c, "client_cpu": 0.2, "achieved_request_rate": None, "gpu": None, "server": None,
              "anatomy": None, "notes": []}
        run.levels.append(lv)
    return run


def test_table_leaves_out_what_no_level_has(capsys):
    run = _run()
    labels = [label for _, label, _ in table_cells(run)]
    assert "TTFT p99 (ms)" in labels and "goodput req/s (ttft_ms <= 500)" in labels
    assert not any("server" in s or "NVML" in s for s, _, _ in table_cells(run))
    print_report(run)
    out = capsys.readouterr().out
    assert "concurrency 8" in out and "note: a <b>note</b>" in out
    data = to_json(run)
    json.dumps(data, allow_nan=False)
    assert [lv["ttft_ms"]["p50"] for lv in data["levels"]] == pytest.approx([100, 800])


def test_html_escapes_what_the_server_says():
    evil = '<script>alert("x")</script>'
    page = render_html(_run(model=evil)).replace(plotly_js(), "")
    assert evil not in page and "&lt;script&gt;alert(" in page and "a &lt;b&gt;note" in page
    assert "Content-Security-Policy" in page and "default-src 'none'" in page


def test_html_draws_its_charts_in_a_browser(tmp_path, chromium):
    path = tmp_path / "bench.html"
    path.write_text(render_html(_run(model='<img src=x onerror=alert(1)>')), encoding="utf-8")
    load = load_in_chromium(path)
    assert load.errors == []
    assert load.requests and all(url == path.resolve().as_uri() or url.startswith(("data:", "blob:"))
                                 for url in load.requests)
    assert set(load.charts) == {"chart-ttft_ms", "chart-tpot_ms", "chart-itl_ms", "chart-e2e_ms", "chart-throughput"}
    for cid, drawn in load.charts.items():
        assert drawn["svgs"] >= 1 and drawn["traces"] >= 1, cid
