"""The HTML report and the Perfetto trace, from hand-made Anatomy records (no model, no GPU).

The browser tests load the written page in Debian's headless Chromium and talk to it over the DevTools
protocol on a pipe (--remote-debugging-pipe: fd 3 in, fd 4 out, NUL-terminated JSON), which gives uncaught
exceptions, console errors, failed loads and CSP violations as events, every network request, and lets the test
count what plotly drew. They are skipped without /usr/bin/chromium (or $LLM_ANATOMY_CHROMIUM) unless
LLM_ANATOMY_REQUIRE_CHROMIUM=1, as CI sets it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sample_anatomy import sample_anatomy, sample_cpu_anatomy  # noqa: E402

from llm_anatomy.anatomy import Anatomy, WeightsRecord  # noqa: E402
from llm_anatomy.report.html import plotly_js, render_html, script_json, write_html  # noqa: E402
from llm_anatomy.report.trace import build_trace, write_trace  # noqa: E402

EVIL_PROMPT = 'Say <script>alert("x")</script> then </script><img src=x onerror=alert(1)> & "quotes" \'too\''
EVIL_OUTPUT = '</script><script>alert("out")</script> <!-- & \u2028 done'


def _without_plotly(page: str) -> str:
    """The page with the inlined plotly.js library taken out (it is large and contains URL strings of its own)."""
    js = plotly_js()
    assert page.count(js) == 1
    return page.replace(js, "")


@pytest.fixture(scope="module")
def evil():
    a = sample_anatomy(prompt_text=EVIL_PROMPT, text=EVIL_OUTPUT, notes=['a note with <b>tags</b> & "quotes"'])
    a.model.name = 'Qwen3-8B <script>alert("model")</script>'
    a.decode_steps[0].token_text = '</script><script>alert("token")</script>'
    a.phases[0].note = "</script><svg onload=alert(1)>"
    return a


@pytest.fixture(scope="module")
def evil_page(evil):
    return render_html(evil)


# ----------------------------------------------------------------------------- HTML, static checks

def test_user_text_is_escaped(evil_page):
    page = _without_plotly(evil_page)
    assert "<script>alert" not in page
    assert "<img src=x" not in page and "<svg onload" not in page
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in page  # the prompt, as text
    assert "&lt;/script&gt;&lt;script&gt;alert(&#34;out&#34;)" in page  # the output
    assert "Qwen3-8B &lt;script&gt;" in page  # the model name
    assert "a note with &lt;b&gt;tags&lt;/b&gt; &amp; &#34;quotes&#34;" in page
    # the only <script> elements are plotly.js, and the one that draws the charts
    assert len(re.findall(r"<script\b", page, flags=re.I)) == 2
    assert len(re.findall(r"</script", page, flags=re.I)) == 2


def test_prompt_and_output_in_pre(evil_page):
    page = _without_plotly(evil_page)
    pre = re.search(r'<pre id="prompt-text">(.*?)</pre>', page, flags=re.S)
    assert pre and "&lt;script&gt;" in pre.group(1)
    out = re.search(r'<pre id="output-text">(.*?)</pre>', page, flags=re.S)
    assert out and "&lt;/script&gt;" in out.group(1)


def test_figure_json_cannot_close_its_script(evil_page):
    page = _without_plotly(evil_page)
    body = re.search(r"var figures = (.*?);\n", page)
    assert body, "figure JSON not found"
    text = body.group(1)
    assert "<" not in text and ">" not in text and "&" not in text
    figures = json.loads(text)  # \u003c etc. decode back to the same data
    assert {"chart-timeline", "chart-steps", "chart-roofline", "chart-power", "chart-clocks", "chart-kv",
            "chart-census", "chart-kernels"} <= set(figures)
    # the token text is in a hover label, with the entities plotly decodes back to the text
    assert '&lt;/script&gt;&lt;script&gt;alert(' in json.dumps(figures["chart-steps"])
    assert script_json({"s": "</script>\u2028&"}) == '{"s":"\\u003c/script\\u003e\\u2028\\u0026"}'


def test_no_remote_resources(evil_page):
    page = _without_plotly(evil_page)
    for m in re.finditer(r"""\b(?:src|href)\s*=\s*["']?\s*([^"'\s>]*)""", page, flags=re.I):
        assert not re.match(r"(?:https?:)?//", m.group(1), flags=re.I), m.group(0)
    assert not re.search(r"<link\b", page, flags=re.I)
    assert not re.search(r"@import|url\(\s*['\"]?(?:https?:)?//", page, flags=re.I)
    assert "Content-Security-Policy" in page and "default-src 'none'" in page


def test_headline_and_sections():
    a = sample_anatomy()
    page = _without_plotly(render_html(a))
    assert "Qwen3-8B" in page and "NVIDIA H200" in page and "2025-06-01" in page
    for label in ("TTFT", "TPOT", "End to end", "Prefill", "Decode", "KV cache per token", "Energy per token"):
        assert f'<div class="label">{label}</div>' in page
    assert "TFLOP/s" in page and "TB/s" in page and "MFU" in page and "MBU" in page
    for other_unit in ("GB/s", "GiB", "MiB", "KiB"):  # one unit system (decimal), bandwidth in TB/s
        assert other_unit not in page, other_unit
    assert "SYNTHETIC WEIGHTS" not in page  # a real checkpoint is not labelled synthetic
    for chart in ("timeline", "steps", "roofline", "power", "clocks", "kv", "census", "kernels"):
        assert f'id="chart-{chart}"' in page
    assert f"{a.memory.total:,}" in page  # the census total


def test_batching_section_says_who_shared_and_stalled_the_call():
    page = _without_plotly(render_html(sample_anatomy()))
    assert "<h2>Batching</h2>" in page and "req-&lt;c&gt;" in page and "req-<c>" not in page
    assert "13.500" in page  # the stall's GPU ms
    assert "<h2>Batching</h2>" not in _without_plotly(render_html(sample_cpu_anatomy()))  # no record, no section


def test_terminal_report_has_every_part():
    from rich.console import Console

    from llm_anatomy.report.terminal import render

    console = Console(record=True, width=240)
    render(sample_anatomy(), console)
    text = console.export_text()
    for part in ("Timeline", "Latency", "Prefill", "Decode", "Batching", "stalled 13.5 ms by 1 prefill step",
                 "KV cache", "Memory census", "GPU", "Kernels",
                 "17.4 s once, before this call and not in its timings, of which 14.2 s compiling kernels and "
                 "capturing 20 CUDA graphs, with 6.3 s of GEMV tile tuning (kept for the next start) (programmatic "
                 "dependent launch on; batch-1 GEMVs stream their weights before their wait)"):
        assert part in " ".join(text.split()), part  # long lines wrap
    assert "start-up: 17.4 s once" in render_html(sample_anatomy())
    render(sample_cpu_anatomy(), console)


def test_long_step_table_is_cut():
    page = render_html(sample_anatomy(steps=100))
    assert "60 steps left out" in page
    assert page.count('<td class="l"><code>') >= 40


def test_synthetic_weights_are_labelled():
    page = render_html(sample_anatomy(weights=WeightsRecord("synthetic", "random init", "synthetic (seed 7)", 7)))
    assert 'id="synthetic-banner"' in page and "SYNTHETIC WEIGHTS" in page


def test_cpu_variant_shows_the_note_not_empty_charts():
    a = sample_cpu_anatomy()
    page = _without_plotly(render_html(a))
    assert 'id="telemetry-note"' in page
    assert a.telemetry.note in page
    for chart in ("power", "clocks", "kernels"):
        assert f'id="chart-{chart}"' not in page
        assert f'"chart-{chart}"' not in page
    assert 'id="synthetic-banner"' in page  # the CPU sample runs synthetic weights
    assert "Energy per token" not in page


def test_degenerate_record_renders():
    a = sample_anatomy(steps=0)  # one output token: no decode steps, no decode summary
    a.prefill.roofline.achieved_tflops = float("nan")
    a.memory.activation_peak = None
    page = render_html(a)
    assert "no decode steps in this call" in page
    assert 'id="chart-steps"' not in page


def test_renders_from_the_json_record():
    a = sample_anatomy()
    again = Anatomy.from_json(a.to_json())
    assert render_html(again) == render_html(a)
    assert build_trace(again) == build_trace(a)


# ----------------------------------------------------------------------------- HTML in a browser

CHROMIUM = os.environ.get("LLM_ANATOMY_CHROMIUM", "/usr/bin/chromium")  # Debian's package: apt-get install chromium
REQUIRE_CHROMIUM = os.environ.get("LLM_ANATOMY_REQUIRE_CHROMIUM") == "1"


@pytest.fixture(scope="module")
def chromium():
    if not Path(CHROMIUM).exists():
        if REQUIRE_CHROMIUM:
            pytest.fail(f"{CHROMIUM} is missing and LLM_ANATOMY_REQUIRE_CHROMIUM=1 (apt-get install -y chromium)")
        pytest.skip(f"{CHROMIUM} not installed (apt-get install -y chromium)")
    return CHROMIUM


@dataclasses.dataclass
class PageLoad:
    errors: list[str]  # uncaught exceptions, console.error/assert, browser log errors (failed loads, CSP)
    requests: list[str]  # every URL the page asked for
    charts: dict[str, dict]  # per div.chart: svg count and number of drawn traces


_PROBE = """JSON.stringify(Array.from(document.querySelectorAll('div.chart')).map(function (d) {
  return [d.id, d.querySelectorAll('.main-svg').length, d.querySelectorAll('g.trace, g.shape-group path').length];
}))"""


def load_in_chromium(path: Path, timeout: float = 60.0, settle_s: float = 0.3) -> PageLoad:
    """Open `path` in headless Chromium over the DevTools pipe and collect errors, requests and drawn charts."""
    cmd_r, cmd_w = os.pipe()  # we write commands, Chromium reads them on fd 3
    ans_r, ans_w = os.pipe()  # Chromium writes answers and events on fd 4
    profile = tempfile.mkdtemp(prefix="llm-anatomy-chromium-")
    log = tempfile.TemporaryFile()

    def child_fds():
        r, w = os.dup(cmd_r), os.dup(ans_w)  # via fresh fds, in case the pipes are themselves 3 or 4
        os.dup2(r, 3)
        os.dup2(w, 4)

    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-extensions", "--disable-dev-shm-usage", "--mute-audio", f"--user-data-dir={profile}",
            "--remote-debugging-pipe", "about:blank"]
    proc = subprocess.Popen(args, preexec_fn=child_fds, close_fds=False, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log)
    os.close(cmd_r)
    os.close(ans_w)
    deadline = time.monotonic() + timeout
    events: list[dict] = []
    buf = b""
    ids = iter(range(1, 1 << 30))

    def read_until(done):
        nonlocal buf
        while True:
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "method" in msg:
                    events.append(msg)
                if done(msg):
                    return msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"Chromium did not answer within {timeout} s")
            if select.select([ans_r], [], [], left)[0]:
                chunk = os.read(ans_r, 1 << 16)
                if not chunk:
                    log.seek(0)
                    raise RuntimeError("Chromium closed the pipe:\n" + log.read().decode(errors="replace")[-3000:])
                buf += chunk

    def call(method, params=None, session=None):
        i = next(ids)
        msg = {"id": i, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(cmd_w, json.dumps(msg).encode() + b"\0")
        answer = read_until(lambda m: m.get("id") == i)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    try:
        target = call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page", "Network"):
            call(f"{domain}.enable", session=session)
        call("Page.navigate", {"url": path.resolve().as_uri()}, session=session)
        read_until(lambda m: m.get("method") == "Page.loadEventFired" and m.get("sessionId") == session)
        time.sleep(settle_s)  # let late errors (timers, promises) arrive
        probe = call("Runtime.evaluate", {"expression": _PROBE, "returnByValue": True}, session=session)
        charts = {cid: {"svgs": svgs, "traces": traces}
                  for cid, svgs, traces in json.loads(probe["result"]["value"])}
        try:
            call("Browser.close")
        except (RuntimeError, TimeoutError):
            pass
    finally:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.close(cmd_w)
        os.close(ans_r)
        log.close()
        shutil.rmtree(profile, ignore_errors=True)

    errors = []
    for ev in events:
        method, p = ev["method"], ev.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            errors.append("exception: " + (d.get("exception", {}).get("description") or d.get("text", "")))
        elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            errors.append(f"console.{p['type']}: " + " ".join(str(x.get("value", x.get("description", "")))
                                                               for x in p.get("args", [])))
        elif method == "Log.entryAdded" and p["entry"].get("level") == "error":
            errors.append("log: " + p["entry"].get("text", ""))
    requests = [ev["params"]["request"]["url"] for ev in events if ev["method"] == "Network.requestWillBeSent"]
    return PageLoad(errors, requests, charts)


def _assert_offline(load: PageLoad, path: Path):
    assert load.requests, "the page load was not observed"
    for url in load.requests:
        assert url == path.resolve().as_uri() or url.startswith(("data:", "blob:")), url


def test_browser_renders_gpu_report(chromium, evil, tmp_path):
    path = write_html(evil, tmp_path / "anatomy.html")
    load = load_in_chromium(path)
    assert load.errors == []
    _assert_offline(load, path)
    expected = {"chart-timeline", "chart-steps", "chart-roofline", "chart-power", "chart-clocks", "chart-kv",
                "chart-census", "chart-kernels"}
    assert set(load.charts) == expected
    for cid, drawn in load.charts.items():
        assert drawn["svgs"] > 0 and drawn["traces"] > 0, (cid, drawn)


def test_browser_renders_cpu_report(chromium, tmp_path):
    path = write_html(sample_cpu_anatomy(), tmp_path / "anatomy-cpu.html")
    load = load_in_chromium(path)
    assert load.errors == []
    _assert_offline(load, path)
    assert "chart-power" not in load.charts and "chart-clocks" not in load.charts
    assert load.charts and all(d["svgs"] > 0 and d["traces"] > 0 for d in load.charts.values()), load.charts


def test_browser_check_detects_errors(chromium, tmp_path):
    """The detection itself: a thrown error, a console.error and a blocked remote load are all caught."""
    boom = tmp_path / "boom.html"
    boom.write_text('<!DOCTYPE html><html><body><script>throw new Error("boom")</script></body></html>')
    load = load_in_chromium(boom)
    assert any("boom" in e for e in load.errors), load.errors

    noisy = tmp_path / "noisy.html"
    noisy.write_text('<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" '
                     'content="default-src \'none\'; script-src \'unsafe-inline\'"></head><body>'
                     '<img src="https://example.invalid/x.png"><script>console.error("quiet failure")</script>'
                     '</body></html>')
    load = load_in_chromium(noisy)
    assert any("quiet failure" in e for e in load.errors), load.errors
    assert any("example.invalid" in e for e in load.errors), load.errors  # the CSP violation
    with pytest.raises(AssertionError):
        _assert_offline(load, noisy)


# ----------------------------------------------------------------------------- trace

PHASES = {"X", "C", "M", "i"}


def validate_trace(trace: dict) -> None:
    """The trace-event format, as Chrome's and Perfetto's JSON importers read it."""
    assert isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list) and trace["traceEvents"]
    assert trace.get("displayTimeUnit") in ("ms", "ns")
    for ev in trace["traceEvents"]:
        for key in ("name", "ph", "ts", "pid", "tid"):
            assert key in ev, (key, ev)
        assert isinstance(ev["name"], str) and ev["name"]
        assert ev["ph"] in PHASES, ev
        assert type(ev["pid"]) is int and type(ev["tid"]) is int, ev
        assert isinstance(ev["ts"], (int, float)) and not isinstance(ev["ts"], bool), ev
        assert math.isfinite(ev["ts"]) and ev["ts"] >= 0, ev
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], (int, float)) and math.isfinite(ev["dur"]) and ev["dur"] >= 0, ev
        if ev["ph"] == "C":
            assert isinstance(ev["args"], dict) and ev["args"], ev
            for v in ev["args"].values():
                assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), ev
        if ev["ph"] == "M":
            assert ev["name"] in ("process_name", "process_labels", "thread_name", "thread_sort_index",
                                  "process_sort_index"), ev
        if ev["ph"] == "i":
            assert ev.get("s", "t") in ("g", "p", "t"), ev
    # complete events nest properly within each thread
    by_tid: dict[tuple, list] = {}
    for ev in trace["traceEvents"]:
        if ev["ph"] == "X":
            by_tid.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    for spans in by_tid.values():
        stack: list[float] = []
        for ev in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= ev["ts"]:
                stack.pop()
            assert not stack or ev["ts"] + ev["dur"] <= stack[-1] + 1e-6, f"{ev['name']} overlaps its parent"
            stack.append(ev["ts"] + ev["dur"])


def _threads(trace: dict) -> dict[str, int]:
    return {ev["args"]["name"]: ev["tid"] for ev in trace["traceEvents"]
            if ev["ph"] == "M" and ev["name"] == "thread_name"}


def test_trace_is_valid_and_complete(evil, tmp_path):
    trace = build_trace(evil)
    validate_trace(trace)
    text = json.dumps(trace, allow_nan=False)
    assert json.loads(text) == trace
    path = write_trace(evil, tmp_path / "anatomy.trace.json")
    loaded = json.loads(path.read_text(encoding="utf-8"))
    assert loaded == trace
    validate_trace(loaded)

    threads = _threads(trace)
    assert "host" in threads and "GPU" in threads
    events = trace["traceEvents"]
    host = [e for e in events if e["ph"] == "X" and e["tid"] == threads["host"]]
    assert {p.name for p in evil.phases} <= {e["name"] for e in host}
    e2e_us = evil.e2e_ms * 1000
    for ev in host:
        assert 0 <= ev["ts"] and ev["ts"] + ev["dur"] <= e2e_us + 1e-3, ev

    gpu = [e for e in events if e["ph"] == "X" and e["tid"] == threads["GPU"]]
    assert len(gpu) == 1 + len(evil.decode_steps)
    step1 = next(e for e in gpu if e["name"] == "decode step 1")
    assert step1["args"]["token"] == evil.decode_steps[0].token_text  # raw text in JSON, it is data here
    for key in ("context_len", "batch_size", "bytes", "flops"):
        assert key in step1["args"]
    assert step1["dur"] == pytest.approx(evil.decode_steps[0].gpu_ms * 1000, abs=1e-2)

    counters = {e["name"] for e in events if e["ph"] == "C"}
    for name in ("power (W)", "SM clock (MHz)", "memory clock (MHz)", "energy since call start (J)",
                 "KV cache of this request (bytes)"):
        assert name in counters
    kv = [e for e in events if e["name"] == "KV cache of this request (bytes)"]
    assert [e["args"]["bytes"] for e in kv] == evil.kv_cache.bytes_after_step


def test_trace_cpu_and_odd_values():
    a = sample_cpu_anatomy()
    a.decode_steps[0].mbu = float("nan")
    a.decode_steps[1].flops = float("inf")
    trace = build_trace(a)
    validate_trace(trace)
    json.dumps(trace, allow_nan=False)  # no NaN or infinity anywhere
    counters = {e["name"] for e in trace["traceEvents"] if e["ph"] == "C"}
    assert counters == {"KV cache of this request (bytes)"}  # no telemetry on the CPU


def test_trace_overlapping_phases_get_their_own_lane():
    a = sample_anatomy()
    a.phases.append(dataclasses.replace(a.phases[-2], name="overlap", start_ms=a.ttft_ms - 1.0,
                                        end_ms=a.ttft_ms + 1.0))
    trace = build_trace(a)
    validate_trace(trace)  # it would fail if "overlap" shared the host thread
    assert "host (2)" in _threads(trace)
