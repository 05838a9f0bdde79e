"""The one GPU table (llm_anatomy/data/gpus.json): its figures and sources, the names `plan --gpu` accepts, and the
device names torch gives that find (or do not find) an entry."""

import dataclasses
import math

import pytest

from llm_anatomy.errors import AnatomyError
from llm_anatomy.gpus import gpu_for_device, gpus, lookup_gpu

PLAN_KEYS = ("h100-sxm", "h100-pcie", "h200", "h20", "a100-40gb", "a100-80gb", "l40s", "l4", "b200", "rtx-4090")


def test_entries_are_sourced_and_plausible():
    table = gpus()
    assert set(PLAN_KEYS) <= set(table)
    for g in table.values():
        assert g.source and ("NVIDIA" in g.source or "AMD" in g.source), g.key
        assert "sparsity" in g.source or "dense" in g.source, g.key  # says which figure was halved or left out
        for v in (g.memory_gb, g.memory_gbps, g.bf16_tflops, g.power_w):
            assert math.isfinite(v) and v > 0, g.key
        assert 100 <= g.memory_gbps < 10_000 and g.memory_gb <= 200 and 50 <= g.power_w <= 1200, g.key
        assert g.bf16_tflops < 2600, g.key  # dense: no entry may carry a sparsity figure
        assert g.fp8_tflops is None or g.fp8_tflops == pytest.approx(2 * g.bf16_tflops, rel=0.02), g.key
    assert table["a100-80gb"].fp8_tflops is None and table["a100-pcie-40gb"].fp8_tflops is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        table["h200"].memory_gbps = 1.0


@pytest.mark.parametrize("key, gbps, tflops, fp8, gb, watts", [
    ("h200", 4800, 989.4, 1978.9, 141, 700), ("h100-sxm", 3350, 989.4, 1978.9, 80, 700),
    ("h100-pcie", 2000, 756.5, 1513, 80, 350), ("h100-nvl", 3900, 835.5, 1670.5, 94, 400),
    ("h200-nvl", 4800, 835.5, 1670.5, 141, 600), ("h20", 4000, 148, 296, 96, 400),
    ("a100-40gb", 1555, 312, None, 40, 400), ("a100-80gb", 2039, 312, None, 80, 400),
    ("a100-pcie-40gb", 1555, 312, None, 40, 250), ("a100-pcie-80gb", 1935, 312, None, 80, 300),
    ("l40s", 864, 362.05, 733, 48, 350), ("l4", 300, 121, 242.5, 24, 72), ("b200", 8000, 2250, 4500, 180, 1000),
    ("rtx-4090", 1008, 165.2, 330.3, 24, 450), ("mi300x", 5300, 1307.4, 2614.9, 192, 750),
])
def test_known_figures(key, gbps, tflops, fp8, gb, watts):
    g = gpus()[key]
    assert (g.memory_gbps, g.bf16_tflops, g.fp8_tflops, g.memory_gb, g.power_w) == (gbps, tflops, fp8, gb, watts)


def test_plan_names_and_aliases():
    assert lookup_gpu("H100 SXM").key == "h100-sxm" and lookup_gpu("RTX-4090").key == "rtx-4090"
    assert lookup_gpu("h100").key == "h100-sxm" and lookup_gpu("A100").key == "a100-80gb"
    assert lookup_gpu("4090").key == "rtx-4090" and lookup_gpu("H200_SXM").key == "h200"
    for key in gpus():
        assert lookup_gpu(key.upper()).key == key


@pytest.mark.parametrize("name", ["h300", "", "a100 sxm4", "NVIDIA H200"])
def test_unknown_plan_names_are_refused_with_the_known_list(name):
    with pytest.raises(AnatomyError) as info:
        lookup_gpu(name)
    assert str(info.value) == f"unknown GPU {name!r}; known: {', '.join(gpus())}"


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA H100 SXM5 80GB", "h100-sxm"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"),
    ("nvidia h200", "h200"),
    ("NVIDIA H200 NVL", "h200-nvl"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
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
    g = gpu_for_device(name)
    assert g is not None and g.key == key


@pytest.mark.parametrize("name", [
    "", None, "cpu", "Intel Xeon", "AMD EPYC 7763 64-Core Processor",
    "NVIDIA H100",  # form factor unknown: no guess between SXM, PCIe and NVL
    "NVIDIA A100",  # neither the form factor nor the memory
    "NVIDIA L40",  # not the L40S, not the L4
    "NVIDIA H20",  # no vendor datasheet: measured ceilings only
    "NVIDIA H800", "NVIDIA GH200 480GB", "NVIDIA GB200",
    "NVIDIA GeForce RTX 4090 D", "NVIDIA GeForce RTX 4090 Laptop GPU", "NVIDIA GeForce RTX 3090",
    "Tesla T4", "AMD Instinct MI250X", "AMD Instinct MI300A",
    "NVIDIA H100 80GB HBM3 MIG 1g.10gb",  # a slice of the GPU: the whole GPU's figures would be wrong
])
def test_unknown_or_ambiguous_device_names_have_no_entry(name):
    assert gpu_for_device(name) is None


def test_every_entry_with_device_names_is_found_by_its_name_and_each_of_them():
    for g in gpus().values():
        if not g.device_names:
            continue
        assert gpu_for_device(g.name) is g, g.name
        for device_name in g.device_names:
            assert gpu_for_device("NVIDIA " + device_name) is g, device_name
    assert not gpus()["h20"].device_names
