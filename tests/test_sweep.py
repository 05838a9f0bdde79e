"""`llm-anatomy sweep` on a tiny synthetic Qwen3 on the CPU: the grid, the records, resume, out-of-memory points,
the energy arithmetic, the scheduler replay and the report's data."""

import argparse
import io
import json
import re

import pytest
import torch
from rich.console import Console

from llm_anatomy import Engine
from llm_anatomy.anatomy import Anatomy, Ceilings
from llm_anatomy.errors import AnatomyError
from llm_anatomy.probe.telemetry import RawSample
from llm_anatomy.report.html import plotly_js
from llm_anatomy.sweep import measure as measure_module
from llm_anatomy.sweep import run as run_module
from llm_anatomy.sweep.cli import add_sweep_parser
from llm_anatomy.sweep.energy import TokenClock, counter_updates, phase_energy
from llm_anatomy.sweep.grid import Grid, Point, Precision, parse_int_list
from llm_anatomy.sweep.measure import Run, Telemetry, run_batch
from llm_anatomy.sweep.planner import prefill_schedule
from llm_anatomy.sweep.report import HTML_FILE, SUMMARY_FILE, measured_ridge, write_report
from llm_anatomy.sweep.run import SweepOptions, engine_accepts, run_sweep

from conftest import TINY
from test_report_files import chromium, load_in_chromium  # noqa: F401 (chromium is a fixture)

CEILINGS = Ceilings("cpu (test)", read_gbps=20.0, gemv_gbps=15.0, matmul_tflops=0.5, datasheet_gbps=None,
                    datasheet_tflops=None, measured_at="test")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen3 config (no weights: the sweep runs it with synthetic ones)."""
    directory = tmp_path_factory.mktemp("tiny")
    (directory / "config.json").write_text(json.dumps({**TINY, "model_type": "qwen3", "torch_dtype": "float32"}))
    return directory


def options(tiny, **kw):
    return SweepOptions(model=str(tiny), weights="synthetic", device="cpu", **{"energy_seconds": 0, **kw})


def sweep(tiny, out, prompt="8", batch="1", output="4", telemetry=None, **kw):
    grid = Grid.parse(prompt, batch, output)
    meta, records = run_sweep(grid, options(tiny, **kw), out, ceilings=CEILINGS, telemetry=telemetry,
                              console=Console(file=io.StringIO()))
    write_report(out, meta, records, Console(file=io.StringIO(), width=200))
    return meta, records


def test_the_calibrated_ceilings_are_what_the_meta_keeps(tiny, tmp_path, monkeypatch):
    """Without ceilings given, the sweep calibrates (here: a stand-in calibration) and keeps the ceilings
    themselves, which the report reads back as Ceilings."""
    import dataclasses

    from llm_anatomy.probe import ceilings as ceilings_module

    monkeypatch.setattr(ceilings_module, "load_or_calibrate",
                        lambda device, quick=False: ceilings_module.Calibration(CEILINGS, quick=quick))
    meta, _ = run_sweep(Grid.parse("8", "1", "2"), options(tiny), tmp_path / "out", console=Console(file=io.StringIO()))
    assert meta["ceilings"] == dataclasses.asdict(CEILINGS)
    assert Ceilings(**meta["ceilings"]) == CEILINGS


class FakeNvml:
    """NVML's energy counter as a board drawing `watts`: it steps every `update_ms`, read every 5 ms."""

    def __init__(self, watts=200.0, update_ms=20):
        self.watts, self.update_ns = watts, update_ms * 1_000_000

    def window(self, t0_ns, t1_ns, margin_ns=300_000_000):
        import time

        end = min(t1_ns + margin_ns, time.perf_counter_ns())
        t = (t0_ns - margin_ns) // 5_000_000 * 5_000_000
        out = []
        while t <= end:
            energy_mj = int(t // self.update_ns * self.update_ns / 1e9 * self.watts * 1e3)
            out.append(RawSample(t, int(self.watts * 1e3), energy_mj, None, None, None, None, None, None, None))
            t += 5_000_000
        return out


def test_axes_parse_lists_and_ranges():
    assert parse_int_list("128..1024", "--x", 1, 10 ** 6) == (128, 256, 512, 1024)
    assert parse_int_list("1..6,3", "--x", 1, 100) == (1, 2, 3, 4, 6)
    grid = Grid.parse("8", "1,2", "4", "bf16", "auto,bf16")
    assert grid.precisions == (Precision(None, "auto"),)
    assert [p.key for p in grid.points()] == ["bf16-kvauto-p8-b1-o4", "bf16-kvauto-p8-b2-o4"]
    assert Precision("fp8", "fp8").engine_settings() == {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    assert Precision().engine_settings() == {}


@pytest.mark.parametrize("argv,message", [
    (["--prompt-tokens", "0"], "--prompt-tokens: 0 is out of range; values must be in 1..10000000"),
    (["--batch", "8..2"], "--batch: range 8..2 runs downwards; write it as 2..8"),
    (["--output-tokens", "4,x"], "--output-tokens: 'x' in '4,x' is not an integer"),
    (["--batch", "1,,2"], "--batch: empty value"),
    (["--batch", "5000"], "--batch: 5000 is out of range"),
    (["--prompt-tokens", "500", "--output-tokens", "20"], "is 520 tokens, past the context of"),
    (["--quantization", "int4"], "--quantization: unknown value 'int4'; use bf16, none, fp8"),
    (["--kv-cache-dtype", "fp16"], "--kv-cache-dtype: unknown value 'fp16'"),
    (["--energy-seconds", "0.1"], "--energy-seconds must be 0 (no energy figures) or in 0.3..60"),
    (["--kv-cache-tokens", "0"], "--kv-cache-tokens must be >= 1"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
])
def test_bad_values_are_refused_before_any_work(tiny, tmp_path, monkeypatch, argv, message):
    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: pytest.fail("an engine was started"))
    parser = argparse.ArgumentParser()
    add_sweep_parser(parser.add_subparsers())
    args = parser.parse_args(["sweep", str(tiny), "--device", "cpu", "--out", str(tmp_path / "out"), *argv])
    with pytest.raises(AnatomyError) as info:
        args.handler(args)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_fp8_axis_refused_with_one_line_while_the_engine_lacks_it(tiny, tmp_path, monkeypatch):
    if engine_accepts("quantization"):
        pytest.skip("this engine has fp8")
    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: pytest.fail("an engine was started"))
    with pytest.raises(AnatomyError, match=r"^--quantization fp8: this engine has no quantization setting yet"):
        run_sweep(Grid.parse("8", "1", "4", "bf16,fp8"), options(tiny), tmp_path / "out", ceilings=CEILINGS)


def test_out_dir_of_another_sweep_or_a_file_is_refused(tiny, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(AnatomyError, match="is a file; give a directory"):
        sweep(tiny, tmp_path / "file")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "sweep_meta.json").write_text(json.dumps({"identity": {"model": "another"}}))
    with pytest.raises(AnatomyError, match="holds a sweep of .*use --fresh to replace it"):
        sweep(tiny, tmp_path / "other")


@pytest.fixture(scope="module")
def small_sweep(tiny, tmp_path_factory):
    """Two prompt lengths by two batches, with energy: every plot of the report has data. (out dir, records)"""
    out = tmp_path_factory.mktemp("small-sweep") / "out"
    _, records = sweep(tiny, out, prompt="8,24", batch="1,3", output="4",
                       telemetry=Telemetry(FakeNvml(200.0), "fake NVML", 200.0), energy_seconds=0.3,
                       kv_cache_tokens=2048)  # room for decode blocks of 0.3 s
    return out, records


def test_a_small_sweep_writes_every_plots_data(small_sweep):
    out, records = small_sweep
    lines = (out / "sweep.jsonl").read_text().splitlines()
    assert len(lines) == len(records) == 4
    for r in map(json.loads, lines):
        assert r["status"] == "ok", r
        for key in ("ttft_ms", "prefill_ms", "prefill_tflops", "prefill_mfu", "tpot_ms", "decode_mbu",
                    "decode_kv_share", "output_tokens_per_s", "total_tokens_per_s", "prefill_j_per_token",
                    "decode_j_per_token", "kv_bytes", "kv_bytes_per_token"):
            assert r[key] is not None and r[key] > 0, key
        assert r["kv_bytes"] == r["batch"] * (r["prompt_tokens"] + 3) * r["kv_bytes_per_token"]
        assert r["output_tokens_per_s"] * r["elapsed_ms"] / 1e3 == pytest.approx(r["batch"] * 4)
        assert sum(s["tokens"] for s in r["steps"]["prefill"]) == r["batch"] * r["prompt_tokens"]
        assert r["steps"]["decode"]["steps"] == 3
        for phase in ("prefill", "decode"):  # the fake board draws 200 W throughout
            assert r["energy"][phase]["mean_power_w"] == pytest.approx(200.0, rel=0.1)
            assert r["energy"][phase]["intervals"] >= 2
        anatomy = Anatomy.from_json((out / r["anatomy"]).read_text())
        assert len(anatomy.output_token_ids) == 4 and len(anatomy.prompt_token_ids) == r["prompt_tokens"]
        assert anatomy.prefill.batch_size == r["batch"]  # a step shared by the batch: its tokens are all of theirs
    summary = json.loads((out / SUMMARY_FILE).read_text())
    for name in ("prefill", "decode", "batch", "energy", "capacity", "validation"):
        series = summary["plots"][name]["series"]
        assert series and all(s["x"] and len(s["x"]) == len(s["y"]) for s in series), name
    assert {s["name"] for s in summary["plots"]["prefill"]["series"]} == {"bf16: prefill ms", "bf16: MFU"}
    assert summary["plots"]["prefill"]["series"][0]["x"] == [8, 24]
    assert [r["batches"] for r in summary["ridges"]] == [[1, 3], [1, 3]]
    assert summary["leave_one_out"]["summary"]["tpot_ms"]["points"] == 4
    html = (out / HTML_FILE).read_text()
    for name in ("prefill", "decode", "batch", "energy", "capacity", "validation"):
        assert f'id="chart-{name}"' in html
    assert html.count(plotly_js()) == 1 and html.count("<script") == 2  # plotly inlined once, nothing fetched
    assert not re.search(r"<script[^>]+src=|<link\b", html) and "default-src 'none'" in html


def test_the_sweep_page_draws_its_charts_in_a_browser(small_sweep, chromium):
    page = small_sweep[0] / HTML_FILE
    load = load_in_chromium(page)
    assert load.errors == []
    assert load.requests and all(url == page.resolve().as_uri() or url.startswith(("data:", "blob:"))
                                 for url in load.requests)
    assert set(load.charts) == {f"chart-{name}" for name in
                                ("prefill", "decode", "batch", "energy", "capacity", "validation")}
    for cid, drawn in load.charts.items():
        assert drawn["svgs"] >= 1 and drawn["traces"] >= 1, cid


def test_interrupted_sweep_resumes_without_redoing_finished_points(tiny, tmp_path, monkeypatch):
    out, real, measured = tmp_path / "out", run_module.measure_point, []

    def interrupted(engine, point, *a, **k):
        if len(measured) == 1:
            raise KeyboardInterrupt
        measured.append(point.key)
        return real(engine, point, *a, **k)

    monkeypatch.setattr(run_module, "measure_point", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sweep(tiny, out, batch="1,2,3")
    assert [json.loads(x)["key"] for x in (out / "sweep.jsonl").read_text().splitlines()] == measured
    with open(out / "sweep.jsonl", "a") as f:
        f.write('{"key": "bf16-kvauto-p8-b2-o4", "sta')  # killed in the middle of a write
    first = list(measured)
    monkeypatch.setattr(run_module, "measure_point", lambda engine, point, *a, **k: (
        measured.append(point.key), real(engine, point, *a, **k))[1])
    meta, records = sweep(tiny, out, batch="1,2,3")
    assert measured == first + ["bf16-kvauto-p8-b2-o4", "bf16-kvauto-p8-b3-o4"]
    keys = [json.loads(x)["key"] for x in (out / "sweep.jsonl").read_text().splitlines()]
    assert keys == ["bf16-kvauto-p8-b1-o4", "bf16-kvauto-p8-b2-o4", "bf16-kvauto-p8-b3-o4"]
    measured.clear()
    meta, records = sweep(tiny, out, batch="1,2,3")  # all done: nothing measured, the report written again
    assert measured == [] and len(records) == 3
    meta["engines"]["bf16-kvauto"]["weights_source"] = "/somewhere/else"  # as if --weights auto found a checkpoint
    (out / "sweep_meta.json").write_text(json.dumps(meta))
    with pytest.raises(AnatomyError, match="holds points measured with /somewhere/else, but the engine now runs"):
        sweep(tiny, out, batch="1,2,3,4")


def test_points_that_do_not_fit_are_recorded_and_the_sweep_goes_on(tiny, tmp_path, monkeypatch):
    real_step = Engine.step

    def step(engine):  # the batch-2 points run out of device memory in the middle of their run
        if len(engine.scheduler.running) == 2 and any(s.output_token_ids for s in engine.scheduler.running):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_step(engine)

    monkeypatch.setattr(Engine, "step", step)
    meta, records = sweep(tiny, tmp_path / "out", prompt="8,12", batch="1,2,8", output="8", kv_cache_tokens=64)
    status = {(r["prompt_tokens"], r["batch"]): (r["status"], r.get("reason", "")) for r in records}
    assert status[(8, 1)][0] == status[(12, 1)][0] == "ok"  # after an out-of-memory point: its blocks came back
    assert status[(8, 2)] == status[(12, 2)] == ("oom", "out of device memory: CUDA out of memory. Tried to allocate "
                                                         "2.00 GiB")
    assert status[(8, 8)][0] == "oom" and status[(8, 8)][1].startswith(
        "the KV pool holds 4 blocks of 16 tokens (64 tokens); 8 sequences of 8 + 8 tokens need 8")
    summary = json.loads((tmp_path / "out" / SUMMARY_FILE).read_text())
    assert [r["status"] for r in summary["records"]].count("oom") == 4


def test_a_failed_run_gives_its_blocks_back(tiny):
    engine = Engine.from_pretrained(tiny, device="cpu", weights="synthetic", kv_cache_tokens=64, max_num_seqs=4)
    calls = []
    real = engine.step

    def failing():
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("out of memory")
        return real()

    engine.step = failing
    with pytest.raises(torch.OutOfMemoryError):
        run_batch(engine, [[1, 2, 3]] * 3, 6)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks and not engine.has_work()
    engine.step = lambda: []  # nothing schedulable (the scheduler preempts rather than stall: a guard, not a path)
    with pytest.raises(measure_module.KVPoolExhausted, match="cannot admit the 2 sequences"):
        run_batch(engine, [[1] * 20] * 2, 4)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("prompt,batch", [(100, 3), (20, 4), (64, 2)])
def test_the_scheduler_replay_matches_the_engines_prefill_steps(tiny, prompt, batch):
    engine = Engine.from_pretrained(tiny, device="cpu", weights="synthetic", kv_cache_tokens=512, max_num_seqs=4,
                                    max_num_batched_tokens=64)
    run = run_batch(engine, [[7] * prompt] * batch, 2)
    measured = [(r.step.num_tokens, len(r.step.seqs), sum(t is not None for t in r.step.tokens))
                for r in run.prefill_steps]
    replay = [(sum(n for n, _ in seqs), len(seqs), done) for seqs, done in prefill_schedule(batch, prompt, 64, 4)]
    assert measured == replay


def test_phase_energy_between_counter_updates():
    # 100 W, the counter stepping every 100 ms, sampled every 10 ms; 1000 tokens/s from t = 0 to 1 s
    samples = [RawSample(t * 10_000_000, None, int((t * 10 // 100) * 100 * 100), None, None, None, None, None, None,
                         None) for t in range(0, 120)]
    tokens = TokenClock(0, [(i * 1_000_000, 1) for i in range(1, 1001)])
    assert counter_updates(samples)[:2] == [(100_000_000, 10_000), (200_000_000, 20_000)]
    e = phase_energy(samples, [(0, 1_000_000_000)], tokens, 0.01, "test")
    assert e.joules_per_token == pytest.approx(0.1) and e.intervals == 9 and e.mean_power_w == pytest.approx(100)
    assert e.uncertainty_j_per_token == pytest.approx(0.1 * 0.01 * 2 ** 0.5 / 0.9)
    assert phase_energy(samples, [(120_000_000, 190_000_000)], tokens, 0.01, "test") is None  # no update pair inside


def test_measured_ridge_where_the_step_leaves_its_memory_floor():
    series = [{"batch": b, "decode_bytes_per_step": 100.0 + b, "decode_step_ms": (100.0 + b) * (1 + e)}
              for b, e in ((1, 0.0), (2, 0.01), (4, 0.1), (8, 0.5), (16, 1.0))]
    ridge = measured_ridge(series)
    assert 4 < ridge < 8  # 26% above the floor falls between batch 4 (10%) and 8 (50%)
    assert measured_ridge(series[:3]) is None


def test_report_of_an_empty_or_failed_sweep_still_renders(tiny, tmp_path):
    out = tmp_path / "out"
    meta, records = sweep(tiny, out, prompt="8", batch="16", output="4", kv_cache_tokens=16)
    assert [r["status"] for r in records] == ["oom"]
    summary = write_report(out, meta, records)
    html = (out / HTML_FILE).read_text()
    # the validation plot has a series per metric, all empty: a note says so instead of drawing empty axes
    assert "<h2>Leave-one-out: each point predicted from the others</h2><p class=\"note\">No data" in html
    assert 'id="chart-validation"' not in html and 'id="chart-capacity"' in html
    assert not summary["leave_one_out"]["available"]


def test_run_records_each_engine_step_once(tiny):
    engine = Engine.from_pretrained(tiny, device="cpu", weights="synthetic", kv_cache_tokens=256, max_num_seqs=4)
    run = run_batch(engine, [[3] * 10] * 3, 5)
    assert isinstance(run, Run) and len(run.prefill_steps) == 1 and len(run.decode_steps) == 4
    assert [len(t.steps) for t in run.traces] == [5, 5, 5]
    walls = run.walls_ms()
    assert sum(walls.values()) == pytest.approx((run.steps[-1].step.t_end_ns - run.t0_ns) / 1e6)
    assert Point(Precision(), 10, 3, 5).tokens_per_sequence == 15


def test_the_roofline_ridge_is_where_flops_time_meets_bytes_time(tiny):
    from llm_anatomy.models.config import ModelConfig
    from llm_anatomy.probe.cost import decode_cost
    from llm_anatomy.sweep.planner import roofline_ridge_batch

    config = ModelConfig.from_hf({**TINY, "model_type": "qwen3"})
    ridge = roofline_ridge_batch(config, torch.float32, Precision(), 100, 1000.0, 2.0)  # ridge at 2 FLOP/B
    assert ridge > 2
    for b, below in ((int(ridge), True), (int(ridge) + 1, False)):
        cost = decode_cost(config, torch.float32, [100] * b)
        assert (cost.flops / 2e12 < cost.bytes / 1000e9) == below
    # each sequence brings at most ~3 FLOP per byte of its own: a ridge at 5 is never reached, one at 0.1 from batch 1
    assert roofline_ridge_batch(config, torch.float32, Precision(), 100, 1000.0, 5.0) is None
    assert roofline_ridge_batch(config, torch.float32, Precision(), 100, 1000.0, 0.1) == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_sweep_measures_energy_memory_and_validates_itself(tmp_path):
    out = tmp_path / "out"
    grid = Grid.parse("128,1024", "1,4", "64")
    opts = SweepOptions(model="Qwen/Qwen3-0.6B", weights="synthetic", device="cuda", energy_seconds=1.0,
                        gpu_memory_utilization=0.5)
    meta, records = run_sweep(grid, opts, out, console=Console(file=io.StringIO()))
    summary = write_report(out, meta, records)
    assert [r["status"] for r in records] == ["ok"] * 4
    for r in records:
        assert r["peak_memory_bytes"] > r["activation_peak_bytes"] > 0
        for phase in ("prefill", "decode"):  # NVML's counter, over windows of at least a second
            e = r["energy"][phase]
            assert e["joules_per_token"] > 0 and e["intervals"] >= 3 and e["seconds"] >= 0.5
            assert e["uncertainty_j_per_token"] < 0.05 * e["joules_per_token"]
    assert meta["engines"]["bf16-kvauto"]["memory"]["total"] > 0 and meta["gpu"] is not None
    assert summary["leave_one_out"]["available"]


def test_a_gpu_engines_record_counts_its_graphs(monkeypatch):
    """The memory census of an engine on a GPU: its CUDA graphs' bytes come from the engine's GraphRunner (none
    where it captured no graphs)."""
    from types import SimpleNamespace

    from llm_anatomy.probe import memory

    seen = []
    monkeypatch.setattr(memory, "census", lambda device, weights, pool, graphs, peak=None: seen.append(graphs) or
                        memory.MemoryCensus.__new__(memory.MemoryCensus))
    monkeypatch.setattr(run_module.dataclasses, "asdict", lambda census: {"graphs": seen[-1]})
    pool = SimpleNamespace(total_bytes=10, bytes_per_token=2, capacity_tokens=5, block_size=16)
    weights = SimpleNamespace(bytes=7, label="synthetic", kind="synthetic", source=None, num_parameters=3)
    for graphs, want in ((SimpleNamespace(graph_bytes=123), 123), (None, 0)):
        engine = SimpleNamespace(device=torch.device("cuda"), pool=pool, weights=weights, graphs=graphs,
                                 max_num_seqs=1, max_num_batched_tokens=8, max_model_len=64, startup_seconds=1.0)
        assert run_module.engine_record(engine, Precision())["memory"] == {"graphs": want}


def test_a_sweep_on_a_known_gpu_reports_against_its_datasheet(tiny, tmp_path):
    """A sweep whose device the GPU table knows (here: records of the CPU labelled as an H200's) predicts and
    validates against that GPU: the summary and the HTML are written."""
    meta, records = sweep(tiny, tmp_path / "out", prompt="8,12", batch="1,2")
    meta = {**meta, "gpu": "h200"}
    summary = write_report(tmp_path / "out", meta, records)
    assert "leave_one_out" in summary and (tmp_path / "out" / HTML_FILE).exists()


def test_an_fp8_points_bytes_are_the_fp8_engines(tiny, tmp_path):
    """The cost model behind each point's bytes and MBU is its engine's precision: fp8 weights read a byte a
    parameter (and a scale per row), so an fp8 point's decode step reads the bf16 one's bytes less its linear
    layers' difference, as the planner's precision shapes count it."""
    from llm_anatomy.probe.cost import DEFAULT_SHAPES, decode_cost
    from llm_anatomy.sweep.planner import precision_shapes

    grid = Grid.parse("8", "2", "4", quantization="bf16,fp8")
    meta, records = run_sweep(grid, options(tiny), tmp_path / "out", ceilings=CEILINGS,
                              console=Console(file=io.StringIO()))
    by = {r["precision"]: r for r in records}
    assert by["bf16"]["status"] == by["fp8"]["status"] == "ok"
    config = run_module.identity(options(tiny))[1]
    linear = {name: decode_cost(config, torch.float32, [10, 10], shapes).part("linear", "bytes")
              for name, shapes in (("bf16", DEFAULT_SHAPES), ("fp8", precision_shapes(Precision("fp8"))))}
    assert linear["fp8"] < linear["bf16"] / 3  # float32 weights here: a quarter, and the scales
    saved = by["bf16"]["decode_bytes_per_step"] - by["fp8"]["decode_bytes_per_step"]
    assert saved == pytest.approx(linear["bf16"] - linear["fp8"], rel=1e-9)
    # the fp8 prefill attention is the plan of fp8 weights with the fp8 KV cache only, as engine/plan.py has it
    assert precision_shapes(Precision("fp8", "fp8")).fp8_prefill_attention
    assert not (precision_shapes(Precision("fp8")).fp8_prefill_attention
                or precision_shapes(Precision(None, "fp8")).fp8_prefill_attention)
