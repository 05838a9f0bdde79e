"""The page machinery every HTML report shares: render_page with a report's own template and figures, and the
templates shipped as package data (in a built wheel, and found from it by the call, bench and sweep reports)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

import plotly.graph_objects as go
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sample_anatomy import sample_anatomy  # noqa: E402

from llm_anatomy.report.page import plotly_js, render_page  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SWEEP_TEMPLATE = """{% extends "base.html" %}
{% block style %}.points td { color: #333; }{% endblock %}
{% block body %}<main><h1>{{ title }}</h1>
<p id="rate">{{ rate|tflops }} and {{ bandwidth|tbps }}; {{ units_note }}</p>
<table class="points">{% for p in points %}<tr><td>{{ p }}</td></tr>{% endfor %}</table>
<div class="chart" id="chart-tpot"></div><div class="chart" id="chart-ttft"></div></main>{% endblock %}
"""


def _figure(name: str) -> go.Figure:
    return go.Figure(go.Scatter(x=[1, 2, 4], y=[3.0, 3.1, 3.4], name=name))


@pytest.fixture()
def sweep_dir(tmp_path):
    (tmp_path / "sweep.html").write_text(SWEEP_TEMPLATE, encoding="utf-8")
    return tmp_path


def test_render_page_with_a_reports_own_template(sweep_dir):
    page = render_page("sweep.html", title='Sweep <b>"8B"</b>', template_dirs=[sweep_dir],
                       figures={"chart-tpot": _figure("tpot"), "chart-ttft": _figure("ttft").to_plotly_json()},
                       points=["<script>alert(1)</script>", "b=2"], rate=0.0123, bandwidth=38.0)
    assert page.count(plotly_js()) == 1  # plotly.js inlined once, for both charts
    body = page.replace(plotly_js(), "")
    assert "<title>Sweep &lt;b&gt;&#34;8B&#34;&lt;/b&gt;</title>" in body
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body and "<script>alert" not in body
    assert "Content-Security-Policy" in body and "default-src 'none'" in body
    assert '"chart-tpot"' in body and '"chart-ttft"' in body
    assert "0.0123 TFLOP/s and 0.038 TB/s" in body and "1 GB = 10^9 bytes" in body
    assert ".points td" in body  # the report's own style block
    assert len(re.findall(r"<script\b", body)) == 2  # plotly.js and the drawing script, nothing else


def test_render_page_refuses_what_would_break_the_page(sweep_dir):
    common = dict(template_dirs=[sweep_dir], points=[], rate=1.0, bandwidth=1.0)
    with pytest.raises(ValueError, match="chart-missing"):
        render_page("sweep.html", title="t", figures={"chart-missing": _figure("x")}, **common)
    with pytest.raises(ValueError, match="figure id"):
        render_page("sweep.html", title="t", figures={'x" onload="alert(1)': _figure("x")}, **common)
    with pytest.raises(ValueError, match="plotlyjs"):
        render_page("sweep.html", title="t", plotlyjs="<script>", **common)
    with pytest.raises(Exception, match="no-such.html"):
        render_page("no-such.html", title="t", **common)


def test_package_templates_are_found_without_template_dirs():
    templates = resources.files("llm_anatomy.report") / "templates"
    assert (templates / "base.html").is_file() and (templates / "anatomy.html").is_file()
    page = render_page("base.html", title="empty page")
    assert page.count(plotly_js()) == 1 and "<title>empty page</title>" in page


PAGE_TEMPLATES = ("report/templates", "bench/templates", "sweep/templates")  # under llm_anatomy/


def test_pyproject_ships_every_template():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["llm_anatomy"]
    for folder in PAGE_TEMPLATES:
        files = sorted((ROOT / "llm_anatomy" / folder).iterdir())
        assert files, folder
        for f in files:
            rel = f.relative_to(ROOT / "llm_anatomy").as_posix()
            assert any(fnmatch(rel, g) for g in globs), f"{rel} is not in pyproject's package-data {globs}"


def _sweep_summary() -> dict:
    """The summary of a sweep with no points yet: its engine's KV capacity is its one chart."""
    from conftest import TINY

    from llm_anatomy.anatomy import Ceilings
    from llm_anatomy.sweep.report import summarize

    engine = {"label": "bf16", "kv_bytes_per_token": 1024, "block_size": 16, "kv_pool_bytes": 1 << 24,
              "kv_pool_tokens": 1 << 14, "max_num_seqs": 8, "max_num_batched_tokens": 512}
    meta = {"config": {**TINY, "model_type": "qwen3"}, "engines": {"bf16": engine},
            "identity": {"model": "tiny", "device": "cpu", "dtype": "float32", "weights": "synthetic"},
            "ceilings": dataclasses.asdict(Ceilings("cpu", read_gbps=20.0, gemv_gbps=15.0, matmul_tflops=0.5,
                                                      datasheet_gbps=None, datasheet_tflops=None, measured_at="test")),
            "updated_at": "test", "tool_version": "test"}
    return summarize(meta, [])


# Renders the three reports from an installed wheel alone (-I: no cwd, no PYTHONPATH), each from its inputs.
WHEEL_SCRIPT = """
import json, pickle, sys
sys.path.insert(0, sys.argv[1])
import llm_anatomy
assert llm_anatomy.__file__.startswith(sys.argv[1]), llm_anatomy.__file__
from llm_anatomy.anatomy import Anatomy
from llm_anatomy.bench.report import render_html as bench_page
from llm_anatomy.report.html import render_html as anatomy_page
from llm_anatomy.sweep.report import render_html as sweep_page
pages = {"anatomy": anatomy_page(Anatomy.from_json(open(sys.argv[2]).read())),
         "bench": bench_page(pickle.load(open(sys.argv[3], "rb"))),
         "sweep": sweep_page(json.load(open(sys.argv[4])))}
print(json.dumps({name: [page.count("Plotly.newPlot"), page.count('class="chart"')] for name, page in pages.items()}))
"""


def test_wheel_ships_the_templates_and_renders_from_them(tmp_path):
    """Build a wheel from a copy of the source, install it by unzipping, and render each report from there alone."""
    from test_bench_units import _run

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "llm_anatomy", src / "llm_anatomy", ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                            "print(build_meta.build_wheel(sys.argv[1]))", str(tmp_path / "dist")],
                           cwd=src, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = tmp_path / "dist" / build.stdout.strip().splitlines()[-1]
    names = zipfile.ZipFile(wheel).namelist()
    for template in ("report/templates/anatomy.html", "report/templates/base.html", "bench/templates/bench.html",
                     "sweep/templates/sweep.html"):
        assert f"llm_anatomy/{template}" in names, template
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    inputs = [tmp_path / "anatomy.json", tmp_path / "bench.pickle", tmp_path / "sweep_summary.json"]
    inputs[0].write_text(sample_anatomy().to_json(), encoding="utf-8")
    inputs[1].write_bytes(pickle.dumps(_run()))
    inputs[2].write_text(json.dumps(_sweep_summary()), encoding="utf-8")
    run = subprocess.run([sys.executable, "-I", "-c", WHEEL_SCRIPT, str(site), *map(str, inputs)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    drawn = json.loads(run.stdout)
    assert drawn["bench"] == [1, 5] and drawn["sweep"] == [1, 1]  # the drawing script once, a div per chart
    assert drawn["anatomy"][0] == 1 and drawn["anatomy"][1] >= 3
