"""Concurrency sweep of `llm-anatomy serve` beside the bare engine, in one run: for each request shape (prompt /
output tokens) and each level of concurrent streams, the engine alone (generate_many, no HTTP, no anatomy: one
batch of that many prompts, and then the server's very workload as a closed loop on the engine itself) and then
the server under a closed loop of that many streams, each sending its next request as soon as the last one
ends, through the official openai client (retries off, so every failure counts). A closed loop's streams drift
apart and its last round ends one stream at a time, the batch emptying, where one batch ends all at once: each
level also gives the tok/s while every stream was busy ("steady") and how long that drain took.

Clients run in several processes (one Python process parsing thousands of SSE chunks a second would itself
delay the timestamps; each level reports the busiest one's CPU share). Reported per level: output tokens/s of both
and their ratio, failed requests and why, TTFT / TPOT / ITL percentiles as the client sees them, and the server's
own view from a sample of the calls' anatomies (TTFT, batch sizes, queueing, stalls), with each sampled client
TTFT split into its arrival at the server (the client's own send, then the way to the server's handler), the
server's TTFT and the first token's way back. `--bench-prompts N`
also runs the product's load generator (`llm-anatomy bench --anatomy`) against the same server at the largest
level, with each request's TTFT split the same way. The clients share the host with the server unless
`--server-cpus` and `--client-cpus` keep them apart (as clients on a host of their own would be). A short table
comes last; --out holds all.

    python3 benchmarks/serve_sweep.py --levels 1,64,256,512 --shapes 128/128,512/256 --requests-per-stream 4 \
        --out sweep.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench_args import (Parser, as_cpu_list, cpu_list, non_negative_real, output_file, positive_int, positive_ints,
                        positive_real)

THIS_CHECKOUT = Path(__file__).resolve().parents[1]
WINDOW_S = 5.0  # the windows of a level's output tok/s over time (by_window)
STORE_KEEPS = 1000  # the anatomies a server keeps (serve's --keep-anatomies default, which the sweep leaves)
CLIENT_START_S = 3.0  # a level's clients start sending this long after they are started (all of them up first)
PROFILE_DELAY_S = 5.0  # --profile-seconds: a level's window opens this long after its first requests


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(length)] for _ in range(n)]  # below the special tokens


def level_requests(concurrency: int, per_stream: int, length: int) -> list[list[int]]:
    """A level's requests, the same for the server and the bare engine's closed loop."""
    return prompts(concurrency * per_stream, length, 2000 + concurrency)


# ---- client ---------------------------------------------------------------------------------------------------------
# The request's marks, set by _one for httpx's request hook (each stream's requests run in a task of its own)
_MARKS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("marks", default=None)


async def _on_request(request) -> None:
    """httpx's request hook, run as httpx starts sending a built request: the client's own work on it (the openai
    client's, its event loop's wait) ends here, the part of its arrival that the server has no part in."""
    marks = _MARKS.get()
    if marks is not None:
        marks["handed_unix"] = time.time()


async def _one(client, model: str, ids: list[int], max_tokens: int) -> dict:
    """One streamed completion through the openai client; a failure is a record with its reason, not a raise."""
    t0, sent_unix = time.perf_counter(), time.time()
    marks = {}
    _MARKS.set(marks)
    times, tokens, anatomy_id = [], None, None
    try:
        # the token ids go in extra_body, which the client sends as it is: as `prompt` it walks them one by one
        # (about 17 us an id, 2 ms a 128-token prompt: a process's streams that end in the same step then
        # wait on each other before anything is sent, measured as "arrival"); the body sent is the same
        raw = await client.completions.with_raw_response.create(
            model=model, prompt="", max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"prompt": ids, "ignore_eos": True})
        anatomy_id = raw.headers.get("x-anatomy-id")
        async for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
    except Exception as e:  # noqa: BLE001 - counted and reported per level
        return {"error": f"{type(e).__name__}: {e}"[:200], "start": t0, "end": time.perf_counter(), "tokens": 0}
    t1 = time.perf_counter()
    if not times or tokens is None:
        return {"error": "the stream ended without text or usage", "start": t0, "end": t1, "tokens": tokens or 0}
    return {"ttft_s": times[0] - t0, "e2e_s": t1 - t0, "tokens": tokens, "chunks": len(times), "times": times,
            "tpot_s": (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else None,
            "itl_s": [b - a for a, b in zip(times, times[1:])], "anatomy_id": anatomy_id, "sent_unix": sent_unix,
            "handed_unix": marks.get("handed_unix"), "start": t0, "end": t1}


def _client_process(url: str, model: str, streams: list[tuple[int, list[list[int]]]], max_tokens: int,
                    start_at: float, out, cpus: set[int] | None = None) -> None:
    import httpx
    import openai

    if cpus:  # before any work: the clients keep to their CPUs, as on a host of their own
        os.sched_setaffinity(0, cpus)

    async def stream_worker(client, number, queue):
        return [{**await _one(client, model, ids, max_tokens), "stream": number} for ids in queue]

    async def main():
        limits = httpx.Limits(max_connections=len(streams) + 4, max_keepalive_connections=len(streams) + 4)
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600,
                                      http_client=openai.DefaultAsyncHttpxClient(
                                          limits=limits, event_hooks={"request": [_on_request]})) as client:
            # open every stream's connection (and warm the client's code paths) before the clock starts
            await asyncio.gather(*(client.models.list() for _ in streams))
            await asyncio.sleep(max(0.0, start_at - time.time()))
            wall, cpu = time.perf_counter(), time.process_time()
            done = await asyncio.gather(*(stream_worker(client, n, q) for n, q in streams))
            busy = (time.process_time() - cpu) / (time.perf_counter() - wall)
        return [r for rs in done for r in rs], busy, sorted(os.sched_getaffinity(0))

    out.put(asyncio.run(main()))


def run_level(url: str, model: str, concurrency: int, requests: list[list[int]], max_tokens: int,
              processes: int = 8, cpus: set[int] | None = None) -> tuple[list, float, list[float], list[list[int]]]:
    """`concurrency` closed-loop streams over `requests`, split over `processes` client processes (at most one a
    stream), each kept to `cpus` when given; returns per-request records, the wall time, each client process's CPU
    share while it ran (near 1: that client's own work may be what paced its streams) and the CPUs it ran on."""
    streams = list(enumerate(closed_loop_streams(requests, concurrency)))
    procs_n = min(processes, concurrency)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + CLIENT_START_S  # every process up before the first request
    procs = [ctx.Process(target=_client_process, args=(url, model, streams[p::procs_n], max_tokens, start_at, out,
                                                                 cpus))
             for p in range(procs_n)]
    for p in procs:
        p.start()
    done = [out.get() for _ in procs]
    for p in procs:
        p.join()
    records = [r for rs, _, _ in done for r in rs]
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    return records, wall, [busy for _, busy, _ in done], [ran_on for _, _, ran_on in done]


def closed_loop_streams(requests: list, concurrency: int) -> list[list]:
    """The requests each of `concurrency` streams sends in turn (the server's clients and the engine's loop alike)."""
    return [requests[i::concurrency] for i in range(concurrency)]


def steady(first_sends: list[float], last_ends: list[float], tokens_at: list[tuple[float, float]]) -> dict:
    """Output tok/s while every stream of a closed loop had a request in flight: from the last stream's first
    send to the first stream's last answer. Left out: the drain after it, where the last round's streams end one
    by one and the batch empties (a bare-engine batch ends all at once and has none). `tokens_at`: (time,
    output tokens) as they came."""
    start, end = max(first_sends), min(last_ends)
    if end <= start:
        return {"steady_s": 0.0, "steady_tok_s": None, "drain_s": max(last_ends) - end}
    tokens = sum(n for t, n in tokens_at if start <= t <= end)
    return {"steady_s": end - start, "steady_tok_s": tokens / (end - start), "drain_s": max(last_ends) - end}


def by_window(tokens_at: list[tuple[float, float]], start: float, seconds: float = WINDOW_S) -> list[float]:
    """Output tok/s in each whole window of `seconds` from `start` (the part after the last whole one is left out):
    a server that slows as a run goes on shows here, where a level's one figure averages it away."""
    if not tokens_at:
        return []
    sums = [0.0] * int((max(t for t, _ in tokens_at) - start) // seconds)
    for t, n in tokens_at:
        i = int((t - start) // seconds)
        if 0 <= i < len(sums):
            sums[i] += n
    return [x / seconds for x in sums]


def client_steady(records: list[dict]) -> dict:
    """`steady` over a level's client records (each with its stream, send, end and the chunks' arrival times), and
    the level's output tok/s window by window from its first send (`by_window`)."""
    first, last = {}, {}
    for r in records:
        first[r["stream"]] = min(first.get(r["stream"], r["start"]), r["start"])
        last[r["stream"]] = max(last.get(r["stream"], r["end"]), r["end"])
    tokens_at = [(t, r["tokens"] / len(r["times"])) for r in records if r.get("times") for t in r["times"]]
    return {**steady(list(first.values()), list(last.values()), tokens_at), "window_s": WINDOW_S,
            "tok_s_by_window": by_window(tokens_at, min(first.values(), default=0.0))}


# ---- the bare engine ------------------------------------------------------------------------------------------------
def engine_closed_loop(engine, streams: list[list[list[int]]], max_tokens: int, window=None) -> dict:
    """The server's workload on the bare engine: each stream's next request added as soon as its last one ends
    (no HTTP, no client between them), timed to the last token, with its `steady` part. `window`: (ProfileWindow,
    seconds) profiles that long from PROFILE_DELAY_S in, as the server's window of the same level."""
    import torch

    params = engine.sampling_params(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    profiled, opened, (profile, profile_s) = None, False, window or (None, 0.0)
    t0 = time.perf_counter()
    queues = [list(q) for q in streams]
    running = {n: engine.add_request(q.pop(0), params) for n, q in enumerate(queues)}
    first = dict.fromkeys(running, t0)
    last, tokens_at, emitted, total = {}, [], dict.fromkeys(running, 0), 0
    steps, forwarded = 0, sum(len(r) + max_tokens - 1 for q in streams for r in q)  # each request's P + T - 1
    while running:
        steps += bool(engine.step())
        now, step_tokens = time.perf_counter(), 0
        for n, seq in list(running.items()):
            produced = len(seq.output_token_ids)
            step_tokens += produced - emitted[n]
            emitted[n] = produced
            if seq.finished:
                total += produced
                if queues[n]:
                    running[n], emitted[n] = engine.add_request(queues[n].pop(0), params), 0
                else:
                    del running[n]
                    last[n] = now
        tokens_at.append((now, step_tokens))
        if profile is not None and not opened and now - t0 >= PROFILE_DELAY_S:
            profile.start()
            opened = True
        elif profile is not None and profile.running and (now - t0 >= PROFILE_DELAY_S + profile_s or not running):
            profile.cut()  # here, as the server's core does between steps; its trace is written after the loop
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if profile is not None and profile.has_window:
        profiled = profile.stop()  # the trace written after the clock (seconds, for a busy window)
    return {"output_tok_s": total / wall, "wall_s": wall, "engine_steps_per_s": steps / wall,
            "tokens_per_step_mean": forwarded / steps if steps else None,
            **steady(list(first.values()), list(last.values()), tokens_at),
            **({"profile": profiled} if profile is not None else {})}


def bare_engine(model: str, levels: list[int], shapes: list[tuple[int, int]], settings: dict,
                requests_per_stream: int, profile_dir: Path | None = None, profile_s: float = 0.0) -> list[dict]:
    """Per shape and level: that many prompts at once through generate_many, timed to the last token (one batch,
    ending together); then the same closed loop of streams the server gets (`engine_closed_loop`), with a profile
    window in `profile_dir` when given."""
    import torch

    from llm_anatomy import Engine
    from llm_anatomy.probe.timeline import ProfileWindow

    longest = max(p + o for p, o in shapes)
    engine = Engine.from_pretrained(model, weights="synthetic", max_num_seqs=max(levels),
                                    kv_cache_tokens=max(levels) * (longest + 16), **settings)
    out = []
    for prompt_len, _ in shapes:  # warm each prompt length's path (kernels, attention plans) before timing
        engine.generate_many(prompts(2, prompt_len, 99), max_tokens=8, temperature=0, ignore_eos=True)
    for prompt_len, max_tokens in shapes:
        for c in levels:
            batch = prompts(c, prompt_len, 1000 + c)
            t0 = time.perf_counter()
            engine.generate_many(batch, max_tokens=max_tokens, temperature=0, ignore_eos=True)
            wall = time.perf_counter() - t0
            window = (ProfileWindow(profile_dir, engine.device, name=f"bare-{prompt_len}-{max_tokens}-c{c}"),
                      profile_s) if profile_dir is not None else None
            looped = engine_closed_loop(engine, closed_loop_streams(
                level_requests(c, requests_per_stream, prompt_len), c), max_tokens, window)
            out.append({"shape": f"{prompt_len}/{max_tokens}", "concurrency": c,
                        "output_tok_s": c * max_tokens / wall, "wall_s": wall, "closed_loop": looped})
            print(f"engine {prompt_len}/{max_tokens} c={c}: {out[-1]['output_tok_s']:.0f} tok/s one batch, "
                  f"{looped['output_tok_s']:.0f} in a closed loop", flush=True)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


# ---- the server -----------------------------------------------------------------------------------------------------
def checkout_env() -> dict:
    """This process's environment with this checkout first on PYTHONPATH (what the children import)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(THIS_CHECKOUT), os.environ.get("PYTHONPATH"))
                                                         if p)}


def start_server(model: str, port: int, run_dir: Path, max_num_seqs: int, log: Path, extra: list[str]
                 ) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llm_anatomy.cli", "serve", model, "--weights", "synthetic", "--port", str(port),
           "--run-dir", str(run_dir), "--max-num-seqs", str(max_num_seqs), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=checkout_env())
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


def sampled(records: list, sample: int | None, held: int) -> list:
    """`sample` records spread evenly over the last `held` (those whose anatomies the store may still hold), the
    first and the last among them: the level's last calls alone are its drain, where the batch empties."""
    # nine tenths of them: the store keeps the newest by when each anatomy was stored, which several builders and
    # HTTP processes reorder slightly against when the clients saw the calls end
    recent = records[-max(1, held * 9 // 10):]
    if sample is None or sample >= len(recent):
        return recent
    if sample == 1:
        return recent[-1:]
    return [recent[round(i * (len(recent) - 1) / (sample - 1))] for i in range(sample)]


def server_view(url: str, records: list[dict], sample: int | None = None, held: int = STORE_KEEPS) -> dict:
    """What the calls' own anatomies say, from those the server still holds (its store keeps the latest `held`:
    at many streams the first calls of a level may have been rotated out, or never built: a busy server drops the
    oldest unbuilt ones). `sample`: read only that many, spread over the level's calls the store may still hold
    (each read has the server build it).
    Beside them, where each client's TTFT went (clients and server on one host, so their wall clocks agree):
    `arrival_ms` and `delivery_ms` around the server's TTFT, as `llm-anatomy bench --anatomy` splits it
    (bench.join.ttft_split), and the arrival itself split where the client handed the request to its connection:
    `client_send_ms` (the client's own work and its event loop's wait) and `to_server_ms` (the network, the
    server's accept and parse, its event loop's wait, up to the handler's start)."""
    from llm_anatomy.bench.join import arrival_split, ttft_split

    anatomies, missing, arrival, delivery, client_send, to_server = [], 0, [], [], [], []
    # in the order they finished, as the store rotates them (the clients return theirs stream by stream: the last
    # `held` of that order reach back to each stream's first requests, long rotated out at many streams)
    records = sorted((r for r in records if r.get("anatomy_id")), key=lambda r: r.get("end", 0.0))
    for r in sampled(records, sample, held):
        response = httpx.get(f"{url}/v1/anatomy/{r['anatomy_id']}", timeout=60)
        if response.status_code == 404:
            missing += 1
            continue
        response.raise_for_status()
        if "error" in response.json():  # dropped unbuilt by a busy server: there is no anatomy to read
            missing += 1
            continue
        a = response.json()
        anatomies.append(a)
        if "sent_unix" in r:  # a completed request's record
            came, went = ttft_split(r["sent_unix"], r["ttft_s"], a)
            arrival += [came] if came is not None else []
            delivery += [went] if went is not None else []
            client, rest = arrival_split(r["sent_unix"], r.get("handed_unix"), came)
            client_send += [client] if client is not None else []
            to_server += [rest] if rest is not None else []
    parts = (("arrival", arrival), ("delivery", delivery), ("client_send", client_send), ("to_server", to_server))
    split = {f"{name}_ms_p{q}": pct(values, q) for name, values in parts if values for q in (50, 90)}
    return {"anatomies": len(anatomies), "anatomies_missing": missing, **summarize_anatomies(anatomies), **split}


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
    """The sweep's detailed table (markdown), what the server said after it, and the short table last."""
    def fixed(value, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"{result['model']}, {result.get('device')}; server start {result['server_start_s']:.0f} s",
             "| shape | streams | output tok/s | bare engine tok/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | "
             "ITL p99 ms | mean batch | J/token | all tokens | client processes, busiest CPU | "
             "client TTFT p50: arrival (client send + to server) / server / delivery ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in result["levels"]:
        t, p = lv["ttft_ms"], lv["tpot_ms"]
        lines.append(
            f"| {lv['shape']} | {lv['concurrency']} | {lv['output_tok_s']:.0f} | {fixed(lv['bare_engine_tok_s'], 0)} | "
            f"{' / '.join(fixed(t[q], 1) for q in (50, 90, 99))} | "
            f"{' / '.join(fixed(p[q], 2) for q in (50, 90, 99))} | "
            f"{fixed(lv['itl_ms'][99], 2)} | {fixed(lv['server'].get('mean_batch'), 1)} | "
            f"{fixed(lv['joules_per_output_token'], 3)} | {lv['all_tokens']} | "
            f"{lv.get('client_processes', '-')}, {fixed(lv.get('client_cpu_max'), 2)} | "
            f"{fixed(lv['server'].get('arrival_ms_p50'), 1)} ({fixed(lv['server'].get('client_send_ms_p50'), 1)} + "
            f"{fixed(lv['server'].get('to_server_ms_p50'), 1)}) / {fixed(lv['server'].get('ttft_ms_p50'), 1)} / "
            f"{fixed(lv['server'].get('delivery_ms_p50'), 1)} |")
    build = result.get("anatomy_build_ms_mean")
    lines += [f"anatomy build (off the step loop): {fixed(build, 1)} ms per call on average; "
              f"{fixed(result.get('anatomies_dropped'), 0)} dropped unbuilt",
              f"after the sweep: KV cache usage {result.get('kv_cache_usage_after')}, running "
              f"{result.get('running_after')}, server exit status {result.get('server_exit')}"]
    bench = result.get("bench")
    if bench:
        lines.append(f"llm-anatomy bench at {bench['concurrency']} streams, {bench['num_prompts']} prompts: exit "
                     f"{bench['exit']}, {fixed(bench.get('output_tok_s'), 0)} tok/s, "
                     f"errors {(bench.get('errors') or {}).get('count', '-')}")
    lines += ["", "Engine: one batch of that many prompts (generate_many), and the server's closed loop run on it "
                  "directly. Steady: while every stream had a request in flight (the closed loop's drain left out).",
              "| level | shape | engine tok/s: one batch / closed loop | server tok/s | server / engine: one batch, "
              "closed loop | steady tok/s: server / engine closed loop | drain s: server / engine | engine steps a "
              "second: server / engine closed loop | tokens a step: server / engine closed loop | errors | "
              "TTFT p50 / p99 ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]

    def share(a, b):
        return f"{a / b:.0%}" if a and b else "-"

    for lv in result["levels"]:
        engine, looped, served = lv["bare_engine_tok_s"], lv.get("engine_closed_loop_tok_s"), lv["output_tok_s"]
        lines.append(f"| {lv['concurrency']} | {lv['shape']} | {fixed(engine, 0)} / {fixed(looped, 0)} | "
                     f"{served:.0f} | {share(served, engine)}, {share(served, looped)} | "
                     f"{fixed(lv.get('steady_tok_s'), 0)} / {fixed(lv.get('engine_closed_loop_steady_tok_s'), 0)} | "
                     f"{fixed(lv.get('drain_s'), 1)} / {fixed(lv.get('engine_closed_loop_drain_s'), 1)} | "
                     f"{fixed(lv.get('engine_steps_per_s'), 1)} / {fixed(lv.get('engine_closed_loop_steps_per_s'), 1)}"
                     f" | {fixed(lv.get('tokens_per_step_mean'), 1)} / "
                     f"{fixed(lv.get('engine_closed_loop_tokens_per_step_mean'), 1)} | {lv['errors']} | "
                     f"{fixed(lv['ttft_ms'][50], 1)} / {fixed(lv['ttft_ms'][99], 1)} |")
    profiled = [lv for lv in result["levels"] if lv.get("profile")]
    if profiled:
        lines += ["", "Profile windows (--profile-seconds): the device's busy share of the window, its idle time in "
                  "gaps of 50 us or more, and the kernel time by kind, server / bare engine.",
                  "| level | shape | busy | idle in gaps ms (gaps) | window s | gemm ms | attention ms |",
                  "|---|---|---|---|---|---|---|"]
        for lv in profiled:
            windows = [lv["profile"].get(side) or {} for side in ("server", "engine")]
            devices = [w.get("device") or {} for w in windows]

            def both(get) -> str:
                return " / ".join(get(d) for d in devices)

            def busy(d) -> str:
                return f"{100 * d['busy_share']:.1f}%" if d.get("busy_share") is not None else "-"

            def gaps(d) -> str:
                return f"{fixed(d.get('idle_in_gaps_ms'), 0)} ({d.get('gaps', '-')})"

            def kind(name):
                return lambda d: fixed((d.get("category_ms") or {}).get(name), 0)

            lines.append(f"| {lv['concurrency']} | {lv['shape']} | {both(busy)} | {both(gaps)} | "
                         f"{' / '.join(fixed(w.get('seconds'), 1) for w in windows)} | {both(kind('gemm'))} | "
                         f"{both(kind('attention'))} |")
    return "\n".join(lines)


def shapes_list(text: str) -> list[tuple[int, int]]:
    """Comma-separated PROMPT/OUTPUT token counts, e.g. 128/128,512/256."""
    shapes = []
    for part in text.split(","):
        prompt, _, output = part.strip().partition("/")
        if not (prompt.isdigit() and output.isdigit() and int(prompt) > 0 and int(output) > 0):
            raise argparse.ArgumentTypeError(f"want comma-separated PROMPT/OUTPUT token counts, positive whole "
                                             f"numbers (e.g. 128/128,512/256), got {text!r}")
        shapes.append((int(prompt), int(output)))
    return shapes


def profile_seconds(text: str) -> float:
    from llm_anatomy.probe.timeline import PROFILE_MAX_S

    seconds = positive_real(text)
    if seconds > PROFILE_MAX_S:
        raise argparse.ArgumentTypeError(f"want at most {PROFILE_MAX_S:.0f} s (a profile window's limit), got {text!r}")
    return seconds


def port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"want a TCP port, 1..65535, got {text!r}")
    return int(text)


def parse_args(argv: list[str] | None):
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen/Qwen3-8B")
    ap.add_argument("--levels", type=positive_ints, default=[1, 64, 256, 512],
                    help="concurrent streams at each level, comma-separated (default 1,64,256,512)")
    ap.add_argument("--shapes", type=shapes_list, default=[(128, 128), (512, 256)],
                    help="request shapes, PROMPT/OUTPUT tokens, comma-separated (default 128/128,512/256)")
    ap.add_argument("--requests-per-stream", type=positive_int, default=4,
                    help="requests each stream sends in turn at each level (default 4: 2048 requests at 512)")
    ap.add_argument("--anatomy-sample", type=positive_int, default=64,
                    help="anatomies read per level for the server's view, spread over the level's calls the server may "
                         "still hold, the last 1000 (default 64)")
    ap.add_argument("--bench-prompts", type=positive_int,
                    help="then run `llm-anatomy bench` with this many prompts at the largest level, first shape")
    ap.add_argument("--client-processes", type=positive_int, default=8,
                    help="client processes the streams are split over, at most one a stream (default 8); each "
                         "level reports the busiest one's CPU share")
    ap.add_argument("--port", type=port, default=8123)
    ap.add_argument("--no-baseline", action="store_true", help="skip the bare-engine comparison")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, help="for the server and the bare engine "
                                                                        "(default: their own)")
    ap.add_argument("--mixed-steps", action="store_true", help="for the server and the bare engine")
    ap.add_argument("--max-waiting-tokens", type=positive_int,
                    help="for the server and the bare engine (TGI's rule; default: theirs, 0)")
    ap.add_argument("--waiting-served-ratio", type=non_negative_real,
                    help="for the server and the bare engine, with --max-waiting-tokens (default: TGI's 1.2)")
    ap.add_argument("--stream-interval", type=positive_int, help="passed to the server (default: its own)")
    ap.add_argument("--anatomy-processes", type=positive_int, help="passed to the server (default: its own)")
    ap.add_argument("--api-server-count", type=positive_int, help="passed to the server (default: its own)")
    ap.add_argument("--server-cpus", type=cpu_list,
                    help="CPUs for the server's processes and the bare engine, e.g. 0-7 (default: all)")
    ap.add_argument("--client-cpus", type=cpu_list,
                    help="CPUs for the client processes, e.g. 8-15 (default: all); apart from --server-cpus, the "
                         "clients take no CPU time from the server, as on a host of their own")
    ap.add_argument("--profile-seconds", type=profile_seconds,
                    help=f"profile a window this long of each level, {PROFILE_DELAY_S:.0f} s in, on the server "
                         "(serve --profile-dir) and on the bare engine's closed loop: the device's busy and idle "
                         "time side by side, the traces beside --out (the profiler's cost is in those levels' "
                         "figures)")
    ap.add_argument("--out", type=output_file, default=Path("serve_sweep.json"),
                    help="the results (JSON); the server's log and run directory go beside it")
    sys.path.insert(0, str(THIS_CHECKOUT))  # this checkout's llm_anatomy (the flags' checks import it too), as the
    # server it starts runs it
    args = ap.parse_args(argv)
    from llm_anatomy.engine.config import EngineConfig
    from llm_anatomy.errors import AnatomyError
    from llm_anatomy.hub import resolve

    try:
        resolve(args.model)
        EngineConfig(mixed_steps=args.mixed_steps, max_waiting_tokens=args.max_waiting_tokens or 0,
                     waiting_served_ratio=args.waiting_served_ratio)  # the settings' checks across flags
    except AnatomyError as e:
        ap.error(str(e))
    return args


def run_bench(url: str, args, out: Path) -> dict:
    """The product's load generator against the same server: its exit status and its own figures."""
    concurrency, (prompt_len, max_tokens) = max(args.levels), args.shapes[0]
    cmd = [sys.executable, "-m", "llm_anatomy.cli", "bench", url, "--concurrency", str(concurrency),
           "--num-prompts", str(args.bench_prompts), "--input-tokens", str(prompt_len),
           "--output-tokens", str(max_tokens), "--anatomy", "--json", str(out)]
    done = subprocess.run(cmd, env=checkout_env(), capture_output=True, text=True)
    found = {"concurrency": concurrency, "num_prompts": args.bench_prompts, "exit": done.returncode,
             "command": " ".join(cmd[1:]), "stderr_tail": done.stderr[-2000:]}
    if done.returncode == 0 and out.is_file():
        level = json.loads(out.read_text())
        level = level[0] if isinstance(level, list) else level.get("levels", [level])[0]
        found.update({k: level.get(k) for k in ("output_tok_s", "requests", "errors", "ttft_ms", "tpot_ms")})
        joined = level.get("anatomy") or {}  # where the client's TTFT goes beside the server's (same host)
        found["anatomy"] = {k: joined.get(k) for k in ("joined", "missing", "server_ttft_ms", "ttft_gap_ms",
                                                       "arrival_ms", "client_send_ms", "to_server_ms",
                                                       "delivery_ms")}
    return found


def profile_server(url: str, delay_s: float, seconds: float, out: dict,
                   level_over: threading.Event) -> threading.Thread:
    """A thread that opens the server's profile window `delay_s` from now and closes it `seconds` later, or when
    `level_over` is set (the window holds the level alone, as the bare engine's does), its answer (or what went
    wrong) in out["profile"]."""
    def run() -> None:
        if level_over.wait(delay_s):
            out["profile"] = {"error": f"the level ended within {delay_s:.0f} s, before its window"}
            return
        try:
            httpx.post(f"{url}/start_profile", timeout=30).raise_for_status()
            level_over.wait(seconds)
            answer = httpx.post(f"{url}/stop_profile", timeout=600)
            out["profile"] = answer.json() if answer.status_code == 200 else {"error": answer.text[:500]}
        except httpx.HTTPError as e:
            out["profile"] = {"error": f"{type(e).__name__}: {e}"}

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def measure_level(url: str, args, shape: tuple[int, int], c: int, baseline: dict) -> dict:
    prompt_len, max_tokens = shape
    requests = level_requests(c, args.requests_per_stream, prompt_len)
    energy0 = metric(url, "gpu_energy_joules_total")
    steps0, stepped0 = metric(url, "iteration_tokens_total_count"), metric(url, "iteration_tokens_total_sum")
    profiled, level_over = {}, threading.Event()
    profiler = profile_server(url, CLIENT_START_S + PROFILE_DELAY_S, args.profile_seconds, profiled,
                              level_over) if args.profile_seconds else None
    records, wall, client_cpu, _ = run_level(url, args.model, c, requests, max_tokens, args.client_processes,
                                             args.client_cpus)
    level_over.set()
    if profiler is not None:
        profiler.join()
    energy1 = metric(url, "gpu_energy_joules_total")
    steps1, stepped1 = metric(url, "iteration_tokens_total_count"), metric(url, "iteration_tokens_total_sum")
    steps = steps1 - (steps0 or 0) if steps1 is not None else None  # a fresh server has no series before a step
    stepped = stepped1 - (stepped0 or 0) if stepped1 is not None else None
    ok = [r for r in records if "error" not in r]
    reasons: dict[str, int] = {}
    for r in records:
        if "error" in r:
            reasons[r["error"]] = reasons.get(r["error"], 0) + 1
    tokens = sum(r["tokens"] for r in ok)
    itl = [x for r in ok for x in r["itl_s"]]
    bare = baseline.get((f"{prompt_len}/{max_tokens}", c), {})
    engine_tok_s, looped = bare.get("output_tok_s"), bare.get("closed_loop") or {}
    held = client_steady(records)
    return {
        "shape": f"{prompt_len}/{max_tokens}", "prompt_tokens": prompt_len, "output_tokens": max_tokens,
        "concurrency": c, "requests": len(records), "errors": len(records) - len(ok), "error_reasons": reasons,
        "wall_s": wall, "output_tok_s": tokens / wall, "bare_engine_tok_s": engine_tok_s,
        "client_processes": len(client_cpu), "client_cpu_max": max(client_cpu),
        "server_to_engine": tokens / wall / engine_tok_s if engine_tok_s else None,
        # the same closed loop on the bare engine: what the server costs on the very same workload
        "engine_closed_loop_tok_s": looped.get("output_tok_s"),
        "server_to_engine_closed_loop": tokens / wall / looped["output_tok_s"] if looped else None,
        "engine_closed_loop_steady_tok_s": looped.get("steady_tok_s"),
        "engine_closed_loop_drain_s": looped.get("drain_s"),
        # the engine's steps, server against bare: as many a second, each as full, is a server keeping up
        "engine_steps_per_s": steps / wall if steps else None,
        "tokens_per_step_mean": stepped / steps if steps else None,
        "engine_closed_loop_steps_per_s": looped.get("engine_steps_per_s"),
        "engine_closed_loop_tokens_per_step_mean": looped.get("tokens_per_step_mean"),
        **held,
        "all_tokens": bool(ok) and all(r["tokens"] == max_tokens for r in ok),
        "ttft_ms": {q: pct([r["ttft_s"] * 1e3 for r in ok], q) for q in (50, 90, 99)},
        "tpot_ms": {q: pct([r["tpot_s"] * 1e3 for r in ok if r["tpot_s"]], q) for q in (50, 90, 99)},
        "itl_ms": {q: pct([x * 1e3 for x in itl], q) for q in (50, 90, 99)},
        "joules_per_output_token": (energy1 - energy0) / tokens if energy0 is not None and energy1 and tokens else None,
        "server": server_view(url, ok, args.anatomy_sample),
        # the device's share of a window of this level, the server's and the bare engine's closed loop's
        **({"profile": {"server": profiled.get("profile"), "engine": looped.get("profile")}}
           if args.profile_seconds else {}),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    levels = args.levels
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv), "model": args.model,
              "shapes": [f"{p}/{o}" for p, o in args.shapes], "requests_per_stream": args.requests_per_stream,
              "levels": []}
    try:
        import torch

        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        result["torch"] = torch.__version__
    except ImportError:
        pass
    if args.server_cpus:  # the bare engine here, and the server and its processes, which inherit it
        os.sched_setaffinity(0, args.server_cpus)
    result.update({f"{who}_cpus": as_cpu_list(cpus) if cpus else "all"
                   for who, cpus in (("server", args.server_cpus), ("client", args.client_cpus))})
    settings = {"mixed_steps": args.mixed_steps}
    for name in ("max_waiting_tokens", "waiting_served_ratio"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    if args.max_num_batched_tokens:
        settings["max_num_batched_tokens"] = args.max_num_batched_tokens
    profile_dir = args.out.parent / "profiles" if args.profile_seconds else None
    bare = [] if args.no_baseline else bare_engine(args.model, levels, args.shapes, settings,
                                                   args.requests_per_stream, profile_dir, args.profile_seconds or 0)
    result["bare_engine"] = bare
    baseline = {(b["shape"], b["concurrency"]): b for b in bare}

    run_dir = args.out.parent / "serve_run"
    url = f"http://127.0.0.1:{args.port}"
    t_start = time.monotonic()
    extra = ["--max-num-batched-tokens", str(args.max_num_batched_tokens)] if args.max_num_batched_tokens else []
    extra += ["--mixed-steps"] if args.mixed_steps else []
    extra += ["--max-waiting-tokens", str(args.max_waiting_tokens)] if args.max_waiting_tokens else []
    extra += ["--waiting-served-ratio", str(args.waiting_served_ratio)] if args.waiting_served_ratio is not None else []
    extra += ["--stream-interval", str(args.stream_interval)] if args.stream_interval else []
    extra += ["--anatomy-processes", str(args.anatomy_processes)] if args.anatomy_processes else []
    extra += ["--api-server-count", str(args.api_server_count)] if args.api_server_count else []
    extra += ["--profile-dir", str(profile_dir)] if profile_dir else []
    longest = max(p + o for p, o in args.shapes)
    extra += ["--kv-cache-tokens", str(max(levels) * (longest + 16))]  # the bare engine's pool, not more
    proc = start_server(args.model, args.port, run_dir, max(levels), args.out.parent / "server.log", extra)
    result["server_start_s"] = time.monotonic() - t_start
    try:
        run_level(url, args.model, 2, prompts(2, args.shapes[0][0], 7), 16, cpus=args.client_cpus)  # warm the path
        for shape in args.shapes:
            for c in levels:
                level = measure_level(url, args, shape, c, baseline)
                result["levels"].append(level)
                print(f"server {level['shape']} c={c}: {level['output_tok_s']:.0f} tok/s, {level['errors']} errors, "
                      f"TTFT p50 {level['ttft_ms'][50] or 0:.1f} ms", flush=True)
        if args.bench_prompts:
            result["bench"] = run_bench(url, args, args.out.with_suffix(".bench.json"))
        builds = metric(url, "anatomy_build_seconds_count")
        result["anatomy_build_ms_mean"] = 1e3 * metric(url, "anatomy_build_seconds_sum") / builds if builds else None
        result["anatomies_dropped"] = metric(url, "anatomies_dropped_total")
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
