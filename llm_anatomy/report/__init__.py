"""Reports: they only read Anatomy records (terminal, HTML, Perfetto trace)."""

import math
from typing import Any


def finite(x: Any) -> float | None:
    """A finite float, or None (charts and trace JSON must hold no NaN or infinity)."""
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def startup_text(a) -> str | None:
    """The engine's one-time start-up, as a line: a call on a fresh process waits for it first."""
    s = getattr(a, "startup", None)
    if s is None:
        return None
    if not s.cuda_graphs:
        return f"{s.total_s:.1f} s once, before this call and not in its timings; eager, no CUDA graphs"
    pdl = "on" if s.programmatic_dependent_launch else "off"
    tiles = ("GEMV tiles from the cache" if s.tiles_from_cache
             else f"GEMV tile tuning {s.tile_tuning_s:.1f} s (kept for the next start)")
    streaming = "; batch-1 GEMVs stream their weights before their wait" if s.streaming_gemv else ""
    return (f"{s.total_s:.1f} s once, before this call and not in its timings, of which {s.compile_and_capture_s:.1f} s "
            f"Triton compiles, {tiles} and the capture of {s.cuda_graphs} CUDA graphs (programmatic dependent "
            f"launch {pdl}{streaming})")
