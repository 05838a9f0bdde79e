"""Concurrency sweep of `llm-anatomy serve`: N concurrent streams, each a 512-token prompt and 256 output tokens.

For each concurrency level, a closed loop: that many client streams, each sending its next request as soon
as the last one ends. Clients run in several processes (one Python process parsing thousands of SSE chunks a
second would itself delay the timestamps). Reported per level: output tokens/s, TTFT / TPOT / ITL
percentiles as the client sees them, the server's own view from each call's anatomy (TTFT, batch sizes,
queueing, stalls), and the bare engine (generate_many on the same shapes, no HTTP, no anatomy) beside it.

    python3 benchmarks/serve_sweep.py --levels 1,4,16,64 --out sweep.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench_args import Parser, output_file, positive_int, positive_ints

THIS_CHECKOUT = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(length)] for _ in range(n)]  # below the special tokens


# ---- client ---------------------------------------------------------------------------------------------------------
async def _one(client: httpx.AsyncClient, url: str, model: str, ids: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, tokens, anatomy_id = [], None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        anatomy_id = r.headers.get("x-anatomy-id")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    t1 = time.perf_counter()
    ttft = times[0] - t0
    return {"ttft_s": ttft, "e2e_s": t1 - t0, "tokens": tokens, "chunks": len(times),
            "tpot_s": (times[-1] - times[0]) / (tokens - 1) if tokens and tokens > 1 else None,
            "itl_s": [b - a for a, b in zip(times, times[1:])], "anatomy_id": anatomy_id, "start": t0, "end": t1}


def _client_process(url: str, model: str, streams: list[list[list[int]]], max_tokens: int, start_at: float,
                    out) -> None:
    async def stream_worker(client, queue):
        results = []
        for ids in queue:
            results.append(await _one(client, url, model, ids, max_tokens))
        return results

    async def main():
        limits = httpx.Limits(max_connections=len(streams) + 4, max_keepalive_connections=len(streams) + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            # open every stream's connection (and warm the client's code paths) before the clock starts
            await asyncio.gather(*(client.get(url + "/v1/models") for _ in streams))
            await asyncio.sleep(max(0.0, start_at - time.time()))
            done = await asyncio.gather(*(stream_worker(client, q) for q in streams))
        return [r for rs in done for r in rs]

    out.put(asyncio.run(main()))


def run_level(url: str, model: str, concurrency: int, requests: list[list[int]], max_tokens: int) -> tuple[list, float]:
    """`concurrency` closed-loop streams over `requests`; returns per-request records and the wall time."""
    streams = [requests[i::concurrency] for i in range(concurrency)]
    procs_n = min(8, concurrency)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 3.0  # every process up before the first request
    procs = [ctx.Process(target=_client_process, args=(url, model, streams[p::procs_n], max_tokens, start_at, out))
             for p in range(procs_n)]
    for p in procs:
        p.start()
    records = [r for _ in procs for r in out.get()]
    for p in procs:
        p.join()
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    return records, wall


# ---- the bare engine ------------------------------------------------------------------------------------------------
def bare_engine(model: str, levels: list[int], prompt_len: int, max_tokens: int) -> list[dict]:
    import torch

    from llm_anatomy import Engine

    engine = Engine.from_pretrained(model, weights="synthetic", max_num_seqs=max(levels),
                                    kv_cache_tokens=max(levels) * (prompt_len + max_tokens + 16))
    out = []
    engine.generate_many(prompts(2, prompt_len, 99), max_tokens=8, temperature=0, ignore_eos=True)  # warm
    for c in levels:
        batch = prompts(c, prompt_len, 1000 + c)
        t0 = time.perf_counter()
        engine.generate_many(batch, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        wall = time.perf_counter() - t0
        out.append({"concurrency": c, "output_tok_s": c * max_tokens / wall, "wall_s": wall})
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


# ---- the server -----------------------------------------------------------------------------------------------------
def start_server(model: str, port: int, run_dir: Path, max_num_seqs: int, log: Path, extra: list[str]
                 ) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llm_anatomy.cli", "serve", model, "--weights", "synthetic", "--port", str(port),
           "--run-dir", str(run_dir), "--max-num-seqs", str(max_num_seqs), "--log-level", "warning", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(THIS_CHECKOUT), os.environ.get("PYTHONPATH"))
                                                       if p)}
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up in 600 s")


def metric(url: str, name: str) -> float | None:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("llm_anatomy:" + name):
            return float(line.rsplit(" ", 1)[1])
    return None


def server_view(url: str, records: list[dict]) -> dict:
    """What the calls' own anatomies say, from those the server still holds (its store keeps the latest ones: at
    many streams the first calls of a level may have been rotated out)."""
    anatomies, missing = [], 0
    for r in records:
        response = httpx.get(f"{url}/v1/anatomy/{r['anatomy_id']}", timeout=60)
        if response.status_code == 404:
            missing += 1
            continue
        response.raise_for_status()
        anatomies.append(response.json())
    return {"anatomies": len(anatomies), "anatomies_missing": missing, **summarize_anatomies(anatomies)}


def summarize_anatomies(anatomies: list[dict]) -> dict:
    """Medians (and some means) over a level's anatomies: phases, prefill and decode steps, batching."""
    if not anatomies:
        return {}
    batch = [s["batch_size"] for a in anatomies for s in a["decode_steps"]]
    names = ("parse", "template", "tokenize", "queue", "prefill", "decode")

    def phase(a, name):
        return next((p["end_ms"] - p["start_ms"] for p in a["phases"] if p["name"] == name), 0.0)

    return {
        "phases_ms_p50": {name: pct([phase(a, name) for a in anatomies], 50) for name in names},
        "phases_ms_p90": {name: pct([phase(a, name) for a in anatomies], 90) for name in names},
        "prefill_batch_mean": statistics.mean(a["prefill"]["batch_size"] for a in anatomies),
        "prefill_gpu_ms_p50": pct([a["prefill"]["ms"] for a in anatomies], 50),
        "host_ms_per_step_p50": pct([s["host_ms"] for a in anatomies for s in a["decode_steps"]], 50),
        "ttft_ms_p50": pct([a["ttft_ms"] for a in anatomies], 50),
        "ttft_ms_p90": pct([a["ttft_ms"] for a in anatomies], 90),
        "tpot_ms_p50": pct([a["tpot_ms"] for a in anatomies if a["tpot_ms"]], 50),
        "decode_gpu_ms_p50": pct([s["gpu_ms"] for a in anatomies for s in a["decode_steps"]], 50),
        "queue_ms_p50": pct([a["batching"]["queue_ms"] for a in anatomies], 50),
        "stall_ms_mean": statistics.mean(a["batching"]["stall_ms"] for a in anatomies),
        "prefill_steps_mean": statistics.mean(a["prefill"].get("steps", 1) for a in anatomies),
        "mixed_decode_steps_share": (sum(1 for a in anatomies for s in a["decode_steps"]
                                         if s.get("step_tokens", 1) > s["batch_size"]) / max(1, len(batch))),
        "mean_batch": statistics.mean(batch) if batch else None,
        "max_batch": max(batch) if batch else None,
        "decode_mbu_p50": pct([a["decode"]["roofline"]["mbu"] for a in anatomies if a["decode"]], 50),
    }


def render_levels(result: dict) -> str:
    """The sweep's table (markdown) and what the server said after it."""
    def fixed(value, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"{result['model']}, {result['prompt_tokens']} prompt / {result['output_tokens']} output tokens, "
             f"{result.get('device')}; server start {result['server_start_s']:.0f} s",
             "| streams | output tok/s | bare engine tok/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | "
             "ITL p99 ms | mean batch | J/token | all tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for lv in result["levels"]:
        t, p = lv["ttft_ms"], lv["tpot_ms"]
        lines.append(
            f"| {lv['concurrency']} | {lv['output_tok_s']:.0f} | {fixed(lv['bare_engine_tok_s'], 0)} | "
            f"{' / '.join(fixed(t[q], 1) for q in (50, 90, 99))} | "
            f"{' / '.join(fixed(p[q], 2) for q in (50, 90, 99))} | "
            f"{fixed(lv['itl_ms'][99], 2)} | {fixed(lv['server'].get('mean_batch'), 1)} | "
            f"{fixed(lv['joules_per_output_token'], 3)} | {lv['all_tokens']} |")
    build = result.get("anatomy_build_ms_mean")
    lines += [f"anatomy build (off the engine thread): {fixed(build, 1)} ms per call on average",
              f"after the sweep: KV cache usage {result.get('kv_cache_usage_after')}, running "
              f"{result.get('running_after')}, server exit status {result.get('server_exit')}"]
    return "\n".join(lines)


def port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"want a TCP port, 1..65535, got {text!r}")
    return int(text)


def parse_args(argv: list[str] | None):
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen/Qwen3-8B")
    ap.add_argument("--levels", type=positive_ints, default=[1, 4, 16, 64],
                    help="concurrent streams at each level, comma-separated (default 1,4,16,64)")
    ap.add_argument("--prompt-tokens", type=positive_int, default=512)
    ap.add_argument("--output-tokens", type=positive_int, default=256)
    ap.add_argument("--waves", type=positive_int, default=2, help="requests per stream at each level (default 2)")
    ap.add_argument("--port", type=port, default=8123)
    ap.add_argument("--no-baseline", action="store_true", help="skip the bare-engine comparison")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, help="passed to the server (default: its own)")
    ap.add_argument("--mixed-steps", action="store_true", help="passed to the server")
    ap.add_argument("--out", type=output_file, default=Path("serve_sweep.json"),
                    help="the results (JSON); the server's log and run directory go beside it")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(THIS_CHECKOUT))  # this checkout's llm_anatomy, as the server it starts runs it
    from llm_anatomy.errors import AnatomyError
    from llm_anatomy.hub import resolve

    try:
        resolve(args.model)
    except AnatomyError as e:
        ap.error(str(e))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    levels = args.levels
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv), "model": args.model,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "levels": []}
    try:
        import torch

        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        result["torch"] = torch.__version__
    except ImportError:
        pass
    baseline = {} if args.no_baseline else {b["concurrency"]: b for b in bare_engine(
        args.model, levels, args.prompt_tokens, args.output_tokens)}
    result["bare_engine"] = list(baseline.values())

    run_dir = args.out.parent / "serve_run"
    url = f"http://127.0.0.1:{args.port}"
    t_start = time.monotonic()
    extra = ["--max-num-batched-tokens", str(args.max_num_batched_tokens)] if args.max_num_batched_tokens else []
    extra += ["--mixed-steps"] if args.mixed_steps else []
    proc = start_server(args.model, args.port, run_dir, max(levels), args.out.parent / "server.log", extra)
    result["server_start_s"] = time.monotonic() - t_start
    try:
        run_level(url, args.model, 2, prompts(2, args.prompt_tokens, 7), 16)  # warm the path end to end
        for c in levels:
            requests = prompts(c * args.waves, args.prompt_tokens, 2000 + c)
            energy0 = metric(url, "gpu_energy_joules_total")
            records, wall = run_level(url, args.model, c, requests, args.output_tokens)
            energy1 = metric(url, "gpu_energy_joules_total")
            tokens = sum(r["tokens"] for r in records)
            itl = [x for r in records for x in r["itl_s"]]
            level = {
                "concurrency": c, "requests": len(records), "wall_s": wall, "output_tok_s": tokens / wall,
                "all_tokens": all(r["tokens"] == args.output_tokens for r in records),
                "ttft_ms": {q: pct([r["ttft_s"] * 1e3 for r in records], q) for q in (50, 90, 99)},
                "tpot_ms": {q: pct([r["tpot_s"] * 1e3 for r in records if r["tpot_s"]], q) for q in (50, 90, 99)},
                "itl_ms": {q: pct([x * 1e3 for x in itl], q) for q in (50, 90, 99)},
                "joules_per_output_token": (energy1 - energy0) / tokens if energy0 is not None and energy1 else None,
                "server": server_view(url, records),
                "bare_engine_tok_s": baseline.get(c, {}).get("output_tok_s"),
            }
            result["levels"].append(level)
            print(f"c={c}: {level['output_tok_s']:.0f} tok/s, TTFT p50 {level['ttft_ms'][50]:.1f} ms, "
                  f"TPOT p50 {level['tpot_ms'][50]:.2f} ms", flush=True)
        builds = metric(url, "anatomy_build_seconds_count")
        result["anatomy_build_ms_mean"] = 1e3 * metric(url, "anatomy_build_seconds_sum") / builds if builds else None
        result["kv_cache_usage_after"] = metric(url, "kv_cache_usage_perc")
        result["running_after"] = metric(url, "num_requests_running")
    finally:
        proc.terminate()
        result["server_exit"] = proc.wait(120)
    args.out.write_text(json.dumps(result, indent=1))

    print("\n" + render_levels(result))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
