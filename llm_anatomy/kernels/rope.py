"""QK-norm, RoPE and the KV-cache store in one kernel, straight from the fused qkv projection's output.

One program per (token, head): query heads are normalised over head_dim (Qwen3), rotated (rotate-half) and
written out; key heads likewise, then stored into their cache slot together with the matching value head.
A slot of -1 (a padded row of a CUDA-graph batch) stores nothing.
"""

import torch
import triton
import triton.language as tl

from .pdl import PDL, gdc_enter


@triton.jit
def _qk_norm_rope_store_kernel(qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr,
                               pos_ptr, slot_ptr, stride_qkv, stride_qo, n_heads, n_kv_heads, eps,
                               HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, half)
    is_q = h < n_heads
    kv_h = h - n_heads
    col = tl.where(is_q, h * HEAD_DIM, n_heads * HEAD_DIM + kv_h * HEAD_DIM)
    base = qkv_ptr + t * stride_qkv + col
    x1 = tl.load(base + d)
    x2 = tl.load(base + half + d)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / HEAD_DIM + eps)
        if is_q:
            w1 = tl.load(qn_ptr + d).to(tl.float32)
            w2 = tl.load(qn_ptr + half + d).to(tl.float32)
        else:
            w1 = tl.load(kn_ptr + d).to(tl.float32)
            w2 = tl.load(kn_ptr + half + d).to(tl.float32)
        a = ((a * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        b = ((b * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cos_ptr + pos * half + d)
    sin = tl.load(sin_ptr + pos * half + d)
    o1 = (a * cos - b * sin).to(dtype)
    o2 = (b * cos + a * sin).to(dtype)
    if is_q:
        out = q_out_ptr + t * stride_qo + h * HEAD_DIM
        tl.store(out + d, o1)
        tl.store(out + half + d, o2)
    else:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            dst = slot * n_kv_heads * HEAD_DIM + kv_h * HEAD_DIM
            tl.store(k_cache_ptr + dst + d, o1)
            tl.store(k_cache_ptr + dst + half + d, o2)
            v_src = qkv_ptr + t * stride_qkv + (n_heads + n_kv_heads) * HEAD_DIM + kv_h * HEAD_DIM
            full = tl.arange(0, HEAD_DIM)
            tl.store(v_cache_ptr + dst + full, tl.load(v_src + full))


def qk_norm_rope_store(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """qkv [tokens, (H + 2 KVH) x D] -> q [tokens, H, D]; K and V go into the layer's cache [slots..., KVH, D]."""
    tokens = qkv.shape[0]
    q = torch.empty(tokens, n_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    has_norm = q_norm is not None
    _qk_norm_rope_store_kernel[(tokens, n_heads + n_kv_heads)](
        qkv, q, k_cache, v_cache, q_norm if has_norm else qkv, k_norm if has_norm else qkv, cos, sin, positions,
        slot_mapping, qkv.stride(0), q.stride(0), n_heads, n_kv_heads, eps, HEAD_DIM=head_dim, HAS_NORM=has_norm,
        USE_PDL=PDL.on, launch_pdl=PDL.on, num_warps=1)
    return q
