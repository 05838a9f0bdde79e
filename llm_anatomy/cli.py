"""The commands: call (one measured chat completion), serve (an OpenAI-compatible server that measures every
call), calibrate (this device's ceilings), report (re-render a saved anatomy)."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from pathlib import Path

from .errors import AnatomyError, RequestError

DEFAULT_PROMPT = "Explain in one paragraph what a KV cache is and why it makes decoding fast."
GPU_DEFAULT_MODEL = "Qwen/Qwen3-8B"
CPU_DEFAULT_MODEL = "Qwen/Qwen3-0.6B"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"hub id, preset or checkpoint dir (default: {GPU_DEFAULT_MODEL} on a CUDA GPU, "
                                   f"{CPU_DEFAULT_MODEL} without one)")
    p.add_argument("--weights", default="auto", help="auto (real if found locally, else synthetic), synthetic, or DIR")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if there is one)")
    p.add_argument("--dtype", help="bfloat16, float16 or float32 (default: the model's, bfloat16 for Qwen3)")
    p.add_argument("--kv-cache-tokens", type=int, help="size the KV pool for this many tokens (default: from "
                                                          "free memory on a GPU, 1 GiB on the host)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-anatomy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    call = sub.add_parser("call", help="run one chat completion and show what happened inside it")
    call.add_argument("prompt", nargs="?", help=f"the user message (default: {DEFAULT_PROMPT!r})")
    call.add_argument("--messages", type=Path, help="a JSON file with a list of {role, content} messages")
    call.add_argument("--system", help="a system message to put first")
    call.add_argument("--raw-prompt", action="store_true", help="send PROMPT as is, without the chat template")
    call.add_argument("--no-thinking", action="store_true", help="enable_thinking=False in the chat template")
    _add_model_args(call)
    s = call.add_argument_group("sampling (unset values take the model's generation_config.json)")
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--temperature", type=float)
    s.add_argument("--top-p", type=float)
    s.add_argument("--top-k", type=int)
    s.add_argument("--min-p", type=float)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--seed", type=int)
    s.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep going past EOS (for benchmarks)")
    o = call.add_argument_group("output")
    o.add_argument("--json", type=Path, help="write the Anatomy record (docs/anatomy.md)")
    o.add_argument("--html", type=Path, help="write a self-contained HTML report")
    o.add_argument("--trace", type=Path, help="write a Perfetto / Chrome trace")
    o.add_argument("--kernels", action="store_true", help="profile kernels over a replay of prefill + 8 decode steps")
    o.add_argument("--no-telemetry", action="store_true", help="do not sample GPU counters")
    o.add_argument("--no-calibrate", action="store_true",
                   help="do not measure this device's ceilings if none are cached (datasheet only)")
    o.add_argument("--quiet", action="store_true", help="no terminal report")
    o.add_argument("--repeat", type=int, metavar="N",
                   help="after the call, measure J per prefill token and J per decode token in steady state: the "
                        "prefill N times back to back, then N decode steps at the call's context (each run longer "
                        "where the energy counter needs it); CUDA GPU with telemetry only")
    o.add_argument("--dram", action="store_true",
                   help="after the call, replay its prefill and one decode step under Nsight Compute (ncu on PATH) "
                        "and show measured DRAM bytes beside the model's")

    srv = sub.add_parser("serve", help="an OpenAI-compatible server; every response carries its own anatomy")
    srv.add_argument("model_name", nargs="?", metavar="MODEL", help="as --model")
    _add_model_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=os.environ.get("LLM_ANATOMY_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on every route but /health "
                          "(default: $LLM_ANATOMY_API_KEY, else no key)")
    srv.add_argument("--served-model-name", action="append", default=[],
                     help="the name clients give as `model` (repeatable; default: the model's name)")
    srv.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one step (default 64)")
    srv.add_argument("--max-model-len", type=int, help="context limit per request (default: the model's)")
    srv.add_argument("--max-num-batched-tokens", type=int,
                     help="tokens forwarded per step (default: 8192, or the context if shorter); longer prompts are "
                          "prefilled in chunks")
    srv.add_argument("--mixed-steps", action="store_true",
                     help="decode the running requests in every step, prompts filling the rest of it (lower time to "
                          "first token under load; the default prefills first, in steps CUDA graphs cover)")
    srv.add_argument("--gpu-memory-utilization", type=float,
                     help="on a GPU, the fraction of its memory to use, the KV pool taking what the rest leaves "
                          "(default 0.9); or size the pool with --kv-cache-tokens")
    srv.add_argument("--run-dir", type=Path, default=Path("~/.cache/llm-anatomy/serve").expanduser(),
                     help="where anatomies.jsonl is kept across restarts (default ~/.cache/llm-anatomy/serve)")
    srv.add_argument("--keep-anatomies", type=int, default=1000, help="newest anatomies kept (default 1000)")
    srv.add_argument("--max-body-bytes", type=int, default=4 << 20, help="request body limit (default 4 MiB)")
    srv.add_argument("--drain-timeout", type=float, default=120.0,
                     help="on SIGTERM, seconds to let in-flight requests finish (default 120)")
    srv.add_argument("--no-telemetry", action="store_true", help="do not sample GPU counters")
    srv.add_argument("--no-calibrate", action="store_true",
                     help="do not measure this device's ceilings if none are cached (datasheet only)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])

    cal = sub.add_parser("calibrate", help="measure this device's bandwidth and matmul ceilings, and cache them")
    cal.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if there is one)")
    cal.add_argument("--quick", action="store_true", help="smaller buffers, fewer repeats")

    rep = sub.add_parser("report", help="show a saved Anatomy JSON again, or turn it into HTML / a trace")
    rep.add_argument("anatomy", type=Path)
    rep.add_argument("--html", type=Path)
    rep.add_argument("--trace", type=Path)
    rep.add_argument("--quiet", action="store_true")
    return parser


def _messages(args) -> list[dict] | None:
    """The request's messages, validated before any model is loaded."""
    from .tokenizer import validate_messages

    if args.raw_prompt:
        if args.messages or args.system:
            raise RequestError("--raw-prompt sends PROMPT as is: it cannot be combined with --messages or --system")
        return None
    if args.messages:
        try:
            messages = json.loads(args.messages.read_text())
        except OSError as e:
            raise RequestError(f"cannot read --messages {args.messages}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise RequestError(f"--messages {args.messages} is not valid JSON: {e}") from None
        if args.prompt:
            messages = [*messages, {"role": "user", "content": args.prompt}] if isinstance(messages, list) else messages
    else:
        messages = [{"role": "user", "content": args.prompt or DEFAULT_PROMPT}]
    if args.system:
        messages = [{"role": "system", "content": args.system}, *messages] if isinstance(messages, list) else messages
    return validate_messages(messages)


def _sampling(args) -> dict:
    from .engine.sampling import SamplingParams

    given = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                 min_p=args.min_p, presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                 seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    given = {k: v for k, v in given.items() if v is not None}
    SamplingParams(**given)  # refuse bad values now, before the model loads
    return given


def cmd_call(args) -> int:
    from .engine.engine import Engine, parse_device
    from .hub import resolve
    from .models.config import ModelConfig
    from .probe.call import CallRequest, measure_call
    from .probe.ceilings import datasheet_ceilings, load_or_calibrate
    from .prompt import render_prompt
    from .tokenizer import Tokenizer

    messages = _messages(args)
    sampling = _sampling(args)
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 1:
        raise AnatomyError(f"--kv-cache-tokens must be >= 1, got {args.kv_cache_tokens}")
    device = parse_device(args.device)
    if args.repeat is not None:
        if not 1 <= args.repeat <= 100_000:
            raise AnatomyError(f"--repeat must be in 1..100000, got {args.repeat}")
        if device.type != "cuda" or args.no_telemetry:
            raise AnatomyError("--repeat measures energy with NVML's energy counter: it needs a CUDA GPU and "
                               "telemetry (drop --no-telemetry)" + (f"; this call runs on the {device.type}"
                                                                     if device.type != "cuda" else ""))
    why = f"asked for (--device {args.device})" if args.device else (
        "default: a CUDA GPU was found" if device.type == "cuda" else "default: no CUDA GPU on this machine")
    model = args.model or (GPU_DEFAULT_MODEL if device.type == "cuda" else CPU_DEFAULT_MODEL)

    # Pre-flight on the config and tokenizer alone: a prompt past the context fails before any weights load.
    source = resolve(model)
    config = ModelConfig.from_hf(source.config)
    tokenizer = Tokenizer.from_pretrained(source.directory or source.name)
    rendered = render_prompt(tokenizer, messages=messages,
                             prompt=(args.prompt or DEFAULT_PROMPT) if messages is None else None,
                             enable_thinking=not args.no_thinking)
    prompt_text, n_prompt = rendered.text, len(rendered.token_ids)
    if n_prompt + args.max_tokens > config.max_position_embeddings:
        raise RequestError(f"the prompt ({n_prompt} tokens) plus --max-tokens ({args.max_tokens}) exceeds the "
                           f"context of {model} ({config.max_position_embeddings} tokens)")

    kv_tokens = args.kv_cache_tokens
    if kv_tokens is None and device.type == "cpu":
        kv_tokens = n_prompt + args.max_tokens  # one request: the pool it needs, no more to zero
    engine = Engine.from_pretrained(model, device=device, dtype=args.dtype, weights=args.weights,
                                    kv_cache_tokens=kv_tokens)
    ceilings = datasheet_ceilings(device) if args.no_calibrate else load_or_calibrate(device, quick=True)
    settle_heap()
    request = CallRequest(messages=messages, prompt=prompt_text if messages is None else None,
                          enable_thinking=not args.no_thinking, sampling=sampling)
    result, anatomy = measure_call(engine, request, ceilings, device_why=why, use_telemetry=not args.no_telemetry)
    if args.kernels:
        from .probe.kernels import REPLAY_NOTE, profile_kernels

        anatomy.kernels = profile_kernels(engine, result.prompt_token_ids, sampling)
        anatomy.notes.append(REPLAY_NOTE)
    if args.repeat:
        from .probe.call import steady_energy

        steady_energy(engine, anatomy, args.repeat)
    if args.dram:
        from .probe.dram import DramReplay, apply_dram

        replay = DramReplay.of(engine, result.prompt_token_ids, sampling)
        del engine  # the replay builds its own engine in a child process: this one's memory goes back first
        apply_dram(anatomy, replay.measure(progress=lambda line: print(f"llm-anatomy: {line}", file=sys.stderr)))
    _write_outputs(anatomy, args)
    return 0


def _write_outputs(anatomy, args) -> None:
    if getattr(args, "json", None):
        args.json.write_text(anatomy.to_json(indent=1))
    if args.html:
        from .report.html import write_html

        write_html(anatomy, args.html)
    if args.trace:
        from .report.trace import write_trace

        write_trace(anatomy, args.trace)
    if not args.quiet:
        from .report.terminal import render

        render(anatomy)
    for what in ("json", "html", "trace"):
        if getattr(args, what, None):
            print(f"wrote {what}: {getattr(args, what)}", file=sys.stderr)


def settle_heap() -> None:
    """After start-up: collect once, then exempt everything alive from later collections. A full collection
    walks the ~300k objects start-up leaves (weights' modules, tokenizer, Triton's caches): 221 ms on the H200
    host (benchmarks/results/2026-11-29_probe_new_length4.json), a pause that would otherwise land in some step."""
    gc.collect()
    gc.freeze()


def cmd_serve(args) -> int:
    from .engine.engine import Engine, parse_device
    from .probe.ceilings import datasheet_ceilings, load_or_calibrate
    from .server.app import serve

    if args.model_name and args.model:
        raise AnatomyError("give the model once: as MODEL or as --model")
    for flag, value, low in (("--port", args.port, 0), ("--max-num-seqs", args.max_num_seqs, 1),
                             ("--keep-anatomies", args.keep_anatomies, 1), ("--max-body-bytes", args.max_body_bytes, 1),
                             ("--kv-cache-tokens", args.kv_cache_tokens, 1),
                             ("--max-num-batched-tokens", args.max_num_batched_tokens, 1)):
        if value is not None and value < low:
            raise AnatomyError(f"{flag} must be >= {low}, got {value}")
    if args.port > 65535:
        raise AnatomyError(f"--port must be <= 65535, got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise AnatomyError("--api-key is empty; give a key, or leave it out to serve without one")
    device = parse_device(args.device)
    if args.gpu_memory_utilization is not None and (device.type != "cuda" or args.kv_cache_tokens is not None):
        raise AnatomyError("--gpu-memory-utilization sizes the KV pool from GPU memory: it cannot be used "
                           + ("on the CPU" if device.type != "cuda" else "with --kv-cache-tokens")
                           + "; use --kv-cache-tokens")
    why = f"asked for (--device {args.device})" if args.device else (
        "default: a CUDA GPU was found" if device.type == "cuda" else "default: no CUDA GPU on this machine")
    model = args.model_name or args.model or (GPU_DEFAULT_MODEL if device.type == "cuda" else CPU_DEFAULT_MODEL)
    engine = Engine.from_pretrained(model, device=device, dtype=args.dtype, weights=args.weights,
                                    kv_cache_tokens=args.kv_cache_tokens, max_model_len=args.max_model_len,
                                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                    mixed_steps=args.mixed_steps,
                                    gpu_memory_utilization=args.gpu_memory_utilization or 0.9)
    ceilings = datasheet_ceilings(device) if args.no_calibrate else load_or_calibrate(device, quick=True)
    settle_heap()
    names = tuple(args.served_model_name) or (engine.source.name,)
    print(f"llm-anatomy: serving {names[0]} ({engine.weights.label}) on http://{args.host}:{args.port}/v1 "
          f"- KV pool {engine.pool.capacity_tokens} tokens, anatomies in {args.run_dir}", file=sys.stderr, flush=True)
    serve(engine, host=args.host, port=args.port, model_names=names, ceilings=ceilings, run_dir=args.run_dir,
          keep_anatomies=args.keep_anatomies, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
          device_why=why, telemetry_hz=None if args.no_telemetry else 50.0, drain_timeout_s=args.drain_timeout,
          log_level=args.log_level)
    return 0


def cmd_calibrate(args) -> int:
    from .engine.engine import parse_device
    from .probe.ceilings import format_ceilings, load_or_calibrate

    device = parse_device(args.device)
    print(format_ceilings(load_or_calibrate(device, recalibrate=True, quick=args.quick)))
    return 0


def cmd_report(args) -> int:
    from .anatomy import Anatomy

    try:
        anatomy = Anatomy.from_json(args.anatomy.read_text())
    except OSError as e:
        raise AnatomyError(f"cannot read {args.anatomy}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise AnatomyError(f"{args.anatomy} is not an Anatomy JSON: {e}") from None
    _write_outputs(anatomy, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    try:
        return {"call": cmd_call, "serve": cmd_serve, "calibrate": cmd_calibrate,
                "report": cmd_report}[args.command](args)
    except AnatomyError as e:
        print(f"llm-anatomy: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:  # the frozen heap (settle_heap) back to the collector, so that exit frees it: Triton's bindings
        gc.unfreeze()  # report every object of theirs still alive then, ~30 lines after the run


if __name__ == "__main__":
    sys.exit(main())
