"""`llm-anatomy compare`: what quantization costs in accuracy and buys in speed and memory, measured, not assumed.

A fixed prompt set (PROMPTS) goes through two engines in one process: the baseline (the checkpoint as it is, or
with --baseline-quantization fp8 its linear layers in fp8, so that what lm_head or the KV cache adds is measured
alone) and the quantized one (--quantization, --quantize-lm-head, --kv-cache-dtype), both greedy:
- greedy agreement: each engine continues each prompt for N tokens; the figure is how many tokens come before the
  first difference (N where none);
- teacher forcing: the baseline's continuation is fed to both engines, token by token through their own prefill and
  decode paths (KV cache, kernels, CUDA graphs), and at each position the two next-token distributions are
  compared: KL(baseline || quantized) in nats (mean and 99th percentile over the positions), and whether their
  most likely tokens agree (top-1 agreement).
Beside them, what quantization buys: the weight bytes (all of them, and the linear layers'), the KV cache's bytes per
token and, on a GPU, each engine's prefill time and time per output token. With synthetic weights the drift figures
are not the real model's (random weights predict nothing with confidence), and say so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .errors import AnatomyError

# Written for llm-anatomy (no outside source): short user requests of different kinds (explanation, code, arithmetic,
# a list, translation, a story), so that the continuations cover prose, code, digits and another language.
PROMPTS = (
    ("explain", "Explain in three sentences why the sky is blue."),
    ("code", "Write a Python function that returns the n-th Fibonacci number iteratively."),
    ("arithmetic", "What is 17 times 23? Show the steps."),
    ("list", "List five uses of a paper clip, one per line."),
    ("translate", "Translate into French: The train leaves at seven tomorrow morning."),
    ("story", "Begin a short story about a lighthouse keeper who finds a message in a bottle."),
)
MAX_TOKENS_LIMIT = 4096
# --context-tokens: a document read before each request, so that long contexts' drift is measured too (an fp8 KV
# cache's, and with fp8 weights the fp8 attention of prompts past the prefill graphs, docs/quantization.md). Written
# for llm-anatomy (no outside source), repeated to the length asked for.
CONTEXT_PARAGRAPH = ("The lighthouse stood on a rock a mile out from the harbour. Every evening the keeper climbed its "
                     "ninety-one steps, trimmed the wick, wound the clockwork that turned the lens, and wrote in the "
                     "log the wind's direction and strength, the state of the sea and the ships that passed. ")
MAX_CONTEXT_TOKENS = 131072


@dataclass(frozen=True)
class PromptDrift:
    name: str
    prompt_tokens: int  # the request's tokens, the document before it (--context-tokens) included
    greedy_agreement: int  # tokens of the quantized engine's greedy continuation before the first difference
    kl: tuple[float, ...]  # per position: KL(baseline || quantized), nats
    top1: tuple[bool, ...]  # per position: the two most likely tokens agree

    @property
    def tokens(self) -> int:
        return len(self.kl)


@dataclass(frozen=True)
class EngineFigures:
    precision: str
    weight_bytes: int
    linear_weight_bytes: int
    kv_bytes_per_token: int
    prefill_ms: float | None  # median over the prompts, on a GPU; None elsewhere
    tpot_ms: float | None  # median time per output token after the first, on a GPU


@dataclass(frozen=True)
class Summary:
    positions: int
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1_agreement: float  # fraction of positions
    greedy_agreement_mean: float  # tokens before the first difference, mean over the prompts
    greedy_identical: int  # prompts whose N tokens all agree


def summarize(prompts: list[PromptDrift]) -> Summary:
    kl = torch.tensor([v for p in prompts for v in p.kl], dtype=torch.float64)
    top1 = [v for p in prompts for v in p.top1]
    return Summary(len(kl), kl.mean().item(), torch.quantile(kl, 0.99).item(), kl.max().item(),
                   sum(top1) / len(top1), sum(p.greedy_agreement for p in prompts) / len(prompts),
                   sum(p.greedy_agreement == p.tokens for p in prompts))


@dataclass(frozen=True)
class Comparison:
    model: str
    weights: str  # the weights' label (says when they are synthetic)
    synthetic: bool
    device: str
    max_tokens: int
    context_tokens: int  # --context-tokens: at least this many tokens of a document before each request (0: none)
    baseline: EngineFigures
    quantized: EngineFigures
    prompts: tuple[PromptDrift, ...]

    @property
    def summary(self) -> Summary:
        return summarize(list(self.prompts))

    def to_dict(self) -> dict:
        out = asdict(self)
        out["summary"] = asdict(self.summary)
        if self.synthetic:
            out["note"] = "synthetic random weights: the drift figures are not the real model's"
        return out


def drift(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities [positions, vocab] of the baseline and the quantized engine -> (KL(baseline || quantized)
    per position in nats, float64; whether the most likely tokens agree, per position)."""
    p, q = reference.double(), candidate.double()
    kl = (p.exp() * (p - q)).sum(-1).clamp(min=0.0)  # >= 0 in exact arithmetic; rounding may dip below
    return kl, reference.argmax(-1) == candidate.argmax(-1)


@torch.inference_mode()
def teacher_forced_logprobs(engine, prompt_ids: list[int], forced_ids: list[int]) -> torch.Tensor:
    """The engine's next-token log-probabilities [len(forced_ids), vocab] (float32, on the host) at each position
    of prompt + forced_ids: the prompt's prefill, then one decode step a forced token, through the engine's runner
    as its own requests run (KV cache, kernels, CUDA graphs), in a sequence of its own."""
    from .engine.kv_cache import BlockTable
    from .engine.sampling import SamplingParams
    from .engine.scheduler import ScheduledBatch, Sequence

    seq = Sequence(f"compare-{uuid.uuid4().hex}", list(prompt_ids), SamplingParams(max_tokens=len(forced_ids)),
                   BlockTable(engine.pool))
    if not seq.block_table.ensure(len(prompt_ids) + len(forced_ids)):
        raise AnatomyError(f"the KV pool cannot hold {len(prompt_ids) + len(forced_ids)} tokens for teacher forcing")
    try:
        rows = [engine.runner.run(ScheduledBatch([seq], [len(prompt_ids)], True, [seq], 0)).float().cpu()]
        seq.num_cached = len(prompt_ids)
        for token in forced_ids[:-1]:
            seq.output_token_ids.append(token)
            rows.append(engine.runner.run(ScheduledBatch([seq], [1], False, [seq], 1)).float().cpu())
            seq.num_cached += 1
    finally:
        seq.block_table.release()
    return torch.cat(rows).log_softmax(-1)


def _greedy(engine, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """The greedy continuation and its wall time in ms (the device synchronised)."""
    start = time.perf_counter()
    out = engine.generate(prompt_token_ids=ids, temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return out.output_token_ids, (time.perf_counter() - start) * 1e3


def compare_engines(baseline, quantized, prompts: list[tuple[str, list[int]]], max_tokens: int,
                    progress=None) -> tuple[list[PromptDrift], dict]:
    """Drift of each prompt, and (on a GPU) the timings: {"baseline"|"quantized": (prefill_ms, tpot_ms) medians}."""
    timed = baseline.device.type == "cuda"
    results, times = [], {"baseline": [], "quantized": []}
    if timed:  # a first run of each (lazy initialisations) before any timed one
        for engine in (baseline, quantized):
            _greedy(engine, prompts[0][1], 2)
    for name, ids in prompts:
        if progress:
            progress(name)
        ref_tokens, ref_ms = _greedy(baseline, ids, max_tokens)
        q_tokens, q_ms = _greedy(quantized, ids, max_tokens)
        agree = next((i for i, (a, b) in enumerate(zip(ref_tokens, q_tokens)) if a != b), len(ref_tokens))
        kl, top1 = drift(teacher_forced_logprobs(baseline, ids, ref_tokens),
                         teacher_forced_logprobs(quantized, ids, ref_tokens))
        results.append(PromptDrift(name, len(ids), agree, tuple(kl.tolist()), tuple(top1.tolist())))
        if timed:  # a one-token run is the prefill; the rest of the greedy run is decode
            for side, engine, total in (("baseline", baseline, ref_ms), ("quantized", quantized, q_ms)):
                _, prefill = _greedy(engine, ids, 1)
                times[side].append((prefill, (total - prefill) / max(1, max_tokens - 1)))
    medians = {side: tuple(torch.tensor(v).median(0).values.tolist()) if v else (None, None)
               for side, v in times.items()}
    return results, medians


def engine_figures(engine, timings: tuple) -> EngineFigures:
    from .models.quant import linear_weight_bytes
    from .report import fp8_plan_words

    label = engine.weights.quantization or f"{str(engine.dtype).removeprefix('torch.')} weights"
    kv = str(engine.pool.dtype).removeprefix("torch.")
    precision = "; ".join(filter(None, (label, f"KV cache {kv}", fp8_plan_words(engine.plan.describe()))))
    return EngineFigures(precision, engine.weights.bytes, linear_weight_bytes(engine.model),
                         engine.pool.bytes_per_token, *timings)


def context_document(tokenizer, context_tokens: int) -> str:
    """CONTEXT_PARAGRAPH repeated to at least context_tokens tokens, and a blank line; "" for 0."""
    if not context_tokens:
        return ""
    repeats = -(-context_tokens // len(tokenizer.encode(CONTEXT_PARAGRAPH)))
    while len(tokenizer.encode(CONTEXT_PARAGRAPH * repeats)) < context_tokens:  # tokens at the joins may merge
        repeats += 1
    return CONTEXT_PARAGRAPH * repeats + "\n\n"


def run(model: str, *, quantization: str | None, kv_cache_dtype: str, max_tokens: int, weights: str = "auto",
        device=None, dtype=None, seed: int = 0, prompts=PROMPTS, quantize_lm_head: bool = False,
        baseline_quantization: str | None = None, context_tokens: int = 0) -> Comparison:
    """Load both engines (each with a KV pool just large enough), measure, and return the comparison."""
    from .engine.engine import Engine, parse_device
    from .hub import resolve
    from .models.config import ModelConfig
    from .prompt import render_prompt
    from .tokenizer import Tokenizer

    device = parse_device(device)
    source = resolve(model)
    tokenizer = Tokenizer.from_pretrained(source.directory or source.name)
    document = context_document(tokenizer, context_tokens)
    rendered = [(name, render_prompt(tokenizer, messages=[{"role": "user", "content": document + text}]).token_ids)
                for name, text in prompts]
    longest = max(len(ids) for _, ids in rendered) + max_tokens
    context = ModelConfig.from_hf(source.config).max_position_embeddings
    if longest > context:
        raise AnatomyError(f"the longest prompt with its continuation takes {longest} tokens, more than {model}'s "
                           f"context ({context}); lower --context-tokens or --max-tokens")
    common = dict(device=device, dtype=dtype, weights=weights, seed=seed, kv_cache_tokens=longest,
                  max_model_len=longest, max_num_seqs=1)
    asked = {k: v for k, v in (("quantization", quantization), ("quantize_lm_head", quantize_lm_head),
                               ("kv_cache_dtype", kv_cache_dtype)) if v not in (None, "auto", False)}
    base = {"quantization": baseline_quantization} if baseline_quantization is not None else {}
    _say("loading the baseline engine" + (f" with quantization={baseline_quantization}" if base else ""))
    baseline = Engine.from_pretrained(model, **common, **base)
    _say(f"loading the engine with {', '.join(f'{k}={v}' for k, v in asked.items())}")
    quantized = Engine.from_pretrained(model, **common, **asked)
    drifts, timings = compare_engines(baseline, quantized, rendered, max_tokens,
                                      progress=lambda name: _say(f"prompt {name!r}"))
    return Comparison(source.name, baseline.weights.label, baseline.weights.kind == "synthetic", str(device),
                      max_tokens, context_tokens, engine_figures(baseline, timings["baseline"]),
                      engine_figures(quantized, timings["quantized"]), tuple(drifts))


def _say(what: str) -> None:
    print(f"compare: {what}", file=sys.stderr, flush=True)


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} ms"


def render(c: Comparison) -> str:
    """The comparison as text: the two engines side by side, then the drift per prompt and over all of them."""
    b, q, s = c.baseline, c.quantized, c.summary
    context = f", each request after a document of {c.context_tokens}+ tokens" if c.context_tokens else ""
    lines = [f"Model     {c.model} on {c.device}, greedy, {c.max_tokens} tokens a prompt{context}",
             f"Weights   {c.weights}" + ("; the drift figures below are not the real model's" if c.synthetic else ""),
             f"Baseline  {b.precision}", f"Quantized {q.precision}",
             f"{'':24}{'baseline':>18}{'quantized':>18}{'ratio':>9}"]
    for what, x, y, fmt in (("weights", b.weight_bytes, q.weight_bytes, _gb),
                            ("  linear layers", b.linear_weight_bytes, q.linear_weight_bytes, _gb),
                            ("KV cache per token", b.kv_bytes_per_token, q.kv_bytes_per_token, lambda n: f"{n:,} B"),
                            ("prefill (median)", b.prefill_ms, q.prefill_ms, _ms),
                            ("time per output token", b.tpot_ms, q.tpot_ms, _ms)):
        ratio = f"{y / x:.3f}" if x and y is not None else "-"
        lines.append(f"{what:24}{fmt(x) if x is not None else '-':>18}{fmt(y) if y is not None else '-':>18}{ratio:>9}")
    if b.prefill_ms is None:
        lines.append("(timings are measured on a GPU only: the CPU path dequantizes the weights at every product)")
    lines.append("Drift: KL(baseline || quantized) in nats at each position of the baseline's continuation "
                 "(teacher-forced); greedy agreement: tokens before the first difference")
    lines.append(f"{'prompt':14}{'tokens':>8}{'KL mean':>12}{'KL p99':>12}{'top-1':>9}{'greedy':>10}")
    for p in c.prompts:
        one = summarize([p])
        lines.append(f"{p.name:14}{p.prompt_tokens:>8}{one.kl_mean:>12.3e}{one.kl_p99:>12.3e}"
                     f"{one.top1_agreement:>9.1%}{f'{p.greedy_agreement}/{p.tokens}':>10}")
    lines.append(f"{'all':14}{s.positions:>8}{s.kl_mean:>12.3e}{s.kl_p99:>12.3e}{s.top1_agreement:>9.1%}"
                 f"{f'{s.greedy_agreement_mean:.1f}':>10}  ({s.greedy_identical} of {len(c.prompts)} identical)")
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("compare", help="measure what quantization changes: drift against the baseline "
                                              "(KL, top-1, greedy agreement) beside the memory and speed gained")
    p.add_argument("model_name", nargs="?", metavar="MODEL",
                   help="hub id, preset or checkpoint dir (default: Qwen/Qwen3-8B on a CUDA GPU, Qwen/Qwen3-0.6B without)")
    p.add_argument("--quantization", help="fp8: linear layers' weights in fp8 e4m3, quantized at load (vLLM's name)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization fp8: lm_head's weights in fp8 too (per output channel)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype) or fp8 (vLLM's name)")
    p.add_argument("--baseline-quantization",
                   help="fp8: the baseline's linear layers in fp8 too, so that --quantize-lm-head and/or "
                        "--kv-cache-dtype fp8 are measured alone (default: the checkpoint as it is)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens of each greedy continuation (default 64)")
    p.add_argument("--context-tokens", type=int, default=0,
                   help="a document of at least this many tokens before each request, so that long contexts' "
                        "drift is measured (default 0: none)")
    p.add_argument("--weights", default="auto", help="auto (real if found locally, else synthetic), synthetic, or DIR")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if there is one)")
    p.add_argument("--dtype", help="the baseline's dtype: bfloat16, float16 or float32 (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="synthetic weights' seed (default 0)")
    p.add_argument("--json", type=Path, help="write the comparison, per-position figures included")
    p.set_defaults(handler=cmd_compare)
    return p


def check_args(args) -> None:
    """Every flag checked before any weights load."""
    from .cli import check_precision
    from .models.config import SUPPORTED_QUANTIZATION

    if args.quantization is not None and args.quantization not in SUPPORTED_QUANTIZATION:
        raise AnatomyError(f"--quantization {args.quantization!r} is not supported; use "
                           f"{' or '.join(SUPPORTED_QUANTIZATION)}")
    check_precision(args)
    if args.kv_cache_dtype not in ("auto", "fp8"):
        raise AnatomyError(f"--kv-cache-dtype {args.kv_cache_dtype!r} is not supported; use auto or fp8")
    if args.quantization is None and args.kv_cache_dtype == "auto":
        raise AnatomyError("nothing to compare: give --quantization fp8 and/or --kv-cache-dtype fp8")
    if args.baseline_quantization is not None:
        if args.baseline_quantization not in SUPPORTED_QUANTIZATION:
            raise AnatomyError(f"--baseline-quantization {args.baseline_quantization!r} is not supported; use "
                               f"{' or '.join(SUPPORTED_QUANTIZATION)}")
        if args.quantization != args.baseline_quantization or not (args.quantize_lm_head
                                                                    or args.kv_cache_dtype == "fp8"):
            raise AnatomyError(f"nothing to compare beyond the baseline's --quantization {args.baseline_quantization}: "
                               f"give --quantization {args.baseline_quantization} with --quantize-lm-head and/or "
                               f"--kv-cache-dtype fp8")
    if not 1 <= args.max_tokens <= MAX_TOKENS_LIMIT:
        raise AnatomyError(f"--max-tokens must be in 1..{MAX_TOKENS_LIMIT}, got {args.max_tokens}")
    if not 0 <= args.context_tokens <= MAX_CONTEXT_TOKENS:
        raise AnatomyError(f"--context-tokens must be in 0..{MAX_CONTEXT_TOKENS}, got {args.context_tokens}")
    if args.json is not None and not args.json.parent.is_dir():
        raise AnatomyError(f"--json {args.json}: directory {args.json.parent} does not exist")


def cmd_compare(args) -> int:
    from .engine.engine import parse_device

    check_args(args)
    device = parse_device(args.device)
    model = args.model_name or ("Qwen/Qwen3-8B" if device.type == "cuda" else "Qwen/Qwen3-0.6B")
    comparison = run(model, quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
                     kv_cache_dtype=args.kv_cache_dtype, baseline_quantization=args.baseline_quantization,
                     max_tokens=args.max_tokens, weights=args.weights, device=device, dtype=args.dtype, seed=args.seed,
                     context_tokens=args.context_tokens)
    print(render(comparison))
    if args.json is not None:
        args.json.write_text(json.dumps(comparison.to_dict(), indent=1))
        print(f"wrote json: {args.json}", file=sys.stderr)
    return 0
