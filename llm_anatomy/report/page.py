"""Self-contained, offline HTML pages with plotly charts, from jinja2 templates shipped with the package.

Every report page (one call's anatomy, a sweep, a bench run) is rendered by `render_page`: plotly.js is inlined
once from the installed plotly package, each figure travels as JSON inside the page, and a Content-Security-
Policy forbids fetching anything. Text from the record is HTML-escaped by jinja2's autoescape; the figure JSON
has `<`, `>`, `&` (and U+2028/9) written as \\uXXXX so it cannot close its <script>.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup
from plotly.offline import get_plotlyjs

from . import units

CHART_CONFIG = {"displaylogo": False, "responsive": True}
_FIGURE_ID = re.compile(r"[A-Za-z][A-Za-z0-9_-]*\Z")


def plotly_js() -> str:
    """The installed plotly.js bundle, made safe to inline in a <script> element."""
    return get_plotlyjs().replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT")


def script_json(obj: Any) -> str:
    """JSON that is safe inside an HTML <script> element (no `</script>`, `<!--`, or line separators)."""
    text = json.dumps(obj, allow_nan=False, separators=(",", ":"))
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _environment(loader: jinja2.BaseLoader) -> jinja2.Environment:
    env = jinja2.Environment(loader=loader, autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True)
    # the unit formatters, for templates that format raw record values themselves
    env.filters.update(sig=units.sig, integer=units.integer, ms=units.ms, size=units.size, tbps=units.tbps,
                       tflops=units.tflops, percent=units.percent, joules=units.joules)
    return env


_PACKAGE_TEMPLATES = jinja2.PackageLoader("llm_anatomy.report", "templates")
_ENV = _environment(_PACKAGE_TEMPLATES)


def _figure_json(fig: Any) -> dict:
    if isinstance(fig, Mapping):
        return dict(fig)
    return json.loads(fig.to_json(validate=False, engine="json"))  # a plotly Figure


def render_page(template_name: str, *, title: str, figures: Mapping[str, Any] | None = None,
                template_dirs: Sequence[str | Path] = (), **context: Any) -> str:
    """Render one self-contained HTML page: `template_name` with `context`, its `figures` drawn by plotly.

    template_name: a template in llm_anatomy/report/templates/ (package data), or in one of `template_dirs`
        (searched first). A page template extends "base.html", which holds the <head> (Content-Security-
        Policy, the shared CSS, plotly.js inlined once) and the script that draws the figures, and fills its
        blocks: `body` (everything inside <body>), optionally `style` (CSS added to the shared rules) and
        `head` (more elements in <head>, e.g. <meta>).
    title: the page's <title> (escaped).
    figures: element id -> plotly `Figure` (or its JSON dict). The template must have an element with each id,
        e.g. `<div class="chart" id="chart-ttft"></div>`; the figure is drawn into it, its height taken from
        the figure's layout. A ValueError names an id the rendered page lacks.
    context: any further variables for the template. Text is HTML-escaped; pass `markupsafe.Markup` only for
        HTML you built and escaped yourself.

    Templates also get the unit filters of `llm_anatomy.report.units` (`{{ x|tflops }}`, `|tbps`, `|size`,
    `|ms`, `|percent`, `|sig`, `|integer`, `|joules`) and `units_note`, the sentence stating the units once.
    Returns the page as a string; nothing in it is fetched when it is opened.

    Example (a sweep's report)::

        html = render_page("sweep.html", title="Sweep: Qwen3-8B on H200",
                           figures={"chart-tpot": tpot_figure}, points=rows)

    with templates/sweep.html::

        {% extends "base.html" %}
        {% block body %}<main><h1>{{ title }}</h1><div class="chart" id="chart-tpot"></div></main>{% endblock %}
    """
    figures = dict(figures or {})
    for fid in figures:
        if not isinstance(fid, str) or not _FIGURE_ID.match(fid):
            raise ValueError(f"figure id {fid!r} must be a letter then letters, digits, '-' or '_'")
    env = _ENV
    if template_dirs:
        env = _environment(jinja2.ChoiceLoader([jinja2.FileSystemLoader([str(d) for d in template_dirs]),
                                                _PACKAGE_TEMPLATES]))
    reserved = {"title", "plotlyjs", "figures_json", "chart_config", "units_note"} & set(context)
    if reserved:
        raise ValueError(f"render_page sets {sorted(reserved)} itself: rename these context variables")
    page = env.get_template(template_name).render(
        title=title, plotlyjs=Markup(plotly_js()), units_note=units.UNITS,
        figures_json=Markup(script_json({fid: _figure_json(f) for fid, f in figures.items()})),
        chart_config=Markup(script_json(CHART_CONFIG)), **context)
    missing = [fid for fid in figures if f'id="{fid}"' not in page]
    if missing:
        raise ValueError(f"{template_name} has no element for the figures {missing}: add "
                         f'<div class="chart" id="..."></div> for each, or leave them out of `figures`')
    return page
