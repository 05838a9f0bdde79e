"""Host time per engine step of the server's path, against the batch size, with a model that costs nothing.

The engine's forward and sampler are replaced by ones that return at once (a random token per sequence), so
that what is left is the host's own work: scheduling and detokenizing (the bare engine), then the server's
engine thread on top (the Recorder's per-step records, the calls' progress handed to the event loop), the
event loop turning that progress into SSE lines, and the anatomies of a step's worth of finished calls (B calls
over their output tokens' steps): the server process's share (packing each call for the builder's process)
and the builder process's own (building it), measured here one after the other. Runs on the CPU; no GPU.

    python3 benchmarks/host_overhead.py --batch-sizes 1,64,256,512 --output-tokens 128
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

from bench_args import Parser, output_file, positive_int, positive_ints

THIS_CHECKOUT = Path(__file__).resolve().parents[1]
TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
              "eos_token_id": 151645}


class FreeRunner:
    """Stands in for the model runner: no forward at all (the sampler below makes the tokens)."""

    def run(self, batch, ahead_tokens=None):
        return None


def free_sampler(seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)

    def sample(logits, params, generators, counts, banned):
        return torch.randint(0, 151643, (len(params),), generator=generator)  # ordinary text tokens
    return sample


def tiny_engine(directory: Path, batch: int, prompt_tokens: int, output_tokens: int):
    import torch

    from llm_anatomy import Engine

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_QWEN3))
    engine = Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, weights="synthetic",
                                    max_num_seqs=batch, block_size=16,
                                    kv_cache_tokens=batch * (prompt_tokens + output_tokens + 16),
                                    max_num_batched_tokens=max(2048, prompt_tokens))
    engine.runner = FreeRunner()
    engine.sampler = free_sampler(0)
    return engine


class Consumers:
    """An event loop on its own thread, one task per call taking its progress and encoding its SSE line, as a
    stream handler does (the HTTP write itself is left out). Counts the loop thread's CPU time."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.cpu_s = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        asyncio.set_event_loop(self.loop)
        t0 = time.thread_time()
        self.loop.run_forever()
        self.cpu_s = time.thread_time() - t0

    def follow(self, ctx, call):
        from llm_anatomy.server.completions import ChoiceStream

        async def drain():
            async for _ in ChoiceStream(ctx, call, call.id, 0, 0).lines():
                pass
        return asyncio.run_coroutine_threadsafe(drain(), self.loop)

    def stop(self) -> float:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        return self.cpu_s


def server_parts(engine, run_dir: Path):
    """The server's engine loop and anatomy builder around `engine`, neither thread started."""
    from llm_anatomy.anatomy import Ceilings
    from llm_anatomy.server.anatomies import AnatomyBuilder
    from llm_anatomy.server.loop import EngineLoop
    from llm_anatomy.server.metrics import Metrics
    from llm_anatomy.server.store import AnatomyStore

    ceilings = Ceilings("cpu", read_gbps=20.0, gemv_gbps=15.0, matmul_tflops=0.5, datasheet_gbps=None,
                        datasheet_tflops=None, measured_at="host_overhead")
    store = AnatomyStore(run_dir, keep=100_000)
    builder = AnatomyBuilder(engine, ceilings, store, Metrics("tiny", engine), None, "no telemetry", "host_overhead")
    return EngineLoop(engine, builder)


def request(prompt_tokens: int, output_tokens: int):
    from llm_anatomy.server.protocol import CompletionRequest, completion_request, parse_body

    body = {"model": "tiny", "prompt": list(range(1000, 1000 + prompt_tokens)), "max_tokens": output_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    return completion_request(parse_body(json.dumps(body).encode(), CompletionRequest))


def bare_engine_steps(engine, batch: int, prompt_tokens: int, output_tokens: int) -> list[float]:
    """ms of host time per decode step of the bare engine (no observers)."""
    params = engine.sampling_params(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(list(range(1000, 1000 + prompt_tokens)), params) for _ in range(batch)]
    times = []
    while not all(s.finished for s in seqs):
        t0 = time.perf_counter()
        ran = engine.step()
        if ran and all(s.output_token_ids[1:] for s in ran):  # a decode step (each has its second token on)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def server_steps(engine, batch: int, prompt_tokens: int, output_tokens: int, run_dir: Path) -> dict:
    """The server's engine thread per decode step, its event loop's work per step, and the anatomies."""
    loop = server_parts(engine, run_dir)
    consumers = Consumers()
    ctx = types.SimpleNamespace(engine=engine)  # all a stream handler reads of the server's context here
    req = request(prompt_tokens, output_tokens)
    calls = [loop.prepare(req, time.perf_counter_ns(), consumers.loop) for _ in range(batch)]
    followers = [consumers.follow(ctx, c) for c in calls]
    for call in calls:
        loop._add(call)
    times, cpu, finished = [], [], []
    while engine.has_work():
        t0, c0 = time.perf_counter(), time.thread_time()
        loop._step()
        elapsed, used = time.perf_counter() - t0, time.thread_time() - c0
        if all(c.seq.output_token_ids[1:] for c in calls):  # a decode step
            times.append(elapsed * 1e3)
            cpu.append(used * 1e3)
        for trace in loop.recorder.take_finished():
            finished.append((trace, loop._calls.pop(trace.request_id)))
    for f in followers:
        f.result(timeout=60)
    loop_cpu_s = consumers.stop()
    parent, child = anatomy_costs(loop.builder, engine, finished)
    steps = output_tokens  # each call's anatomy covers its `output_tokens` steps, shared by the batch
    return {"engine_thread_ms": statistics.median(times), "engine_thread_cpu_ms": statistics.median(cpu),
            "event_loop_ms": loop_cpu_s * 1e3 / max(1, output_tokens),
            "anatomy_parent_ms_per_call": statistics.median(parent),
            "anatomy_parent_ms_per_step": statistics.mean(parent) * batch / steps,
            "anatomy_ms_per_call": statistics.median(child),
            "anatomy_ms_per_step": statistics.mean(child) * batch / steps}


def anatomy_costs(builder, engine, finished) -> tuple[list[float], list[float]]:
    """ms per finished call: the server process's share (the job, the new step snapshots, pickling them: what
    the sending thread does) and the builder process's (unpickling, building, the JSON), run here in turn."""
    import pickle

    from llm_anatomy.server.anatomy_process import Builder

    far = Builder(pickle.loads(pickle.dumps(builder.setup)))
    sent: set[int] = set()
    parent, child = [], []
    for trace, call in finished:
        call.marks.end = trace.finished_ns
        result = engine.result(call.seq, call.prompt_text)
        t0 = time.thread_time()
        job = builder._job(call, trace, result)
        new = {i: m.snapshot(s, trace.clock) for i, (s, m) in trace.shared_steps().items() if i not in sent}
        sent.update(new)
        message = pickle.dumps((new, job, trace.first_step()))
        t1 = time.thread_time()
        far.take(*pickle.loads(message))
        t2 = time.thread_time()
        parent.append((t1 - t0) * 1e3)
        child.append((t2 - t1) * 1e3)
    return parent, child


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__)
    ap.add_argument("--batch-sizes", type=positive_ints, default=[1, 64, 256, 512])
    ap.add_argument("--prompt-tokens", type=positive_int, default=128)
    ap.add_argument("--output-tokens", type=positive_int, default=128)
    ap.add_argument("--json", type=output_file, help="also write the figures here")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(THIS_CHECKOUT))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for b in args.batch_sizes:
            engine = tiny_engine(Path(tmp) / "model", b, args.prompt_tokens, args.output_tokens)
            bare = statistics.median(bare_engine_steps(engine, b, args.prompt_tokens, args.output_tokens))
            served = server_steps(engine, b, args.prompt_tokens, args.output_tokens, Path(tmp) / f"run{b}")
            rows.append({"batch": b, "bare_engine_ms": bare, **served})
            print(json.dumps(rows[-1]), flush=True)
    print("\nhost ms per decode step (median)\n| batch | bare engine | server engine thread (its CPU) | "
          "event loop (SSE lines) | anatomies: server process per step (per call) | builder process per step "
          "(per call) |")
    for r in rows:
        print(f"| {r['batch']} | {r['bare_engine_ms']:.2f} | {r['engine_thread_ms']:.2f} "
              f"({r['engine_thread_cpu_ms']:.2f}) | {r['event_loop_ms']:.2f} "
              f"| {r['anatomy_parent_ms_per_step']:.2f} ({r['anatomy_parent_ms_per_call']:.2f}) "
              f"| {r['anatomy_ms_per_step']:.2f} ({r['anatomy_ms_per_call']:.1f}) |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
