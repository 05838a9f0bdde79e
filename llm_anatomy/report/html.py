"""One self-contained HTML page for one call's Anatomy: headline numbers, charts and tables.

The page works offline: plotly.js is inlined from the installed plotly package, nothing is fetched (a
Content-Security-Policy forbids it), and every chart is a plotly figure serialised to JSON inside the page.
All text that comes from the call (prompt, output, token texts, model name, notes) is HTML-escaped by jinja2's
autoescape; the figure JSON has `<`, `>`, `&` (and U+2028/9) written as \\uXXXX so it cannot close its <script>.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jinja2
import plotly.graph_objects as go
from markupsafe import Markup
from plotly.offline import get_plotlyjs

from llm_anatomy.report import finite, startup_text
from llm_anatomy.anatomy import Anatomy, GpuSample
from llm_anatomy.probe.memory import census_rows

STEP_ROWS = 20  # the per-step table shows the first and last STEP_ROWS steps when there are more than 2x that

PHASE_COLORS = {
    "parse": "#9e9e9e", "template": "#8d6e63", "tokenize": "#ab47bc", "queue": "#ffb300",
    "prefill": "#e53935", "decode": "#1e88e5", "detokenize": "#43a047", "e2e": "#546e7a",
}
CENSUS_COLORS = {  # by the labels of probe.memory.census_rows (GPU and host)
    "weights": "#5e35b1", "KV pool": "#1e88e5", "CUDA graphs": "#00897b", "other tensors": "#fb8c00",
    "allocator reserved, free": "#fdd835", "CUDA context and others": "#8d6e63", "free": "#cfd8dc",
    "rest of this process": "#fb8c00", "other processes, the OS and its caches": "#8d6e63", "available": "#cfd8dc",
}
CHART_CONFIG = {"displaylogo": False, "responsive": True}


# ----------------------------------------------------------------------------- formatting helpers

_f = finite


def _ms(x: Any) -> str:
    v = _f(x)
    if v is None:
        return "n/a"
    if abs(v) >= 1000:
        return f"{v / 1000:.3g} s" if abs(v) < 10000 else f"{v / 1000:.1f} s"
    return f"{v:.3g} ms" if abs(v) < 100 else f"{v:.1f} ms"


def _bytes(x: Any) -> str:
    v = _f(x)
    if v is None:
        return "n/a"
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(v) >= size:
            return f"{v / size:.2f} {unit}"
    return f"{v:.0f} B"


def _pct(x: Any) -> str:
    v = _f(x)
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _num(x: Any, digits: int = 3) -> str:
    v = _f(x)
    if v is None:
        return "n/a"
    if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
        return f"{v:.{digits}g}"
    return f"{v:,.{digits}g}" if abs(v) < 1000 else f"{v:,.0f}"


def _int(x: Any) -> str:
    v = _f(x)
    return "n/a" if v is None else f"{int(v):,}"


def _fixed(x: Any, digits: int = 3) -> str:
    v = _f(x)
    return "n/a" if v is None else f"{v:.{digits}f}"


def _scaled(x: Any, scale: float) -> str:
    v = _f(x)
    return _num(None if v is None else v / scale)


def plotly_js() -> str:
    """The installed plotly.js bundle, made safe to inline in a <script> element."""
    return get_plotlyjs().replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT")


def _plot_text(s: Any) -> str:
    """User text placed in a plotly label, which reads a few tags (<br>, <a href>...) and the entities &amp; &lt;
    &gt;: escape those three so the text shows as it is (plotly does not know &quot;, so quotes stay)."""
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _token_repr(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def script_json(obj: Any) -> str:
    """JSON that is safe inside an HTML <script> element (no `</script>`, `<!--`, or line separators)."""
    text = json.dumps(obj, allow_nan=False, separators=(",", ":"))
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _base_layout(title: str, **kw: Any) -> dict:
    layout = dict(title=dict(text=title, x=0.01, font=dict(size=15)), template="plotly_white", height=340,
                  margin=dict(l=70, r=30, t=50, b=50), hovermode="closest")
    layout.update(kw)
    return layout


# ----------------------------------------------------------------------------- charts

def _timeline_figure(a: Anatomy) -> go.Figure | None:
    phases = [p for p in a.phases if _f(p.start_ms) is not None and _f(p.end_ms) is not None]
    if not phases:
        return None
    fig = go.Figure()
    rows = []
    for p in phases:
        if p.name not in rows:
            rows.append(p.name)
    gpu_row = "GPU (forward)"
    fig.add_trace(go.Bar(
        orientation="h", y=[p.name for p in phases], base=[_f(p.start_ms) for p in phases],
        x=[max(0.0, _f(p.end_ms) - _f(p.start_ms)) for p in phases],
        marker=dict(color=[PHASE_COLORS.get(p.name, "#78909c") for p in phases]),
        customdata=[[_f(p.start_ms), _f(p.end_ms), _plot_text(p.note or "")] for p in phases],
        hovertemplate="<b>%{y}</b><br>%{customdata[0]:.3f} → %{customdata[1]:.3f} ms<br>"
                      "duration %{x:.3f} ms<br>%{customdata[2]}<extra></extra>",
        name="host phases",
    ))
    spans = []
    pf = a.prefill
    if _f(pf.start_ms) is not None and _f(pf.ms) is not None:
        spans.append(("prefill", _f(pf.start_ms), _f(pf.ms), f"{pf.tokens} tokens", PHASE_COLORS["prefill"]))
    for s in a.decode_steps:
        if _f(s.start_ms) is not None and _f(s.gpu_ms) is not None:
            spans.append((f"step {s.index}", _f(s.start_ms), _f(s.gpu_ms),
                          f"context {s.context_len}, token {_plot_text(_token_repr(s.token_text))}",
                          PHASE_COLORS["decode"]))
    if spans:
        fig.add_trace(go.Bar(
            orientation="h", y=[gpu_row] * len(spans), base=[s[1] for s in spans], x=[max(0.0, s[2]) for s in spans],
            marker=dict(color=[s[4] for s in spans], line=dict(color="white", width=0.5)),
            customdata=[[s[0], s[3]] for s in spans],
            hovertemplate="<b>%{customdata[0]}</b> (GPU)<br>start %{base:.3f} ms, %{x:.3f} ms<br>"
                          "%{customdata[1]}<extra></extra>",
            name="GPU spans",
        ))
        rows.append(gpu_row)
    height = max(260, 38 * len(rows) + 110)
    fig.update_layout(**_base_layout("Phases of the call (ms since the call began)", height=height,
                                     barmode="overlay", showlegend=False),
                      xaxis=dict(title="ms", rangemode="tozero"),
                      yaxis=dict(categoryorder="array", categoryarray=list(reversed(rows)), automargin=True))
    ttft = _f(a.ttft_ms)
    if ttft is not None:
        fig.add_vline(x=ttft, line=dict(color="#e53935", dash="dot", width=1),
                      annotation_text="first token", annotation_position="top")
    return fig


def _steps_figure(a: Anatomy) -> go.Figure | None:
    steps = a.decode_steps
    if not steps:
        return None
    x = [s.context_len for s in steps]
    custom = [[s.index, _plot_text(_token_repr(s.token_text)), s.batch_size] for s in steps]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=[_f(s.gpu_ms) for s in steps], mode="lines+markers", name="GPU ms (forward)",
                             customdata=custom, line=dict(color="#1e88e5"),
                             hovertemplate="step %{customdata[0]}: %{y:.3f} ms GPU<br>context %{x}, batch "
                                           "%{customdata[2]}<br>token %{customdata[1]}<extra></extra>"))
    itl = list(a.itl_ms)[:len(steps)]  # itl_ms[i] is the wait for decode step i + 1's token
    fig.add_trace(go.Scatter(x=x[:len(itl)], y=[_f(v) for v in itl], mode="lines+markers",
                             name="inter-token latency", customdata=custom, line=dict(color="#fb8c00"),
                             hovertemplate="step %{customdata[0]}: %{y:.3f} ms since the previous token<br>"
                                           "context %{x}<br>token %{customdata[1]}<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=[_f(s.host_ms) for s in steps], mode="lines", name="host work",
                             customdata=custom, line=dict(color="#8e24aa", dash="dot"),
                             hovertemplate="step %{customdata[0]}: %{y:.3f} ms of host work<br>context %{x}"
                                           "<extra></extra>"))
    fig.update_layout(**_base_layout("Decode step latency against context length"),
                      xaxis=dict(title="context length (tokens attended to)"),
                      yaxis=dict(title="ms per step", rangemode="tozero"))
    return fig


def _roofline_figure(a: Anatomy) -> go.Figure | None:
    c = a.ceilings
    points = []  # (label, AI, TFLOP/s, hover)
    rl = a.prefill.roofline
    if _f(rl.arithmetic_intensity) and _f(rl.achieved_tflops):
        points.append(("prefill", rl.arithmetic_intensity, rl.achieved_tflops))
    step_pts = []
    for s in a.decode_steps:
        if _f(s.flops) and _f(s.bytes) and _f(s.gpu_ms) and s.gpu_ms > 0:
            step_pts.append((s, s.flops / s.bytes, s.flops / s.gpu_ms / 1e9))
    ceilings = []  # (name, tflops, gbps, dash, color)
    if _f(c.matmul_tflops) or _f(c.read_gbps):
        ceilings.append(("measured", _f(c.matmul_tflops), _f(c.read_gbps), "solid", "#263238"))
    if _f(c.gemv_gbps):
        ceilings.append(("measured GEMV", _f(c.matmul_tflops), _f(c.gemv_gbps), "dashdot", "#607d8b"))
    if _f(c.datasheet_tflops) or _f(c.datasheet_gbps):
        ceilings.append(("datasheet", _f(c.datasheet_tflops), _f(c.datasheet_gbps), "dot", "#9e9e9e"))
    if not points and not step_pts:
        return None
    ais = [p[1] for p in points] + [p[1] for p in step_pts]
    ridges = [t * 1e3 / g for _, t, g, _, _ in ceilings if t and g]
    lo = min(ais + ridges) / 4
    hi = max(ais + ridges) * 8
    fig = go.Figure()
    for name, tflops, gbps, dash, color in ceilings:
        ridge = tflops * 1e3 / gbps if tflops and gbps else None
        xs = [lo] + ([ridge] if ridge is not None and lo < ridge < hi else []) + [hi]
        ys = []
        for xv in xs:
            cands = [v for v in (tflops, xv * gbps / 1e3 if gbps else None) if v]
            ys.append(min(cands))
        label = name + ": " + ", ".join(x for x in (f"{_num(tflops)} TFLOP/s" if tflops else "",
                                                    f"{_num(gbps)} GB/s" if gbps else "") if x)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=label, line=dict(color=color, dash=dash, width=2),
                                 hovertemplate=f"{_plot_text(name)} ceiling<br>%{{x:.3g}} FLOP/B → "
                                               "%{y:.3g} TFLOP/s<extra></extra>"))
    if step_pts:
        fig.add_trace(go.Scatter(
            x=[p[1] for p in step_pts], y=[p[2] for p in step_pts], mode="markers", name="decode steps",
            marker=dict(color="#1e88e5", size=7, opacity=0.75),
            customdata=[[p[0].index, p[0].context_len] for p in step_pts],
            hovertemplate="decode step %{customdata[0]} (context %{customdata[1]})<br>%{x:.3g} FLOP/B, "
                          "%{y:.3g} TFLOP/s<extra></extra>"))
    for name, ai, tf in points:
        fig.add_trace(go.Scatter(x=[ai], y=[tf], mode="markers", name=name,
                                 marker=dict(color=PHASE_COLORS["prefill"], size=13, symbol="diamond"),
                                 hovertemplate=f"{name}<br>%{{x:.3g}} FLOP/B, %{{y:.3g}} TFLOP/s<extra></extra>"))
    fig.update_layout(**_base_layout("Roofline: achieved TFLOP/s against arithmetic intensity", height=420),
                      xaxis=dict(type="log", title="arithmetic intensity (FLOP per byte moved)"),
                      yaxis=dict(type="log", title="achieved TFLOP/s"))
    return fig


def _samples(a: Anatomy) -> list[GpuSample]:
    return list(a.gpu_samples or [])


def _phase_shading(fig: go.Figure, a: Anatomy) -> None:
    for p in a.phases:
        if p.name in ("prefill", "decode") and _f(p.start_ms) is not None and _f(p.end_ms) is not None:
            fig.add_vrect(x0=p.start_ms, x1=p.end_ms, fillcolor=PHASE_COLORS[p.name], opacity=0.08, line_width=0,
                          annotation_text=p.name, annotation_position="top left")


def _power_figure(a: Anatomy) -> go.Figure | None:
    samples = [s for s in _samples(a) if _f(s.t_ms) is not None]
    if not any(_f(s.power_w) is not None for s in samples):
        return None
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[s.t_ms for s in samples], y=[_f(s.power_w) for s in samples], mode="lines+markers",
                             name="power (W)", line=dict(color="#e53935", shape="hv"),
                             hovertemplate="%{x:.1f} ms: %{y:.0f} W<extra></extra>"))
    if any(_f(s.energy_j) is not None for s in samples):
        fig.add_trace(go.Scatter(x=[s.t_ms for s in samples], y=[_f(s.energy_j) for s in samples],
                                 mode="lines", name="energy since start (J)", yaxis="y2",
                                 line=dict(color="#6d4c41", dash="dot"),
                                 hovertemplate="%{x:.1f} ms: %{y:.2f} J<extra></extra>"))
    fig.update_layout(**_base_layout("GPU power and energy"), xaxis=dict(title="ms since the call began"),
                      yaxis=dict(title="W", rangemode="tozero"),
                      yaxis2=dict(title="J", overlaying="y", side="right", rangemode="tozero", showgrid=False))
    _phase_shading(fig, a)
    return fig


def _clocks_figure(a: Anatomy) -> go.Figure | None:
    samples = [s for s in _samples(a) if _f(s.t_ms) is not None]
    has_sm = any(_f(s.sm_clock_mhz) is not None for s in samples)
    has_mem = any(_f(s.mem_clock_mhz) is not None for s in samples)
    if not (has_sm or has_mem):
        return None
    fig = go.Figure()
    if has_sm:
        fig.add_trace(go.Scatter(x=[s.t_ms for s in samples], y=[_f(s.sm_clock_mhz) for s in samples],
                                 mode="lines+markers", name="SM clock (MHz)", line=dict(color="#3949ab", shape="hv"),
                                 hovertemplate="%{x:.1f} ms: SM %{y:.0f} MHz<extra></extra>"))
    if has_mem:
        fig.add_trace(go.Scatter(x=[s.t_ms for s in samples], y=[_f(s.mem_clock_mhz) for s in samples],
                                 mode="lines+markers", name="memory clock (MHz)",
                                 line=dict(color="#00897b", shape="hv"),
                                 hovertemplate="%{x:.1f} ms: memory %{y:.0f} MHz<extra></extra>"))
    fig.update_layout(**_base_layout("GPU clocks"), xaxis=dict(title="ms since the call began"),
                      yaxis=dict(title="MHz", rangemode="tozero"))
    _phase_shading(fig, a)
    return fig


def _kv_figure(a: Anatomy) -> go.Figure | None:
    kv = a.kv_cache
    after = [_f(b) for b in kv.bytes_after_step]
    if not any(b is not None for b in after):
        return None
    steps = list(range(len(after)))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=steps, y=[b / 2**20 if b is not None else None for b in after], mode="lines+markers",
                             name="used (tokens × bytes/token)", line=dict(color="#1e88e5"),
                             customdata=[[round(b / kv.bytes_per_token) if b is not None and kv.bytes_per_token
                                          else None] for b in after],
                             hovertemplate="after %{x}: %{y:.2f} MiB, %{customdata[0]} tokens<extra></extra>"))
    if kv.bytes_per_token and kv.block_size:
        block_bytes = kv.block_size * kv.bytes_per_token
        alloc = [math.ceil(b / block_bytes) * block_bytes / 2**20 if b is not None else None for b in after]
        fig.add_trace(go.Scatter(x=steps, y=alloc, mode="lines", name=f"allocated (blocks of {kv.block_size})",
                                 line=dict(color="#fb8c00", shape="hv"),
                                 hovertemplate="after %{x}: %{y:.2f} MiB allocated<extra></extra>"))
    fig.update_layout(**_base_layout("KV cache of this request"),
                      xaxis=dict(title="decode step (0 = after prefill)"),
                      yaxis=dict(title="MiB", rangemode="tozero"))
    return fig


def _census_rows(a: Anatomy) -> list[tuple[str, int]]:
    return census_rows(a.memory)


def _memory_name(a: Anatomy) -> str:
    return "host RAM" if a.memory.kind == "host" else "GPU memory"


def _census_figure(a: Anatomy) -> go.Figure | None:
    rows = [(n, v) for n, v in _census_rows(a) if _f(v) is not None]
    total = _f(a.memory.total)
    if not rows or not total:
        return None
    fig = go.Figure()
    for name, v in rows:
        fig.add_trace(go.Bar(orientation="h", y=[_memory_name(a)], x=[v / 1e9], name=name,
                             marker=dict(color=CENSUS_COLORS.get(name, "#90a4ae")),
                             customdata=[[v / total * 100]],
                             hovertemplate=f"{_plot_text(name)}: %{{x:.2f}} GB (%{{customdata[0]:.1f}}%)"
                                           "<extra></extra>"))
    fig.update_layout(**_base_layout(f"Memory census: {total / 1e9:.2f} GB of {_memory_name(a)}", height=240,
                                     barmode="stack"),
                      xaxis=dict(title="GB", range=[0, max(total, sum(v for _, v in rows)) / 1e9]),
                      yaxis=dict(showticklabels=False))
    return fig


def _kernels_figure(a: Anatomy) -> go.Figure | None:
    kb = [k for k in a.kernels if k.categories]
    if not kb:
        return None
    labels = [f"{k.phase} ({k.steps} step{'s' if k.steps != 1 else ''}, {_ms(k.total_ms)})" for k in kb]
    cats: list[str] = []
    for k in kb:
        for c in k.categories:
            if c.category not in cats:
                cats.append(c.category)
    palette = ["#5e35b1", "#1e88e5", "#00897b", "#fdd835", "#fb8c00", "#e53935", "#8d6e63", "#546e7a", "#d81b60",
               "#43a047"]
    fig = go.Figure()
    for i, cat in enumerate(cats):
        ms, counts, shares = [], [], []
        for k in kb:
            hit = [c for c in k.categories if c.category == cat]
            v = sum(_f(c.ms) or 0.0 for c in hit)
            tot = sum(_f(c.ms) or 0.0 for c in k.categories) or 1.0
            ms.append(v)
            counts.append(sum(c.count for c in hit))
            shares.append(100 * v / tot)
        fig.add_trace(go.Bar(orientation="h", y=labels, x=shares, name=_plot_text(cat),
                             marker=dict(color=palette[i % len(palette)]),
                             customdata=[[m, c] for m, c in zip(ms, counts)],
                             hovertemplate=f"{_plot_text(cat)}: %{{x:.1f}}% of the phase's kernel time, "
                                           "%{customdata[0]:.3f} ms in %{customdata[1]} kernels<extra></extra>"))
    fig.update_layout(**_base_layout("GPU kernel time by category (share of each phase)",
                                     height=max(240, 70 * len(kb) + 150), barmode="stack"),
                      xaxis=dict(title="% of the phase's kernel time", range=[0, 100]),
                      yaxis=dict(automargin=True, autorange="reversed"))
    return fig


# ----------------------------------------------------------------------------- page content

def _headline(a: Anatomy) -> list[dict]:
    d = a.definitions or {}
    cards = [
        dict(label="TTFT", value=_ms(a.ttft_ms), sub=f"{len(a.prompt_token_ids)} prompt tokens",
             title=d.get("ttft_ms", "")),
        dict(label="TPOT", value=_ms(a.tpot_ms), sub=f"{len(a.output_token_ids)} output tokens",
             title=d.get("tpot_ms", "")),
        dict(label="End to end", value=_ms(a.e2e_ms), sub=f"finish: {a.finish_reason}", title=d.get("e2e_ms", "")),
    ]
    rl = a.prefill.roofline
    cards.append(dict(label="Prefill", value=f"{_num(rl.achieved_tflops)} TFLOP/s",
                      sub=f"MFU {_pct(a.prefill.mfu)} (datasheet {_pct(rl.mfu_datasheet)}), {rl.bound.kind}-bound",
                      title=rl.bound.why))
    if a.decode is not None and a.decode.roofline is not None:
        drl = a.decode.roofline
        cards.append(dict(label="Decode", value=f"{_num(drl.achieved_gbps)} GB/s",
                          sub=f"MBU {_pct(drl.mbu)} (datasheet {_pct(drl.mbu_datasheet)}), "
                              f"{_num(a.decode.tokens_per_s)} tok/s",
                          title=drl.bound.why))
    elif a.decode is not None:
        cards.append(dict(label="Decode", value=f"{_num(a.decode.tokens_per_s)} tok/s",
                          sub=f"{a.decode.steps} steps", title=""))
    cards.append(dict(label="KV cache per token", value=_bytes(a.kv_cache.bytes_per_token),
                      sub=f"{_bytes(a.kv_cache.bytes_used)} used by this call", title=a.kv_cache.formula))
    energy = {e.phase: e for e in a.telemetry.energy}
    total = energy.get("call") or energy.get("e2e")
    e_tok = energy.get("decode") or total
    if e_tok is not None and _f(e_tok.per_token_j) is not None:
        cards.append(dict(label="Energy per token", value=f"{_num(e_tok.per_token_j)} J",
                          sub=(f"{e_tok.phase}; whole call {_num(total.joules)} ± {_num(total.uncertainty_j, 2)} J"
                               if total is not None else e_tok.phase),
                          title=e_tok.method))
    return cards


def _step_rows(a: Anatomy) -> tuple[list[dict], list[dict], int]:
    def row(s):
        return dict(index=s.index, start=_fixed(s.start_ms), gpu=_fixed(s.gpu_ms), host=_fixed(s.host_ms),
                    ctx=s.context_len, batch=s.batch_size, token_id=s.token_id, token=_token_repr(s.token_text),
                    gflop=_scaled(s.flops, 1e9), mb=_scaled(s.bytes, 1e6), kv_mb=_scaled(s.kv_bytes_read, 1e6),
                    mbu=_pct(s.mbu), mfu=_pct(s.mfu), bound=s.bound,
                    batch_change=" ".join([f"+{x}" for x in s.joined] + [f"\u2212{x}" for x in s.left]))

    steps = a.decode_steps
    if len(steps) <= 2 * STEP_ROWS:
        return [row(s) for s in steps], [], 0
    return ([row(s) for s in steps[:STEP_ROWS]], [row(s) for s in steps[-STEP_ROWS:]],
            len(steps) - 2 * STEP_ROWS)


def _batching(a: Anatomy) -> dict | None:
    b = getattr(a, "batching", None)
    if b is None:
        return None
    co = sorted(b.co_scheduled.items(), key=lambda kv: -kv[1])
    return dict(queue=_ms(b.queue_ms), max=_int(b.max_batch_size), mean=_num(b.mean_batch_size),
                shared=_int(len(co)), stall_count=_int(len(b.stalls)), stall_ms=_ms(b.stall_ms),
                preemptions=_int(b.preemptions), co=[dict(id=k, steps=_int(v)) for k, v in co[:12]],
                stalls=[dict(start=_fixed(st.start_ms), gpu=_fixed(st.gpu_ms), tokens=_int(st.tokens),
                             requests=", ".join(st.requests[:6]) + (" ..." if len(st.requests) > 6 else ""))
                        for st in b.stalls[:20]])


def _context(a: Anatomy) -> dict:
    figures: dict[str, go.Figure] = {}

    def add(chart_id: str, fig: go.Figure | None) -> bool:
        if fig is not None:
            figures[chart_id] = fig
        return fig is not None

    charts = dict(
        timeline=add("chart-timeline", _timeline_figure(a)),
        steps=add("chart-steps", _steps_figure(a)),
        roofline=add("chart-roofline", _roofline_figure(a)),
        power=add("chart-power", _power_figure(a)) if a.telemetry.available else False,
        clocks=add("chart-clocks", _clocks_figure(a)) if a.telemetry.available else False,
        kv=add("chart-kv", _kv_figure(a)),
        census=add("chart-census", _census_figure(a)),
        kernels=add("chart-kernels", _kernels_figure(a)),
    )
    fig_json = {k: json.loads(f.to_json(validate=False, engine="json")) for k, f in figures.items()}

    m = a.memory
    rows = _census_rows(a)
    total = _f(m.total) or 0
    census_sum = sum(_f(v) or 0 for _, v in rows)
    census = [dict(name=n, bytes=_int(v), human=_bytes(v), share=_pct(_f(v) / total if total and _f(v) else None))
              for n, v in rows]

    when = "unknown date"
    if _f(a.started_at_unix):
        when = datetime.fromtimestamp(a.started_at_unix, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    dev = a.device
    device_line = dev.name + (f" ({dev.type})" if dev.type and dev.type not in dev.name else "")
    software = ", ".join(x for x in (f"torch {dev.torch}" if dev.torch else "", f"CUDA {dev.cuda}" if dev.cuda else "",
                                     f"driver {dev.driver}" if dev.driver else "") if x)
    first, last, omitted = _step_rows(a)
    c = a.ceilings
    kv = a.kv_cache
    return dict(
        a=a, when=when, device_line=device_line, software=software, synthetic=a.weights.kind == "synthetic",
        startup=startup_text(a),
        cards=_headline(a), charts=charts, figures_json=Markup(script_json(fig_json)),
        chart_config=Markup(script_json(CHART_CONFIG)), plotlyjs=Markup(plotly_js()),
        census=census, census_total=_int(total), census_total_h=_bytes(total),
        census_ok=census_sum == total, census_sum=_int(census_sum), parameters=_int(a.model.parameters),
        activation_peak=_bytes(m.activation_peak) if _f(m.activation_peak) is not None else "",
        host_work=[(k.replace("_", " "), _ms(v)) for k, v in (getattr(a, "host_ms", None) or {}).items()],
        steps_first=first, steps_last=last, steps_omitted=omitted,
        prefill=dict(tokens=a.prefill.tokens, ms=_ms(a.prefill.ms), host=_ms(a.prefill.host_ms),
                     gflop=_scaled(a.prefill.flops, 1e9), gb=_scaled(a.prefill.bytes, 1e9),
                     ai=_num(a.prefill.roofline.arithmetic_intensity), mfu=_pct(a.prefill.mfu),
                     mbu=_pct(a.prefill.mbu), bound=a.prefill.roofline.bound),
        decode=a.decode, batching=_batching(a),
        decode_fmt=(dict(gpu=_ms(a.decode.gpu_ms_median), host=_ms(a.decode.host_ms_median),
                         itl=_ms(a.decode.itl_ms_median), itl90=_ms(a.decode.itl_ms_p90),
                         tps=_num(a.decode.tokens_per_s), bytes=_bytes(a.decode.bytes_per_step_median),
                         kv_share=_pct(a.decode.kv_share_of_bytes)) if a.decode is not None else None),
        ceilings=dict(read=_num(c.read_gbps), gemv=_num(c.gemv_gbps), matmul=_num(c.matmul_tflops),
                      ds_gbps=_num(c.datasheet_gbps), ds_tflops=_num(c.datasheet_tflops),
                      ridge=_num(c.ridge) if _f(c.ridge) else "", source=c.datasheet_source,
                      has_ds=bool(_f(c.datasheet_gbps) or _f(c.datasheet_tflops)),
                      has_measured=bool(_f(c.read_gbps) or _f(c.gemv_gbps) or _f(c.matmul_tflops)),
                      measured_at=f"calibrated {c.measured_at}" if c.measured_at else "calibration date unknown"),
        kv=dict(bpt=_int(kv.bytes_per_token), formula=kv.formula, dtype=kv.dtype, block=kv.block_size,
                pool=_bytes(kv.pool_bytes), pool_blocks=_int(kv.pool_blocks),
                pool_share=_pct(kv.pool_share_of_device), tokens=kv.tokens, blocks=kv.blocks_allocated,
                used=_bytes(kv.bytes_used), allocated=_bytes(kv.bytes_allocated),
                fits=_int(kv.fits_sequences_this_length), fits_full=_int(kv.fits_sequences_full_context),
                full=_int(kv.full_context)),
        energy=[dict(phase=e.phase, j=_num(e.joules), u=_num(e.uncertainty_j, 2), per_token=_num(e.per_token_j),
                     method=e.method) for e in a.telemetry.energy],
        kernel_tables=[dict(phase=k.phase, steps=k.steps, total=_ms(k.total_ms),
                            top=[dict(name=str(t.get("name", "?")), ms=_ms(t.get("ms")), count=t.get("count", ""))
                                 for t in k.top_kernels]) for k in a.kernels if k.top_kernels],
        definitions=sorted((a.definitions or {}).items()),
        prompt_text=a.prompt_text if a.prompt_text is not None else "",
        request_json=json.dumps(a.request, indent=2, ensure_ascii=False, default=str),
    )


_TEMPLATE = r"""{% macro step_row(r) %}
<tr><td>{{ r.index }}</td><td>{{ r.start }}</td><td>{{ r.gpu }}</td><td>{{ r.host }}</td><td>{{ r.ctx }}</td>
<td>{{ r.batch }}</td><td>{{ r.token_id }}</td><td class="l"><code>{{ r.token }}</code></td><td>{{ r.gflop }}</td>
<td>{{ r.mb }}</td><td>{{ r.kv_mb }}</td><td>{{ r.mbu }}</td><td>{{ r.mfu }}</td><td class="l">{{ r.bound }}</td>
<td class="l">{{ r.batch_change }}</td></tr>
{% endmacro %}
<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; img-src data: blob:; font-src data:">
<title>Anatomy of a call: {{ a.model.name }} on {{ a.device.name }}</title>
<style>
  body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0; color: #1f2933;
         background: #f5f7fa; line-height: 1.45; }
  main { max-width: 1180px; margin: 0 auto; padding: 20px 24px 60px; }
  header { background: #263238; color: #eceff1; padding: 18px 24px; }
  header .inner { max-width: 1180px; margin: 0 auto; }
  header h1 { margin: 0 0 4px; font-size: 22px; font-weight: 600; }
  header .meta { font-size: 14px; color: #b0bec5; }
  header .meta span { margin-right: 18px; }
  .synthetic { background: #c62828; color: #fff; font-weight: 700; padding: 10px 24px; text-align: center;
               letter-spacing: .02em; }
  .cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(200px, 1fr)); gap: 12px; margin: 18px 0; }
  .card { background: #fff; border-radius: 8px; padding: 12px 14px; box-shadow: 0 1px 3px rgba(0,0,0,.08); }
  .card .label { font-size: 12px; text-transform: uppercase; letter-spacing: .06em; color: #616e7c; }
  .card .value { font-size: 22px; font-weight: 600; margin: 2px 0; }
  .card .sub { font-size: 12px; color: #616e7c; }
  section { background: #fff; border-radius: 8px; padding: 14px 18px; margin: 16px 0;
            box-shadow: 0 1px 3px rgba(0,0,0,.08); }
  section h2 { font-size: 17px; margin: 0 0 2px; }
  section p.why { margin: 0 0 10px; color: #616e7c; font-size: 13px; }
  .chart { width: 100%; min-height: 220px; }
  .note { background: #fff8e1; border-left: 4px solid #ffb300; padding: 8px 12px; font-size: 14px; }
  .warn { background: #ffebee; border-left: 4px solid #c62828; padding: 8px 12px; font-size: 14px; }
  table { border-collapse: collapse; font-size: 13px; width: 100%; }
  th, td { padding: 4px 8px; border-bottom: 1px solid #e4e7eb; text-align: right; vertical-align: top; }
  th { background: #f5f7fa; font-weight: 600; }
  td.l, th.l { text-align: left; }
  .facts td:first-child { text-align: left; color: #616e7c; width: 40%; }
  .facts td { text-align: left; }
  .two { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; }
  @media (max-width: 900px) { .two { grid-template-columns: 1fr; } }
  pre { white-space: pre-wrap; word-break: break-word; background: #f5f7fa; border: 1px solid #e4e7eb;
        border-radius: 6px; padding: 10px 12px; font-size: 13px; max-height: 420px; overflow: auto; margin: 4px 0 12px; }
  .scroll { overflow-x: auto; }
  code { font-size: 12px; }
  footer { color: #7b8794; font-size: 12px; text-align: center; margin-top: 24px; }
</style>
<script>{{ plotlyjs }}</script>
</head>
<body>
<header><div class="inner">
  <h1>Anatomy of a call: {{ a.model.name }}</h1>
  <div class="meta">
    <span>weights: <b>{{ a.weights.label }}</b> ({{ a.weights.kind }}{% if a.weights.source %}, {{ a.weights.source }}{% endif %})</span>
    <span>device: <b>{{ device_line }}</b></span>
    <span>{{ when }}</span>
  </div>
  <div class="meta">
    <span>{{ parameters }} parameters, {{ a.model.dtype }}</span>
    {% if software %}<span>{{ software }}</span>{% endif %}
    <span>device chosen: {{ a.device.why }}</span>
  </div>
  {% if startup %}<div class="meta"><span>start-up: {{ startup }}</span></div>{% endif %}
</div></header>
{% if synthetic %}
<div class="synthetic" id="synthetic-banner">SYNTHETIC WEIGHTS (random, not a trained checkpoint): the output text is meaningless; the timings, memory, bytes and FLOPs are those of the real model shape.</div>
{% endif %}
<main>

<div class="cards">
{% for c in cards %}
  <div class="card" title="{{ c.title }}"><div class="label">{{ c.label }}</div><div class="value">{{ c.value }}</div><div class="sub">{{ c.sub }}</div></div>
{% endfor %}
</div>

{% if charts.timeline %}
<section>
  <h2>Timeline</h2>
  <p class="why">Each host phase of the call, and below them the GPU time of the prefill and of every decode step.</p>
  <div class="chart" id="chart-timeline"></div>
</section>
{% endif %}

<section>
  <h2>Prefill and decode</h2>
  <p class="why">Prefill runs the whole prompt in one forward; each decode step runs one token per request and reads every weight again.</p>
  <div class="two">
    <table class="facts">
      <tr><td>prefill tokens</td><td>{{ prefill.tokens }}</td></tr>
      <tr><td>prefill GPU / host time</td><td>{{ prefill.ms }} / {{ prefill.host }}</td></tr>
      <tr><td>prefill work</td><td>{{ prefill.gflop }} GFLOP, {{ prefill.gb }} GB moved, {{ prefill.ai }} FLOP/B</td></tr>
      <tr><td>prefill MFU / MBU (measured ceilings)</td><td>{{ prefill.mfu }} / {{ prefill.mbu }}</td></tr>
      <tr><td>prefill bound</td><td>{{ prefill.bound.kind }}: {{ prefill.bound.why }}</td></tr>
    </table>
    <table class="facts">
    {% if decode_fmt %}
      <tr><td>decode steps</td><td>{{ decode.steps }}</td></tr>
      <tr><td>median GPU / host per step</td><td>{{ decode_fmt.gpu }} / {{ decode_fmt.host }}</td></tr>
      <tr><td>inter-token latency median / p90</td><td>{{ decode_fmt.itl }} / {{ decode_fmt.itl90 }}</td></tr>
      <tr><td>decode rate</td><td>{{ decode_fmt.tps }} tokens/s</td></tr>
      <tr><td>bytes per step (median)</td><td>{{ decode_fmt.bytes }}, {{ decode_fmt.kv_share }} of it KV reads</td></tr>
    {% else %}
      <tr><td>decode</td><td>no decode steps in this call</td></tr>
    {% endif %}
    </table>
  </div>
  {% if host_work %}
  <p class="why">Host work summed over the call's steps:
    {% for k, v in host_work %}{{ k }} {{ v }}{% if not loop.last %} · {% endif %}{% endfor %}</p>
  {% endif %}
  {% if charts.steps %}<div class="chart" id="chart-steps"></div>{% endif %}
</section>

{% if charts.roofline %}
<section>
  <h2>Roofline</h2>
  {% if ceilings.has_measured or ceilings.has_ds %}
  <p class="why">Below the sloped line work waits on memory, under the flat one on arithmetic{% if ceilings.ridge %}; the ridge is at {{ ceilings.ridge }} FLOP/byte{% endif %}.</p>
  {% else %}
  <p class="why">No ceilings for this device (not calibrated, no datasheet): only this call's points are shown.</p>
  {% endif %}
  <div class="chart" id="chart-roofline"></div>
  <table class="facts">
    <tr><td>measured{% if ceilings.has_measured %} ({{ ceilings.measured_at }}){% endif %}</td><td>{% if ceilings.has_measured %}read {{ ceilings.read }} GB/s, GEMV {{ ceilings.gemv }} GB/s, matmul {{ ceilings.matmul }} TFLOP/s{% else %}not calibrated (llm-anatomy calibrate measures them){% endif %}</td></tr>
    <tr><td>datasheet</td><td>{% if ceilings.has_ds %}{{ ceilings.ds_gbps }} GB/s, {{ ceilings.ds_tflops }} TFLOP/s{% if ceilings.source %} ({{ ceilings.source }}){% endif %}{% else %}none for this device{% endif %}</td></tr>
  </table>
</section>
{% endif %}

<section id="telemetry">
  <h2>GPU telemetry</h2>
  {% if charts.power or charts.clocks %}
  <p class="why">Power, energy and clocks sampled while the call ran; shaded bands are prefill and decode.</p>
    <p class="why">{{ a.telemetry.note }}{% if a.telemetry.counter_update_ms %}; the energy counter updated every {{ '%.0f' % a.telemetry.counter_update_ms }} ms{% endif %}. NVML's power reading is an average that lags the load; energy comes from the counter.</p>
    {% if charts.power %}<div class="chart" id="chart-power"></div>{% endif %}
    {% if charts.clocks %}<div class="chart" id="chart-clocks"></div>{% endif %}
  {% else %}
    <p class="why">Power, energy and clocks of the GPU, when NVML can read them.</p>
    <div class="note" id="telemetry-note">No GPU telemetry for this call: {{ a.telemetry.note }}</div>
  {% endif %}
  {% if energy %}
  <h3>Energy</h3>
  <table><tr><th class="l">phase</th><th>joules</th><th>±</th><th>per token (J)</th><th class="l">method</th></tr>
  {% for e in energy %}<tr><td class="l">{{ e.phase }}</td><td>{{ e.j }}</td><td>{{ e.u }}</td><td>{{ e.per_token }}</td><td class="l">{{ e.method }}</td></tr>{% endfor %}
  </table>
  {% endif %}
</section>

{% if batching %}
<section>
  <h2>Batching</h2>
  <p class="why">How this request shared the engine: continuous batching runs several requests in one step; a prefill step for others holds the running ones back.</p>
  <table class="facts">
    <tr><td>queued before its first step</td><td>{{ batching.queue }}</td></tr>
    <tr><td>batch size over its steps</td><td>max {{ batching.max }}, mean {{ batching.mean }}</td></tr>
    <tr><td>requests it shared steps with</td><td>{{ batching.shared }}</td></tr>
    <tr><td>stalled by others' prefill steps</td><td>{{ batching.stall_count }} steps, {{ batching.stall_ms }} of device time</td></tr>
    <tr><td>preemptions (KV blocks taken back, recomputed)</td><td>{{ batching.preemptions }}</td></tr>
  </table>
  {% if batching.co %}
  <h3>Shared steps</h3>
  <table><tr><th class="l">request</th><th>steps shared</th></tr>
  {% for r in batching.co %}<tr><td class="l">{{ r.id }}</td><td>{{ r.steps }}</td></tr>{% endfor %}
  </table>
  {% endif %}
  {% if batching.stalls %}
  <h3>Stalls</h3>
  <table><tr><th>start ms</th><th>GPU ms</th><th>tokens</th><th class="l">requests prefilled</th></tr>
  {% for r in batching.stalls %}<tr><td>{{ r.start }}</td><td>{{ r.gpu }}</td><td>{{ r.tokens }}</td><td class="l">{{ r.requests }}</td></tr>{% endfor %}
  </table>
  {% endif %}
</section>
{% endif %}

<section>
  <h2>KV cache</h2>
  <p class="why">Keys and values of every cached position, in fixed-size blocks; this request's share grows by one token per step.</p>
  <div class="two">
    <table class="facts">
      <tr><td>bytes per token</td><td>{{ kv.bpt }} = {{ kv.formula }}</td></tr>
      <tr><td>dtype, block size</td><td>{{ kv.dtype }}, {{ kv.block }} tokens</td></tr>
      <tr><td>this request at its end</td><td>{{ kv.tokens }} tokens, {{ kv.used }} used, {{ kv.blocks }} blocks = {{ kv.allocated }}</td></tr>
    </table>
    <table class="facts">
      <tr><td>pool</td><td>{{ kv.pool }} ({{ kv.pool_blocks }} blocks, {{ kv.pool_share }} of the device)</td></tr>
      <tr><td>sequences of this length that fit</td><td>{{ kv.fits }}</td></tr>
      <tr><td>sequences of full context ({{ kv.full }})</td><td>{{ kv.fits_full }}</td></tr>
    </table>
  </div>
  {% if charts.kv %}<div class="chart" id="chart-kv"></div>{% endif %}
</section>

<section>
  <h2>Memory census</h2>
  <p class="why">Where every byte of {{ 'host RAM' if a.memory.kind == 'host' else 'GPU memory' }} is: the rows sum to the total. Measured by {{ a.memory.source }}.</p>
  {% if charts.census %}<div class="chart" id="chart-census"></div>{% endif %}
  {% if not census_ok %}<div class="warn">The rows sum to {{ census_sum }} bytes, not the total {{ census_total }}.</div>{% endif %}
  <table><tr><th class="l">row</th><th>bytes</th><th>size</th><th>share</th></tr>
  {% for r in census %}<tr><td class="l">{{ r.name }}</td><td>{{ r.bytes }}</td><td>{{ r.human }}</td><td>{{ r.share }}</td></tr>{% endfor %}
  <tr><th class="l">total</th><th>{{ census_total }}</th><th>{{ census_total_h }}</th><th>100%</th></tr>
  </table>
  {% if activation_peak %}<p class="why">Transient activation peak during the call (inside the rows above): {{ activation_peak }}.</p>{% endif %}
</section>

{% if charts.kernels or kernel_tables %}
<section>
  <h2>GPU kernels</h2>
  <p class="why">Kernel time by category from the profiler: for the prefill, and summed over the profiled decode steps.</p>
  {% if charts.kernels %}<div class="chart" id="chart-kernels"></div>{% endif %}
  {% for k in kernel_tables %}
  <h3>Top kernels: {{ k.phase }} ({{ k.steps }} step{{ "s" if k.steps != 1 }}, {{ k.total }})</h3>
  <div class="scroll"><table><tr><th class="l">kernel</th><th>time</th><th>count</th></tr>
  {% for t in k.top %}<tr><td class="l"><code>{{ t.name }}</code></td><td>{{ t.ms }}</td><td>{{ t.count }}</td></tr>{% endfor %}
  </table></div>
  {% endfor %}
</section>
{% endif %}

<section>
  <h2>Prompt and output</h2>
  <p class="why">The prompt as the model saw it (after the chat template), and the text it produced.</p>
  <h3>Prompt ({{ a.prompt_token_ids|length }} tokens)</h3>
  <pre id="prompt-text">{{ prompt_text }}</pre>
  <h3>Output ({{ a.output_token_ids|length }} tokens, finish: {{ a.finish_reason }})</h3>
  <pre id="output-text">{{ a.text }}</pre>
  <details><summary>Request</summary><pre>{{ request_json }}</pre></details>
</section>

{% if steps_first %}
<section>
  <h2>Decode steps</h2>
  <p class="why">One row per decode step{% if steps_omitted %}: the first and last {{ steps_first|length }}, {{ steps_omitted }} in between left out{% endif %}.</p>
  <div class="scroll"><table>
    <tr><th>step</th><th>start ms</th><th>GPU ms</th><th>host ms</th><th>context</th><th>batch</th><th>token id</th><th class="l">token</th><th>GFLOP</th><th>MB moved</th><th>KV MB read</th><th>MBU</th><th>MFU</th><th class="l">bound</th><th class="l" title="other requests that joined (+) or left (&minus;) the batch since the step before">batch change</th></tr>
    {% for r in steps_first %}{{ step_row(r) }}
    {% endfor %}
    {% if steps_omitted %}<tr><td colspan="15" class="l">… {{ steps_omitted }} steps left out …</td></tr>{% endif %}
    {% for r in steps_last %}{{ step_row(r) }}
    {% endfor %}
  </table></div>
</section>
{% endif %}

<section>
  <h2>Notes and definitions</h2>
  <p class="why">How the numbers above were measured and what they mean.</p>
  {% if a.notes %}<ul>{% for n in a.notes %}<li>{{ n }}</li>{% endfor %}</ul>{% endif %}
  <table class="facts">{% for k, v in definitions %}<tr><td>{{ k }}</td><td>{{ v }}</td></tr>{% endfor %}</table>
</section>

<footer>llm-anatomy {{ a.tool_version }} · schema {{ a.schema_version }}{% if a.id %} · call {{ a.id }}{% endif %}</footer>
</main>
<script>
(function () {
  var figures = {{ figures_json }};
  var config = {{ chart_config }};
  Object.keys(figures).forEach(function (id) {
    var el = document.getElementById(id);
    if (!el) { return; }
    var fig = figures[id];
    if (fig.layout.height) { el.style.height = fig.layout.height + "px"; }  // responsive plots fill their div
    Plotly.newPlot(el, fig.data, fig.layout, config);
  });
})();
</script>
</body>
</html>
"""

_ENV = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
_PAGE = _ENV.from_string(_TEMPLATE)


def render_html(anatomy: Anatomy) -> str:
    """The whole report for one call as one self-contained, offline HTML document."""
    return _PAGE.render(**_context(anatomy))


def write_html(anatomy: Anatomy, path: str | Path) -> Path:
    """Write `render_html(anatomy)` to `path` (UTF-8) and return the path."""
    path = Path(path)
    path.write_text(render_html(anatomy), encoding="utf-8")
    return path
