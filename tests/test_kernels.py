"""Each Triton kernel against its PyTorch reference: under Triton's interpreter on the CPU (float32, and bf16
with bf16 tolerances), natively on a GPU."""

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from llm_anatomy.kernels import use_kernels  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if not use_kernels(DEVICE):
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from llm_anatomy.kernels.activation import silu_mul, silu_mul_reference  # noqa: E402
from llm_anatomy.kernels.decode_attention import paged_decode_attention  # noqa: E402
from llm_anatomy.kernels.gemv import gemv  # noqa: E402
from llm_anatomy.kernels.norm import rmsnorm, rmsnorm_reference  # noqa: E402
from llm_anatomy.kernels.rope import qk_norm_rope_store  # noqa: E402
from llm_anatomy.models.attention import decode_attention  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Triton's interpreter has no true bf16 arithmetic (numpy has no bf16): bf16 is checked on a GPU only.
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm(dtype, with_residual):
    x, w = rand(5, 96, dtype=dtype), rand(96, dtype=dtype, seed=1)
    r1 = rand(5, 96, dtype=dtype, seed=2) if with_residual else None
    r2 = r1.clone() if with_residual else None
    out = rmsnorm(x, w, 1e-6, residual=r1)
    ref = rmsnorm_reference(x, w, 1e-6, residual=r2)
    assert rel(out, ref) < TOL[dtype]
    if with_residual:
        assert rel(r1, r2) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gu = rand(3, 2 * 1500, dtype=dtype)
    assert rel(silu_mul(gu), silu_mul_reference(gu)) < TOL[dtype]


def _rotary(heads: int, kv_heads: int, d: int):
    """The RoPE tables of a one-layer Qwen3 with these heads (positions up to 4096)."""
    from llm_anatomy.models.config import ModelConfig
    from llm_anatomy.models.qwen3 import RotaryEmbedding

    config = ModelConfig.from_hf({"model_type": "qwen3", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
                                  "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                                  "head_dim": d, "max_position_embeddings": 4096, "rope_theta": 10000.0})
    return RotaryEmbedding(config).to(DEVICE)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("tokens", [5, 2100])  # a decode batch (a program per token), a prefill (blocks of 32)
def test_qk_norm_rope_store(norm, tokens):
    from llm_anatomy.models.qwen3 import RMSNorm

    heads, kv_heads, d, eps = 4, 2, 32, 1e-6
    rotary = _rotary(heads, kv_heads, d)
    qkv = rand(tokens, (heads + 2 * kv_heads) * d)
    qn, kn = RMSNorm(d, eps).to(DEVICE), RMSNorm(d, eps).to(DEVICE)
    with torch.no_grad():
        qn.weight.copy_(rand(d, seed=3))
        kn.weight.copy_(rand(d, seed=4))
    g = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(4 * tokens, generator=g)[:tokens]
    slots[2::7] = -1  # -1: a padded row, stores nothing
    slots = slots.to(DEVICE)
    k_cache = torch.zeros(tokens, 4, kv_heads, d, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q = qk_norm_rope_store(qkv, heads, kv_heads, d, qn.weight if norm else None, kn.weight if norm else None, eps,
                           rotary.cos, rotary.sin, positions, slots, k_cache, v_cache)

    rq, rk, rv = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    rq, rk, rv = rq.view(tokens, heads, d), rk.view(tokens, kv_heads, d), rv.view(tokens, kv_heads, d)
    if norm:
        rq, rk = qn(rq), kn(rk)
    rq, rk = rotary(rq, positions), rotary(rk, positions)
    assert rel(q, rq) < 1e-5
    flat_k, flat_v = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    stored = slots >= 0
    assert rel(flat_k[slots[stored]], rk[stored]) < 1e-5 and torch.equal(flat_v[slots[stored]], rv[stored])
    untouched = torch.ones(len(flat_k), dtype=torch.bool, device=DEVICE)
    untouched[slots[stored]] = False
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0  # nothing else written

    # a prefill also gets every row's K and V back, contiguous, padded rows included
    q2, k, v = qk_norm_rope_store(qkv, heads, kv_heads, d, qn.weight if norm else None, kn.weight if norm else None,
                                  eps, rotary.cos, rotary.sin, positions, slots, k_cache, v_cache, kv_out=True)
    assert torch.equal(q2, q) and rel(k, rk) < 1e-5 and torch.equal(v, rv)
    assert torch.equal(k[stored], flat_k[slots[stored]])


@pytest.mark.parametrize("tokens", [5, 70])
def test_qk_norm_rope_store_fp8_rows(tokens):
    """For the fp8 prefill attention: Q, K and V in fp8 as an fp8 cache stores them (the bits of the model-dtype
    outputs saturated to e4m3), zero rows up to the attention's length, the largest |V| stored; the cache's
    stores as without."""
    from llm_anatomy.models.attention import as_cached
    from llm_anatomy.models.qwen3 import RMSNorm

    heads, kv_heads, d, eps = 4, 2, 32, 1e-6
    rotary = _rotary(heads, kv_heads, d)
    qkv = rand(tokens, (heads + 2 * kv_heads) * d)
    qkv[1, -3] = 1000.0  # a value past e4m3's largest: it saturates at 448
    qn = RMSNorm(d, eps).to(DEVICE)
    with torch.no_grad():
        qn.weight.copy_(rand(d, seed=3) * 300)  # normed q and k up to ~1000: saturated too
    positions = torch.arange(tokens, device=DEVICE)
    slots = torch.arange(tokens, device=DEVICE)
    caches = [tuple(torch.zeros(tokens, 1, kv_heads, d, device=DEVICE, dtype=torch.float8_e4m3fn) for _ in "kv")
              for _ in "ab"]
    args = (qkv, heads, kv_heads, d, qn.weight, qn.weight, eps, rotary.cos, rotary.sin, positions, slots)
    q, k, v = qk_norm_rope_store(*args, *caches[0], kv_out=True)
    rows = tokens + 13
    q8, k8, v8, v_amax = qk_norm_rope_store(*args, *caches[1], fp8_rows=rows)
    fp8 = torch.float8_e4m3fn
    assert q8.shape == (rows, heads, d) and k8.shape == v8.shape == (rows, kv_heads, d)
    assert q8.dtype == k8.dtype == v8.dtype == fp8
    k_cache, v_cache = caches[1]
    for got, cached in ((k8, k_cache), (v8, v_cache)):  # the cache's bytes: one conversion
        assert torch.equal(got[:tokens].view(torch.uint8), cached.view(tokens, kv_heads, d).view(torch.uint8))
    want = as_cached(q, q8).float()
    if DEVICE.type == "cuda":
        assert torch.equal(q8[:tokens].float(), want)
    else:  # Triton 3.6's interpreter rounds some values otherwise (tests/test_kv_cache_fp8.py says which)
        assert (q8[:tokens].float() == want).float().mean() > 0.95
    for got in (q8, k8, v8):
        assert torch.equal(got[tokens:].float(), torch.zeros_like(got[tokens:].float()))
    assert v8.float().abs().max() == 448 and q8.float().abs().max() == 448 and not q8.float().isnan().any()
    assert v_amax.shape == (1,) and v_amax.item() == v8.float().abs().max().item()
    for a, b in zip(*caches):  # the cache gets the same bytes either way
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    with pytest.raises(ValueError, match="fp8_rows"):
        qk_norm_rope_store(*args, *caches[1], fp8_rows=tokens - 1)


@pytest.mark.parametrize("dtype", DTYPES)
# None: defaults; 40 splits: a merge of several warps (decode_attention.merge_warps)
@pytest.mark.parametrize("splits,block_n", [(1, 16), (3, 16), (8, 16), (16, 64), (40, 16), (None, None)])
@pytest.mark.parametrize("head_major", [False, True])
def test_paged_decode_attention(dtype, splits, block_n, head_major):
    heads, kv_heads, d, page, pages = 8, 2, 32, 4, 40
    k_cache, v_cache = rand(pages, page, kv_heads, d, dtype=dtype), rand(pages, page, kv_heads, d, dtype=dtype, seed=1)
    if head_major:  # the same values stored [kv_heads, pages, page, d]: the kernel reads through the strides
        k_cache, v_cache = (c.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for c in (k_cache, v_cache))
        assert k_cache.stride(2) == pages * page * d
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(0))
    context = [1, 37, 100, 0]  # 0: a padded row of a graph batch
    tables = torch.zeros(4, 25, dtype=torch.int32)
    tables[0, :1], tables[1, :10], tables[2, :25] = perm[:1], perm[1:11], perm[11:36]
    tables, lens = tables.to(DEVICE), torch.tensor(context, dtype=torch.int32, device=DEVICE)
    q = rand(4, heads, d, dtype=dtype, seed=2)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 1 / math.sqrt(d), splits=splits, block_n=block_n)
    ref = decode_attention(q[:3], k_cache, v_cache, tables[:3], lens[:3])
    assert rel(out[:3], ref) < TOL[dtype]
    assert out[3].abs().sum() == 0


def test_paged_decode_attention_merges_heads_in_pieces():
    """One sequence of few heads: the merge cuts each head into pieces (decode_attention.merge_chunks; the
    interpreter counts 8 multiprocessors), each piece merged alike."""
    from llm_anatomy.kernels.decode_attention import merge_chunks

    assert merge_chunks(2, 32, 8) == 2 and merge_chunks(32, 128, 132) == 2 and merge_chunks(64, 128, 132) == 1
    assert merge_chunks(512, 128, 132) == 1 and merge_chunks(1, 128, 1000) == 8  # pieces of 16 at least
    heads, kv_heads, d, page, pages = 2, 1, 32, 4, 12
    k_cache, v_cache = rand(pages, page, kv_heads, d), rand(pages, page, kv_heads, d, seed=1)
    tables = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).int()[None].to(DEVICE)
    lens = torch.tensor([45], dtype=torch.int32, device=DEVICE)
    q = rand(1, heads, d, seed=2)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 1 / math.sqrt(d), splits=3, block_n=16)
    assert rel(out, decode_attention(q, k_cache, v_cache, tables, lens)) < TOL[torch.float32]


CACHES = [None, torch.float8_e4m3fn] if DEVICE.type == "cuda" else [None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", CACHES)  # None: the model's dtype
@pytest.mark.parametrize("splits,block_n", [(1, 16), (3, 16), (16, 16), (4, 64)])  # 3 x 16: several tiles a split
def test_rope_decode_attention_is_rope_then_decode_attention(dtype, cache_dtype, splits, block_n):
    """One kernel for QK-norm, RoPE, the new token's store, the split attention and the merge gives the outputs
    and the cache of qk_norm_rope_store then paged_decode_attention; its counts end at zero, ready for the next."""
    from llm_anatomy.kernels.decode_attention import rope_decode_attention

    heads, kv_heads, d, page, pages, eps = 8, 2, 32, 4, 40, 1e-6
    rotary = _rotary(heads, kv_heads, d)
    cache_dtype = cache_dtype or dtype
    caches = [(rand(pages, page, kv_heads, d, dtype=dtype).to(cache_dtype),
               rand(pages, page, kv_heads, d, dtype=dtype, seed=1).to(cache_dtype)) for _ in range(2)]
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(0))
    context = [1, 37, 100, 0]  # 0: a padded row of a graph batch
    tables = torch.zeros(4, 25, dtype=torch.int32)
    tables[0, :1], tables[1, :10], tables[2, :25] = perm[:1], perm[1:11], perm[11:36]
    slots = [int(tables[i, (n - 1) // page]) * page + (n - 1) % page for i, n in enumerate(context[:3])] + [-1]
    tables, lens = tables.to(DEVICE), torch.tensor(context, dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([max(n - 1, 0) for n in context], device=DEVICE)
    slots = torch.tensor(slots, device=DEVICE)
    qkv = rand(4, (heads + 2 * kv_heads) * d, dtype=dtype, seed=2)
    qn, kn = rand(d, dtype=dtype, seed=3), rand(d, dtype=dtype, seed=4)
    common = (heads, kv_heads, d, qn, kn, eps, rotary.cos, rotary.sin, positions, slots)
    q = qk_norm_rope_store(qkv, *common, *caches[0])
    ref = paged_decode_attention(q, *caches[0], tables, lens, 1 / math.sqrt(d), splits=splits, block_n=block_n)
    counts = torch.zeros(4 * kv_heads, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the counts reset themselves: a second launch merges as the first
        out = rope_decode_attention(qkv, *common, *caches[1], tables, lens, counts, 1 / math.sqrt(d), splits, block_n)
        assert rel(out[:3], ref[:3]) < TOL[dtype] and out[3].abs().sum() == 0
        assert torch.equal(counts, torch.zeros_like(counts))
    with pytest.raises(ValueError, match="int32"):
        rope_decode_attention(qkv, *common, *caches[1], tables, lens, counts.long(), 1 / math.sqrt(d), splits, block_n)
    for ours, theirs in zip(caches[1], caches[0]):  # the new tokens stored alike, nothing else written
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv(rows, dtype):
    x, w = rand(rows, 1024, dtype=dtype), rand(96, 1024, seed=1, dtype=dtype)
    assert rel(gemv(x, w), F.linear(x, w)) < TOL[dtype]
    assert rel(gemv(x, w, gated=True), silu_mul_reference(F.linear(x, w))) < TOL[dtype]


def test_gemv_every_candidate_tile(monkeypatch):
    """Start-up may pick any candidate tile for a shape: each must give the same product (here 80 rows, so
    the last program of every BLOCK_N is partly masked, and K = 1024, two or more BLOCK_K steps)."""
    from llm_anatomy.engine.plan import ExecutionPlan
    from llm_anatomy.kernels import gemv as gemv_module
    from llm_anatomy.kernels.gemv import CANDIDATE_TILES, DEFAULT_TILE, Tile, tile_key
    from llm_anatomy.models.qwen3 import skinny_product

    from triton.runtime.errors import OutOfResources

    dtype = DTYPES[-1]  # bf16 on a GPU, as the engine runs: float32 tiles twice the size may not fit there
    x, w = rand(2, 1024, dtype=dtype), rand(160, 1024, seed=1, dtype=dtype)
    plain, gated = F.linear(x, w[:80]), silu_mul_reference(F.linear(x, w))
    for tile in CANDIDATE_TILES:
        assert rel(gemv(x, w[:80], tile=tile), plain) < TOL[dtype], tile
        try:  # the gated kernel holds two weight tiles per stage: tuning skips those that do not fit
            assert rel(gemv(x, w, gated=True, tile=tile), gated) < TOL[dtype], tile
        except OutOfResources:
            assert DEVICE.type == "cuda"

    kernel, grids = gemv_module._gemv_kernel, []
    monkeypatch.setattr(gemv_module, "_gemv_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: grids.append(grid) or kernel[grid]})())
    key = tile_key(80, 1024, False, dtype)
    tuned = ExecutionPlan(kernels=True).with_tiles({key: Tile(16, 512, 4, 3)})
    untuned = ExecutionPlan(kernels=True)
    layer = torch.nn.Linear(1024, 80, bias=False, device=DEVICE, dtype=dtype)
    with torch.no_grad():  # the plan's tuned tile is the one the model's product uses; else the default
        layer.weight.copy_(w[:80])
        for plan in (tuned, untuned):
            assert rel(skinny_product(x, layer, plan), plain) < TOL[dtype]
    assert grids == [(5,), (-(-80 // DEFAULT_TILE[w.element_size()].block_n),)]


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_prefetched_weight_tiles(dtype, prefetch):
    """Weight tiles loaded before the wait on the previous kernel enter the sum once, as the others do."""
    from llm_anatomy.kernels.gemv import Tile

    x, w = rand(3, 1024, dtype=dtype), rand(160, 1024, seed=1, dtype=dtype)
    for tile in (Tile(16, 128, 4, 3, prefetch), Tile(32, 256, 4, 3, prefetch)):
        assert rel(gemv(x, w[:80], tile=tile), F.linear(x, w[:80])) < TOL[dtype], tile
        assert rel(gemv(x, w, gated=True, tile=tile), silu_mul_reference(F.linear(x, w))) < TOL[dtype], tile


GEMV_SHAPES = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=4,
                   head_dim=32)  # every projection's K a multiple of 512: decode steps run on the GEMV kernel


@pytest.mark.parametrize("budget,mixed,model_type,shapes", [
    (None, False, "qwen3", {}), (5, True, "qwen3", {}), (None, False, "qwen3", GEMV_SHAPES),
    (None, False, "qwen2", {k: v for k, v in GEMV_SHAPES.items() if k != "head_dim"})])
def test_fast_path_model_equals_reference(save_tiny, budget, mixed, model_type, shapes):
    """The whole network on the fused-kernel path (prefill and paged decode) against the PyTorch path; with a
    budget of 5 tokens a step, also in mixed steps (decodes on the decode kernel, prompt chunks beside them);
    at shapes where decode runs on the GEMV kernel (SiLU*up inside gate_up's), Qwen3's and Qwen2's (qkv bias)."""
    from llm_anatomy import Engine

    overrides = {"num_attention_heads": 8, "num_key_value_heads": 2, "initializer_range": 0.2, **shapes}
    if model_type == "qwen2":
        overrides.pop("head_dim", None)
    directory, _ = save_tiny(model_type, **overrides)
    kw = dict(device=DEVICE, dtype=torch.float32, kv_cache_tokens=256, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=budget, mixed_steps=mixed)
    fast = Engine.from_pretrained(directory, fast_path=True, **kw)  # on a GPU, decode replays CUDA graphs
    reference = Engine.from_pretrained(directory, fast_path=False, cuda_graphs=False, **kw)
    prompts = [[5, 9, 2, 7, 1, 3], [8, 8, 1], [4] * 11]
    logits = {}
    for name, engine in (("fast", fast), ("reference", reference)):
        rows = []
        run = engine.runner.run
        def recording(batch, ahead=None, run=run, rows=rows):
            rows.append(run(batch, ahead).clone())  # a graph's output buffer is reused: copy it
            return rows[-1]

        engine.runner.run = recording
        # at the GEMV's shapes the interpreter takes seconds a decode step: fewer of them (the GPU runs all ten)
        steps = 4 if shapes and DEVICE.type == "cpu" else 10
        outs = engine.generate_many(prompts, temperature=0, max_tokens=steps, ignore_eos=True, logprobs=2)
        logits[name] = (torch.cat(rows), [o.output_token_ids for o in outs], [o.logprobs for o in outs])
    assert logits["fast"][1] == logits["reference"][1]
    assert rel(logits["fast"][0], logits["reference"][0]) < 1e-5
    # logprobs come back with the tokens (on a GPU: copied with them, ahead of the next step)
    for fast_seq, ref_seq in zip(logits["fast"][2], logits["reference"][2]):
        for (lp, top), (ref_lp, ref_top) in zip(fast_seq, ref_seq, strict=True):
            assert lp == pytest.approx(ref_lp, abs=1e-4) and [t for t, _ in top] == [t for t, _ in ref_top]


def test_fast_path_logit_bias_and_seeded_sampling(save_tiny):
    """The sampler's device paths behind the fast path (on a GPU: graphs, lookahead): a logit bias decides every
    token of one request and none of its neighbour's, and seeded sampling repeats itself."""
    from llm_anatomy import Engine

    directory, _ = save_tiny(num_attention_heads=8, num_key_value_heads=2, initializer_range=0.2)
    engine = Engine.from_pretrained(directory, fast_path=True, device=DEVICE, dtype=torch.float32, kv_cache_tokens=256,
                                    block_size=4, max_num_seqs=4)
    greedy = engine.generate_many([[4, 5, 6]], temperature=0, max_tokens=6, ignore_eos=True)[0].output_token_ids
    biased = engine.sampling_params(temperature=0, max_tokens=6, ignore_eos=True, logit_bias=((7, 100.0),))
    plain = engine.sampling_params(temperature=0, max_tokens=6, ignore_eos=True)
    a, b = engine.add_request([4, 5, 6], biased), engine.add_request([4, 5, 6], plain)
    while not (a.finished and b.finished):
        engine.step()
    assert a.output_token_ids == [7] * 6 and b.output_token_ids == greedy
    seeded = [engine.generate_many([[1, 2]], temperature=1.0, max_tokens=8, ignore_eos=True, seed=3)[0].output_token_ids
              for _ in range(2)]
    assert seeded[0] == seeded[1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_matmul_plain_and_gated(dtype):
    """The persistent prefill GEMM: 70 rows (not a multiple of the tile's: TMA pads the loads and clips the
    stores), several K tiles, more output tiles than programs; plain and with SiLU*up in its epilogue."""
    from llm_anatomy.kernels.matmul import GemmTile, matmul, matmul_reference

    tile = GemmTile(32, 32, 32, 2, 4) if DEVICE.type == "cpu" else GemmTile(64, 64, 64, 3, 4)
    x, w = rand(70, 192, dtype=dtype), rand(256, 192, seed=1, dtype=dtype) / 8
    ref = F.linear(x.float(), w.float())
    assert rel(matmul(x, w, tile), ref) < TOL[dtype]
    assert rel(matmul(x, w, tile, gated=True), silu_mul_reference(ref)) < TOL[dtype]
    assert rel(matmul_reference(x.float(), w.float(), gated=True), silu_mul_reference(ref)) < 1e-6
    with pytest.raises(ValueError, match="multiple of the tile"):
        matmul(x, w[:200], tile, gated=True)


def test_prefill_gated_matmul_applies_to_long_bf16_prompts_on_hopper_only():
    from llm_anatomy.kernels.matmul import GATED_MIN_ROWS, GATED_TILE, supports_gated

    w = rand(4 * GATED_TILE.bn, 64, dtype=torch.bfloat16)
    long, short = rand(GATED_MIN_ROWS, 64, dtype=torch.bfloat16), rand(GATED_MIN_ROWS - 1, 64, dtype=torch.bfloat16)
    hopper = DEVICE.type == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    assert supports_gated(long, w) == hopper
    assert not supports_gated(short, w)
    assert not supports_gated(long.float(), w.float())
    assert not supports_gated(long, w[:3 * GATED_TILE.bn])  # an intermediate size the tile does not divide


def test_residual_linear_adds_into_the_stream_on_gemms_only():
    """o_proj/down on the fast path: a GEMM (prefill) adds into the residual stream in place and returns None, for
    the norm after it to read the stream alone; a GEMV (decode) returns its product for the norm's fused add. A plan
    without residual_in_gemm returns the product either way."""
    from llm_anatomy.engine.plan import REFERENCE_PLAN, ExecutionPlan
    from llm_anatomy.models import qwen3

    plan = ExecutionPlan(kernels=True, residual_in_gemm=True)
    layer = torch.nn.Linear(512, 64, bias=False).to(DEVICE)
    for rows, gemm in ((40, True), (2, False)):
        x, residual = rand(rows, 512, seed=rows), rand(rows, 64, seed=rows + 1)
        before = residual.clone()
        want = F.linear(x, layer.weight)
        with torch.no_grad():
            got = qwen3.residual_linear(x, layer, plan, residual)
        if gemm:
            assert got is None and rel(residual, before + want) < TOL[torch.float32]
        else:
            assert torch.equal(residual, before) and rel(got, want) < TOL[torch.float32]
    x, residual = rand(40, 512), rand(40, 64, seed=1)
    with torch.no_grad():
        for other in (ExecutionPlan(kernels=True), REFERENCE_PLAN):
            assert rel(qwen3.residual_linear(x, layer, other, residual), F.linear(x, layer.weight)) < TOL[torch.float32]


def test_pending_norm_falls_back_to_the_norm_kernel_where_the_gemv_cannot_take_it():
    """A PendingNorm whose product the streaming GEMV does not take (here: no CUDA, or float32) runs the norm kernel
    into its new residual buffer, then the plain product; the residual it was given stays as it was. On the CPU no
    norm is ever left pending (no plan streams there), so this is the fallback's only CPU check; the fused path is
    tests/test_stream_gemv.py's."""
    from llm_anatomy.engine.plan import ExecutionPlan
    from llm_anatomy.models import qwen3

    plan = ExecutionPlan(kernels=True)
    norm_module = qwen3.RMSNorm(512, 1e-6).to(DEVICE)
    with torch.no_grad():
        norm_module.weight.copy_(1 + 0.1 * rand(512, seed=3))
    layer = torch.nn.Linear(512, 64, bias=True).to(DEVICE)
    x, residual = rand(1, 512, seed=1), rand(1, 512, seed=2)
    before = residual.clone()
    pending = qwen3.PendingNorm(x, residual, norm_module, torch.empty_like(residual))
    with torch.no_grad():
        y = qwen3.linear(pending, layer, plan)
        stream = before.clone()
        want = F.linear(rmsnorm_reference(x, norm_module.weight, 1e-6, residual=stream), layer.weight, layer.bias)
    assert torch.equal(residual, before) and rel(pending.new_residual, stream) < TOL[torch.float32]
    assert rel(y, want) < TOL[torch.float32]
    # and a norm is left pending only where the streaming GEMV would run: never on this machine or in float32
    streaming = ExecutionPlan(kernels=True, stream_gemv=True, norm_in_gemv=True)
    for p in (plan, streaming):
        assert norm_module.add_forward(x, residual.clone(), p, defer=True)[0].__class__ is torch.Tensor
