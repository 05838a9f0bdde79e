"""Triton kernels for the CUDA fast path, each with a PyTorch reference beside it and a test against it.

On a machine without CUDA the kernels still run under Triton's interpreter (TRITON_INTERPRET=1), which is
how the CPU tests check them; the engine itself uses them only on CUDA devices.
"""

from __future__ import annotations

import os
from functools import cache


@cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_kernels(device) -> bool:
    """Whether the fast path's kernels apply to tensors on this device."""
    if device.type == "cuda":
        return triton_available()
    return os.environ.get("TRITON_INTERPRET") == "1" and triton_available()
