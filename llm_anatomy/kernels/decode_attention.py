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

Batch 1's short contexts take one kernel instead of three (rope_decode_attention): rope.py's QK-norm, RoPE and
store, the split kernel and the merge, straight from the qkv product. A decode step's attention is then one
dependent wait between the qkv and o_proj GEMVs rather than three; each split reads its first tile before its
wait, and the last split of each KV head to finish (an atomic count) merges the partials, all heads of its group
in one set of loads (benchmarks/README.md has the measured steps).
"""

import torch
import triton
import triton.language as tl

from . import interpreted, sm_count
from .pdl import gdc_enter
from .rope import _cache_value, norm_rotate

# Tile and pipelining for long contexts, where the attention's bytes matter (benchmarks/README.md); the short
# graph takes its own tile (DecodeAttentionPlan.short_block_n). Any config is correct.
BLOCK_N, NUM_WARPS, NUM_STAGES = 128, 4, 2
FP8_STAGES = 3  # an fp8 cache's 128-token tiles (half a bf16 tile's bytes): one more in flight
# rope_decode_attention: a program's first tile is read before its wait, the rest (contexts past a tile a split)
# one at a time; 8 warps made batch 1's step shorter than 4 (benchmarks/README.md)
ROPE_ATTENTION_WARPS = 8


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
def _kv_tile(k_ptr, v_ptr, table_ptr, b, kvh, n0, end, stride_tb, stride_slot, stride_head, page_size,
             dtype: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
             WORDS: tl.constexpr):
    """Keys and values of tokens n0 .. n0 + BLOCK_N (those before `end`; zeros past it) through the block table,
    [BLOCK_N, HEAD_DIM] each, in the dtype of the dots (an fp8 cache's as fp16, scale 1: rope.py)."""
    d = tl.arange(0, HEAD_DIM)
    tok = n0 + tl.arange(0, BLOCK_N)
    valid = tok < end
    page = tl.load(table_ptr + b * stride_tb + tok // page_size, mask=valid, other=0)
    slot = page.to(tl.int64) * page_size + tok % page_size
    offs = slot[:, None] * stride_slot + kvh * stride_head + d[None, :]
    if FP8:
        k = _fp8_tile(k_ptr, offs, slot, kvh * stride_head, valid, stride_slot, HEAD_DIM, BLOCK_N, WORDS)
        v = _fp8_tile(v_ptr, offs, slot, kvh * stride_head, valid, stride_slot, HEAD_DIM, BLOCK_N, WORDS)
    else:
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0).to(dtype)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0).to(dtype)
    return k, v


@triton.jit
def _attend(q, k, v, valid, m, l, acc, scale, IEEE: tl.constexpr):
    """The online softmax's step over one tile: scores of the valid tokens, (max, sum, accumulator) updated."""
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
def _attend_tile(q, k_ptr, v_ptr, table_ptr, b, kvh, n0, end, m, l, acc, scale, stride_tb, stride_slot, stride_head,
                 page_size, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
                 WORDS: tl.constexpr):
    k, v = _kv_tile(k_ptr, v_ptr, table_ptr, b, kvh, n0, end, stride_tb, stride_slot, stride_head, page_size,
                    q.dtype, HEAD_DIM, BLOCK_N, FP8, WORDS)
    return _attend(q, k, v, n0 + tl.arange(0, BLOCK_N) < end, m, l, acc, scale, IEEE)


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


@triton.jit
def _merged(m, l, acc, AXIS: tl.constexpr):
    """Partials merged along AXIS, the splits': their maxima m and sums l, their unnormalised accumulators acc
    (the head's values on the axis after AXIS). Empty splits (m = -inf) weigh nothing."""
    m_all = tl.max(m, axis=AXIS, keep_dims=True)
    w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)
    total = tl.sum(l * w, axis=AXIS, keep_dims=True)
    return tl.sum(acc * tl.expand_dims(w, AXIS + 1), axis=AXIS) / tl.maximum(total, 1e-30)


@triton.jit
def _merge_group(acc_ptr, ml_ptr, out_ptr, first, splits, used, stride_oh, GROUP: tl.constexpr,
                 GROUP_P2: tl.constexpr, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The one-kernel attention's merge of a KV head's group: its GROUP heads' partials (from L2, in one set of
    loads) over the first `used` of SPLITS splits, into out_ptr's heads (stride_oh apart). `first`: the group's
    first partial row (heads `splits` rows apart)."""
    j = tl.arange(0, GROUP_P2)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    jm = (j < GROUP)[:, None] & (sp < used)[None, :]
    hb = first + j[:, None] * splits + sp[None, :]  # [GROUP_P2, SPLITS]
    pm = tl.load(ml_ptr + hb * 2, mask=jm, other=float("-inf"), cache_modifier=".cg")
    pl = tl.load(ml_ptr + hb * 2 + 1, mask=jm, other=0.0, cache_modifier=".cg")
    pa = tl.load(acc_ptr + hb[:, :, None] * HEAD_DIM + d[None, None, :], mask=jm[:, :, None], other=0.0,
                 cache_modifier=".cg")
    tl.store(out_ptr + j[:, None] * stride_oh + d[None, :], _merged(pm, pl, pa, 1).to(out_ptr.dtype.element_ty),
             mask=(j < GROUP)[:, None])


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
    d = tl.program_id(2) * D_BLOCK + tl.arange(0, D_BLOCK)  # this program's piece of the head
    acc = tl.load(acc_ptr + base[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
    out = _merged(m, l, acc, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _rotated_heads(row_ptr, first, qn_ptr, cos, sin, eps, NH: tl.constexpr, NH_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads first .. first + NH of a qkv row, QK-normed and rotated as rope.py's kernel does (norm_rotate):
    [NH_PAD, HEAD_DIM] in the model dtype, padded heads zero."""
    half: tl.constexpr = HEAD_DIM // 2
    dh = tl.arange(0, half)
    g = tl.arange(0, NH_PAD)
    cols = (first + g) * HEAD_DIM
    gmask = (g < NH)[:, None]
    x1 = tl.load(row_ptr + cols[:, None] + dh[None, :], mask=gmask, other=0.0)
    x2 = tl.load(row_ptr + cols[:, None] + half + dh[None, :], mask=gmask, other=0.0)
    w1 = None
    w2 = None
    if HAS_NORM:
        w1 = tl.load(qn_ptr + dh).to(tl.float32)[None, :]
        w2 = tl.load(qn_ptr + half + dh).to(tl.float32)[None, :]
    o1, o2 = norm_rotate(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM, HAS_NORM)
    # the halves side by side: join gives [NH_PAD, half, 2]; its last two axes swapped, flattened
    return tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), [NH_PAD, HEAD_DIM])


@triton.jit(do_not_specialize=["stride_tb", "splits"],
            do_not_specialize_on_alignment=["table_ptr", "ctx_ptr", "pos_ptr", "slot_ptr"])
def _rope_decode_attention_kernel(qkv_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, pos_ptr, slot_ptr, qn_ptr, kn_ptr,
                                  cos_ptr, sin_ptr, acc_ptr, ml_ptr, count_ptr, out_ptr, scale, eps, stride_qkv,
                                  stride_ob, stride_oh, stride_tb, stride_slot, stride_head, n_heads, n_kv_heads,
                                  page_size, splits, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS_PAD: tl.constexpr,
                                  SPLITS_HALF: tl.constexpr,
                                  HAS_NORM: tl.constexpr, FP8: tl.constexpr, WORDS: tl.constexpr,
                                  GROUP_P2: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    ctx = tl.load(ctx_ptr + b)
    per_split = _split_len(ctx, splits, BLOCK_N)
    start = s * per_split
    end = tl.minimum(start + per_split, ctx)
    if start < ctx:
        newest = ctx - 1  # this step's token: its key and value come from the qkv row, not from the cache
        dtype = qkv_ptr.dtype.element_ty
        tile_dtype: tl.constexpr = tl.float16 if FP8 else dtype
        # The cache before this step is not the kernel before's output: its first tile is read while that one ends
        k, v = _kv_tile(k_ptr, v_ptr, table_ptr, b, kvh, start, tl.minimum(end, newest), stride_tb, stride_slot,
                        stride_head, page_size, tile_dtype, HEAD_DIM, BLOCK_N, FP8, WORDS)
        pos = tl.load(pos_ptr + b)
        table = pos.to(tl.int64) * half + tl.arange(0, half)[None, :]
        cos = tl.load(cos_ptr + table)
        sin = tl.load(sin_ptr + table)
        gdc_enter(USE_PDL, LAUNCH_FIRST=True)  # see pdl.py
        row = qkv_ptr + b * stride_qkv
        q = _rotated_heads(row, kvh * GROUP, qn_ptr, cos, sin, eps, GROUP, GROUP_PAD, HEAD_DIM, HAS_NORM)
        k_new = _rotated_heads(row, n_heads + kvh, kn_ptr, cos, sin, eps, 1, 1, HEAD_DIM, HAS_NORM)
        v_new = tl.load(row + (n_heads + n_kv_heads + kvh) * HEAD_DIM + d)[None, :]
        # as the cache holds them (an fp8 cache rounds: the dots take the stored values, as the next steps will)
        k_new = _cache_value(k_new, k_ptr)
        v_new = _cache_value(v_new, v_ptr)
        if end == ctx:  # this split holds the new token: it stores its key and value for the steps after
            slot = tl.load(slot_ptr + b)
            if slot >= 0:
                dst = slot.to(tl.int64) * stride_slot + kvh * stride_head + d[None, :]
                tl.store(k_ptr + dst, k_new)
                tl.store(v_ptr + dst, v_new)
        q = q.to(tile_dtype)
        k_new = k_new.to(tile_dtype)
        v_new = v_new.to(tile_dtype)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        tok = start + tl.arange(0, BLOCK_N)
        is_new = (tok == newest)[:, None]
        m, l, acc = _attend(q, tl.where(is_new, k_new, k), tl.where(is_new, v_new, v), tok < end, m, l, acc, scale,
                            IEEE)
        for n0 in range(start + BLOCK_N, end, BLOCK_N):  # contexts past a tile a split
            k, v = _kv_tile(k_ptr, v_ptr, table_ptr, b, kvh, n0, tl.minimum(end, newest), stride_tb, stride_slot,
                            stride_head, page_size, tile_dtype, HEAD_DIM, BLOCK_N, FP8, WORDS)
            tok = n0 + tl.arange(0, BLOCK_N)
            is_new = (tok == newest)[:, None]
            m, l, acc = _attend(q, tl.where(is_new, k_new, k), tl.where(is_new, v_new, v), tok < end, m, l, acc,
                                scale, IEEE)
        base = (b * n_kv_heads * GROUP + heads) * splits + s
        tl.store(acc_ptr + base[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])
        tl.store(ml_ptr + base * 2, m, mask=gmask)
        tl.store(ml_ptr + base * 2 + 1, l, mask=gmask)
        # The last split of this (sequence, KV head) to finish merges them all, as the merge kernel does: the
        # barrier, then the count's release, order this program's stores before it; the acquire orders the last
        # one's loads (from L2) after every other's. Its group's heads in one set of loads: a load per head, one
        # after the other, made the step slower than the merge kernel (benchmarks/README.md).
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + b * n_kv_heads + kvh, 1, sem="acq_rel", scope="gpu")
        used = _splits_used(ctx, splits, BLOCK_N)
        if arrived == used - 1:
            tl.atomic_xchg(count_ptr + b * n_kv_heads + kvh, 0, sem="relaxed", scope="gpu")  # for the next launch
            first = (b * n_kv_heads * GROUP + kvh * GROUP) * splits
            out = out_ptr + b * stride_ob + kvh * GROUP * stride_oh
            # a short context fills at most half the splits: its merge reads and sums half as many
            if used <= SPLITS_HALF:
                _merge_group(acc_ptr, ml_ptr, out, first, splits, used, stride_oh, GROUP, GROUP_P2, SPLITS_HALF,
                             HEAD_DIM)
            else:
                _merge_group(acc_ptr, ml_ptr, out, first, splits, used, stride_oh, GROUP, GROUP_P2, SPLITS_PAD,
                             HEAD_DIM)
    elif s == 0:  # a padded row (no context): zeros, as the merge gives it
        zeros = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], zeros, mask=gmask[:, None])


def rope_decode_attention(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                          q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor,
                          sin: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                          counts: torch.Tensor, scale: float, splits: int, block_n: int, pdl: bool = False
                          ) -> torch.Tensor:
    """A decode step's attention from the qkv product's rows [B, (H + 2 KVH) x D] in one kernel: each split
    QK-norms and rotates its group's queries and this step's key (rope.py's arithmetic), the split holding the new
    token stores its key and value in the cache, each attends its range of the context as paged_decode_attention's
    split kernel does (the new token's key and value from the row, as the cache holds them; the rest from the
    cache, the first tile read before the PDL wait), and the last split of each (sequence, KV head) to finish merges
    their partials as its merge kernel does. The arguments after the first are qk_norm_rope_store's and
    paged_decode_attention's; `counts`: int32 [B x KVH] at zero, left at zero (the last split resets its count), one
    set per stream that runs this kernel. Returns [B, H, D]; a padded row (no context) gets zeros."""
    batch = qkv.shape[0]
    group = n_heads // n_kv_heads
    if counts.dtype != torch.int32 or counts.numel() < batch * n_kv_heads:
        raise ValueError(f"counts must be int32 with at least {batch * n_kv_heads} elements")
    out = torch.empty(batch, n_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    acc = torch.empty(batch * n_heads * splits * head_dim, dtype=torch.float32, device=qkv.device)
    ml = torch.empty(batch * n_heads * splits * 2, dtype=torch.float32, device=qkv.device)
    fp8, words = _fp8_reads(qkv, k_cache, v_cache, head_dim)
    has_norm = q_norm is not None
    splits_pad = max(2, triton.next_power_of_2(splits))
    _rope_decode_attention_kernel[(batch, n_kv_heads, splits)](
        qkv, k_cache, v_cache, block_tables, context_lens, positions, slot_mapping, q_norm if has_norm else qkv,
        k_norm if has_norm else qkv, cos, sin, acc, ml, counts, out, scale, eps, qkv.stride(0), out.stride(0),
        out.stride(1), block_tables.stride(0), k_cache.stride(1), k_cache.stride(2), n_heads, n_kv_heads,
        k_cache.shape[1], splits, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_N=block_n, SPLITS_PAD=splits_pad, SPLITS_HALF=max(1, splits_pad // 2), HAS_NORM=has_norm, FP8=fp8,
        WORDS=words,
        GROUP_P2=triton.next_power_of_2(group), IEEE=qkv.dtype == torch.float32, USE_PDL=pdl, launch_pdl=pdl,
        num_warps=ROPE_ATTENTION_WARPS, num_stages=1)
    return out


def _fp8_reads(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> tuple[bool, bool]:
    """(fp8, words) of an attention kernel's cache reads: an fp8 cache read as fp8 (dots in fp16) unless the query
    is float32 (exact float32 dots then), and read as 4-byte words (_fp8_tile) where the cache allows it on a GPU."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32
    words = (fp8 and q.is_cuda and not interpreted() and head_dim % 4 == 0 and k_cache.stride(1) % 4 == 0
             and k_cache.stride(2) % 4 == 0 and k_cache.data_ptr() % 4 == 0 and v_cache.data_ptr() % 4 == 0)
    return fp8, words


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
    fp8, words = _fp8_reads(q, k_cache, v_cache, head_dim)
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
