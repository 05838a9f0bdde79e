"""Would the decode GEMVs stream their weights faster through Hopper's TMA (tensor-memory accelerator) than
through the engine's pointer loads (cp.async)?  A variant kernel reads each [BLOCK_N, BLOCK_K] weight tile with
a host-made tensor descriptor; each shape is swept over TMA tiles inside the real batch-1 decode step (the
start-up-tuned engine GEMV for the other shapes), by coordinate descent, against the engine's step.

    python3 benchmarks/probe_gemv_tma.py --out $OUT/gemv_tma.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench_h200 import make_engine, rel
from llm_anatomy.kernels import gemv as gemv_module
from llm_anatomy.kernels.activation import silu_mul_reference
from llm_anatomy.kernels.pdl import PDL, gdc_enter
from probe_decode_parts import decode_forward, step_ms

TMA_TILES = [(bn, bk, w, s) for bn, bk in ((16, 256), (32, 128), (32, 256), (64, 128), (16, 512))
             for w in (2, 4) for s in (3, 4, 6)]


@triton.jit(do_not_specialize=["M"])
def _gemv_tma_kernel(x_ptr, w_desc, y_ptr, M, N, stride_xm, stride_ym, K: tl.constexpr, M_PAD: tl.constexpr,
                     GATED: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr):
    gdc_enter(USE_PDL)
    n0 = tl.program_id(0) * BLOCK_N
    rm = tl.arange(0, M_PAD)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    acc_up = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k0 + rk[None, :], mask=rm[:, None] < M, other=0.0)
        acc += tl.dot(x, tl.trans(w_desc.load([n0, k0])))
        if GATED:
            acc_up += tl.dot(x, tl.trans(w_desc.load([N + n0, k0])))
    gemv_module.store_rows(y_ptr, acc, acc_up, rm, n0 + tl.arange(0, BLOCK_N), M, N, stride_ym, GATED)


TMA_PICK: dict[tuple, tuple] = {}  # tile_key -> TMA tile; shapes not in it run the engine's kernel
_DESCRIPTORS: dict[tuple, TensorDescriptor] = {}


def gemv_tma(x, weight, gated=False, tile=None):
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    pick = TMA_PICK.get(gemv_module.tile_key(n, k, gated, weight.dtype)) if tile is None else tile
    if pick is None:
        return ENGINE_GEMV(x, weight, gated)
    bn, bk, warps, stages = pick
    key = (weight.data_ptr(), weight.shape[0], bn, bk)
    desc = _DESCRIPTORS.get(key)
    if desc is None:
        desc = _DESCRIPTORS[key] = TensorDescriptor.from_tensor(weight, [bn, bk])
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_tma_kernel[(triton.cdiv(n, bn),)](x, desc, y, m, n, x.stride(0), y.stride(0), K=k, M_PAD=16, GATED=gated,
                                            USE_PDL=PDL.on, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages,
                                            launch_pdl=PDL.on, num_warps=warps)
    return y


ENGINE_GEMV = gemv_module.gemv


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    ctx = {"model": "Qwen/Qwen3-8B"}
    engine = make_engine(ctx, kv_cache_tokens=8192, max_num_seqs=1, max_model_len=4096)
    out = {"engine_tiles": {str(k): str(t) for k, t in gemv_module.TILES.items()}, "check": {}}
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * 1000, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    for tile in ((16, 256, 4, 4), (64, 128, 2, 3)):
        out["check"][str(tile)] = (rel(gemv_tma(x, w[:1000], tile=tile), F.linear(x, w[:1000])),
                                   rel(gemv_tma(x, w, gated=True, tile=tile), silu_mul_reference(F.linear(x, w))))
    print("check", out["check"], flush=True)
    with torch.inference_mode():
        forward = decode_forward(engine)
        out["engine_step_ms"] = step_ms(engine, forward)
        gemv_module.gemv = gemv_tma
        try:
            out["sweeps"] = {}
            for key in engine.runner._gemv_keys():
                rows = {}
                for tile in TMA_TILES:
                    TMA_PICK[key] = tile
                    try:
                        rows[str(tile)] = step_ms(engine, forward, iters=30)
                    except Exception as e:
                        rows[str(tile)] = str(e)[:100]
                timed = {t: ms for t, ms in rows.items() if isinstance(ms, float)}
                best = min(timed, key=timed.get) if timed else None
                engine_ms = None
                del TMA_PICK[key]
                engine_ms = step_ms(engine, forward)
                if best is not None and timed[best] < engine_ms:
                    TMA_PICK[key] = eval(best)
                out["sweeps"][str(key)] = {"best_tma": best, "best_tma_ms": timed.get(best), "engine_ms": engine_ms,
                                           "kept": str(TMA_PICK.get(key)), "all": rows}
                print(key, "engine", round(engine_ms, 4), "tma", best, timed.get(best), flush=True)
            out["tma_step_ms"] = step_ms(engine, forward)
            TMA_PICK.clear()
            out["engine_again_ms"] = step_ms(engine, forward)
        finally:
            gemv_module.gemv = ENGINE_GEMV
    print("engine", out["engine_step_ms"], "with TMA picks", out["tma_step_ms"], "engine again", out["engine_again_ms"])
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
