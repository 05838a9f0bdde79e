"""--kv-cache-dtype fp8: the paged pool in float8 e4m3 (scale 1, saturating), written by the store kernel and the
reference path, read by the decode attention kernel and the reference attention; bytes per token halve."""

import math

import pytest
import torch

from llm_anatomy import Engine
from llm_anatomy.models.attention import FP8_MAX, as_cached, decode_attention

FP8 = torch.float8_e4m3fn


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_as_cached_saturates_instead_of_overflowing():
    x = torch.tensor([0.1, -1000.0, 1000.0, 3.0, float("inf")])
    got = as_cached(x, torch.zeros(1, dtype=FP8)).float()
    assert torch.isfinite(got).all() and got[1] == -FP8_MAX and got[2] == FP8_MAX == got[4]
    assert torch.equal(as_cached(x, torch.zeros(1)), x)  # other caches store the values as they are


def test_fp8_pool_halves_kv_bytes_and_decodes_close_to_bf16(save_tiny):
    directory, _ = save_tiny()
    kw = dict(device="cpu", dtype=torch.bfloat16, kv_cache_tokens=128, block_size=4)
    bf16 = Engine.from_pretrained(directory, **kw)
    fp8 = Engine.from_pretrained(directory, kv_cache_dtype="fp8", **kw)
    assert fp8.pool.k.dtype == FP8 and fp8.plan.kv_cache_dtype == "float8_e4m3fn"
    assert fp8.pool.bytes_per_token * 2 == bf16.pool.bytes_per_token
    assert fp8.pool.total_bytes * 2 == bf16.pool.total_bytes
    ids = [5, 9, 2, 7, 1, 3, 8, 8, 1, 4]
    outs = {}
    for name, engine in (("bf16", bf16), ("fp8", fp8)):
        rows = []
        run = engine.runner.run
        engine_rows = rows

        def recording(batch, ahead=None, run=run, rows=engine_rows):
            rows.append(run(batch, ahead).clone())
            return rows[-1]

        engine.runner.run = recording
        engine.generate(prompt_token_ids=ids, temperature=0, max_tokens=6, ignore_eos=True)
        outs[name] = torch.cat(rows)
    a, b = outs["fp8"], outs["bf16"]
    assert torch.isfinite(a).all()
    # the prefill attends this step's own K/V (bf16), decode steps read the fp8 cache: close, not equal
    assert torch.equal(a[0], b[0]) and ((a - b).norm() / b.norm()).item() < 0.05


def test_reference_decode_attention_reads_an_fp8_cache_as_its_values():
    heads, kv_heads, d, page, pages = 8, 2, 32, 4, 12
    k, v = rand(pages, page, kv_heads, d), rand(pages, page, kv_heads, d, seed=1)
    k8, v8 = as_cached(k, torch.zeros(1, dtype=FP8)), as_cached(v, torch.zeros(1, dtype=FP8))
    tables = torch.arange(pages, dtype=torch.int32).view(2, 6)
    lens = torch.tensor([21, 9], dtype=torch.int32)
    q = rand(2, heads, d, seed=2)
    got = decode_attention(q, k8, v8, tables, lens)
    want = decode_attention(q, k8.float(), v8.float(), tables, lens)
    assert torch.equal(got, want)


triton = pytest.importorskip("triton")


def _kernels_or_skip():
    from llm_anatomy.kernels import use_kernels

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not use_kernels(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    return device


def test_store_kernel_writes_fp8_and_decode_kernel_reads_it():
    """The fused QK-norm/RoPE/store kernel writes the fp8 cache as as_cached would (Triton's interpreter rounds
    exact ties away from even: within one fp8 step), and the split decode attention over that cache equals the
    reference attention over the same fp8 values."""
    from llm_anatomy.kernels.decode_attention import paged_decode_attention
    from llm_anatomy.kernels.rope import qk_norm_rope_store
    from llm_anatomy.models.config import ModelConfig
    from llm_anatomy.models.qwen3 import RotaryEmbedding

    device = _kernels_or_skip()
    heads, kv_heads, d, tokens = 4, 2, 32, 24
    config = ModelConfig.from_hf({"model_type": "qwen3", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
                                  "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                                  "head_dim": d, "max_position_embeddings": 512, "rope_theta": 10000.0})
    rotary = RotaryEmbedding(config).to(device)
    qkv = rand(tokens, (heads + 2 * kv_heads) * d, seed=3, scale=200.0).to(device)  # some values past 448
    positions = torch.arange(tokens, device=device)
    slots = torch.arange(tokens, device=device)
    k_cache = torch.zeros(8, 4, kv_heads, d, dtype=FP8, device=device)
    v_cache = torch.zeros_like(k_cache)
    q, k, v = qk_norm_rope_store(qkv, heads, kv_heads, d, None, None, 0.0, rotary.cos, rotary.sin, positions, slots,
                                 k_cache, v_cache, kv_out=True)
    assert k.dtype == qkv.dtype  # the prefill's own K/V stay in the model's dtype
    for cache, values in ((k_cache, k), (v_cache, v)):
        stored = cache.view(-1, kv_heads, d)[:tokens].float()
        want = as_cached(values, cache).float()
        assert torch.isfinite(stored).all() and stored.abs().max() <= FP8_MAX
        checked = torch.ones_like(want, dtype=torch.bool)
        if device.type == "cpu":  # Triton 3.6's interpreter rounds ties away from even, and a value that rounds up
            # to the next power of two (-31.7 -> -32) loses the carry (-16): the GPU's conversion does neither
            mantissa = values.float().abs() / 2 ** values.float().abs().log2().floor()
            checked = (mantissa < 1.875) & (want.abs() < FP8_MAX)
        assert checked.float().mean() > 0.8 and (stored == want)[checked].float().mean() > 0.95
        assert (stored.abs() == FP8_MAX).sum() == (want.abs() == FP8_MAX).sum() > 0  # some saturated, the same

    tables = torch.arange(8, dtype=torch.int32, device=device).view(1, 8)
    lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    query = rand(1, heads, d, seed=4).to(device)
    got = paged_decode_attention(query, k_cache, v_cache, tables, lens, 1 / math.sqrt(d), splits=3, block_n=16)
    want = decode_attention(query, k_cache.float(), v_cache.float(), tables, lens)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.parametrize("block_n,splits", [(16, 3), (32, 1)])
def test_decode_kernel_reads_an_fp8_cache_for_a_bf16_query(block_n, splits):
    """The engine's case: a bf16 query over an fp8 cache (tiles to fp16, the dots in fp16; on the GPU read as 4-byte
    words and converted by PTX, under the interpreter cast) against the float32 attention over the same values;
    one split writes its output itself. Pages out of order, a padded row."""
    from llm_anatomy.kernels.decode_attention import paged_decode_attention

    device = _kernels_or_skip()
    heads, kv_heads, d, page, pages = 8, 2, 32, 4, 20
    k_cache = rand(pages, page, kv_heads, d, seed=5, scale=3.0).to(FP8).to(device)
    v_cache = rand(pages, page, kv_heads, d, seed=6, scale=3.0).to(FP8).to(device)
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(1))
    tables = torch.zeros(3, 10, dtype=torch.int32)
    tables[0, :10], tables[1, :3] = perm[:10], perm[10:13]
    tables, lens = tables.to(device), torch.tensor([37, 9, 0], dtype=torch.int32, device=device)
    q = rand(3, heads, d, seed=7).to(torch.bfloat16).to(device)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, 1 / math.sqrt(d), splits=splits, block_n=block_n)
    assert got.dtype == torch.bfloat16
    want = decode_attention(q[:2].float(), k_cache.float(), v_cache.float(), tables[:2], lens[:2])
    # the output's rounding to bf16 alone is 1.6e-3 here; p in fp16 (and the interpreter's fp16 dots) the rest
    assert ((got[:2].float() - want).norm() / want.norm()).item() < 4e-3
    assert got[2].abs().sum() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_tile_words_convert_every_e4m3_byte_exactly():
    """The PTX conversion of 4-byte words gives every one of the 256 e4m3 values as fp16 exactly, in place, NaN kept."""
    import triton
    import triton.language as tl

    from llm_anatomy.kernels.decode_attention import _fp8_tile

    @triton.jit
    def convert(src, dst, WORDS: tl.constexpr):
        rows, cols = tl.arange(0, 16), tl.arange(0, 128)
        offs = rows[:, None] * 128 + cols[None, :]
        tile = _fp8_tile(src, offs, rows.to(tl.int64), 0, rows < 16, 128, 128, 16, WORDS)
        tl.store(dst + offs, tile)

    raw = torch.arange(256, dtype=torch.uint8, device="cuda").repeat(8).view(16, 128)
    want = raw.view(FP8).to(torch.float16)
    for words in (True, False):
        got = torch.empty(16, 128, dtype=torch.float16, device="cuda")
        convert[(1,)](raw.view(FP8), got, WORDS=words)
        nan = want.isnan()
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)) and got[nan].isnan().all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a Hopper GPU")
def test_the_engine_hands_its_fp8_cache_to_the_cuda_kernel_as_to_the_triton_one(save_tiny):
    """The engine's decode steps over an fp8 cache (bf16, head_dim 128: the CUDA kernel's case): a batch of three
    at short contexts and one sequence past short_context, each step's logits with the plan's CUDA kernel against
    the same step with the Triton kernel (the plan's fp8_cuda off), eager, over the same cache. What is checked is
    what the engine gives the kernel (strides, tables, lengths, splits); the kernels themselves have their own
    tests (tests/test_fp8_decode_attention.py)."""
    from dataclasses import replace

    from llm_anatomy import Engine
    from llm_anatomy.engine.runner import ModelRunner
    from llm_anatomy.engine.scheduler import ScheduledBatch

    directory, _ = save_tiny(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                             head_dim=128, num_hidden_layers=2, initializer_range=0.2, max_position_embeddings=4096,
                             shard=None)
    engine = Engine.from_pretrained(directory, device="cuda", dtype=torch.bfloat16, kv_cache_tokens=6144,
                                    max_num_seqs=4, kv_cache_dtype="fp8", cuda_graphs=False, lookahead=False)
    assert engine.plan.decode_attention.fp8_cuda
    g = torch.Generator().manual_seed(0)
    attention = engine.plan.decode_attention
    runners = {cuda: ModelRunner(engine.model, engine.pool, engine.device,
                                 replace(engine.plan, decode_attention=replace(attention, fp8_cuda=cuda)))
               for cuda in (True, False)}
    for lengths in ((40, 17, 5), (2100,)):
        params = engine.sampling_params(temperature=0, max_tokens=64, ignore_eos=True)
        seqs = [engine.add_request(torch.randint(0, 500, (n,), generator=g).tolist(), params) for n in lengths]
        for _ in range(3):  # the prefill, then decode steps: contexts past a tile
            engine.step()
        batch = ScheduledBatch(seqs, [1] * len(seqs), False, seqs, len(seqs))
        assert runners[True].prepare(batch)[2].decode_fp8_cuda
        got, want = (runners[cuda].run(batch).float() for cuda in (True, False))
        assert ((got - want).norm() / want.norm()).item() < 1e-2
        for s in seqs:
            engine.abort(s)
