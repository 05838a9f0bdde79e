"""The streaming decode attention split kernel (CUDA C++ through NVRTC) against the Triton split kernel, both
merged by the Triton merge. CUDA only, but for `supports`."""

import pytest
import torch

from llm_anatomy.kernels import stream_attention as sa
from llm_anatomy.kernels.decode_attention import paged_decode_attention

cuda = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                          reason="needs a Hopper-or-later CUDA device")


def test_supports_only_single_bf16_rows_on_cuda():
    cache = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    table = torch.zeros(1, 4, dtype=torch.int32)
    assert not sa.supports(torch.zeros(1, 32, 128, dtype=torch.bfloat16), cache, cache, table, 16, 64, 4)


def test_shared_bytes_hold_the_ring_or_the_warps_merge():
    assert sa.shared_bytes(64, 4, 4) == 4 * 64 * 128 * 2 * 2
    assert sa.shared_bytes(64, 2, 32) == 8 * 32 * 130 * 4  # the merge is the larger
    assert sa.shared_bytes(64, 4, 4, 10) == 4 * 64 * 128 * 2 * 2 + 40


def test_split_pages_cover_any_split():
    """For every context a table holds, each split's tokens (as the kernel and the merge cut them) span at most
    split_pages pages."""
    for width, page, splits, tile in ((8, 16, 3, 64), (2065, 16, 16, 64), (2065, 16, 33, 64), (40, 128, 5, 64)):
        most = sa.split_pages(width, page, splits, tile)
        for ctx in range(1, width * page + 1, 7):
            per = -(-(-(-ctx // splits)) // tile) * tile
            for s in range(splits):
                start, end = s * per, min(s * per + per, ctx)
                if start < end:
                    assert (end - 1) // page - start // page + 1 <= most


@pytest.fixture
def streaming():
    from llm_anatomy.kernels.pdl import enable_pdl

    enable_pdl(torch.device("cuda"))
    saved = sa.STREAM.on, sa.STAGES
    sa.STREAM.on = True
    yield
    sa.STREAM.on, sa.STAGES = saved


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (16, 8), (64, 8)])
@pytest.mark.parametrize("splits,tile,stages", [(16, 64, 4), (33, 64, 3), (8, 128, 2)])
@pytest.mark.parametrize("context", [1, 63, 64, 65, 700, 5000])
def test_matches_the_triton_split_kernel(heads, kv_heads, splits, tile, stages, context, streaming):
    """Random caches over a shuffled block table of 16-token pages: the same output as the Triton split kernel
    within the float32 sums' and bf16 probabilities' rounding, the same bits every run."""
    group = heads // kv_heads
    tile = max(tile, 8 * 32 // group)  # a warp scores 32 / group tokens a round
    stages = min(stages, sa.SHARED_LIMIT // (tile * 128 * 2 * 2))
    g = torch.Generator(device="cuda").manual_seed(context + heads + splits)
    pages = -(-context // 16) + 2
    k = torch.randn(pages, 16, kv_heads, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn(pages, 16, kv_heads, 128, device="cuda", generator=g).bfloat16()
    table = torch.randperm(pages, device="cuda", generator=g).int()[None]
    q = torch.randn(1, heads, 128, device="cuda", generator=g).bfloat16()
    lens = torch.tensor([context], device="cuda", dtype=torch.int32)
    sa.STAGES = stages
    assert sa.supports(q, k, v, table, splits, tile, stages)
    got = paged_decode_attention(q, k, v, table, lens, 128 ** -0.5, splits=splits, block_n=tile)
    sa.STREAM.on = False
    ref = paged_decode_attention(q, k, v, table, lens, 128 ** -0.5, splits=splits, block_n=tile)
    slots = (table[0, :, None] * 16 + torch.arange(16, device="cuda")).flatten()[:context]
    keys, values = (c.view(-1, kv_heads, 128)[slots].float() for c in (k, v))  # [context, KV heads, 128]
    scores = torch.einsum("hgd,thd->hgt", q.float().view(kv_heads, group, 128), keys) * 128 ** -0.5
    exact = torch.einsum("hgt,thd->hgd", scores.softmax(-1), values).reshape(1, heads, 128)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    assert (got.float() - ref.float()).abs().max().item() < 2e-2
    assert ((got.float() - exact).norm() / exact.norm()).item() < 5e-3
    sa.STREAM.on = True
    assert torch.equal(paged_decode_attention(q, k, v, table, lens, 128 ** -0.5, splits=splits, block_n=tile), got)
