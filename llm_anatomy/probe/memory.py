"""The memory census: where every byte of the device is, at one instant, summing to the total."""

from __future__ import annotations

import os

import torch

from ..anatomy import MemoryCensus


def census(device: torch.device, weights: int, kv_pool: int, cuda_graphs: int = 0,
           activation_peak: int | None = None) -> MemoryCensus:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)  # the driver's view, as NVML reports it
        reserved = torch.cuda.memory_reserved(device)
        allocated = torch.cuda.memory_allocated(device)
        other = max(0, allocated - weights - kv_pool - cuda_graphs)
        return MemoryCensus(
            total=total, weights=weights, kv_pool=kv_pool, cuda_graphs=cuda_graphs, other_allocated=other,
            allocator_free=reserved - allocated, context_and_other=(total - free) - reserved,
            free=free, activation_peak=activation_peak,
            source="torch.cuda.mem_get_info (driver) and the caching allocator's counters",
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
        activation_peak=activation_peak,
        source="host RAM: /proc/self/statm (this process) and sysconf (free = available pages); "
               "other processes and the OS page cache are in context_and_other",
    )
