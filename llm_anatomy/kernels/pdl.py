"""Programmatic dependent launch (Hopper and later): each kernel of the decode step may be launched while
the one before it is still finishing, so the ~300 launches of a step do not each pay a launch gap.

Every kernel starts with `gdc_enter`: it waits until the previous kernel has completed and its writes are
visible (griddepcontrol.wait), then lets the next kernel launch early (griddepcontrol.launch_dependents).
Semantics are those of ordinary stream order; only the launch latency overlaps. Off under the interpreter
and on GPUs before compute capability 9.0.

With LAUNCH_FIRST, a kernel lets the next launch before it waits, so the next one's programs are already
resident (themselves waiting) when this one ends. Still ordinary stream order: each kernel waits for the one
before, which waited for its own. On the H200 (Qwen3-8B batch-1 decode step, benchmarks/probe_early_launch.py)
this paid for the GEMVs (whose successors are small kernels) and the decode attention's split kernel, 0.015-0.03
ms a step at 512 tokens and at 32k, and cost 0.6 ms when given to the norms (the GEMV after a norm then launches
while the GEMV before the norm still streams) or 0.05 ms at 32k when given to QK-norm/RoPE. A kernel that feeds
the streaming batch-1 GEMV (stream_gemv.py: the norms, the attention's merge) does launch first: that GEMV's
blocks cannot share a multiprocessor with the one before, so they land as it leaves, and start reading weights
there (3.88 against 4.00 ms a step at 512 tokens, 5.05 against 5.21 at 32k: benchmarks/probe_stream_gemv.py).
Since then the norms inside a layer run in the GEMV after them at batch 1 (stream_gemv.py), so the GEMV before
launches that one directly.
"""

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


class _Switch:
    on = False


PDL = _Switch()


def enable_pdl(device, on: bool = True) -> bool:
    """Turn PDL on for kernels launched from now on (it is a launch option, so CUDA graphs captured
    afterwards carry it); returns whether it is on."""
    import torch

    PDL.on = bool(on and device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
                  and torch.cuda.get_device_capability(device)[0] >= 9)
    return PDL.on


@triton.jit
def gdc_enter(USE_PDL: tl.constexpr, LAUNCH_FIRST: tl.constexpr = False):
    if USE_PDL:
        if LAUNCH_FIRST:
            gdc_launch_dependents()
            gdc_wait()
        else:
            gdc_wait()
            gdc_launch_dependents()
