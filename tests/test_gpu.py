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

    from llm_anatomy.kernels.gemv import CANDIDATE_TILES, PREFETCH_CHOICES

    tuning = engine.runner.tile_tuning
    assert tuning.source == "tuned" and tuning.step_ms > 0
    assert set(tuning.tiles) == set(engine.runner._gemv_keys()) and len(tuning.tiles) == 5
    for t in tuning.tiles.values():  # a candidate, read ahead of the PDL wait or not
        assert dataclasses.replace(t, prefetch=0) in CANDIDATE_TILES and t.prefetch in (0, *PREFETCH_CHOICES), t


def test_eager_prefill_at_a_new_length_compiles_nothing(engine):
    graphs, engine.runner.prefill_graphs = engine.runner.prefill_graphs, {}  # every prefill eager
    try:
        before = compiled_kernels()
        for n in (1025, 1100, 3001, 3002, 77, 2050):
            ids = torch.randint(0, 151643, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            out = engine.generate(prompt_token_ids=ids, temperature=0, max_tokens=2, ignore_eos=True)
            assert len(out.output_token_ids) == 2
        assert compiled_kernels() == before
    finally:
        engine.runner.prefill_graphs = graphs


def test_short_context_decode_graph_gives_the_long_ones_logits(engine):
    """Batch 1 at a short context replays the graph whose attention has 16 splits of 64-token tiles; its
    logits must be those of the default graph (33 splits of 128), up to bf16 rounding of the merge order."""
    runner = engine.runner
    assert set(runner.short_graphs) == {1}
    ids = torch.randint(0, 151643, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = []
    for graphs in (runner.short_graphs, {}):
        short, runner.short_graphs = runner.short_graphs, graphs
        run, rows = runner.run, []
        runner.run = lambda batch, ahead=None: rows.append(run(batch, ahead).clone()) or rows[-1]
        try:
            engine.generate(prompt_token_ids=ids, temperature=0, max_tokens=4, ignore_eos=True)
        finally:
            runner.short_graphs, runner.run = short, run
        logits.append(torch.cat(rows[1:]))  # the decode steps
    a, b = logits
    assert a.shape == b.shape and a.shape[0] >= 3 and ((a - b).norm() / b.norm()).item() < 2e-2
