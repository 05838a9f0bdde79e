"""`llm-anatomy plan`: what a Qwen3 size would do on a GPU of the table, and what each answer leans on."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import AnatomyError
from ..gpus import Gpu, lookup_gpu
from .grid import KV_CACHE_DTYPES, MAX_BATCH, QUANTIZATIONS, Precision
from .planner import (DEFAULT_RUNTIME_BYTES, GEMV_ROWS, PREFILL_GRAPH_TOKENS, Efficiencies, Hardware, Setup, capacity,
                      default_efficiencies, fit_efficiencies, predict_point)


def load_sweep(directory: Path) -> tuple[dict, list[dict]]:
    """A sweep's meta and records, read only (a torn last line is skipped)."""
    from .run import META_FILE, RESULTS_FILE

    directory = Path(directory)
    try:
        meta = json.loads((directory / META_FILE).read_text())
        lines = (directory / RESULTS_FILE).read_text().split("\n")
    except (OSError, json.JSONDecodeError) as e:
        raise AnatomyError(f"--from-sweep {directory}: not a sweep directory ({e})") from None
    records = []
    for line in lines[:-1]:  # the part after the last newline is a line still being written, or nothing
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise AnatomyError(f"--from-sweep {directory}: {RESULTS_FILE} holds a line that is not JSON") from None
    return meta, records


def _from_sweep(directory: Path, precision: Precision) -> tuple[Efficiencies, list[str], float | None]:
    from .report import sweep_hardware, sweep_prior

    meta, records = load_sweep(directory)
    hw = sweep_hardware(meta)
    device = meta.get("identity", {}).get("device", "?")
    if hw is None or not hw.basis.endswith("datasheet"):
        raise AnatomyError(f"--from-sweep {directory}: it ran on {device}, which has no datasheet entry, so its "
                           f"efficiencies cannot be carried to another GPU")
    ok = [r for r in records if r.get("status") == "ok"]
    mine = [r for r in ok if Precision(r.get("quantization"), r.get("kv_cache_dtype", "auto")) == precision]
    notes = []
    if not mine:
        mine = [r for r in ok if r.get("quantization") is None and r.get("kv_cache_dtype", "auto") == "auto"]
        notes.append(f"the sweep has no {precision.label} points: its bf16 efficiencies are applied to "
                     f"{precision.label}")
    if not mine:
        raise AnatomyError(f"--from-sweep {directory}: no measured point to fit efficiencies to")
    eff = fit_efficiencies(mine, hw, precision.quantization, sweep_prior(meta, hw))
    source = (f"{eff.source} of the sweep in {directory} ({meta['identity']['model']} on {device}), as fractions "
              f"of {hw.basis}")
    memories = [e["memory"] for e in meta.get("engines", {}).values() if e.get("memory")]
    runtime = memories[0]["context_and_other"] if memories else None
    return Efficiencies(**eff.values(), source=source), notes, runtime


def _largest_batch(fits, limit: int) -> int:
    """The largest b in 1..limit with fits(b) (fits is monotone: true up to some b), 0 if none."""
    if limit < 1 or not fits(1):
        return 0
    low, high = 1, limit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _check(name: str, value, low, high=None) -> None:
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value) or value < low or (high is not None and value > high):
        raise AnatomyError(f"{name} must be in {low}..{high}, got {value}" if high is not None
                           else f"{name} must be > 0, got {value}")


def plan(gpu: str, model: str, *, context: int | None = None, batch: int = 1, prompt_tokens: int | None = None,
         quantization: str = "bf16", kv_cache_dtype: str = "auto", tpot_ms: float | None = None,
         ttft_ms: float | None = None, from_sweep: Path | None = None, gpu_memory_utilization: float = 0.9,
         max_num_batched_tokens: int = 8192) -> dict:
    """Predictions for `model` on `gpu`; `assumptions` says what each one leans on. The context defaults to
    4096 tokens (or the model's, if shorter), the prompt to 1024 (or the context, if shorter)."""
    import torch

    from ..hub import resolve
    from ..models.config import ModelConfig, parse_dtype
    from ..probe.cost import kv_formula

    device = lookup_gpu(gpu)
    source = resolve(model)
    config = ModelConfig.from_hf(source.config)
    top = config.max_position_embeddings
    context = min(4096, top) if context is None else context
    prompt_tokens = min(1024, context) if prompt_tokens is None else prompt_tokens
    for q, table, flag in ((quantization, QUANTIZATIONS, "--quantization"),
                           (kv_cache_dtype, KV_CACHE_DTYPES, "--kv-cache-dtype")):
        if str(q).lower() not in table:
            raise AnatomyError(f"{flag}: unknown value {q!r}; use {', '.join(table)}")
    precision = Precision(QUANTIZATIONS[quantization.lower()], KV_CACHE_DTYPES[kv_cache_dtype.lower()])
    _check("--context", context, 1, top)
    _check("--prompt-tokens", prompt_tokens, 1, top)
    _check("--batch", batch, 1, MAX_BATCH)
    _check("--max-num-batched-tokens", max_num_batched_tokens, 1, 1 << 20)
    for name, v in (("--tpot-ms", tpot_ms), ("--ttft-ms", ttft_ms)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise AnatomyError(f"{name} must be a positive number of milliseconds, got {v}")
    if not 0 < gpu_memory_utilization <= 1:
        raise AnatomyError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    device.matmul_tflops(precision.quantization)  # refuses fp8 on a GPU without fp8 tensor cores
    dtype = parse_dtype(config.torch_dtype)
    notes: list[str] = []
    runtime = None
    if from_sweep is not None:
        eff, notes, runtime = _from_sweep(Path(from_sweep), precision)
    else:
        eff = default_efficiencies(_local_ceilings())
    runtime_source = ("measured: the CUDA context and libraries in the sweep's memory census" if runtime is not None
                      else "the CUDA context and libraries as measured on the H200 (the default)")
    runtime = runtime if runtime is not None else DEFAULT_RUNTIME_BYTES
    return _answer(device, source.name, config, dtype, precision, eff, context=context, batch=batch,
                   prompt_tokens=prompt_tokens, tpot_ms=tpot_ms, ttft_ms=ttft_ms, utilization=gpu_memory_utilization,
                   budget=max_num_batched_tokens, runtime=runtime, runtime_source=runtime_source, notes=notes,
                   formula=kv_formula(config, torch.float8_e4m3fn if precision.kv_cache_dtype == "fp8" else dtype))


def _local_ceilings():
    """This machine's cached calibration of its GPU, if it has one (never measures)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        from ..probe.ceilings import cached_ceilings

        return cached_ceilings(torch.device("cuda"))
    except Exception:  # no driver, a broken cache: the defaults serve
        return None


def _answer(gpu: Gpu, model: str, config, dtype, precision: Precision, eff: Efficiencies, *, context: int,
            batch: int, prompt_tokens: int, tpot_ms, ttft_ms, utilization: float, budget: int, runtime: float,
            runtime_source: str, notes: list[str], formula: str) -> dict:
    hw = Hardware.of(gpu)

    def setup(seqs: int) -> Setup:
        return Setup(config, dtype, precision, hw, eff, budget, seqs)

    cap = capacity(config, dtype, precision, gpu.memory_bytes, context, gpu_memory_utilization=utilization,
                   prefill_tokens=budget, runtime_bytes=runtime)
    limit = min(cap["max_concurrent_sequences"], MAX_BATCH)
    ttft = predict_point(setup(1), 1, prompt_tokens, 1)["ttft_ms"]
    tpot = setup(batch).decode_step_ms(batch, context)
    answer = {
        "gpu": gpu.key, "gpu_datasheet": gpu.describe(), "model": model,
        "precision": {"quantization": precision.quantization, "kv_cache_dtype": precision.kv_cache_dtype,
                      "label": precision.label},
        "prompt_tokens": prompt_tokens, "context": context, "batch": batch,
        "ttft_ms": ttft, "tpot_ms": tpot, "output_tokens_per_s": batch / tpot * 1e3,
        "fits": cap["fits"], "max_concurrent_sequences": cap["max_concurrent_sequences"],
        "kv_bytes_per_token": cap["kv_bytes_per_token"], "memory": cap,
        "energy_per_output_token_j_max": gpu.power_w * tpot / 1e3 / batch,
        "efficiencies": {**eff.values(), "source": eff.source},
    }
    if tpot_ms is not None:
        answer["max_batch_for_tpot"] = {"tpot_ms": tpot_ms, "context": context, "batch": _largest_batch(
            lambda b: setup(b).decode_step_ms(b, context) <= tpot_ms, limit)}
    if ttft_ms is not None:
        answer["max_batch_for_ttft"] = {"ttft_ms": ttft_ms, "prompt_tokens": prompt_tokens, "batch": _largest_batch(
            lambda b: predict_point(setup(b), b, prompt_tokens, 1)["ttft_ms_max"] <= ttft_ms, limit)}
    if not cap["fits"]:
        answer["why_not"] = _why_not(cap)
    answer["assumptions"] = _assumptions(gpu, eff, precision, cap, context, batch, prompt_tokens, budget,
                                         runtime_source, notes, formula, limit)
    return answer


def _why_not(cap: dict) -> str:
    if cap["usable_bytes"] < cap["weights_bytes"]:
        return (f"the weights ({cap['weights_bytes'] / 1e9:.2f} GB) exceed the usable memory "
                f"({cap['usable_bytes'] / 1e9:.2f} GB)")
    return (f"after weights, runtime and activations {max(cap['kv_budget_bytes'], 0) / 1e9:.2f} GB remain for the KV "
            f"cache; one sequence of {cap['context']} tokens needs {cap['kv_bytes_per_sequence'] / 1e9:.2f} GB")


def _assumptions(gpu: Gpu, eff: Efficiencies, precision: Precision, cap: dict, context: int, batch: int,
                 prompt_tokens: int, budget: int, runtime_source: str, notes: list[str], formula: str,
                 limit: int) -> list[str]:
    v = eff.values()
    rates = (f"{gpu.memory_gbps:.0f} GB/s, {gpu.matmul_tflops(precision.quantization):.0f} TFLOP/s "
             f"{'fp8' if precision.quantization == 'fp8' else 'bf16'} dense ({gpu.name} datasheet)")
    out = [
        f"ttft_ms: the prefill steps of one {prompt_tokens}-token prompt (no queueing, tokenization or network), at "
        f"{v['prefill_mm']:.0%} of the matmul rate for the linear layers, {v['prefill_attn']:.0%} for attention, "
        f"{v['prefill_bw']:.0%} of the bandwidth for its bytes, {v['prefill_t0_ms']:.3f} ms per step and "
        f"{v['prefill_eager_ms']:.3f} ms more for a step that replays no CUDA graph (several prompts, a chunk, more "
        f"than {PREFILL_GRAPH_TOKENS} tokens); of {rates}",
        f"tpot_ms: one decode step of {batch} sequence{'s' if batch > 1 else ''} at {context} tokens of context: "
        f"weights at {v['decode_bw']:.0%} of the bandwidth for one sequence ({v['decode_bw_gemv']:.0%} for 2 to "
        f"{GEMV_ROWS}, {v['decode_bw_gemm']:.0%} beyond), KV and activations at {v['decode_kv']:.0%}, the linear layers' "
        f"FLOPs at {v['decode_mm']:.0%} of the matmul rate, {v['decode_t0_ms']:.3f} ms + {v['decode_seq_ms']:.4f} ms "
        f"per sequence of step overhead",
        f"efficiencies: {eff.source}",
        f"max_concurrent_sequences: {gpu.memory_gb:g} GB read as {cap['memory_bytes'] / 1e9:.2f}e9 bytes (device "
        f"memory is sold in binary GB); the KV pool takes what {cap['gpu_memory_utilization']:.0%} of it leaves "
        f"after the weights ({cap['weights_bytes'] / 1e9:.2f} GB), the runtime ({cap['runtime_bytes'] / 1e9:.2f} GB, "
        f"{runtime_source}) and the activations of a prefill step of {min(budget, context)} tokens "
        f"({cap['activations_bytes'] / 1e9:.2f} GB, "
        f"estimated from the model's shapes), in blocks of {cap['block_size']} tokens per sequence",
        f"kv_bytes_per_token: {formula}" + (" (fp8 KV cache)" if precision.kv_cache_dtype == "fp8" else ""),
        f"energy_per_output_token_j_max: the board's maximum power ({gpu.power_w:.0f} W) x TPOT / batch, an upper "
        f"bound, not a measurement",
        "largest batches: searched up to the concurrent sequences that fit"
        + (f" ({limit})" if limit else " (none fit)") + "; TTFT target met by the last of the batch's prompts, all "
        "queued at once",
    ]
    if precision.quantization == "fp8":
        out.append("fp8 weights: 1 byte per linear-layer parameter (scales left out), linear layers at the fp8 "
                   "tensor-core rate; norms, embedding and lm_head in bf16")
    return out + notes
