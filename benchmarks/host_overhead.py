"""Host time per engine step of the server's path, against the batch size, with a model that costs nothing.

The engine's forward and sampler are replaced by ones that return at once (a random token per sequence), so
that what is left is the host's own work: scheduling and detokenizing (the bare engine); then the server's engine
core on top (the Recorder's per-step records, the calls' outputs, the step's one message pickled and written to
the pipe to the HTTP process: the core's process's time per step, and of it the message's); the HTTP process's
share of that message (its reading thread: receiving and unpickling it); the same calls served through HTTP (the
app with its Guard middleware, the completion handler, the event stream and uvicorn's loop and protocol writing
to connections that drop the bytes: the event loop's and the reading thread's time per step and per chunk
written, fed by a core over a real pipe, and the process's CPU per request (every thread) taking in the batch's
requests sent all at once); and the anatomies of a step's worth of finished calls (B calls over
their output tokens' steps): the core's share (packing each call for the builder's process) and the builder
process's own (building it), measured here one after the other. Runs on the CPU; no GPU.

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

    def run(self, batch, ahead=None):
        return None

    def run_greedy(self, batch, ahead=None):
        return None  # no graph picks the tokens: the sampler below makes them


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


def make_core(engine, inbox, send, run_dir: Path):
    """The server's engine core around `engine`, one HTTP side reaching it: reading `inbox`, sending to `send` (its
    anatomy builder not started: the calls it is handed wait there)."""
    from llm_anatomy.anatomy import Ceilings
    from llm_anatomy.server.core import CoreOptions, EngineCore, Frontends

    ceilings = Ceilings("cpu", read_gbps=20.0, gemv_gbps=15.0, matmul_tflops=0.5, datasheet_gbps=None,
                        datasheet_tflops=None, measured_at="host_overhead")
    run_dir.mkdir(parents=True, exist_ok=True)
    return EngineCore(engine, CoreOptions(ceilings, device_why="host_overhead", telemetry_hz=None,
                                          keep_anatomies=100_000), ceilings, Frontends([inbox], [send]), None,
                      "no telemetry")


def torch_inference():
    import torch

    return torch.inference_mode()


class TimedSender:
    """The core's Sender, timing each message's pickling and write (this thread's CPU) and counting its bytes. The
    core's own writes its messages from a thread of its own, still in the core's process: here they are written
    where they are sent, so that their cost is counted."""

    def __init__(self, conn):
        self.conn, self.cpu_s, self.bytes, self.messages = conn, 0.0, 0, 0

    def __call__(self, message) -> None:
        import pickle

        t0 = time.thread_time()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # what Connection.send does
        self.conn.send_bytes(data)
        self.cpu_s += time.thread_time() - t0
        self.bytes += len(data)
        self.messages += 1

    post = __call__


class Receiver:
    """The HTTP process's reading thread, without an event loop to hand to: receives and unpickles the core's
    messages; its CPU time is read at the end."""

    def __init__(self, conn):
        self.conn, self.cpu_s, self.messages = conn, 0.0, 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        t0 = time.thread_time()
        while self.conn.recv() != "end":
            self.messages += 1
        self.cpu_s = time.thread_time() - t0

    def stop(self) -> float:
        self._thread.join()
        return self.cpu_s


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
    """The HTTP process's CPU per decode step and per SSE chunk written, serving `batch` streams through HTTP: its
    event loop, and its reading thread; and its event loop's CPU per request while it takes the `batch` requests
    in, arriving together, to each response's head (one interpreter takes them one after the other). This thread stands in for the core's process (a real core over a real
    pipe, stepped here one step at a time)."""
    import multiprocessing

    from llm_anatomy.server.auth import Keys, load_salt
    from llm_anatomy.server.context import Drain, ServeOptions, ServerContext
    from llm_anatomy.server.core import EngineInfo, Sender
    from llm_anatomy.server.loop import EngineClient
    from llm_anatomy.server.metrics import Metrics
    from llm_anatomy.server.store import AnatomyStore

    class Counted(EngineClient):
        delivered = 0

        def _deliver(self, outputs, failures):
            super()._deliver(outputs, failures)
            self.delivered += 1

    their_inbox, to_core = multiprocessing.Pipe(duplex=False)
    from_core, their_outbox = multiprocessing.Pipe(duplex=False)
    client = Counted(AnatomyStore(run_dir, keep=100_000), Metrics("tiny"))
    client._to_core, client._from_core, client._worker = to_core, from_core, threading.current_thread()
    client.info = EngineInfo.of(engine)
    client._writer.start()
    core = make_core(engine, their_inbox, Sender(their_outbox), run_dir)
    ctx = ServerContext(client, ServeOptions(("tiny",)), Keys((), load_salt(run_dir)), Drain(60.0), "host-overhead")
    http = HttpStreams(ctx)
    client.attach(http.loop)
    reader_clock = time.pthread_getcpuclockid(client._reader.ident)
    intake0 = time.process_time() - time.thread_time()  # every thread's CPU but this one's (the core's stand-in)
    http.open(http_request(prompt_tokens, output_tokens), batch)
    while len(core._calls) < batch:  # each handler parses and tokenizes, then submits
        if http.finished():
            raise RuntimeError(f"the server answered without streaming: {http.protocols[0].transport.head!r}")
        core._take_inbox(block=False)
        time.sleep(0.001)
    while not http.started():  # each response's head written: what follows is the streams' chunks
        time.sleep(0.001)
    cpu0, reader0, writes0 = http.cpu_s(), time.clock_gettime(reader_clock), http.writes()
    intake_ms = (time.process_time() - time.thread_time() - intake0) * 1e3 / batch  # each to its response's head
    with torch_inference():
        while engine.has_work():
            before = client.delivered
            core._step()
            core._post_and_hand_over()
            while client.delivered == before:  # until the reading thread has handed the step to the event loop
                time.sleep(0.0002)
            http.settle()
    while not http.finished():
        time.sleep(0.001)
    cpu_ms, chunks = (http.cpu_s() - cpu0) * 1e3, http.writes() - writes0
    reader_ms = (time.clock_gettime(reader_clock) - reader0) * 1e3
    client._stopping = True  # its pipes close with this function: no engine to mourn
    http.stop()
    core.detach()
    return {"http_intake_ms": intake_ms, "http_loop_ms": cpu_ms / max(1, output_tokens),
            "http_us_per_chunk": cpu_ms * 1e3 / max(1, chunks),
            "http_chunks_per_stream": chunks / batch, "http_reader_ms": reader_ms / max(1, output_tokens)}


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


def core_steps(engine, batch: int, prompt_tokens: int, output_tokens: int, run_dir: Path) -> dict:
    """The server's engine core per decode step (its CPU, and of it the step's message: pickled, written to a
    pipe), the HTTP process's reading thread per message (receiving, unpickling), and the anatomies."""
    import multiprocessing

    from llm_anatomy.server.core import CoreCall, EngineInfo
    from llm_anatomy.server.loop import EngineClient

    from_core, their_outbox = multiprocessing.Pipe(duplex=False)
    their_inbox, _ = multiprocessing.Pipe(duplex=False)  # the calls are added here directly
    sender = TimedSender(their_outbox)
    receiver = Receiver(from_core)
    core = make_core(engine, their_inbox, sender, run_dir)
    front = EngineClient(None, None)  # the HTTP side's prepare, as the handlers run it
    front.info = EngineInfo.of(engine)
    req = request(prompt_tokens, output_tokens)
    calls = []
    for _ in range(batch):
        c = front.prepare(req, time.perf_counter_ns())
        calls.append(CoreCall(c.id, c.request, c.marks, c.prompt_token_ids, c.prompt_text, c.params))
    times, cpu, send_cpu, sent_bytes = [], [], [], []
    with torch_inference():
        for call in calls:
            core._add(call)
        while engine.has_work():
            t0, c0, s0, b0 = time.perf_counter(), time.thread_time(), sender.cpu_s, sender.bytes
            core._step()
            core._post_and_hand_over()
            elapsed, used = time.perf_counter() - t0, time.thread_time() - c0
            if all(c.seq.output_token_ids[1:] for c in calls):  # a decode step
                times.append(elapsed * 1e3)
                cpu.append(used * 1e3)
                send_cpu.append((sender.cpu_s - s0) * 1e3)
                sent_bytes.append(sender.bytes - b0)
    builder = core.anatomy_builders.builders[0]  # make_core: one
    finished = [(trace, call) for call, trace, _ in builder._waiting.values()]
    sender("end")
    recv_s = receiver.stop()
    parent, child = anatomy_costs(builder, engine, finished)
    core.detach()
    steps = output_tokens  # each call's anatomy covers its `output_tokens` steps, shared by the batch
    return {"core_ms": statistics.median(times), "core_cpu_ms": statistics.median(cpu),
            "core_cpu_mean_ms": statistics.mean(cpu),  # with the collector's pauses, which the median skips
            "ipc_send_ms": statistics.median(send_cpu), "ipc_kb": statistics.median(sent_bytes) / 1e3,
            "ipc_recv_ms": recv_s * 1e3 / max(1, receiver.messages),
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
                served = core_steps(engine, b, args.prompt_tokens, args.output_tokens, Path(tmp) / f"run{b}")
                http = http_steps(engine, b, args.prompt_tokens, args.output_tokens, Path(tmp) / f"http{b}")
            gc.unfreeze()  # this engine's heap back to the collector (the next batch size makes its own)
            rows.append({"batch": b, "bare_engine_ms": bare, **served, **http})
            print(json.dumps(rows[-1]), flush=True)
    print("\nhost ms per decode step (median)\n| batch | bare engine | engine core (its CPU; mean) | of it, the step's "
          "message pickled and written (KB) | HTTP process: reading a message | HTTP process taking in the "
          "batch's requests at once (its threads' CPU ms a request) | HTTP process through HTTP: event "
          "loop (us a chunk); reading thread | anatomies: core per step (per call) | builder process per step "
          "(per call) |")
    for r in rows:
        print(f"| {r['batch']} | {r['bare_engine_ms']:.2f} | {r['core_ms']:.2f} "
              f"({r['core_cpu_ms']:.2f}; {r['core_cpu_mean_ms']:.2f}) | {r['ipc_send_ms']:.3f} ({r['ipc_kb']:.1f}) "
              f"| {r['ipc_recv_ms']:.3f} | {r['http_intake_ms']:.3f} | {r['http_loop_ms']:.2f} "
              f"({r['http_us_per_chunk']:.1f}); "
              f"{r['http_reader_ms']:.2f} | {r['anatomy_parent_ms_per_step']:.2f} ({r['anatomy_parent_ms_per_call']:.2f}) "
              f"| {r['anatomy_ms_per_step']:.2f} ({r['anatomy_ms_per_call']:.1f}) |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
