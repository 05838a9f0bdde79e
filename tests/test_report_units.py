"""Numbers in the reports: one unit system (decimal GB, TB/s, TFLOP/s) stated once, and enough significant
digits that a small nonzero value never prints as zero."""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from sample_anatomy import sample_anatomy, sample_cpu_anatomy  # noqa: E402

from llm_anatomy.report import units  # noqa: E402
from llm_anatomy.report.html import plotly_js, render_html  # noqa: E402
from llm_anatomy.report.terminal import render  # noqa: E402


@pytest.mark.parametrize("value, digits, text", [
    (0.012345, 3, "0.0123"), (4.0, 3, "4"), (724.0, 3, "724"), (1234.5, 3, "1,234"), (2.5e-7, 3, "2.5e-07"),
    (-0.000123, 2, "-0.00012"), (0.0, 3, "0"), (1e-300, 3, "1e-300"), (99.96, 3, "100"),
])
def test_significant_digits(value, digits, text):
    assert units.sig(value, digits) == text


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf"), "fast", True, object()])
def test_missing_or_odd_values_print_as_not_available(bad):
    for fmt in (units.sig, units.ms, units.size, units.tbps, units.tflops, units.percent, units.joules, units.integer):
        assert fmt(bad) == "n/a", fmt


def test_each_quantity_has_one_decimal_unit():
    assert units.tflops(0.0123) == "0.0123 TFLOP/s" and units.tflops(724) == "724 TFLOP/s"
    assert units.tbps(4310) == "4.31 TB/s" and units.tbps(38) == "0.038 TB/s"  # the record's GB/s, printed in TB/s
    assert units.size(16_381_470_720) == "16.38 GB" and units.size(147_456) == "147.5 kB"
    assert units.size(1.2e12) == "1.2 TB" and units.size(512) == "512 B"
    assert units.percent(0.4523) == "45.2%" and units.percent(0.00042) == "0.042%" and units.percent(0) == "0%"
    assert units.ms(0.0123) == "0.0123 ms" and units.ms(4.123) == "4.12 ms" and units.ms(1234) == "1.23 s"
    assert units.interval(0, 81.34, "J") == "[0, 81.3] J"


def _tiny_cpu_call():
    """A call on a slow host: rates far below one TFLOP/s or TB/s, and a tiny MFU."""
    a = sample_cpu_anatomy()
    a.prefill.roofline.achieved_tflops = 0.00421
    a.prefill.roofline.achieved_gbps = 3.2
    a.prefill.mfu = 0.00038
    a.decode.roofline.achieved_gbps = 12.5
    a.ceilings.matmul_tflops = 0.04
    return a


ZERO_PRINTED = re.compile(r"(?<![\d.])0\.0+ ?(TFLOP/s|TB/s|GB|MB|J|%)")


def _visible(page: str) -> str:
    page = page.replace(plotly_js(), "")
    page = re.sub(r"<script>.*?</script>|<style>.*?</style>", "", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def _terminal(a) -> str:
    console = Console(record=True, width=400)
    render(a, console)
    return console.export_text()


def test_small_values_keep_their_digits():
    a = _tiny_cpu_call()
    for text in (_visible(render_html(a)), _terminal(a)):
        assert not ZERO_PRINTED.search(text), ZERO_PRINTED.search(text).group(0)
        assert "0.00421 TFLOP/s" in text and "0.0125 TB/s" in text
    assert "0.038%" in _visible(render_html(a))  # the prefill MFU


def test_units_are_decimal_and_stated_once():
    for a in (sample_anatomy(), sample_cpu_anatomy()):
        page, term = _visible(render_html(a)), _terminal(a)
        for text in (page, " ".join(term.split())):
            assert text.count(units.UNITS) == 1
            for other in ("GiB", "MiB", "KiB", "GB/s", "MB/s"):
                assert other not in text, other
        assert "TB/s" in page and "TFLOP/s" in page and "TB/s" in term and "TFLOP/s" in term


def test_startup_seconds_keep_their_digits():
    from llm_anatomy.report import startup_text

    a = sample_cpu_anatomy()
    assert startup_text(a) is None  # the CPU sample has no start-up record
    s = sample_anatomy().startup
    a.startup = type(s)(total_s=0.042, compile_and_capture_s=0.0, cuda_graphs=0, programmatic_dependent_launch=False)
    assert startup_text(a).startswith("0.042 s once")
    assert units.seconds(17.43) == "17.4 s" and units.seconds(0.0) == "0 s"
