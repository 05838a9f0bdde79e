"""QK-norm, RoPE and the KV-cache store in one kernel, straight from the fused qkv projection's output.

Each program takes one head of a block of tokens: query heads are normalised over head_dim (Qwen3), rotated
(rotate-half) and written out; key heads likewise, then stored into their cache slots together with the
matching value heads. A decode step has a few tokens (one per sequence) and gets blocks of one; a prefill
of thousands gets blocks of 32, so that a program moves 16 KB rather than 512 bytes (a program per token
and head took several times as long; benchmarks/README.md). A slot of -1 (a padded row of a
CUDA-graph batch) stores nothing. A prefill also gets this step's K and V as contiguous tensors (kv_out), which
its attention reads instead of gathering them back out of the cache; for cuDNN's fp8 attention
(kernels/fp8_prefill_attention.py) Q, K and V come in fp8 as an fp8 cache stores them (scale 1), zero rows padding
them to the attention's length, with the largest |V| stored (the output's scale).
"""

import torch
import triton
import triton.language as tl

from .pdl import gdc_enter

MAX_BLOCK_T = 32


@triton.jit
def _cache_value(x, cache_ptr):
    """A value as the cache stores it: an fp8 cache (scale 1, as vLLM's uncalibrated default) saturates at the
    format's largest finite value rather than overflowing to NaN."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        return tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0).to(tl.float8e4nv)  # 448: e4m3's largest
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def norm_rotate(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads given as their halves (x1, x2: [rows, HEAD_DIM // 2], the model dtype) RMS-normalised over the head,
    times the norm's weight halves (w1, w2: float32 [1, HEAD_DIM // 2]; Qwen3's QK-norm), each step rounded to the
    dtype as HF rounds it, then rotated (rotate-half) by cos and sin: the result's two halves, in the dtype. This
    kernel and the decode attention that does this work itself (decode_attention.rope_decode_attention) share it."""
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HEAD_DIM + eps)[:, None]
        a = ((a * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        b = ((b * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return (a * cos - b * sin).to(dtype), (b * cos + a * sin).to(dtype)


# The token count and the index vectors' addresses change with every prompt (an odd-length prompt's positions
# sit 8 bytes off 16); specialising on them compiled a new kernel, 0.3-0.5 s, at new prompt lengths.
@triton.jit(do_not_specialize=["tokens", "rows"], do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _qk_norm_rope_store_kernel(qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, k_out_ptr, v_out_ptr, qn_ptr, kn_ptr,
                               cos_ptr, sin_ptr, pos_ptr, slot_ptr, v_amax_ptr, tokens, rows, stride_qkv, stride_qo,
                               n_heads, n_kv_heads, eps, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
                               HAS_NORM: tl.constexpr, KV_OUT: tl.constexpr, V_AMAX: tl.constexpr,
                               USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)
    h = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < tokens
    omask = t < rows  # q, k and v out: `rows` >= tokens, the rows past the tokens zeros (a = b = v = 0 there)
    d = tl.arange(0, half)
    is_q = h < n_heads
    kv_h = h - n_heads
    col = tl.where(is_q, h * HEAD_DIM, n_heads * HEAD_DIM + kv_h * HEAD_DIM)
    base = qkv_ptr + t.to(tl.int64)[:, None] * stride_qkv + col + d[None, :]
    x1 = tl.load(base, mask=tmask[:, None], other=0.0)
    x2 = tl.load(base + half, mask=tmask[:, None], other=0.0)
    w1 = None
    w2 = None
    if HAS_NORM:
        if is_q:
            w1 = tl.load(qn_ptr + d).to(tl.float32)[None, :]
            w2 = tl.load(qn_ptr + half + d).to(tl.float32)[None, :]
        else:
            w1 = tl.load(kn_ptr + d).to(tl.float32)[None, :]
            w2 = tl.load(kn_ptr + half + d).to(tl.float32)[None, :]
    pos = tl.load(pos_ptr + t, mask=tmask, other=0)
    table = pos.to(tl.int64)[:, None] * half + d[None, :]
    o1, o2 = norm_rotate(x1, x2, w1, w2, tl.load(cos_ptr + table), tl.load(sin_ptr + table), eps, HEAD_DIM, HAS_NORM)
    if is_q:
        out = q_out_ptr + t.to(tl.int64)[:, None] * stride_qo + h * HEAD_DIM + d[None, :]
        tl.store(out, _cache_value(o1, q_out_ptr), mask=omask[:, None])
        tl.store(out + half, _cache_value(o2, q_out_ptr), mask=omask[:, None])
    else:
        slot = tl.load(slot_ptr + t, mask=tmask, other=-1)
        smask = (slot >= 0)[:, None]
        dst = slot.to(tl.int64)[:, None] * (n_kv_heads * HEAD_DIM) + kv_h * HEAD_DIM
        tl.store(k_cache_ptr + dst + d[None, :], _cache_value(o1, k_cache_ptr), mask=smask)
        tl.store(k_cache_ptr + dst + half + d[None, :], _cache_value(o2, k_cache_ptr), mask=smask)
        full = tl.arange(0, HEAD_DIM)[None, :]
        v_src = qkv_ptr + t.to(tl.int64)[:, None] * stride_qkv + (n_heads + n_kv_heads) * HEAD_DIM + kv_h * HEAD_DIM
        v = tl.load(v_src + full, mask=tmask[:, None], other=0.0)
        tl.store(v_cache_ptr + dst + full, _cache_value(v, v_cache_ptr), mask=smask)
        if KV_OUT:  # every row, padded ones too: [rows, KVH, D]
            row = t.to(tl.int64)[:, None] * (n_kv_heads * HEAD_DIM) + kv_h * HEAD_DIM
            tl.store(k_out_ptr + row + d[None, :], _cache_value(o1, k_out_ptr), mask=omask[:, None])
            tl.store(k_out_ptr + row + half + d[None, :], _cache_value(o2, k_out_ptr), mask=omask[:, None])
            v_out = _cache_value(v, v_out_ptr)
            tl.store(v_out_ptr + row + full, v_out, mask=omask[:, None])
            if V_AMAX:
                tl.atomic_max(v_amax_ptr, tl.max(tl.max(tl.abs(v_out.to(tl.float32)), axis=1), axis=0))


def qk_norm_rope_store(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, kv_out: bool = False, pdl: bool = False,
                       fp8_rows: int | None = None):
    """qkv [tokens, (H + 2 KVH) x D] -> q [tokens, H, D]; K and V go into the layer's cache [slots..., KVH, D].
    With kv_out, returns (q, k, v), k and v [tokens, KVH, D] as stored. With fp8_rows (>= tokens), returns (q, k, v,
    v_amax): q [fp8_rows, H, D], k and v [fp8_rows, KVH, D] in float8 e4m3 as an fp8 cache stores them (scale 1,
    saturating), zeros past the tokens, and v_amax (float32 [1]) the largest |v| of those."""
    tokens = qkv.shape[0]
    rows = tokens if fp8_rows is None else fp8_rows
    if rows < tokens:
        raise ValueError(f"fp8_rows ({fp8_rows}) must be at least the tokens ({tokens})")
    out_dtype = qkv.dtype if fp8_rows is None else torch.float8_e4m3fn
    kv_out = kv_out or fp8_rows is not None
    q = torch.empty(rows, n_heads, head_dim, dtype=out_dtype, device=qkv.device)
    # kv_out: this step's K and V in the model's dtype (an fp8 cache stores them rounded; the prefill reads these)
    k = torch.empty(rows, n_kv_heads, head_dim, dtype=out_dtype, device=qkv.device) if kv_out else q
    v = torch.empty_like(k) if kv_out else q
    # max|V|, taken by atomic max from zero (without fp8_rows the kernel never touches it: any tensor will do)
    v_amax = torch.zeros(1, dtype=torch.float32, device=qkv.device) if fp8_rows is not None else cos
    has_norm = q_norm is not None
    block_t = min(MAX_BLOCK_T, triton.next_power_of_2(max(1, tokens // 64)))  # decode batches: blocks of 1
    _qk_norm_rope_store_kernel[(triton.cdiv(rows, block_t), n_heads + n_kv_heads)](
        qkv, q, k_cache, v_cache, k, v, q_norm if has_norm else qkv, k_norm if has_norm else qkv, cos, sin,
        positions, slot_mapping, v_amax, tokens, rows, qkv.stride(0), q.stride(0), n_heads, n_kv_heads, eps,
        HEAD_DIM=head_dim, BLOCK_T=block_t, HAS_NORM=has_norm, KV_OUT=kv_out, V_AMAX=fp8_rows is not None,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=1 if block_t == 1 else 4)
    if fp8_rows is not None:
        return q, k, v, v_amax
    return (q, k, v) if kv_out else q
