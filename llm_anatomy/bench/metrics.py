"""A level's figures from its requests, as vLLM's benchmark defines them (vllm/benchmarks/serve.py,
calculate_metrics):

- over the successful requests only; the level's duration runs from its first send to its last response;
- TTFT: first output chunk's arrival - send. e2e: last chunk's arrival - send;
- TPOT per request: (e2e - TTFT) / (output tokens - 1), for requests with more than one output token;
- ITL: the gaps between consecutive output chunks after the first, pooled over all requests;
- output tokens: the server's usage where it sent one, else the count of output chunks;
- request throughput = successes / duration; output throughput = output tokens / duration;
- goodput = requests meeting every SLO / duration, where a one-token request's TPOT counts as 0 (as vLLM);
- mean, and the 50th, 90th and 99th percentiles by linear interpolation between the closest ranks
  (numpy.percentile's default method, which vLLM uses).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from ..errors import AnatomyError
from .client import RequestResult

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


def distribution_ms(values_s: list[float]) -> dict:
    """mean, p50, p90, p99 in ms; None for each when there is no value."""
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = np.asarray(values_s, dtype=float) * 1e3
    return {"mean": float(ms.mean()),
            **{f"p{q}": float(v) for q, v in zip(PERCENTILES, np.percentile(ms, PERCENTILES, method="linear"))}}


def tpot_s(r: RequestResult) -> float | None:
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def parse_slo(text: str) -> dict[str, float]:
    """'ttft_ms=200,tpot_ms=50' -> {'ttft_ms': 200.0, 'tpot_ms': 50.0}."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise AnatomyError(f"--slo takes {', '.join(k + '=MS' for k in SLO_KEYS)} (comma-separated), "
                               f"not {part!r}")
        if key in slo:
            raise AnatomyError(f"--slo gives {key} twice")
        try:
            ms = float(value)
        except ValueError:
            raise AnatomyError(f"--slo {key} must be a number of milliseconds, got {value!r}") from None
        if not math.isfinite(ms) or ms <= 0:
            raise AnatomyError(f"--slo {key} must be > 0 ms, got {value}")
        slo[key] = ms
    if not slo:
        raise AnatomyError("--slo is empty: give e.g. ttft_ms=500,tpot_ms=50")
    return slo


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    figures = {"ttft_ms": r.ttft_s * 1e3, "tpot_ms": (tpot_s(r) or 0.0) * 1e3, "e2e_ms": r.e2e_s * 1e3}
    return all(figures[k] <= limit for k, limit in slo.items())


def level_metrics(results: list[RequestResult], duration_s: float, slo: dict[str, float] | None) -> dict:
    """The client's view of one level."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt_known = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    tpots = [t for t in map(tpot_s, ok) if t is not None]
    from_usage = sum(r.tokens_from_usage for r in ok)
    good = sum(meets_slo(r, slo) for r in ok) if slo else None
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": {"count": len(failed), "reasons": dict(Counter(r.error for r in failed).most_common())},
        "duration_s": duration_s,
        "request_s": len(ok) / duration_s if duration_s > 0 else None,
        "output_tok_s": output / duration_s if duration_s > 0 else None,
        "total_tok_s": (output + sum(prompt_known)) / duration_s if duration_s > 0 and prompt_known else None,
        "output_tokens": output,
        "input_tokens": sum(prompt_known) if len(prompt_known) == len(ok) and ok else None,
        "output_tokens_from": "usage" if from_usage == len(ok) else "chunks" if from_usage == 0 else "mixed",
        "goodput": None if slo is None else {
            "slo": slo, "good_requests": good, "request_s": good / duration_s if duration_s > 0 else None,
            "fraction": good / len(ok) if ok else None},
        "ttft_ms": distribution_ms([r.ttft_s for r in ok]),
        "tpot_ms": distribution_ms(tpots),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok]),
        "finish_reasons": dict(Counter(r.finish_reason or "none" for r in ok).most_common()),
    }
