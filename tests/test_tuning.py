"""Start-up's GEMV tile tuning: coordinate descent over candidate tiles, and the disk cache that spares a
later start-up the tuning. The step time is a made-up function of the tiles here; on a GPU it is the
captured decode step's (tests/test_gpu.py)."""

import dataclasses
import json
from unittest import mock

import pytest

pytest.importorskip("triton")

from triton.runtime.errors import OutOfResources  # noqa: E402

from llm_anatomy.engine.tuning import (cached_tiles, code_digest, coordinate_descent, kernels_digest,  # noqa: E402
                                       tune_tiles)
from llm_anatomy.kernels.gemv import CANDIDATE_TILES, Tile, prefetch_variants  # noqa: E402

QKV, DOWN = (6144, 4096, False, "bfloat16"), (4096, 12288, False, "bfloat16")
CANDIDATES = [Tile(16, 256, 4, 4), Tile(32, 256, 4, 4), Tile(32, 512, 4, 4), Tile(64, 128, 2, 4)]


def fake_step(tiles, calls, too_big=()):
    """A step whose time each shape's tile sets: qkv is fastest at 32x256, down at 32x512 reading two K tiles
    ahead of the wait (prefetch 2); a tile in too_big does not fit in shared memory."""
    best = {QKV: Tile(32, 256, 4, 4), DOWN: Tile(32, 512, 4, 4)}

    def cost(key, tile):
        base = dataclasses.replace(tile, prefetch=0)
        ahead = -0.05 if key == DOWN and tile.prefetch == 2 else 0.0
        return ahead + (0.0 if base == best[key] else 0.1 * (1 + CANDIDATES.index(base)))

    def step_ms():
        calls.append(dict(tiles))
        if any(t in too_big for t in tiles.values()):
            raise OutOfResources(245760, 232448, "shared memory")
        return 4.0 + sum(cost(k, tiles[k]) for k in best if k in tiles)

    return step_ms


TUNED = {DOWN: Tile(32, 512, 4, 4, prefetch=2), QKV: Tile(32, 256, 4, 4)}
CALLS = 2 * (len(CANDIDATES) + 2)  # per shape: the candidates, then the best one's two prefetch variants


def test_coordinate_descent_picks_each_shapes_fastest_tile_and_skips_what_cannot_run():
    tiles, calls = {}, []
    ms = coordinate_descent([DOWN, QKV], tiles, fake_step(tiles, calls, too_big={Tile(64, 128, 2, 4)}), CANDIDATES)
    assert tiles == TUNED  # a prefetch variant kept only where it is faster
    assert ms == pytest.approx(3.95)
    assert len(calls) == CALLS
    assert [c[DOWN] for c in calls[len(CANDIDATES):len(CANDIDATES) + 2]] == [
        Tile(32, 512, 4, 4, prefetch=1), Tile(32, 512, 4, 4, prefetch=2)]  # the variants of the best candidate
    assert all(c[DOWN] == TUNED[DOWN] for c in calls[len(CANDIDATES) + 2:])  # the first shape held at its best


def test_coordinate_descent_refuses_a_shape_no_tile_runs():
    tiles = {}
    with pytest.raises(RuntimeError, match="no candidate GEMV tile runs"):
        coordinate_descent([QKV], tiles, fake_step(tiles, [], too_big=set(CANDIDATES)), CANDIDATES)


def test_tuned_tiles_are_cached_per_device_and_pdl(tmp_path):
    device = "cuda | NVIDIA H200 | driver 580 | cuda 13.0 | torch 2.11"
    tiles, calls = {}, []
    first = tune_tiles([DOWN, QKV], tiles, fake_step(tiles, calls), device, True, tmp_path, CANDIDATES)
    assert first.source == "tuned" and first.tiles == TUNED
    assert first.step_ms == pytest.approx(3.95) and len(calls) == CALLS

    tiles, calls = {}, []  # a later start-up on the same device: read back, nothing timed
    again = tune_tiles([DOWN, QKV], tiles, fake_step(tiles, calls), device, True, tmp_path, CANDIDATES)
    assert again.source == "cache" and again.tiles == first.tiles and tiles == first.tiles and not calls

    tiles, calls = {}, []  # without PDL, or on another device, the tiles are tuned again
    assert tune_tiles([QKV], tiles, fake_step(tiles, calls), device, False, tmp_path, CANDIDATES).source == "tuned"
    assert tune_tiles([QKV], tiles, fake_step(tiles, calls), device.replace("H200", "H100"), True,
                      tmp_path, CANDIDATES).source == "tuned"

    tiles, calls = {}, []  # after a change to the step's kernels, tuned again
    with mock.patch("llm_anatomy.engine.tuning.kernels_digest", return_value="another"):
        assert tune_tiles([QKV], tiles, fake_step(tiles, calls), device, True, tmp_path, CANDIDATES).source == "tuned"

    tiles, calls = {}, []  # a new shape tunes that shape only; the others come from the cache
    new = (151936, 4096, False, "bfloat16")
    third = tune_tiles([new, QKV], tiles, fake_step(tiles, calls), device, True, tmp_path, CANDIDATES)
    assert third.source == "tuned" and len(calls) == CALLS // 2 and all(c[QKV] == first.tiles[QKV] for c in calls)


def test_a_damaged_or_foreign_cache_entry_is_not_used(tmp_path):
    device = "cuda | NVIDIA H200"
    path = tmp_path / "gemv_tiles.json"
    path.write_text("{not json")
    assert cached_tiles(device, True, [QKV], tmp_path, CANDIDATES) == {}
    entry = {"6144x4096 bfloat16": [32, 256, 4, 4, 1], "4096x12288 bfloat16": [32, 1024, 4, 4, 0]}  # not a candidate
    key = f"{device} | triton {_triton()} | kernels {kernels_digest()} | pdl on"
    path.write_text(json.dumps({"format": 2, "entries": {key: entry}}))
    assert cached_tiles(device, True, [QKV, DOWN], tmp_path, CANDIDATES) == {QKV: Tile(32, 256, 4, 4, prefetch=1)}
    # a string, no such prefetch, too short
    for bad in ([32, 256, 4, "4", 0], [32, 256, 4, 4, 3], [32, 256, 4, 4], [32, 256, 4, 4, -1]):
        entry["6144x4096 bfloat16"] = bad
        path.write_text(json.dumps({"format": 2, "entries": {key: entry}}))
        assert cached_tiles(device, True, [QKV], tmp_path, CANDIDATES) == {}, bad
    small = (512, 1024, False, "bfloat16")  # K = 1024 holds two 512-wide K tiles: one may be read ahead, not two
    path.write_text(json.dumps({"format": 2, "entries": {key: {"512x1024 bfloat16": [32, 512, 4, 4, 2]}}}))
    assert cached_tiles(device, True, [small], tmp_path, CANDIDATES) == {}
    path.write_text(json.dumps({"format": 2, "entries": {key: {"512x1024 bfloat16": [32, 512, 4, 4, 1]}}}))
    assert cached_tiles(device, True, [small], tmp_path, CANDIDATES) == {small: Tile(32, 512, 4, 4, 1)}
    path.write_text(json.dumps({"format": 1, "entries": {key: {"6144x4096 bfloat16": [32, 256, 4, 4]}}}))
    assert cached_tiles(device, True, [QKV], tmp_path, CANDIDATES) == {}  # the format before prefetch: tuned again


def test_prefetch_variants_leave_a_k_tile_for_the_loop():
    assert prefetch_variants(Tile(32, 256, 4, 4), 4096) == [Tile(32, 256, 4, 4, 1), Tile(32, 256, 4, 4, 2)]
    assert prefetch_variants(Tile(16, 512, 2, 4), 1024) == [Tile(16, 512, 2, 4, 1)]
    assert str(Tile(16, 512, 2, 4, 2)) == "N16_K512_w2_s4_p2"


def test_candidate_tiles_fit_every_decode_shape():
    """Every candidate divides K (a multiple of 512, which the kernel requires) and holds its pipeline in the
    H100/H200's 227 KB of shared memory for the plain product; gated ones may not fit and are skipped."""
    for t in CANDIDATE_TILES:
        assert 512 % t.block_k == 0 and t.block_n >= 16 and t.num_warps in (2, 4, 8)
        assert 2 * t.num_stages * (t.block_n + 16) * t.block_k <= 227 * 1024, t


def _triton():
    import triton

    return triton.__version__


def test_the_kernels_digest_changes_with_their_code_not_their_comments_or_docstrings():
    code = 'import triton\n\n\n@triton.jit\ndef k(x):\n    """Adds one."""\n    return x + 1  # why\n'
    assert code_digest(code) == code_digest('"""A module."""\n' + code.replace("  # why", "  # because"))
    assert code_digest(code) == code_digest(code.replace('    """Adds one."""\n', ""))
    assert code_digest(code) != code_digest(code.replace("x + 1", "x + 2"))
    assert len(kernels_digest()) == 12


def test_a_first_start_on_a_shipped_gpu_reads_the_package_table(tmp_path):
    """The package ships the tiles tuned on an H200 for Qwen3-8B's shapes (data/gemv_tiles.json): a first start-up
    there (empty cache, any library versions) takes them and times nothing; another GPU, PDL off or a shape the
    table lacks is tuned as before."""
    shapes = [(12288, 4096, True, "bfloat16"), (151936, 4096, False, "bfloat16"), (4096, 12288, False, "bfloat16"),
              (4096, 4096, False, "bfloat16"), (6144, 4096, False, "bfloat16")]
    device = "NVIDIA H200 | cuda 13.9 | torch 9.0"
    tiles, calls = {}, []
    shipped = tune_tiles(shapes, tiles, fake_step(tiles, calls), device, True, tmp_path)
    assert shipped.source == "shipped" and not calls and set(shipped.tiles) == set(shapes)
    assert all(dataclasses.replace(t, prefetch=0) in CANDIDATE_TILES for t in shipped.tiles.values())
    for other, pdl, keys in (("NVIDIA H100 80GB HBM3 | cuda 13.0", True, [QKV]), (device, False, [QKV]),
                             (device, True, [QKV, (1024, 1024, False, "bfloat16")])):
        tiles, calls = {}, []
        assert tune_tiles(keys, tiles, fake_step(tiles, calls), other, pdl, tmp_path / other[:11] / str(pdl),
                          CANDIDATES).source == "tuned" and calls
