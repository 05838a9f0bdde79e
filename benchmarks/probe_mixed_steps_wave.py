"""One wave of 64 prompts of 512 tokens, 256 output tokens each, through Engine.generate_many on the H200:
its wall time, the shape of each step the scheduler made, the gaps between steps, and how often a decode
step could be launched ahead. Run twice in one process (the second has every shape compiled).

    python3 benchmarks/probe_mixed_steps_wave.py [--mixed-steps]
"""

import argparse
import collections
import time

import torch

from llm_anatomy import Engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mixed-steps", action="store_true")
    args = ap.parse_args()
    engine = Engine.from_pretrained("Qwen/Qwen3-8B", weights="synthetic", max_num_seqs=64,
                                    kv_cache_tokens=64 * 784, mixed_steps=args.mixed_steps)
    gen = torch.Generator().manual_seed(0)

    def prompts(n):
        return [torch.randint(0, 151643, (512,), generator=gen).tolist() for _ in range(n)]

    engine.generate_many(prompts(2), max_tokens=8, temperature=0, ignore_eos=True)
    log, ahead = [], collections.Counter()
    schedule, can_run_ahead = engine.scheduler.schedule, engine._can_run_ahead

    def watched():
        b = schedule()
        log.append((time.perf_counter(), None if b is None else
                    (len(b.seqs), b.is_prefill, sum(b.query_lens), len(b.sampled))))
        return b

    def counted(p):
        r = can_run_ahead(p)
        ahead[r] += 1
        return r

    engine.scheduler.schedule, engine._can_run_ahead = watched, counted
    for _ in range(2):
        log.clear()
        ahead.clear()
        t = time.perf_counter()
        engine.generate_many(prompts(64), max_tokens=256, temperature=0, ignore_eos=True)
        wall = time.perf_counter() - t
        gaps = [b[0] - a[0] for a, b in zip(log, log[1:])]
        print(f"wall {wall:.2f} s, {len(log)} schedules, {sum(1 for x in log if x[1] and x[1][1])} with prefill, "
              f"launched ahead {dict(ahead)}")
        print("first steps (seqs, is_prefill, tokens, sampled):", [x[1] for x in log[:8]])
        print("gaps ms:", [round(g * 1e3, 1) for g in gaps[:8]])


if __name__ == "__main__":
    main()
