"""The decode GEMVs' tiles, tuned once inside the captured decode step and kept on disk.

A GEMV's best tile depends on what runs around it: with programmatic dependent launch the next kernel starts
while this one drains, and the weights come cold from HBM every step. Timed alone (Triton's autotuner), the
picks vary from process to process and can cost the step more than a kernel change gains (benchmarks/README.md).
So each shape is
tuned by coordinate descent on the real thing: for each candidate tile, the batch-1 decode step is captured
and replayed, and the fastest step wins; then the winner with weights read ahead of the PDL wait
(gemv.prefetch_variants) is tried. Shapes go largest first, each tuned with the others at their best so far.
The choice is stored per GPU model, CUDA, torch and Triton version and per version of the step's kernels (their
code, comments and docstrings aside: a change to any of them, such as when each lets the next launch, moves the
best tiles), and a later start-up reads it back.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..disk_cache import cache_file, read_entries, write_entry

if TYPE_CHECKING:  # the kernels need Triton, which an engine without the fast path may not have
    from ..kernels.gemv import Tile

CACHE_FORMAT = 2  # entries [block_n, block_k, num_warps, num_stages, prefetch]


def _candidates(candidates: Sequence[Tile] | None) -> Sequence[Tile]:
    if candidates is not None:
        return candidates
    from ..kernels.gemv import CANDIDATE_TILES

    return CANDIDATE_TILES


@dataclass
class TileTuning:
    """What start-up did about the GEMV tiles."""
    tiles: dict[tuple, Tile]  # tile_key -> tile in use
    source: str  # "tuned" (some timed now), "cache" (all read back), "shipped" (the package's table for this GPU)
    seconds: float
    step_ms: float | None = None  # the batch-1 decode step with the chosen tiles, when tuned now


def coordinate_descent(keys: Sequence[tuple], tiles: dict[tuple, Tile], step_ms: Callable[[], float],
                       candidates: Sequence[Tile] | None = None) -> float:
    """Tune tiles[key] for each key in order, the others held: the best candidate, then the best of it and its
    prefetch variants; returns the last best step time. A tile that cannot run here (a kernel needing more
    shared memory than there is) is skipped."""
    from triton.runtime.errors import OutOfResources

    from ..kernels.gemv import prefetch_variants

    def fastest(key, tried: Sequence[Tile], best: tuple[Tile, float] | None) -> tuple[Tile, float] | None:
        for tile in tried:
            tiles[key] = tile
            try:
                ms = step_ms()
            except OutOfResources:
                continue
            if best is None or ms < best[1]:
                best = (tile, ms)
        return best

    best_ms = float("inf")
    for key in keys:
        best = fastest(key, _candidates(candidates), None)
        if best is None:
            raise RuntimeError(f"no candidate GEMV tile runs for shape {key}")
        tiles[key], best_ms = fastest(key, prefetch_variants(best[0], key[1]), best)
    return best_ms


def device_tag(device) -> str:
    """What tiles are kept for: the GPU model and the CUDA and torch builds (Triton's version is added below)."""
    import torch

    return f"{torch.cuda.get_device_name(device)} | cuda {torch.version.cuda} | torch {torch.__version__}"


def code_digest(source: str) -> str:
    """A digest of Python source that a comment or a docstring does not change (ast drops the comments)."""
    import ast
    import hashlib

    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()[:12]


def kernels_digest() -> str:
    """A digest of the code of the decode step's kernel modules (their comments and docstrings aside)."""
    from pathlib import Path

    from ..kernels import decode_attention, gemv, norm, pdl, rope

    return code_digest("".join(Path(m.__file__).read_text() for m in (gemv, decode_attention, norm, rope, pdl)))


def _cache_key(device: str, pdl: bool) -> str:
    import triton

    return f"{device} | triton {triton.__version__} | kernels {kernels_digest()} | pdl {'on' if pdl else 'off'}"


def _entry_key(key: tuple) -> str:
    n, k, gated, dtype = key
    return f"{n}x{k}{' gated' if gated else ''} {dtype}"


def _tiles_of(entry: dict, keys: Sequence[tuple], candidates: Sequence[Tile] | None) -> dict[tuple, Tile]:
    """The entry's tiles for these shapes: only well-formed ones that are candidates, or their prefetch variants for
    the shape's K (a damaged or foreign entry yields nothing)."""
    from ..kernels.gemv import Tile, prefetch_variants

    candidates = _candidates(candidates)
    found = {}
    for key in keys:
        value = entry.get(_entry_key(key))
        if isinstance(value, list) and len(value) == 5 and all(type(v) is int for v in value):
            tile, base = Tile(*value), Tile(*value[:4])
            if base in candidates and (tile == base or tile in prefetch_variants(base, key[1])):
                found[key] = tile
    return found


def cached_tiles(device: str, pdl: bool, keys: Sequence[tuple], cache_dir: str | os.PathLike | None = None,
                 candidates: Sequence[Tile] | None = None) -> dict[tuple, Tile]:
    """The tiles stored for these shapes on this device (only the shapes found)."""
    entry = read_entries(cache_file("gemv_tiles.json", cache_dir), CACHE_FORMAT).get(_cache_key(device, pdl), {})
    return _tiles_of(entry, keys, candidates)


def store_tiles(device: str, pdl: bool, tiles: dict[tuple, Tile], cache_dir: str | os.PathLike | None = None):
    path = cache_file("gemv_tiles.json", cache_dir)
    cache_key = _cache_key(device, pdl)
    entry = read_entries(path, CACHE_FORMAT).get(cache_key, {})
    entry.update({_entry_key(k): [t.block_n, t.block_k, t.num_warps, t.num_stages, t.prefetch]
                  for k, t in tiles.items()})
    return write_entry(path, CACHE_FORMAT, cache_key, entry)


def shipped_tiles(device: str, pdl: bool, keys: Sequence[tuple], candidates: Sequence[Tile] | None = None
                  ) -> dict[tuple, Tile]:
    """Tiles tuned on a GPU of this model and shipped with the package (data/gemv_tiles.json, whose header says
    where and with what they were measured), for a first start-up that would otherwise tune for most of a
    minute. Keyed by the GPU's name alone: tiles tuned with other kernel or library versions are still correct,
    at worst a little slower, and a later start-up's own tuning can replace them (`calibrate --force`)."""
    path = Path(__file__).resolve().parent.parent / "data" / "gemv_tiles.json"
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    gpu = device.split(" | ")[0]
    return _tiles_of(table.get("entries", {}).get(f"{gpu} | pdl {'on' if pdl else 'off'}", {}), keys, candidates)


def tune_tiles(keys: Sequence[tuple], tiles: dict[tuple, Tile], step_ms: Callable[[], float], device: str,
               pdl: bool, cache_dir: str | os.PathLike | None = None,
               candidates: Sequence[Tile] | None = None) -> TileTuning:
    """Read the keys' tiles from the cache; tune those missing (largest first, as given) and store them."""
    start = time.perf_counter()
    found = cached_tiles(device, pdl, keys, cache_dir, candidates)
    tiles.update(found)
    missing = [k for k in keys if k not in found]
    if not missing:
        return TileTuning({k: tiles[k] for k in keys}, "cache", time.perf_counter() - start)
    shipped = shipped_tiles(device, pdl, missing, candidates)
    if len(shipped) == len(missing):
        tiles.update(shipped)
        return TileTuning({k: tiles[k] for k in keys}, "shipped", time.perf_counter() - start)
    ms = coordinate_descent(missing, tiles, step_ms, candidates)
    try:
        store_tiles(device, pdl, {k: tiles[k] for k in keys}, cache_dir)
    except OSError as e:  # a cache that cannot be written costs the next start-up a tuning, nothing more
        warnings.warn(f"could not save the GEMV tiles: {e}", stacklevel=2)
    return TileTuning({k: tiles[k] for k in keys}, "tuned", time.perf_counter() - start, ms)


def gemv_keys(model) -> list[tuple]:
    """The decode step's GEMV shapes (the linear layers whose inputs the Triton GEMV takes), largest first."""
    from torch import nn

    from ..kernels.gemv import tile_key

    keys = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and m.in_features % 512 == 0:
            gated = name.endswith("gate_up_proj")
            n = m.out_features // 2 if gated else m.out_features
            keys[tile_key(n, m.in_features, gated, m.weight.dtype)] = m.weight.numel()
    return sorted(keys, key=lambda k: -keys[k])


def tune_gemv_tiles(plan, model, graphs, device, cache_dir: str | os.PathLike | None = None):
    """The plan with each GEMV shape's tile, tuned inside the captured batch-1 decode step at a context of up to
    512 tokens (whatever the KV pool holds; nothing is stored), or read from the cache; and what was done.
    The tiles serve the Triton GEMV (batches of 2-16 rows, and batch 1 where the plan does not stream): they are
    timed with batch 1 on it."""
    pool = graphs.pool
    context = min(512, pool.num_blocks * pool.block_size, graphs.block_tables.device_rows.shape[1] * pool.block_size)
    timer = graphs.decode_step_timer(context)
    on_triton = replace(plan, stream_gemv=False, norm_in_gemv=False)
    tiles: dict[tuple, Tile] = {}
    try:
        tuning = tune_tiles(gemv_keys(model), tiles, lambda: timer(on_triton.with_tiles(tiles)), device_tag(device),
                            plan.pdl, cache_dir)
    finally:
        graphs.reset_buffers()
    return plan.with_tiles(tuning.tiles), tuning
