"""Host time per engine step of the server's path, against the batch size, with a model that costs nothing.

The engine's forward and sampler are replaced by ones that return at once (a random token per sequence), so
that what is left is the host's own work: scheduling and detokenizing (the bare engine), then the server's
engine thread on top (the Recorder's per-step records, the calls' progress handed to the event loop), the
event loop turning that progress into SSE lines, the same calls served whole through HTTP (the app with its Guard
middleware, the completion handler, Starlette's StreamingResponse and uvicorn's loop and protocol writing to
connections that drop the bytes: the event loop's time per step and per chunk written), and the anatomies of a
step's worth of finished calls (B calls over their output tokens' steps): the server process's share (packing each
call for the builder's process) and the builder process's own (building it), measured here one after the other.
Runs on the CPU; no GPU.

    python3 benchmarks/host_overhead.py --batch-sizes 1,64,256,512 --output-tokens 128
"""

from __future__ import annotations

import asyncio
import gc
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


class DroppedConnection(asyncio.Transport):
    """What uvicorn's protocol writes a response to: the bytes are counted, not sent (no socket, no client)."""

    def __init__(self):
        super().__init__()
        self.writes, self.bytes, self.closed = 0, 0, False
        self.head = b""  # the response's first write (its status line and headers)

    def write(self, data) -> None:
        if not self.writes:
            self.head = bytes(data)
        self.writes += 1
        self.bytes += len(data)

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None: pass

    def resume_reading(self) -> None: pass


class HttpStreams:
    """The server's HTTP side as uvicorn runs it (its event loop and HTTP protocol: uvloop and httptools where
    installed), on a thread of its own: per call a connection whose request goes through the whole app (Guard,
    routing, the completion handler, StreamingResponse with its disconnect listener) and whose response uvicorn
    writes to a DroppedConnection. The loop thread's CPU clock can be read from any thread."""

    def __init__(self, ctx):
        import uvicorn
        from uvicorn.server import ServerState

        from llm_anatomy.server.app import create_app

        self.config = uvicorn.Config(create_app(ctx), lifespan="off", log_level="warning")
        self.config.load()
        self.state = ServerState()
        self.state.default_headers = list(self.config.encoded_headers)
        factory = self.config.get_loop_factory()
        self.loop = factory() if factory is not None else asyncio.new_event_loop()
        self.protocols: list = []
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._clock = time.pthread_getcpuclockid(self._thread.ident)

    def cpu_s(self) -> float:
        return time.clock_gettime(self._clock)

    def open(self, raw_request: bytes, count: int) -> None:
        """`count` connections, each sending `raw_request`."""
        async def connect():
            for _ in range(count):
                protocol = self.config.http_protocol_class(config=self.config, server_state=self.state,
                                                           app_state={}, _loop=self.loop)
                protocol.connection_made(DroppedConnection())
                protocol.data_received(raw_request)
                self.protocols.append(protocol)
        asyncio.run_coroutine_threadsafe(connect(), self.loop).result()

    def settle(self) -> None:
        """Wait until the loop has handled what was posted to it so far: the progress delivered, then each
        stream woken, its chunk written (no stream falls behind and gets several tokens in one chunk)."""
        async def turns():
            for _ in range(3):
                await asyncio.sleep(0)
        asyncio.run_coroutine_threadsafe(turns(), self.loop).result()

    def writes(self) -> int:
        return sum(p.transport.writes for p in list(self.protocols))

    def started(self) -> bool:
        return all(p.transport.writes for p in list(self.protocols))

    def finished(self) -> bool:
        return all(p.cycle is not None and p.cycle.response_complete for p in list(self.protocols))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()


def http_request(prompt_tokens: int, output_tokens: int) -> bytes:
    """A streamed completion as the bench client sends it (usage in the last chunk, EOS ignored)."""
    body = json.dumps({"model": "tiny", "prompt": list(range(1000, 1000 + prompt_tokens)), "max_tokens": output_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:8000\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body)) + body


def http_steps(engine, batch: int, prompt_tokens: int, output_tokens: int, run_dir: Path) -> dict:
    """The event loop's CPU per decode step and per SSE chunk written, serving `batch` streams through HTTP; this
    thread stands in for the engine thread (admitting the calls the handlers submit, stepping)."""
    from llm_anatomy.server.auth import Keys, load_salt
    from llm_anatomy.server.context import Drain, ServeOptions, ServerContext

    loop = server_parts(engine, run_dir)
    loop._thread = threading.current_thread()  # the loop takes calls while its engine thread is alive: this one
    ctx = ServerContext(loop, ServeOptions(("tiny",)), Keys((), load_salt(run_dir)), Drain(60.0), "host-overhead")
    http = HttpStreams(ctx)
    http.open(http_request(prompt_tokens, output_tokens), batch)
    while len(loop._calls) < batch:  # each handler parses and tokenizes in a worker thread, then submits
        if http.finished():
            raise RuntimeError(f"the server answered without streaming: {http.protocols[0].transport.head!r}")
        loop._take_inbox(block=False)
        time.sleep(0.001)
    while not http.started():  # each response's head written: what follows is the streams' chunks
        time.sleep(0.001)
    cpu0, writes0 = http.cpu_s(), http.writes()
    while engine.has_work():
        loop._step()
        http.settle()
        for trace in loop.recorder.take_finished():
            loop._calls.pop(trace.request_id)
    while not http.finished():
        time.sleep(0.001)
    cpu_ms, chunks = (http.cpu_s() - cpu0) * 1e3, http.writes() - writes0
    http.stop()
    return {"http_loop_ms": cpu_ms / max(1, output_tokens), "http_us_per_chunk": cpu_ms * 1e3 / max(1, chunks),
            "http_chunks_per_stream": chunks / batch}


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
            "engine_thread_cpu_mean_ms": statistics.mean(cpu),  # with the collector's pauses, which the median skips
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
    from llm_anatomy.cli import settle_heap
    from llm_anatomy.server.app import collector_while_serving

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for b in args.batch_sizes:
            engine = tiny_engine(Path(tmp) / "model", b, args.prompt_tokens, args.output_tokens)
            settle_heap()  # as `llm-anatomy serve` does after start-up
            bare = statistics.median(bare_engine_steps(engine, b, args.prompt_tokens, args.output_tokens))
            with collector_while_serving():
                served = server_steps(engine, b, args.prompt_tokens, args.output_tokens, Path(tmp) / f"run{b}")
                http = http_steps(engine, b, args.prompt_tokens, args.output_tokens, Path(tmp) / f"http{b}")
            gc.unfreeze()  # this engine's heap back to the collector (the next batch size makes its own)
            rows.append({"batch": b, "bare_engine_ms": bare, **served, **http})
            print(json.dumps(rows[-1]), flush=True)
    print("\nhost ms per decode step (median)\n| batch | bare engine | server engine thread (its CPU; mean) | "
          "event loop (SSE lines) | event loop through HTTP (us a chunk) | anatomies: server process per step (per call) | builder process per step "
          "(per call) |")
    for r in rows:
        print(f"| {r['batch']} | {r['bare_engine_ms']:.2f} | {r['engine_thread_ms']:.2f} "
              f"({r['engine_thread_cpu_ms']:.2f}; {r['engine_thread_cpu_mean_ms']:.2f}) | {r['event_loop_ms']:.2f} "
              f"| {r['http_loop_ms']:.2f} ({r['http_us_per_chunk']:.1f}) "
              f"| {r['anatomy_parent_ms_per_step']:.2f} ({r['anatomy_parent_ms_per_call']:.2f}) "
              f"| {r['anatomy_ms_per_step']:.2f} ({r['anatomy_ms_per_call']:.1f}) |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
