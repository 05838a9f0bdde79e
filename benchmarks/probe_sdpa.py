"""Which SDPA backend runs causal GQA prefill attention fastest on this GPU, with and without enable_gqa.

    python benchmarks/probe_sdpa.py --out $OUT/probe_sdpa.json
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def bench(fn, iters=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    heads, kv_heads, dim = 32, 8, 128
    for n in (2048, 8192):
        q = torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kr, vr = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        flops = 4 * heads * dim * n * (n + 1) / 2
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            for gqa in (True, False):
                try:
                    with sdpa_kernel(backend):
                        if gqa:
                            ms = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
                        else:
                            ms = bench(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True))
                    rows.append(dict(tokens=n, backend=backend.name, enable_gqa=gqa, ms=ms, tflops=flops / ms / 1e9))
                except RuntimeError as e:
                    rows.append(dict(tokens=n, backend=backend.name, enable_gqa=gqa, error=str(e).splitlines()[0]))
    if args.out:
        json.dump(rows, open(args.out, "w"), indent=2)
    print("\n== SDPA causal prefill, 32/8 heads, head_dim 128 ==")
    for r in rows:
        what = f"{r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s" if "ms" in r else r["error"][:90]
        print(f"{r['tokens']:6d} {r['backend']:20s} gqa={r['enable_gqa']!s:5s} {what}")


if __name__ == "__main__":
    main()
