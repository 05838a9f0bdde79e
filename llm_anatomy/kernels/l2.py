"""Asking for weights into L2 ahead of the kernel that reads them (sm_90 and later).

A batch-1 decode step at a short context spends ~8 us a layer in attention (QK-norm/RoPE, the split
kernel, its merge) while DRAM sits nearly idle: the few MB of KV cache are read in a fraction of that. The
attention's programs can use that time to bring the next GEMV's weights (o_proj: 32 MB for Qwen3-8B, of an
H200's 50 MB L2) into L2, so that the GEMV then reads them from L2 instead of DRAM. A prefetch is a hint: it
holds no registers, is not waited for, and changes no result.
"""

import triton
import triton.language as tl


@triton.jit
def _bulk_prefetch(ptrs, nbytes):
    """One bulk L2 prefetch per element (cp.async.bulk.prefetch: 16-byte aligned, a multiple of 16 bytes);
    none where nbytes is 0."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs.to(tl.int64, bitcast=True), nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _line_prefetch(ptrs, mask):
    """prefetch.global.L2 of the 128-byte line at each pointer where mask holds."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


# How the prefetch is issued: BULK, one bulk prefetch per thread (the TMA unit fetches it); LINES, one
# prefetch.global.L2 per 128-byte line, from the threads themselves
BULK, LINES = 1, 2
MODE = BULK


@triton.jit
def prefetch_share(base_ptr, nbytes, program, programs, LANES: tl.constexpr, MODE: tl.constexpr):
    """This program's share of the `nbytes` bytes at `base_ptr` (a uint8 pointer; nbytes a multiple of 16),
    asked into L2: the bytes are cut into `programs` equal shares, each share into LANES pieces, one per thread
    (LANES should be the program's thread count)."""
    share = tl.cdiv(tl.cdiv(nbytes, programs), 128 * LANES) * 128 * LANES
    piece = share // LANES
    start = program.to(tl.int64) * share + tl.arange(0, LANES).to(tl.int64) * piece
    size = tl.minimum(tl.maximum(nbytes - start, 0), piece).to(tl.int32)
    if MODE == 1:
        _bulk_prefetch(base_ptr + start, size)
    else:
        for line in range(0, piece, 128):
            _line_prefetch(base_ptr + start + line, line < size)
