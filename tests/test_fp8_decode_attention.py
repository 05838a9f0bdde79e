"""The CUDA fp8 decode attention (kernels/fp8_decode_attention.py).

On the CPU: its layout maps are bijections, and one warp's work on a 16-token tile, emulated fragment by fragment
(each lane's loads, conversions, byte permutes, MMAs and movmatrix as the kernel's indexing does them, the MMAs by
PTX's fragment layouts), gives q k^T and softmax(q k^T) v. On a Hopper GPU: against float32 attention over the
dequantized cache, for Qwen3's group sizes, page sizes, contexts around the tile edges, padded rows, one split and
several (with the Triton merge), PDL, a CUDA graph, and NaN bytes in unused cache slots.
"""

import math
from functools import cache

import pytest
import torch

from llm_anatomy.kernels import fp8_decode_attention as fa

FP8 = torch.float8_e4m3fn


def test_layout_maps_are_bijections():
    assert sorted(fa.k_dim(t, s, j) for t in range(4) for s in range(8) for j in range(4)) == list(range(128))
    assert sorted(fa.tile_token(r) for r in range(16)) == list(range(16))
    assert sorted(fa.out_dim(m, r) for m in range(8) for r in range(16)) == list(range(128))
    for t in range(4):  # P.V's lane t holds the logical tokens 2t, 2t+1, 2t+8, 2t+9: physical 4t..4t+3 in order
        assert [fa.tile_token(r) for r in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)] == [4 * t + i for i in range(4)]
        for g in range(8):  # the rows that lane 4g+t loads for the score MMA (the kernel's expression)
            assert [4 * (g >> 1) + (g & 1) + 2 * h for h in range(2)] == [fa.tile_token(g), fa.tile_token(g + 8)]
    for g in range(8):  # lane g's P.V rows of all m-tiles: 16 consecutive head dims, in the order it stores them
        assert [fa.out_dim(m, g + 8 * r) for m in range(8) for r in range(2)] == list(range(16 * g, 16 * g + 16))


# PTX's m16n8k16 fragments (lane = 4g + t): A's register r, half e; B's; C's element i.
def a_at(lane, r, e):
    g, t = lane >> 2, lane & 3
    return g + 8 * (r & 1), 2 * t + e + 8 * (r >> 1)


def b_at(lane, r, e):
    return 2 * (lane & 3) + e + 8 * r, lane >> 2


def c_at(lane, i):
    return (lane >> 2) + 8 * (i >> 1), 2 * (lane & 3) + (i & 1)


def mma(c, a, b):
    """c [32][4] += A . B, from a [32][4] and b [32][2] registers, each a (low, high) pair of values."""
    A, B = torch.full((16, 16), math.nan, dtype=torch.float64), torch.full((16, 8), math.nan, dtype=torch.float64)
    for lane in range(32):
        for r in range(4):
            for e in range(2):
                A[a_at(lane, r, e)] = a[lane][r][e]
        for r in range(2):
            for e in range(2):
                B[b_at(lane, r, e)] = b[lane][r][e]
    assert not A.isnan().any() and not B.isnan().any()  # every element given once
    D = A @ B
    return [[c[lane][i] + D[c_at(lane, i)].item() for i in range(4)] for lane in range(32)]


def movmatrix_trans(regs):
    """movmatrix.m8n8.trans.b16: lane 4g+t holds row g, columns 2t, 2t+1 of an 8x8 matrix; gets its transpose's."""
    M = torch.empty(8, 8, dtype=torch.float64)
    for lane in range(32):
        for e in range(2):
            M[lane >> 2, 2 * (lane & 3) + e] = regs[lane][e]
    return [(M.T[lane >> 2, 2 * (lane & 3)].item(), M.T[lane >> 2, 2 * (lane & 3) + 1].item()) for lane in range(32)]


def byte_perm(x: int, y: int, selector: int) -> int:
    data = x | y << 32
    return sum(((data >> 8 * ((selector >> 4 * n) & 7)) & 0xFF) << 8 * n for n in range(4))


@cache
def e4m3(byte: int) -> float:
    return torch.tensor([byte], dtype=torch.uint8).view(FP8).double().item()


def cvt(word: int, high: bool):
    """cvt.rn.f16x2.e4m3x2 of a word's low (or high) two bytes: (value of the lower byte, value of the upper)."""
    half = word >> 16 if high else word & 0xFFFF
    return e4m3(half & 0xFF), e4m3(half >> 8)


def words(row_bytes) -> list[int]:
    return [int.from_bytes(bytes(row_bytes[i:i + 4].tolist()), "little") for i in range(0, len(row_bytes), 4)]


def emulate_tile(q, k, v, group):
    """One warp's tile as the kernel computes it: q [group, 128] (fp16 values), k and v [16, 128] e4m3 bytes
    (uint8). Returns (S^T [16 tokens, 8 heads] by physical token, O [group, 128] normalised)."""
    qpad = torch.zeros(8, 128, dtype=torch.float64)
    qpad[:group] = q
    qb = [[None] * 8 for _ in range(32)]
    a_k = [[None] * 8 for _ in range(32)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        row = qpad[g, 32 * t:32 * t + 32]  # raw[c]: 8 values from 32t + 8c, as f16x2 pairs x, y, z, w
        for c in range(4):
            pairs = [(row[8 * c + 2 * i].item(), row[8 * c + 2 * i + 1].item()) for i in range(4)]
            qb[lane][2 * c], qb[lane][2 * c + 1] = [pairs[0], pairs[1]], [pairs[2], pairs[3]]
        rows = [words(k[4 * (g >> 1) + (g & 1) + 2 * h, 32 * t:32 * t + 32]) for h in range(2)]
        for s in range(8):
            lo, hi = rows[0][s], rows[1][s]
            a_k[lane][s] = [cvt(lo, False), cvt(hi, False), cvt(lo, True), cvt(hi, True)]
    c = [[0.0] * 4 for _ in range(32)]
    for s in range(8):
        c = mma(c, [a_k[lane][s] for lane in range(32)], [qb[lane][s] for lane in range(32)])
    scores = torch.empty(16, 8, dtype=torch.float64)  # by physical token
    for lane in range(32):
        g = lane >> 2
        for i in range(4):
            row, col = c_at(lane, i)
            assert row == (g if i < 2 else g + 8)
            scores[4 * (g >> 1) + (g & 1) + 2 * (i >> 1), col] = c[lane][i]
    # softmax per column over the lanes of the same t (the kernel's shuffles over g), p rounded to fp16
    colmax = [max(c[lane][i] for lane in range(32) for i in range(4) if 2 * (lane & 3) + (i & 1) == col)
              for col in range(8)]
    p = [[math.exp(c[lane][i] - colmax[2 * (lane & 3) + (i & 1)]) for i in range(4)] for lane in range(32)]
    total = [sum(p[lane][i] for lane in range(32) for i in range(4) if 2 * (lane & 3) + (i & 1) == col)
             for col in range(8)]
    p16 = [[torch.tensor(x).half().double().item() for x in row] for row in p]
    pb0 = movmatrix_trans([(p16[lane][0], p16[lane][1]) for lane in range(32)])
    pb1 = movmatrix_trans([(p16[lane][2], p16[lane][3]) for lane in range(32)])
    o = [[[0.0] * 4 for _ in range(32)] for _ in range(8)]
    for c4 in range(4):
        a_lo, a_hi = [], []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            x, y, z, u = (words(v[4 * t + i, 16 * g:16 * g + 16])[c4] for i in range(4))
            xy01, xy23, zu01, zu23 = (byte_perm(x, y, 0x5140), byte_perm(x, y, 0x7362), byte_perm(z, u, 0x5140),
                                      byte_perm(z, u, 0x7362))
            a_lo.append([cvt(xy01, False), cvt(xy01, True), cvt(zu01, False), cvt(zu01, True)])
            a_hi.append([cvt(xy23, False), cvt(xy23, True), cvt(zu23, False), cvt(zu23, True)])
        b = [[pb0[lane], pb1[lane]] for lane in range(32)]
        o[2 * c4] = mma(o[2 * c4], a_lo, b)
        o[2 * c4 + 1] = mma(o[2 * c4 + 1], a_hi, b)
    out = torch.full((group, 128), math.nan, dtype=torch.float64)
    for lane in range(32):  # the stores: head 2t + h, dims 16g + 2m (o[m][h]) and 16g + 2m + 1 (o[m][h + 2])
        g, t = lane >> 2, lane & 3
        for h in range(2):
            if 2 * t + h < group:
                for m in range(8):
                    out[2 * t + h, 16 * g + 2 * m] = o[m][lane][h] / total[2 * t + h]
                    out[2 * t + h, 16 * g + 2 * m + 1] = o[m][lane][h + 2] / total[2 * t + h]
    return scores, out


@pytest.mark.parametrize("group", [5, 8])
def test_emulated_warp_tile_computes_attention(group):
    gen = torch.Generator().manual_seed(group)
    # e4m3 bytes of magnitudes 1/8..4 of both signs (exponent fields 4..8), so that the softmax is not one-hot
    values = torch.tensor([b for b in range(256) if 4 <= (b >> 3) & 15 <= 8], dtype=torch.uint8)
    k = values[torch.randint(0, len(values), (16, 128), generator=gen)]
    v = values[torch.randint(0, len(values), (16, 128), generator=gen)]
    q = (torch.randn(group, 128, generator=gen) * 0.05).bfloat16().half().double()
    kf, vf = k.view(FP8).double(), v.view(FP8).double()
    scores, out = emulate_tile(q, k, v, group)
    assert torch.allclose(scores[:, :group], kf @ q.T, rtol=1e-12, atol=1e-9)
    assert (scores[:, group:] == 0).all()
    probs = torch.softmax(q @ kf.T, dim=-1)
    assert probs.max() < 0.9  # a spread softmax: every token's V weighs
    want = probs @ vf
    assert ((out - want).norm() / want.norm()).item() < 2e-3  # p in fp16


def emulated_partials(q, k_cache, v_cache, tables, lens, scale, splits, tiles):
    """The kernel's partials for `splits` splits as its loop makes them, per (sequence, KV head, split): splits of
    whole iterations of 16 x tiles tokens, scores in log2 units, online softmax, p in fp16, the max stored in
    natural-log units. Splits that hold no tokens are left NaN (the kernel writes nothing there)."""
    batch, n_heads, d = q.shape
    page, n_kv = k_cache.shape[1], k_cache.shape[2]
    group, tokens = n_heads // n_kv, 16 * tiles
    acc = torch.full((batch, n_heads, splits, d), math.nan)
    ml = torch.full((batch, n_heads, splits, 2), math.nan)
    k_flat, v_flat = k_cache.flatten(0, 1).double(), v_cache.flatten(0, 1).double()
    for b, ctx in enumerate(lens.tolist()):
        per = -(-(-(-ctx // splits)) // tokens) * tokens
        for s in range(splits):
            start, end = s * per, min(s * per + per, ctx)
            if start >= ctx:
                continue
            for kvh in range(n_kv):
                heads = slice(kvh * group, (kvh + 1) * group)
                qh = q[b, heads].half().double()
                m, l, o = torch.full((group,), -math.inf, dtype=torch.float64), torch.zeros(group), torch.zeros(group, d)
                for n0 in range(start, end, tokens):
                    tok = torch.arange(n0, n0 + tokens)
                    valid = tok < end
                    slots = torch.where(valid, tables[b, (tok // page).clamp(max=tables.shape[1] - 1)] * page + tok % page, 0)
                    sc = torch.where(valid, qh @ k_flat[slots, kvh].T * scale * math.log2(math.e), -math.inf)
                    mx = torch.maximum(m, sc.max(dim=1).values)
                    alpha, p = torch.exp2(m - mx), torch.exp2(sc - mx[:, None])
                    l = l * alpha + p.sum(dim=1)
                    o = o * alpha[:, None] + p.half().double() @ torch.where(valid[:, None], v_flat[slots, kvh], 0.0)
                    m = mx
                acc[b, heads, s] = o.float()
                ml[b, heads, s, 0], ml[b, heads, s, 1] = (m * math.log(2)).float(), l.float()
    return acc, ml


@pytest.mark.parametrize("tiles", [1, 2])
def test_partials_as_the_kernel_writes_them_merge_to_attention(tiles):
    """The Triton merge (under Triton's interpreter on the CPU) reads the partials in the kernel's layout, units
    and split lengths (fa.merge gives it the kernel's tile): the merged output is the attention, padded rows zeros."""
    from llm_anatomy.kernels import use_kernels

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not use_kernels(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(tiles)
    contexts, page, n_kv, group, splits = [1, 40, 0, 130], 4, 2, 4, 3
    per_seq = [-(-max(n, 1) // page) for n in contexts]
    pages = sum(per_seq)
    k = (torch.randn(pages, page, n_kv, 128, generator=gen) * 2).to(FP8)
    v = (torch.randn(pages, page, n_kv, 128, generator=gen) * 2).to(FP8)
    perm = torch.randperm(pages, generator=gen).int()
    tables = torch.zeros(len(contexts), max(per_seq), dtype=torch.int32)
    at = 0
    for b, n in enumerate(per_seq):
        tables[b, :n], at = perm[at:at + n], at + n
    lens = torch.tensor(contexts, dtype=torch.int32)
    q = torch.randn(len(contexts), n_kv * group, 128, generator=gen).bfloat16()
    acc, ml = emulated_partials(q, k, v, tables, lens, 128 ** -0.5, splits, tiles)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
    fa.merge(acc.to(device).flatten(), ml.to(device).flatten(), lens.to(device), out, splits, tiles)
    want = reference(q, k, v, tables, lens, 128 ** -0.5)
    check(out.cpu(), want, lens)


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                            reason="needs a Hopper-or-later CUDA device")


def reference(q, k_cache, v_cache, tables, lens, scale):
    """float32 attention over the dequantized cache, each sequence's valid tokens only (unused slots may be NaN)."""
    page = k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    group = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        tok = torch.arange(n, device=q.device)
        slots = tables[b, tok // page].long() * page + tok % page
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


def make_case(group, page, contexts, kv_heads=2, nan_fill=False, head_major=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = [-(-max(n, 1) // page) for n in contexts]
    pages = sum(per_seq) + 3
    shape = (kv_heads, pages, page, 128) if head_major else (pages, page, kv_heads, 128)
    k = (torch.randn(shape, device="cuda", generator=gen) * 2).to(FP8)
    v = (torch.randn(shape, device="cuda", generator=gen) * 2).to(FP8)
    if head_major:
        k, v = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
    if nan_fill:  # every slot no sequence's valid context covers: NaN bytes
        k.view(torch.uint8).fill_(0x7F)
        v.view(torch.uint8).fill_(0x7F)
    perm = torch.randperm(pages, device="cuda", generator=gen).int()
    tables = torch.zeros(len(contexts), max(per_seq), dtype=torch.int32, device="cuda")
    at = 0
    for b, n in enumerate(contexts):
        tables[b, :per_seq[b]] = perm[at:at + per_seq[b]]
        at += per_seq[b]
    if nan_fill:  # real values in the valid slots only
        for b, n in enumerate(contexts):
            tok = torch.arange(n, device="cuda")
            slots = tables[b, tok // page].long() * page + tok % page
            for kv in (k, v):
                flat = kv.flatten(0, 1)
                flat[slots] = (torch.randn(n, kv_heads, 128, device="cuda", generator=gen) * 2).to(FP8)
    q = torch.randn(len(contexts), kv_heads * group, 128, device="cuda", generator=gen).bfloat16()
    lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    return q, k, v, tables, lens


def check(got, want, lens):
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    valid = lens > 0
    rel = ((got[valid].float() - want[valid]).norm() / want[valid].norm()).item()
    assert rel < 4e-3  # test_kv_cache_fp8's bound for the Triton fp8 path: bf16 output rounding and p in fp16
    assert (got[~valid] == 0).all()


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("group", [2, 4, 5, 8])
@pytest.mark.parametrize("page", [1, 16, 32])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_matches_float32_attention(group, page, splits):
    contexts = [1, 15, 16, 17, 0, 33, 300, 4097]
    q, k, v, tables, lens = make_case(group, page, contexts, seed=group * 100 + page)
    scale = 128 ** -0.5
    got = fa.fp8_decode_attention(q, k, v, tables, lens, scale, splits=splits)
    check(got, reference(q, k, v, tables, lens, scale), lens)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("tiles,prefetch,min_blocks", [(1, False, 4), (1, True, 3), (2, True, 2), (2, False, 1)])
def test_every_variant_matches(tiles, prefetch, min_blocks):
    q, k, v, tables, lens = make_case(4, 16, [5, 0, 47, 1000], seed=7)
    scale = 128 ** -0.5
    want = reference(q, k, v, tables, lens, scale)
    for splits in (1, 4):
        check(fa.fp8_decode_attention(q, k, v, tables, lens, scale, splits=splits, tiles=tiles, prefetch=prefetch,
                                      min_blocks=min_blocks),
              want, lens)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [0, 3, 4])
def test_iterations_longer_than_a_warp_are_refused(tiles):
    """A lane holds one token's slot: an iteration of 64 tokens (tiles 4) would read other tokens' slots."""
    q, k, v, tables, lens = make_case(4, 16, [5, 100], seed=7)
    with pytest.raises(ValueError, match="tiles must be 1 or 2"):
        fa.fp8_decode_attention(q, k, v, tables, lens, 128 ** -0.5, tiles=tiles)


@hopper
@pytest.mark.gpu
def test_head_major_cache_and_nan_in_unused_slots():
    """Slots past every context hold 0x7f (NaN in e4m3): nothing of them reaches the output. A cache stored
    [kv_heads, pages, page, d] is read through its strides."""
    for head_major in (False, True):
        q, k, v, tables, lens = make_case(8, 16, [1, 17, 0, 250], nan_fill=True, head_major=head_major, seed=3)
        scale = 128 ** -0.5
        want = reference(q, k, v, tables, lens, scale)
        for splits in (1, 5):
            check(fa.fp8_decode_attention(q, k, v, tables, lens, scale, splits=splits), want, lens)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_close_to_the_triton_fp8_kernel_in_a_cuda_graph(pdl):
    from llm_anatomy.kernels import pdl as pdl_mod
    from llm_anatomy.kernels.decode_attention import paged_decode_attention

    q, k, v, tables, lens = make_case(4, 16, [300, 0, 33, 2000], kv_heads=8, seed=11)
    scale = 128 ** -0.5
    first = q.clone()
    use_pdl = pdl and pdl_mod.supported(q.device)
    for splits in (1, 6):
        q.copy_(first)  # the graph below halves the query in place
        want = reference(q, k, v, tables, lens, scale)
        triton_out = paged_decode_attention(q, k, v, tables, lens, scale)
        eager = fa.fp8_decode_attention(q, k, v, tables, lens, scale, splits=splits, pdl=use_pdl)
        check(eager, want, lens)
        assert ((eager.float() - triton_out.float()).norm() / triton_out.float().norm()).item() < 4e-3
        fa.fp8_decode_attention(q, k, v, tables, lens, scale, splits=splits, pdl=use_pdl, launch_first=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fa.fp8_decode_attention(q, k, v, tables, lens, scale, splits=splits, pdl=use_pdl,
                                               launch_first=True)
        q.copy_(q * 0.5)  # the graph reads the query in place
        graph.replay()
        torch.cuda.synchronize()
        check(captured, reference(q, k, v, tables, lens, scale), lens)
        assert torch.equal(captured, fa.fp8_decode_attention(q, k, v, tables, lens, scale, splits=splits))


@hopper
@pytest.mark.gpu
def test_refuses_what_it_cannot_read():
    q, k, v, tables, lens = make_case(4, 16, [20], seed=1)
    with pytest.raises(ValueError, match="not bf16"):
        fa.fp8_decode_attention(q.half(), k, v, tables, lens, 0.1)
    with pytest.raises(ValueError, match="not float8_e4m3fn"):
        fa.fp8_decode_attention(q, k.view(torch.uint8), v, tables, lens, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        fa.fp8_decode_attention(q[..., :64], k[..., :64], v[..., :64], tables, lens, 0.1)
