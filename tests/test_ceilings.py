"""Device ceilings: the datasheet table, calibration on the CPU, the per-device cache, the summary."""

import dataclasses
import json
import math
from datetime import datetime

import pytest
import torch

from llm_anatomy.anatomy import Ceilings
from llm_anatomy.probe import ceilings as C

CPU = torch.device("cpu")


# ---- datasheet table ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA H100 SXM5 80GB", "h100-sxm"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200-sxm"),
    ("nvidia h200", "h200-sxm"),
    ("NVIDIA H200 NVL", "h200-nvl"),
    ("NVIDIA A100-SXM4-40GB", "a100-sxm-40gb"),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ("NVIDIA B200", "b200"),
    ("AMD Instinct MI300X", "mi300x"),
    ("AMD Instinct MI300X VF", "mi300x"),
])
def test_device_names_match_the_most_specific_entry(name, key):
    sheet = C.lookup_datasheet(name)
    assert sheet is not None and sheet.key == key


@pytest.mark.parametrize("name", [
    "", None, "cpu", "AMD EPYC 7763 64-Core Processor",
    "NVIDIA H100",  # form factor unknown: no guess between SXM, PCIe and NVL
    "NVIDIA A100",  # neither the form factor nor the memory
    "NVIDIA L40",  # not the L40S, not the L4
    "NVIDIA H20", "NVIDIA H800", "NVIDIA GH200 480GB", "NVIDIA GB200",
    "NVIDIA GeForce RTX 4090 D", "NVIDIA GeForce RTX 4090 Laptop GPU", "NVIDIA GeForce RTX 3090",
    "Tesla T4", "AMD Instinct MI250X", "AMD Instinct MI300A",
    "NVIDIA H100 80GB HBM3 MIG 1g.10gb",  # a slice of the GPU: the whole GPU's figures would be wrong
])
def test_unknown_or_ambiguous_names_have_no_datasheet(name):
    assert C.lookup_datasheet(name) is None


def test_every_entry_is_found_by_its_name_and_each_alias():
    keys = [s.key for s in C.DATASHEETS]
    assert len(keys) == len(set(keys))
    for sheet in C.DATASHEETS:
        assert C.lookup_datasheet(sheet.name) is sheet, sheet.name
        for alias in sheet.aliases:
            assert C.lookup_datasheet("NVIDIA " + alias) is sheet, alias


def test_entries_are_sourced_and_plausible():
    for s in C.DATASHEETS:
        assert s.source and ("NVIDIA" in s.source or "AMD" in s.source), s.key
        assert "sparsity" in s.source, s.key  # says which figure was halved or left out
        for v in (s.memory_gbps, s.bf16_dense_tflops, s.memory_gb):
            assert math.isfinite(v) and v > 0, s.key
        assert 100 <= s.memory_gbps < 10_000, s.key
        assert s.bf16_dense_tflops < 2600, s.key  # dense: no entry may carry a sparsity figure
        assert s.memory_gb <= 200, s.key
    with pytest.raises(dataclasses.FrozenInstanceError):
        C.DATASHEETS[0].memory_gbps = 1.0


@pytest.mark.parametrize("key, gbps, tflops, gb", [
    ("h200-sxm", 4800, 989.4, 141), ("h100-sxm", 3350, 989.4, 80), ("a100-sxm-80gb", 2039, 312, 80),
    ("l4", 300, 121, 24), ("l40s", 864, 362.05, 48), ("rtx-4090", 1008, 165.2, 24),
    ("b200", 8000, 2250, 180), ("mi300x", 5300, 1307.4, 192),
])
def test_known_figures(key, gbps, tflops, gb):
    (s,) = [s for s in C.DATASHEETS if s.key == key]
    assert (s.memory_gbps, s.bf16_dense_tflops, s.memory_gb) == (gbps, tflops, gb)


def test_cpu_has_no_datasheet():
    c = C.datasheet_ceilings(CPU)
    assert c.device.startswith("cpu")
    assert (c.read_gbps, c.gemv_gbps, c.matmul_tflops) == (None, None, None)
    assert (c.datasheet_gbps, c.datasheet_tflops, c.datasheet_source, c.measured_at) == (None, None, "", "")
    assert c.ridge is None


# ---- calibration -------------------------------------------------------------------------------

def test_quick_cpu_calibration():
    c = C.calibrate(CPU, quick=True)
    for v in (c.read_gbps, c.gemv_gbps, c.matmul_tflops):
        assert v is not None and math.isfinite(v) and v > 0
    assert c.device.startswith("cpu") and ("bf16 matmul" in c.device or "fp32 matmul" in c.device)
    assert datetime.fromisoformat(c.measured_at)
    assert c.datasheet_gbps is None and c.datasheet_tflops is None and c.datasheet_source == ""
    assert c.ridge is not None and c.ridge > 0


def test_small_sizes_can_be_asked_for():
    c = C.calibrate("cpu", quick=True, read_bytes=8 << 20, gemv_bytes=4 << 20, matmul_n=128)
    for v in (c.read_gbps, c.gemv_gbps, c.matmul_tflops):
        assert v is not None and math.isfinite(v) and v > 0


def test_calibrating_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    C.calibrate(CPU, quick=True, read_bytes=8 << 20, gemv_bytes=4 << 20, matmul_n=128)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quick_gpu_calibration():
    c = C.calibrate(torch.device("cuda"), quick=True)
    for v in (c.read_gbps, c.gemv_gbps, c.matmul_tflops):
        assert v is not None and math.isfinite(v) and v > 0
    sheet = C.lookup_datasheet(torch.cuda.get_device_name())
    if sheet is not None:
        assert c.datasheet_gbps == sheet.memory_gbps and c.datasheet_source == sheet.source
        assert c.read_gbps < 1.1 * sheet.memory_gbps


# ---- cache -------------------------------------------------------------------------------------

def _record(read=50.0, device="cpu: test"):
    return Ceilings(device=device, read_gbps=read, gemv_gbps=30.0, matmul_tflops=0.9, datasheet_gbps=None,
                    datasheet_tflops=None, datasheet_source="", measured_at="2026-01-01T00:00:00+00:00")


def _no_measuring(*args, **kwargs):
    raise AssertionError("calibrate() was called, the cache should have answered")


def test_cache_location(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert C.cache_path() == tmp_path / "xdg" / "llm-anatomy" / "ceilings.json"
    assert C.cache_path(tmp_path / "mine") == tmp_path / "mine" / "ceilings.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert C.cache_path() == tmp_path / "home" / ".cache" / "llm-anatomy" / "ceilings.json"


def test_cache_round_trip_is_per_device(tmp_path, monkeypatch):
    assert C.cached_ceilings(CPU, tmp_path) is None
    first = _record(50.0)
    path = C.store_ceilings(CPU, first, tmp_path)
    assert path == tmp_path / "ceilings.json"
    assert C.cached_ceilings(CPU, tmp_path) == first
    assert C.device_key(CPU) in json.loads(path.read_text())["entries"]

    monkeypatch.setattr(C, "calibrate", _no_measuring)
    assert C.load_or_calibrate(CPU, cache_dir=tmp_path) == first

    # Another device (here: the same CPU at another thread count) has its own entry.
    threads, key = torch.get_num_threads(), C.device_key(CPU)
    try:
        torch.set_num_threads(1 if threads != 1 else 2)
        assert C.device_key(CPU) != key
        assert C.cached_ceilings(CPU, tmp_path) is None
        second = _record(20.0)
        C.store_ceilings(CPU, second, tmp_path)
        assert C.cached_ceilings(CPU, tmp_path) == second
    finally:
        torch.set_num_threads(threads)
    assert C.cached_ceilings(CPU, tmp_path) == first
    assert len(json.loads(path.read_text())["entries"]) == 2


def test_quick_entries_serve_only_quick_requests(tmp_path, monkeypatch):
    fresh = _record(77.0)
    calls = []
    monkeypatch.setattr(C, "calibrate", lambda device, quick=False: calls.append(quick) or fresh)
    C.store_ceilings(CPU, _record(10.0), tmp_path, quick=True)
    assert C.load_or_calibrate(CPU, tmp_path, quick=True).read_gbps == 10.0
    assert calls == []
    assert C.load_or_calibrate(CPU, tmp_path) == fresh  # a full one was asked for: measured, and saved
    assert calls == [False]
    assert C.load_or_calibrate(CPU, tmp_path, quick=True) == fresh  # a full entry serves quick requests
    assert C.load_or_calibrate(CPU, tmp_path, recalibrate=True) == fresh
    assert calls == [False, False]


@pytest.mark.parametrize("content", [
    "{not json", "", "[]", '{"format": 1}', '{"format": 99, "entries": {}}', "\x00\xff",
    "BAD-ENTRY-DEVICE", "BAD-ENTRY-NUMBER", "BAD-ENTRY-NAN",
])
def test_a_corrupt_cache_is_ignored_and_replaced(tmp_path, monkeypatch, content):
    key = C.device_key(CPU)
    good = dataclasses.asdict(_record())
    bad = {"BAD-ENTRY-DEVICE": {**good, "device": 3}, "BAD-ENTRY-NUMBER": {**good, "read_gbps": "fast"},
           "BAD-ENTRY-NAN": {**good, "read_gbps": float("nan")}}
    path = tmp_path / "ceilings.json"
    if content in bad:
        path.write_text(json.dumps({"format": 1, "entries": {key: {"ceilings": bad[content]}}}))
    else:
        path.write_bytes(content.encode("latin-1"))
    assert C.cached_ceilings(CPU, tmp_path) is None
    fresh = _record(42.0)
    monkeypatch.setattr(C, "calibrate", lambda device, quick=False: fresh)
    assert C.load_or_calibrate(CPU, tmp_path) == fresh
    assert json.loads(path.read_text())["entries"][key]["ceilings"]["read_gbps"] == 42.0
    assert C.cached_ceilings(CPU, tmp_path) == fresh


def test_load_or_calibrate_measures_and_saves_once(tmp_path, monkeypatch):
    real = C.calibrate
    monkeypatch.setattr(C, "calibrate", lambda device, quick=False: real(
        device, quick, read_bytes=8 << 20, gemv_bytes=4 << 20, matmul_n=128))
    c = C.load_or_calibrate(CPU, tmp_path, quick=True)
    assert c.read_gbps and c.measured_at
    assert C.cached_ceilings(CPU, tmp_path) == c


# ---- ridge and summary -------------------------------------------------------------------------

def test_ridge_point():
    c = Ceilings(device="NVIDIA H200", read_gbps=4000.0, gemv_gbps=3700.0, matmul_tflops=800.0,
                 datasheet_gbps=4800.0, datasheet_tflops=989.4, datasheet_source="x", measured_at="t")
    assert c.ridge == pytest.approx(200.0)
    only_sheet = dataclasses.replace(c, read_gbps=None, gemv_gbps=None, matmul_tflops=None)
    assert only_sheet.ridge == pytest.approx(989.4e12 / 4800e9)


def test_format_ceilings():
    sheet = C.lookup_datasheet("NVIDIA H200")
    c = Ceilings(device="NVIDIA H200", read_gbps=4240.0, gemv_gbps=3750.0, matmul_tflops=770.0,
                 datasheet_gbps=sheet.memory_gbps, datasheet_tflops=sheet.bf16_dense_tflops,
                 datasheet_source=sheet.source, measured_at="2026-01-01T00:00:00+00:00")
    text = C.format_ceilings(c)
    assert "read" in text and "4.24 TB/s (88% of datasheet 4.80 TB/s)" in " ".join(text.split())
    assert "78% of datasheet 989 TFLOP/s" in text
    assert "ridge point" in text and "182 FLOP/byte" in text and "datasheet 206" in text
    assert sheet.source in text

    cpu = C.format_ceilings(_record())
    assert "GB/s" in cpu and "900 GFLOP/s" in cpu and "none for this device" in cpu

    sheet_only = C.format_ceilings(dataclasses.replace(c, read_gbps=None, gemv_gbps=None, matmul_tflops=None,
                                                       measured_at=""))
    assert "not calibrated" in sheet_only and "not measured (datasheet 4.80 TB/s)" in sheet_only
