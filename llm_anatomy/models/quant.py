"""fp8 linear layers, in gpt-fast's way: a module swapped in for nn.Linear, holding float8 e4m3 weights and float32
scales, that computes the product itself.

Scales come in two layouts (`block`): one per output channel ([N]: the weight row r is fp8 value x scale[r]), or
one per block of weight rows x columns as Qwen's FP8 releases publish them ([ceil(N / rows), ceil(K / cols)]).
A fused projection (qkv_proj, gate_up_proj) is its parts' rows one after the other, scales included: per-channel
scales concatenate as they are, block scales too where every part starts on a block boundary (the loader checks).

The product, by path:
- off the fast path (the CPU, the PyTorch reference): the weight dequantized exactly (fp8 value x scale in float32,
  rounded to the activations' dtype) and an ordinary matmul, so the result is the model whose float weights are
  those dequantized ones, bit for bit;
- the fast path, per-channel scales, bf16 on sm_90 or later: W8A8, the activations quantized per token by one
  kernel (kernels/fp8_quant.py), then a decode step's few rows (up to 16) through the fp8 tensor-core GEMV
  (fp8_gemv.w8a8_gemv) and more rows (prefill) through torch._scaled_mm (row-wise scaling, scale_a [M, 1] and
  scale_b [1, N], float32; its sums in the tensor cores' fp8 accumulator where the plan says: fp8_fast_accum).
  The gated product (gate_up) can hand on SiLU(gate) * up already quantized (Fp8Rows), which the down
  projection takes as it is: that activation is never written in bf16; likewise the norm before
  qkv_proj and gate_up_proj writes its result quantized (takes_fp8_rows; a batch-1 decode step's GEMVs are the
  streaming kernel's, kernels/stream_gemv.py, which takes the bf16 row and quantizes it itself, W8A8 too);
- elsewhere on the fast path (block scales, fp16/fp32, a GPU before sm_90): W8A16, the fp8 GEMV (up to 16 rows) or
  matmul kernel (kernels/fp8_gemv.py), which dequantizes each weight tile in registers and multiplies by the
  unquantized activations on bf16 tensor cores.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedModelError
from .config import QuantizationConfig, WeightScheme
from .qwen3 import PACKED_MODULES

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE_BYTES = 4  # float32
# Kept in the model dtype by default: a quantized lm_head costs the most accuracy for the least of the bytes (the
# embedding and the norms are not nn.Linear, so never swapped).
DEFAULT_SKIP = ("lm_head",)


def scale_shape(out_features: int, in_features: int, block: tuple[int, int] | None) -> tuple[int, ...]:
    if block is None:
        return (out_features,)
    return (-(-out_features // block[0]), -(-in_features // block[1]))


def fp8_linear_bytes(out_features: int, in_features: int, block: tuple[int, int] | None = None) -> int:
    """Bytes of one fp8 weight matrix with its scales (the cost model's figure for a quantized layer; a bias,
    in the model dtype, comes on top)."""
    scales = 1
    for d in scale_shape(out_features, in_features, block):
        scales *= d
    return out_features * in_features + scales * SCALE_BYTES


def decoder_layer_linear_bytes(config, dtype: torch.dtype, quantization: QuantizationConfig | None) -> int:
    """Bytes of one decoder layer's linear weights (qkv, o, gate_up, down; biases in the model dtype), from the
    config alone: what the cost model reads per layer and step. fp8 layers at a byte an element plus their scales
    (block scales for checkpoints that store them so, per channel for fp8 quantized at load)."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    total = (q + 2 * kv) * dtype.itemsize if config.attention_bias else 0
    for name, n, k in (("self_attn.qkv_proj", q + 2 * kv, h), ("self_attn.o_proj", h, q),
                       ("mlp.gate_up_proj", 2 * inter, h), ("mlp.down_proj", h, inter)):
        scheme = None if quantization is None else layer_scheme(f"model.layers.0.{name}", quantization)
        if scheme is None:
            total += n * k * dtype.itemsize
        else:
            total += fp8_linear_bytes(n, k, scheme.block if quantization.serialized else None)
    return total


def expand_scales(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] | None) -> torch.Tensor:
    """The scale of every weight element, [N, K] (per channel: [N, 1], broadcasting)."""
    if block is None:
        return scale[:, None]
    n, k = shape
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """The real weight, float32: each fp8 value times its scale (exact: e4m3 has 4 significant bits)."""
    return weight.float() * expand_scales(scale, tuple(weight.shape), block)


def quantize(weight: torch.Tensor, block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights -> (fp8 e4m3, float32 scales): each channel's (or block's) largest magnitude maps to 448,
    values round to nearest. An all-zero channel gets a tiny scale and zeros."""
    w = weight.float()
    if block is None:
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    else:
        n, k = w.shape
        bn, bk = block
        padded = F.pad(w.abs(), (0, -k % bk, 0, -n % bn))
        scale = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk).amax(dim=(1, 3))
        scale = scale.clamp(min=1e-12) / FP8_MAX
    q = (w / expand_scales(scale, tuple(w.shape), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class Fp8Rows(NamedTuple):
    """Activations quantized per token, for a W8A8 product: fp8 e4m3 values [M, K] and float32 scales [M, 1]."""
    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype  # the model dtype they stand for (the product's output dtype)

    def dequantized(self) -> torch.Tensor:
        return (self.values.float() * self.scale).to(self.dtype)


@cache
def _rowwise_scaled_mm(device: torch.device) -> bool:
    """torch._scaled_mm with row-wise scales needs a Hopper GPU or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in float8 e4m3 (a parameter, so that the model's parameter count stays its own) and
    float32 scales (`weight_scale`, a buffer); the bias, if any, in the model dtype. `stored_as`: how the checkpoint
    holds this layer (None: float weights, quantized per channel as they load)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 block: tuple[int, int] | None = None, stored_as: WeightScheme | None = None,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = block
        self.stored_as = stored_as
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale", torch.ones(scale_shape(out_features, in_features, block),
                                                        dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, stored_as: WeightScheme | None = None,
                    rows: int = 8192) -> "Fp8Linear":
        """The fp8 twin of a linear layer: empty on the meta device (for the loader to fill), else its weights
        quantized per output channel (or block), `rows` rows at a time (whole blocks): the float32 temporaries of a
        whole large matrix (Qwen3-8B's lm_head: 2.5 GB each) would stay in the caching allocator and shrink a KV
        pool sized after. A slice's scales are the whole matrix's."""
        w = linear.weight
        block = stored_as.block if stored_as is not None and stored_as.scales == "block" else None
        fp8 = cls(linear.in_features, linear.out_features, linear.bias is not None, block, stored_as,
                  dtype=w.dtype, device=w.device)
        if not w.is_meta:
            step = rows if block is None else -(-rows // block[0]) * block[0]
            for start in range(0, linear.out_features, step):
                q, scale = quantize(w.detach()[start:start + step], block)
                fp8.weight.data[start:start + step].copy_(q)
                first = start if block is None else start // block[0]
                fp8.weight_scale[first:first + scale.shape[0]].copy_(scale)
            if linear.bias is not None:
                fp8.bias.data.copy_(linear.bias.detach())
        return fp8

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.block).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The reference product: the dequantized weight, an ordinary matmul (the fast path: fast_product)."""
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def fast_product(self, x: torch.Tensor | Fp8Rows, gated: bool = False, pdl: bool = False,
                     quantized_output: bool = False, cuda_gated_quant: bool = False, fast_accum: bool = False
                     ) -> torch.Tensor | Fp8Rows:
        """The fast path's product (see the module's docstring) of x [rows, K] (or of rows already quantized,
        Fp8Rows); with gated (gate_up_proj = [gate; up]) SiLU(x gate^T) * (x up^T), rounded as HF rounds it, and
        with quantized_output as well, that quantized per token (Fp8Rows) where the product is W8A8. The batch-1
        streaming GEMV is the model's to choose (qwen3.skinny_product), with the plan. `pdl`: the Triton kernels'
        launches (kernels/pdl.py); `cuda_gated_quant`: SiLU(gate) * up quantized by the CUDA kernel; `fast_accum`:
        torch._scaled_mm's sums in the tensor cores' fp8 accumulator (both the plan's)."""
        if isinstance(x, Fp8Rows) and not (self.w8a8_on(x.values.device, x.dtype) and (self.bias is None or not gated)):
            x = x.dequantized()
        y = (self._fast(x, gated, pdl, quantized_output, cuda_gated_quant, fast_accum)
             if self.bias is None or not gated else None)
        if y is None:
            y = self.forward(x)
            if gated:
                gate, up = y.chunk(2, dim=-1)
                return F.silu(gate) * up
            return y
        return y if self.bias is None or isinstance(y, Fp8Rows) else y + self.bias

    def takes_fp8_rows(self, x: torch.Tensor, gated: bool = False) -> bool:
        """Whether fast_product(x, gated) quantizes x per token for a W8A8 product: where it does, the kernel
        before it may hand x over quantized instead (Fp8Rows, the same arithmetic: kernels/norm.rmsnorm_fp8)."""
        from ..kernels import use_kernels

        return use_kernels(x.device) and self.w8a8_on(x.device, x.dtype) and (self.bias is None or not gated)

    def w8a8_on(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the fast product of `dtype` rows on `device` is W8A8 (per-channel scales, bf16 rows, sm_90+)."""
        return (self.block is None and dtype == torch.bfloat16 and _rowwise_scaled_mm(device)
                and self.in_features % 16 == 0 and self.out_features % 16 == 0)

    def _fast(self, x: torch.Tensor | Fp8Rows, gated: bool, pdl: bool, quantized_output: bool,
              cuda_gated_quant: bool, fast_accum: bool) -> torch.Tensor | Fp8Rows | None:
        from ..kernels import fp8_gemv, fp8_quant, use_kernels
        from ..kernels.activation import silu_mul

        if isinstance(x, Fp8Rows):  # W8A8 (fast_product checked)
            xq, x_scale, dtype = x
        else:
            if not use_kernels(x.device):
                return None
            if not self.w8a8_on(x.device, x.dtype):  # W8A16: the weights dequantized in registers
                if fp8_gemv.supports(x, self.weight, self.block):
                    return fp8_gemv.fp8_gemv(x, self.weight, self.weight_scale, self.block, gated, pdl=pdl)
                if fp8_gemv.supports_matmul(x, self.weight, self.block):
                    return fp8_gemv.fp8_matmul(x, self.weight, self.weight_scale, self.block, gated, pdl=pdl)
                return None
            (xq, x_scale), dtype = fp8_quant.quantize_rows(x, pdl=pdl), x.dtype
        if fp8_gemv.supports_w8a8(xq, self.weight):  # a decode step's few rows
            y = fp8_gemv.w8a8_gemv(xq, x_scale, self.weight, self.weight_scale, dtype, gated, pdl=pdl)
            return Fp8Rows(*fp8_quant.quantize_rows(y, pdl=pdl), dtype) if gated and quantized_output else y
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale.view(1, -1),
                             out_dtype=dtype, use_fast_accum=fast_accum)
        if not gated:
            return y
        if quantized_output:
            return Fp8Rows(*fp8_quant.quantize_rows(y, gated=True, pdl=pdl, cuda=cuda_gated_quant), dtype)
        return silu_mul(y, pdl=pdl)

    def weight_bytes(self) -> int:
        """Bytes this layer's weights take: fp8 values, float32 scales and the bias."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() + self.weight_scale.numel() * SCALE_BYTES + bias

    def extra_repr(self) -> str:
        scales = "per-channel" if self.block is None else f"{self.block[0]}x{self.block[1]} block"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8 e4m3, {scales} scales")


def hf_layer_names(name: str) -> list[str]:
    """The HF linear layers a module of ours holds: a fused projection's parts, else itself."""
    prefix, _, leaf = name.rpartition(".")
    parts = [hf for hf, (fused, _) in PACKED_MODULES.items() if fused == leaf]
    return [f"{prefix}.{hf}" if prefix else hf for hf in parts] or [name]


def layer_scheme(name: str, quantization: QuantizationConfig) -> WeightScheme | None:
    """How the checkpoint stores this layer of ours (None: not quantized); a fused layer's parts must agree."""
    schemes = {quantization.scheme_for(hf) for hf in hf_layer_names(name)}
    if len(schemes) > 1:
        raise UnsupportedModelError(
            f"the quantization_config stores the parts of {name} ({', '.join(hf_layer_names(name))}) differently; "
            f"llm-anatomy fuses them into one layer and needs them quantized alike")
    return schemes.pop()


def quantize_linear_layers(model: nn.Module, skip: tuple[str, ...] = DEFAULT_SKIP,
                           quantization: QuantizationConfig | None = None) -> list[str]:
    """Swap each nn.Linear that `quantization` quantizes (default: every one, per output channel) and `skip`
    does not name for an Fp8Linear: empty on the meta device (the loader fills it), else quantized from its
    weights. Returns the names swapped."""
    quantization = quantization or QuantizationConfig.at_load()
    swapped = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        scheme = layer_scheme(name, quantization)
        if name in skip or name.split(".")[-1] in skip:
            if scheme is not None and quantization.serialized:
                raise UnsupportedModelError(f"the checkpoint stores {name} in fp8; llm-anatomy keeps {name} in the "
                                            f"model dtype and cannot load it quantized")
            continue
        if scheme is None:
            continue
        model.set_submodule(name, Fp8Linear.from_linear(module, scheme if quantization.serialized else None))
        swapped.append(name)
    return swapped


@torch.no_grad()
def quantize_head(model: nn.Module) -> None:
    """Swap lm_head for its fp8 twin, quantized per output channel (EngineConfig's quantize_lm_head). A tied head
    gets its own fp8 copy; the embedding keeps the float one."""
    if not isinstance(model.lm_head, nn.Linear):
        raise UnsupportedModelError("lm_head is already quantized; quantize_lm_head quantizes a float lm_head")
    model.lm_head = Fp8Linear.from_linear(model.lm_head)


def w8a8_gemms(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether any fp8 layer of `model` multiplies `dtype` rows on `device` in W8A8, through torch._scaled_mm past a
    decode step's few rows (what ExecutionPlan.fp8_fast_accum applies to)."""
    return any(isinstance(m, Fp8Linear) and m.w8a8_on(device, dtype) for m in model.modules())


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the linear layers' weights (the decoder layers' projections and lm_head), biases and scales
    included: what --quantization fp8 roughly halves."""
    total = 0
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            total += m.weight_bytes()
        elif isinstance(m, nn.Linear):
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total


def precision_label(model: nn.Module) -> str | None:
    """The fp8 layers in words, for the report; None where every layer runs in the model dtype."""
    head = model.lm_head if isinstance(getattr(model, "lm_head", None), Fp8Linear) else None
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear) and m is not head]
    if not layers:
        return None
    scales = sorted({"per-channel" if m.block is None else f"{m.block[0]}x{m.block[1]} block" for m in layers})
    stored = {m.stored_as is not None for m in layers}
    origin = "as the checkpoint stores them" if stored == {True} else "quantized at load"
    if head is None:
        return (f"fp8 e4m3 weights with {' and '.join(scales)} float32 scales ({origin}) in {len(layers)} linear "
                f"layers; the embedding, the norms and lm_head in the model dtype")
    return (f"fp8 e4m3 weights with {' and '.join(scales)} float32 scales ({origin}) in {len(layers)} linear "
            f"layers, and lm_head's with per-channel scales (quantized at load); the embedding and the norms in "
            f"the model dtype")
