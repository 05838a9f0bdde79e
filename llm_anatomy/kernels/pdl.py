"""Programmatic dependent launch (Hopper and later): each kernel of the decode step may be launched while
the one before it is still finishing, so the ~300 launches of a step do not each pay a launch gap.

Every kernel starts with `gdc_enter`: it waits until the previous kernel has completed and its writes are
visible (griddepcontrol.wait), then lets the next kernel launch early (griddepcontrol.launch_dependents).
Semantics are those of ordinary stream order; only the launch latency overlaps. Whether a launch uses PDL is
the caller's `pdl` argument, from its engine's plan (engine/plan.py); `supported` says where it can.

With LAUNCH_FIRST, a kernel lets the next launch before it waits, so the next one's programs are already
resident (themselves waiting) when this one ends. Still ordinary stream order: each kernel waits for the one
before, which waited for its own. It pays for the GEMVs (whose successors are small kernels) and the decode
attention's split kernel, and for the kernels that feed the streaming batch-1 GEMV (stream_gemv.py: the norms,
the attention's merge): that GEMV's blocks cannot share a multiprocessor with the kernel before, so they land as
it leaves and start reading weights there. It costs where given to a norm followed by the Triton GEMV (the GEMV
after the norm then launches while the GEMV before it still streams). Measured choices: benchmarks/README.md.
"""

from functools import cache

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import interpreted


@triton.jit
def gdc_enter(USE_PDL: tl.constexpr, LAUNCH_FIRST: tl.constexpr = False):
    if USE_PDL:
        if LAUNCH_FIRST:
            gdc_launch_dependents()
            gdc_wait()
        else:
            gdc_wait()
            gdc_launch_dependents()


@triton.jit
def _probe_kernel(x_ptr, USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)
    tl.store(x_ptr, tl.load(x_ptr) + 1)


@cache
def _supported(device_index: int) -> bool:
    import torch

    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    device = torch.device("cuda", device_index)
    x = torch.zeros(1, device=device)
    try:  # some drivers cannot capture programmatic launches into a CUDA graph: find out once, here
        with torch.cuda.device(device):
            _probe_kernel[(1,)](x, USE_PDL=True, launch_pdl=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _probe_kernel[(1,)](x, USE_PDL=True, launch_pdl=True)
            graph.replay()
            torch.cuda.synchronize(device)
    except RuntimeError as e:
        import logging

        logging.getLogger(__name__).warning("programmatic dependent launch is unavailable here (%s); kernels "
                                            "launch one after the other", str(e).splitlines()[0])
        return False
    return x.item() == 2


def supported(device) -> bool:
    """Whether kernels on this device can launch with PDL, in CUDA graphs too: compute capability 9.0 or later,
    not under Triton's interpreter, and a driver that captures such launches (checked once per device)."""
    if device.type != "cuda" or interpreted():
        return False
    return _supported(device.index if device.index is not None else 0)
