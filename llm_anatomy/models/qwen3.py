"""The Qwen3 (and Qwen2) network in plain PyTorch, over a flat batch of tokens and a paged KV cache.

Numerics follow HF transformers' modeling_qwen3.py: residual adds in the model dtype, RMSNorm in float32,
QK-norm over head_dim before RoPE, rotate-half RoPE. Module names follow HF's so the loader maps names one
to one, except the fused projections: qkv_proj = [q_proj; k_proj; v_proj], gate_up_proj = [gate_proj; up_proj].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionBatch, attend, prefill_step_attention
from .config import ModelConfig

try:  # the fast path's kernels; without Triton the model runs the PyTorch path only
    from ..kernels import gemv, matmul, norm, stream_gemv
    from ..kernels.activation import silu_mul
    from ..kernels.decode_attention import paged_decode_attention
    from ..kernels.rope import qk_norm_rope_store
except ImportError:
    pass

# HF name -> (our fused parameter, shard index). Shard sizes come from the config (see packed_shards).
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def packed_shards(config: ModelConfig) -> dict[str, list[int]]:
    """Row counts of each shard of a fused weight, in order."""
    return {
        "qkv_proj": [config.q_size, config.kv_size, config.kv_size],
        "gate_up_proj": [config.intermediate_size, config.intermediate_size],
    }


class FastPath:
    """Modules with a fused-kernel path (Triton, CUDA): `enable_fast_path` turns it on for a whole model."""

    fast = False


def enable_fast_path(model: nn.Module, on: bool = True) -> None:
    for m in model.modules():
        if isinstance(m, FastPath):
            m.fast = on


# Batch-1 decode: the streaming GEMV after a norm (qkv, gate_up) computes the residual add and the norm itself, from
# the product before and the residual stream (stream_gemv.py), which takes the norm's kernel and one wait out of
# the step's chain of dependent kernels. Qwen3-8B's step on the H200: 3.861 against 3.915 ms at 512 tokens, 4.984
# against 5.076 at 32k (benchmarks/probe_stream_gemv.py, variant norms_apart; RESULTS.md thirteenth session).
NORM_IN_GEMV = True


@dataclass
class PendingNorm:
    """RMSNorm(x + residual), left for the product after it to compute (NORM_IN_GEMV). `new_residual` receives the
    new residual stream either way: every block of that GEMV reads `residual`, so it cannot be updated in place."""
    x: torch.Tensor
    residual: torch.Tensor
    layernorm: RMSNorm
    new_residual: torch.Tensor

    def product(self, weight: torch.Tensor, gated: bool = False) -> torch.Tensor | None:
        """The norm and the product by one streaming GEMV, where it takes them; else None (see normed)."""
        if not (stream_gemv.supports(self.x, weight, gated)
                and stream_gemv.supports_norm(self.x, self.residual, self.layernorm.weight)):
            return None
        return stream_gemv.stream_gemv(self.x, weight, gated, norm=(self.residual, self.new_residual,
                                                                    self.layernorm.weight, self.layernorm.eps))

    def normed(self) -> torch.Tensor:
        """The norm by its own kernel, for a product that does not take it."""
        self.new_residual.copy_(self.residual)
        return norm.rmsnorm(self.x, self.layernorm.weight, self.layernorm.eps, residual=self.new_residual)


def linear(x: torch.Tensor | PendingNorm, layer: nn.Linear, fast: bool) -> torch.Tensor:
    """A linear layer; on the fast path a skinny product (decode) runs the bandwidth-tuned GEMV kernel, and the
    norm before it too where that was left pending."""
    if isinstance(x, PendingNorm):
        y = x.product(layer.weight)
        if y is None:
            return linear(x.normed(), layer, fast)
    elif fast and gemv.supports(x, layer.weight):
        y = gemv.gemv(x, layer.weight)
    else:
        return layer(x)
    return y if layer.bias is None else y + layer.bias


# Prefill's products that feed the residual stream (o_proj, down_proj) add into it in cuBLAS's epilogue (beta = 1),
# so that the norm after them reads one tensor and writes one instead of reading two and writing two. On the H200
# (Qwen3-8B, benchmarks/probe_prefill_fusions.py, 2026-11-30): o_proj and its norm 97.9 us against 102.5 at 2048
# tokens, down 302.9 against 307.5; the stream and a 2048-token prompt's logits came out equal bit for bit.
RESIDUAL_IN_GEMM = True


def residual_linear(x: torch.Tensor, layer: nn.Linear, fast: bool, residual: torch.Tensor | None):
    """A product that the residual stream takes next. On the fast path's GEMMs (prefill) it is added into
    `residual` in place and None is returned; otherwise the product, for the norm's fused add (decode: the GEMV
    has no epilogue)."""
    if (fast and RESIDUAL_IN_GEMM and residual is not None and layer.bias is None
            and not gemv.supports(x, layer.weight)):
        residual.addmm_(x, layer.weight.t())
        return None
    return linear(x, layer, fast)


class RMSNorm(nn.Module, FastPath):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast:
            return norm.rmsnorm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, x: torch.Tensor | None, residual: torch.Tensor,
                    defer: bool = False) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
        """Residual add (in the model dtype, as HF does) followed by the norm: returns (normed, new residual).
        x None: the product was already added into the residual (see residual_linear). With defer, a single bf16
        row that the streaming GEMV takes comes back as a PendingNorm, for the product after the norm."""
        if (defer and self.fast and NORM_IN_GEMV and x is not None
                and stream_gemv.streams(x.shape[0], x.shape[1], x.dtype)):
            pending = PendingNorm(x, residual, self, torch.empty_like(residual))
            return pending, pending.new_residual
        if x is None:
            return self.forward(residual), residual
        if self.fast:  # one kernel; the residual is updated in place
            return norm.rmsnorm(x, self.weight, self.eps, residual=residual), residual
        x = x + residual
        return self.forward(x), x


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, float32, scaled by YaRN's attention factor where it applies."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv_freq, attention_factor = config.rope_inv_freq()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim] -> same, rotated by each token's position (rotate-half convention)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module, FastPath):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.split_sizes = [config.q_size, config.kv_size, config.kv_size]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, batch: AttentionBatch,
                residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """The attention's output; None where it was added into `residual` (see residual_linear). x may be a
        PendingNorm (see linear)."""
        tokens = positions.shape[0]
        qkv = linear(x, self.qkv_proj, self.fast)
        if self.fast:
            out = self._fast_attention(qkv, positions, rotary, batch)
            return residual_linear(out.reshape(tokens, self.num_heads * self.head_dim), self.o_proj, True, residual)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, positions), rotary(k, positions)
        out = attend(q, k, v, self.layer_idx, batch)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

    def _fast_attention(self, qkv, positions, rotary, batch: AttentionBatch) -> torch.Tensor:
        """QK-norm + RoPE + cache store in one kernel, then cuDNN/flash prefill or the paged decode kernel. (In
        the epilogue of a Triton qkv GEMM, prefill's QK-norm + RoPE + store was slower: benchmarks/RESULTS.md.)"""
        k_cache, v_cache = batch.k_cache[self.layer_idx], batch.v_cache[self.layer_idx]
        out = qk_norm_rope_store(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                 self.q_norm.weight if self.qk_norm else None,
                                 self.k_norm.weight if self.qk_norm else None,
                                 self.q_norm.eps if self.qk_norm else 0.0, rotary.cos, rotary.sin, positions,
                                 batch.slot_mapping, k_cache, v_cache, kv_out=batch.is_prefill)
        scale = self.head_dim ** -0.5
        if not batch.is_prefill:
            return paged_decode_attention(out, k_cache, v_cache, batch.block_tables, batch.context_lens, scale,
                                          splits=batch.decode_splits, block_n=batch.decode_block_n)
        q, k, v = out  # k, v: this step's keys and values, as stored
        return prefill_step_attention(q, k, v, k_cache, v_cache, batch,
                                      lambda *args: paged_decode_attention(*args, scale))


class MLP(nn.Module, FastPath):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """The MLP's output; None where it was added into `residual` (see residual_linear). x may be a
        PendingNorm (see linear)."""
        if self.fast:
            return residual_linear(self._fast_activation(x), self.down_proj, True, residual)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def _fast_activation(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        """SiLU(gate) * up, in the gate_up product's kernel where it can be."""
        w = self.gate_up_proj.weight
        if isinstance(x, PendingNorm):  # decode, batch 1: the norm, the GEMV and SiLU*up in one kernel
            act = x.product(w, gated=True)
            if act is not None:
                return act
            x = x.normed()
        if gemv.supports(x, w):  # decode: SiLU*up fused into the gate_up GEMV
            return gemv.gemv(x, w, gated=True)
        if matmul.supports_gated(x, w):  # a long prefill: SiLU*up in the GEMM's epilogue
            return matmul.matmul(x, w, matmul.GATED_TILE, gated=True)
        return silu_mul(self.gate_up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, positions, rotary, batch):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_forward(x, residual, defer=True)
        x = self.self_attn(x, positions, rotary, batch, residual)
        x, residual = self.post_attention_layernorm.add_forward(x, residual, defer=True)
        return self.mlp(x, residual), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module, FastPath):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """input_ids, positions: [tokens] (all sequences of the batch, concatenated) -> final hidden states."""
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, self.rotary, batch)
        x, _ = self.model.norm.add_forward(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head, self.fast).float()
