"""Parity with HF transformers: the engine's greedy decode against HF's Qwen3 holding the very same weights.

For each case (a random prompt of P tokens, then D greedy tokens), the engine generates through its public API
with log-probabilities; HF then reads the prompt and the engine's tokens in one teacher-forced forward, in the
engine's dtype and in float32. Reported per case: how often the engine's token is HF's argmax, and how far the
engine's log-probabilities (of its token and of its 20 most likely ones) are from each of HF's, beside HF's own
distance between its dtype and float32 (the rounding any implementation in that dtype has).

    python benchmarks/check_core.py --out $OUT/check_core.json                 # Qwen3-8B, synthetic, bf16
    python benchmarks/check_core.py --model Qwen/Qwen3-0.6B --device cpu --dtype float32 --cases 64:16
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

from bench_args import Parser, output_file, positive_int

TOP = 20  # the most log-probabilities an OpenAI request may ask for (top_logprobs)


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(151643, vocab), (n,), generator=g).tolist()  # below Qwen's special tokens


def hf_model(engine, dtype: torch.dtype, device: torch.device):
    """HF's causal LM for the engine's config, holding a copy of the engine's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llm_anatomy.models.loader import hf_state_dict

    config = AutoConfig.for_model(**{k: v for k, v in engine.config.to_hf().items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {k: v.to(dtype) for k, v in hf_state_dict(engine.model).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


def logprob_errors(ours: list, tokens: list[int], ref: torch.Tensor) -> dict:
    """Log-probabilities as GenerationResult holds them (per output token: its token's, and the top ones as
    (id, value) pairs) against a reference's [tokens, vocab] log-probabilities at the same positions."""
    chosen = [abs(lp - ref[i, t].item()) for i, ((lp, _), t) in enumerate(zip(ours, tokens))]
    top = [abs(v - ref[i, t].item()) for i, (_, alternatives) in enumerate(ours) for t, v in alternatives]
    return {"chosen_logprob_abs_err_mean": sum(chosen) / len(chosen), "chosen_logprob_abs_err_max": max(chosen),
            f"top{TOP}_logprob_abs_err_max": max(top)}


def as_generated(logprobs: torch.Tensor) -> tuple[list[int], list]:
    """A reference's greedy tokens and their log-probabilities in GenerationResult's form."""
    values, ids = logprobs.topk(min(TOP, logprobs.shape[-1]), dim=-1)
    tokens = ids[:, 0].tolist()
    return tokens, [(v[0], list(zip(i, v))) for i, v in zip(ids.tolist(), values.tolist())]


def reference_logprobs(engine, dtype: torch.dtype, device: torch.device, prompt: list[int], output: list[int]):
    """HF's log-probabilities for each output position, teacher-forced on the engine's tokens."""
    model = hf_model(engine, dtype, device)
    with torch.inference_mode():
        ids = torch.tensor([prompt + output[:-1]], device=device)
        logits = model(ids, logits_to_keep=len(output)).logits[0]
    logprobs = logits.float().log_softmax(-1).cpu()
    del model, logits
    gc.collect()  # the model's memory back before the next one loads, whatever cycles it holds
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return logprobs


def parity(engine, dtype: torch.dtype, device: torch.device, prompt_tokens: int, decode_steps: int,
           seed: int = 7) -> dict:
    """One case: the engine's greedy decode against HF in `dtype` and in float32 (one HF model at a time)."""
    prompt = prompt_ids(prompt_tokens, engine.config.vocab_size, seed)
    result = engine.generate(prompt_token_ids=prompt, max_tokens=decode_steps, temperature=0, ignore_eos=True,
                             logprobs=TOP)
    output = result.output_token_ids
    refs = {"hf": reference_logprobs(engine, dtype, device, prompt, output)}
    if dtype != torch.float32:
        refs["fp32"] = reference_logprobs(engine, torch.float32, device, prompt, output)
    out = {"prompt_tokens": prompt_tokens, "output_tokens": len(output),
           "argmax_agreement_with_hf": sum(t == int(refs["hf"][i].argmax()) for i, t in enumerate(output))
           / len(output)}
    for name, ref in refs.items():
        out[f"vs_{name}"] = logprob_errors(result.logprobs, output, ref)
    if "fp32" in refs:  # the rounding of HF's own implementation in this dtype, for scale
        hf_tokens, hf_logprobs = as_generated(refs["hf"])
        out["hf_vs_fp32"] = logprob_errors(hf_logprobs, hf_tokens, refs["fp32"])
    return out


def cases(text: str) -> list[tuple[int, int]]:
    """PROMPT:STEPS,... e.g. 512:64,16384:16"""
    out = []
    for part in text.split(","):
        prompt, _, steps = part.partition(":")
        if not (prompt.isdigit() and steps.isdigit() and int(prompt) > 0 and int(steps) > 0):
            raise argparse.ArgumentTypeError(f"want PROMPT:STEPS pairs of positive whole numbers, e.g. "
                                             f"512:64,16384:16, got {text!r}")
        out.append((int(prompt), int(steps)))
    return out


def parse_args(argv: list[str] | None):
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen3-8B")
    parser.add_argument("--weights", default="synthetic", help="auto, synthetic (default) or a directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--cases", type=cases, default=[(512, 64), (16384, 16)],
                        help="PROMPT:STEPS,... (default 512:64,16384:16)")
    parser.add_argument("--kv-cache-tokens", type=positive_int, default=None,
                        help="KV pool size (default: the longest case)")
    parser.add_argument("--out", type=output_file, help="write the results as JSON to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's llm_anatomy
    from llm_anatomy import Engine
    from llm_anatomy.errors import AnatomyError

    longest = max(p + s for p, s in args.cases)
    try:
        started = time.perf_counter()
        engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, weights=args.weights,
                                        kv_cache_tokens=args.kv_cache_tokens or longest + 64)
        load_s = time.perf_counter() - started
        for prompt, steps in args.cases:  # every case checked before the first one runs
            engine.check_request(prompt_ids(prompt, engine.config.vocab_size, 0),
                                 engine.sampling_params(max_tokens=steps, temperature=0, ignore_eos=True))
    except AnatomyError as e:  # a model, device or length this engine refuses
        print(f"check_core.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    import transformers

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    results = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "weights": args.weights, "dtype": args.dtype,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__,
               "python": platform.python_version(), "load_s": load_s, "cases": {}}
    for prompt, steps in args.cases:
        results["cases"][f"{prompt}+{steps}"] = parity(engine, dtype, device, prompt, steps)
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return results


if __name__ == "__main__":
    main()
