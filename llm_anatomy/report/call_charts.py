"""Charts of one call's time and work: the timeline of its phases, each decode step's latency, and the roofline.

Each function returns a plotly Figure, or None when the record holds nothing to draw.
"""

from __future__ import annotations

import plotly.graph_objects as go

from ..anatomy import Anatomy
from . import finite, units
from .charts import PHASE_COLORS, base_layout, plot_text, token_repr
from .readings import BytesReading, bytes_reading, memory_words


def timeline_figure(a: Anatomy) -> go.Figure | None:
    """Host phases as bars on one row each, and the forward of the prefill and of each step on one more row."""
    phases = [p for p in a.phases if finite(p.start_ms) is not None and finite(p.end_ms) is not None]
    if not phases:
        return None
    rows = list(dict.fromkeys(p.name for p in phases))
    fig = go.Figure()
    fig.add_trace(go.Bar(
        orientation="h", y=[p.name for p in phases], base=[finite(p.start_ms) for p in phases],
        x=[max(0.0, finite(p.end_ms) - finite(p.start_ms)) for p in phases],
        marker=dict(color=[PHASE_COLORS.get(p.name, "#78909c") for p in phases]),
        customdata=[[finite(p.start_ms), finite(p.end_ms), plot_text(p.note or "")] for p in phases],
        hovertemplate="<b>%{y}</b><br>%{customdata[0]:.3f} → %{customdata[1]:.3f} ms<br>"
                      "duration %{x:.3g} ms<br>%{customdata[2]}<extra></extra>",
        name="host phases",
    ))
    processor = memory_words(a).processor
    spans = _forward_spans(a)
    if spans:
        forward_row = f"{processor} (forward)"
        fig.add_trace(go.Bar(
            orientation="h", y=[forward_row] * len(spans), base=[s[1] for s in spans],
            x=[max(0.0, s[2]) for s in spans],
            marker=dict(color=[s[4] for s in spans], line=dict(color="white", width=0.5)),
            customdata=[[s[0], s[3]] for s in spans],
            hovertemplate=f"<b>%{{customdata[0]}}</b> ({processor})<br>start %{{base:.3f}} ms, %{{x:.3g}} ms<br>"
                          "%{customdata[1]}<extra></extra>",
            name=f"{processor} spans",
        ))
        rows.append(forward_row)
    height = max(260, 38 * len(rows) + 110)
    fig.update_layout(**base_layout("Phases of the call (ms since the call began)", height=height, barmode="overlay",
                                    showlegend=False),
                      xaxis=dict(title="ms", rangemode="tozero"),
                      yaxis=dict(categoryorder="array", categoryarray=list(reversed(rows)), automargin=True))
    ttft = finite(a.ttft_ms)
    if ttft is not None:
        fig.add_vline(x=ttft, line=dict(color="#e53935", dash="dot", width=1),
                      annotation_text="first token", annotation_position="top")
    return fig


def _forward_spans(a: Anatomy) -> list[tuple[str, float, float, str, str]]:
    """(label, start ms, duration ms, hover text, colour) of the prefill's forward and each decode step's."""
    spans = []
    pf = a.prefill
    if finite(pf.start_ms) is not None and finite(pf.ms) is not None:
        spans.append(("prefill", finite(pf.start_ms), finite(pf.ms), f"{pf.tokens} tokens", PHASE_COLORS["prefill"]))
    for s in a.decode_steps:
        if finite(s.start_ms) is not None and finite(s.gpu_ms) is not None:
            spans.append((f"step {s.index}", finite(s.start_ms), finite(s.gpu_ms),
                          f"context {s.context_len}, token {plot_text(token_repr(s.token_text))}",
                          PHASE_COLORS["decode"]))
    return spans


def steps_figure(a: Anatomy) -> go.Figure | None:
    """Each decode step's forward time, inter-token latency and host work against its context length."""
    steps = a.decode_steps
    if not steps:
        return None
    processor = memory_words(a).processor
    x = [s.context_len for s in steps]
    custom = [[s.index, plot_text(token_repr(s.token_text)), s.batch_size] for s in steps]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=[finite(s.gpu_ms) for s in steps], mode="lines+markers",
                             name=f"{processor} ms (forward)", customdata=custom, line=dict(color="#1e88e5"),
                             hovertemplate=f"step %{{customdata[0]}}: %{{y:.3g}} ms {processor}<br>context %{{x}}, "
                                           "batch %{customdata[2]}<br>token %{customdata[1]}<extra></extra>"))
    itl = list(a.itl_ms)[:len(steps)]  # itl_ms[i] is the wait for decode step i + 1's token
    fig.add_trace(go.Scatter(x=x[:len(itl)], y=[finite(v) for v in itl], mode="lines+markers",
                             name="inter-token latency", customdata=custom, line=dict(color="#fb8c00"),
                             hovertemplate="step %{customdata[0]}: %{y:.3g} ms since the previous token<br>"
                                           "context %{x}<br>token %{customdata[1]}<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=[finite(s.host_ms) for s in steps], mode="lines", name="host work",
                             customdata=custom, line=dict(color="#8e24aa", dash="dot"),
                             hovertemplate="step %{customdata[0]}: %{y:.3g} ms of host work<br>context %{x}"
                                           "<extra></extra>"))
    fig.update_layout(**base_layout("Decode step latency against context length"),
                      xaxis=dict(title="context length (tokens attended to)"),
                      yaxis=dict(title="ms per step", rangemode="tozero"))
    return fig


def _ceilings(a: Anatomy) -> list[tuple[str, float | None, float | None, str, str]]:
    """(name, TFLOP/s, GB/s, dash, colour) of each roof to draw: measured, measured GEMV, datasheet."""
    c = a.ceilings
    roofs = []
    if finite(c.matmul_tflops) or finite(c.read_gbps):
        roofs.append(("measured", finite(c.matmul_tflops), finite(c.read_gbps), "solid", "#263238"))
    if finite(c.gemv_gbps):
        roofs.append(("measured GEMV", finite(c.matmul_tflops), finite(c.gemv_gbps), "dashdot", "#607d8b"))
    if finite(c.datasheet_tflops) or finite(c.datasheet_gbps):
        roofs.append(("datasheet", finite(c.datasheet_tflops), finite(c.datasheet_gbps), "dot", "#9e9e9e"))
    return roofs


def _work_point(flops, reading: BytesReading, ms) -> tuple[float, float, str] | None:
    """(FLOP per byte, TFLOP/s, bytes source) of one forward, by measured bytes where the record has them."""
    f, b, t = finite(flops), reading.value, finite(ms)
    if not f or not b or not t or t <= 0:
        return None
    return f / b, f / t / 1e9, reading.source


def roofline_figure(a: Anatomy) -> go.Figure | None:
    """Achieved TFLOP/s against arithmetic intensity for the prefill and each step, under the ceilings."""
    pf = a.prefill
    prefill = _work_point(pf.flops, bytes_reading(pf), pf.ms)
    steps = [(s, p) for s in a.decode_steps if (p := _work_point(s.flops, bytes_reading(s), s.gpu_ms))]
    if prefill is None and not steps:
        return None
    roofs = _ceilings(a)
    ais = ([prefill[0]] if prefill else []) + [p[0] for _, p in steps]
    ridges = [t * 1e3 / g for _, t, g, _, _ in roofs if t and g]
    lo, hi = min(ais + ridges) / 4, max(ais + ridges) * 8
    fig = go.Figure()
    for name, tflops, gbps, dash, color in roofs:
        ridge = tflops * 1e3 / gbps if tflops and gbps else None
        xs = [lo] + ([ridge] if ridge is not None and lo < ridge < hi else []) + [hi]
        ys = [min(v for v in (tflops, xv * gbps / 1e3 if gbps else None) if v) for xv in xs]
        label = name + ": " + ", ".join(x for x in (units.tflops(tflops) if tflops else "",
                                                    units.tbps(gbps) if gbps else "") if x)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=label, line=dict(color=color, dash=dash, width=2),
                                 hovertemplate=f"{plot_text(name)} ceiling<br>%{{x:.3g}} FLOP/B → "
                                               "%{y:.3g} TFLOP/s<extra></extra>"))
    if steps:
        fig.add_trace(go.Scatter(
            x=[p[0] for _, p in steps], y=[p[1] for _, p in steps], mode="markers", name="decode steps",
            marker=dict(color="#1e88e5", size=7, opacity=0.75),
            customdata=[[s.index, s.context_len, p[2]] for s, p in steps],
            hovertemplate="decode step %{customdata[0]} (context %{customdata[1]})<br>%{x:.3g} FLOP/B "
                          "(%{customdata[2]} bytes), %{y:.3g} TFLOP/s<extra></extra>"))
    if prefill is not None:
        fig.add_trace(go.Scatter(x=[prefill[0]], y=[prefill[1]], mode="markers", name="prefill",
                                 marker=dict(color=PHASE_COLORS["prefill"], size=13, symbol="diamond"),
                                 hovertemplate=f"prefill<br>%{{x:.3g}} FLOP/B ({prefill[2]} bytes), "
                                               "%{y:.3g} TFLOP/s<extra></extra>"))
    fig.update_layout(**base_layout("Roofline: achieved TFLOP/s against arithmetic intensity", height=420),
                      xaxis=dict(type="log", title="arithmetic intensity (FLOP per byte moved)"),
                      yaxis=dict(type="log", title="achieved TFLOP/s"))
    return fig
