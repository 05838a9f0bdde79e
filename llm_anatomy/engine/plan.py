"""ExecutionPlan: how one engine runs its model on its device, chosen once at start-up and passed down.

The model and the kernels take their behaviour from the plan they are given (gpt-fast's way), never from
module state: two engines in one process (bf16 and fp8, or graphs and no graphs) each run their own plan.
`choose_plan` turns an EngineConfig and a device into a plan; start-up then tunes the GEMV tiles (tuning.py)
and freezes them into the plan the engine keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch

from ..errors import AnatomyError
from ..kernels import use_kernels
from ..models.attention import FP8_PREFILL_MIN_TOKENS
from .config import EngineConfig


@dataclass(frozen=True)
class DecodeAttentionPlan:
    """How the fast path's paged decode attention splits a sequence's context (the split kernel, then a merge).

    A single sequence splits its context over many programs per KV head, enough to read a long context at full
    bandwidth; at short contexts most of them would find nothing to do and still cost the step, as would merging
    their partials, so batch 1 runs a second configuration up to `short_context`: `short_splits` splits of
    `short_block_n`-token tiles. Beyond it batch 1 takes `long_splits` splits (about two programs per
    multiprocessor on an H100/H200); batches take the kernel's default splits (None) over `batch_block_n`-token
    tiles. An fp8 cache is read by the CUDA kernel (`fp8_cuda`, kernels/fp8_decode_attention.py) where the
    device has one, except at batch 1's short contexts (where the Triton kernel makes the shorter step, both
    launched early): its splits are a warp each, so at batch 1 it takes its own default (a warp-sized count, not
    long_splits). With `short_rope_attention`, batch 1's short contexts (the short CUDA graph) take the QK-norm,
    RoPE and the new token's store, the split attention and the merge in one kernel
    (decode_attention.rope_decode_attention) rather than three. The figures that chose these are in
    benchmarks/README.md."""
    short_context: int = 2048
    short_splits: int = 16
    short_block_n: int = 64
    long_splits: int = 48
    batch_block_n: int = 64
    fp8_cuda: bool = False
    short_rope_attention: bool = True

    def is_short(self, batch_size: int, longest_context: int) -> bool:
        return batch_size == 1 and longest_context <= self.short_context

    def rope_attention(self, batch_size: int, longest_context: int) -> bool:
        """Whether a decode step's QK-norm, RoPE, store and attention run as one kernel (short_rope_attention)."""
        return self.short_rope_attention and self.is_short(batch_size, longest_context)

    def uses_fp8_cuda(self, batch_size: int, longest_context: int) -> bool:
        """Whether a decode step's attention over an fp8 cache runs the CUDA kernel (else Triton's)."""
        return self.fp8_cuda and not self.is_short(batch_size, longest_context)

    def for_step(self, batch_size: int, longest_context: int) -> tuple[int | None, int | None]:
        """(splits, tile) of a decode step's attention, None for the kernel's defaults."""
        if self.is_short(batch_size, longest_context):
            return self.short_splits, self.short_block_n
        if batch_size == 1:
            return (None if self.fp8_cuda else self.long_splits), None
        return None, self.batch_block_n


@dataclass(frozen=True)
class ExecutionPlan:
    """Which path each part of a step takes. All False is the plain PyTorch reference path (CPU, tests)."""
    kernels: bool = False  # the fused Triton/CUDA kernels (the fast path); False: the PyTorch reference path
    cuda_graphs: bool = False  # decode steps and short whole prompts replay CUDA graphs (graphs.py)
    pdl: bool = False  # programmatic dependent launch: each kernel may launch while the one before drains
    stream_gemv: bool = False  # batch-1 bf16 GEMVs in the streaming CUDA kernel (kernels/stream_gemv.py)
    # At batch 1 the streaming GEMV after a norm (qkv, gate_up) computes the residual add and the norm itself,
    # which takes the norm's kernel and one wait out of the step's chain of dependent kernels.
    norm_in_gemv: bool = False
    # Prefill's products that feed the residual stream (o_proj, down_proj) add into it in cuBLAS's epilogue
    # (beta = 1), so that the norm after them reads one tensor and writes one instead of two of each.
    residual_in_gemm: bool = False
    lookahead: bool = False  # launch step n+1 (a prefill or decode) before reading step n's tokens back
    # Batch 1's decode graphs end in the greedy kernel (kernels/greedy.py): a greedy step's token picked and handed
    # to the host inside the graph, and the next step's inputs advanced on the device, so that between two greedy
    # steps nothing is copied and no kernel is launched from the host.
    greedy_in_graph: bool = False
    # W8A8's per-token quantization of SiLU(gate) * up for the down projection (more than a batch-1 step's rows) by
    # the CUDA kernel whose row a thread-block cluster shares (kernels/fp8_quant_cuda.py) instead of Triton's one
    # program a row: the same bits.
    cuda_gated_quant: bool = False
    # With fp8 weights and KV cache, a fresh prompt's prefill attention, alone in its step and of
    # attention.FP8_PREFILL_MIN_TOKENS tokens or more, in cuDNN's fp8 SDPA (kernels/fp8_prefill_attention.py): Q, K
    # and V as the cache stores them, the output in fp8 rows for o_proj's W8A8 product.
    fp8_prefill_attention: bool = False
    # W8A8 products through torch._scaled_mm sum in the tensor cores' own fp8 accumulator (use_fast_accum), without
    # cuBLAS promoting partial sums to float32 as it goes, as vLLM's CUTLASS fp8 kernels for Hopper do: a few bf16
    # roundings of error against float32 sums, far below the fp8 weights' own, for shorter GEMMs (the figures:
    # benchmarks/README.md).
    fp8_fast_accum: bool = False
    gemv_tiles: Mapping = field(default_factory=lambda: MappingProxyType({}))  # tile_key -> Tile (tuning.py)
    decode_attention: DecodeAttentionPlan = DecodeAttentionPlan()
    weight_dtype: str = "bfloat16"  # the linear layers' weights: the model dtype, or "float8_e4m3fn"
    head_dtype: str = "bfloat16"  # lm_head's weights: the model dtype, or "float8_e4m3fn" (quantize_lm_head)
    kv_cache_dtype: str = "bfloat16"  # what the KV pool stores

    def eager(self) -> "ExecutionPlan":
        """The same kernels launched one by one as the host issues them: no graphs, no early launch. For
        profilers, where each kernel's span must be its own (with early launch it would include the wait)."""
        return replace(self, cuda_graphs=False, pdl=False)

    def with_tiles(self, tiles: Mapping) -> "ExecutionPlan":
        return replace(self, gemv_tiles=MappingProxyType(dict(tiles)))

    def gemv_tile(self, key: tuple):
        """The Triton GEMV's tile for a shape: the tuned one, or the default for the weight's element size."""
        from ..kernels.gemv import DEFAULT_TILE

        return self.gemv_tiles.get(key) or DEFAULT_TILE[4 if key[3] == "float32" else 2]

    def streams(self, rows: int, k: int, dtype: torch.dtype) -> bool:
        """Whether a GEMV over `rows` rows and `k` columns runs the streaming kernel (if its weight fits):
        the kernels that feed one let it launch before they wait (kernels/pdl.py)."""
        if not self.stream_gemv:
            return False
        from ..kernels.stream_gemv import eligible

        return eligible(rows, k, dtype)

    def describe(self) -> dict:
        return {"kernels": self.kernels, "cuda_graphs": self.cuda_graphs, "pdl": self.pdl,
                "stream_gemv": self.stream_gemv, "norm_in_gemv": self.norm_in_gemv,
                "residual_in_gemm": self.residual_in_gemm, "lookahead": self.lookahead,
                "greedy_in_graph": self.greedy_in_graph,
                "cuda_gated_quant": self.cuda_gated_quant, "fp8_fast_accum": self.fp8_fast_accum,
                "fp8_prefill_attention": self.fp8_prefill_attention,
                **({"fp8_prefill_min_tokens": FP8_PREFILL_MIN_TOKENS} if self.fp8_prefill_attention else {}),
                "weight_dtype": self.weight_dtype, "head_dtype": self.head_dtype, "kv_cache_dtype": self.kv_cache_dtype,
                "gemv_tiles": {"x".join(map(str, k)): str(t) for k, t in self.gemv_tiles.items()},
                "decode_attention": vars(self.decode_attention).copy()}


def choose_plan(config: EngineConfig, device: torch.device, weight_dtype: str, kv_cache_dtype: str,
                head_dtype: str = "bfloat16", attention_heads: tuple[int, int, int] | None = None,
                w8a8_gemms: bool = False) -> ExecutionPlan:
    """The plan this device can run for this config (before the GEMV tiles are tuned). A feature the config
    asks for stays off where the device cannot do it (PDL before Hopper, no NVRTC for the streaming GEMV).
    attention_heads: the model's (heads, kv_heads, head_dim), which the fp8 prefill attention is checked for;
    w8a8_gemms: whether any of its fp8 layers multiplies through torch._scaled_mm (models/quant.w8a8_gemms)."""
    cuda = device.type == "cuda"
    kernels = use_kernels(device) and cuda if config.fast_path is None else config.fast_path
    if kernels and not use_kernels(device):
        raise AnatomyError("fast_path needs Triton and a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
    graphs = config.cuda_graphs and kernels and cuda  # graphs replay the fused-kernel path
    pdl = False
    stream = False
    if graphs and config.pdl:
        from ..kernels.pdl import supported as pdl_supported

        pdl = pdl_supported(device)
    if pdl and config.stream_gemv:  # without PDL nothing overlaps the streaming GEMV's ramp: the Triton GEMV serves
        from ..kernels.stream_gemv import available

        stream = available(device)
    fp8_cuda = fp8_prefill = False
    if kernels and cuda and kv_cache_dtype == "float8_e4m3fn":
        from ..kernels.fp8_decode_attention import available as fp8_attention_available

        fp8_cuda = fp8_attention_available(device)
        if attention_heads is not None and weight_dtype == "float8_e4m3fn":  # its fp8 output is o_proj's W8A8 input
            from ..kernels.fp8_prefill_attention import available as fp8_prefill_available

            fp8_prefill = fp8_prefill_available(device, *attention_heads)
    cuda_gated_quant = fast_accum = False
    if kernels and cuda and weight_dtype == "float8_e4m3fn":
        from ..kernels.fp8_quant_cuda import available as cuda_gated_quant_available

        cuda_gated_quant = cuda_gated_quant_available(device)
        fast_accum = w8a8_gemms
    return ExecutionPlan(kernels=kernels, cuda_graphs=graphs, pdl=pdl, stream_gemv=stream, norm_in_gemv=stream,
                         residual_in_gemm=kernels, lookahead=cuda if config.lookahead is None else config.lookahead,
                         greedy_in_graph=graphs,
                         cuda_gated_quant=cuda_gated_quant, fp8_fast_accum=fast_accum,
                         fp8_prefill_attention=fp8_prefill,
                         decode_attention=DecodeAttentionPlan(fp8_cuda=fp8_cuda),
                         weight_dtype=weight_dtype, head_dtype=head_dtype,
                         kv_cache_dtype=kv_cache_dtype)


REFERENCE_PLAN = ExecutionPlan()  # the PyTorch path, everything off
