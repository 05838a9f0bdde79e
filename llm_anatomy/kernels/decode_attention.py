"""Paged decode attention (one query token per sequence), split along the context (flash-decoding).

Batch-1 decode has only KV-heads programs' worth of work per layer, far too few to fill the GPU and read
the cache at full bandwidth; so each (sequence, KV head) is split into `splits` ranges of the context,
each program attends its range for all query heads of its GQA group (one tl.dot over the group), and a
second kernel merges the partial softmaxes. Tokens are gathered through the block table per token, so the
tile (BLOCK_N tokens) does not depend on the page size. Only each sequence's valid context is read.

(Merging in the last-arriving program of the first kernel, through an atomic counter, saves a launch but
was slower on the H200: 15 us a layer against 7.4 for the two kernels, its merge being a serial chain of
loads. benchmarks/results/2026-11-29_bench_run3.json, section attn.)

A decode step calls paged_decode_attention_qkv: the split kernel itself QK-norms and rotates its group's
query heads straight from the qkv projection's output, and the program whose split holds the newest token
also makes that token's key, stores it and the value into the cache, and folds it into its softmax from
registers; that removes rope.py's kernel, and the wait before the attention, from every layer of the step.
"""

import torch
import triton
import triton.language as tl

from . import sm_count
from .pdl import PDL, gdc_enter
from .stream_gemv import streams

# Tile and pipelining: the best of benchmarks/bench_h200.py's section attn at 32k context on the H200
# (at 512 tokens all configs were within 10%). Any config is correct.
BLOCK_N, NUM_WARPS, NUM_STAGES = 128, 4, 2


class _Switch:
    on = True


# Whether a decode step's QK-norm + RoPE + K/V store run inside the attention (paged_decode_attention_qkv) rather
# than in rope.py's kernel before it; models/qwen3.py consults it at each call, so a probe can time both.
ROPE_IN_ATTENTION = _Switch()


def merge_warps(splits_pad: int, head_dim: int) -> int:
    """The merge kernel's warps: a program holds splits x head_dim float32 partial sums, at most 128 a thread.
    One warp for 33 splits spilled them: on the H200, 36 layers of attention at 32k took 1.541 ms with one
    warp and 1.456 with two; with 66 splits one warp took 2.79 ms and four 1.58
    (benchmarks/probe_kv_layout.py)."""
    return max(1, min(8, splits_pad * head_dim // (32 * 128)))


@triton.jit
def _attend_tile(q, k_ptr, v_ptr, table_ptr, b, kvh, n0, end, m, l, acc, scale, stride_tb, stride_slot, stride_head,
                 page_size, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    d = tl.arange(0, HEAD_DIM)
    tok = n0 + tl.arange(0, BLOCK_N)
    valid = tok < end
    page = tl.load(table_ptr + b * stride_tb + tok // page_size, mask=valid, other=0)
    slot = page.to(tl.int64) * page_size + tok % page_size
    offs = slot[:, None] * stride_slot + kvh * stride_head + d[None, :]
    k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
    v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
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


@triton.jit
def _head_pairs(row_ptr, heads, hmask, partner, HEAD_DIM: tl.constexpr):
    """Heads [R] of one token's qkv row, [R, HEAD_DIM] twice: as stored, and each element's rotate-half partner
    (d + D/2) % D, a second load of the same bytes (a cache hit) rather than the two halves concatenated, so
    that the rotated head comes out whole, the tile tl.dot takes."""
    ptrs = row_ptr + heads[:, None] * HEAD_DIM
    x = tl.load(ptrs + tl.arange(0, HEAD_DIM)[None, :], mask=hmask[:, None], other=0.0)
    return x, tl.load(ptrs + partner[None, :], mask=hmask[:, None], other=0.0)


@triton.jit
def _norm_rope(x, p, w, wp, cos, sin, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads x [R, HEAD_DIM] QK-normed (weights w, and wp at the partners p) and rotated (cos/sin [HEAD_DIM] at the
    token's position), rounded to x's dtype where rope.py rounds: the normalised value, its product with the
    weight, the rotated value."""
    dtype = x.dtype
    a = x.to(tl.float32)
    b = p.to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt(tl.sum(a * a, axis=1) / HEAD_DIM + eps)[:, None]
        a = ((a * inv).to(dtype).to(tl.float32) * w[None, :]).to(dtype).to(tl.float32)
        b = ((b * inv).to(dtype).to(tl.float32) * wp[None, :]).to(dtype).to(tl.float32)
    first = (tl.arange(0, HEAD_DIM) < HEAD_DIM // 2)[None, :]
    return tl.where(first, a * cos[None, :] - b * sin[None, :], a * cos[None, :] + b * sin[None, :]).to(dtype)


# The block tables' width, the split count and where the step's integers sit change from step to step: no
# specialising on them, so that an eager step of a new shape does not compile a kernel. The arguments after
# USE_PDL are the fused decode's (paged_decode_attention_qkv); left at their defaults, q_ptr is the queries.
@triton.jit(do_not_specialize=["stride_tb", "splits"],
            do_not_specialize_on_alignment=["table_ptr", "ctx_ptr", "pos_ptr", "slot_ptr"])
def _decode_attention_split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, acc_ptr, ml_ptr, scale,
                  stride_qb, stride_qh, stride_tb, stride_slot, stride_head, n_kv_heads, page_size, splits,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  IEEE: tl.constexpr, USE_PDL: tl.constexpr, pos_ptr=None, slot_ptr=None, cos_ptr=None,
                  sin_ptr=None, qn_ptr=None, kn_ptr=None, eps=0.0, FUSED_QKV: tl.constexpr = False,
                  HAS_NORM: tl.constexpr = False):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    # The lengths are written before the step, not by a kernel of it: read while the kernel before finishes. (Its
    # first tile of keys and values read there too was slower: 4.226 ms a step against 4.172 at 512 tokens on the
    # H200, commit f871882.)
    ctx = tl.load(ctx_ptr + b)
    per_split = _split_len(ctx, splits, BLOCK_N)
    start = s * per_split
    end = tl.minimum(start + per_split, ctx)
    # A split past the context (more splits than a short context fills) leaves at once, before its wait; the
    # merge reads only the splits that hold tokens.
    if start < ctx:
        if FUSED_QKV:
            # Likewise the step's positions and slots, and the model's RoPE tables and norm weights, so that after
            # the wait only the qkv row is waited for. (Read after it, the position-then-table chain of loads
            # delayed every program's first tile: in a micro-benchmark of 36 layers on the H200 the fused kernels
            # were then slower than rope.py's kernel and the unfused ones together.)
            half: tl.constexpr = HEAD_DIM // 2
            partner = (tl.arange(0, HEAD_DIM) + half) % HEAD_DIM
            pos = tl.load(pos_ptr + b)
            slot = tl.load(slot_ptr + b)
            rot = pos.to(tl.int64) * half + tl.arange(0, HEAD_DIM) % half
            cos = tl.load(cos_ptr + rot)
            sin = tl.load(sin_ptr + rot)
            wq = tl.load(qn_ptr + tl.arange(0, HEAD_DIM)).to(tl.float32)
            wq_p = tl.load(qn_ptr + partner).to(tl.float32)
            wk = tl.load(kn_ptr + tl.arange(0, HEAD_DIM)).to(tl.float32)
            wk_p = tl.load(kn_ptr + partner).to(tl.float32)
        gdc_enter(USE_PDL, LAUNCH_FIRST=True)  # see pdl.py
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUP + g
        gmask = g < GROUP
        if FUSED_QKV:  # q_ptr: the qkv projection's output, a row per sequence
            # The newest token's key and value only where this split holds it (end == ctx), loaded with the queries
            n_heads = n_kv_heads * GROUP
            last = (tl.zeros([1], tl.int32) + end) == ctx
            k_head = tl.zeros([1], tl.int32) + n_heads + kvh
            row = q_ptr + b * stride_qb
            k, k_p = _head_pairs(row, k_head, last, partner, HEAD_DIM)
            v = tl.load(row + (k_head + n_kv_heads)[:, None] * HEAD_DIM + d[None, :], mask=last[:, None], other=0.0)
            q, q_p = _head_pairs(row, heads, gmask, partner, HEAD_DIM)
            q = _norm_rope(q, q_p, wq, wq_p, cos, sin, eps, HEAD_DIM, HAS_NORM)
        else:
            q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None],
                        other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        if FUSED_QKV:
            if end == ctx:
                # The newest token (position ctx - 1), which only this program reads: its key and value are
                # stored for later steps and taken from registers here, where they start the softmax (weight
                # exp(0) = 1), so that the tiles need not wait for the store to land.
                k = _norm_rope(k, k_p, wk, wk_p, cos, sin, eps, HEAD_DIM, HAS_NORM)
                dst = slot * stride_slot + kvh * stride_head + d[None, :]
                tl.store(k_ptr + dst, k.to(k_ptr.dtype.element_ty), mask=slot >= 0)  # -1: stored nowhere
                tl.store(v_ptr + dst, v.to(v_ptr.dtype.element_ty), mask=slot >= 0)
                m = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1) * scale
                l = tl.full([GROUP_PAD], 1.0, tl.float32)
                acc = acc + v.to(tl.float32)
                end = ctx - 1  # the tiles stop before it
        for n0 in range(start, end, BLOCK_N):
            m, l, acc = _attend_tile(q, k_ptr, v_ptr, table_ptr, b, kvh, n0, end, m, l, acc, scale, stride_tb,
                                     stride_slot, stride_head, page_size, HEAD_DIM, BLOCK_N, IEEE)
        # partials: acc [b, head, split, d] unnormalised; ml [b, head, split, 2] = (max, sum)
        base = (b * n_kv_heads * GROUP + heads) * splits + s
        tl.store(acc_ptr + base[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])
        tl.store(ml_ptr + base * 2, m, mask=gmask)
        tl.store(ml_ptr + base * 2 + 1, l, mask=gmask)


@triton.jit
def _splits_used(ctx, splits, BLOCK_N: tl.constexpr):
    """How many of a sequence's splits hold tokens: each takes a whole number of tiles, the last what is left."""
    return tl.cdiv(ctx, tl.maximum(_split_len(ctx, splits, BLOCK_N), 1))


@triton.jit(do_not_specialize=["splits"], do_not_specialize_on_alignment=["ctx_ptr"])
def _decode_attention_merge_kernel(acc_ptr, ml_ptr, ctx_ptr, out_ptr, stride_ob, stride_oh, n_heads, splits,
                  SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
                  LAUNCH_FIRST: tl.constexpr):
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
    d = tl.arange(0, HEAD_DIM)
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
                           num_stages: int = NUM_STAGES) -> torch.Tensor:
    """q [B, H, D]; k/v_cache one layer's [pages, page_size, KVH, D], in any strides that keep slots flat;
    block_tables [B, max_pages] int32; context_lens [B] int32 (0 for a padded row, which then gets zeros)
    -> [B, H, D]."""
    batch, n_heads, head_dim = q.shape
    return _launch(q, q.stride(0), q.stride(1), batch, n_heads, head_dim, k_cache, v_cache, block_tables,
                   context_lens, scale, splits, block_n, num_warps, num_stages, {})


def paged_decode_attention_qkv(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                               q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                               cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                               slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               splits: int | None = None, block_n: int | None = None, num_warps: int = NUM_WARPS,
                               num_stages: int = NUM_STAGES) -> torch.Tensor:
    """A decode step's attention straight from the qkv projection: rope.qk_norm_rope_store (which stores this
    step's K and V into the cache) then paged_decode_attention, in the latter's kernels. qkv [B, (H + 2 KVH) x D],
    one token per sequence at positions [B] (its context's last, context_lens - 1), stored at slot_mapping [B]
    (-1: nowhere, a padded row with context 0); cos/sin float32 [positions, D / 2]; q_norm/k_norm [D] or None.
    -> [B, H, D]."""
    batch = qkv.shape[0]
    assert qkv.shape[1] == (n_heads + 2 * n_kv_heads) * head_dim and qkv.stride(1) == 1
    assert k_cache.shape[2] == n_kv_heads and k_cache.shape[3] == head_dim and head_dim % 2 == 0
    has_norm = q_norm is not None  # without, the kernel reads (and ignores) weights from cos: any valid address
    fused = dict(pos_ptr=positions, slot_ptr=slot_mapping, cos_ptr=cos, sin_ptr=sin,
                 qn_ptr=q_norm if has_norm else cos, kn_ptr=k_norm if has_norm else cos, eps=eps, FUSED_QKV=True,
                 HAS_NORM=has_norm)
    return _launch(qkv, qkv.stride(0), head_dim, batch, n_heads, head_dim, k_cache, v_cache, block_tables,
                   context_lens, scale, splits, block_n, num_warps, num_stages, fused)


def _launch(q, stride_qb, stride_qh, batch, n_heads, head_dim, k_cache, v_cache, block_tables, context_lens, scale,
            splits, block_n, num_warps, num_stages, fused: dict) -> torch.Tensor:
    """The split and merge kernels; q (queries, or with `fused` the qkv rows) in the dtype of the output."""
    n_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    # slots are flat (page x page_size + position); any order of the head and slot dimensions is read
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "K and V caches laid out alike"
    assert k_cache.stride(0) == page_size * k_cache.stride(1), "a page's positions one slot stride apart"
    group = n_heads // n_kv_heads
    splits = splits or default_splits(batch, n_kv_heads, sm_count(q.device))
    block_n = block_n or BLOCK_N
    acc = torch.empty(batch, n_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(batch, n_heads, splits, 2, dtype=torch.float32, device=q.device)
    _decode_attention_split_kernel[(batch, n_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, acc, ml, scale, stride_qb, stride_qh,
        block_tables.stride(0), k_cache.stride(1), k_cache.stride(2), n_kv_heads, page_size, splits, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        USE_PDL=PDL.on, launch_pdl=PDL.on, num_warps=num_warps, num_stages=num_stages, **fused)
    out = torch.empty(batch, n_heads, head_dim, dtype=q.dtype, device=q.device)
    splits_pad = max(2, triton.next_power_of_2(splits))
    _decode_attention_merge_kernel[(batch, n_heads)](acc, ml, context_lens, out, out.stride(0), out.stride(1), n_heads,
                                    splits, SPLITS_PAD=splits_pad, HEAD_DIM=head_dim, BLOCK_N=block_n, USE_PDL=PDL.on,
                                    LAUNCH_FIRST=streams(batch, n_heads * head_dim, q.dtype), launch_pdl=PDL.on,
                                    num_warps=merge_warps(splits_pad, head_dim))
    return out
