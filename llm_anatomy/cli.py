"""The commands: call (one measured chat completion), serve (an OpenAI-compatible server that measures every
call), calibrate (this device's ceilings), report (re-render a saved anatomy).

Each command is an `add_<name>(subparsers)` that builds its parser and sets its handler; a command kept in
another module does the same (`add_parser(subparsers)`) and joins COMMANDS. Everything that can be checked
before a model loads is checked then: each flag by its type while parsing (llm_anatomy/cli_types.py), the rest
in the command's pre-flight. Units are decimal throughout (1 GB = 1e9 bytes, TB/s, TFLOP/s)."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .cli_types import INT64_MAX, INT64_MIN, Parser, input_file, integer, nonempty, output_dir, output_file, real
from .engine.config import KV_CACHE_DTYPES, QUANTIZATIONS
from .errors import AnatomyError, RequestError

DEFAULT_PROMPT = "Explain in one paragraph what a KV cache is and why it makes decoding fast."
GPU_DEFAULT_MODEL = "Qwen/Qwen3-8B"
CPU_DEFAULT_MODEL = "Qwen/Qwen3-0.6B"


# ---- shared flags ------------------------------------------------------------------------------------------------
def _weights(value: str) -> str:
    if value in ("auto", "synthetic") or Path(value).expanduser().is_dir():
        return value
    raise argparse.ArgumentTypeError(f"is not a directory: {value}; use auto, synthetic or a checkpoint directory")


def _add_model_args(p: argparse.ArgumentParser, kv_default: str) -> None:
    p.add_argument("--model", type=nonempty, help=f"hub id, preset or checkpoint dir (default: {GPU_DEFAULT_MODEL} "
                                                   f"on a CUDA GPU, {CPU_DEFAULT_MODEL} without one)")
    p.add_argument("--weights", default="auto", type=_weights,
                   help="auto (real if found locally, else synthetic), synthetic, or DIR")
    p.add_argument("--device", type=nonempty, help="cpu, cuda or cuda:N (default: cuda if there is one)")
    p.add_argument("--dtype", type=nonempty, help="bfloat16, float16 or float32 (default: the model's, bfloat16 "
                                                  "for Qwen3)")
    p.add_argument("--kv-cache-tokens", type=integer(1),
                   help=f"size the KV pool for this many tokens (default: from free memory on a GPU; {kv_default})")
    p.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="fp8: the linear layers' weights quantized to float8 e4m3 at load, a scale per output channel "
                        "(W8A8 prefill, fp8-weight decode GEMVs); default: the checkpoint's own precision (an fp8 "
                        "checkpoint runs as published)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization fp8: lm_head's weights in fp8 too, a scale per output channel (half "
                        "its bytes a decode step; off by default, as in vLLM: measure the drift with "
                        "`llm-anatomy compare --quantization fp8 --quantize-lm-head`)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="what the KV cache stores: auto (the model's dtype) or fp8 (= fp8_e4m3: half the bytes a "
                        "token, twice the tokens in the same memory)")


def check_precision(args) -> None:
    """The precision flags together, before anything loads, by the rule the engine's config keeps."""
    from .engine.config import EngineConfig

    EngineConfig(quantization=args.quantization, quantize_lm_head=args.quantize_lm_head)


def _add_no_calibrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-telemetry", action="store_true", help="do not sample GPU counters")
    p.add_argument("--no-calibrate", action="store_true",
                   help="do not measure this device's ceilings if none are cached (datasheet only)")


def _device_and_why(arg: str | None):
    from .engine.engine import parse_device

    device = parse_device(arg)
    why = f"asked for (--device {arg})" if arg else (
        "default: a CUDA GPU was found" if device.type == "cuda" else "default: no CUDA GPU on this machine")
    return device, why


def _load_engine(model: str, progress, **settings):
    """Engine.from_pretrained, telling `progress` its stages."""
    from .engine.engine import Engine

    return Engine.from_pretrained(model, progress=progress.stage, **settings)


def _ceilings(device, no_calibrate: bool, progress) -> tuple:
    """(Ceilings, a note for the anatomy or None): the cached or quickly measured ceilings, or the datasheet's."""
    from .probe.ceilings import datasheet_ceilings, load_or_calibrate

    if no_calibrate:
        return datasheet_ceilings(device), None
    calibration = load_or_calibrate(device, quick=True, progress=progress.stage)
    note = None if not calibration.busy else (
        f"the ceilings were measured while the device was busy ({'; '.join(calibration.busy)}), so MFU and MBU "
        f"may read high; they were not cached: `llm-anatomy calibrate` measures them again")
    return calibration.ceilings, note


def settle_heap() -> None:
    """After start-up: collect once, then exempt everything alive from later collections. A full collection
    walks the ~300k objects start-up leaves (weights' modules, tokenizer, Triton's caches): 221 ms on the H200
    host (benchmarks/README.md), a pause that would otherwise land in some step."""
    gc.collect()
    gc.freeze()


# ---- call --------------------------------------------------------------------------------------------------------
def _prompt(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty; give a message, or leave PROMPT out for the default one")
    return value


def add_call(sub) -> None:
    call = sub.add_parser("call", help="run one chat completion and show what happened inside it",
                          description="Run one chat completion and show what happened inside it.")
    call.add_argument("prompt", nargs="?", type=_prompt, help=f"the user message (default: {DEFAULT_PROMPT!r})")
    call.add_argument("--messages", type=input_file, help="a JSON file with a list of {role, content} messages")
    call.add_argument("--system", type=nonempty, help="a system message to put first")
    call.add_argument("--raw-prompt", action="store_true", help="send PROMPT as is, without the chat template")
    call.add_argument("--no-thinking", action="store_true", help="enable_thinking=False in the chat template")
    _add_model_args(call, "on the host, what this call needs")
    s = call.add_argument_group("sampling (unset values take the model's generation_config.json)")
    s.add_argument("--max-tokens", type=integer(1), default=256, help="most tokens to generate (default 256)")
    s.add_argument("--temperature", type=real(0), help=">= 0; 0 is greedy")
    s.add_argument("--top-p", type=real(0, 1, low_open=True), help="nucleus sampling, in (0, 1]")
    s.add_argument("--top-k", type=integer(-1), help="keep the k likeliest tokens; 0 or -1: all")
    s.add_argument("--min-p", type=real(0, 1), help="drop tokens below this fraction of the likeliest's, in [0, 1]")
    s.add_argument("--presence-penalty", type=real(-2, 2), default=0.0, help="in [-2, 2] (default 0)")
    s.add_argument("--frequency-penalty", type=real(-2, 2), default=0.0, help="in [-2, 2] (default 0)")
    s.add_argument("--seed", type=integer(INT64_MIN, INT64_MAX), help="a signed 64-bit integer: same seed, same text")
    s.add_argument("--stop", action="append", default=[], type=nonempty, help="a stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep going past EOS (for benchmarks)")
    o = call.add_argument_group("output")
    o.add_argument("--json", type=output_file, help="write the Anatomy record (docs/anatomy.md)")
    o.add_argument("--html", type=output_file, help="write a self-contained HTML report")
    o.add_argument("--trace", type=output_file, help="write a Perfetto / Chrome trace")
    o.add_argument("--kernels", action="store_true", help="profile kernels over a replay of prefill + 8 decode steps")
    _add_no_calibrate(o)
    o.add_argument("--quiet", action="store_true", help="no terminal report and no progress line")
    o.add_argument("--repeat", type=integer(1, 100_000), metavar="N",
                   help="after the call, measure J per prefill token and J per decode token in steady state: the "
                        "prefill N times back to back, then N decode steps at the call's context (each run longer "
                        "where the energy counter needs it); CUDA GPU with telemetry only")
    o.add_argument("--dram", action="store_true",
                   help="after the call, replay its prefill and one decode step under Nsight Compute (ncu on PATH) "
                        "and show measured DRAM bytes beside the model's")
    call.set_defaults(handler=cmd_call)


def _messages(args) -> list[dict] | None:
    """The request's messages, validated before any model is loaded."""
    from .tokenizer import validate_messages

    if args.raw_prompt:
        if args.messages or args.system:
            raise RequestError("--raw-prompt sends PROMPT as is: it cannot be combined with --messages or --system")
        return None
    if args.messages:
        try:
            messages = json.loads(args.messages.read_text(encoding="utf-8"))
        except OSError as e:
            raise RequestError(f"cannot read --messages {args.messages}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise RequestError(f"--messages {args.messages} is not UTF-8 text") from None
        except (json.JSONDecodeError, RecursionError) as e:
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


def _distinct_outputs(args, *flags: str) -> None:
    seen: dict[Path, str] = {}
    source = getattr(args, "anatomy", None)
    for flag in flags:
        path = getattr(args, flag, None)
        if path is None:
            continue
        key = path.resolve()
        if source is not None and key == source.resolve():
            raise AnatomyError(f"--{flag} {path} is the anatomy being read; give another file")
        if key in seen:
            raise AnatomyError(f"--{flag} and --{seen[key]} name the same file ({path}); give each its own")
        seen[key] = flag


@dataclass
class Preflight:
    """What cmd_call settles before loading the model."""

    model: str
    device: object
    why: str
    messages: list | None
    sampling: dict
    prompt_text: str | None
    prompt_tokens: int
    kv_cache_tokens: int | None


def _preflight(args) -> Preflight:
    """Every check a call can make on its config and tokenizer alone: a prompt past the context, a top-k past the
    vocabulary or a KV pool too small fail here, before any weights load."""
    from .hub import resolve
    from .models.config import ModelConfig, parse_dtype
    from .prompt import render_prompt
    from .tokenizer import Tokenizer

    _distinct_outputs(args, "json", "html", "trace")
    check_precision(args)
    messages = _messages(args)
    sampling = _sampling(args)
    device, why = _device_and_why(args.device)
    if args.dtype is not None:
        parse_dtype(args.dtype)
    model = args.model or (GPU_DEFAULT_MODEL if device.type == "cuda" else CPU_DEFAULT_MODEL)
    source = resolve(model)
    config = ModelConfig.from_hf(source.config)
    tokenizer = Tokenizer.from_pretrained(source.directory or source.name)
    rendered = render_prompt(tokenizer, messages=messages,
                             prompt=(args.prompt or DEFAULT_PROMPT) if messages is None else None,
                             enable_thinking=not args.no_thinking)
    n_prompt, needed = len(rendered.token_ids), len(rendered.token_ids) + args.max_tokens
    if needed > config.max_position_embeddings:
        raise RequestError(f"the prompt ({n_prompt} tokens) plus --max-tokens ({args.max_tokens}) exceeds the "
                           f"context of {model} ({config.max_position_embeddings} tokens)")
    if args.top_k is not None and args.top_k > config.vocab_size:
        raise RequestError(f"--top-k {args.top_k} is more than the vocabulary of {model} ({config.vocab_size} "
                           f"tokens); use 0 to keep them all")
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < needed:
        raise RequestError(f"--kv-cache-tokens {args.kv_cache_tokens} cannot hold the prompt ({n_prompt} tokens) "
                           f"plus --max-tokens ({args.max_tokens}); give at least {needed}")
    if args.repeat is not None and (device.type != "cuda" or args.no_telemetry):
        raise AnatomyError("--repeat measures energy with NVML's energy counter: it needs a CUDA GPU and telemetry"
                           + (" (drop --no-telemetry)" if args.no_telemetry else f"; this call runs on the {device.type}"))
    kv_tokens = args.kv_cache_tokens
    if kv_tokens is None and device.type == "cpu":
        kv_tokens = needed  # one request: the pool it needs, no more to zero
    return Preflight(model, device, why, messages, sampling, rendered.text, n_prompt, kv_tokens)


def cmd_call(args) -> int:
    from .probe.call import CallRequest, measure_call
    from .progress import ProgressLine

    plan = _preflight(args)
    with ProgressLine(enabled=False if args.quiet else None) as progress:
        # One request: batch-1 graphs, and prefill graphs no longer than its prompt (start-up compiles no more)
        engine = _load_engine(plan.model, progress, device=plan.device, dtype=args.dtype, weights=args.weights,
                              kv_cache_tokens=plan.kv_cache_tokens, quantization=args.quantization,
                              quantize_lm_head=args.quantize_lm_head, kv_cache_dtype=args.kv_cache_dtype,
                              max_num_seqs=1,
                              prefill_graph_tokens=plan.prompt_tokens)
        ceilings, note = _ceilings(plan.device, args.no_calibrate, progress)
        settle_heap()
        request = CallRequest(messages=plan.messages, prompt=plan.prompt_text if plan.messages is None else None,
                              enable_thinking=not args.no_thinking, sampling=plan.sampling)
        with progress.during_call(engine, plan.prompt_tokens, args.max_tokens):
            result, anatomy = measure_call(engine, request, ceilings, device_why=plan.why,
                                           use_telemetry=not args.no_telemetry)
        if note:
            anatomy.notes.append(note)
        if args.kernels:
            from .probe.kernels import REPLAY_NOTE, profile_kernels

            progress.stage("profiling kernels over a replay of the call")
            anatomy.kernels = profile_kernels(engine, result.prompt_token_ids, plan.sampling)
            anatomy.notes.append(REPLAY_NOTE)
        if args.repeat:
            from .probe.call import steady_energy

            progress.stage(f"steady-state energy: the prefill and {args.repeat} decode steps repeated")
            steady_energy(engine, anatomy, args.repeat)
        if args.dram:
            from .probe.dram import DramReplay, apply_dram

            progress.stage("replaying the prefill and a decode step under Nsight Compute")
            replay = DramReplay.of(engine, result.prompt_token_ids, plan.sampling)
            del engine  # the replay builds its own engine in a child process: this one's memory goes back first
            apply_dram(anatomy, replay.measure(progress=progress.stage))
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


# ---- serve -------------------------------------------------------------------------------------------------------
def add_serve(sub) -> None:
    from .server.context import MAX_API_SERVERS

    srv = sub.add_parser("serve", help="an OpenAI-compatible server; every response carries its own anatomy",
                         description="An OpenAI-compatible server; every response carries its own anatomy.")
    srv.add_argument("model_name", nargs="?", metavar="MODEL", type=nonempty, help="as --model")
    _add_model_args(srv, "on the host, an eighth of the available memory, at most 2^30 bytes (1.07 GB)")
    srv.add_argument("--host", default="127.0.0.1", type=nonempty,
                     help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=integer(0, 65535), default=8000, help="port to listen on (default 8000)")
    srv.add_argument("--api-key", action="append", default=[], type=nonempty,
                     help="require 'Authorization: Bearer KEY' on every route but /health; repeatable, each key "
                          "owning the anatomies its calls make (default: $LLM_ANATOMY_API_KEY, else no key)")
    srv.add_argument("--api-key-file", type=input_file,
                     help="a file of API keys, one a line (blank lines and # comments skipped), as --api-key")
    srv.add_argument("--stream-interval", type=integer(1, 4096), default=1,
                     help="tokens per streamed chunk after the first (default 1: every token); larger sends fewer, "
                          "larger chunks when many streams run")
    srv.add_argument("--served-model-name", action="append", default=[], type=nonempty,
                     help="the name clients give as `model` (repeatable; default: the model's name)")
    srv.add_argument("--max-num-seqs", type=integer(1), default=64, help="most requests in one step (default 64)")
    srv.add_argument("--max-model-len", type=integer(1), help="context limit per request (default: the model's)")
    srv.add_argument("--max-num-batched-tokens", type=integer(1),
                     help="tokens forwarded per step (default: 8192, or the context if shorter); longer prompts are "
                          "prefilled in chunks")
    srv.add_argument("--mixed-steps", action="store_true",
                     help="decode the running requests in every step, prompts filling the rest of it (lower time to "
                          "first token under load; the default prefills first, in steps CUDA graphs cover)")
    srv.add_argument("--max-waiting-tokens", type=integer(0, 1_000_000), default=0,
                     help="TGI's rule: while requests decode, new prompts wait up to this many decode steps for "
                          "more to join them in one prefill step (each prefill step stops every stream's decode); "
                          "default 0: prefill in the next step")
    srv.add_argument("--waiting-served-ratio", type=real(0),
                     help="with --max-waiting-tokens: prefill at once when this many times the running requests "
                          "wait (default TGI's 1.2)")
    srv.add_argument("--gpu-memory-utilization", type=real(0, 1, low_open=True),
                     help="on a GPU, the fraction of its memory to use, in (0, 1], the KV pool taking what the rest "
                          "leaves (default 0.9); or size the pool with --kv-cache-tokens")
    srv.add_argument("--run-dir", type=output_dir, default="~/.cache/llm-anatomy/serve",
                     help="where the anatomies are kept across restarts, in anatomies.db (default "
                          "~/.cache/llm-anatomy/serve)")
    srv.add_argument("--keep-anatomies", type=integer(1), default=1000, help="newest anatomies kept (default 1000)")
    srv.add_argument("--anatomy-processes", type=integer(1, 16),
                     help="processes building the served calls' anatomies, 1 to 16 (default: one per four CPUs, up "
                          "to 4; each holds about 0.5 GB); a busy server finishes more calls than one builds, and "
                          "drops the oldest unbuilt")
    srv.add_argument("--api-server-count", type=integer(1, MAX_API_SERVERS), default=1,
                     help=f"HTTP processes taking requests in on the one port, 1 to {MAX_API_SERVERS} (default 1); "
                          "at hundreds of streams one process's parsing, tokenizing and streaming keeps the engine "
                          "waiting")
    srv.add_argument("--profile-dir", type=output_dir,
                     help="turn on POST /start_profile and /stop_profile (vLLM's): torch.profiler over the engine "
                          "core between them, each window's Chrome trace written here and summed up in the answer "
                          "(device busy and idle time, kernel time by kind); off by default")
    srv.add_argument("--max-body-bytes", type=integer(1), default=4 << 20,
                     help="request body limit in bytes (default 4194304, 4.19 MB)")
    srv.add_argument("--drain-timeout", type=real(0), default=120.0,
                     help="on SIGTERM, seconds to let in-flight requests finish (default 120)")
    _add_no_calibrate(srv)
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                     help="the server's log level (default info)")
    srv.set_defaults(handler=cmd_serve)


def _serve_preflight(args, model: str) -> str:
    """What the config alone can refuse, before any weights load. Returns the model's name."""
    from .engine.config import EngineConfig
    from .hub import resolve
    from .models.config import ModelConfig, parse_dtype

    check_precision(args)
    if args.dtype is not None:
        parse_dtype(args.dtype)
    # the scheduling settings' checks that span flags (the engine's own, made here before its process starts)
    EngineConfig(mixed_steps=args.mixed_steps, max_waiting_tokens=args.max_waiting_tokens,
                 waiting_served_ratio=args.waiting_served_ratio)
    source = resolve(model)
    context = ModelConfig.from_hf(source.config).max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > context:
        raise AnatomyError(f"--max-model-len {args.max_model_len} is more than the context of {model} ({context} "
                           f"tokens); give at most {context} or leave it out")
    return source.name


def cmd_serve(args) -> int:
    from .progress import ProgressLine
    from .server.anatomies import default_builders
    from .server.app import build_server, serve
    from .server.auth import api_keys
    from .server.core import EngineSpec

    if args.model_name and args.model:
        raise AnatomyError("give the model once: as MODEL or as --model")
    device, why = _device_and_why(args.device)
    if args.gpu_memory_utilization is not None and (device.type != "cuda" or args.kv_cache_tokens is not None):
        raise AnatomyError("--gpu-memory-utilization sizes the KV pool from GPU memory: it cannot be used "
                           + ("on the CPU" if device.type != "cuda" else "with --kv-cache-tokens")
                           + "; use --kv-cache-tokens")
    model = args.model_name or args.model or (GPU_DEFAULT_MODEL if device.type == "cuda" else CPU_DEFAULT_MODEL)
    name = _serve_preflight(args, model)
    names = tuple(args.served_model_name) or (name,)
    keys = api_keys(args.api_key, args.api_key_file, os.environ.get("LLM_ANATOMY_API_KEY"))
    # The engine is built (and the ceilings measured) in the engine core's own process: this one never touches
    # the device (server/core.py).
    spec = EngineSpec.of(model, device=args.device, dtype=args.dtype, weights=args.weights,
                         kv_cache_tokens=args.kv_cache_tokens, max_model_len=args.max_model_len,
                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         mixed_steps=args.mixed_steps, max_waiting_tokens=args.max_waiting_tokens,
                         waiting_served_ratio=args.waiting_served_ratio, quantization=args.quantization,
                         quantize_lm_head=args.quantize_lm_head, kv_cache_dtype=args.kv_cache_dtype,
                         gpu_memory_utilization=args.gpu_memory_utilization or 0.9)
    builders = args.anatomy_processes or default_builders()
    with ProgressLine() as progress:
        server, client = build_server(
            spec, host=args.host, port=args.port, model_names=names, calibrate=not args.no_calibrate,
            run_dir=args.run_dir, keep_anatomies=args.keep_anatomies, api_keys=keys,
            max_body_bytes=args.max_body_bytes, device_why=why, telemetry_hz=None if args.no_telemetry else 50.0,
            drain_timeout_s=args.drain_timeout, stream_interval=args.stream_interval,
            anatomy_processes=builders, api_server_count=args.api_server_count, log_level=args.log_level,
            profile_dir=args.profile_dir, progress=progress.stage)
    settle_heap()
    info = client.info
    http = f", {args.api_server_count} HTTP processes" if args.api_server_count > 1 else ""
    print(f"llm-anatomy: serving {names[0]} ({info.weights_label}) on http://{args.host}:{server.port}/v1{http} "
          f"- KV pool {info.admission.capacity_tokens} tokens, anatomies in {args.run_dir} (built by {builders} "
          f"process{'es' if builders > 1 else ''})", file=sys.stderr, flush=True)
    serve(server)
    return 0


# ---- calibrate ---------------------------------------------------------------------------------------------------
def add_calibrate(sub) -> None:
    cal = sub.add_parser("calibrate", help="this device's bandwidth and matmul ceilings: cached ones if fresh, "
                                           "else measured and cached",
                         description="Show this device's ceilings (read and GEMV bandwidth, the burst and sustained "
                                     "matmul rate): the cached ones if valid and fresh, else measured now and cached "
                                     "unless the device was busy.")
    cal.add_argument("--device", type=nonempty, help="cpu, cuda or cuda:N (default: cuda if there is one)")
    cal.add_argument("--quick", action="store_true", help="smaller buffers and a 2 s matmul run instead of 6 s "
                                                          "(what a call runs when nothing is cached)")
    cal.add_argument("--force", action="store_true", help="measure again even if the cache holds fresh ceilings")
    cal.set_defaults(handler=cmd_calibrate)


def cmd_calibrate(args) -> int:
    from .probe.ceilings import cache_path, format_ceilings, load_or_calibrate
    from .progress import ProgressLine

    device, _ = _device_and_why(args.device)
    with ProgressLine() as progress:
        calibration = load_or_calibrate(device, recalibrate=args.force, quick=args.quick, progress=progress.stage)
    print(format_ceilings(calibration.ceilings))
    if calibration.from_cache:
        print(f"  from the cache ({cache_path()}); `llm-anatomy calibrate --force` measures again")
    elif calibration.busy:
        print(f"  not cached: the device was busy ({'; '.join(calibration.busy)}); run again when it is idle")
        return 1
    return 0


# ---- report ------------------------------------------------------------------------------------------------------
def add_report(sub) -> None:
    rep = sub.add_parser("report", help="show a saved Anatomy JSON again, or turn it into HTML / a trace",
                         description="Show a saved Anatomy JSON again, or turn it into HTML / a trace.")
    rep.add_argument("anatomy", type=input_file, help="an anatomy written by `llm-anatomy call --json`")
    rep.add_argument("--html", type=output_file, help="write a self-contained HTML report")
    rep.add_argument("--trace", type=output_file, help="write a Perfetto / Chrome trace")
    rep.add_argument("--quiet", action="store_true", help="no terminal report")
    rep.set_defaults(handler=cmd_report)


def load_anatomy(path: Path):
    """The Anatomy in a JSON file, or an AnatomyError saying in one line why the file is not one."""
    import pydantic

    from .anatomy import SCHEMA_VERSION, Anatomy

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise AnatomyError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise AnatomyError(f"{path} is not an Anatomy JSON: it is not UTF-8 text") from None
    except (ValueError, RecursionError) as e:
        raise AnatomyError(f"{path} is not an Anatomy JSON: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise AnatomyError(f"{path} is not an Anatomy JSON: it holds a {type(data).__name__}, not an object")
    version = data.get("schema_version")
    try:
        newer = tuple(map(int, version.split("."))) > tuple(map(int, SCHEMA_VERSION.split(".")))
    except (AttributeError, ValueError):
        raise AnatomyError(f"{path} is not an Anatomy JSON: schema_version is {version!r}") from None
    if version != SCHEMA_VERSION:
        fix = "upgrade llm-anatomy" if newer else "run the call again"
        raise AnatomyError(f"{path} is an anatomy of schema_version {version}, which this llm-anatomy does not read "
                           f"(it reads {SCHEMA_VERSION}): {fix}")
    try:
        return pydantic.TypeAdapter(Anatomy).validate_python(data)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"])) or "the record"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise AnatomyError(f"{path} is not an Anatomy JSON: {where}: {first['msg']}{more}") from None


def cmd_report(args) -> int:
    _distinct_outputs(args, "html", "trace")
    _write_outputs(load_anatomy(args.anatomy), args)
    return 0


# ---- main --------------------------------------------------------------------------------------------------------
def add_bench(sub) -> None:
    from .bench.cli import add_parser

    add_parser(sub)


def add_compare(sub) -> None:
    from .compare import add_parser

    add_parser(sub)


def add_sweep(sub) -> None:
    from .sweep.cli import add_sweep_parser

    add_sweep_parser(sub)


def add_plan(sub) -> None:
    from .sweep.cli import add_plan_parser

    add_plan_parser(sub)


COMMANDS = (add_call, add_serve, add_calibrate, add_report, add_sweep, add_plan, add_bench, add_compare)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="llm-anatomy", description="One LLM API call on your own GPU, and exactly what happens "
                                                    "inside it. Units are decimal: 1 GB = 1e9 bytes, TB/s, TFLOP/s.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0), or a bad command line, already said in one line (2)
        return e.code if isinstance(e.code, int) else 0
    logging.basicConfig(level=logging.WARNING, format="llm-anatomy: %(message)s", stream=sys.stderr)
    try:
        return args.handler(args)
    except AnatomyError as e:
        print(f"llm-anatomy: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:  # the frozen heap (settle_heap) back to the collector, so that exit frees it: Triton's bindings
        gc.unfreeze()  # report every object of theirs still alive then, ~30 lines after the run


if __name__ == "__main__":
    sys.exit(main())
