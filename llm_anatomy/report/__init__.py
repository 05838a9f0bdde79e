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
