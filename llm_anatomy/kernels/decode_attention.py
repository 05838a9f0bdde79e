"""Paged decode attention (one query token per sequence), split along the context (flash-decoding).

Batch-1 decode has only KV-heads programs' worth of work per layer, far too few to fill the GPU and read
the cache at full bandwidth; so each (sequence, KV head) is split into `splits` ranges of the context,
each program attends its range for all query heads of its GQA group (one tl.dot over the group), and the
last program of a group to finish merges the partial softmaxes (an atomic counter tells it it is last),
so a layer's attention is one launch. Tokens are gathered through the block table per token, so the tile
(BLOCK_N tokens) does not depend on the page size. Only each sequence's valid context is read.
"""

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Tile and pipelining for the H200 (benchmarks/bench_h200.py, section attn); any config is correct.
BLOCK_N, NUM_WARPS, NUM_STAGES = 64, 4, 3


@triton.jit
def _attend_tile(q, k_ptr, v_ptr, table_ptr, b, kvh, n0, end, m, l, acc, scale, stride_tb, row, page_size,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    d = tl.arange(0, HEAD_DIM)
    tok = n0 + tl.arange(0, BLOCK_N)
    valid = tok < end
    page = tl.load(table_ptr + b * stride_tb + tok // page_size, mask=valid, other=0)
    slot = page.to(tl.int64) * page_size + tok % page_size
    offs = slot[:, None] * row + kvh * HEAD_DIM + d[None, :]
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
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, out_ptr, acc_ptr, ml_ptr, lock_ptr, scale,
                             stride_qb, stride_qh, stride_ob, stride_oh, stride_tb, n_kv_heads, page_size,
                             splits: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_N: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    per_split = tl.cdiv(tl.cdiv(ctx, splits), BLOCK_N) * BLOCK_N
    start = s * per_split
    end = tl.minimum(start + per_split, ctx)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    row = n_kv_heads * HEAD_DIM
    if INTERPRET:  # the interpreter cannot take loaded values as range() bounds
        n0 = start
        while n0 < end:
            m, l, acc = _attend_tile(q, k_ptr, v_ptr, table_ptr, b, kvh, n0, end, m, l, acc, scale, stride_tb, row,
                                     page_size, HEAD_DIM, BLOCK_N, IEEE)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m, l, acc = _attend_tile(q, k_ptr, v_ptr, table_ptr, b, kvh, n0, end, m, l, acc, scale, stride_tb, row,
                                     page_size, HEAD_DIM, BLOCK_N, IEEE)

    # This split's partial: acc [b, kvh, split, group, d] unnormalised, (max, sum) beside it.
    group_base = (b * n_kv_heads + kvh) * splits
    part = (group_base + s) * GROUP_PAD + g
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc)
    tl.store(ml_ptr + part * 2, m)
    tl.store(ml_ptr + part * 2 + 1, l)
    # acq_rel: our partial is visible before the count moves; the last program sees everyone's.
    done = tl.atomic_add(lock_ptr + b * n_kv_heads + kvh, 1)
    if done == splits - 1:
        m_all = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_all = tl.zeros([GROUP_PAD], tl.float32)
        acc_all = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for i in range(0, splits):
            p_i = (group_base + i) * GROUP_PAD + g
            m_i = tl.load(ml_ptr + p_i * 2, cache_modifier=".cg")
            l_i = tl.load(ml_ptr + p_i * 2 + 1, cache_modifier=".cg")
            a_i = tl.load(acc_ptr + p_i[:, None] * HEAD_DIM + d[None, :], cache_modifier=".cg")
            m_new = tl.maximum(m_all, m_i)
            # an empty split has max -inf: it weighs nothing (and -inf - -inf must not make a NaN)
            w_old = tl.where(m_all > float("-inf"), tl.exp(m_all - m_new), 0.0)
            w_i = tl.where(m_i > float("-inf"), tl.exp(m_i - m_new), 0.0)
            l_all = l_all * w_old + l_i * w_i
            acc_all = acc_all * w_old[:, None] + a_i * w_i[:, None]
            m_all = m_new
        out = acc_all / tl.maximum(l_all, 1e-30)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
        tl.atomic_xchg(lock_ptr + b * n_kv_heads + kvh, 0)  # ready for the next launch (graph replay)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


@functools.cache
def _locks(device: torch.device) -> torch.Tensor:
    """Per (sequence, KV head) arrival counters; every launch leaves them at zero."""
    return torch.zeros(1 << 16, dtype=torch.int32, device=device)


def default_splits(batch: int, n_kv_heads: int, sm_count: int) -> int:
    """Enough (sequence, head, split) programs to give every multiprocessor about two."""
    return max(1, min(64, triton.cdiv(2 * sm_count, batch * n_kv_heads)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           splits: int | None = None, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                           num_stages: int = NUM_STAGES) -> torch.Tensor:
    """q [B, H, D]; k/v_cache one layer's [pages, page_size, KVH, D]; block_tables [B, max_pages] int32;
    context_lens [B] int32 (0 for a padded row, which then gets zeros) -> [B, H, D]."""
    batch, n_heads, head_dim = q.shape
    n_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = n_heads // n_kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    splits = splits or default_splits(batch, n_kv_heads, _sm_count(q.device))
    locks = _locks(q.device)
    assert batch * n_kv_heads <= locks.numel()
    acc = torch.empty(batch, n_kv_heads, splits, group_pad, head_dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(batch, n_kv_heads, splits, group_pad, 2, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    _decode_attention_kernel[(batch, n_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, acc, ml, locks, scale, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), n_kv_heads, page_size, splits, GROUP=group,
        GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        INTERPRET=INTERPRET, num_warps=num_warps, num_stages=num_stages)
    return out
