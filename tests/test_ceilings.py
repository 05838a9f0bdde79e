"""Device ceilings: datasheet figures from the GPU table, calibration on the CPU, the per-device cache, the summary."""

import dataclasses
import json
import math
from datetime import datetime, timedelta, timezone

import pytest
import torch

from llm_anatomy.anatomy import Ceilings
from llm_anatomy.gpus import gpu_for_device, gpus
from llm_anatomy.probe import ceilings as C

CPU = torch.device("cpu")


# ---- datasheet table ---------------------------------------------------------------------------

def test_an_h200_reports_its_datasheet_ceilings(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    c = C.datasheet_ceilings("cuda:0")
    assert (c.device, c.datasheet_gbps, c.datasheet_tflops) == ("NVIDIA H200", 4800.0, 989.4)
    assert c.datasheet_source == gpus()["h200"].source and "H200 SXM" in c.datasheet_source
    assert (c.read_gbps, c.gemv_gbps, c.matmul_tflops, c.measured_at) == (None, None, None, "")


def test_a_gpu_without_an_entry_has_no_datasheet(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H20")
    c = C.datasheet_ceilings("cuda:0")
    assert (c.datasheet_gbps, c.datasheet_tflops, c.datasheet_source) == (None, None, "")


def test_cpu_has_no_datasheet():
    c = C.datasheet_ceilings(CPU)
    assert c.device.startswith("cpu")
    assert (c.read_gbps, c.gemv_gbps, c.matmul_tflops) == (None, None, None)
    assert (c.datasheet_gbps, c.datasheet_tflops, c.datasheet_source, c.measured_at) == (None, None, "", "")
    assert c.ridge is None


# ---- calibration on the CPU --------------------------------------------------------------------------------------

SMALL = dict(read_bytes=8 << 20, gemv_bytes=4 << 20, matmul_n=128, matmul_s=0.05)


def test_a_cpu_measurement_gives_every_ceiling_and_says_whether_it_was_idle():
    said = []
    result = C.measure(CPU, quick=True, progress=said.append, **SMALL)
    c = result.ceilings
    for v in (c.read_gbps, c.gemv_gbps, c.matmul_tflops, c.matmul_burst_tflops):
        assert v is not None and math.isfinite(v) and v > 0
    assert c.device.startswith("cpu") and ("bf16 matmul" in c.device or "fp32 matmul" in c.device)
    assert datetime.fromisoformat(c.measured_at)
    assert c.datasheet_gbps is None and c.datasheet_source == ""
    assert isinstance(result.busy, tuple) and not result.from_cache and result.quick
    assert [s.split(":")[1].split()[0] for s in said] == ["matrix", "read", "GEMV"]  # each stage announced


def test_calibrating_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    C.calibrate(CPU, quick=True, **SMALL)
    assert torch.equal(torch.rand(4), expected)


def test_only_cuda_and_cpu_can_be_calibrated():
    with pytest.raises(ValueError, match="only cuda and cpu"):
        C.measure("meta")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quick_gpu_calibration_sustained_below_burst():
    result = C.measure(torch.device("cuda"), quick=True)
    c = result.ceilings
    for v in (c.read_gbps, c.gemv_gbps, c.matmul_tflops, c.matmul_burst_tflops):
        assert v is not None and math.isfinite(v) and v > 0
    assert c.matmul_tflops <= c.matmul_burst_tflops * 1.05  # the power limit can only take the rate down
    sheet = gpu_for_device(torch.cuda.get_device_name())
    if sheet is not None:
        assert c.datasheet_gbps == sheet.memory_gbps and c.datasheet_source == sheet.source
        assert c.read_gbps < 1.1 * sheet.memory_gbps and c.matmul_burst_tflops < 1.05 * sheet.bf16_tflops
    assert "power limit" in C.device_key("cuda") or "W limit" in C.device_key("cuda")


# ---- burst and sustained rates -----------------------------------------------------------------------------------

def test_burst_is_the_first_tenth_of_a_second_and_sustained_the_second_halfs_median():
    # 10 ms batches of one product of 1e12 FLOP: 100 TFLOP/s for 0.2 s, then the clocks drop to 80, then 70
    seconds = [0.01] * 20 + [0.0125] * 40 + [1 / 70] * 60
    rates = C.matmul_rates(seconds, 1e12, 1, torch.bfloat16, 8192)
    assert rates.burst_tflops == pytest.approx(100.0)
    assert rates.sustained_tflops == pytest.approx(70.0)  # the second half (by device time) is all at 70
    assert rates.run_s == pytest.approx(0.2 + 0.5 + 60 / 70)
    assert min(rates.settled_tflops) == pytest.approx(70.0) and len(rates.settled_tflops) < 60 + 1


def test_batches_of_several_calls_count_their_device_time():
    # 5 products per batch: each batch's start moves on by 5 x its per-call seconds
    seconds = [0.01] * 4 + [0.02] * 4
    rates = C.matmul_rates(seconds, 2e12, 5, torch.bfloat16, 8192)
    assert rates.run_s == pytest.approx(5 * (0.04 + 0.08))
    assert rates.burst_tflops == pytest.approx(200.0)  # batches starting at 0, 0.05 s
    assert rates.sustained_tflops == pytest.approx(100.0)


# ---- is the device busy? -----------------------------------------------------------------------------------------

def test_an_idle_device_has_no_busy_reasons():
    idle = C.Readings(other_processes=0, spreads={"read": 0.01, "sustained matmul": C.MAX_SPREAD},
                      of_datasheet={"read bandwidth": 0.9, "sustained matmul rate": C.MIN_OF_DATASHEET})
    assert C.busy_reasons(idle) == ()
    assert C.busy_reasons(C.Readings()) == ()  # nothing known: nothing claimed


@pytest.mark.parametrize("readings, words", [
    (C.Readings(other_processes=2), "2 other process(es) on the GPU"),
    (C.Readings(spreads={"read": 0.01, "GEMV": 0.4}),
     "the GEMV repeats disagree: their interquartile range is 40% of the median"),
    (C.Readings(of_datasheet={"sustained matmul rate": 0.3}), "the sustained matmul rate is 30% of the datasheet's"),
])
def test_busy_readings_are_named(readings, words):
    reasons = C.busy_reasons(readings)
    assert len(reasons) == 1 and words in reasons[0]


@pytest.mark.parametrize("listed, own, others", [
    ([], 100, 0),
    ([100], 100, 0),  # this process alone
    ([100, 7, 8], 100, 2),
    ([7, 7], 100, 0),  # another pid namespace (a container): the one listed twice (compute, graphics) is this one
    ([7, 8, 9], 100, 2),  # another namespace: one of them is this process
])
def test_other_processes_on_the_gpu(listed, own, others):
    assert C.other_processes(listed, own) == others


def test_spread_is_the_interquartile_range_over_the_median():
    assert C.spread([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert C.spread([1.0, 2.0]) == 0.0  # too few repeats to judge
    assert C.spread([1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 1.0, 1.0]) > C.MAX_SPREAD  # bimodal: time-sliced with another


def test_a_measurement_with_other_processes_on_the_gpu_is_busy(monkeypatch):
    """measure() feeds what NVML lists into the judgement (the CPU path with the GPU queries stubbed)."""
    monkeypatch.setattr(C, "_other_processes", lambda device: 3)
    result = C.measure(CPU, quick=True, **SMALL)
    assert any("3 other process(es)" in r for r in result.busy)


# ---- cache -------------------------------------------------------------------------------------------------------

def _record(read=50.0, device="cpu: test", measured_at=None):
    return Ceilings(device=device, read_gbps=read, gemv_gbps=30.0, matmul_tflops=0.9, datasheet_gbps=None,
                    datasheet_tflops=None, datasheet_source="",
                    measured_at=measured_at or datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    matmul_burst_tflops=1.1)


class FakeMeasure:
    """Stands in for C.measure: returns the given calibrations in turn and counts the calls."""

    def __init__(self, *results):
        self.results, self.calls = list(results), []

    def __call__(self, device, quick=False, progress=None, **sizes):
        self.calls.append(quick)
        return self.results.pop(0)


def test_cache_location(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert C.cache_path() == tmp_path / "xdg" / "llm-anatomy" / "ceilings.json"
    assert C.cache_path(tmp_path / "mine") == tmp_path / "mine" / "ceilings.json"


def test_an_idle_calibration_is_cached_and_then_served_from_the_cache(tmp_path, monkeypatch):
    fake = FakeMeasure(C.Calibration(_record(50.0)))
    monkeypatch.setattr(C, "measure", fake)
    first = C.load_or_calibrate(CPU, tmp_path)
    assert not first.from_cache and fake.calls == [False]
    again = C.load_or_calibrate(CPU, tmp_path)
    assert again.from_cache and again.ceilings == first.ceilings and fake.calls == [False]
    assert C.cached_ceilings(CPU, tmp_path).matmul_burst_tflops == 1.1
    assert C.device_key(CPU) in json.loads((tmp_path / "ceilings.json").read_text())["entries"]


def test_a_busy_calibration_is_returned_but_never_cached(tmp_path, monkeypatch, caplog):
    busy = C.Calibration(_record(5.0), busy=("2 other process(es) on the GPU (NVML)",))
    fake = FakeMeasure(busy, C.Calibration(_record(50.0)))
    monkeypatch.setattr(C, "measure", fake)
    result = C.load_or_calibrate(CPU, tmp_path, quick=True)
    assert result is busy
    assert "busy" in caplog.text and "2 other process(es)" in caplog.text and "not cached" in caplog.text
    assert C.cached_ceilings(CPU, tmp_path) is None
    assert C.load_or_calibrate(CPU, tmp_path, quick=True).ceilings.read_gbps == 50.0  # measured again, then kept
    assert fake.calls == [True, True] and C.cached_ceilings(CPU, tmp_path).read_gbps == 50.0


def test_quick_entries_serve_only_quick_requests_and_recalibrate_measures(tmp_path, monkeypatch):
    fake = FakeMeasure(C.Calibration(_record(77.0)), C.Calibration(_record(78.0)))
    monkeypatch.setattr(C, "measure", fake)
    C.store_ceilings(CPU, _record(10.0), tmp_path, quick=True)
    assert C.load_or_calibrate(CPU, tmp_path, quick=True).ceilings.read_gbps == 10.0
    assert C.load_or_calibrate(CPU, tmp_path).ceilings.read_gbps == 77.0  # a full one asked for: measured
    assert C.load_or_calibrate(CPU, tmp_path, quick=True).ceilings.read_gbps == 77.0  # a full entry serves quick
    assert C.load_or_calibrate(CPU, tmp_path, recalibrate=True).ceilings.read_gbps == 78.0
    assert fake.calls == [False, False]


def test_a_stale_calibration_is_measured_again(tmp_path, monkeypatch):
    old = (datetime.now(timezone.utc) - C.MAX_AGE - timedelta(days=1)).isoformat(timespec="seconds")
    C.store_ceilings(CPU, _record(10.0, measured_at=old), tmp_path)
    assert C.cached_ceilings(CPU, tmp_path) is None
    fake = FakeMeasure(C.Calibration(_record(60.0)))
    monkeypatch.setattr(C, "measure", fake)
    assert C.load_or_calibrate(CPU, tmp_path).ceilings.read_gbps == 60.0 and fake.calls == [False]


def test_a_cache_of_the_previous_format_is_measured_again(tmp_path, monkeypatch):
    """Format 1 held the burst matmul rate as matmul_tflops: it must not pass for the sustained one."""
    entry = {"ceilings": dataclasses.asdict(_record(10.0)), "quick": False}
    (tmp_path / "ceilings.json").write_text(json.dumps({"format": 1, "entries": {C.device_key(CPU): entry}}))
    assert C.cached_ceilings(CPU, tmp_path) is None
    fake = FakeMeasure(C.Calibration(_record(60.0)))
    monkeypatch.setattr(C, "measure", fake)
    assert C.load_or_calibrate(CPU, tmp_path).ceilings.read_gbps == 60.0


def test_the_key_changes_with_the_gpus_power_limit(monkeypatch):
    """The sustained rate follows the power limit, which an administrator can change without a new driver."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(C, "_driver_version", lambda: "580.1")
    gpu = torch.device("cuda", 0)
    keys = set()
    for watts in (700.0, 500.0, None):
        monkeypatch.setattr(C, "_power_limit_w", lambda device, w=watts: w)
        keys.add(C.device_key(gpu))
    assert len(keys) == 3 and any("700 W limit" in k for k in keys)


@pytest.mark.parametrize("content", [
    "{not json", "", "[]", '{"format": 2}', '{"format": 99, "entries": {}}', "\x00\xff",
    "BAD-ENTRY-DEVICE", "BAD-ENTRY-NUMBER", "BAD-ENTRY-NAN", "BAD-ENTRY-NO-MATMUL", "BAD-ENTRY-DATE",
])
def test_a_corrupt_cache_is_ignored_and_replaced(tmp_path, monkeypatch, content):
    key = C.device_key(CPU)
    good = dataclasses.asdict(_record())
    bad = {"BAD-ENTRY-DEVICE": {**good, "device": 3}, "BAD-ENTRY-NUMBER": {**good, "read_gbps": "fast"},
           "BAD-ENTRY-NAN": {**good, "read_gbps": float("nan")}, "BAD-ENTRY-NO-MATMUL": {**good, "matmul_tflops": None},
           "BAD-ENTRY-DATE": {**good, "measured_at": "yesterday"}}
    path = tmp_path / "ceilings.json"
    if content in bad:
        path.write_text(json.dumps({"format": C.CACHE_FORMAT, "entries": {key: {"ceilings": bad[content]}}}))
    else:
        path.write_bytes(content.encode("latin-1"))
    assert C.cached_ceilings(CPU, tmp_path) is None
    monkeypatch.setattr(C, "measure", FakeMeasure(C.Calibration(_record(42.0))))
    assert C.load_or_calibrate(CPU, tmp_path).ceilings.read_gbps == 42.0
    assert json.loads(path.read_text())["entries"][key]["ceilings"]["read_gbps"] == 42.0


def test_an_unwritable_cache_costs_a_warning_not_the_result(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")  # the cache directory would have to be inside a file
    monkeypatch.setattr(C, "measure", FakeMeasure(C.Calibration(_record(42.0))))
    assert C.load_or_calibrate(CPU, blocker / "cache").ceilings.read_gbps == 42.0
    assert "could not save the ceilings" in caplog.text


# ---- what the ceilings are used for ------------------------------------------------------------------------------

def test_mfu_is_against_the_sustained_rate():
    from llm_anatomy.probe.cost import Cost
    from llm_anatomy.probe.recorder import roofline

    c = Ceilings(device="NVIDIA H200", read_gbps=4000.0, gemv_gbps=3700.0, matmul_tflops=680.0,
                 datasheet_gbps=4800.0, datasheet_tflops=989.4, measured_at="t", matmul_burst_tflops=780.0)
    r = roofline(Cost(flops=340e12, bytes=40e9), 1.0, 1.0, c)
    assert r.mfu == pytest.approx(0.5)  # 340 of the sustained 680, not of the burst 780
    assert r.bound.kind == "compute"


def test_the_burst_rate_survives_the_anatomy_json_and_old_records_load_without_it():
    from sample_anatomy import sample_anatomy

    from llm_anatomy.anatomy import Anatomy

    a = sample_anatomy()
    a.ceilings = dataclasses.replace(a.ceilings, matmul_burst_tflops=780.0)
    assert Anatomy.from_json(a.to_json()).ceilings.matmul_burst_tflops == 780.0
    old = json.loads(a.to_json())
    del old["ceilings"]["matmul_burst_tflops"]
    assert Anatomy.from_dict(old).ceilings.matmul_burst_tflops is None


# ---- display -----------------------------------------------------------------------------------------------------

def test_format_ceilings_shows_sustained_and_burst_against_the_datasheet():
    sheet = gpu_for_device("NVIDIA H200")
    c = Ceilings(device="NVIDIA H200", read_gbps=4240.0, gemv_gbps=3750.0, matmul_tflops=680.0,
                 datasheet_gbps=sheet.memory_gbps, datasheet_tflops=sheet.bf16_tflops,
                 datasheet_source=sheet.source, measured_at="2026-01-01T00:00:00+00:00", matmul_burst_tflops=780.0)
    text = " ".join(C.format_ceilings(c).split())
    assert "read 4.24 TB/s 88% of datasheet 4.80 TB/s" in text
    assert "bf16 matmul 680 TFLOP/s 69% of datasheet 989 TFLOP/s; sustained, MFU's denominator" in text
    assert "first 0.1 s 780 TFLOP/s 79% of datasheet" in text
    assert "ridge point 160 FLOP/byte (datasheet 206)" in text
    assert "units: decimal" in text and sheet.source in text


def test_small_rates_keep_three_significant_digits():
    cpu = C.format_ceilings(dataclasses.replace(_record(), matmul_tflops=0.0512, matmul_burst_tflops=0.9,
                                                read_gbps=5.25))
    assert "0.0512 TFLOP/s" in cpu and "0.900 TFLOP/s" in cpu and "5.25 GB/s" in cpu
    assert "0.0 TFLOP/s" not in cpu and "none for this device" in cpu

    sheet_only = C.format_ceilings(C.datasheet_ceilings(CPU))
    assert "not calibrated" in sheet_only and "not measured" in sheet_only and "first 0.1 s" not in sheet_only
