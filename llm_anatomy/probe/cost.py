"""The cost model: FLOPs and bytes of a prefill or a decode step, from the config and the dtype alone.

One place, used by every command. Conventions:
- FLOPs: 2 per multiply-add of the matrix products (linear layers, lm_head, attention's QK^T and PV); the
  elementwise work (norms, RoPE, SiLU, softmax) is left out, as FLOP counters and MFU figures do.
- Causal attention counts only the unmasked half: query i of a prefill attends to prefix + i keys.
- Bytes: the least traffic to device memory a step needs: every weight read once per step (the embedding
  only for the rows it gathers), K/V read once per attending sequence and written once per new token,
  each intermediate activation written once and read once, and the float32 logits written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.config import ModelConfig


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float
    parts: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> {"flops", "bytes"}

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")

    def part(self, name: str, key: str) -> float:
        return self.parts.get(name, {}).get(key, 0.0)


def _make(parts: dict[str, dict[str, float]]) -> Cost:
    parts = {k: {"flops": float(v.get("flops", 0.0)), "bytes": float(v.get("bytes", 0.0))} for k, v in parts.items()}
    return Cost(sum(p["flops"] for p in parts.values()), sum(p["bytes"] for p in parts.values()), parts)


def layer_linear_params(c: ModelConfig) -> int:
    """Weights of one decoder layer's matrices (q, k, v, o, gate, up, down), biases included."""
    qkv = c.hidden_size * (c.q_size + 2 * c.kv_size) + (c.q_size + 2 * c.kv_size if c.attention_bias else 0)
    return qkv + c.q_size * c.hidden_size + 3 * c.hidden_size * c.intermediate_size


def layer_norm_params(c: ModelConfig) -> int:
    return 2 * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0)


def weight_bytes_per_step(c: ModelConfig, dtype: torch.dtype) -> dict[str, float]:
    """Weights every step must read: the layers, the final norm and the lm_head (a tied head too)."""
    size = dtype.itemsize
    return {
        "layers": c.num_hidden_layers * (layer_linear_params(c) + layer_norm_params(c)) * size,
        "lm_head": (c.vocab_size * c.hidden_size + c.hidden_size) * size,
    }


def activation_bytes_per_token(c: ModelConfig, dtype: torch.dtype) -> float:
    """Each intermediate of one token through all layers, written once and read once."""
    per_layer = (c.hidden_size * 2  # norm in and out
                 + c.q_size + 2 * c.kv_size  # qkv
                 + c.q_size  # attention output
                 + c.hidden_size * 2  # o_proj output, residual add + second norm
                 + 2 * c.intermediate_size + c.intermediate_size  # gate_up and SiLU*up
                 + c.hidden_size)  # down_proj output
    return 2 * per_layer * c.num_hidden_layers * dtype.itemsize


def attention_flops(c: ModelConfig, query_tokens: int, prefix: int, causal: bool = True) -> float:
    """QK^T and PV over all layers for `query_tokens` new tokens after `prefix` cached ones."""
    if causal:
        keys = query_tokens * prefix + query_tokens * (query_tokens + 1) / 2
    else:
        keys = query_tokens * (prefix + query_tokens)
    return 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * keys


def prefill_cost(c: ModelConfig, dtype: torch.dtype, seqs: list[tuple[int, int]], logits_tokens: int | None = None,
                 causal: bool = True) -> Cost:
    """A prefill step over sequences given as (new tokens, cached prefix); logits for one token per sequence."""
    tokens = sum(n for n, _ in seqs)
    logits_tokens = len(seqs) if logits_tokens is None else logits_tokens
    kv = c.kv_bytes_per_token(dtype)
    weights = weight_bytes_per_step(c, dtype)
    return _make({
        "linear": {"flops": 2 * tokens * c.num_hidden_layers * layer_linear_params(c), "bytes": weights["layers"]},
        "attention": {"flops": sum(attention_flops(c, n, p, causal) for n, p in seqs)},
        "lm_head": {"flops": 2 * logits_tokens * c.hidden_size * c.vocab_size,
                    "bytes": weights["lm_head"] + logits_tokens * c.vocab_size * 4},
        "embedding": {"bytes": tokens * c.hidden_size * dtype.itemsize},
        "kv_write": {"bytes": tokens * kv},
        "kv_read": {"bytes": sum(p + n for n, p in seqs) * kv},
        "activations": {"bytes": tokens * activation_bytes_per_token(c, dtype)},
    })


def decode_cost(c: ModelConfig, dtype: torch.dtype, context_lens: list[int]) -> Cost:
    """A decode step: one new token for each sequence, attending to its context (the new token included)."""
    batch = len(context_lens)
    kv = c.kv_bytes_per_token(dtype)
    weights = weight_bytes_per_step(c, dtype)
    return _make({
        "linear": {"flops": 2 * batch * c.num_hidden_layers * layer_linear_params(c), "bytes": weights["layers"]},
        "attention": {"flops": sum(4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * n
                                   for n in context_lens)},
        "lm_head": {"flops": 2 * batch * c.hidden_size * c.vocab_size,
                    "bytes": weights["lm_head"] + batch * c.vocab_size * 4},
        "embedding": {"bytes": batch * c.hidden_size * dtype.itemsize},
        "kv_write": {"bytes": batch * kv},
        "kv_read": {"bytes": sum(context_lens) * kv},
        "activations": {"bytes": batch * activation_bytes_per_token(c, dtype)},
    })


def kv_formula(c: ModelConfig, dtype: torch.dtype) -> str:
    return (f"{c.num_hidden_layers} layers x 2 (K, V) x {c.num_key_value_heads} KV heads x {c.head_dim} head_dim "
            f"x {dtype.itemsize} B = {c.kv_bytes_per_token(dtype):,} B per token")
