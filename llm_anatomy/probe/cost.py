"""The cost model: FLOPs and bytes of a prefill or a decode step, from the config, the dtype and the kernels' shapes.

One place, used by every command; docs/anatomy.md states these conventions for the record's readers.

FLOPs: 2 per multiply-add of the matrix products (linear layers, lm_head, attention's QK^T and PV); the
elementwise work (norms, RoPE, SiLU, softmax) is left out, as FLOP counters and MFU figures do. Causal attention
counts only the unmasked half: query i of a prefill attends to prefix + i keys. The lm_head runs on one token per
sequence (the last of its prompt in a prefill): logits of the other prompt tokens are never computed, nor is
their last layer past its qkv product and K/V store (o_proj, the MLP, the norms), which nothing reads; a prompt's
chunk that samples nothing does not attend in its last layer either.

Bytes: a model of the device-memory (DRAM) traffic of the CUDA fast path's kernels, kernel by kernel, as Nsight
Compute counts it (each kernel starting from a cold L2 cache, its default): every kernel reads its inputs from
device memory; an intermediate tensor written by one kernel and read by the next is counted once, at its read
(its write-back falls outside both kernels there, and an unprofiled run pays one crossing or the other); writes
that outlive the step are counted: the KV cache. The tiled GEMMs of a prefill read their operands once per
wave of output tiles (`gemm_reads`): a wave is the tiles the multiprocessors work on at once, and nothing is
assumed to stay in L2 from one wave to the next. Sampling is counted as one read of the logits, in the model dtype
(a greedy argmax reads them as they are).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch

from ..models.config import ModelConfig
from ..engine.plan import DecodeAttentionPlan
from ..models.attention import FP8_PREFILL_MIN_TOKENS


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

    def bytes_by_category(self) -> dict[str, float]:
        """Modelled bytes per kernel category (probe/kernels.py's names), to set beside measured ones."""
        out: dict[str, float] = {}
        for name, p in self.parts.items():
            category = PART_CATEGORY[name]
            out[category] = out.get(category, 0.0) + p["bytes"]
        return out


# The kernel category (probe/kernels.py) whose kernels move each part's bytes. At batch 1 on Hopper the decode
# step's norms and its embedding's gather run inside the streaming GEMVs (models/qwen3.py), so there measured bytes
# show them under gemm; and in the short graph its rope and kv_write inside the attention's kernel
# (decode_attention.rope_decode_attention).
PART_CATEGORY = {
    "linear": "gemm", "linear_inputs": "gemm", "lm_head": "gemm", "attention": "attention", "kv_read": "attention",
    "kv_write": "rope", "rope": "rope", "norm": "norm", "activation": "activation", "embedding": "copy",
    "logits": "sampling", "bias": "other", "quantize": "other",
}


@dataclass(frozen=True)
class GemmTiling:
    """How a tiled GEMM walks its output: tiles of bm x bn, taken in `order` ("rows": along N first, so a wave
    covers whole rows of tiles; "grouped": `group_m` rows of tiles at a time, along M first within them, as
    kernels/matmul.py's grouped order)."""

    bm: int
    bn: int
    order: str = "rows"
    group_m: int = 1


@dataclass(frozen=True)
class KernelShapes:
    """What the byte model assumes about the kernels and the device; the defaults are this engine's on an H100 or
    H200 (132 multiprocessors). tests/test_cost.py checks them against the kernels' own constants."""

    sms: int = 132
    # cuBLAS's prefill GEMMs: 128 x 256 tiles along N. Along N, each wave re-reads the weight; Nsight Compute
    # counted 19.6 GB in cuBLAS's kernels of a 2048-token Qwen3-8B prefill (H200), against 18.9 modelled this way
    # and 14.3 along M (docs/anatomy.md). cuBLAS picks its kernel by shape: at 2041 tokens it walked along M
    # (14.4 GB read against 19.1 modelled, 2026-12-04), which this model does not follow.
    cublas: GemmTiling = GemmTiling(128, 256, "rows")
    # kernels/matmul.py: prefill's gate_up with SiLU * up in its epilogue (GATED_TILE, BN per half, grouped by 16
    # rows of tiles), from GATED_MIN_ROWS rows; fewer rows take cuBLAS and the SiLU * up kernel.
    gated: GemmTiling = GemmTiling(128, 128, "grouped", 16)
    gated_min_rows: int = 1024
    gemv_max_rows: int = 16  # kernels/gemv.py MAX_ROWS: up to this many rows a product is a GEMV
    # Decode attention's context splits (the engine's plan, kernels/decode_attention.py): each split writes float32
    # partials (head_dim + 2 values) that the merge reads back.
    attention: DecodeAttentionPlan = DecodeAttentionPlan()
    # The precision the engine runs (its plan): bytes of a decoder layer's linear weight element (1 for fp8, with a
    # float32 scale per output row) and of a KV cache element; 0: the activations' dtype.
    weight_size: int = 0
    weight_row_scale_bytes: int = 0
    # lm_head's weight element (1: fp8 with a float32 scale per row, the engine's quantize_lm_head); 0: the
    # activations' dtype
    head_size: int = 0
    kv_size: int = 0
    # W8A8 (fp8 weights with a scale per row, bf16 activations, on Hopper or later): from 2 rows (batch 1 streams bf16 rows,
    # kernels/stream_gemv.py) the products read their input as fp8 rows, a byte an element and a float32 scale a
    # row. The norms write qkv_proj's and gate_up_proj's so (kernels/norm.rmsnorm_fp8); o_proj's and down_proj's
    # come from kernels/fp8_quant.py, which reads the attention's output and the gate_up product (`quantize`).
    # No fp8 product adds into the residual stream, so the norms read the product and the stream.
    w8a8: bool = False
    # The plan's fp8 prefill attention (kernels/fp8_prefill_attention.py): a fresh prompt alone of
    # attention.FP8_PREFILL_MIN_TOKENS or more reads its queries in fp8 and hands o_proj its output in fp8 rows,
    # which then need no quantization kernel.
    fp8_prefill_attention: bool = False

    def kv_bytes_per_token(self, c: ModelConfig, dtype: torch.dtype) -> int:
        return c.num_hidden_layers * 2 * c.kv_size * (self.kv_size or dtype.itemsize)

    def decode_splits(self, batch: int, longest_context: int, kv_heads: int) -> int:
        splits, _ = self.attention.for_step(batch, longest_context)
        return splits or max(1, min(64, -(-2 * self.sms // (batch * kv_heads))))


DEFAULT_SHAPES = KernelShapes()


def _make(parts: dict[str, dict[str, float]]) -> Cost:
    parts = {k: {"flops": float(v.get("flops", 0.0)), "bytes": float(v.get("bytes", 0.0))} for k, v in parts.items()}
    return Cost(sum(p["flops"] for p in parts.values()), sum(p["bytes"] for p in parts.values()), parts)


def layer_linear_params(c: ModelConfig) -> int:
    """Weights of one decoder layer's matrices (q, k, v, o, gate, up, down), biases included."""
    qkv = c.hidden_size * (c.q_size + 2 * c.kv_size) + (c.q_size + 2 * c.kv_size if c.attention_bias else 0)
    return qkv + c.q_size * c.hidden_size + 3 * c.hidden_size * c.intermediate_size


def layer_norm_params(c: ModelConfig) -> int:
    return 2 * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0)


def weight_bytes_per_step(c: ModelConfig, dtype: torch.dtype, shapes: KernelShapes = DEFAULT_SHAPES
                          ) -> dict[str, float]:
    """Weights every step must read: the layers in `dtype`, the final norm and the lm_head (a tied head too), the
    head at shapes.head_size (fp8: with a float32 scale per row)."""
    size = dtype.itemsize
    head = c.vocab_size * c.hidden_size * (shapes.head_size or size) + (c.vocab_size * 4 if shapes.head_size else 0)
    return {
        "layers": c.num_hidden_layers * (layer_linear_params(c) + layer_norm_params(c)) * size,
        "lm_head": head + c.hidden_size * size,
    }


@functools.lru_cache(maxsize=512)
def gemm_reads(m: int, n: int, k: int, tiling: GemmTiling, sms: int, weight_rows_per_tile: int | None = None
               ) -> tuple[int, int]:
    """(activation elements, weight elements) a tiled GEMM out[m, n] = x[m, k] @ w[n, k].T reads from device memory:
    each wave of `sms` output tiles reads the row blocks of x and the column blocks of w that its tiles need, once
    each (the tiles of a wave share them through L2), and nothing is assumed to survive to the next wave.
    `weight_rows_per_tile`: rows of w behind one tile's bn columns (2 bn for the gated gate_up product)."""
    tm, tn = -(-m // tiling.bm), -(-n // tiling.bn)
    w_rows = weight_rows_per_tile or tiling.bn
    n_rows = n * w_rows // tiling.bn  # rows of w in all
    a_elems = w_elems = 0
    for first in range(0, tm * tn, sms):
        rows, cols = set(), set()
        for t in range(first, min(first + sms, tm * tn)):
            pm, pn = _tile_coords(t, tm, tn, tiling)
            rows.add(pm)
            cols.add(pn)
        a_elems += sum(min(tiling.bm, m - r * tiling.bm) for r in rows) * k
        w_elems += sum(min(w_rows, n_rows - col * w_rows) for col in cols) * k
    return a_elems, w_elems


def _tile_coords(t: int, tm: int, tn: int, tiling: GemmTiling) -> tuple[int, int]:
    if tiling.order == "rows":
        return t // tn, t % tn
    in_group = tiling.group_m * tn  # kernels/matmul.py _tile_coords
    first_m = (t // in_group) * tiling.group_m
    group_rows = min(tm - first_m, tiling.group_m)
    return first_m + t % group_rows, (t % in_group) // group_rows


def _linear_bytes(rows: int, n: int, k: int, size: int, shapes: KernelShapes, gated: bool = False,
                  residual: bool = False, fp8_input: bool = False) -> tuple[float, float]:
    """(weight bytes, input bytes) of one linear layer over `rows` tokens: a GEMV reads each once; a GEMM (more
    rows) per wave of tiles, and the bf16 products that feed the residual stream also read it (added in the
    epilogue). Weights at the plan's size (shapes.weight_size), their per-row scales once; W8A8 inputs as fp8 rows
    with their scales (shapes.w8a8; fp8_input: rows that come quantized, even one)."""
    wsize, scales = shapes.weight_size or size, n * shapes.weight_row_scale_bytes
    w8a8 = (shapes.w8a8 and size == 2 and rows > 1) or fp8_input
    in_size, row_scales = (1, rows * 4) if w8a8 else (size, 0)
    if rows <= shapes.gemv_max_rows:
        return n * k * wsize + scales, rows * k * in_size + row_scales
    if gated and rows >= shapes.gated_min_rows and not shapes.weight_size:
        a, w = gemm_reads(rows, n // 2, k, shapes.gated, shapes.sms, 2 * shapes.gated.bn)
    else:
        a, w = gemm_reads(rows, n, k, shapes.cublas, shapes.sms)
    stream = rows * n * size if residual and not shapes.weight_size else 0
    return w * wsize + scales, a * in_size + row_scales + stream


def _layer(c: ModelConfig, dtype: torch.dtype, tokens: int, kept: int, shapes: KernelShapes,
           fp8_attention: bool = False, queries: int | None = None) -> dict[str, float]:
    """Bytes of one decoder layer's kernels for a step of `tokens` tokens, by part (attention's K/V apart), its
    o_proj, MLP and second norm over `kept` of them (the last layer of a prefill keeps the sampled rows alone, none
    for a prompt's chunk, which then attends nothing: models/qwen3.py), its attention over `queries` of them (all
    by default); fp8_attention: a prefill attended in fp8 (KernelShapes.fp8_prefill_attention)."""
    s, h, inter = dtype.itemsize, c.hidden_size, c.intermediate_size
    qkv = c.q_size + 2 * c.kv_size
    weights, inputs = _linear_bytes(tokens, qkv, h, s, shapes)
    if kept:  # o_proj takes the fp8 attention's rows as they are, quantized, however few
        for n, k, gated, residual, fp8_in in ((h, c.q_size, False, True, fp8_attention and shapes.w8a8),
                                              (2 * inter, h, True, False, False), (h, inter, False, True, False)):
            w, x = _linear_bytes(kept, n, k, s, shapes, gated, residual, fp8_in)
            weights, inputs = weights + w, inputs + x
    # SiLU * up is a kernel of its own only for bf16 prefills of 17-1023 rows: the fp8 products take it in theirs
    # (the batch-1 streaming GEMV, the W8A16 kernels) or hand it to the quantization of down_proj's input (W8A8)
    fused_gate = kept <= shapes.gemv_max_rows or kept >= shapes.gated_min_rows or shapes.weight_size
    # W8A8's own quantization kernels (shapes.w8a8): o_proj's input, and down_proj's from the gate_up product (a
    # GEMV's SiLU * up, a GEMM's [gate, up])
    quantize = 0.0
    if shapes.w8a8 and dtype == torch.bfloat16 and kept > 1:
        o_input = 0 if fp8_attention else c.q_size  # the fp8 attention writes o_proj's input quantized
        quantize = kept * (o_input + (inter if kept <= shapes.gemv_max_rows else 2 * inter)) * s
    norm_weights = layer_norm_params(c) - (0 if kept else h)  # no second norm without rows
    return {
        "linear": weights + norm_weights * s,
        "linear_inputs": inputs,
        "norm": (_norm_inputs(tokens, shapes) * tokens + _norm_inputs(kept, shapes) * kept) * h * s,
        # QK-norm + RoPE + the cache store reads the qkv product and a cos and a sin row (float32) per token
        "rope": tokens * (qkv * s + c.head_dim * 4),
        "activation": 0.0 if fused_gate else kept * 2 * inter * s,  # SiLU * up, unfused
        "quantize": quantize,
        "bias": tokens * qkv * s if c.attention_bias else 0.0,  # the bias add after the qkv product
        # attention reads the rotated queries (none where the layer attends nothing)
        "attention_q": (tokens if queries is None else queries) * c.q_size * (1 if fp8_attention else s) if kept
        else 0.0,
    }


def _norm_inputs(rows: int, shapes: KernelShapes) -> int:
    """Tensors a norm reads after a product over `rows`: a GEMV has no epilogue, its product reaches the residual
    stream through the norm, which reads the product and the stream; after a GEMM that added it there (bf16
    weights), the stream alone."""
    return 2 if rows <= shapes.gemv_max_rows or shapes.weight_size else 1


def _layers(c: ModelConfig, dtype: torch.dtype, tokens: int, kept: int, shapes: KernelShapes,
            fp8_attention: bool = False, last_row: bool = False) -> dict[str, float]:
    """Bytes of all decoder layers' kernels (_layer): every layer over all tokens but the last, over `kept`;
    last_row: the last layer attends its last row's query alone, in bf16 (attention.attends_last_row_alone)."""
    full = _layer(c, dtype, tokens, tokens, shapes, fp8_attention)
    last = full if kept == tokens else _layer(c, dtype, tokens, kept, shapes, fp8_attention and not last_row,
                                               1 if last_row else None)
    return {part: (c.num_hidden_layers - 1) * full[part] + last[part] for part in full}


def attention_flops(c: ModelConfig, query_tokens: int, prefix: int, causal: bool = True,
                    layers: int | None = None) -> float:
    """QK^T and PV over all layers (or `layers` of them) for `query_tokens` new tokens after `prefix` cached ones."""
    if causal:
        keys = query_tokens * prefix + query_tokens * (query_tokens + 1) / 2
    else:
        keys = query_tokens * (prefix + query_tokens)
    return 4 * (c.num_hidden_layers if layers is None else layers) * c.num_attention_heads * c.head_dim * keys


def _step(c: ModelConfig, dtype: torch.dtype, tokens: int, sampled: int, attention_flops_: float, kv_read: float,
          partials: float, shapes: KernelShapes, fp8_attention: bool = False, last_row: bool = False) -> Cost:
    s, h = dtype.itemsize, c.hidden_size
    layer = _layers(c, dtype, tokens, sampled, shapes, fp8_attention, last_row)
    final_norm = _norm_inputs(sampled, shapes) * sampled * h * s  # the sampled rows alone (models/qwen3.py)
    qkv_params = h * (c.q_size + 2 * c.kv_size) + (c.q_size + 2 * c.kv_size if c.attention_bias else 0)
    # every layer's qkv product over all tokens; the rest of the last layer over the sampled rows alone
    linear_flops = 2 * (c.num_hidden_layers * tokens * qkv_params
                        + ((c.num_hidden_layers - 1) * tokens + sampled) * (layer_linear_params(c) - qkv_params))
    # An fp8 lm_head's W8A8 product over more than one row quantizes them first (a read of the bf16 rows), then
    # reads them as fp8 rows with a float32 scale each; one row is the streaming GEMV's, which reads it in bf16.
    head_w8a8 = shapes.head_size and shapes.w8a8 and s == 2 and sampled > 1
    head_input = sampled * (h + 4) if head_w8a8 else sampled * h * s
    return _make({
        "linear": {"flops": linear_flops, "bytes": layer["linear"]},
        "linear_inputs": {"bytes": layer["linear_inputs"]},
        "attention": {"flops": attention_flops_, "bytes": layer["attention_q"] + partials},
        "kv_read": {"bytes": kv_read},
        "kv_write": {"bytes": tokens * shapes.kv_bytes_per_token(c, dtype)},
        "rope": {"bytes": layer["rope"]},
        "norm": {"bytes": layer["norm"] + final_norm},
        "activation": {"bytes": layer["activation"]},
        "quantize": {"bytes": layer["quantize"] + (sampled * h * s if head_w8a8 else 0)},
        "bias": {"bytes": layer["bias"]},
        "embedding": {"bytes": tokens * h * s},
        "lm_head": {"flops": 2 * sampled * h * c.vocab_size,
                    "bytes": weight_bytes_per_step(c, dtype, shapes)["lm_head"] + head_input},
        "logits": {"bytes": sampled * c.vocab_size * s},  # written then read by sampling: once
    })


def prefill_cost(c: ModelConfig, dtype: torch.dtype, seqs: list[tuple[int, int]], logits_tokens: int | None = None,
                 causal: bool = True, shapes: KernelShapes = DEFAULT_SHAPES) -> Cost:
    """A prefill step over sequences given as (new tokens, cached prefix); logits for one token per sequence.
    Attention reads this step's K and V and each cached prefix once."""
    tokens = sum(n for n, _ in seqs)
    logits_tokens = len(seqs) if logits_tokens is None else logits_tokens
    kv_read = sum(p + n for n, p in seqs) * shapes.kv_bytes_per_token(c, dtype)
    long_alone = len(seqs) == 1 and seqs[0][1] == 0 and seqs[0][0] >= FP8_PREFILL_MIN_TOKENS  # attention.py's
    fp8_attention = shapes.fp8_prefill_attention and long_alone
    # a step that samples nothing (a prompt's chunk) attends nothing in its last layer; a long fresh prompt alone
    # attends its last row alone there (models/qwen3.py, attention.attends_last_row_alone)
    layers = c.num_hidden_layers - (0 if logits_tokens else 1)
    last_row = long_alone and logits_tokens == 1
    if last_row:
        n = seqs[0][0]
        flops = attention_flops(c, n, 0, causal, layers - 1) + attention_flops(c, 1, n - 1, causal, 1)
    else:
        flops = sum(attention_flops(c, n, p, causal, layers) for n, p in seqs)
    return _step(c, dtype, tokens, logits_tokens, flops, kv_read * layers / c.num_hidden_layers, 0.0, shapes,
                 fp8_attention, last_row)


def decode_cost(c: ModelConfig, dtype: torch.dtype, context_lens: list[int], shapes: KernelShapes = DEFAULT_SHAPES
                ) -> Cost:
    """A decode step: one new token for each sequence, attending to its context (the new token included)."""
    batch = len(context_lens)
    splits = shapes.decode_splits(batch, max(context_lens), c.num_key_value_heads)
    # one split a sequence writes the output itself: no partials (kernels/decode_attention.py)
    partials = 0 if splits == 1 else c.num_hidden_layers * batch * c.num_attention_heads * splits * (c.head_dim + 2) * 4
    flops = sum(4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * n for n in context_lens)
    return _step(c, dtype, batch, batch, flops, sum(context_lens) * shapes.kv_bytes_per_token(c, dtype), partials,
                 shapes)


def kv_formula(c: ModelConfig, dtype: torch.dtype) -> str:
    return (f"{c.num_hidden_layers} layers x 2 (K, V) x {c.num_key_value_heads} KV heads x {c.head_dim} head_dim "
            f"x {dtype.itemsize} B = {c.kv_bytes_per_token(dtype):,} B per token")


def w8a8_device(device: torch.device) -> bool:
    """Whether fp8 layers with a scale per row run W8A8 here (models/quant.py: bf16 on Hopper or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def device_shapes(device: torch.device, plan=None) -> KernelShapes:
    """The default shapes with this device's multiprocessor count (the width of a wave of tiles) and, given the
    engine's plan, its precision (fp8 weights with a scale per row, an fp8 KV cache) and decode attention."""
    shapes = DEFAULT_SHAPES
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        shapes = shapes if sms == shapes.sms else replace(shapes, sms=sms)
    if plan is not None:
        fp8_weights = plan.weight_dtype == "float8_e4m3fn"
        shapes = replace(shapes, attention=plan.decode_attention, weight_size=1 if fp8_weights else 0,
                         head_size=1 if plan.head_dtype == "float8_e4m3fn" else 0,
                         weight_row_scale_bytes=4 if fp8_weights else 0, w8a8=fp8_weights and w8a8_device(device),
                         kv_size=1 if plan.kv_cache_dtype == "float8_e4m3fn" else 0,
                         fp8_prefill_attention=plan.fp8_prefill_attention)
    return shapes

