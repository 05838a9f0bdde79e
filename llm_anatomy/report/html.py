"""One self-contained HTML page for one call's Anatomy: headline numbers, charts and tables.

The page is templates/anatomy.html (package data) rendered by `page.render_page`, which inlines plotly.js
once, so the page works offline; call_page.py builds its figures and formatted values.
"""

from __future__ import annotations

from pathlib import Path

from ..anatomy import Anatomy
from .call_page import page_context
from .page import plotly_js, render_page, script_json

__all__ = ["render_html", "write_html", "render_page", "plotly_js", "script_json"]


def render_html(anatomy: Anatomy) -> str:
    """The whole report for one call as one self-contained, offline HTML document."""
    figures, context = page_context(anatomy)
    title = f"Anatomy of a call: {anatomy.model.name} on {anatomy.device.name}"
    return render_page("anatomy.html", title=title, figures=figures, **context)


def write_html(anatomy: Anatomy, path: str | Path) -> Path:
    """Write `render_html(anatomy)` to `path` (UTF-8) and return the path."""
    path = Path(path)
    path.write_text(render_html(anatomy), encoding="utf-8")
    return path
