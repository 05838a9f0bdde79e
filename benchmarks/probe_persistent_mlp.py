"""Can a persistent kernel stream the weights of dependent GEMVs without the drain and ramp between kernels?

The decode step loses about 1 ms to transitions between dependent kernels (probe_gemv_overlap.py: the step's
GEMVs alone take 4.37 ms waiting for each other and 3.28 ms not waiting). Here the MLP of 36 layers at batch 1
(gate_up with SiLU*up, then down, the down output feeding the next layer's gate_up; no norms) runs two ways:

- kernels: the engine's GEMV kernel, 72 launches in a CUDA graph with programmatic dependent launch;
- persistent: one kernel, one CTA per multiprocessor, looping over the layers. Each phase (a layer's gate_up, its
  down) ends in a grid-wide barrier (an atomic counter) instead of a kernel boundary; each CTA arrives, reads its
  first weight tiles of the next phase, then waits for the others.

Both read the same weights (10.9 GB for 36 layers); their outputs after two layers are compared. A barrier
that waits too long gives up and raises a flag instead of hanging the GPU (all CTAs must be resident at once).

    python3 benchmarks/probe_persistent_mlp.py --out $OUT/persistent_mlp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench_h200 import cuda_ms, positive_int
from llm_anatomy.kernels import gemv as gemv_module
from llm_anatomy.kernels.pdl import enable_pdl

HIDDEN, INTER = 4096, 12288


def mlp_weights(layers: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-8B's MLP weights for `layers` layers, random bf16 on g's device: gate_up [L, 2I, H], down [L, H, I]."""
    gate_up = torch.randn(layers, 2 * INTER, HIDDEN, generator=g, device=g.device) / HIDDEN ** 0.5
    down = torch.randn(layers, HIDDEN, INTER, generator=g, device=g.device) / INTER ** 0.5
    return gate_up.bfloat16(), down.bfloat16()


def mlp_probe_args(argv, rounds: int = 3) -> argparse.Namespace:
    """The MLP probes' arguments (--out, --layers, --rounds), checked before any GPU work; then PDL on."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--layers", type=positive_int, default=36)
    parser.add_argument("--rounds", type=positive_int, default=rounds)
    args = parser.parse_args(argv)
    enable_pdl(torch.device("cuda"))
    return args


def use_tiles(gate_up: gemv_module.Tile, down: gemv_module.Tile) -> None:
    """The engine's GEMV tiles for the MLP's two shapes in bf16, as some start-up on the H200 picked them."""
    gemv_module.TILES[gemv_module.tile_key(INTER, HIDDEN, True, torch.bfloat16)] = gate_up
    gemv_module.TILES[gemv_module.tile_key(HIDDEN, INTER, False, torch.bfloat16)] = down
MAX_SPIN = 1 << 18  # polls, a fraction of a second: far beyond any phase, short of a hung GPU


@triton.jit
def _arrive(counter_ptr):
    """This CTA is done with the phase: its writes are released to the GPU (CTA-wide sync, then one add)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(counter_ptr, target, flag_ptr, MAX_SPIN: tl.constexpr):
    """Until `target` CTAs have arrived (the counter only grows within a launch); then every CTA's writes before
    its arrival are visible here. Gives up after MAX_SPIN polls, raising the flag, rather than hang the GPU."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < MAX_SPIN):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < target:
        tl.store(flag_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _gated_block(x_ptr, w_ptr, act_ptr, blk, acc, acc_up, K_START: tl.constexpr, H: tl.constexpr,
                 I: tl.constexpr, M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.arange(0, M_PAD)
    rn = blk * BN + tl.arange(0, BN)
    for k0 in range(K_START, H, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * H + rk[None, :], mask=rm[:, None] < 1, other=0.0, cache_modifier=".cg")
        w = tl.load(w_ptr + rn[:, None] * H + rk[None, :])
        u = tl.load(w_ptr + (rn[:, None] + I) * H + rk[None, :])
        acc += tl.dot(x, tl.trans(w))
        acc_up += tl.dot(x, tl.trans(u))
    gemv_module.store_rows(act_ptr, acc, acc_up, rm, rn, 1, I, I, True)


@triton.jit
def _mlp_persistent_kernel(x_ptr, wgu_ptr, wd_ptr, act_ptr, counter_ptr, flag_ptr, n_layers,
                           H: tl.constexpr, I: tl.constexpr, M_PAD: tl.constexpr, BN1: tl.constexpr,
                           BK1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr, PRE1: tl.constexpr,
                           PRE2: tl.constexpr, MAX_SPIN: tl.constexpr):
    """x [1, H] is each layer's input and output; act [1, I]. One down block (BN2 rows) per CTA: H // BN2 <= grid."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    rm = tl.arange(0, M_PAD)
    rp1 = tl.arange(0, PRE1 * BK1)
    rp2 = tl.arange(0, PRE2 * BK2)
    rn1 = pid * BN1 + tl.arange(0, BN1)  # this CTA's first gate_up block
    rn2 = pid * BN2 + tl.arange(0, BN2)  # its down block
    arrived = 0
    # the first layer's first gate_up tiles: nothing to wait for yet
    g_first = tl.load(wgu_ptr + rn1[:, None] * H + rp1[None, :])
    u_first = tl.load(wgu_ptr + (rn1[:, None] + I) * H + rp1[None, :])
    layer = 0
    while layer < n_layers:  # (while, not range: the interpreter takes no tensor as a range bound)
        wgu = wgu_ptr + layer * (2 * I * H)
        wd = wd_ptr + layer * (H * I)
        # gate_up: the first block from the tiles read before the barrier, the others from scratch
        x_first = tl.load(x_ptr + rm[:, None] * H + rp1[None, :], mask=rm[:, None] < 1, other=0.0,
                          cache_modifier=".cg")
        acc = tl.dot(x_first, tl.trans(g_first))
        acc_up = tl.dot(x_first, tl.trans(u_first))
        _gated_block(x_ptr, wgu, act_ptr, pid, acc, acc_up, PRE1 * BK1, H, I, M_PAD, BN1, BK1)
        blk = pid + grid
        while blk < I // BN1:
            zero = tl.zeros([M_PAD, BN1], tl.float32)
            _gated_block(x_ptr, wgu, act_ptr, blk, zero, zero, 0, H, I, M_PAD, BN1, BK1)
            blk += grid
        _arrive(counter_ptr)  # arrive first, then read ahead while the others finish
        d_first = tl.load(wd + rn2[:, None] * I + rp2[None, :], mask=rn2[:, None] < H, other=0.0)
        arrived += grid
        _wait(counter_ptr, arrived, flag_ptr, MAX_SPIN)
        # down: one block per CTA, its first tiles read before the barrier
        if pid < H // BN2:  # this CTA has a down block
            a_first = tl.load(act_ptr + rm[:, None] * I + rp2[None, :], mask=rm[:, None] < 1, other=0.0,
                              cache_modifier=".cg")
            acc2 = tl.dot(a_first, tl.trans(d_first))
            for k0 in range(PRE2 * BK2, I, BK2):
                rk = k0 + tl.arange(0, BK2)
                a = tl.load(act_ptr + rm[:, None] * I + rk[None, :], mask=rm[:, None] < 1, other=0.0,
                            cache_modifier=".cg")
                acc2 += tl.dot(a, tl.trans(tl.load(wd + rn2[:, None] * I + rk[None, :])))
            gemv_module.store_rows(x_ptr, acc2, acc2, rm, rn2, 1, H, H, False)
        _arrive(counter_ptr)
        if layer + 1 < n_layers:  # the next layer's first gate_up tiles while waiting for every down block
            nxt = wgu + 2 * I * H
            g_first = tl.load(nxt + rn1[:, None] * H + rp1[None, :])
            u_first = tl.load(nxt + (rn1[:, None] + I) * H + rp1[None, :])
        arrived += grid
        _wait(counter_ptr, arrived, flag_ptr, MAX_SPIN)
        layer += 1


def persistent(x, wgu, wd, act, counter, flag, grid: int, tile: dict):
    """x [1, H] in place through the layers of wgu [L, 2I, H] and wd [L, H, I]; act [1, I] scratch. Every one of
    the `grid` CTAs must be resident at once, or the barriers give up (flag set, output wrong)."""
    hidden, inter = wd.shape[1], wd.shape[2]
    assert hidden // tile["bn2"] <= grid and inter % tile["bn1"] == 0, "one down block per CTA, whole gate_up blocks"
    assert tile["pre1"] * tile["bk1"] <= hidden and tile["pre2"] * tile["bk2"] <= inter, "read ahead within K"
    counter.zero_()
    _mlp_persistent_kernel[(grid,)](x, wgu, wd, act, counter, flag, wgu.shape[0], H=hidden, I=inter, M_PAD=16,
                                    BN1=tile["bn1"], BK1=tile["bk1"], BN2=tile["bn2"], BK2=tile["bk2"],
                                    PRE1=tile["pre1"], PRE2=tile["pre2"], MAX_SPIN=MAX_SPIN,
                                    num_warps=tile["warps"], num_stages=tile["stages"])


def kernels(x, wgu, wd) -> torch.Tensor:
    for layer in range(wgu.shape[0]):
        x = gemv_module.gemv(gemv_module.gemv(x, wgu[layer], gated=True), wd[layer])
    return x


def reference(x, wgu, wd) -> torch.Tensor:
    for layer in range(wgu.shape[0]):
        gate, up = (x @ wgu[layer].T).chunk(2, dim=-1)
        x = (torch.nn.functional.silu(gate) * up) @ wd[layer].T
    return x


def check(device, hidden: int, inter: int, layers: int, grid: int, tile: dict) -> float:
    """The persistent kernel's output against torch's, float32, small shapes: the relative error."""
    g = torch.Generator().manual_seed(0)
    wgu = (torch.randn(layers, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(device)
    wd = (torch.randn(layers, hidden, inter, generator=g) / inter ** 0.5).to(device)
    x = torch.randn(1, hidden, generator=g).to(device)
    ref = reference(x, wgu, wd)
    act = torch.empty(1, inter, device=device)
    counter, flag = torch.zeros(1, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device)
    persistent(x, wgu, wd, act, counter, flag, grid, tile)
    assert flag.item() == 0, "a grid barrier gave up"
    return ((x - ref).norm() / ref.norm()).item()


TILES = {  # gate_up BN1 x BK1, down BN2 x BK2, K tiles read ahead, warps, stages, CTAs per multiprocessor
    "bn32_pre1_w4_s3": dict(bn1=32, bk1=128, bn2=32, bk2=256, pre1=1, pre2=1, warps=4, stages=3, per_sm=1),
    "bn32_pre2_w4_s4": dict(bn1=32, bk1=128, bn2=32, bk2=256, pre1=2, pre2=2, warps=4, stages=4, per_sm=1),
    "bn32_pre2_w8_s4": dict(bn1=32, bk1=128, bn2=32, bk2=256, pre1=2, pre2=2, warps=8, stages=4, per_sm=1),
    "bn32_pre4_w8_s4": dict(bn1=32, bk1=128, bn2=32, bk2=256, pre1=4, pre2=4, warps=8, stages=4, per_sm=1),
    "bn16_pre2_w4_s4_x2": dict(bn1=16, bk1=128, bn2=16, bk2=256, pre1=2, pre2=2, warps=4, stages=4, per_sm=2),
}


def main(argv=None):
    args = mlp_probe_args(argv)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(0)
    wgu, wd = mlp_weights(args.layers, g)
    x0 = torch.randn(1, HIDDEN, generator=g, device=dev).bfloat16()
    use_tiles(gemv_module.Tile(32, 128, 4, 3, 1), gemv_module.Tile(16, 512, 2, 4))  # runs 20-22
    nbytes = (wgu.numel() + wd.numel()) * 2
    out = {"layers": args.layers, "gb": nbytes / 1e9, "sms": sms, "variants": {}}

    ref = kernels(x0, wgu[:2], wd[:2])  # compiles; the reference output of two layers (36 random ones overflow)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels(x0, wgu, wd)
    variants = {"kernels": (graph, x0.clone(), None)}
    act = torch.empty(1, INTER, dtype=torch.bfloat16, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    for name, tile in TILES.items():
        flag = torch.zeros(1, dtype=torch.int32, device=dev)
        x = x0.clone()
        grid = sms * tile["per_sm"]
        try:
            persistent(x, wgu[:2], wd[:2], act, counter, flag, grid, tile)
            torch.cuda.synchronize()
        except Exception as e:  # a variant that does not compile or fit
            out["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(name, out["variants"][name], flush=True)
            continue
        err = ((x.float() - ref.float()).norm() / ref.float().norm()).item()
        out["variants"][name] = {"rel_err_vs_kernels_2_layers": err, "barrier_gave_up": bool(flag.item()), "grid": grid}
        if flag.item():  # not all CTAs resident: timing it would only time the give-ups
            print(name, out["variants"][name], flush=True)
            continue
        x.copy_(x0)
        pgraph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(pgraph):
            persistent(x, wgu, wd, act, counter, flag, grid, tile)
        variants[name] = (pgraph, x, flag)
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (graph, x, _) in variants.items():
            x.copy_(x0)
            times[name].append(cuda_ms(graph.replay, iters=10, warmup=2))
    for name, t in times.items():
        row = out["variants"].setdefault(name, {})
        row.update({"ms": statistics.median(t), "all": t, "tb_s": nbytes / statistics.median(t) / 1e9})
        if variants[name][2] is not None:
            row["barrier_gave_up_timed"] = bool(variants[name][2].item())
        print(f"{name:18s} {row['ms']:.3f} ms {row['tb_s']:.2f} TB/s",
              {k: v for k, v in row.items() if k not in ("ms", "all", "tb_s")}, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
