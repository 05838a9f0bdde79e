"""Programmatic dependent launch (Hopper and later): each kernel of the decode step may be launched while
the one before it is still finishing, so the ~300 launches of a step do not each pay a launch gap.

Every kernel starts with `gdc_enter`: it waits until the previous kernel has completed and its writes are
visible (griddepcontrol.wait), then lets the next kernel launch early (griddepcontrol.launch_dependents).
Semantics are those of ordinary stream order; only the launch latency overlaps. Off under the interpreter
and on GPUs before compute capability 9.0.
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
def gdc_enter(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


# Weights do not depend on the kernel before: a kernel may ask for them before its wait. The bulk prefetch
# (Hopper's cp.async.bulk.prefetch.L2) has the memory system pull a range into L2 with no registers and no
# waiting, so the loads after the wait find them there, and the memory bus does not idle while the kernel
# before finishes. Pieces of PREFETCH_CHUNK bytes, one per lane.
PREFETCH_CHUNK = tl.constexpr(4096)


@triton.jit
def prefetch_l2(base, nbytes, part, parts, ON: tl.constexpr, LANES: tl.constexpr = 128):
    """Prefetch piece `part` of `parts` equal pieces of the bytes [base, base + nbytes) into L2 (a hint: it
    changes no result). Off under the interpreter and before Hopper."""
    if ON:
        chunks = tl.cdiv(nbytes, PREFETCH_CHUNK)
        per = tl.cdiv(chunks, parts)
        first = part * per
        last = tl.minimum(first + per, chunks)
        raw = base.to(tl.pointer_type(tl.int8))
        for c0 in range(first, last, LANES):
            c = c0 + tl.arange(0, LANES)
            off = c.to(tl.int64) * PREFETCH_CHUNK
            size = tl.where(c < last, tl.minimum(nbytes - off, PREFETCH_CHUNK), 0).to(tl.int32) & ~15
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [raw + off, size], dtype=tl.int32, is_pure=False, pack=1)
