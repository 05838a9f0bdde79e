"""Predictions for any Qwen3 size on any GPU of the table: the cost model (FLOPs and bytes of each step) turned
into time by efficiencies measured on this machine, the engine's scheduler replayed on integers, and the
memory a GPU leaves for the KV cache.

A step's time is modelled per kind of work, each at a fraction ("efficiency") of the GPU's datasheet rates:
- decode: t0 + t_seq x batch + smoothmax(weight bytes / (bw x BW), linear FLOPs / (mm x FLOPS))
          + (KV and activation bytes) / (kv x BW)
- prefill: t0 + smoothmax(bytes / (bw x BW), linear FLOPs / (mm x FLOPS)) + attention FLOPs / (attn x FLOPS)
The smooth maximum (the p-norm of the two times) lets a step near the ridge cost more than either limit alone,
as measured steps do. The efficiencies come from a sweep's steps (least squares on log time, drawn towards the
defaults where the points do not tell) or, without one, from the defaults and this machine's calibrated ceilings.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, fields, replace

import torch

from ..engine.graphs import BATCH_PREFILL_TOKENS, PREFILL_GRAPH_TOKENS, batch_graph_size
from ..engine.scheduler import CHUNK_ALIGN
from ..errors import AnatomyError
from ..models.config import ModelConfig
from ..probe.cost import (DEFAULT_SHAPES, KernelShapes, decode_cost, layer_linear_params, layer_norm_params,
                          prefill_cost)
from ..gpus import Gpu
from .grid import Precision

SMOOTH_P = 3.0  # the p of the smooth maximum; 3 puts a step at the ridge 26% above either limit
PRIOR_WEIGHT = 0.01  # per parameter, on (log efficiency - log default)^2: the defaults hold where the data is mute
GIB = 1 << 30

# Default efficiencies, each as (fraction of the calibrated ceiling the engine reaches, which ceiling), measured with
# Qwen3-8B in bf16 on the H200 (docs/sweep.md shows where each comes from). Step overheads: host work per step and
# per sequence that the device waits for.
DEFAULT_FRACTIONS = {
    "decode_bw": (0.89, "read"), "decode_bw_gemv": (0.80, "read"), "decode_bw_gemm": (0.75, "read"),
    "decode_mm": (0.81, "matmul"), "decode_kv": (0.76, "read"),
    "prefill_bw": (0.59, "read"), "prefill_mm": (0.80, "matmul"), "prefill_attn": (0.77, "matmul"),
}
DEFAULT_OVERHEADS_MS = {"decode_t0_ms": 0.002, "decode_seq_ms": 0.0001, "prefill_t0_ms": 0.13, "prefill_eager_ms": 1.0}
# Calibrated ceilings as fractions of the datasheet where this machine has none cached: the H200's calibration
# (read 4459 of 4800 GB/s, matmul 790 of 989 TFLOP/s).
DEFAULT_CEILING_FRACTIONS = {"read": 0.93, "matmul": 0.80}
# The CUDA context and libraries beside the engine's tensors (the memory census's context_and_other on the H200).
DEFAULT_RUNTIME_BYTES = 0.82e9
DECODE = ("decode_bw", "decode_bw_gemv", "decode_bw_gemm", "decode_mm", "decode_kv", "decode_t0_ms", "decode_seq_ms")
# A decode step reads its weights through one of three kernels, each with its own efficiency (decode_bw,
# decode_bw_gemv, decode_bw_gemm): one sequence the streaming GEMV, up to GEMV_ROWS the GEMV kernel
# (kernels/gemv.py and fp8_gemv.py: MAX_ROWS), more a GEMM (cuBLAS). The GEMV kernels read their weights at
# another rate than the streaming kernel (on the H200 the bf16 GEMV's qkv_proj at 3.4 TB/s, the streaming one's
# at 4.4; benchmarks/README.md): one efficiency for all could not predict both.
GEMV_ROWS = 16
PREFILL = ("prefill_bw", "prefill_mm", "prefill_attn", "prefill_t0_ms", "prefill_eager_ms")
# A rate of FLOPs cannot pass the datasheet's; a rate of bytes can, where L2 serves what the model counts as read
BOUNDS = {"decode_t0_ms": (1e-4, 1e3), "decode_seq_ms": (1e-6, 10.0), "prefill_t0_ms": (1e-4, 1e3),
          "prefill_eager_ms": (1e-4, 1e3),
          "decode_mm": (0.01, 1.0), "prefill_mm": (0.01, 1.0), "prefill_attn": (0.01, 1.0)}
EFFICIENCY_BOUNDS = (0.01, 1.5)


@dataclass(frozen=True)
class Hardware:
    """The rates efficiencies are fractions of: a GPU's datasheet, or (no datasheet) the measured ceilings."""

    name: str
    gbps: float
    bf16_tflops: float
    fp8_tflops: float | None
    basis: str

    @classmethod
    def of(cls, gpu: Gpu) -> "Hardware":
        return cls(gpu.name, gpu.memory_gbps, gpu.bf16_tflops, gpu.fp8_tflops, f"the {gpu.name} datasheet")

    def linear_tflops(self, quantization: str | None) -> float:
        if quantization == "fp8":
            if self.fp8_tflops is None:
                raise AnatomyError(f"{self.name} has no fp8 tensor cores: use --quantization bf16")
            return self.fp8_tflops
        return self.bf16_tflops


@dataclass(frozen=True)
class Efficiencies:
    decode_bw: float  # weights, one sequence
    decode_bw_gemv: float  # weights, 2..GEMV_ROWS sequences
    decode_bw_gemm: float  # weights, more
    decode_mm: float
    decode_kv: float
    decode_t0_ms: float
    decode_seq_ms: float
    prefill_bw: float
    prefill_mm: float
    prefill_attn: float
    prefill_t0_ms: float
    prefill_eager_ms: float  # a prefill step launched kernel by kernel, beyond one replaying a CUDA graph
    source: str = ""

    def values(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "source"}


def default_efficiencies(ceilings=None, ceiling_fractions: dict | None = None) -> Efficiencies:
    """The defaults as fractions of the datasheet: the engine's fraction of each calibrated ceiling, times that
    ceiling's fraction of the datasheet on this machine (its cached calibration) or on the H200 (none cached).
    `ceiling_fractions` overrides the latter ({"read": 1, "matmul": 1}: fractions of the ceilings themselves)."""
    ratio, where = dict(DEFAULT_CEILING_FRACTIONS), "the H200's calibration (none cached here)"
    if ceiling_fractions is not None:
        ratio, where = dict(ceiling_fractions), "the ceilings themselves"
    elif ceilings is not None and ceilings.read_gbps and ceilings.datasheet_gbps and ceilings.matmul_tflops \
            and ceilings.datasheet_tflops:
        ratio = {"read": ceilings.read_gbps / ceilings.datasheet_gbps,
                 "matmul": ceilings.matmul_tflops / ceilings.datasheet_tflops}
        where = f"this machine's calibrated ceilings ({ceilings.device}, {ceilings.measured_at})"
    values = {name: fraction * ratio[ceiling] for name, (fraction, ceiling) in DEFAULT_FRACTIONS.items()}
    return Efficiencies(**values, **DEFAULT_OVERHEADS_MS,
                        source=f"stated defaults (the engine's fractions of its ceilings) x ceilings/datasheet from "
                               f"{where}: read {ratio['read']:.2f}, matmul {ratio['matmul']:.2f}")


# ---------------------------------------------------------------------------------------------------------------
# Costs at a precision
# ---------------------------------------------------------------------------------------------------------------


def precision_shapes(precision: Precision) -> KernelShapes:
    """The cost model's kernel shapes at `precision`: fp8 weights read a byte per linear-layer parameter and a
    float32 scale per output row (norms, embedding and lm_head stay in the model dtype), their products W8A8 as on
    the H200, an fp8 KV cache a byte per element, and with both the prefill attention of long prompts in fp8 (as on
    the H200 with cuDNN's fp8 SDPA): what an engine of that precision's plan gives the cost model
    (probe.cost.device_shapes)."""
    fp8, fp8_kv = precision.quantization == "fp8", precision.kv_cache_dtype != "auto"
    return replace(DEFAULT_SHAPES, weight_size=1 if fp8 else 0, weight_row_scale_bytes=4 if fp8 else 0, w8a8=fp8,
                   kv_size=1 if fp8_kv else 0, fp8_prefill_attention=fp8 and fp8_kv)


def weight_bytes(config: ModelConfig, dtype: torch.dtype, precision: Precision) -> int:
    """All weights resident on the device: embedding, layers, final norm, lm_head (none when tied)."""
    size = dtype.itemsize
    linear_size = 1 if precision.quantization == "fp8" else size
    layers = config.num_hidden_layers * (layer_linear_params(config) * linear_size + layer_norm_params(config) * size)
    embedding = config.vocab_size * config.hidden_size * size
    head = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size * size
    return layers + embedding + head + config.hidden_size * size


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, precision: Precision) -> int:
    kv_dtype = torch.float8_e4m3fn if precision.kv_cache_dtype == "fp8" else dtype
    return config.kv_bytes_per_token(kv_dtype)


# ---------------------------------------------------------------------------------------------------------------
# Step models
# ---------------------------------------------------------------------------------------------------------------


def _part(parts: dict, name: str, key: str) -> float:
    return parts.get(name, {}).get(key, 0.0)


def decode_features(parts: dict, batch: float, hw: Hardware, quantization: str | None) -> tuple[float, ...]:
    """(weights at full bandwidth, linear FLOPs at full rate, KV and activations at full bandwidth, batch), ms."""
    per_ms = hw.gbps * 1e6
    weights = _part(parts, "linear", "bytes") + _part(parts, "lm_head", "bytes") + _part(parts, "embedding", "bytes")
    compute = (_part(parts, "linear", "flops") / (hw.linear_tflops(quantization) * 1e9)
               + _part(parts, "lm_head", "flops") / (hw.bf16_tflops * 1e9))
    other = _part(parts, "kv_read", "bytes") + _part(parts, "kv_write", "bytes") + _part(parts, "activations", "bytes")
    return weights / per_ms, compute, other / per_ms, batch


def prefill_features(parts: dict, hw: Hardware, quantization: str | None, eager: bool) -> tuple[float, ...]:
    """(all bytes at full bandwidth, linear FLOPs at full rate, attention FLOPs at full rate, ms; 1 for a step
    launched kernel by kernel, 0 for one that replays a CUDA graph: see eager_prefill)."""
    total_bytes = sum(p.get("bytes", 0.0) for p in parts.values())
    compute = (_part(parts, "linear", "flops") / (hw.linear_tflops(quantization) * 1e9)
               + _part(parts, "lm_head", "flops") / (hw.bf16_tflops * 1e9))
    return (total_bytes / (hw.gbps * 1e6), compute, _part(parts, "attention", "flops") / (hw.bf16_tflops * 1e9),
            float(eager))


def eager_prefill(seqs: int, tokens: int, cached: int = 0) -> bool:
    """Whether the engine runs a prefill step eagerly: it replays a captured graph for one fresh prompt of up to
    PREFILL_GRAPH_TOKENS, or for 2-64 fresh prompts that fit a batch-prefill graph (engine/graphs.py), not for
    others. Eager, the host's launches can outlast a short step's device work (the measured difference:
    docs/sweep.md)."""
    if cached > 0 or tokens > PREFILL_GRAPH_TOKENS:
        return True
    return seqs > 1 and batch_graph_size(seqs, tokens, BATCH_PREFILL_TOKENS, seqs) is None


def _smax(a, b):
    return (a ** SMOOTH_P + b ** SMOOTH_P) ** (1 / SMOOTH_P)


def _weights_bw(batch, e: dict):
    """The weights' efficiency of a decode step of `batch` sequences (a tensor of batches, or a number)."""
    if isinstance(batch, torch.Tensor):
        return torch.where(batch <= 1, e["decode_bw"],
                           torch.where(batch <= GEMV_ROWS, e["decode_bw_gemv"], e["decode_bw_gemm"]))
    return e["decode_bw"] if batch <= 1 else e["decode_bw_gemv"] if batch <= GEMV_ROWS else e["decode_bw_gemm"]


def decode_time(x, e: dict):
    """Decode step ms from decode_features (columns of a tensor, or floats) and efficiencies."""
    return (e["decode_t0_ms"] + e["decode_seq_ms"] * x[3] + _smax(x[0] / _weights_bw(x[3], e), x[1] / e["decode_mm"])
            + x[2] / e["decode_kv"])


def prefill_time(x, e: dict):
    return (e["prefill_t0_ms"] + e["prefill_eager_ms"] * x[3] + _smax(x[0] / e["prefill_bw"], x[1] / e["prefill_mm"])
            + x[2] / e["prefill_attn"])


# ---------------------------------------------------------------------------------------------------------------
# Fitting
# ---------------------------------------------------------------------------------------------------------------


def _bounds(name: str) -> tuple[float, float]:
    return BOUNDS.get(name, EFFICIENCY_BOUNDS)


def _fit(rows: list[tuple], measured: list[float], model, names: tuple[str, ...], prior: dict, start: dict) -> dict:
    """Least squares on log time: minimise sum (log predicted - log measured)^2 + PRIOR_WEIGHT x
    sum (log theta / prior)^2 over the log of the parameters `names` (L-BFGS; each kept within its bounds)."""
    theta = dict(start)
    if not rows:
        return theta
    x = torch.tensor(rows, dtype=torch.float64).T  # [features, N]
    y = torch.log(torch.tensor(measured, dtype=torch.float64))
    log_prior = torch.log(torch.tensor([prior[k] for k in names], dtype=torch.float64))
    low = torch.log(torch.tensor([_bounds(k)[0] for k in names], dtype=torch.float64))
    high = torch.log(torch.tensor([_bounds(k)[1] for k in names], dtype=torch.float64))
    z = torch.log(torch.tensor([theta[k] for k in names], dtype=torch.float64)).requires_grad_(True)
    optimizer = torch.optim.LBFGS([z], lr=1.0, max_iter=300, tolerance_grad=1e-10, tolerance_change=1e-12,
                                  line_search_fn="strong_wolfe")

    def objective():
        optimizer.zero_grad()
        zc = torch.maximum(torch.minimum(z, high), low)
        values = {**{k: torch.tensor(v, dtype=torch.float64) for k, v in theta.items()},
                  **{k: torch.exp(zc[i]) for i, k in enumerate(names)}}
        loss = ((torch.log(model(x, values)) - y) ** 2).sum() + PRIOR_WEIGHT * ((zc - log_prior) ** 2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(objective)
    fitted = torch.exp(torch.maximum(torch.minimum(z.detach(), high), low))
    return {**theta, **{k: float(fitted[i]) for i, k in enumerate(names)}}


def training_rows(records: list[dict], hw: Hardware, quantization: str | None):
    """The measured steps of `records` as model features: each prefill step, and each point's mean decode step.
    A prefill step's time is its device time where there is one: the host runs ahead of the device through a
    prompt's chunks, so their wall times are launch gaps until the one that waits for all of them."""
    p_rows, p_ms, d_rows, d_ms = [], [], [], []
    for r in records:
        steps = r.get("steps") or {}
        for s in steps.get("prefill", []):
            # a recorded step names its sequences and tokens, not what was cached: a chunk after the first is
            # longer than a graph's prompt in any sweep whose budget is the default 8192
            p_rows.append(prefill_features(s["parts"], hw, quantization, eager_prefill(s["seqs"], s["tokens"])))
            p_ms.append(s.get("device_ms") or s["wall_ms"])
        d = steps.get("decode")
        if d and d["steps"]:
            d_rows.append(decode_features(d["parts"], d["batch"], hw, quantization))
            d_ms.append(d["wall_ms"] / d["steps"])
    return p_rows, p_ms, d_rows, d_ms


def fit_efficiencies(records: list[dict], hw: Hardware, quantization: str | None, prior: Efficiencies,
                     start: Efficiencies | None = None) -> Efficiencies:
    """Efficiencies fitted to the steps of sweep records of one precision (ok points only). The search starts
    from `start` (default: the prior); the minimum it converges to does not depend on it, only the time taken."""
    ok = [r for r in records if r.get("status") == "ok"]
    p_rows, p_ms, d_rows, d_ms = training_rows(ok, hw, quantization)
    theta = _fit(d_rows, d_ms, decode_time, DECODE, prior.values(), (start or prior).values())
    theta = _fit(p_rows, p_ms, prefill_time, PREFILL, prior.values(), theta)
    return Efficiencies(**theta, source=f"fitted to {len(p_rows)} prefill steps and {len(d_rows)} decode points")


# ---------------------------------------------------------------------------------------------------------------
# The scheduler replayed, and a point predicted
# ---------------------------------------------------------------------------------------------------------------


def prefill_schedule(batch: int, prompt: int, budget: int, max_num_seqs: int) -> list[tuple[list[tuple[int, int]], int]]:
    """The prefill steps the engine's prefill-first scheduler runs for `batch` prompts of `prompt` tokens queued
    together: per step, each sequence's (new tokens, cached prefix) and how many sequences get their first
    token. Whole prompts while they fit the token budget; a prompt longer than the whole budget in aligned
    chunks, the running chunked prompts first."""
    align = max(1, min(CHUNK_ALIGN, budget - max_num_seqs))
    cached = [0] * batch
    waiting, chunked, admitted = list(range(batch)), [], 0
    steps = []
    while waiting or chunked:
        left, seqs, done = budget, [], 0
        for i in list(chunked):
            remaining = prompt - cached[i]
            take = remaining if remaining <= left else left // align * align
            if take <= 0:
                continue
            seqs.append((take, cached[i]))
            cached[i] += take
            left -= take
            if cached[i] == prompt:
                chunked.remove(i)
                done += 1
        while waiting and left > 0 and admitted < max_num_seqs:
            take = prompt if prompt <= left else (left // align * align if prompt > budget else 0)
            if take <= 0:
                break
            i = waiting.pop(0)
            admitted += 1
            seqs.append((take, 0))
            cached[i] = take
            left -= take
            if take == prompt:
                done += 1
            else:
                chunked.append(i)
        if not seqs:
            raise AnatomyError(f"a token budget of {budget} cannot schedule prompts of {prompt} tokens")
        steps.append((seqs, done))
    return steps


@dataclass(frozen=True)
class Setup:
    """What a prediction needs besides the point: the model, precision, GPU rates, efficiencies and the
    engine's batching limits."""

    config: ModelConfig
    dtype: torch.dtype
    precision: Precision
    hw: Hardware
    eff: Efficiencies
    budget: int  # max_num_batched_tokens
    max_num_seqs: int

    def prefill_step_ms(self, seqs: list[tuple[int, int]]) -> float:
        cost = prefill_cost(self.config, self.dtype, seqs, shapes=precision_shapes(self.precision))
        eager = eager_prefill(len(seqs), sum(n for n, _ in seqs), sum(cached for _, cached in seqs))
        return prefill_time(prefill_features(cost.parts, self.hw, self.precision.quantization, eager),
                            self.eff.values())

    def decode_step_ms(self, batch: int, context: float) -> float:
        cost = decode_cost(self.config, self.dtype, [context] * batch, shapes=precision_shapes(self.precision))
        x = decode_features(cost.parts, batch, self.hw, self.precision.quantization)
        return decode_time(x, self.eff.values())


def predict_point(s: Setup, batch: int, prompt: int, output: int) -> dict:
    """TTFT (median and last), TPOT (median over sequences, vLLM's definition) and throughput of `batch`
    prompts queued together, each generating `output` tokens, as the sweep measures a point."""
    t, first = 0.0, []
    for seqs, done in prefill_schedule(batch, prompt, s.budget, max(s.max_num_seqs, 1)):
        t += s.prefill_step_ms(seqs)
        first += [t] * done
    prefill_ms = t
    step_ms = s.decode_step_ms(batch, prompt + output / 2) if output > 1 else 0.0
    decode_ms = step_ms * (output - 1)
    elapsed_ms = prefill_ms + decode_ms
    tpots = [(prefill_ms - f + decode_ms) / (output - 1) for f in first] if output > 1 else []
    return {"ttft_ms": statistics.median(first), "ttft_ms_max": max(first), "prefill_ms": prefill_ms,
            "tpot_ms": statistics.median(tpots) if tpots else None, "decode_step_ms": step_ms,
            "output_tokens_per_s": batch * output / elapsed_ms * 1e3,
            "total_tokens_per_s": batch * (prompt + output) / elapsed_ms * 1e3}


def roofline_ridge_batch(config: ModelConfig, dtype: torch.dtype, precision: Precision, context: float,
                         gbps: float, tflops: float, most: int = 1 << 16) -> float | None:
    """The batch at which a decode step's FLOPs at `tflops` take as long as its bytes at `gbps`: the roofline's
    ridge, in sequences (fractional, between the two whole batches around it). The bytes do not grow quite linearly
    with the batch (the decode attention's splits, and so its partials, depend on it), so the crossing is searched
    for: doubling, then halving the interval. None when the FLOPs do not catch up by `most` sequences."""
    def gap(b: int) -> float:
        cost = decode_cost(config, dtype, [context] * b, shapes=precision_shapes(precision))
        return cost.flops / (tflops * 1e12) - cost.bytes / (gbps * 1e9)

    if gap(1) >= 0:
        return 1.0
    low, high = 1, 2
    while gap(high) < 0:
        if high >= most:
            return None
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if gap(mid) < 0 else (low, mid)
    g_low, g_high = gap(low), gap(high)
    return low + -g_low / (g_high - g_low)


# ---------------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------------


def activation_bytes(config: ModelConfig, dtype: torch.dtype, tokens: int) -> int:
    """The largest layer's live activations in a prefill step of `tokens` tokens (an estimate of what the engine
    measures at start-up): the residual stream and the normed input, with the MLP's gate_up output and its
    SiLU x up product, or attention's q, k, v and output, whichever is larger; plus logits of one row."""
    mlp = 2 * config.hidden_size + 3 * config.intermediate_size
    attention = 2 * config.hidden_size + 2 * config.q_size + 2 * config.kv_size
    return (tokens * max(mlp, attention) + config.vocab_size) * dtype.itemsize


def capacity(config: ModelConfig, dtype: torch.dtype, precision: Precision, memory_bytes: int, context: int, *,
             gpu_memory_utilization: float = 0.9, prefill_tokens: int = 8192, block_size: int = 16,
             runtime_bytes: float = DEFAULT_RUNTIME_BYTES) -> dict:
    """How many sequences of `context` tokens fit, the way the engine sizes its KV pool: of the memory it may use
    (utilization x total), the weights, the CUDA runtime and a prefill step's activations come first, and the
    pool takes the rest, in blocks of `block_size` tokens per sequence."""
    usable = gpu_memory_utilization * memory_bytes
    weights = weight_bytes(config, dtype, precision)
    activations = activation_bytes(config, dtype, min(prefill_tokens, context))
    kv_budget = usable - weights - runtime_bytes - activations
    per_token = kv_bytes_per_token(config, dtype, precision)
    per_sequence = -(-context // block_size) * block_size * per_token
    fits = max(0, int(kv_budget // per_sequence)) if kv_budget > 0 else 0
    return {"memory_bytes": memory_bytes, "gpu_memory_utilization": gpu_memory_utilization, "usable_bytes": usable,
            "weights_bytes": weights, "runtime_bytes": runtime_bytes, "activations_bytes": activations,
            "kv_budget_bytes": kv_budget, "kv_bytes_per_token": per_token, "kv_bytes_per_sequence": per_sequence,
            "block_size": block_size, "context": context, "max_concurrent_sequences": fits,
            "fits": fits >= 1}


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured - 1 (None when either is missing)."""
    if predicted is None or measured is None or measured <= 0 or not math.isfinite(predicted):
        return None
    return predicted / measured - 1
