"""EngineConfig: every setting of an engine, frozen and checked in one place.

What the user chooses lives here; what the engine then decides for its device (which kernels, graphs, tiles)
is its ExecutionPlan (plan.py). Checks that need the model's config.json (max_model_len against the model's
context) or the device (is there a GPU) are made when the engine is built from this.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields

from ..errors import AnatomyError

QUANTIZATIONS = ("fp8",)  # --quantization values (vLLM's names); None: the checkpoint's own precision
# --kv-cache-dtype values: "auto" stores the model's dtype; "fp8" (= "fp8_e4m3", vLLM's names) halves the bytes
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
INT64_MAX = (1 << 63) - 1


def _check_int(name: str, value, low: int, high: int = INT64_MAX, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise AnatomyError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise AnatomyError(f"{name} must be >= {low}, got {value}" if high == INT64_MAX and low > -INT64_MAX
                           else f"{name} must be in {low}..{high}, got {value}")


def _check_real(name: str, value, what: str, within, optional: bool = False) -> None:
    """A finite number (not a bool) for which within(value) holds; `what` names the range in the message."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not within(value):
        raise AnatomyError(f"{name} must be {what}, got {value!r}")


def _check_switch(name: str, value, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, bool):  # a string such as "false" would read as on
        raise AnatomyError(f"{name} must be True or False{' or None' if optional else ''}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "Qwen/Qwen3-0.6B"  # hub id, preset name or checkpoint directory
    weights: str = "auto"  # "auto" (a local checkpoint if there is one, else synthetic), "synthetic" or a directory
    device: str | None = None  # "cpu", "cuda", "cuda:N"; None: a CUDA GPU if there is one
    dtype: str | None = None  # activations' and unquantized weights' dtype; None: the model's (bfloat16 for Qwen3)
    seed: int = 0  # synthetic weights' seed, and the sampler's default generator
    quantization: str | None = None  # "fp8": linear layers' weights in fp8 e4m3 (W8A8); None: as the checkpoint
    # lm_head in fp8 too (per output channel, quantized at load): with quantization="fp8" only. Off by default, as in
    # vLLM: it is the largest single matrix a decode step reads, and the one whose error reaches the logits directly.
    quantize_lm_head: bool = False
    kv_cache_dtype: str = "auto"
    kv_cache_tokens: int | None = None  # the KV pool's size; None: from free memory (GPU) or 1 GiB (host)
    gpu_memory_utilization: float = 0.9  # the fraction of GPU memory the engine may use, the KV pool taking the rest
    max_model_len: int | None = None  # context limit per request; None: the model's
    max_num_seqs: int = 64  # most sequences in one step
    max_num_batched_tokens: int | None = None  # tokens forwarded per step; None: min(max_model_len, 8192)
    block_size: int = 16  # KV cache tokens per block
    # The longest prompt start-up prepares for: whole prompts up to it replay captured CUDA graphs
    # (graphs.PREFILL_GRAPH_TOKENS at most), and cuDNN's attention plans are built up to it. None: every length
    # the step budget allows. A single call sets its own prompt's length, so that start-up prepares no more.
    prefill_graph_tokens: int | None = None
    # The fast path: the fused Triton/CUDA kernels (None: on where there is a CUDA GPU and Triton) and, with them,
    # CUDA graphs, programmatic dependent launch, the streaming batch-1 GEMV (each still subject to the device).
    fast_path: bool | None = None
    cuda_graphs: bool = True
    pdl: bool = True
    stream_gemv: bool = True
    mixed_steps: bool = False  # decode the running sequences in every step, prompts filling the rest
    # Prefill first, TGI's rule: while sequences decode, waiting prompts wait until this many decode steps have run
    # since prompts last joined (so that more join in one prefill step), or until they number waiting_served_ratio
    # times the running sequences (None: TGI's 1.2). 0: prompts are prefilled in the step after they arrive.
    max_waiting_tokens: int = 0
    waiting_served_ratio: float | None = None
    lookahead: bool | None = None  # launch step n+1 (a prefill or decode) before reading step n's tokens; None: on CUDA

    def __post_init__(self) -> None:
        for name in ("model", "weights"):
            value = getattr(self, name)
            if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
                raise AnatomyError(f"{name} must be a non-empty string, got {value!r}")
        for name in ("device", "dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise AnatomyError(f"{name} must be a string or None, got {value!r}")
        _check_int("seed", self.seed, -(1 << 63), INT64_MAX)
        if self.quantization not in (None, *QUANTIZATIONS):
            raise AnatomyError(f"quantization {self.quantization!r} is not supported; use one of: "
                               f"{', '.join(QUANTIZATIONS)} (or leave it unset for the checkpoint's own precision)")
        _check_switch("quantize_lm_head", self.quantize_lm_head)
        if self.quantize_lm_head and self.quantization != "fp8":
            raise AnatomyError("quantize_lm_head (--quantize-lm-head) needs quantization='fp8' (--quantization "
                               "fp8): lm_head is quantized with the linear layers")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise AnatomyError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; use one of: "
                               f"{', '.join(KV_CACHE_DTYPES)}")
        _check_int("kv_cache_tokens", self.kv_cache_tokens, 1, optional=True)
        _check_real("gpu_memory_utilization", self.gpu_memory_utilization, "a fraction in (0, 1]", lambda v: 0 < v <= 1)
        _check_int("max_model_len", self.max_model_len, 1, optional=True)
        _check_int("max_num_seqs", self.max_num_seqs, 1, 65536)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        _check_int("block_size", self.block_size, 1, 1024)
        _check_int("prefill_graph_tokens", self.prefill_graph_tokens, 0, optional=True)
        if self.block_size & (self.block_size - 1):
            raise AnatomyError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("cuda_graphs", "pdl", "stream_gemv", "mixed_steps"):
            _check_switch(name, getattr(self, name))
        _check_int("max_waiting_tokens", self.max_waiting_tokens, 0, 1_000_000)
        _check_real("waiting_served_ratio", self.waiting_served_ratio, "a finite number >= 0", lambda v: v >= 0,
                    optional=True)
        if self.waiting_served_ratio is not None and not self.max_waiting_tokens:
            raise AnatomyError("waiting_served_ratio (--waiting-served-ratio) ends the wait that max_waiting_tokens "
                               "(--max-waiting-tokens) sets: give that too")
        if self.max_waiting_tokens and self.mixed_steps:
            raise AnatomyError("max_waiting_tokens (--max-waiting-tokens) holds prompts back from prefill-first "
                               "steps; mixed steps (--mixed-steps) admit them into every decode step: use one")
        for name in ("fast_path", "lookahead"):
            _check_switch(name, getattr(self, name), optional=True)

    @property
    def kv_cache_fp8(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_settings(cls, **settings) -> "EngineConfig":
        """An EngineConfig from keyword settings, refusing names it does not have (a typo must not be ignored)."""
        unknown = sorted(set(settings) - set(cls.setting_names()))
        if unknown:
            raise AnatomyError(f"unknown engine setting(s) {', '.join(unknown)}; the settings are: "
                               f"{', '.join(cls.setting_names())}")
        return cls(**{k: str(v) if isinstance(v, os.PathLike) else v for k, v in settings.items()})

    def describe(self) -> dict:
        return asdict(self)
