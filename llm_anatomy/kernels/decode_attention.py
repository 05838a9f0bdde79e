"""Paged decode attention (one query token per sequence), split along the context (flash-decoding).

Batch-1 decode has only KV-heads programs' worth of work per layer, far too few to fill the GPU and read
the cache at full bandwidth; so each (sequence, KV head) is split into `splits` ranges of the context,
each program attends its range for all query heads of its GQA group (one tl.dot over the group), and a
second kernel merges the partial softmaxes (at batch 1 each head in pieces, see merge_chunks). A batch large
enough for one split a sequence has nothing to merge: its split kernel writes the output. Tokens are
gathered through the block table per token, so the tile (BLOCK_N tokens) does not depend on the page size. Only
each sequence's valid context is read.

An fp8 e4m3 cache is read as 4-byte words and converted in registers to fp16 by PTX (`cvt.rn.f16x2.e4m3x2`, exact,
NaN kept), with the query and the probabilities in fp16 for the two dots. Loaded as fp8 and cast, Triton moves the
cast past the staging in shared memory: V, the dot's transposed operand, is then gathered from it byte by byte, and
each value goes to bf16 by way of fp16 (benchmarks/README.md). fp16 holds a bf16 query exactly down to 6e-5 and up
to 65504 (Qwen3's queries are RMS-normalised: far inside), and the probabilities with more bits than bf16.

(Two alternatives measured slower in the decode step, benchmarks/README.md: merging in the split kernel's
last-arriving program through an atomic counter, which saves a launch but makes the merge a serial chain of
loads; and a split kernel in CUDA C++ that reads the cache before its PDL wait.)
"""

import torch
import triton
import triton.language as tl

from . import interpreted, sm_count
from .pdl import gdc_enter

# Tile and pipelining for long contexts, where the attention's bytes matter (benchmarks/README.md); the short
# graph takes its own tile (DecodeAttentionPlan.short_block_n). Any config is correct.
BLOCK_N, NUM_WARPS, NUM_STAGES = 128, 4, 2
FP8_STAGES = 3  # an fp8 cache's 128-token tiles (half a bf16 tile's bytes): one more in flight


def merge_warps(splits_pad: int, d_block: int) -> int:
    """The merge kernel's warps: a program holds splits x d_block float32 partial sums, at most 128 a thread.
    They stay in registers so (one warp for 33 splits of 128-wide rows spilled them; benchmarks/README.md)."""
    return max(1, min(8, splits_pad * d_block // (32 * 128)))


def merge_chunks(programs: int, head_dim: int, sm_count: int) -> int:
    """Pieces of head_dim that each (sequence, query head) of the merge is cut into: the most, in powers of two
    and of at least 16 values, that keep `programs` x pieces within half a program per multiprocessor (batch 1,
    32 heads: 2 pieces of 64), so that each program's chain of loads is shorter, which shortens the batch-1 step (benchmarks/README.md)."""
    chunks = 1
    while 4 * chunks * programs <= sm_count and 2 * chunks <= head_dim // 16:
        chunks *= 2
    return chunks


@triton.jit
def _e4m3x4_to_f16(words):
    """Each int32 word's four e4m3 bytes as four fp16 tensors, the lowest byte first (exact: two cvt a word)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        .reg .b32 h0, h1;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 h0, lo;
        cvt.rn.f16x2.e4m3x2 h1, hi;
        mov.b32 {$0, $1}, h0;
        mov.b32 {$2, $3}, h1;
        }""",
        constraints="=h,=h,=h,=h,r", args=[words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True, pack=1)


@triton.jit
def _fp8_tile(ptr, offs, slot, head_offset, valid, stride_slot, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
              WORDS: tl.constexpr):
    """A [BLOCK_N, HEAD_DIM] tile of an fp8 e4m3 cache as fp16. WORDS: read as int32 words and converted in
    registers (the module's docstring says why); else (Triton's interpreter, which runs no PTX, or a cache not in
    4-byte words) loaded and cast, the same values."""
    if WORDS:
        w = tl.arange(0, HEAD_DIM // 4)
        word_offs = slot[:, None] * (stride_slot // 4) + head_offset // 4 + w[None, :]
        words = tl.load(ptr.to(tl.pointer_type(tl.int32)) + word_offs, mask=valid[:, None], other=0)
        b0, b1, b2, b3 = _e4m3x4_to_f16(words)
        # join's new axis is last: ((b0, b2), (b1, b3)) flattens to b0 b1 b2 b3, the bytes' order
        return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [BLOCK_N, HEAD_DIM])
    return tl.load(ptr + offs, mask=valid[:, None], other=0.0).to(tl.float16)


@triton.jit
def _attend_tile(q, k_ptr, v_ptr, table_ptr, b, kvh, n0, end, m, l, acc, scale, stride_tb, stride_slot, stride_head,
                 page_size, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
                 WORDS: tl.constexpr):
    d = tl.arange(0, HEAD_DIM)
    tok = n0 + tl.arange(0, BLOCK_N)
    valid = tok < end
    page = tl.load(table_ptr + b * stride_tb + tok // page_size, mask=valid, other=0)
    slot = page.to(tl.int64) * page_size + tok % page_size
    offs = slot[:, None] * stride_slot + kvh * stride_head + d[None, :]
    if FP8:  # scale 1 (rope.py); q is fp16 already (the split kernel)
        k = _fp8_tile(k_ptr, offs, slot, kvh * stride_head, valid, stride_slot, HEAD_DIM, BLOCK_N, WORDS)
        v = _fp8_tile(v_ptr, offs, slot, kvh * stride_head, valid, stride_slot, HEAD_DIM, BLOCK_N, WORDS)
    else:
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0).to(q.dtype)
    if IEEE:  # float32 caches: exact products, not TF32
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        scores = tl.dot(q, tl.trans(k)) * scale
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    l = l * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


@triton.jit
def _split_len(ctx, splits, BLOCK_N: tl.constexpr):
    """Tokens of each split of a context of ctx: a whole number of tiles."""
    return tl.cdiv(tl.cdiv(ctx, splits), BLOCK_N) * BLOCK_N


# The block tables' width, the split count and where the step's integers sit change from step to step: no
# specialising on them, so that an eager step of a new shape does not compile a kernel.
@triton.jit(do_not_specialize=["stride_tb", "splits"], do_not_specialize_on_alignment=["table_ptr", "ctx_ptr"])
def _decode_attention_split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, acc_ptr, ml_ptr, out_ptr, scale,
                  stride_qb, stride_qh, stride_ob, stride_oh, stride_tb, stride_slot, stride_head, n_kv_heads,
                  page_size, splits, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_N: tl.constexpr, IEEE: tl.constexpr, DIRECT: tl.constexpr, USE_PDL: tl.constexpr,
                  FP8: tl.constexpr, WORDS: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    # The lengths are written before the step, not by a kernel of it: read while the kernel before finishes. (The
    # first tile of keys and values is not read there: that was slower, benchmarks/README.md.)
    ctx = tl.load(ctx_ptr + b)
    per_split = _split_len(ctx, splits, BLOCK_N)
    start = s * per_split
    end = tl.minimum(start + per_split, ctx)
    # A split past the context (more splits than a short context fills) leaves at once, before its wait; the
    # merge reads only the splits that hold tokens.
    if start < ctx:
        gdc_enter(USE_PDL, LAUNCH_FIRST=True)  # see pdl.py
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUP + g
        gmask = g < GROUP
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        if FP8:
            q = q.to(tl.float16)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            m, l, acc = _attend_tile(q, k_ptr, v_ptr, table_ptr, b, kvh, n0, end, m, l, acc, scale, stride_tb,
                                     stride_slot, stride_head, page_size, HEAD_DIM, BLOCK_N, IEEE, FP8, WORDS)
        if DIRECT:  # one split: the output itself, as the merge would make it of one split
            out = acc / tl.maximum(l, 1e-30)[:, None]
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
        else:  # partials: acc [b, head, split, d] unnormalised; ml [b, head, split, 2] = (max, sum)
            base = (b * n_kv_heads * GROUP + heads) * splits + s
            tl.store(acc_ptr + base[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])
            tl.store(ml_ptr + base * 2, m, mask=gmask)
            tl.store(ml_ptr + base * 2 + 1, l, mask=gmask)
    elif DIRECT:  # a padded row (no context): zeros, as the merge gives it
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUP + g
        zeros = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], zeros, mask=(g < GROUP)[:, None])


@triton.jit
def _splits_used(ctx, splits, BLOCK_N: tl.constexpr):
    """How many of a sequence's splits hold tokens: each takes a whole number of tiles, the last what is left."""
    return tl.cdiv(ctx, tl.maximum(_split_len(ctx, splits, BLOCK_N), 1))


@triton.jit(do_not_specialize=["splits"], do_not_specialize_on_alignment=["ctx_ptr"])
def _decode_attention_merge_kernel(acc_ptr, ml_ptr, ctx_ptr, out_ptr, stride_ob, stride_oh, n_heads, splits,
                  SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                  USE_PDL: tl.constexpr, LAUNCH_FIRST: tl.constexpr):
    gdc_enter(USE_PDL, LAUNCH_FIRST)
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    smask = sp < _splits_used(tl.load(ctx_ptr + b), splits, BLOCK_N)  # none for a padded row: zeros out
    base = (b * n_heads + h) * splits + sp
    m = tl.load(ml_ptr + base * 2, mask=smask, other=float("-inf"))
    l = tl.load(ml_ptr + base * 2 + 1, mask=smask, other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)  # empty splits weigh nothing
    d = tl.program_id(2) * D_BLOCK + tl.arange(0, D_BLOCK)  # this program's piece of the head
    acc = tl.load(acc_ptr + base[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
    total = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def default_splits(batch: int, n_kv_heads: int, sm_count: int) -> int:
    """Enough (sequence, head, split) programs to give every multiprocessor about two."""
    return max(1, min(64, triton.cdiv(2 * sm_count, batch * n_kv_heads)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           splits: int | None = None, block_n: int | None = None, num_warps: int = NUM_WARPS,
                           num_stages: int | None = None, pdl: bool = False, launch_first: bool = False
                           ) -> torch.Tensor:
    """q [B, H, D]; k/v_cache one layer's [pages, page_size, KVH, D], in any strides that keep slots flat;
    block_tables [B, max_pages] int32; context_lens [B] int32 (0 for a padded row, which then gets zeros)
    -> [B, H, D]. `pdl`, `launch_first` (the merge's, where the next kernel is the streaming GEMV): pdl.py."""
    batch, n_heads, head_dim = q.shape
    n_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    # slots are flat (page x page_size + position); any order of the head and slot dimensions is read
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "K and V caches laid out alike"
    assert k_cache.stride(0) == page_size * k_cache.stride(1), "a page's positions one slot stride apart"
    group = n_heads // n_kv_heads
    splits = splits or default_splits(batch, n_kv_heads, sm_count(q.device))
    block_n = block_n or BLOCK_N
    out = torch.empty_like(q)
    direct = splits == 1  # large batches: nothing to merge, the split kernel writes the output
    fp8 = k_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32  # a float32 query: exact float32 dots
    words = (fp8 and q.is_cuda and not interpreted() and head_dim % 4 == 0
             and k_cache.stride(1) % 4 == 0 and k_cache.stride(2) % 4 == 0
             and k_cache.data_ptr() % 4 == 0 and v_cache.data_ptr() % 4 == 0)
    if num_stages is None:
        num_stages = FP8_STAGES if fp8 and block_n == BLOCK_N else NUM_STAGES
    acc = torch.empty(0 if direct else batch * n_heads * splits * head_dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(0 if direct else batch * n_heads * splits * 2, dtype=torch.float32, device=q.device)
    _decode_attention_split_kernel[(batch, n_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, acc, ml, out, scale, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), k_cache.stride(1), k_cache.stride(2), n_kv_heads,
        page_size, splits, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_N=block_n, IEEE=q.dtype == torch.float32, DIRECT=direct,
        USE_PDL=pdl, FP8=fp8, WORDS=words, launch_pdl=pdl, num_warps=num_warps, num_stages=num_stages)
    if direct:
        return out
    splits_pad = max(2, triton.next_power_of_2(splits))
    chunks = merge_chunks(batch * n_heads, head_dim, sm_count(q.device))
    _decode_attention_merge_kernel[(batch, n_heads, chunks)](
        acc, ml, context_lens, out, out.stride(0), out.stride(1), n_heads, splits, SPLITS_PAD=splits_pad,
        HEAD_DIM=head_dim, D_BLOCK=head_dim // chunks, BLOCK_N=block_n, USE_PDL=pdl,
        LAUNCH_FIRST=launch_first, launch_pdl=pdl,
        num_warps=merge_warps(splits_pad, head_dim // chunks))
    return out
