"""A call's energy, as its anatomy states it, against NVML's total-energy counter read by an independent process
over the same window (CUDA GPU with NVML). Calls of increasing length on one engine; for each: the anatomy's
estimate and interval, the independent reading, and the difference.

    python3 benchmarks/check_energy.py --out $OUT/energy.json
    python3 benchmarks/check_energy.py --model Qwen/Qwen3-8B --max-tokens 256,2048

The independent reader polls nvmlDeviceGetTotalEnergyConsumption every ~2 ms with wall-clock stamps and takes
the counter's value at an instant by linear interpolation between the readings where it changed (its updates).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time

from bench_args import Parser, output_dir, positive_ints


def read_counter(stop, out) -> None:
    """In its own process: (time.time_ns(), millijoules) at every change of the counter, until `stop` is set."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    changes, last = [], None
    while not stop.is_set():
        t, value = time.time_ns(), pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        if value != last:
            changes.append((t, value))
            last = value
        time.sleep(0.002)
    out.put(changes)


def energy_between(changes: list[tuple[int, int]], start_ns: int, end_ns: int) -> float:
    """Joules the counter gained between two instants, each interpolated between the updates around it."""
    def at(t: int) -> float:
        for (t0, e0), (t1, e1) in zip(changes, changes[1:]):
            if t0 <= t <= t1:
                return e0 + (e1 - e0) * (t - t0) / (t1 - t0)
        raise ValueError("the reader's updates do not bracket the call")
    return (at(end_ns) - at(start_ns)) / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen3-8B")
    parser.add_argument("--max-tokens", type=positive_ints, default=[64, 256, 2048],
                        help="the calls' lengths in output tokens (comma-separated)")
    parser.add_argument("--out", type=output_dir, help="a directory for energy.json")
    args = parser.parse_args(argv)

    import torch

    from llm_anatomy import Engine
    from llm_anatomy.probe.call import CallRequest, measure_call
    from llm_anatomy.probe.ceilings import datasheet_ceilings

    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (NVML's energy counter)")
    engine = Engine.from_pretrained(args.model, device="cuda", weights="synthetic", max_num_seqs=1,
                                    kv_cache_tokens=8192)
    ceilings = datasheet_ceilings(engine.device)
    request = lambda n: CallRequest(messages=[{"role": "user", "content": "Explain what a KV cache is."}],  # noqa: E731
                                    sampling=dict(max_tokens=n, temperature=0, ignore_eos=True))
    measure_call(engine, request(16), ceilings)  # warm-up
    rows = []
    ctx = mp.get_context("spawn")
    for n in args.max_tokens:
        stop, out = ctx.Event(), ctx.Queue()
        reader = ctx.Process(target=read_counter, args=(stop, out))
        reader.start()
        time.sleep(0.5)  # the reader sees updates before the call
        _, a = measure_call(engine, request(n), ceilings)
        time.sleep(0.5)  # and after it
        stop.set()
        changes = out.get()
        reader.join()
        call = next(e for e in a.telemetry.energy if e.phase == "call")
        start_ns = int(a.started_at_unix * 1e9)
        independent = energy_between(changes, start_ns, start_ns + int(a.e2e_ms * 1e6))
        rows.append({"output_tokens": n, "e2e_s": a.e2e_ms / 1e3, "anatomy_j": call.joules, "low_j": call.low_j,
                     "high_j": call.high_j, "independent_j": independent,
                     "difference": call.joules / independent - 1, "inside_interval": call.low_j <= independent
                     <= (call.high_j if call.high_j is not None else float("inf"))})
    print("| call | e2e s | anatomy J [interval] | independent J | difference |")
    print("|---|---|---|---|---|")
    for r in rows:
        high = f"{r['high_j']:.1f}" if r["high_j"] is not None else "n/a"
        print(f"| {r['output_tokens']} tokens | {r['e2e_s']:.2f} | {r['anatomy_j']:.1f} [{r['low_j']:.1f}, {high}] | "
              f"{r['independent_j']:.1f} | {r['difference']:+.2%} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "energy.json").write_text(json.dumps({"model": args.model, "device": torch.cuda.get_device_name(),
                                                          "calls": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
