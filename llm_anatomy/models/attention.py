"""Attention over the paged KV cache: store the new K/V in their slots, then attend.

The batch is a flat list of tokens; `AttentionBatch` says which sequence each belongs to and where its
context lives. Prefill uses SDPA per sequence, short fresh prompts of one bucket length together (GQA through
`enable_gqa`, no repeated KV); decode reads each sequence's blocks through its block table. A step that mixes
the two (chunked prefill) puts its decoding sequences first: their single tokens take the decode path together,
the rest the prefill path. A batch of fresh prompts replayed from a CUDA graph is attended packed, one
variable-length call a layer (varlen_attention).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right


@dataclass
class AttentionBatch:
    k_cache: torch.Tensor  # [layers, blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [tokens] int64: flat slot (block * block_size + offset) of each new token
    is_prefill: bool
    block_tables: torch.Tensor  # [seqs, max_blocks] int32, padded with 0 (masked out by context_lens)
    context_lens: torch.Tensor  # [seqs] int32: tokens of context after this step, new ones included
    query_lens: tuple[int, ...] = ()  # prefill only: new tokens per sequence, in order
    prefix_lens: tuple[int, ...] = ()  # prefill only: tokens already cached before this step
    num_decodes: int = 0  # prefill only: the first num_decodes sequences forward one token each (decodes)
    # The fast path's decode attention: context splits and tile, None for its defaults (see plan.DecodeAttentionPlan)
    decode_splits: int | None = None
    decode_block_n: int | None = None
    # an fp8 cache's decode attention in the CUDA kernel (DecodeAttentionPlan.uses_fp8_cuda)
    decode_fp8_cuda: bool = False
    # A decode step's QK-norm, RoPE, store, attention and merge in one kernel (rope_decode_attention), its
    # splits counting into these (int32, a sequence's KV heads each, zero between launches); None: three kernels
    decode_counts: torch.Tensor | None = None
    # Host-to-device copy of fresh_groups' indices (the runner's pinned upload: from pageable memory a copy waits
    # for the step in flight); None: a plain copy
    upload: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False, compare=False)
    # Fresh prompts one after the other, attended by one variable-length call a layer (varlen_attention): the
    # prompts' boundaries (int32 [segments + 1] on the device, empty segments allowed) and the longest segment.
    # Set by a CUDA graph of a batch of prompts (graphs.py), whose boundaries change from replay to replay.
    varlen: tuple[torch.Tensor, int] | None = None
    _groups: tuple | None = field(default=None, repr=False, compare=False)  # fresh_groups, once a step
    _prefill: "AttentionBatch | None" = field(default=None, repr=False, compare=False)  # prefill_part, once a step

    def fresh_groups(self, device: torch.device) -> tuple[list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]],
                                                          frozenset[int]]:
        """Fresh prompts (nothing cached) whose bucket lengths (prefill_bucket) are equal and at most
        GROUPED_PREFILL_MAX, two or more, as groups attended in one call each: per group (its bucket length R,
        the rows of q/k/v to gather into [G x R] (a prompt's padding repeats its last row: causality hides it),
        where the real rows sit in that, and their rows in the step), or (R, first row, G) for G prompts of
        exactly R tokens one after the other, already [G x R] in the step; and the sequences grouped. Computed once a
        step (the indices go up to the device once, not once a layer, all groups' in one copy through `upload`)."""
        if self._groups is None:
            by_bucket: dict[int, list[tuple[int, int, int]]] = {}
            start = 0
            for i, (n, prefix) in enumerate(zip(self.query_lens, self.prefix_lens)):
                rows = prefill_bucket(n)
                if prefix == 0 and rows <= GROUPED_PREFILL_MAX:
                    by_bucket.setdefault(rows, []).append((i, start, n))
                start += n
            groups, members, gathered = [], set(), []
            for rows, group in by_bucket.items():
                if len(group) < 2:
                    continue
                members.update(i for i, _, _ in group)
                first = group[0][1]
                if all(n == rows and s == first + j * rows for j, (_, s, n) in enumerate(group)):
                    groups.append((rows, first, len(group)))  # unpadded, one after the other: the rows as they are
                    continue
                gather = [s + min(t, n - 1) for _, s, n in group for t in range(rows)]
                real = [j * rows + t for j, (_, _, n) in enumerate(group) for t in range(n)]
                dest = [s + t for _, s, n in group for t in range(n)]
                gathered.append((rows, gather, real, dest))
            if gathered:
                host = torch.tensor([i for _, *lists in gathered for x in lists for i in x], dtype=torch.int64)
                flat = self.upload(host) if self.upload is not None else host.to(device, non_blocking=True)
                parts = iter(flat.split([len(x) for _, *lists in gathered for x in lists]))
                groups += [(rows, next(parts), next(parts), next(parts)) for rows, *_ in gathered]
            self._groups = (groups, frozenset(members))
        return self._groups

    @classmethod
    def fresh_prompt(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> "AttentionBatch":
        """One prompt with nothing cached yet, its tokens stored at slot_mapping (-1: stored nowhere)."""
        n, dev = len(slot_mapping), slot_mapping.device
        return cls(k_cache, v_cache, slot_mapping, True, torch.zeros(1, 1, dtype=torch.int32, device=dev),
                   torch.tensor([n], dtype=torch.int32, device=dev), (n,), (0,))

    def prefill_part(self) -> "AttentionBatch":
        """The sequences after the leading decodes, as a prefill batch of their own."""
        if self._prefill is None:
            d = self.num_decodes
            self._prefill = AttentionBatch(self.k_cache, self.v_cache, self.slot_mapping[d:], True,
                                           self.block_tables[d:], self.context_lens[d:], self.query_lens[d:],
                                           self.prefix_lens[d:])
        return self._prefill


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: AttentionBatch) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] -> [tokens, heads, head_dim]."""
    k_cache, v_cache = batch.k_cache[layer], batch.v_cache[layer]
    store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    if not batch.is_prefill:
        return decode_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens)
    return prefill_step_attention(q, k, v, k_cache, v_cache, batch, decode_attention)


def prefill_step_attention(q, k, v, k_cache, v_cache, batch: AttentionBatch, decode) -> torch.Tensor:
    """Attention of a step that prefills: its leading decodes (a mixed step) on `decode(q, k_cache, v_cache,
    block_tables, context_lens)`, the rest on prefill_attention. k, v: this step's keys and values."""
    if batch.varlen is not None:
        return varlen_attention(q, k, v, *batch.varlen)
    d = batch.num_decodes
    if not d:
        return prefill_attention(q, k, v, k_cache, v_cache, batch)
    decoded = decode(q[:d], k_cache, v_cache, batch.block_tables[:d], batch.context_lens[:d])
    return torch.cat([decoded, prefill_attention(q[d:], k[d:], v[d:], k_cache, v_cache, batch.prefill_part())])


FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def as_cached(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Values as a cache of `cache`'s dtype holds them: an fp8 cache (scale 1, vLLM's uncalibrated default)
    saturates at the format's largest finite value rather than overflowing to NaN."""
    if cache.dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)
    return x.to(cache.dtype)


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    kv_heads, head_dim = k_cache.shape[-2:]
    for values, cache in ((k, k_cache), (v, v_cache)):
        values, flat = as_cached(values, cache), cache.view(-1, kv_heads, head_dim)
        if cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernel on every device: copy the bytes
            values, flat = values.view(torch.uint8), flat.view(torch.uint8)
        flat.index_copy_(0, slot_mapping, values)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """One sequence's first `length` cached tokens: [length, kv_heads, head_dim], as `dtype`."""
    block_size = cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size]
    return cache[blocks].flatten(0, 1)[:length].to(dtype)


# On the GPU, cuDNN's fused attention runs causal prefill fastest (benchmarks/README.md); the others are
# fallbacks for shapes it refuses.
GPU_PREFILL_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH]
# Short fresh prompts of one step are attended together, one call per bucket length (fresh_groups): one at a time,
# the host's ~40 us a call outlasted the GPU's work and 64 prompts of 128 tokens took a prefill step from about
# 200 to 350 ms (benchmarks/README.md). FlashAttention first for those calls: cuDNN would build a plan for each new
# number of prompts, a large part of a second each.
GROUPED_PREFILL_MAX = 1024
GROUPED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH]


# A fresh prompt of this many tokens or more, alone in its step, is attended in fp8 where the plan says
# (ExecutionPlan.fp8_prefill_attention): those past the prefill graphs' longest (graphs.PREFILL_GRAPH_TOKENS), whose
# replays attend by FlashAttention's variable-length call, so that the same prompts take it with graphs or without.
FP8_PREFILL_MIN_TOKENS = 2049


def long_prompt_alone(batch: AttentionBatch) -> bool:
    """A step that is a fresh prompt of FP8_PREFILL_MIN_TOKENS or more alone: never in a CUDA graph (the graphs'
    prompts are shorter), so its rows are the prompt's, no padding."""
    return (batch.is_prefill and batch.varlen is None and not batch.num_decodes and len(batch.query_lens) == 1
            and not batch.prefix_lens[0] and batch.query_lens[0] >= FP8_PREFILL_MIN_TOKENS)


def fp8_prefill_rows(batch: AttentionBatch) -> int | None:
    """The length a step's fp8 prefill attention (kernels/fp8_prefill_attention.py) runs at, its prompt's bucket,
    where it takes the step (long_prompt_alone)."""
    return prefill_bucket(batch.query_lens[0]) if long_prompt_alone(batch) else None


def attends_last_row_alone(batch: AttentionBatch, keep: torch.Tensor | None) -> bool:
    """Whether a layer that keeps the rows `keep` (the last: models/qwen3.py) attends with the last row's query
    alone, over all of the step's keys: a long prompt alone keeping one row, its last (the only row such a step
    samples). Its causal attention would cost the layer what a whole prompt's does, quadratic in its length, for
    rows nothing reads."""
    return keep is not None and len(keep) == 1 and long_prompt_alone(batch)


def last_row_attention(q, k, v) -> torch.Tensor:
    """The last row of q's attention over all rows of k and v (its causal row): [1, heads, head_dim]."""
    qi, ki, vi = (x.transpose(0, 1).unsqueeze(0) for x in (q[-1:], k, v))
    if q.is_cuda:
        with sdpa_kernel(GPU_PREFILL_BACKENDS, set_priority=True):
            return F.scaled_dot_product_attention(qi, ki, vi, enable_gqa=True)[0].transpose(0, 1)
    return F.scaled_dot_product_attention(qi, ki, vi, enable_gqa=True)[0].transpose(0, 1)


def prefill_attention(q, k, v, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
    if q.is_cuda:
        with sdpa_kernel(GPU_PREFILL_BACKENDS, set_priority=True):
            return _prefill_attention(q, k, v, k_cache, v_cache, batch, pad=True)
    return _prefill_attention(q, k, v, k_cache, v_cache, batch, pad=False)


def prefill_bucket(n: int) -> int:
    """The length a fresh prompt's attention runs at on the GPU. cuDNN builds a plan for each new length
    (a large part of a second), so lengths are bucketed and the plans built at start-up (benchmarks/README.md):
    powers of two up to 512 (there the step reads weights more than it computes), multiples of 128 up to 2048,
    then four buckets per doubling. Padded tokens sit after the real ones, so causality hides them."""
    if n <= 512:
        return max(16, 1 << (n - 1).bit_length())
    step = 128 if n <= 2048 else 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


def varlen_supported(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether varlen_attention runs on the GPU for this model: FlashAttention's fp16/bf16, head_dim <= 256,
    Ampere or later (the CPU always has its reference path)."""
    if device.type != "cuda":
        return True
    return (dtype in (torch.float16, torch.bfloat16) and head_dim <= 256 and head_dim % 8 == 0
            and torch.cuda.get_device_capability(device) >= (8, 0))


def varlen_attention(q, k, v, cu_seqlens: torch.Tensor, longest: int) -> torch.Tensor:
    """Causal attention of packed sequences, q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim]
    (GQA by the kernel, no repeated KV), sequence i's rows cu_seqlens[i]:cu_seqlens[i + 1] -> like q. On the GPU
    one FlashAttention call whatever the sequences (its variable-length form reads the boundaries on the device:
    a CUDA graph can replay it over other prompts); rows past the last boundary are left unwritten. The CPU's
    reference attends each sequence by itself."""
    if q.is_cuda:
        return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, longest, longest, 0.0, True,
                                                       False)[0]
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            qi, ki, vi = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            alone = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            out[start:end] = alone[0].transpose(0, 1)
    return out


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    if len(x) == rows:
        return x
    out = x.new_empty(rows, *x.shape[1:])
    out[:len(x)] = x
    out[len(x):] = 0
    return out


def _dense_group(q, k, v, rows: int, first: int, g: int) -> torch.Tensor:
    """The attention of g prompts of exactly `rows` tokens one after the other from row `first`: [g x rows, heads,
    head_dim], laid out like q (views in, no gathers)."""
    span = slice(first, first + g * rows)
    qi, ki, vi = (x[span].view(g, rows, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
    return _causal(qi, ki, vi).transpose(1, 2).reshape(g * rows, *q.shape[1:])


def _grouped_attention(q, k, v, out, groups) -> None:
    """Each group of fresh prompts (AttentionBatch.fresh_groups) in one causal call over [G, heads, R, head_dim]."""
    for rows, *where in groups:
        if isinstance(where[0], int):  # prompts of R tokens one after the other: views of the step's rows
            first, g = where
            out[first:first + g * rows] = _dense_group(q, k, v, rows, first, g)
            continue
        gather, real, dest = where
        g = len(gather) // rows
        qi, ki, vi = (x.index_select(0, gather).view(g, rows, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        oi = _causal(qi, ki, vi)
        out.index_copy_(0, dest, oi.transpose(1, 2).reshape(g * rows, *q.shape[1:]).index_select(0, real))


def _causal(q, k, v) -> torch.Tensor:
    if q.is_cuda:
        with sdpa_kernel(GROUPED_BACKENDS, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _prefill_attention(q, k, v, k_cache, v_cache, batch: AttentionBatch, pad: bool) -> torch.Tensor:
    """pad: run each fresh prompt's attention at its bucket's length (see prefill_bucket), short ones of equal
    buckets together."""
    groups, grouped = [], frozenset()
    if pad and len(batch.query_lens) > 1:
        groups, grouped = batch.fresh_groups(q.device)
        if len(groups) == 1 and isinstance(groups[0][1], int) and groups[0][0] * groups[0][2] == len(q):
            # the whole step is one group of equal prompts one after the other (an offline batch): the group's
            # output, laid out like q, is the step's, not copied into another buffer
            rows, _, g = groups[0]
            return _dense_group(q, k, v, rows, 0, g)
    out = torch.empty_like(q) if len(batch.query_lens) > 1 else None
    if groups:
        _grouped_attention(q, k, v, out, groups)
    start = 0
    for i, (n, prefix) in enumerate(zip(batch.query_lens, batch.prefix_lens)):
        if i not in grouped:
            oi = _sequence_attention(q[start:start + n], k[start:start + n], v[start:start + n], k_cache, v_cache,
                                     batch.block_tables[i], prefix, pad)
            if out is None:  # cuDNN lays its output out like q, so this is a view, not a copy
                return oi
            out[start:start + n] = oi
        start += n
    return out


def _sequence_attention(q, k, v, k_cache, v_cache, block_table, prefix: int, pad: bool) -> torch.Tensor:
    """One sequence's new tokens [n, heads, head_dim] after `prefix` cached ones."""
    n = len(q)
    if prefix == 0:  # the whole context is new: plain causal attention over the fresh k, v
        rows = prefill_bucket(n) if pad else n
        qi, ki, vi = (_padded(x, rows).transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)[:, :, :n]
    else:  # new tokens after a cached prefix: attend to all of it, causal from the prefix's end
        total = prefix + n
        qi = q.transpose(0, 1).unsqueeze(0)
        ki = gather_context(k_cache, block_table, total, q.dtype).transpose(0, 1).unsqueeze(0)
        vi = gather_context(v_cache, block_table, total, q.dtype).transpose(0, 1).unsqueeze(0)
        oi = _attend_after_prefix(qi, ki, vi, prefix)
    return oi.squeeze(0).transpose(0, 1)


def _attend_after_prefix(q, k, v, prefix: int) -> torch.Tensor:
    """Queries at positions prefix.. over keys 0..: causal aligned to the bottom right. As a CausalBias the
    fused kernels take it without a mask tensor; an explicit mask where a backend refuses that."""
    n, total = q.shape[2], k.shape[2]
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, total), enable_gqa=True)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        mask = torch.arange(total, device=q.device)[None, :] <= torch.arange(prefix, total, device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def decode_attention(q, k_cache, v_cache, block_tables, context_lens) -> torch.Tensor:
    """One new token per sequence. Reference path: gather the blocks, mask past each context length.

    The pool is zero-initialised, so padded and stale slots hold finite values that the mask removes.
    """
    # [seqs, kv_heads, blocks*block_size, head_dim], in q's dtype (an fp8 cache: scale 1)
    k = k_cache[block_tables].flatten(1, 2).transpose(1, 2).to(q.dtype)
    v = v_cache[block_tables].flatten(1, 2).transpose(1, 2).to(q.dtype)
    positions = torch.arange(k.shape[2], device=q.device)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, enable_gqa=True)
    return out.squeeze(2)
