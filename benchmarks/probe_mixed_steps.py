"""Where a mixed step's time goes (chunked prefill: decodes riding along with prompts), on the H200.

64 prompts of 512 tokens through Engine.step() with the default 8192-token budget: each step's wall time
(synchronised), then a torch.profiler table of the kernels of one mixed step.

    python3 benchmarks/probe_mixed_steps.py
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from llm_anatomy import Engine


def main() -> None:
    engine = Engine.from_pretrained("Qwen/Qwen3-8B", weights="synthetic", max_num_seqs=64, kv_cache_tokens=64 * 800)
    gen = torch.Generator().manual_seed(0)
    params = engine.sampling_params(temperature=0, max_tokens=64, ignore_eos=True)
    for _ in range(64):
        engine.add_request(torch.randint(0, 151643, (512,), generator=gen).tolist(), params)
    for i in range(12):
        batch_before = (len(engine.scheduler.running), len(engine.scheduler.waiting))
        torch.cuda.synchronize()
        t = time.perf_counter()
        if i == 2:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
        else:
            engine.step()
            torch.cuda.synchronize()
        print(f"step {i}: {(time.perf_counter() - t) * 1e3:.1f} ms (running, waiting before: {batch_before})")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
