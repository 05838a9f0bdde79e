"""Reports: they only read Anatomy records (terminal, HTML, Perfetto trace)."""

from .units import finite, seconds

__all__ = ["finite", "fp8_plan_words", "startup_plan", "startup_text"]


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


def fp8_plan_words(plan: dict) -> str | None:
    """What an engine's plan (ExecutionPlan.describe(), as an anatomy's start-up record keeps it) does in fp8 beyond
    the stored precisions (fp8_fast_accum, fp8_prefill_attention), in words for a precision line; None: nothing."""
    words = []
    if plan.get("fp8_fast_accum"):
        words.append("fp8 GEMMs summed in the tensor cores' fp8 accumulator (fast accumulation)")
    if plan.get("fp8_prefill_attention"):
        words.append(f"prompts of {plan['fp8_prefill_min_tokens']} tokens or more attended in fp8 (cuDNN) when alone "
                     f"in a prefill step")
    return "; ".join(words) or None


def startup_plan(a) -> dict:
    """The engine's plan as the anatomy's start-up record keeps it ({} without one)."""
    s = getattr(a, "startup", None)
    return {} if s is None else s.plan
