"""The `sweep` and `plan` commands: llm_anatomy/cli.py registers them with add_sweep_parser and add_plan_parser."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GPU_DEFAULT_MODEL = "Qwen/Qwen3-8B"
CPU_DEFAULT_MODEL = "Qwen/Qwen3-0.6B"


def add_sweep_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sweep", help="measure a grid of prompt lengths, batch sizes, output lengths and "
                                            "precisions; report and plots in --out")
    p.add_argument("model_name", nargs="?", metavar="MODEL", help="as --model")
    p.add_argument("--model", help=f"hub id, preset or checkpoint dir (default: {GPU_DEFAULT_MODEL} on a CUDA GPU, "
                                   f"{CPU_DEFAULT_MODEL} without one)")
    p.add_argument("--weights", default="auto", help="auto (real if found locally, else synthetic), synthetic, or DIR")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if there is one)")
    p.add_argument("--dtype", help="bfloat16, float16 or float32 (default: the model's)")
    g = p.add_argument_group("axes (lists: 128,512,2048 or ranges 128..32768, doubling)")
    g.add_argument("--prompt-tokens", default="128,512,2048,8192", help="prompt lengths (default 128,512,2048,8192)")
    g.add_argument("--batch", default="1,4,16,64", help="sequences run together (default 1,4,16,64)")
    g.add_argument("--output-tokens", default="128", help="tokens generated per sequence (default 128)")
    g.add_argument("--quantization", default="bf16", help="weights: bf16 and/or fp8, e.g. bf16,fp8 (default bf16)")
    g.add_argument("--kv-cache-dtype", default="auto", help="KV cache: auto and/or fp8 (default auto: the model's)")
    e = p.add_argument_group("engine")
    e.add_argument("--kv-cache-tokens", type=int, help="size the KV pool for this many tokens (default: free memory "
                                                       "on a GPU; the largest point on the host)")
    e.add_argument("--gpu-memory-utilization", type=float, help="fraction of GPU memory the engine may use "
                                                                "(default 0.9)")
    e.add_argument("--max-num-batched-tokens", type=int, help="tokens forwarded per step (default 8192)")
    e.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights and the prompts (default 0)")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path("llm-anatomy-sweep"),
                   help="results directory: sweep.jsonl (resumed), sweep.html, anatomies/ (default ./llm-anatomy-sweep)")
    o.add_argument("--fresh", action="store_true", help="discard the results already in --out and start over")
    o.add_argument("--energy-seconds", type=float, default=1.0,
                   help="measure each phase's energy over at least this long, repeating a short one back to back "
                        "(default 1.0; 0: no energy figures)")
    o.add_argument("--no-telemetry", action="store_true", help="do not sample GPU counters (no energy figures)")
    o.add_argument("--no-calibrate", action="store_true",
                   help="do not measure this device's ceilings if none are cached (datasheet only)")
    o.add_argument("--quiet", action="store_true", help="no tables in the terminal")
    p.set_defaults(handler=cmd_sweep)
    return p


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    from ..gpus import gpus

    p = subparsers.add_parser("plan", help="predict TTFT, TPOT, batch and capacity for a Qwen3 size on another GPU")
    p.add_argument("--gpu", required=True, help=f"a GPU of the table ({', '.join(gpus())})")
    p.add_argument("--model", required=True, help="a Qwen3 size (Qwen3-0.6B .. Qwen3-32B), hub id or config dir")
    p.add_argument("--context", type=int,
                   help="context limit per sequence, and the context TPOT is predicted at (default 4096, or the "
                        "model's if shorter)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together for TPOT (default 1)")
    p.add_argument("--prompt-tokens", type=int, help="prompt length for TTFT (default 1024, or --context if shorter)")
    p.add_argument("--quantization", default="bf16", help="bf16 or fp8 weights (default bf16)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8 (default auto)")
    p.add_argument("--tpot-ms", type=float, help="find the largest batch whose TPOT at --context meets this")
    p.add_argument("--ttft-ms", type=float, help="find the largest batch of --prompt-tokens prompts, queued together, "
                                                 "whose last TTFT meets this")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory the engine may use (default 0.9)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per prefill step (default 8192)")
    p.add_argument("--from-sweep", type=Path, help="fit the efficiencies to this sweep's results (its --out)")
    p.add_argument("--json", action="store_true", help="print the answer as one JSON object")
    p.set_defaults(handler=cmd_plan)
    return p


def cmd_sweep(args) -> int:
    from rich.console import Console

    from ..engine.engine import parse_device
    from ..errors import AnatomyError
    from .grid import Grid
    from .report import write_report
    from .run import SweepOptions, run_sweep

    if args.model_name and args.model:
        raise AnatomyError("give the model once: as MODEL or as --model")
    grid = Grid.parse(args.prompt_tokens, args.batch, args.output_tokens, args.quantization, args.kv_cache_dtype)
    device = parse_device(args.device)
    model = args.model_name or args.model or (GPU_DEFAULT_MODEL if device.type == "cuda" else CPU_DEFAULT_MODEL)
    options = SweepOptions(model=model, weights=args.weights, device=args.device, dtype=args.dtype,
                           kv_cache_tokens=args.kv_cache_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
                           max_num_batched_tokens=args.max_num_batched_tokens, energy_seconds=args.energy_seconds,
                           telemetry=not args.no_telemetry, calibrate=not args.no_calibrate, seed=args.seed)
    meta, records = run_sweep(grid, options, args.out, fresh=args.fresh, console=Console(stderr=True))
    write_report(args.out, meta, records, None if args.quiet else Console())
    print(f"wrote {args.out / 'sweep.jsonl'} ({len(records)} points), {args.out / 'sweep.html'}", file=sys.stderr)
    return 0


def cmd_plan(args) -> int:
    from .plan import plan

    answer = plan(args.gpu, args.model, context=args.context, batch=args.batch, prompt_tokens=args.prompt_tokens,
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, tpot_ms=args.tpot_ms,
                  ttft_ms=args.ttft_ms, from_sweep=args.from_sweep,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    if args.json:
        print(json.dumps(answer, indent=1, allow_nan=False))
    else:
        print_plan(answer)
    return 0


def print_plan(a: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m = a["memory"]
    console.rule(f"[bold]llm-anatomy plan[/bold] · {a['model']} ({a['precision']['label']}) on "
                 f"{a['gpu_datasheet']['name']}")
    t = Table.grid(padding=(0, 2))
    t.add_row("Fits", "yes" if a["fits"] else f"no: {a.get('why_not', '')}")
    t.add_row("TTFT", f"{a['ttft_ms']:.2f} ms for a {a['prompt_tokens']}-token prompt")
    t.add_row("TPOT", f"{a['tpot_ms']:.3f} ms at batch {a['batch']}, context {a['context']} "
                      f"({a['output_tokens_per_s']:,.0f} output tok/s)")
    for key, what in (("max_batch_for_tpot", "TPOT"), ("max_batch_for_ttft", "TTFT")):
        if key in a:
            target = a[key][f"{what.lower()}_ms"]
            t.add_row(f"{what} <= {target:g} ms", f"largest batch {a[key]['batch']}")
    t.add_row("Capacity", f"{a['max_concurrent_sequences']:,} concurrent sequences of {a['context']} tokens "
                          f"({a['kv_bytes_per_token']:,} KV bytes per token)")
    t.add_row("Memory", f"{m['memory_bytes'] / 1e9:.2f} GB x {m['gpu_memory_utilization']:.0%} = "
                        f"{m['usable_bytes'] / 1e9:.2f} GB: weights {m['weights_bytes'] / 1e9:.2f}, runtime "
                        f"{m['runtime_bytes'] / 1e9:.2f}, activations {m['activations_bytes'] / 1e9:.2f}, KV "
                        f"{max(m['kv_budget_bytes'], 0) / 1e9:.2f} GB")
    t.add_row("Energy", f"at most {a['energy_per_output_token_j_max']:.3f} J per output token (board power bound)")
    console.print(t)
    console.print("[bold]Assumptions[/bold]")
    for line in a["assumptions"]:
        console.print(f"  - {line}")
