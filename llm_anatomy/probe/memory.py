"""The memory census: where every byte of the device is, at one instant, summing to the total. On a GPU that
is its memory; on the CPU it is the host's RAM, and its rows say so (no CUDA graphs, no CUDA context there).

This module imports torch only to take a census: the reports import `census_rows` without it."""

from __future__ import annotations

import os

from ..anatomy import MemoryCensus


def census(device, weights: int, kv_pool: int, cuda_graphs: int = 0,
           activation_peak: int | None = None) -> MemoryCensus:
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)  # the driver's view, as NVML reports it
        reserved = torch.cuda.memory_reserved(device)
        allocated = torch.cuda.memory_allocated(device)
        other = max(0, allocated - weights - kv_pool - cuda_graphs)
        return MemoryCensus(
            total=total, weights=weights, kv_pool=kv_pool, cuda_graphs=cuda_graphs, other_allocated=other,
            allocator_free=reserved - allocated, context_and_other=(total - free) - reserved,
            free=free, activation_peak=activation_peak,
            source="GPU memory: torch.cuda.mem_get_info (driver) and the caching allocator's counters",
        )
    # The host: RAM, with this process's resident set split into the engine's tensors and the rest.
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    available = os.sysconf("SC_AVPHYS_PAGES") * page
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * page
    other = max(0, rss - weights - kv_pool)
    return MemoryCensus(
        total=total, weights=weights, kv_pool=kv_pool, cuda_graphs=0, other_allocated=other, allocator_free=0,
        context_and_other=max(0, total - available - max(rss, weights + kv_pool)), free=available,
        activation_peak=activation_peak, kind="host",
        source="host RAM: this process's resident set (/proc/self/statm) and the available pages (sysconf)",
    )


def census_rows(m: MemoryCensus) -> list[tuple[str, int]]:
    """The census as (label, bytes) rows that sum to m.total, labelled for the memory it counts."""
    if m.kind == "host":
        return [("weights", m.weights), ("KV pool", m.kv_pool), ("rest of this process", m.other_allocated),
                ("other processes, the OS and its caches", m.context_and_other), ("available", m.free)]
    return [("weights", m.weights), ("KV pool", m.kv_pool), ("CUDA graphs", m.cuda_graphs),
            ("other tensors", m.other_allocated), ("allocator reserved, free", m.allocator_free),
            ("CUDA context and others", m.context_and_other), ("free", m.free)]


def engine_census(engine, activation_peak: int | None = None) -> MemoryCensus:
    """The census of an engine's device: its weights, its KV pool and its captured CUDA graphs (none: 0 bytes)."""
    graphs = engine.graphs.graph_bytes if engine.graphs is not None else 0
    return census(engine.device, engine.weights.bytes, engine.pool.total_bytes, graphs, activation_peak)
