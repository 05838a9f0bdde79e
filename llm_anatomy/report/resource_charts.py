"""Charts of what one call used: GPU power and clocks, the KV cache, the memory census, kernel time by category.

Each function returns a plotly Figure, or None when the record holds nothing to draw. Bytes are in decimal MB
and GB, as everywhere in the reports.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from ..anatomy import Anatomy
from . import finite, units
from .charts import PALETTE, PHASE_COLORS, base_layout, plot_text
from .readings import memory_words

CENSUS_COLORS = {
    "weights": "#5e35b1", "kv_pool": "#1e88e5", "cuda_graphs": "#00897b", "other_allocated": "#fb8c00",
    "allocator_free": "#fdd835", "context_and_other": "#8d6e63", "free": "#cfd8dc",
}


def _timed_samples(a: Anatomy) -> list:
    return [s for s in (a.gpu_samples or []) if finite(s.t_ms) is not None]


def _phase_shading(fig: go.Figure, a: Anatomy) -> None:
    for p in a.phases:
        if p.name in ("prefill", "decode") and finite(p.start_ms) is not None and finite(p.end_ms) is not None:
            fig.add_vrect(x0=p.start_ms, x1=p.end_ms, fillcolor=PHASE_COLORS[p.name], opacity=0.08, line_width=0,
                          annotation_text=p.name, annotation_position="top left")


def power_figure(a: Anatomy) -> go.Figure | None:
    """NVML's power reading and the energy counter since the call began, over the call."""
    samples = _timed_samples(a)
    if not any(finite(s.power_w) is not None for s in samples):
        return None
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[s.t_ms for s in samples], y=[finite(s.power_w) for s in samples], mode="lines+markers",
                             name="power (W)", line=dict(color="#e53935", shape="hv"),
                             hovertemplate="%{x:.1f} ms: %{y:.0f} W<extra></extra>"))
    if any(finite(s.energy_j) is not None for s in samples):
        fig.add_trace(go.Scatter(x=[s.t_ms for s in samples], y=[finite(s.energy_j) for s in samples],
                                 mode="lines", name="energy since start (J)", yaxis="y2",
                                 line=dict(color="#6d4c41", dash="dot"),
                                 hovertemplate="%{x:.1f} ms: %{y:.3g} J<extra></extra>"))
    fig.update_layout(**base_layout("GPU power and energy"), xaxis=dict(title="ms since the call began"),
                      yaxis=dict(title="W", rangemode="tozero"),
                      yaxis2=dict(title="J", overlaying="y", side="right", rangemode="tozero", showgrid=False))
    _phase_shading(fig, a)
    return fig


def clocks_figure(a: Anatomy) -> go.Figure | None:
    """The SM and memory clocks over the call."""
    samples = _timed_samples(a)
    series = [(name, attr, color) for name, attr, color in
              (("SM", "sm_clock_mhz", "#3949ab"), ("memory", "mem_clock_mhz", "#00897b"))
              if any(finite(getattr(s, attr)) is not None for s in samples)]
    if not series:
        return None
    fig = go.Figure()
    for name, attr, color in series:
        fig.add_trace(go.Scatter(x=[s.t_ms for s in samples], y=[finite(getattr(s, attr)) for s in samples],
                                 mode="lines+markers", name=f"{name} clock (MHz)", line=dict(color=color, shape="hv"),
                                 hovertemplate=f"%{{x:.1f}} ms: {name} %{{y:.0f}} MHz<extra></extra>"))
    fig.update_layout(**base_layout("GPU clocks"), xaxis=dict(title="ms since the call began"),
                      yaxis=dict(title="MHz", rangemode="tozero"))
    _phase_shading(fig, a)
    return fig


def kv_figure(a: Anatomy) -> go.Figure | None:
    """This request's KV cache after prefill and each step: bytes used, and bytes of the blocks allocated."""
    kv = a.kv_cache
    after = [finite(b) for b in kv.bytes_after_step]
    if not any(b is not None for b in after):
        return None
    steps = list(range(len(after)))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=steps, y=[b / 1e6 if b is not None else None for b in after], mode="lines+markers",
                             name="used (tokens × bytes/token)", line=dict(color="#1e88e5"),
                             customdata=[[round(b / kv.bytes_per_token) if b is not None and kv.bytes_per_token
                                          else None] for b in after],
                             hovertemplate="after %{x}: %{y:.4g} MB, %{customdata[0]} tokens<extra></extra>"))
    if kv.bytes_per_token and kv.block_size:
        block_bytes = kv.block_size * kv.bytes_per_token
        alloc = [math.ceil(b / block_bytes) * block_bytes / 1e6 if b is not None else None for b in after]
        fig.add_trace(go.Scatter(x=steps, y=alloc, mode="lines", name=f"allocated (blocks of {kv.block_size})",
                                 line=dict(color="#fb8c00", shape="hv"),
                                 hovertemplate="after %{x}: %{y:.4g} MB allocated<extra></extra>"))
    fig.update_layout(**base_layout("KV cache of this request"),
                      xaxis=dict(title="decode step (0 = after prefill)"),
                      yaxis=dict(title="MB", rangemode="tozero"))
    return fig


def census_figure(a: Anatomy) -> go.Figure | None:
    """The memory census as one stacked bar: GPU memory, or host memory on the CPU."""
    words = memory_words(a)
    rows = [(key, label, finite(v)) for key, label, v in words.rows if finite(v) is not None]
    total = finite(a.memory.total)
    if not rows or not total:
        return None
    fig = go.Figure()
    for key, label, v in rows:
        fig.add_trace(go.Bar(orientation="h", y=[words.noun], x=[v / 1e9], name=label,
                             marker=dict(color=CENSUS_COLORS.get(key, "#90a4ae")),
                             customdata=[[v / total * 100]],
                             hovertemplate=f"{plot_text(label)}: %{{x:.4g}} GB (%{{customdata[0]:.3g}}%)"
                                           "<extra></extra>"))
    fig.update_layout(**base_layout(f"Memory census of {words.noun}: {units.size(total)} in total", height=240,
                                    barmode="stack"),
                      xaxis=dict(title="GB", range=[0, max(total, sum(v for _, _, v in rows)) / 1e9]),
                      yaxis=dict(showticklabels=False))
    return fig


def kernels_figure(a: Anatomy) -> go.Figure | None:
    """Each phase's kernel time split by category, as shares of the phase."""
    kb = [k for k in a.kernels if k.categories]
    if not kb:
        return None
    labels = [f"{k.phase} ({k.steps} step{'s' if k.steps != 1 else ''}, {units.ms(k.total_ms)})" for k in kb]
    cats = list(dict.fromkeys(c.category for k in kb for c in k.categories))
    fig = go.Figure()
    for i, cat in enumerate(cats):
        ms, counts, shares = [], [], []
        for k in kb:
            hit = [c for c in k.categories if c.category == cat]
            v = sum(finite(c.ms) or 0.0 for c in hit)
            tot = sum(finite(c.ms) or 0.0 for c in k.categories) or 1.0
            ms.append(v)
            counts.append(sum(c.count for c in hit))
            shares.append(100 * v / tot)
        fig.add_trace(go.Bar(orientation="h", y=labels, x=shares, name=plot_text(cat),
                             marker=dict(color=PALETTE[i % len(PALETTE)]),
                             customdata=[[m, c] for m, c in zip(ms, counts)],
                             hovertemplate=f"{plot_text(cat)}: %{{x:.3g}}% of the phase's kernel time, "
                                           "%{customdata[0]:.3g} ms in %{customdata[1]} kernels<extra></extra>"))
    fig.update_layout(**base_layout("GPU kernel time by category (share of each phase)",
                                    height=max(240, 70 * len(kb) + 150), barmode="stack"),
                      xaxis=dict(title="% of the phase's kernel time", range=[0, 100]),
                      yaxis=dict(automargin=True, autorange="reversed"))
    return fig
