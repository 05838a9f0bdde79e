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

from ..engine.plan import REFERENCE_PLAN, ExecutionPlan
from .attention import (AttentionBatch, attend, attends_last_row_alone, fp8_prefill_rows, last_row_attention,
                        prefill_step_attention, store_kv)
from .config import ModelConfig

try:  # the fast path's kernels; without Triton the model runs the PyTorch path only
    from ..kernels import fp8_decode_attention as fp8_attention
    from ..kernels import gemv, matmul, norm, stream_gemv
    from ..kernels.activation import silu_mul
    from ..kernels.decode_attention import paged_decode_attention, rope_decode_attention
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


@dataclass
class PendingNorm:
    """RMSNorm(x + residual), left for the product after it to compute (ExecutionPlan.norm_in_gemv).
    `new_residual` receives the new residual stream either way: every block of that GEMV reads `residual`, so it
    cannot be updated in place. Before the first layer (`row`, see Qwen3ForCausalLM.embedded) x is the embedding
    table, the input its row `row` (the gather left to the product too) and residual None."""
    x: torch.Tensor
    residual: torch.Tensor | None
    layernorm: RMSNorm
    new_residual: torch.Tensor
    row: torch.Tensor | None = None

    def product(self, layer: nn.Module, plan: ExecutionPlan, gated: bool = False, before_attention: bool = False
                ) -> torch.Tensor | None:
        """The norm and the product by one streaming GEMV, where it takes them; else None (see normed).
        `before_attention`: stream_gemv's."""
        x = self.x if self.row is None else self.x[:1]  # (the table's first row stands for the row it gathers)
        if not (streamable(x, layer, gated) and stream_gemv.supports_norm(x, self.residual, self.layernorm.weight)):
            return None
        return stream_gemv.stream_gemv(self.x, layer.weight, gated, norm=(self.residual, self.new_residual,
                                                                          self.layernorm.weight, self.layernorm.eps),
                                       pdl=plan.pdl, scale=row_scales(layer), before_attention=before_attention,
                                       x_row=self.row)

    def normed(self, plan: ExecutionPlan) -> torch.Tensor:
        """The norm by its own kernel (and the gather by its own), for a product that does not take it."""
        if self.row is not None:
            torch.index_select(self.x, 0, self.row, out=self.new_residual)
            return norm.rmsnorm(self.new_residual, self.layernorm.weight, self.layernorm.eps, pdl=plan.pdl,
                                launch_first=True)
        self.new_residual.copy_(self.residual)
        return norm.rmsnorm(self.x, self.layernorm.weight, self.layernorm.eps, residual=self.new_residual,
                            pdl=plan.pdl, launch_first=True)


def kept_rows(x, keep: torch.Tensor | None):
    """The rows `keep` of x (a tensor, or quant.Fp8Rows with their scales); x itself for None."""
    if keep is None:
        return x
    if isinstance(x, torch.Tensor):
        return x.index_select(0, keep)
    return type(x)(x.values.index_select(0, keep), x.scale.index_select(0, keep), x.dtype)


def is_fp8(layer: nn.Module) -> bool:
    """An fp8 linear layer (models/quant.py: Fp8Linear, its weight float8 e4m3 with float32 scales)."""
    return layer.weight.dtype == torch.float8_e4m3fn


def row_scales(layer: nn.Module) -> torch.Tensor | None:
    """An fp8 layer's per-row scales (None for a bf16 layer)."""
    return layer.weight_scale if is_fp8(layer) else None


def streamable(x: torch.Tensor, layer: nn.Module, gated: bool) -> bool:
    """Whether the streaming GEMV takes this product: a bf16 weight, or an fp8 one with a scale per row."""
    return stream_gemv.supports(x, layer.weight, gated) and (not is_fp8(layer) or layer.block is None)


def takes_fp8_rows(x: torch.Tensor, layer: nn.Module, plan: ExecutionPlan, gated: bool = False) -> bool:
    """Whether the fast path multiplies rows like x (the norm's input: its shape and dtype) by `layer` in W8A8,
    quantizing them per token first (quant.Fp8Linear.takes_fp8_rows): the norm before the product then writes them
    quantized itself (RMSNorm.quantized), the same arithmetic. Never where the plan streams rows this size (batch 1: the
    streaming GEMV reads bf16 rows)."""
    return (plan.kernels and is_fp8(layer) and not plan.streams(x.shape[0], x.shape[1], x.dtype)
            and layer.takes_fp8_rows(x, gated))


def skinny_product(x: torch.Tensor, layer: nn.Module, plan: ExecutionPlan, gated: bool = False,
                   before_attention: bool = False) -> torch.Tensor | None:
    """A decode step's product on the fast path: the streaming GEMV for a single row where the plan streams, the
    Triton GEMV with the plan's tile for a few rows; None for a product these do not take (a prefill, an fp8
    layer's few rows: Fp8Linear.fast_product)."""
    if plan.streams(x.shape[0], x.shape[1], x.dtype) and streamable(x, layer, gated):
        return stream_gemv.stream_gemv(x, layer.weight, gated, pdl=plan.pdl, scale=row_scales(layer),
                                       before_attention=before_attention)
    weight = layer.weight
    if is_fp8(layer) or not gemv.supports(x, weight):
        return None
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    tile = plan.gemv_tile(gemv.tile_key(n, x.shape[1], gated, weight.dtype))
    return gemv.gemv(x, weight, gated, tile=tile, pdl=plan.pdl)


def linear(x: torch.Tensor | PendingNorm, layer: nn.Linear, plan: ExecutionPlan, before_attention: bool = False
           ) -> torch.Tensor:
    """A linear layer; on the fast path a skinny product (decode) runs a bandwidth-tuned GEMV kernel, and the
    norm before it too where that was left pending. `before_attention`: the product is qkv_proj's, the one-kernel
    decode attention next (stream_gemv's)."""
    if isinstance(x, PendingNorm):
        y = x.product(layer, plan, before_attention=before_attention)
        if y is None:
            return linear(x.normed(plan), layer, plan, before_attention)
    elif not isinstance(x, torch.Tensor):  # quantized by the norm for this W8A8 product (takes_fp8_rows)
        return layer.fast_product(x, pdl=plan.pdl, fast_accum=plan.fp8_fast_accum)
    elif not plan.kernels:
        return layer(x)
    elif (y := skinny_product(x, layer, plan, before_attention=before_attention)) is None:
        return layer.fast_product(x, pdl=plan.pdl, fast_accum=plan.fp8_fast_accum) if is_fp8(layer) else layer(x)
    return y if layer.bias is None else y + layer.bias


def residual_linear(x: torch.Tensor, layer: nn.Linear, plan: ExecutionPlan, residual: torch.Tensor | None):
    """A product that the residual stream takes next. With the plan's residual_in_gemm, a GEMM (prefill) adds it
    into `residual` in place and None is returned; otherwise the product, for the norm's fused add (decode: the
    GEMV has no epilogue)."""
    if (plan.residual_in_gemm and residual is not None and layer.bias is None and not is_fp8(layer)
            and not gemv.supports(x, layer.weight)):
        residual.addmm_(x, layer.weight.t())
        return None
    return linear(x, layer, plan)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, plan: ExecutionPlan = REFERENCE_PLAN, fp8: bool = False):
        """The norm of x; with fp8, quantized per token for the W8A8 product after it (see takes_fp8_rows)."""
        if fp8:
            return self.quantized(x, None, plan)
        if plan.kernels:
            return norm.rmsnorm(x, self.weight, self.eps, pdl=plan.pdl,
                                launch_first=plan.streams(x.shape[0], x.shape[1], x.dtype))
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, x: torch.Tensor | None, residual: torch.Tensor, plan: ExecutionPlan,
                    defer: bool = False, fp8: bool = False):
        """Residual add (in the model dtype, as HF does) followed by the norm: returns (normed, new residual).
        x None: the product was already added into the residual (see residual_linear). With defer, a single bf16
        row that the streaming GEMV takes comes back as a PendingNorm, for the product after the norm. With fp8,
        the normed rows come quantized per token for the W8A8 product after the norm (see takes_fp8_rows)."""
        if (defer and plan.norm_in_gemv and x is not None
                and plan.streams(x.shape[0], x.shape[1], x.dtype)):
            pending = PendingNorm(x, residual, self, torch.empty_like(residual))
            return pending, pending.new_residual
        if x is None:
            return self.forward(residual, plan, fp8), residual
        if fp8:
            return self.quantized(x, residual, plan), residual
        if plan.kernels:  # one kernel; the residual is updated in place
            return norm.rmsnorm(x, self.weight, self.eps, residual=residual, pdl=plan.pdl,
                                launch_first=plan.streams(x.shape[0], x.shape[1], x.dtype)), residual
        x = x + residual
        return self.forward(x, plan), x

    def quantized(self, x: torch.Tensor, residual: torch.Tensor | None, plan: ExecutionPlan):
        """The norm (after the residual add, in place, where given) by one kernel that writes it quantized per
        token (quant.Fp8Rows): the bits Fp8Linear's W8A8 product would quantize the bf16 result to."""
        from .quant import Fp8Rows  # quant imports this module

        return Fp8Rows(*norm.rmsnorm_fp8(x, self.weight, self.eps, residual=residual, pdl=plan.pdl), x.dtype)


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


class Attention(nn.Module):
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
                plan: ExecutionPlan, residual: torch.Tensor | None = None, keep: torch.Tensor | None = None
                ) -> torch.Tensor | None:
        """The attention's output; None where it was added into `residual` (see residual_linear). x may be a
        PendingNorm or, for a W8A8 product, quant.Fp8Rows (see linear). With `keep`, the output of those rows
        alone (`residual` holds them alone too): every row's K and V are stored, o_proj runs on these rows; an
        empty keep stores K and V and attends nothing (returns None); a long fresh prompt alone attends the one
        row it keeps alone (attention.attends_last_row_alone)."""
        tokens = positions.shape[0]
        width = self.num_heads * self.head_dim
        attends = keep is None or len(keep) > 0
        last_row = attends_last_row_alone(batch, keep)
        qkv = linear(x, self.qkv_proj, plan, before_attention=batch.decode_counts is not None)
        if plan.kernels:
            out = self._fast_attention(qkv, positions, rotary, batch, plan, attends, last_row)
            if out is None:
                return None
            if last_row:  # the one row kept, attended alone
                return residual_linear(out.reshape(1, width), self.o_proj, plan, residual)
            if not isinstance(out, torch.Tensor):  # fp8 attention's rows (quant.Fp8Rows), as a W8A8 o_proj takes them
                out = kept_rows(out, keep)
                return residual_linear(out if is_fp8(self.o_proj) else out.dequantized(), self.o_proj, plan, residual)
            return residual_linear(kept_rows(out.reshape(tokens, width), keep), self.o_proj, plan, residual)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, positions), rotary(k, positions)
        if not attends or last_row:
            store_kv(k, v, batch.k_cache[self.layer_idx], batch.v_cache[self.layer_idx], batch.slot_mapping)
            return self.o_proj(last_row_attention(q, k, v).reshape(1, width)) if attends else None
        out = attend(q, k, v, self.layer_idx, batch)
        return self.o_proj(kept_rows(out.reshape(tokens, width), keep))

    def _fast_attention(self, qkv, positions, rotary, batch: AttentionBatch, plan: ExecutionPlan,
                        attends: bool = True, last_row: bool = False):
        """QK-norm + RoPE + cache store in one kernel, then cuDNN/flash prefill or the paged decode kernel; a
        prompt the plan attends in fp8 gets its output as quant.Fp8Rows. Without `attends`, the store alone (None);
        with `last_row` (attention.attends_last_row_alone), the last row's output alone, [1, heads, head_dim]."""
        k_cache, v_cache = batch.k_cache[self.layer_idx], batch.v_cache[self.layer_idx]
        if batch.decode_counts is not None and not batch.is_prefill:
            # batch 1's short contexts (the short graph): QK-norm, RoPE, the store, the attention and its merge in
            # one kernel, one dependent wait between the qkv and o_proj GEMVs rather than three
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
            return rope_decode_attention(qkv, self.num_heads, self.num_kv_heads, self.head_dim, *norms, rotary.cos,
                                         rotary.sin, positions, batch.slot_mapping, k_cache, v_cache,
                                         batch.block_tables, batch.context_lens, batch.decode_counts,
                                         self.head_dim ** -0.5, batch.decode_splits, batch.decode_block_n,
                                         pdl=plan.pdl)
        fp8_rows = fp8_prefill_rows(batch) if plan.fp8_prefill_attention and attends and not last_row else None
        out = qk_norm_rope_store(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                 self.q_norm.weight if self.qk_norm else None,
                                 self.k_norm.weight if self.qk_norm else None,
                                 self.q_norm.eps if self.qk_norm else 0.0, rotary.cos, rotary.sin, positions,
                                 batch.slot_mapping, k_cache, v_cache, kv_out=batch.is_prefill and attends,
                                 pdl=plan.pdl, fp8_rows=fp8_rows)
        if not attends:
            return None
        if last_row:
            return last_row_attention(*out)
        if fp8_rows is not None:
            from ..kernels import fp8_prefill_attention
            from .quant import Fp8Rows  # quant imports this module

            values, scale = fp8_prefill_attention.attention(*out, tokens=qkv.shape[0])
            return Fp8Rows(values, scale, qkv.dtype)
        scale = self.head_dim ** -0.5
        width = self.num_heads * self.head_dim

        def decode(q, k_cache, v_cache, block_tables, context_lens, splits=None, block_n=None):
            # Either kernel launches early and lets the next launch first where a streaming GEMV (o_proj) follows,
            # so that it streams its weights during the attention
            launch_first = plan.streams(q.shape[0], width, q.dtype)
            if batch.decode_fp8_cuda and fp8_attention.unsupported(q, k_cache, v_cache, block_tables,
                                                                   context_lens) is None:
                return fp8_attention.fp8_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                          splits=splits, pdl=plan.pdl, launch_first=launch_first)
            return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, splits=splits,
                                          block_n=block_n, pdl=plan.pdl, launch_first=launch_first)

        if not batch.is_prefill:
            return decode(out, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.decode_splits,
                          batch.decode_block_n)
        q, k, v = out  # k, v: this step's keys and values, as stored
        return prefill_step_attention(q, k, v, k_cache, v_cache, batch, decode)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, plan: ExecutionPlan, residual: torch.Tensor | None = None
                ) -> torch.Tensor | None:
        """The MLP's output; None where it was added into `residual` (see residual_linear). x may be a
        PendingNorm or, for a W8A8 product, quant.Fp8Rows (see linear)."""
        if plan.kernels:
            act = self._fast_activation(x, plan)
            if not isinstance(act, torch.Tensor):  # quantized for the fp8 down projection (quant.Fp8Rows)
                return self.down_proj.fast_product(act, pdl=plan.pdl, fast_accum=plan.fp8_fast_accum)
            return residual_linear(act, self.down_proj, plan, residual)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def _fast_activation(self, x: torch.Tensor | PendingNorm, plan: ExecutionPlan):
        """SiLU(gate) * up, in the gate_up product's kernel where it can be; for an fp8 down projection, quantized
        per token as its W8A8 product takes it, where gate_up's product is W8A8 too (quant.Fp8Rows)."""
        layer = self.gate_up_proj
        w = layer.weight
        if isinstance(x, PendingNorm):  # decode, batch 1: the norm, the GEMV and SiLU*up in one kernel
            act = x.product(layer, plan, gated=True)
            if act is not None:
                return act
            x = x.normed(plan)
        if not isinstance(x, torch.Tensor):  # quantized by the norm for this W8A8 product (takes_fp8_rows)
            return layer.fast_product(x, gated=True, pdl=plan.pdl, quantized_output=is_fp8(self.down_proj),
                                     cuda_gated_quant=plan.cuda_gated_quant, fast_accum=plan.fp8_fast_accum)
        act = skinny_product(x, layer, plan, gated=True)  # decode: SiLU*up fused into the gate_up GEMV
        if act is not None:
            return act
        if is_fp8(layer):
            return layer.fast_product(x, gated=True, pdl=plan.pdl, quantized_output=is_fp8(self.down_proj),
                                     cuda_gated_quant=plan.cuda_gated_quant, fast_accum=plan.fp8_fast_accum)
        if matmul.supports_gated(x, w):  # a long prefill: SiLU*up in the GEMM's epilogue
            return matmul.matmul(x, w, matmul.GATED_TILE, gated=True, pdl=plan.pdl)
        return silu_mul(self.gate_up_proj(x), pdl=plan.pdl)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, positions, rotary, batch, plan: ExecutionPlan, keep: torch.Tensor | None = None):
        """(the layer's output, the residual stream); with `keep` (the last layer: see Qwen3ForCausalLM.forward),
        those of the rows `keep` alone, and (None, no rows) for an empty keep."""
        rows = x if residual is None else residual  # the norms' input rows (x may be None: see residual_linear)
        qkv_fp8 = takes_fp8_rows(rows, self.self_attn.qkv_proj, plan)
        if residual is None:
            residual, x = x, self.input_layernorm(x, plan, fp8=qkv_fp8)
        elif isinstance(x, PendingNorm):  # the first layer's, its input the embedding's row (Qwen3ForCausalLM.embedded)
            pass
        else:
            x, residual = self.input_layernorm.add_forward(x, residual, plan, defer=keep is None, fp8=qkv_fp8)
        if keep is not None:  # only these rows go on past the attention
            residual = residual.index_select(0, keep)
        x = self.self_attn(x, positions, rotary, batch, plan, residual, keep)
        if not len(residual):
            return None, residual
        gate_up_fp8 = takes_fp8_rows(residual, self.mlp.gate_up_proj, plan, gated=True)
        x, residual = self.post_attention_layernorm.add_forward(x, residual, plan, defer=True, fp8=gate_up_fp8)
        return self.mlp(x, plan, residual), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                plan: ExecutionPlan = REFERENCE_PLAN, keep: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [tokens] (all sequences of the batch, concatenated) -> final hidden states,
        computed the way `plan` says (the PyTorch reference path by default). With `keep` (row indices: a step's
        sampled rows), those rows' alone, in keep's order: the last layer stores every row's K and V, but runs its
        o_proj, MLP and norms, and the final norm, on these rows only, the rest of them being needed by nothing
        (an empty keep, a prompt's chunk: nothing past the store). Same values as the rows of the whole forward."""
        x, residual = self.embedded(input_ids, plan)
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, positions, self.rotary, batch, plan, keep if i == last else None)
        if not len(residual):
            return residual
        x, _ = self.model.norm.add_forward(x, residual, plan)
        return x

    def embedded(self, input_ids: torch.Tensor, plan: ExecutionPlan
                 ) -> tuple[torch.Tensor | PendingNorm, torch.Tensor | None]:
        """(the first layer's input, the residual stream): the embedding's rows and None; for a single token where
        the streaming GEMV takes the first layer's norm, the gather, the norm and qkv_proj's product in that GEMV
        (a PendingNorm over the table), which writes the row to the residual stream (one kernel where there were
        three: the gather, the norm, the product)."""
        table = self.model.embed_tokens.weight
        if plan.norm_in_gemv and input_ids.shape[0] == 1 and plan.streams(1, table.shape[1], table.dtype):
            stream = torch.empty(1, table.shape[1], dtype=table.dtype, device=table.device)
            pending = PendingNorm(table, None, self.model.layers[0].input_layernorm, stream, row=input_ids)
            return pending, stream
        return self.model.embed_tokens(input_ids), None

    def compute_logits(self, hidden: torch.Tensor, plan: ExecutionPlan = REFERENCE_PLAN) -> torch.Tensor:
        """The logits in the model's dtype: a greedy step's argmax needs nothing wider (bf16 -> float32 is exact,
        so its argmax is the same), and skips the widened copy (512 rows of 151936: about 0.2 ms a step on an
        H200); the sampler and the log-probabilities widen them where arithmetic follows."""
        return linear(hidden, self.lm_head, plan)
