"""How the reports print numbers: one unit system (decimal SI), significant digits, stated once per report.

Sizes are decimal bytes (1 GB = 10^9 B, scaled down to MB, kB for small ones), bandwidth is TB/s (10^12 B/s),
arithmetic rate is TFLOP/s (10^12 FLOP/s), times are ms. The record keeps its own units (bytes, GB/s, TFLOP/s,
ms); these functions only format. Every value is printed with significant digits, not a fixed number of
decimals, so a small rate on a CPU reads "0.0123 TFLOP/s" and never "0.0 TFLOP/s". Missing or non-finite values
print as "n/a".
"""

from __future__ import annotations

import math
from typing import Any

UNITS = ("decimal SI units throughout: 1 GB = 10^9 bytes (MB, kB likewise), bandwidth in TB/s = 10^12 bytes per "
         "second, arithmetic in TFLOP/s = 10^12 floating-point operations per second, times in ms")

NA = "n/a"


def finite(x: Any) -> float | None:
    """A finite float, or None (charts and trace JSON must hold no NaN or infinity)."""
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def sig(x: Any, digits: int = 3) -> str:
    """`x` with `digits` significant digits; integers of more digits than that print whole, with separators.

    0.012345 -> "0.0123", 4.0 -> "4", 1234.5 -> "1,234", 2.5e-7 -> "2.5e-07".
    """
    v = finite(x)
    if v is None:
        return NA
    if v == 0:
        return "0"
    if abs(v) >= 10 ** digits:
        return f"{round(v):,}"
    text = f"{v:.{digits}g}"
    return "0" if text in ("-0", "0") else text


def integer(x: Any) -> str:
    """A count, with thousands separators."""
    v = finite(x)
    return NA if v is None else f"{round(v):,}"


def ms(x: Any) -> str:
    """A duration given in ms: "4.12 ms", "0.0123 ms", "1.23 s" from 1 s on."""
    v = finite(x)
    if v is None:
        return NA
    if abs(v) >= 1000:
        return f"{sig(v / 1000, 4 if abs(v) >= 10_000 else 3)} s"
    return f"{sig(v)} ms"


def seconds(x: Any) -> str:
    """A duration given in seconds, to a tenth from 0.1 s on ("17.4 s"), else with significant digits."""
    v = finite(x)
    if v is None:
        return NA
    return f"{v:.1f} s" if abs(v) >= 0.1 else f"{sig(v, 2)} s"


_SIZES = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def size(n: Any, digits: int = 4) -> str:
    """A number of bytes in decimal units: "16.38 GB", "147.5 kB", "512 B"."""
    v = finite(n)
    if v is None:
        return NA
    for unit, scale in _SIZES:
        if abs(v) >= scale:
            return f"{sig(v / scale, digits)} {unit}"
    return f"{sig(v, digits)} B"


def tbps(gbps: Any) -> str:
    """A bandwidth the record gives in GB/s, printed in TB/s: 4310 -> "4.31 TB/s", 38 -> "0.038 TB/s"."""
    v = finite(gbps)
    return NA if v is None else f"{sig(v / 1000)} TB/s"


def tflops(x: Any) -> str:
    """An arithmetic rate in TFLOP/s: "724 TFLOP/s", "0.0123 TFLOP/s"."""
    v = finite(x)
    return NA if v is None else f"{sig(v)} TFLOP/s"


def percent(fraction: Any) -> str:
    """A fraction as a percentage: one decimal from 1% on, two significant digits below ("0.042%")."""
    v = finite(fraction)
    if v is None:
        return NA
    p = 100 * v
    if p == 0:
        return "0%"
    return f"{p:.1f}%" if abs(p) >= 1 else f"{sig(p, 2)}%"


def joules(x: Any) -> str:
    """Energy: "3.58 J"."""
    v = finite(x)
    return NA if v is None else f"{sig(v)} J"


def interval(low: Any, high: Any, unit: str = "") -> str:
    """A closed interval, "[0, 81.3] J": used where an uncertainty is one-sided or larger than the value."""
    lo, hi = finite(low), finite(high)
    if lo is None or hi is None:
        return NA
    return f"[{sig(lo)}, {sig(hi)}]" + (f" {unit}" if unit else "")

