"""On a CUDA device only: start-up tunes every decode GEMV's tile, and after start-up an eager prefill at a
prompt length never seen compiles no kernel (a Triton compile cost 0.3-0.5 s in the first prompt of some
lengths, from specialising on the token count and on where the step's integers sit)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from llm_anatomy import Engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))  # tune the tiles, don't read them back
        yield Engine.from_pretrained("Qwen/Qwen3-0.6B", device="cuda", weights="synthetic", max_model_len=4096,
                                     kv_cache_tokens=16384, max_num_seqs=4)


def compiled_kernels() -> int:
    import triton

    from llm_anatomy.kernels import activation, decode_attention, gemv, matmul, norm, rope

    count = 0
    for module in (activation, decode_attention, gemv, matmul, norm, rope):
        for fn in vars(module).values():
            if isinstance(fn, triton.runtime.jit.JITFunction):
                count += sum(len(cache[0]) for cache in fn.device_caches.values())
    return count


def test_every_decode_gemv_shape_gets_a_tuned_tile(engine):
    import dataclasses

    from llm_anatomy.engine.tuning import gemv_keys
    from llm_anatomy.kernels.gemv import CANDIDATE_TILES, PREFETCH_CHOICES

    tuning = engine.tile_tuning
    assert tuning.source == "tuned" and tuning.step_ms > 0
    assert set(tuning.tiles) == set(gemv_keys(engine.model)) == set(engine.plan.gemv_tiles) and len(tuning.tiles) == 5
    for t in tuning.tiles.values():  # a candidate, read ahead of the PDL wait or not
        assert dataclasses.replace(t, prefetch=0) in CANDIDATE_TILES and t.prefetch in (0, *PREFETCH_CHOICES), t


def test_eager_prefill_at_a_new_length_compiles_nothing(engine, monkeypatch):
    """Every prefill eager (a runner with the engine's plan and no graphs, as prompts past the graphs' lengths
    run): after start-up, no prompt length compiles a kernel."""
    from llm_anatomy.engine.runner import ModelRunner

    monkeypatch.setattr(engine, "runner", ModelRunner(engine.model, engine.pool, engine.device, engine.plan))
    before = compiled_kernels()
    for n in (1025, 1100, 3001, 3002, 77, 2050):
        ids = torch.randint(0, 151643, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        out = engine.generate(prompt_token_ids=ids, temperature=0, max_tokens=2, ignore_eos=True)
        assert len(out.output_token_ids) == 2
    assert compiled_kernels() == before


def test_short_context_decode_graph_gives_the_long_ones_logits(engine, monkeypatch):
    """Batch 1 at a short context replays the graph whose attention has 16 splits of 64-token tiles; its logits
    must be those of the long-context attention (48 splits of 128: here eagerly, by a plan whose short context is
    0), up to bf16 rounding of the merge order."""
    from dataclasses import replace

    from llm_anatomy.engine.plan import DecodeAttentionPlan
    from llm_anatomy.engine.runner import ModelRunner

    assert engine.graphs.describe()["short_context_batch_sizes"] == [1]
    ids = torch.randint(0, 151643, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    long_only = ModelRunner(engine.model, engine.pool, engine.device,
                            replace(engine.plan, decode_attention=DecodeAttentionPlan(short_context=0)))
    logits = []
    for runner in (engine.runner, long_only):
        run, rows = runner.run, []
        with monkeypatch.context() as mp:
            mp.setattr(engine, "runner", runner)
            mp.setattr(runner, "run", lambda batch, ahead=None, run=run, rows=rows:
                       rows.append(run(batch, ahead).clone()) or rows[-1])
            mp.setattr(runner, "run_greedy", lambda batch, ahead=None: None)  # every step through run
            engine.generate(prompt_token_ids=ids, temperature=0, max_tokens=4, ignore_eos=True)
        logits.append(torch.cat(rows[1:]))  # the decode steps
    a, b = logits
    assert a.shape == b.shape and a.shape[0] >= 3 and ((a - b).norm() / b.norm()).item() < 2e-2


def test_greedy_steps_picked_in_the_graph_give_the_samplers_tokens(engine, monkeypatch):
    """Batch 1's greedy steps replay graphs that pick the token themselves (kernels/greedy.py) and leave the next
    step's inputs in their buffers: the same tokens as the sampler's argmax over the same graphs' logits with every
    step's inputs copied up, across page boundaries, before and after a sampled request and one with min_tokens
    (which the sampler serves). Between greedy steps in order the inputs are copied up only at a new page."""
    assert engine.plan.greedy_in_graph and engine.graphs.greedy_decodes(1) and not engine.graphs.greedy_decodes(2)
    ids = torch.randint(0, 151643, (40,), generator=torch.Generator().manual_seed(11)).tolist()
    greedy = dict(prompt_token_ids=ids, temperature=0, max_tokens=40, ignore_eos=True)
    with monkeypatch.context() as mp:
        mp.setattr(engine.runner, "run_greedy", lambda batch, ahead=None: None)
        want = engine.generate(**greedy).output_token_ids
    uploads, copy, pos = [], torch.Tensor.copy_, engine.graphs.pos.data_ptr()

    def spy(dst, src, *args, **kwargs):
        if dst.data_ptr() == pos:
            uploads.append(1)
        return copy(dst, src, *args, **kwargs)

    with monkeypatch.context() as mp:
        mp.setattr(torch.Tensor, "copy_", spy)
        assert engine.generate(**greedy).output_token_ids == want
    assert 1 <= len(uploads) <= 5  # the first decode step, then positions 48 and 64 (16-token pages)
    engine.generate(prompt_token_ids=ids, temperature=0.9, seed=3, max_tokens=20, ignore_eos=True)
    assert engine.generate(**greedy).output_token_ids == want
    engine.generate(prompt_token_ids=ids, temperature=0, min_tokens=30, max_tokens=35)
    assert engine.generate(**greedy).output_token_ids == want


def test_two_engines_with_different_plans_run_side_by_side(engine):
    """Two plans in one process: an engine with graphs, PDL and the streaming GEMV, and one on the same weights
    with the fused kernels launched eagerly (no graphs, no PDL). Each gives, interleaved with the other, exactly
    the tokens and logprobs it gives alone."""
    from llm_anatomy import Engine

    other = Engine.from_pretrained("Qwen/Qwen3-0.6B", device="cuda", weights="synthetic", max_model_len=4096,
                                   kv_cache_tokens=4096, max_num_seqs=2, cuda_graphs=False)
    assert engine.plan.cuda_graphs and engine.plan.pdl and not other.plan.cuda_graphs and not other.plan.pdl
    prompts = [torch.randint(0, 151643, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 700)]

    def run(e, ids):
        out = e.generate(prompt_token_ids=ids, temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
        return out.output_token_ids, [lp for lp, _ in out.logprobs]

    alone = {(name, i): run(e, ids) for name, e in (("a", engine), ("b", other)) for i, ids in enumerate(prompts)}
    for i, ids in enumerate(prompts):  # the same request on both engines at once, one step of each in turn
        seqs = {name: e.add_request(ids, e.sampling_params(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1))
                for name, e in (("a", engine), ("b", other))}
        while not all(s.finished for s in seqs.values()):
            for e in (engine, other):
                if e.has_work():
                    e.step()
        for name, seq in seqs.items():
            assert (seq.output_token_ids, [lp for lp, _ in seq.logprobs]) == alone[(name, i)], (name, i)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_the_last_layer_over_the_sampled_rows_gives_the_whole_forwards_rows(engine, quantization):
    """On the fast path, the last layer past its K/V store over the sampled rows alone (the products of one row
    take the streaming GEMV, those of many cuBLAS) gives the whole forward's rows, and the same K and V."""
    from llm_anatomy import Engine
    from llm_anatomy.models.attention import AttentionBatch

    if quantization:
        engine = Engine.from_pretrained("Qwen/Qwen3-0.6B", device="cuda", weights="synthetic", max_model_len=4096,
                                        kv_cache_tokens=4096, max_num_seqs=2, quantization="fp8", cuda_graphs=False)
    pool, n = engine.pool, 700
    ids = torch.randint(0, 151643, (n,), generator=torch.Generator().manual_seed(5)).cuda()
    blocks = list(range(pool.blocks_for(n)))
    slots = torch.tensor([blocks[p // pool.block_size] * pool.block_size + p % pool.block_size for p in range(n)],
                         device="cuda")
    batch = AttentionBatch(pool.k, pool.v, slots, True, torch.tensor([blocks], dtype=torch.int32, device="cuda"),
                           torch.tensor([n], dtype=torch.int32, device="cuda"), (n,), (0,))
    plan = engine.plan.eager()
    pool.k.zero_()  # the blocks past this prompt's too: earlier tests' requests left theirs
    pool.v.zero_()
    with torch.inference_mode():
        whole = engine.model.compute_logits(engine.model(ids, torch.arange(n, device="cuda"), batch, plan), plan)
        cached = pool.k.clone(), pool.v.clone()
        for keep in ([n - 1], [n - 1, 3, 200]):
            pool.k.zero_()
            pool.v.zero_()
            rows = torch.tensor(keep, device="cuda")
            kept = engine.model.compute_logits(engine.model(ids, torch.arange(n, device="cuda"), batch, plan, rows),
                                               plan)
            expected = whole[rows].float()
            assert ((kept.float() - expected).norm() / expected.norm()).item() < 2e-2, keep
            assert torch.equal(pool.k, cached[0]) and torch.equal(pool.v, cached[1])
