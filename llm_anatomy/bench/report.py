"""A run's figures three ways: a terminal table (one column per level), a JSON file (one object per level) and
a self-contained HTML page (plotly inlined, works offline) with latency percentiles and throughput against
concurrency or request rate. The table rows are defined once, for the terminal and the page."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import plotly.io as pio
from rich.console import Console
from rich.table import Table

from .. import __version__
from ..report.page import render_page
from .metrics import PERCENTILES
from .runner import BenchRun

STATS = ("mean", *(f"p{q}" for q in PERCENTILES))
LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "e2e"))
TEMPLATES = Path(__file__).parent / "templates"  # bench.html, package data; it extends report's base.html


def _at(level: dict, path: str):
    value = level
    for key in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def fmt(x, unit: str = "") -> str:
    """Numbers with enough digits at any size: 12,345 / 123 / 12.3 / 1.23 / 0.0123."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}{unit}"
    a = abs(x)
    text = (f"{x:,.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 1 else
            "0" if a == 0 else f"{x:.3g}")
    return text + unit


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _mean_max(x) -> str:
    """Gauges' mean / max over a level's scrapes (a count of requests comes back from Prometheus as a float)."""
    if not x:
        return "-"
    peak = int(x["max"]) if float(x["max"]).is_integer() else x["max"]
    return f"{fmt(x['mean'])} / {fmt(peak)}"


Row = tuple[str, str, Callable[[dict], str]]  # section, label, cell


def _rows(run: BenchRun) -> list[Row]:
    def f(path: str) -> Callable[[dict], str]:
        return lambda lv: fmt(_at(lv, path))

    rows: list[Row] = [
        ("client", "requests done / sent", lambda lv: f"{lv['completed']:,} / {lv['requests']:,}"),
        ("client", "errors", lambda lv: fmt(lv["errors"]["count"])),
        ("client", "duration (s)", f("duration_s")),
        ("client", "requests/s", f("request_s")),
        ("client", "output tok/s", f("output_tok_s")),
        ("client", "total tok/s", f("total_tok_s")),
    ]
    if run.config.slo:
        slo = ", ".join(f"{k} <= {v:g}" for k, v in run.config.slo.items())
        rows += [("client", f"goodput req/s ({slo})", f("goodput.request_s")),
                 ("client", "share meeting the SLO", lambda lv: _pct(_at(lv, "goodput.fraction")))]
    for key, name in LATENCIES:
        rows += [("client", f"{name} {stat} (ms)", f(f"{key}.{stat}")) for stat in STATS]
    rows += [
        ("client", "output tokens (counted from)", lambda lv: f"{lv['output_tokens']:,} ({lv['output_tokens_from']})"),
        ("client", "max in flight", f("max_in_flight")),
        ("client", "achieved request rate (/s)", f("achieved_request_rate")),
        ("client", "client CPU busy", lambda lv: _pct(lv["client_cpu"])),
        ("server", "running requests mean / max", lambda lv: _mean_max(_at(lv, "server.requests_running"))),
        ("server", "waiting requests mean / max", lambda lv: _mean_max(_at(lv, "server.requests_waiting"))),
        ("server", "KV cache usage mean / max", lambda lv: "-" if not _at(lv, "server.kv_cache_usage") else
         f"{_pct(lv['server']['kv_cache_usage']['mean'])} / {_pct(lv['server']['kv_cache_usage']['max'])}"),
        ("server", "queue time mean (ms)", f("server.queue_ms_mean")),
        ("server", "prefill mean (ms)", f("server.prefill_ms_mean")),
        ("server", "TTFT mean (ms)", f("server.ttft_ms_mean")),
        ("server", "ITL mean (ms)", f("server.itl_ms_mean")),
        ("server", "e2e mean (ms)", f("server.e2e_ms_mean")),
        ("server", "engine steps per second", f("server.engine_steps_per_s")),
        ("server", "tokens per engine step mean", f("server.tokens_per_step_mean")),
        ("server", "preemptions", f("server.preemptions")),
        ("server", "prefix cache hit rate", lambda lv: _pct(_at(lv, "server.prefix_cache_hit_rate"))),
        ("server", "output tokens counted", f("server.generation_tokens")),
        ("server", "GPU energy (J)", f("server.gpu_energy_j")),
        ("server", "J per output token", f("server.j_per_output_token")),
        ("local GPU (NVML)", "energy (J)", f("gpu.energy_j")),
        ("local GPU (NVML)", "mean power (W)", f("gpu.mean_power_w")),
        ("local GPU (NVML)", "J per output token", f("gpu.j_per_output_token")),
        ("anatomy", "requests joined", f("anatomy.joined")),
        ("anatomy", "server TTFT p50 (ms)", f("anatomy.server_ttft_ms.p50")),
        ("anatomy", "client - server TTFT p50 (ms)", f("anatomy.ttft_gap_ms.p50")),
        ("anatomy", "of it: send to received / first token back, p50 (ms)", lambda lv: "-" if not lv.get("anatomy")
         or lv["anatomy"].get("arrival_ms", {}).get("p50") is None else
         f"{fmt(lv['anatomy']['arrival_ms']['p50'])} / {fmt(lv['anatomy']['delivery_ms']['p50'])}"),
        ("anatomy", "send to received: the client's / the way to the server, p50 (ms)", lambda lv: "-"
         if not lv.get("anatomy") or (lv["anatomy"].get("client_send_ms") or {}).get("p50") is None else
         f"{fmt(lv['anatomy']['client_send_ms']['p50'])} / {fmt(lv['anatomy']['to_server_ms']['p50'])}"),
        ("anatomy", "queue p50 / p99 (ms)", lambda lv: "-" if not lv.get("anatomy") else
         f"{fmt(lv['anatomy']['queue_ms']['p50'])} / {fmt(lv['anatomy']['queue_ms']['p99'])}"),
        ("anatomy", "prefill p50 (ms)", f("anatomy.prefill_ms.p50")),
        ("anatomy", "mean / max batch", lambda lv: "-" if not lv.get("anatomy") else
         f"{fmt(lv['anatomy']['mean_batch_size'])} / {fmt(lv['anatomy']['max_batch_size'])}"),
        ("anatomy", "J per output token (attributed)", f("anatomy.j_per_output_token")),
    ]
    # rows with nothing in any level are left out (a server without metrics, no local GPU...)
    return [r for r in rows if any(r[2](lv) not in ("-", "- / -") for lv in run.levels)]


def table_cells(run: BenchRun) -> list[tuple[str, str, list[str]]]:
    return [(section, label, [cell(lv) for lv in run.levels]) for section, label, cell in _rows(run)]


def title(run: BenchRun) -> str:
    c = run.config
    source = f"dataset {c.dataset.name}" if c.dataset else f"random {c.input_tokens} in"
    out = f"{c.output_tokens or 128} out" if c.output_tokens or not c.dataset else "the dataset's output lengths"
    return f"{run.model} at {c.url} - /v1/{'chat/completions' if c.endpoint == 'chat' else 'completions'}, " \
           f"{source} / {out}"


def print_report(run: BenchRun, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=title(run), title_justify="left", show_lines=False)
    table.add_column("")
    for lv in run.levels:
        table.add_column(lv["level"], justify="right")
    section = None
    for sec, label, cells in table_cells(run):
        if sec != section:
            table.add_section()
            table.add_row(f"[bold]{sec}[/bold]", *[""] * len(cells))
            section = sec
        table.add_row(label, *cells)
    console.print(table)
    for lv in run.levels:
        for reason, count in lv["errors"]["reasons"].items():
            console.print(f"{lv['level']}: {count} x {reason}", markup=False, highlight=False)
        for note in lv["notes"]:
            console.print(f"{lv['level']}: {note}", markup=False, highlight=False)
    for note in run.notes:
        console.print(f"note: {note}", markup=False, highlight=False)


def to_json(run: BenchRun) -> dict:
    c = run.config
    return {
        "tool": f"llm-anatomy {__version__} bench", "url": c.url, "model": run.model, "endpoint": c.endpoint,
        "settings": {
            "dataset": str(c.dataset) if c.dataset else None, "input_tokens": None if c.dataset else c.input_tokens,
            "output_tokens": c.output_tokens or (None if c.dataset else 128), "num_prompts": c.num_prompts,
            "seed": c.seed, "slo": c.slo, "timeout_s": c.timeout_s, "profile": c.profile,
            "ignore_eos": run.shape.ignore_eos if run.shape else c.ignore_eos,
            "include_usage": run.shape.include_usage if run.shape else True,
            "percentiles": "numpy linear interpolation (numpy.percentile's default)"},
        "notes": run.notes,
        "levels": run.levels,
    }


def write_json(run: BenchRun, path: Path) -> None:
    path.write_text(json.dumps(to_json(run), indent=1, allow_nan=False) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- HTML
# Figures are plotly's JSON (data + layout) built directly: go.Figure would validate and deep-copy the theme for
# each of them (a third of a second apiece); here the theme's JSON is made once and shared by every layout.

def _layout(title_text: str, xs: list, x_title: str, log_x: bool, theme: dict, **kw) -> dict:
    layout = dict(title=dict(text=title_text, x=0.01, font=dict(size=15)), template=theme, height=330,
                  margin=dict(l=70, r=70, t=60, b=50), hovermode="x unified",
                  xaxis=dict(title=dict(text=x_title), type="log" if log_x else "linear", tickvals=xs),
                  legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1))
    layout.update(kw)
    return layout


def _line(xs: list, ys: list, name: str, **kw) -> dict:
    return dict(type="scatter", mode="lines+markers", x=xs, y=ys, name=name, **kw)


def _figures(run: BenchRun) -> dict[str, dict]:
    levels = run.levels
    closed = levels[0]["concurrency"] is not None
    xs = [lv["concurrency"] if closed else lv["request_rate"] for lv in levels]
    x_title = "concurrency (streams)" if closed else "request rate (requests/s)"
    log_x = min(xs) > 0 and max(xs) / min(xs) >= 8
    theme = pio.templates["plotly_white"].to_plotly_json()

    def figure(title_text: str, traces: list[dict], **layout) -> dict:
        return {"data": traces, "layout": _layout(title_text, xs, x_title, log_x, theme, **layout)}

    def y(path: str) -> list:
        return [_at(lv, path) for lv in levels]

    def axis(title_text: str, **kw) -> dict:
        return dict(title=dict(text=title_text), rangemode="tozero", **kw)

    figs = {f"chart-{key}": figure(f"{name} (ms)", [_line(xs, y(f"{key}.{stat}"), stat) for stat in STATS],
                                   yaxis=axis("ms"))
            for key, name in LATENCIES}
    traces = [_line(xs, y("output_tok_s"), "output tok/s"),
              _line(xs, y("request_s"), "requests/s", yaxis="y2", line=dict(dash="dot"))]
    if run.config.slo:
        traces.append(_line(xs, y("goodput.request_s"), "goodput req/s", yaxis="y2", line=dict(dash="dash")))
    figs["chart-throughput"] = figure("Throughput", traces, yaxis=axis("output tok/s"),
                                      yaxis2=axis("requests/s", overlaying="y", side="right"))
    if any(lv.get("server") for lv in levels):
        figs["chart-server"] = figure("The server's view", [
            _line(xs, y("server.requests_running.mean"), "running (mean)"),
            _line(xs, y("server.requests_waiting.mean"), "waiting (mean)"),
            _line(xs, y("server.kv_cache_usage.max"), "KV usage (max)", yaxis="y2", line=dict(dash="dot"))],
            yaxis=axis("requests"), yaxis2=axis("KV cache usage", overlaying="y", side="right", tickformat=".1%"))
    energy = [_line(xs, y(path), name) for name, path in (
        ("local GPU (NVML)", "gpu.j_per_output_token"), ("server's GPU counter", "server.j_per_output_token"),
        ("anatomies (attributed)", "anatomy.j_per_output_token")) if any(v is not None for v in y(path))]
    if energy:
        figs["chart-energy"] = figure("Energy per output token", energy, yaxis=axis("J / token"))
    return figs


def render_html(run: BenchRun) -> str:
    figs = _figures(run)
    return render_page("bench.html", template_dirs=[TEMPLATES], title=f"Bench: {title(run)}", figures=figs,
                       charts=list(figs), run=run, when=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                       version=__version__, rows=table_cells(run), settings=to_json(run)["settings"])


def write_html(run: BenchRun, path: Path) -> None:
    path.write_text(render_html(run), encoding="utf-8")
