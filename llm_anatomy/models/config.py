"""Model specs: one frozen dataclass read from an HF config.json (either rope format), validated up front."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import torch

from ..errors import ConfigError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")
# What `quantization` may ask for (vLLM's --quantization): bf16 weights quantized to fp8 at load.
SUPPORTED_QUANTIZATION = ("fp8",)
SUPPORTED_CHECKPOINTS = ("quant_method 'fp8' (e4m3 weights with per-tensor or block scales, dynamic activation scales, "
                         "as Qwen's FP8 releases) and 'compressed-tensors' (8-bit float weights with channel, tensor "
                         "or block scales, dynamic or no activation quantization)")

_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
        raise ConfigError(f"dtype {dtype} is not supported; use bfloat16, float16 or float32")
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class WeightScheme:
    """How a checkpoint stores one quantized linear layer: `weight` in float8 e4m3 and, beside it, `scale_name`
    holding float scales, the real weight being the fp8 value times its scale."""

    scales: str  # "channel": [N, 1] | "tensor": one number | "block": [ceil(N / rows), ceil(K / cols)]
    scale_name: str  # "weight_scale" (compressed-tensors, per-tensor fp8) | "weight_scale_inv" (block fp8)
    block: tuple[int, int] | None = None  # (rows, cols) of weight each scale covers, when scales == "block"


@dataclass(frozen=True)
class QuantizationConfig:
    """Which linear layers are quantized and how: config.json's quantization_config, or fp8 asked for at load."""

    method: str  # "fp8" | "compressed-tensors" (quant_method)
    serialized: bool  # the checkpoint holds fp8 weights; False: float weights quantized per channel at load
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]  # (targets, scheme): "Linear", names, "re:" regexes
    ignore: tuple[str, ...] = ()  # layers (HF names, containers, "re:" regexes) left in the model dtype
    activations: str = "dynamic per token"  # what the checkpoint asks of the activations (we quantize per token)
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # the quantization_config as given

    @classmethod
    def at_load(cls) -> "QuantizationConfig":
        """--quantization fp8 over float weights: every linear layer but lm_head, one scale per output channel."""
        return cls("fp8", False, ((("Linear",), WeightScheme("channel", "weight_scale")),), ignore=("lm_head",))

    def scheme_for(self, layer: str) -> WeightScheme | None:
        """How the linear layer of this HF name (e.g. model.layers.0.self_attn.q_proj) is stored; None: not
        quantized."""
        if any(_names(pattern, layer) for pattern in self.ignore):
            return None
        return next((scheme for targets, scheme in self.groups
                     if any(t == "Linear" or _names(t, layer) for t in targets)), None)

    def describe(self) -> str:
        schemes = {scheme for _, scheme in self.groups}
        scales = ", ".join(sorted(f"{s.block[0]}x{s.block[1]} block" if s.block else f"per-{s.scales}"
                                  for s in schemes))
        origin = f"checkpoint ({self.method})" if self.serialized else "quantized at load"
        return f"fp8 e4m3 weights, {scales} scales, {origin}; activations: {self.activations}"

    @classmethod
    def from_hf(cls, qc) -> "QuantizationConfig":
        """Parse config.json's quantization_config; anything the engine cannot run exactly is refused."""
        if not isinstance(qc, dict):
            raise ConfigError(f"quantization_config must be an object, got {qc!r}")
        method = qc.get("quant_method")
        if method == "fp8":
            return _fp8_config(qc)
        if method == "compressed-tensors":
            return _compressed_tensors_config(qc)
        what = f"quantization method {method!r}" if method else "a quantization_config without quant_method"
        raise UnsupportedModelError(f"{what} (config.json's quantization_config) is not supported; llm-anatomy "
                                    f"loads {SUPPORTED_CHECKPOINTS}, or quantizes bf16 weights at load with "
                                    f"--quantization fp8")


def _names(pattern: str, layer: str) -> bool:
    """A target or ignore entry naming this layer: "re:" + a regex matched from the start (as compressed-tensors
    does), the layer's name, or a module containing it."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], layer) is not None
    return layer == pattern or layer.startswith(pattern + ".")


def _block_size(value, where: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ConfigError(f"{where} must be two positive integers [rows, cols], got {value!r}")
    return int(value[0]), int(value[1])


def _string_list(value, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of module names, got {value!r}")
    return tuple(value)


def _fp8_config(qc: dict) -> QuantizationConfig:
    """quant_method "fp8" (Qwen's and DeepSeek's FP8 releases, AutoFP8): the checkpoint holds e4m3 weights with
    `weight_scale_inv` per block of weight_block_size, or one `weight_scale` per tensor without it."""
    if qc.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedModelError(f"fp8 fmt {qc['fmt']!r} is not supported; only e4m3 weights")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedModelError(
            f"fp8 with activation_scheme {qc['activation_scheme']!r} (calibrated input scales) is not supported; "
            f"only dynamic activation scales")
    block = qc.get("weight_block_size")
    scheme = (WeightScheme("block", "weight_scale_inv", _block_size(block, "fp8 weight_block_size"))
              if block is not None else WeightScheme("tensor", "weight_scale"))
    # vLLM keeps lm_head unquantized under this method whatever the lists say; so does llm-anatomy
    ignore = (_string_list(qc.get("ignored_layers"), "fp8 ignored_layers")
              + _string_list(qc.get("modules_to_not_convert"), "fp8 modules_to_not_convert") + ("lm_head",))
    return QuantizationConfig("fp8", True, ((("Linear",), scheme),), ignore, raw=dict(qc))


CT_STRATEGIES = {"channel": "weight_scale", "tensor": "weight_scale", "block": "weight_scale"}


def _compressed_tensors_config(qc: dict) -> QuantizationConfig:
    """compressed-tensors (llm-compressor's format, most FP8 checkpoints on the hub): config_groups of 8-bit
    float weights with `weight_scale` per channel ([N, 1]), per tensor or per block, activations dynamic or
    not quantized."""
    if qc.get("kv_cache_scheme"):
        raise UnsupportedModelError("compressed-tensors kv_cache_scheme (calibrated KV cache scales) is not "
                                    "supported; --kv-cache-dtype fp8 quantizes the KV cache without them")
    if qc.get("transform_config"):
        raise UnsupportedModelError("compressed-tensors transform_config (rotated weights) is not supported")
    sparsity = qc.get("sparsity_config")
    if sparsity and (not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense"):
        raise UnsupportedModelError(f"compressed-tensors sparsity_config format "
                                    f"{sparsity.get('format') if isinstance(sparsity, dict) else sparsity!r} "
                                    f"is not supported; only dense weights")
    groups_in = qc.get("config_groups")
    if not isinstance(groups_in, dict) or not groups_in:
        raise ConfigError("compressed-tensors quantization_config has no config_groups")
    groups, activations = [], set()
    for name, group in groups_in.items():
        where = f"compressed-tensors config_groups.{name}"
        if not isinstance(group, dict):
            raise ConfigError(f"{where} must be an object")
        fmt = group.get("format") or qc.get("format")
        if fmt not in (None, "float-quantized"):
            raise UnsupportedModelError(f"{where}: format {fmt!r} is not supported; only float-quantized (fp8)")
        w = group.get("weights") or {}
        if (w.get("num_bits"), w.get("type")) != (8, "float") or w.get("symmetric", True) is not True:
            raise UnsupportedModelError(
                f"{where}: weights of {w.get('num_bits')} bits, type {w.get('type')!r}"
                f"{'' if w.get('symmetric', True) else ', asymmetric'} are not supported; only symmetric 8-bit "
                f"float (fp8 e4m3)")
        strategy = w.get("strategy")
        if strategy not in CT_STRATEGIES or w.get("dynamic"):
            dynamic = " (dynamic)" if w.get("dynamic") else ""
            raise UnsupportedModelError(f"{where}: weight strategy {strategy!r}{dynamic} is not supported; use "
                                        f"channel, tensor or block")
        block = _block_size(w.get("block_structure"), f"{where}.weights.block_structure") if strategy == "block" \
            else None
        activations.add(_ct_activations(group.get("input_activations"), where))
        if group.get("output_activations"):
            raise UnsupportedModelError(f"{where}: output_activations quantization is not supported")
        targets = _string_list(group.get("targets"), f"{where}.targets")
        if not targets:
            raise ConfigError(f"{where} has no targets")
        groups.append((targets, WeightScheme(strategy, CT_STRATEGIES[strategy], block)))
    return QuantizationConfig("compressed-tensors", True, tuple(groups),
                              _string_list(qc.get("ignore"), "compressed-tensors ignore"),
                              "; ".join(sorted(activations)), raw=dict(qc))


def _ct_activations(a, where: str) -> str:
    """compressed-tensors input_activations: none (weight-only) or dynamic; the engine quantizes them per token
    (as fine as a per-token or per-group scheme asks, finer than a per-tensor one)."""
    if not a:
        return "not quantized by the checkpoint (weight-only fp8)"
    if (a.get("num_bits"), a.get("type")) != (8, "float"):
        raise UnsupportedModelError(f"{where}: input_activations of {a.get('num_bits')} bits, type "
                                    f"{a.get('type')!r} are not supported; only 8-bit float")
    if not a.get("dynamic"):
        raise UnsupportedModelError(f"{where}: static input_activations (calibrated input_scale) are not "
                                    f"supported; only dynamic activation scales")
    return f"dynamic per {a.get('strategy', 'token')}"


@dataclass(frozen=True)
class ModelConfig:
    """The fields of an HF config.json that the network needs, under the same names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    quantization: QuantizationConfig | None = None  # config.json's quantization_config: a pre-quantized checkpoint
    extra: dict = field(default_factory=dict, compare=False, repr=False)  # other config.json fields, kept for the record

    # Qwen3 normalises q and k over head_dim before RoPE (QK-norm); Qwen2 instead has a bias on q, k, v.
    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V for every layer: layers x 2 x kv_heads x head_dim x bytes (147,456 B for Qwen3-8B in bf16)."""
        return self.num_hidden_layers * 2 * self.kv_size * dtype.itemsize

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            arch = d.get("architectures")
            raise UnsupportedModelError(
                f"model_type {model_type!r}{f' ({arch[0]})' if arch else ''} is not supported; "
                f"llm-anatomy runs {' and '.join(SUPPORTED_MODEL_TYPES)} models"
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}")
        for k in required + ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            if d.get(k) is not None and (not isinstance(d[k], int) or isinstance(d[k], bool) or d[k] <= 0):
                raise ConfigError(f"config.json field {k} must be a positive integer, got {d[k]!r}")
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {d['hidden_act']!r} is not supported; only silu")
        if d.get("use_sliding_window"):
            raise UnsupportedModelError("use_sliding_window=true is not supported; set it to false")
        layer_types = d.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise UnsupportedModelError("only full_attention layers are supported (layer_types has others)")

        # Two formats: rope_theta + rope_scaling (config.json as shipped) or rope_parameters (transformers >= 5).
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
        rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported; use one of {SUPPORTED_ROPE_TYPES}")
        scaling = None
        if rope_type != "default":
            if rope_type == "yarn" and not rope.get("original_max_position_embeddings"):
                raise ConfigError("yarn rope scaling needs original_max_position_embeddings")
            factor = rope.get("factor")
            if factor is None and rope_type == "yarn":
                factor = d["max_position_embeddings"] / rope["original_max_position_embeddings"]
            if not isinstance(factor, (int, float)) or factor < 1:
                raise ConfigError(f"rope scaling factor must be a number >= 1, got {factor!r}")
            known = {f for f in RopeScaling.__dataclass_fields__} - {"rope_type", "factor"}
            scaling = RopeScaling(rope_type=rope_type, factor=float(factor),
                                  **{k: v for k, v in rope.items() if k in known and v is not None})

        dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
        quantization = None if d.get("quantization_config") is None else \
            QuantizationConfig.from_hf(d["quantization_config"])
        fields = {f for f in cls.__dataclass_fields__}
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings") or 32768,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (its config has no attention_bias field); Qwen3 has none by default.
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            torch_dtype=dtype_name(parse_dtype(dtype)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            quantization=quantization,
            extra={k: v for k, v in d.items() if k not in fields},
        )

    def to_hf(self) -> dict:
        """This config under HF config.json field names (what the anatomy records as `model.config`)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "rope_scaling", "quantization")}
        if self.quantization is not None:
            d["quantization_config"] = self.quantization.raw
        d["rope_scaling"] = None if self.rope_scaling is None else {
            k: v for k, v in asdict(self.rope_scaling).items() if v is not None}
        d["hidden_act"] = "silu"
        d["architectures"] = ["Qwen3ForCausalLM" if self.model_type == "qwen3" else "Qwen2ForCausalLM"]
        return d

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies (float32, head_dim/2) and the factor that scales cos/sin (YaRN's attention factor)."""
        dim = self.head_dim
        base = self.rope_theta
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        inv_freq = 1.0 / pos_freqs
        s = self.rope_scaling
        if s is None:
            return inv_freq, 1.0
        if s.rope_type == "linear":
            return inv_freq / s.factor, 1.0
        # YaRN (arXiv 2309.00071): interpolate low frequencies, keep high ones, ramp between them.
        def correction_dim(rotations: float) -> float:
            return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv_freq = inv_freq / s.factor * (1 - extrapolation) + inv_freq * extrapolation

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if s.attention_factor is not None:
            attention_factor = s.attention_factor
        elif s.mscale and s.mscale_all_dim:
            attention_factor = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
        else:
            attention_factor = mscale(s.factor)
        return inv_freq, attention_factor


def resolve_quantization(config: ModelConfig, requested: str | None) -> QuantizationConfig | None:
    """What the engine runs: the checkpoint's own quantization, or fp8 asked for (`requested`, vLLM's
    --quantization) over float weights. Asking for fp8 with an fp8 checkpoint runs it as published."""
    if requested is None:
        return config.quantization
    if requested not in SUPPORTED_QUANTIZATION:
        raise ConfigError(f"quantization {requested!r} is not supported; use "
                          f"{' or '.join(SUPPORTED_QUANTIZATION)}, or leave it unset for the checkpoint's precision")
    if config.quantization is None:
        return QuantizationConfig.at_load()
    if config.quantization.method == requested:
        return config.quantization
    raise ConfigError(f"quantization {requested!r} was asked for, but the checkpoint is quantized with "
                      f"{config.quantization.method!r} (its config.json's quantization_config); leave quantization "
                      f"unset to run it as published")
