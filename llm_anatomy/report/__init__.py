"""Reports: they only read Anatomy records (terminal, HTML, Perfetto trace)."""

from .units import finite, seconds

__all__ = ["finite", "startup_text"]


def startup_text(a) -> str | None:
    """The engine's one-time start-up, as a line: a call on a fresh process waits for it first."""
    s = getattr(a, "startup", None)
    if s is None:
        return None
    if not s.cuda_graphs:
        return f"{seconds(s.total_s)} once, before this call and not in its timings; eager, no CUDA graphs"
    pdl = "on" if s.programmatic_dependent_launch else "off"
    tiles = ("the GEMV tiles read back (cached, or shipped for this GPU)" if s.tiles_from_cache
             else f"{seconds(s.tile_tuning_s)} of GEMV tile tuning (kept for the next start)")
    streaming = "; batch-1 GEMVs stream their weights before their wait" if s.streaming_gemv else ""
    return (f"{seconds(s.total_s)} once, before this call and not in its timings, of which "
            f"{seconds(s.compile_and_capture_s)} compiling kernels and capturing {s.cuda_graphs} CUDA graphs, with "
            f"{tiles} (programmatic dependent launch {pdl}{streaming})")
