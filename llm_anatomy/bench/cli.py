"""The `bench` subcommand: its flags (add_parser), their checks (config_from_args) and its handler (cmd_bench).

Every flag is checked before any request is sent; a bad one is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import AnatomyError

# Only the standard library at import time: the main CLI imports this module to list its commands, and the
# client's libraries (aiohttp, numpy, rich) cost seconds to import.

HELP = "load-test any OpenAI-compatible server (vLLM, SGLang, TGI, llm-anatomy) as vLLM's benchmark measures it"


class _OneLineParser(argparse.ArgumentParser):
    """Flag errors as one line and exit status 2 (argparse's own error prints the whole usage first); flags spelt
    in full (a prefix is an error, not a guess)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"llm-anatomy bench: error: {message}", file=sys.stderr)
        sys.exit(2)


def _define(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", metavar="URL", help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--model", help="the model to ask for (default: the first the server lists in /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="completions: /v1/completions, random prompts sent as token ids (default); chat: "
                        "/v1/chat/completions, random prompts sent as text")
    load = p.add_argument_group("load (one level per value)")
    load.add_argument("--concurrency", metavar="LIST",
                      help="closed loop: this many streams, each sending its next request when its last ends, "
                           "e.g. 1,64,256 (default 1,16,64)")
    load.add_argument("--request-rate", metavar="LIST",
                      help="open loop: Poisson arrivals at this many requests/s, e.g. 2,8 (instead of --concurrency)")
    load.add_argument("--num-prompts", metavar="N", help="requests per level (default: 4 x the concurrency, at "
                                                         "least 100; open loop: 30 s of arrivals, at least 50)")
    load.add_argument("--seed", metavar="N", default="0", help="seeds the prompts and the arrivals (default 0)")
    prompts = p.add_argument_group("prompts")
    prompts.add_argument("--input-tokens", metavar="N", help="random prompts of N tokens (default 128)")
    prompts.add_argument("--output-tokens", metavar="N",
                         help="max_tokens of every request (default 128; with --dataset, each entry's own length)")
    prompts.add_argument("--dataset", metavar="FILE", type=Path,
                         help="JSONL of prompts: {\"prompt\": ...} or ShareGPT's {\"conversations\": [...]} "
                              "(a JSON array of them is read too)")
    prompts.add_argument("--token-id-range", metavar="LO,HI", default="1000,30000",
                         help="random prompt token ids are drawn from [LO, HI) (default 1000,30000: inside every "
                              "common vocabulary, clear of special tokens)")
    prompts.add_argument("--no-ignore-eos", action="store_true",
                         help="let the model stop at its end-of-sequence token (default: ignore_eos is sent, "
                              "where the server accepts it, so that every request writes --output-tokens)")
    measure = p.add_argument_group("measurement")
    measure.add_argument("--slo", metavar="SPEC", help="goodput: requests meeting every limit, e.g. "
                                                       "ttft_ms=500,tpot_ms=50 (also e2e_ms)")
    measure.add_argument("--timeout", metavar="S", default="600",
                         help="a request fails after S seconds without a byte from the server (default 600)")
    measure.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                         help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    measure.add_argument("--anatomy", action="store_true",
                         help="llm-anatomy servers: join each request's server-side anatomy to its client timing")
    measure.add_argument("--gpus", metavar="LIST",
                         help="NVML indices of the GPUs whose energy to read, or 'none' (default: all, when the "
                              "server is on this machine)")
    measure.add_argument("--profile", action="store_true",
                         help="the server's profiler on during each level (POST /start_profile before it, "
                              "/stop_profile after, as `vllm bench serve --profile`): llm-anatomy started with "
                              "--profile-dir (its answer, the device's busy time, goes in the level), vLLM with its "
                              "profiler on; the level's figures then include the profiler's cost")
    measure.add_argument("--scrape-interval", metavar="S", default="1",
                         help="seconds between scrapes of the server's /metrics during a level (default 1; 0: "
                              "only before and after)")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", type=Path, help="write one object per level")
    out.add_argument("--html", metavar="PATH", type=Path, help="write a self-contained HTML report with plots")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` on the main parser's subparsers; its handler is cmd_bench."""
    p = subparsers.add_parser("bench", help=HELP, description=HELP)
    p.error = _OneLineParser.error.__get__(p)  # this subparser's own flag errors as one line
    _define(p)
    p.set_defaults(handler=cmd_bench)
    return p


def standalone_parser() -> argparse.ArgumentParser:
    """`python -m llm_anatomy.bench URL ...`: the same flags without the main CLI."""
    p = _OneLineParser(prog="llm-anatomy bench", description=HELP)
    _define(p)
    return p


# ----------------------------------------------------------------------------- checks

def _int(flag: str, text: str | None, low: int) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise AnatomyError(f"{flag} must be an integer, got {text!r}") from None
    if value < low:
        raise AnatomyError(f"{flag} must be >= {low}, got {value}")
    return value


def _seconds(flag: str, text: str, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise AnatomyError(f"{flag} must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise AnatomyError(f"{flag} must be {'>= 0' if allow_zero else '> 0'} seconds, got {text}")
    return value


def _list(flag: str, text: str, parse, check, what: str, unique: bool = True) -> tuple:
    values = []
    for part in text.split(","):
        try:
            value = parse(part.strip())
        except ValueError:
            raise AnatomyError(f"{flag} takes a comma-separated list of {what}, got {text!r}") from None
        if not check(value):
            raise AnatomyError(f"{flag} values must be {what}, got {part.strip()}")
        values.append(value)
    if unique and len(set(values)) != len(values):
        raise AnatomyError(f"{flag} lists a value twice: {text}")
    return tuple(values)


def _levels(args) -> tuple:
    from .load import Level

    if args.concurrency is not None and args.request_rate is not None:
        raise AnatomyError("give --concurrency (closed loop) or --request-rate (open loop), not both")
    if args.request_rate is not None:
        rates = _list("--request-rate", args.request_rate, float, lambda v: math.isfinite(v) and v > 0,
                      "requests/s > 0")
        return tuple(Level(request_rate=r) for r in rates)
    streams = _list("--concurrency", args.concurrency or "1,16,64", int, lambda v: 1 <= v <= 100_000,
                    "integers in 1..100000")
    return tuple(Level(concurrency=c) for c in streams)


def _base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise AnatomyError(f"URL must look like http://HOST:PORT, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise AnatomyError(f"URL has a bad port: {url!r}") from None
    if parts.query or parts.fragment:
        raise AnatomyError(f"URL must not carry a query or fragment: {url!r}")
    path = parts.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path}"


def is_local(host: str) -> bool:
    """Whether HOST is this machine: a loopback address, or one of this host's own names or addresses."""
    try:
        if ipaddress.ip_address(host).is_loopback or host in ("0.0.0.0", "::"):
            return True
    except ValueError:
        if host == "localhost":
            return True
    try:
        own = {socket.gethostname(), socket.getfqdn()}
        if host in own:
            return True
        addresses = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
        return host in addresses
    except OSError:
        return False


def _writable(flag: str, path: Path | None) -> None:
    if path is None:
        return
    if path.is_dir():
        raise AnatomyError(f"{flag} {path} is a directory: give a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise AnatomyError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise AnatomyError(f"{flag} {path}: the directory {parent} is not writable")


def config_from_args(args):
    """A BenchConfig with every flag checked, before any request."""
    from .metrics import parse_slo
    from .runner import BenchConfig

    levels = _levels(args)
    num_prompts = _int("--num-prompts", args.num_prompts, 1)
    most = max((lv.concurrency or 0) for lv in levels)
    if num_prompts is not None and num_prompts < most:
        raise AnatomyError(f"--num-prompts {num_prompts} is below --concurrency {most}: that level would never "
                           f"have {most} requests in flight")
    if args.dataset is not None and args.input_tokens is not None:
        raise AnatomyError("--input-tokens sizes random prompts: it cannot be used with --dataset")
    if args.dataset is not None and not args.dataset.is_file():
        raise AnatomyError(f"--dataset {args.dataset} is not a file")
    lo_hi = _list("--token-id-range", args.token_id_range, int, lambda v: v >= 0, "integers >= 0", unique=False)
    if len(lo_hi) != 2 or lo_hi[0] >= lo_hi[1]:
        raise AnatomyError(f"--token-id-range takes LO,HI with LO < HI, got {args.token_id_range!r}")
    gpus, gpu_energy = None, True
    if args.gpus is not None:
        if args.gpus.strip().lower() == "none":
            gpu_energy = False
        else:
            gpus = _list("--gpus", args.gpus, int, lambda v: v >= 0, "NVML indices >= 0 (or 'none')")
    if args.api_key is not None and not args.api_key.strip():
        raise AnatomyError("--api-key is empty: give a key, or leave it out")
    _writable("--json", args.json)
    _writable("--html", args.html)
    url = _base_url(args.url)
    return BenchConfig(
        url=url, levels=levels, model=args.model, endpoint=args.endpoint, num_prompts=num_prompts,
        input_tokens=_int("--input-tokens", args.input_tokens, 1) or 128,
        output_tokens=_int("--output-tokens", args.output_tokens, 1), dataset=args.dataset,
        token_id_range=lo_hi, seed=_int("--seed", args.seed, 0), slo=parse_slo(args.slo) if args.slo else None,
        timeout_s=_seconds("--timeout", args.timeout, allow_zero=False), api_key=args.api_key,
        ignore_eos=not args.no_ignore_eos, anatomy=args.anatomy, gpus=gpus, gpu_energy=gpu_energy,
        local_server=is_local(urlsplit(url).hostname), scrape_interval_s=_seconds(
            "--scrape-interval", args.scrape_interval, allow_zero=True), profile=args.profile)


def _allow_open_files(config) -> None:
    """Each stream holds a connection: raise this process's open-file limit to fit the largest level, or say
    how before any request is sent."""
    import resource

    streams = max((lv.concurrency or 0) for lv in config.levels) or 1024  # an open loop: no fixed bound
    needed = streams + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise AnatomyError(f"{streams} streams need about {needed} open files; this shell allows {hard}: raise it "
                           f"with `ulimit -n {needed}`")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def cmd_bench(args) -> int:
    """Run the benchmark the flags describe; exit status 0, or 1 if no request at all succeeded."""
    import asyncio

    from rich.console import Console

    from .report import print_report, write_html, write_json
    from .runner import run_bench

    config = config_from_args(args)
    _allow_open_files(config)
    run = asyncio.run(run_bench(config, Console(stderr=True)))
    print_report(run)
    if args.json:
        write_json(run, args.json)
        print(f"wrote json: {args.json}", file=sys.stderr)
    if args.html:
        write_html(run, args.html)
        print(f"wrote html: {args.html}", file=sys.stderr)
    if not any(lv["completed"] for lv in run.levels):
        print("llm-anatomy bench: every request failed (reasons above)", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = standalone_parser().parse_args(argv)
    try:
        return cmd_bench(args)
    except AnatomyError as e:
        print(f"llm-anatomy bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
