"""A sweep's report: every plot's data (DIR/sweep_summary.json), the same as one self-contained HTML page
(DIR/sweep.html, plotly inlined once, offline) and as tables in the terminal."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import plotly.graph_objects as go
from rich.console import Console
from rich.table import Table

from ..models.config import ModelConfig, parse_dtype
from ..report.page import render_page
from .grid import Precision
from .planner import (Efficiencies, Hardware, Setup, default_efficiencies, fit_efficiencies, predict_point,
                      relative_error, roofline_ridge_batch)

SUMMARY_FILE = "sweep_summary.json"
HTML_FILE = "sweep.html"
TEMPLATES = Path(__file__).parent / "templates"  # sweep.html, package data; it extends report's base.html
# A decode step "leaves the memory floor" when it takes this much longer than its bytes at the smallest batch's
# bandwidth: 2^(1/3) - 1, where a step sits at the planner's smoothed roofline's ridge (compute time = memory time).
RIDGE_EXCESS = 2 ** (1 / 3) - 1
METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("output_tokens_per_s", "output tok/s"))


def _precision(r: dict) -> Precision:
    return Precision(r.get("quantization"), r.get("kv_cache_dtype", "auto"))


def _ok(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("status") == "ok"]


def _labels(records: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["precision"] for r in records))


def _finite(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


# ---------------------------------------------------------------------------------------------------------------
# This machine, as the planner sees it
# ---------------------------------------------------------------------------------------------------------------


def sweep_hardware(meta: dict) -> Hardware | None:
    """The rates this sweep's efficiencies are fractions of: its GPU's datasheet, else its measured ceilings."""
    from ..gpus import gpus

    gpu = gpus().get(meta.get("gpu") or "")
    if gpu is not None:
        return Hardware.of(gpu)
    c = meta.get("ceilings") or {}
    if c.get("read_gbps") and c.get("matmul_tflops"):
        return Hardware(c["device"], c["read_gbps"], c["matmul_tflops"], c["matmul_tflops"],
                        f"this device's measured ceilings ({c['device']})")
    return None


def sweep_prior(meta: dict, hw: Hardware) -> Efficiencies:
    from ..anatomy import Ceilings

    if hw.basis.startswith("this device's measured"):  # efficiencies are then fractions of the ceilings themselves
        return default_efficiencies(None, ceiling_fractions={"read": 1.0, "matmul": 1.0})
    return default_efficiencies(Ceilings(**meta["ceilings"]) if meta.get("ceilings") else None)


def _setup(meta: dict, precision: Precision, hw: Hardware, eff: Efficiencies) -> Setup | None:
    engine = meta.get("engines", {}).get(precision.key)
    if engine is None:
        return None
    config = ModelConfig.from_hf(meta["config"])
    return Setup(config, parse_dtype(meta["identity"]["dtype"]), precision, hw, eff,
                 engine["max_num_batched_tokens"], engine["max_num_seqs"])


def leave_one_out(meta: dict, records: list[dict]) -> dict:
    """Each measured point predicted from the others of its precision (efficiencies refitted without it):
    relative errors for TTFT, TPOT and output throughput."""
    hw = sweep_hardware(meta)
    if hw is None:
        return {"available": False, "note": "no datasheet or calibrated ceilings for this device: nothing to scale "
                                            "(run `llm-anatomy calibrate`)", "rows": [], "summary": {}}
    prior, rows = sweep_prior(meta, hw), []
    for label in _labels(_ok(records)):
        mine = [r for r in _ok(records) if r["precision"] == label]
        if len(mine) < 2:
            continue
        precision = _precision(mine[0])
        everything = fit_efficiencies(mine, hw, precision.quantization, prior)
        for r in mine:
            others = [x for x in mine if x is not r]
            setup = _setup(meta, precision, hw, fit_efficiencies(others, hw, precision.quantization, prior,
                                                                 start=everything))
            if setup is None:
                continue
            predicted = predict_point(setup, r["batch"], r["prompt_tokens"], r["output_tokens"])
            rows.append({"key": r["key"], "precision": label, "prompt_tokens": r["prompt_tokens"],
                         "batch": r["batch"], "output_tokens": r["output_tokens"],
                         **{f"{m}_measured": r.get(m) for m, _ in METRICS},
                         **{f"{m}_predicted": predicted[m] for m, _ in METRICS},
                         **{f"{m}_error": relative_error(predicted[m], r.get(m)) for m, _ in METRICS}})
    summary = {}
    for m, name in METRICS:
        errors = [abs(x[f"{m}_error"]) for x in rows if x[f"{m}_error"] is not None]
        if errors:
            summary[m] = {"name": name, "points": len(errors), "median_abs_error": statistics.median(errors),
                          "max_abs_error": max(errors), "within_10pct": sum(e <= 0.10 for e in errors)}
    return {"available": bool(rows), "basis": hw.basis, "rows": rows, "summary": summary,
            "note": "" if rows else "fewer than two measured points of a precision: nothing to leave out"}


# ---------------------------------------------------------------------------------------------------------------
# Ridges and capacity
# ---------------------------------------------------------------------------------------------------------------


def measured_ridge(series: list[dict]) -> float | None:
    """The batch at which the decode step (device time) first exceeds its memory floor by RIDGE_EXCESS, the floor
    being its bytes at the smallest batch's bandwidth; interpolated on log(batch). None: it never does."""
    base = series[0]
    bandwidth = base["decode_bytes_per_step"] / base["decode_step_ms"]
    previous = None
    for r in series:
        excess = r["decode_step_ms"] / (r["decode_bytes_per_step"] / bandwidth) - 1
        if excess >= RIDGE_EXCESS:
            if previous is None:
                return float(r["batch"])
            (b0, e0), b1 = previous, r["batch"]
            f = (RIDGE_EXCESS - e0) / (excess - e0) if excess > e0 else 1.0
            return math.exp(math.log(b0) + f * (math.log(b1) - math.log(b0)))
        previous = (r["batch"], excess)
    return None


def roofline_rates(meta: dict, precision: Precision) -> tuple[float, float, str] | None:
    """(GB/s, TFLOP/s of the linear layers, which) the anatomy's roofline uses: measured ceilings, else the
    datasheet's; fp8 at the datasheet's fp8 rate scaled as the measured bf16 rate is."""
    from ..gpus import gpus

    c = meta.get("ceilings") or {}
    gbps = c.get("read_gbps") or c.get("datasheet_gbps")
    tflops = c.get("matmul_tflops") or c.get("datasheet_tflops")
    if not gbps or not tflops:
        return None
    which = "measured ceilings" if c.get("read_gbps") and c.get("matmul_tflops") else "datasheet"
    if precision.quantization == "fp8":
        gpu = gpus().get(meta.get("gpu") or "")
        if gpu is None or gpu.fp8_tflops is None or not c.get("datasheet_tflops"):
            return None
        tflops = gpu.fp8_tflops * tflops / c["datasheet_tflops"]
    return gbps, tflops, which


def ridges(meta: dict, records: list[dict]) -> list[dict]:
    """Per precision, prompt and output length with two batches or more: the measured and predicted ridges."""
    out = []
    config = ModelConfig.from_hf(meta["config"])
    dtype = parse_dtype(meta["identity"]["dtype"])
    ok = [r for r in _ok(records) if r.get("decode_step_ms")]
    groups = sorted({(r["precision"], r["prompt_tokens"], r["output_tokens"]) for r in ok})
    for label, prompt, output in groups:
        series = sorted((r for r in ok if (r["precision"], r["prompt_tokens"], r["output_tokens"])
                         == (label, prompt, output)), key=lambda r: r["batch"])
        if len(series) < 2:
            continue
        precision = _precision(series[0])
        rates = roofline_rates(meta, precision)
        predicted = (roofline_ridge_batch(config, dtype, precision, prompt + output / 2, rates[0], rates[1])
                     if rates else None)
        out.append({"precision": label, "prompt_tokens": prompt, "output_tokens": output,
                    "batches": [r["batch"] for r in series], "measured_batch": measured_ridge(series),
                    "predicted_batch": predicted, "predicted_basis": rates[2] if rates else "no ceilings"})
    return out


def capacity_curves(meta: dict) -> list[dict]:
    """Concurrent sequences each engine's KV pool holds at each context limit (its blocks, whole per sequence)."""
    config = ModelConfig.from_hf(meta["config"])
    top = config.max_position_embeddings
    limits = sorted({min(top, 16 << i) for i in range(24) if (16 << i) < top * 2})
    curves = []
    for engine in meta.get("engines", {}).values():
        per_block = engine["kv_bytes_per_token"] * engine["block_size"]
        blocks = engine["kv_pool_bytes"] // per_block
        curves.append({"precision": engine["label"], "context": limits,
                       "sequences": [int(blocks // -(-n // engine["block_size"])) for n in limits],
                       "pool_bytes": engine["kv_pool_bytes"], "kv_bytes_per_token": engine["kv_bytes_per_token"]})
    return curves


# ---------------------------------------------------------------------------------------------------------------
# Plot data and the summary
# ---------------------------------------------------------------------------------------------------------------


def _series(name, xs, ys, axis="y", dash=None) -> dict:
    pairs = [(x, _finite(y)) for x, y in zip(xs, ys) if _finite(y) is not None]
    return {"name": name, "x": [p[0] for p in pairs], "y": [p[1] for p in pairs], "axis": axis, "dash": dash}


def _batch_series(mine: list[dict]):
    """Series over the batch size: one per prompt length (and output length, when the sweep has several)."""
    several = len({r["output_tokens"] for r in mine}) > 1
    for prompt, output in sorted({(r["prompt_tokens"], r["output_tokens"]) for r in mine}):
        name = f"prompt {prompt}" + (f", output {output}" if several else "")
        yield name, sorted((r for r in mine if (r["prompt_tokens"], r["output_tokens"]) == (prompt, output)),
                           key=lambda r: r["batch"])


def _ridge_lines(ridge_rows: list[dict]) -> list[dict]:
    """Vertical lines at each precision's ridges, for its shortest prompt and output."""
    lines = []
    for row in ridge_rows:
        mine = [x for x in ridge_rows if x["precision"] == row["precision"]]
        if (row["prompt_tokens"], row["output_tokens"]) != min((x["prompt_tokens"], x["output_tokens"]) for x in mine):
            continue
        for which in ("measured", "predicted"):
            if row[f"{which}_batch"] is not None:
                lines.append({"x": row[f"{which}_batch"], "dash": "solid" if which == "measured" else "dash",
                              "name": f"{row['precision']}, prompt {row['prompt_tokens']}: {which} ridge "
                                      f"{row[f'{which}_batch']:.0f}"})
    return lines


def plot_data(meta: dict, records: list[dict], ridge_rows: list[dict], loo: dict) -> dict:
    ok = _ok(records)
    plots = {}
    smallest = min((r["batch"] for r in ok), default=1)
    shortest = min((r["output_tokens"] for r in ok), default=1)
    prefill, decode, batch, energy = [], [], [], []
    for label in _labels(ok):
        mine = [r for r in ok if r["precision"] == label]
        base = sorted((r for r in mine if r["batch"] == smallest and r["output_tokens"] == shortest),
                      key=lambda r: r["prompt_tokens"])
        xs = [r["prompt_tokens"] for r in base]
        prefill += [_series(f"{label}: prefill ms", xs, [r["prefill_ms"] for r in base]),
                    _series(f"{label}: MFU", xs, [r["prefill_mfu"] for r in base], "y2", "dot")]
        base = sorted((r for r in mine if r["batch"] == smallest and r.get("tpot_ms")),
                      key=lambda r: r["decode_context_mean"])
        xs = [r["decode_context_mean"] for r in base]
        decode += [_series(f"{label}: TPOT ms", xs, [r["tpot_ms"] for r in base]),
                   _series(f"{label}: MBU", xs, [r.get("decode_mbu") for r in base], "y2", "dot"),
                   _series(f"{label}: KV share of bytes", xs, [r.get("decode_kv_share") for r in base], "y2", "dash")]
        for name, s in _batch_series(mine):
            xs = [r["batch"] for r in s]
            batch += [_series(f"{label}, {name}: output tok/s", xs, [r["output_tokens_per_s"] for r in s]),
                      _series(f"{label}, {name}: TPOT ms", xs, [r.get("tpot_ms") for r in s], "y2", "dot")]
            energy += [_series(f"{label}, {name}: J per output token", xs, [r.get("decode_j_per_token") for r in s]),
                       _series(f"{label}, {name}: J per prompt token", xs, [r.get("prefill_j_per_token") for r in s],
                               "y", "dot")]
    lines = _ridge_lines(ridge_rows)
    plots["prefill"] = {"title": f"Prefill time and MFU against prompt length (batch {smallest})",
                        "x": "prompt tokens", "y": "prefill ms (device)", "y2": "MFU", "log_x": True, "series": prefill}
    plots["decode"] = {"title": f"TPOT and MBU against context (batch {smallest}), with the KV reads' share of bytes",
                       "x": "mean context during decode (tokens)", "y": "TPOT ms", "y2": "fraction", "log_x": True,
                       "series": decode}
    plots["batch"] = {"title": "Throughput and TPOT against batch size, with the measured and the roofline's ridges",
                      "x": "batch (sequences decoded together)", "y": "output tok/s", "y2": "TPOT ms", "log_x": True,
                      "series": batch, "lines": lines}
    plots["energy"] = {"title": "Energy per token against batch size (steady state)", "x": "batch", "y": "J per token",
                       "log_x": True, "series": energy}
    plots["capacity"] = {"title": "KV capacity: concurrent sequences against the context limit", "x": "context limit",
                         "y": "sequences", "log_x": True, "log_y": True,
                         "series": [_series(c["precision"], c["context"], c["sequences"])
                                    for c in capacity_curves(meta)]}
    rows = loo.get("rows", [])
    plots["validation"] = {"title": "Leave-one-out: each point predicted from the others", "x": "point", "y": "error %",
                           "series": [_series(name, [x["key"] for x in rows],
                                              [None if x[f"{m}_error"] is None else 100 * x[f"{m}_error"] for x in rows])
                                      for m, name in METRICS]}
    return plots


def summarize(meta: dict, records: list[dict]) -> dict:
    """Everything the report shows, in one JSON-able object."""
    loo = leave_one_out(meta, records)
    ridge_rows = ridges(meta, records)
    return {"meta": meta, "records": records, "ridges": ridge_rows, "leave_one_out": loo,
            "capacity": capacity_curves(meta), "plots": plot_data(meta, records, ridge_rows, loo),
            "definitions": DEFINITIONS}


DEFINITIONS = {
    "point": "B sequences of the same prompt length queued together, each generating the output length (greedy, "
             "EOS ignored), after a warm-up run of the same shapes",
    "ttft_ms": "time to first token, median over the point's sequences, from the moment they are queued",
    "tpot_ms": "time per output token, (last token - first token) / (output tokens - 1) per sequence (vLLM), median",
    "prefill_ms": "device time of the prefill steps (CUDA events), with MFU = their FLOPs / time / the measured "
                  "matmul ceiling",
    "decode_mbu": "bytes the decode steps move (cost model) / their device time / the measured read bandwidth",
    "decode_kv_share": "KV-cache reads as a fraction of the decode steps' bytes",
    "output_tokens_per_s": "B x output tokens / the point's elapsed time (queued to last token); total adds prompts",
    "energy": "NVML's energy counter between its updates inside the phase; a phase shorter than --energy-seconds "
              "is repeated back to back (a prefill) or extended (a decode block) until it lasts that long",
    "ridge": f"measured: the batch where the decode step's device time first exceeds its memory floor (its bytes at "
             f"the smallest batch's bandwidth) by {RIDGE_EXCESS:.0%}; predicted: the batch where the roofline's "
             f"compute time equals its memory time at the ceilings",
    "capacity": "sequences whose KV blocks fit the engine's pool at once, at each context limit",
}


# ---------------------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------------------


def _figure(plot: dict) -> go.Figure:
    fig = go.Figure()
    for s in plot["series"]:
        fig.add_trace(go.Scatter(x=s["x"], y=s["y"], name=s["name"], mode="lines+markers",
                                 yaxis="y2" if s["axis"] == "y2" else "y",
                                 line=dict(dash=s["dash"]) if s["dash"] else None))
    for line in plot.get("lines", []):
        fig.add_vline(x=line["x"], line_dash=line["dash"], line_color="#555")
        # an annotation on a log axis is placed by log10 of its value (a line by the value itself): given to
        # add_vline, the label sat at 10^66 and the axis stretched to show it
        fig.add_annotation(x=math.log10(line["x"]) if plot.get("log_x") else line["x"], y=1, yref="paper",
                           text=line["name"], showarrow=False, xanchor="right", yanchor="top", textangle=-90)
    layout = dict(title=dict(text=plot["title"], x=0.01, font=dict(size=15)), template="plotly_white", height=420,
                  margin=dict(l=70, r=70, t=50, b=50), xaxis=dict(title=plot["x"], type="log" if plot.get("log_x")
                                                                 else "-"),
                  yaxis=dict(title=plot["y"], type="log" if plot.get("log_y") else "-"),
                  legend=dict(orientation="h", y=-0.2))
    if plot.get("y2"):
        layout["yaxis2"] = dict(title=plot["y2"], overlaying="y", side="right", rangemode="tozero")
    fig.update_layout(**layout)
    return fig


def _fmt(x, digits=3, pct=False) -> str:
    """A number with `digits` significant digits (thousands separated), or a percentage; "" for none."""
    v = _finite(x)
    if v is None:
        return ""
    if pct:
        return f"{v:.0%}" if abs(v) >= 0.1 else f"{v:.1%}" if abs(v) >= 0.01 else f"{v * 100:.2g}%"
    return f"{v:,.{digits}g}" if abs(v) < 10 ** digits else f"{v:,.0f}"


def _bytes(x) -> str:
    v = _finite(x)
    if v is None:
        return ""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v:.0f} B"


def point_rows(records: list[dict]) -> list[dict]:
    rows = []
    for r in sorted(records, key=lambda r: (r["precision"], r["output_tokens"], r["prompt_tokens"], r["batch"])):
        rows.append({"precision": r["precision"], "prompt": r["prompt_tokens"], "batch": r["batch"],
                     "output": r["output_tokens"], "status": r["status"], "reason": r.get("reason") or "",
                     "ttft": _fmt(r.get("ttft_ms")), "tflops": _fmt(r.get("prefill_tflops")),
                     "mfu": _fmt(r.get("prefill_mfu"), pct=True), "tpot": _fmt(r.get("tpot_ms")),
                     "mbu": _fmt(r.get("decode_mbu"), pct=True), "kv_share": _fmt(r.get("decode_kv_share"), pct=True),
                     "out_tps": _fmt(r.get("output_tokens_per_s")), "total_tps": _fmt(r.get("total_tokens_per_s")),
                     "j_prefill": _fmt(r.get("prefill_j_per_token")), "j_decode": _fmt(r.get("decode_j_per_token")),
                     "kv": _bytes(r.get("kv_bytes")), "peak": _bytes(r.get("peak_memory_bytes")),
                     "anatomy": r.get("anatomy") or ""})
    return rows


POINT_COLUMNS = (("precision", "precision"), ("prompt", "prompt"), ("batch", "batch"), ("output", "output"),
                 ("status", "status"), ("ttft", "TTFT ms"), ("tflops", "prefill TFLOP/s"), ("mfu", "MFU"),
                 ("tpot", "TPOT ms"), ("mbu", "MBU"), ("kv_share", "KV share"), ("out_tps", "out tok/s"),
                 ("total_tps", "total tok/s"), ("j_prefill", "J/prompt tok"), ("j_decode", "J/output tok"),
                 ("kv", "KV bytes"), ("peak", "peak memory"))
# The terminal splits the columns in two tables (each point's key columns in both), so that each fits a terminal.
TERMINAL_TABLES = (("Latency and throughput", ("status", "ttft", "tpot", "out_tps", "total_tps", "kv", "peak")),
                   ("Rooflines and energy", ("tflops", "mfu", "mbu", "kv_share", "j_prefill", "j_decode")))


def _predicted_ridge(r: dict) -> str:
    if r["predicted_batch"] is not None:
        return _fmt(r["predicted_batch"])
    return "n/a" if r["predicted_basis"] == "no ceilings" else "never"


def render_html(summary: dict) -> str:
    meta = summary["meta"]
    ident = meta["identity"]
    # a plot whose series are all empty (no leave-one-out rows yet, every point out of memory) gets a note, not axes
    drawn = {name: plot for name, plot in summary["plots"].items() if any(s["x"] for s in plot["series"])}
    figures = {f"chart-{name}": _figure(plot) for name, plot in drawn.items()}
    loo = summary["leave_one_out"]
    return render_page(
        "sweep.html", template_dirs=[TEMPLATES], title=f"Sweep: {ident['model']} on {ident['device']}",
        figures=figures, figure_ids=list(figures), meta=meta, ident=ident,
        empty_plots=[plot for name, plot in summary["plots"].items() if name not in drawn],
        engines=list(meta.get("engines", {}).values()),
        synthetic=any(e.get("weights_kind") == "synthetic" for e in meta.get("engines", {}).values()),
        columns=POINT_COLUMNS, rows=point_rows(summary["records"]),
        ridges=[{**r, "measured": _fmt(r["measured_batch"]) or "not reached",
                 "predicted": _predicted_ridge(r)} for r in summary["ridges"]],
        loo=loo, loo_rows=[{**x, **{f"{m}_e": _fmt(x[f"{m}_error"], pct=True) for m, _ in METRICS},
                           **{f"{m}_m": _fmt(x[f"{m}_measured"]) for m, _ in METRICS},
                           **{f"{m}_p": _fmt(x[f"{m}_predicted"]) for m, _ in METRICS}} for x in loo["rows"]],
        loo_summary=[{**v, "median": _fmt(v["median_abs_error"], pct=True), "max": _fmt(v["max_abs_error"], pct=True)}
                     for v in loo["summary"].values()],
        definitions=sorted(summary["definitions"].items()))


def print_tables(summary: dict, console: Console) -> None:
    meta = summary["meta"]
    ident = meta["identity"]
    console.rule(f"[bold]llm-anatomy sweep[/bold] · {ident['model']} on {ident['device']}")
    titles = dict(POINT_COLUMNS)
    rows = point_rows(summary["records"])
    for title, keys in TERMINAL_TABLES:
        keys = ("precision", "prompt", "batch", "output") + keys
        table = Table(title=title)
        for key in keys:
            table.add_column(titles[key], justify="left" if key in ("precision", "status") else "right")
        for row in rows:
            table.add_row(*[str(row[key]) for key in keys])
        console.print(table)
    for row in rows:
        if row["status"] != "ok":
            console.print(f"  {row['precision']}, prompt {row['prompt']}, batch {row['batch']}: {row['status']}: "
                          f"{row['reason']}")
    if summary["ridges"]:
        t = Table(title=f"Ridge (decode): measured where the step leaves its memory floor by {RIDGE_EXCESS:.0%}, "
                        f"predicted by the roofline")
        for c in ("precision", "prompt", "output", "batches", "measured ridge", "predicted ridge", "roofline from"):
            t.add_column(c)
        for r in summary["ridges"]:
            t.add_row(r["precision"], str(r["prompt_tokens"]), str(r["output_tokens"]),
                      f"{min(r['batches'])}..{max(r['batches'])}", _fmt(r["measured_batch"]) or "not reached",
                      _predicted_ridge(r), r["predicted_basis"])
        console.print(t)
    if summary["capacity"]:
        t = Table(title="KV capacity: concurrent sequences at each context limit (this engine's pool)")
        t.add_column("context limit")
        for c in summary["capacity"]:
            t.add_column(c["precision"], justify="right")
        for i, n in enumerate(summary["capacity"][0]["context"]):
            t.add_row(str(n), *[f"{c['sequences'][i]:,}" for c in summary["capacity"]])
        console.print(t)
    loo = summary["leave_one_out"]
    if loo["summary"]:
        t = Table(title=f"Leave-one-out: each point predicted from the others (efficiencies relative to {loo['basis']})")
        for c in ("metric", "points", "median |error|", "max |error|", "within 10%"):
            t.add_column(c)
        for v in loo["summary"].values():
            t.add_row(v["name"], str(v["points"]), _fmt(v["median_abs_error"], pct=True),
                      _fmt(v["max_abs_error"], pct=True), f"{v['within_10pct']}/{v['points']}")
        console.print(t)
    elif loo.get("note"):
        console.print(f"Leave-one-out: {loo['note']}")


def write_report(out_dir: Path, meta: dict, records: list[dict], console: Console | None = None) -> dict:
    """DIR/sweep_summary.json and DIR/sweep.html, and the tables on `console` (none when None)."""
    summary = summarize(meta, records)
    out_dir = Path(out_dir)
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1, allow_nan=False))
    (out_dir / HTML_FILE).write_text(render_html(summary), encoding="utf-8")
    if console is not None:
        print_tables(summary, console)
    return summary
