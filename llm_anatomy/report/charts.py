"""What every plotly chart of the reports shares: the layout, the colours, and escaping text for labels."""

from __future__ import annotations

import json
from typing import Any

PHASE_COLORS = {
    "parse": "#9e9e9e", "template": "#8d6e63", "tokenize": "#ab47bc", "queue": "#ffb300",
    "prefill": "#e53935", "decode": "#1e88e5", "detokenize": "#43a047", "e2e": "#546e7a",
}
PALETTE = ["#5e35b1", "#1e88e5", "#00897b", "#fdd835", "#fb8c00", "#e53935", "#8d6e63", "#546e7a", "#d81b60",
           "#43a047"]


def base_layout(title: str, **kw: Any) -> dict:
    """The layout of a report chart: a left-aligned title, white template, 340 px high unless given."""
    layout = dict(title=dict(text=title, x=0.01, font=dict(size=15)), template="plotly_white", height=340,
                  margin=dict(l=70, r=30, t=50, b=50), hovermode="closest")
    layout.update(kw)
    return layout


def plot_text(s: Any) -> str:
    """User text placed in a plotly label, which reads a few tags (<br>, <a href>...) and the entities &amp; &lt;
    &gt;: escape those three so the text shows as it is (plotly does not know &quot;, so quotes stay)."""
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def token_repr(s: str) -> str:
    """A token's text as a quoted literal, so spaces and newlines show."""
    return json.dumps(s, ensure_ascii=False)
