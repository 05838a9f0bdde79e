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


@cache
def sm_count(device) -> int:
    """Multiprocessors of a CUDA device (persistent kernels launch one program each); 8 under the interpreter."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def interpreted() -> bool:
    """Whether Triton kernels run under its interpreter here (TRITON_INTERPRET=1): on NumPy, no PTX, no PDL."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_kernels(device) -> bool:
    """Whether the fast path's kernels apply to tensors on this device."""
    if device.type == "cuda":
        return triton_available()
    return interpreted() and triton_available()


def _interpreter_index_fix() -> None:
    """Triton 3.6's interpreter makes a loop bound an int with int(array), which NumPy >= 2.3 refuses for the
    one-element arrays that program ids and loaded scalars are; the persistent GEMM ranges from its program id,
    the decode attention over a loaded context length. Patch that one conversion (the interpreter re-applies its
    patches at every launch, so wrap the function that does)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "index_fixed", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch.index_fixed = True
    interpreter._patch_lang_tensor = patch


if interpreted() and triton_available():
    _interpreter_index_fix()
