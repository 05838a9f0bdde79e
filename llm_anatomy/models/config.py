"""Model specs: one frozen dataclass read from an HF config.json (either rope format), validated up front."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ..errors import ConfigError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")

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
            extra={k: v for k, v in d.items() if k not in fields},
        )

    def to_hf(self) -> dict:
        """This config under HF config.json field names (what the anatomy records as `model.config`)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "rope_scaling")}
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
