"""probe/timeline.py: a profiled window's device summary, and the window's states (CPU; the GPU's kernels are in
the server's test on a GPU machine and in benchmarks)."""

import gzip
import json
import time

import pytest
import torch

from llm_anatomy.probe.timeline import HOST_GAP_US, ProfileError, ProfileWindow, device_summary

US = 1000  # ns


def test_device_summary_takes_the_union_of_the_intervals_and_counts_long_gaps():
    intervals = [
        (0, 100 * US, "nvjet_gemm"),  # busy 0-100 us
        (50 * US, 120 * US, "flash_fwd_kernel"),  # overlaps: busy to 120
        (130 * US, 140 * US, "rms_norm_kernel"),  # a 10 us gap: the launch's own
        (140 * US + int(HOST_GAP_US * US), 300 * US, "stream_gemv"),  # a gap of exactly HOST_GAP_US counts
        (250 * US, 260 * US, "Memcpy HtoD"),  # inside the one before
    ]
    s = device_summary(intervals, window_ns=400 * US)
    assert s["busy_ms"] == pytest.approx((120 + 10 + (300 - 190)) / 1e3)
    assert s["idle_ms"] == pytest.approx(0.4 - s["busy_ms"])
    assert s["busy_share"] == pytest.approx(s["busy_ms"] / 0.4)
    assert s["gaps"] == 1 and s["idle_in_gaps_ms"] == pytest.approx(HOST_GAP_US / 1e3)
    assert s["activities"] == 5
    # each kernel's own time by kind: concurrent ones both count
    assert s["category_ms"]["gemm"] == pytest.approx(0.1 + 0.11)
    assert s["category_ms"]["attention"] == pytest.approx(0.07)
    assert s["category_ms"]["norm"] == pytest.approx(0.01) and s["category_ms"]["copy"] == pytest.approx(0.01)
    assert s["category_count"] == {"gemm": 2, "attention": 1, "norm": 1, "copy": 1}


def test_device_summary_of_nothing():
    s = device_summary([], window_ns=0)
    assert s["busy_ms"] == 0 and s["idle_ms"] == 0 and s["busy_share"] is None and s["gaps"] == 0


def test_a_window_writes_its_trace_and_refuses_the_wrong_order(tmp_path):
    window = ProfileWindow(tmp_path / "traces", torch.device("cpu"), name="test")
    with pytest.raises(ProfileError, match="POST /start_profile first"):
        window.stop()
    assert window.start() == {"status": "started", "max_s": window.max_s}
    assert window.running and window.has_window and not window.expired
    with pytest.raises(ProfileError, match="already running"):
        window.start()
    a = torch.randn(64, 64)
    for _ in range(3):
        a = (a @ a).tanh()
    result = window.stop()
    assert not window.running and not window.has_window
    assert result["host_events"] >= 6 and result["device"] is None and not result["cut_at_max"]
    assert 0 < result["seconds"] < 60
    with gzip.open(result["trace"]) as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert "aten::mm" in names
    assert result["trace"].startswith(str(tmp_path / "traces" / "test-"))
    with pytest.raises(ProfileError):
        window.stop()
    window.start()  # a new window after the last one's end
    assert window.stop()["trace"] != result["trace"]


def test_a_window_is_cut_at_its_limit_and_kept_for_stop(tmp_path):
    window = ProfileWindow(tmp_path, torch.device("cpu"), max_s=0.01)
    window.start()
    time.sleep(0.03)
    assert window.expired
    window.cut()
    assert not window.running and window.has_window and not window.expired
    torch.randn(8, 8).sum()  # after the cut: not in the window
    result = window.stop()
    assert result["cut_at_max"] and 0.01 < result["seconds"] < 5
    with gzip.open(result["trace"]) as f:
        assert "aten::sum" not in {e.get("name") for e in json.load(f)["traceEvents"]}


@pytest.mark.parametrize("max_s", [0, -1.0, float("nan")])
def test_a_window_needs_a_positive_limit(tmp_path, max_s):
    with pytest.raises(ValueError, match="max_s"):
        ProfileWindow(tmp_path, torch.device("cpu"), max_s=max_s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_window_on_the_gpu_sees_its_kernels_also_inside_a_cuda_graph(tmp_path):
    device = torch.device("cuda")
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    graph_out = torch.empty_like(a)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph_out.copy_(a @ a)  # warm-up off the default stream, as graph capture wants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out.copy_(a @ a)
    window = ProfileWindow(tmp_path, device)
    window.start()
    for _ in range(5):
        b = a @ a
    time.sleep(0.05)  # an idle stretch: a gap
    for _ in range(5):
        graph.replay()
    result = window.stop()
    d = result["device"]
    assert b.shape == a.shape and d["activities"] >= 15  # 5 eager matmuls, 5 replays of a matmul and a copy
    assert result["host_events"] >= 10  # the runtime's calls: 5 launches, 5 replays
    assert 0 < d["busy_ms"] < d["window_ms"] and d["idle_in_gaps_ms"] >= 40 and d["gaps"] >= 1
    assert d["category_count"]["gemm"] >= 10  # the graph's kernels count as the eager ones do


def test_a_discarded_window_leaves_nothing_open(tmp_path):
    window = ProfileWindow(tmp_path, torch.device("cpu"))
    window.discard()  # none open: nothing to do
    window.start()
    window.discard()
    assert not window.has_window and not window.running and not list(tmp_path.iterdir())
    window.start()  # the profiler is free again
    assert window.stop()["host_events"] >= 0
