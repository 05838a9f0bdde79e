"""What the reports say about a number's nature: energy intervals (one-sided when the error exceeds the value),
bytes modelled or measured, and host memory (not CUDA/GPU memory) for a call on the CPU."""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from sample_anatomy import sample_anatomy, sample_cpu_anatomy  # noqa: E402

from llm_anatomy.anatomy import EnergyRecord  # noqa: E402
from llm_anatomy.report.html import plotly_js, render_html  # noqa: E402
from llm_anatomy.report.readings import energy_reading, memory_words  # noqa: E402
from llm_anatomy.report.terminal import render  # noqa: E402
from llm_anatomy.report.trace import build_trace  # noqa: E402


def _text(page: str) -> str:
    page = page.replace(plotly_js(), "")
    page = re.sub(r"<script>.*?</script>|<style>.*?</style>", "", page, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


def _section(page: str, ident: str) -> str:
    m = re.search(rf'<section id="{ident}">(.*?)</section>', page, flags=re.S)
    assert m, ident
    return _text(m.group(1))


def _terminal(a) -> str:
    console = Console(record=True, width=400)
    render(a, console)
    return " ".join(console.export_text().split())


# ----------------------------------------------------------------------------- energy

def _short_prefill(a):
    """A 16-token prefill whose error (77.7 J) is twenty times its value (3.58 J)."""
    a.telemetry.energy[0] = EnergyRecord("prefill", 3.58, 0.0, 3.58 + 77.7, 3.58 / 16, "NVML total-energy counter",
                                         shorter_than_update=True)
    return a


def test_error_larger_than_the_value_is_an_interval_not_plus_minus():
    a = _short_prefill(sample_anatomy())
    r = energy_reading(a.telemetry.energy[0])
    assert (r.low, r.high, r.plus_minus) == (0.0, 3.58 + 77.7, None)
    page, term = _text(render_html(a)), _terminal(a)
    assert "prefill 3.58 J [0, 81.3] J" in page and "± 77.7" not in page
    assert "energy prefill: 3.58 J in [0, 81.3] J, 0.224 J per token in [0, 5.08] J" in term
    assert "± 77.7" not in term
    assert "energy decode:" in term and "± 1.2" not in term  # the record's interval, never a made-up ±


def test_interval_given_by_the_record_is_shown_as_it_is():
    a = sample_anatomy()
    e = a.telemetry.energy[0]
    e.low_j, e.high_j, e.note = 2.9, 19.5, "shorter than the counter's 100 ms update period"
    r = energy_reading(e)
    assert (r.low, r.high, r.plus_minus) == (2.9, 19.5, None)
    page, term = _text(render_html(a)), _terminal(a)
    assert "[2.9, 19.5] J" in page and "shorter than the counter's 100 ms update period" in page
    assert f"energy prefill: {r.text()}" in term and "[2.9, 19.5] J" in term
    args = next(ev["args"] for ev in build_trace(a)["traceEvents"] if ev["name"] == "prefill" and ev["ph"] == "X"
                and ev["cat"] == "phase")
    assert (args["energy_low_j"], args["energy_high_j"]) == (2.9, 19.5) and "energy_uncertainty_j" not in args


def test_energy_card_carries_the_interval():
    a = sample_anatomy()
    decode = a.telemetry.energy[1]
    decode.low_j, decode.high_j = 0.0, 3 * decode.joules
    card = re.search(r'<div class="label">Energy per token</div><div class="value">(.*?)</div>', render_html(a))
    assert card and " in [0, " in html.unescape(card.group(1))


# ----------------------------------------------------------------------------- bytes

def test_bytes_are_labelled_modelled_unless_measured():
    a = sample_anatomy(steps=50)
    page, term = _text(render_html(a)), _terminal(a)
    assert "16.43 GB modelled" in page and "16.43 GB modelled" in term
    assert "measured (DRAM counters" not in page and "MB moved (measured)" not in page
    assert "Points are placed by modelled bytes" in page

    a.prefill.dram_bytes = 17.9e9
    a.decode_steps[0].dram_bytes = 16.45e9
    page, term = _text(render_html(a)), _terminal(a)
    assert "17.9 GB measured (DRAM counters; 16.43 GB modelled)" in page
    assert "17.9 GB measured (DRAM counters; 16.43 GB modelled)" in term
    assert "step 1 (context 130): 16.45 GB measured (DRAM counters" in term
    assert "MB moved (measured)" in page and "16,450" in page
    raw = render_html(a)
    assert 'colspan="16"' in raw  # the "steps left out" row spans the extra column
    gpu = [ev for ev in build_trace(a)["traceEvents"] if ev.get("cat") == "gpu"]
    assert gpu[0]["args"]["bytes_source"] == "measured" and gpu[0]["args"]["dram_bytes"] == 17.9e9
    assert gpu[2]["args"]["bytes_source"] == "modelled" and "dram_bytes" not in gpu[2]["args"]


# ----------------------------------------------------------------------------- host memory on the CPU

def test_cpu_call_speaks_of_host_memory():
    a = sample_cpu_anatomy()
    raw = render_html(a)
    for ident in ("memory",):
        census = _section(raw, ident)
        assert "host memory" in census and "rest of this process" in census and "other processes and the OS" in census
        for word in ("CUDA", "GPU", "device memory", "allocator"):
            assert word not in census, word
    page = _text(raw)
    assert "of host memory" in page and "6.2% of host memory" in page  # the KV pool's share
    assert "GPU memory" not in page and "% of the device" not in page
    assert "CPU ms" in page and "GPU ms" not in page
    term = _terminal(a)
    assert "Memory census of host memory" in term and "68.72 GB of host memory" in term
    assert "the host memory left would hold" in term and "(6.2% of host memory)" in term
    census = term[term.index("Memory census"):term.index("activation peak")]
    for word in ("CUDA", "GPU", "allocator"):
        assert word not in census, word
    assert any(ev["args"].get("name") == "CPU" for ev in build_trace(a)["traceEvents"] if ev["name"] == "thread_name")


def test_gpu_call_speaks_of_gpu_memory():
    a = sample_anatomy()
    census = _section(render_html(a), "memory")
    assert "GPU memory" in census and "CUDA graphs" in census and "host memory" not in census
    term = _terminal(a)
    assert "Memory census of GPU memory" in term and "150.8 GB of GPU memory" in term


def test_census_kind_in_the_record_wins_over_the_device_type():
    a = sample_anatomy()
    a.memory.kind = "host"  # e.g. a unified-memory device whose census is the host's
    words = memory_words(a)
    assert words.host and words.noun == "host memory" and words.processor == "GPU"
    labels = [label for _, label, _ in words.rows]
    assert "available" in labels and "CUDA graphs" in labels  # nonzero graphs stay: every byte in one row
    assert sum(v for _, _, v in words.rows) == a.memory.total
