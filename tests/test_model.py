"""The network against HF transformers' Qwen3/Qwen2 on tiny random configs, through real checkpoints."""

import pytest
import torch

from llm_anatomy import Engine
from llm_anatomy.models import attention
from llm_anatomy.models.attention import AttentionBatch

CASES = {
    "qwen3-gqa2": dict(),
    "qwen3-tied": dict(tie_word_embeddings=True),
    "qwen3-gqa1": dict(num_key_value_heads=4),
    "qwen3-gqa4": dict(num_attention_heads=8, num_key_value_heads=2),
    "qwen3-yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2-bias": dict(model_type="qwen2"),
}


def load(directory, **kwargs):
    kwargs.setdefault("kv_cache_tokens", 1024)
    return Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, weights="auto", **kwargs)


def all_logits(engine: Engine, ids: list[int], keep: torch.Tensor | None = None) -> torch.Tensor:
    """Logits at every position (or at the rows `keep`) for one fresh sequence (prefill through the paged cache)."""
    pool = engine.pool
    n = len(ids)
    blocks = list(range(pool.blocks_for(n)))
    slots = torch.tensor([blocks[p // pool.block_size] * pool.block_size + p % pool.block_size for p in range(n)])
    batch = AttentionBatch(pool.k, pool.v, slots, True, torch.tensor([blocks], dtype=torch.int32),
                           torch.tensor([n], dtype=torch.int32), (n,), (0,))
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(ids), torch.arange(n), batch, keep=keep)
        return engine.model.compute_logits(hidden)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf(case, save_tiny):
    overrides = dict(CASES[case])
    directory, hf = save_tiny(overrides.pop("model_type", "qwen3"), **overrides)
    engine = load(directory)
    assert engine.weights.kind == "checkpoint"
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert rel_err(all_logits(engine, ids), ref) < 1e-4


@pytest.mark.parametrize("case,last_row", [("qwen3-gqa2", False), ("qwen2-bias", False), ("qwen3-gqa2", True)])
def test_kept_rows_are_the_whole_forwards_rows(case, last_row, save_tiny, monkeypatch):
    """The last layer past its K/V store over the rows `keep` alone (a step's sampled rows) gives those rows of the
    whole forward, in keep's order, and stores every row's K and V as the whole forward does; an empty keep (a
    prompt's chunk) stores them and gives no rows. last_row: the prompt counts as long (the threshold lowered to
    its length), so that keeping its last row alone attends that row alone."""
    if last_row:
        monkeypatch.setattr(attention, "FP8_PREFILL_MIN_TOKENS", 23)
    overrides = dict(CASES[case])
    directory, _ = save_tiny(overrides.pop("model_type", "qwen3"), **overrides)
    engine = load(directory)
    pool = engine.pool
    ids = torch.randint(0, 512, (23,), generator=torch.Generator().manual_seed(4)).tolist()
    whole = all_logits(engine, ids)
    cached = pool.k.clone(), pool.v.clone()
    for keep in (torch.tensor([22, 5, 0]), torch.tensor([22]), torch.tensor([], dtype=torch.int64)):
        pool.k.zero_()
        pool.v.zero_()
        kept = all_logits(engine, ids, keep)
        assert attention.attends_last_row_alone(AttentionBatch(pool.k, pool.v, pool.k, True, pool.k, pool.k, (23,),
                                                               (0,)), keep) == (last_row and len(keep) == 1)
        assert kept.shape == (len(keep), 512)
        torch.testing.assert_close(kept, whole[keep], rtol=1e-5, atol=1e-5)
        assert torch.equal(pool.k, cached[0]) and torch.equal(pool.v, cached[1])


def test_yarn_long_positions_match_hf(save_tiny):
    """Past original_max_position_embeddings the YaRN frequencies matter; check positions up to 300."""
    directory, hf = save_tiny(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 64})
    engine = load(directory)
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert rel_err(all_logits(engine, ids), ref) < 1e-4


@pytest.mark.parametrize("budget,mixed", [(None, False), (6, False), (6, True)])
def test_paged_decode_equals_full_recompute(save_tiny, budget, mixed):
    """Several sequences of different lengths, prefilled together then decoded over small blocks, give the
    logits of a full recompute at every step. With a budget of 6 tokens a step, the longest prompt is
    prefilled in chunks; with mixed steps, in steps that also decode the sequences already running."""
    directory, hf = save_tiny(num_attention_heads=8, num_key_value_heads=2)
    engine = load(directory, block_size=4, max_num_batched_tokens=budget, mixed_steps=mixed)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 13, 1)]
    seqs = [engine.add_request(p, engine.sampling_params(temperature=0, max_tokens=12, ignore_eos=True))
            for p in prompts]
    shapes = []
    schedule = engine.scheduler.schedule

    def watched():
        batch = schedule()
        if batch is not None:
            shapes.append((batch.num_decodes, list(batch.query_lens), len(batch.sampled)))
        return batch

    engine.scheduler.schedule = watched
    step_logits = {s.request_id: [] for s in seqs}
    runner_run = engine.runner.run

    def recording_run(batch, ahead=None):
        logits = runner_run(batch, ahead)
        for s, row in zip(batch.sampled, logits):
            step_logits[s.request_id].append(row.clone())
        return logits

    engine.runner.run = recording_run
    while not all(s.finished for s in seqs):
        engine.step()
    for s in seqs:
        full = s.prompt_token_ids + s.output_token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([full])).logits[0].float()
        got = torch.stack(step_logits[s.request_id])  # one row per sampled token
        expect = ref[len(s.prompt_token_ids) - 1: len(full) - 1]
        assert got.shape == expect.shape
        assert rel_err(got, expect) < 1e-4
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    if budget:  # chunks happened (a step with a prompt chunk that sampled nothing)
        assert all(sum(lens) <= budget for _, lens, _ in shapes)
        assert any(n < len(lens) for _, lens, n in shapes)
    # decodes rode along with prompts only with mixed steps
    assert any(d and len(lens) > d for d, lens, _ in shapes) == mixed


@pytest.mark.parametrize("case", ["qwen3-gqa2", "qwen3-tied", "qwen2-bias"])
def test_greedy_matches_hf_generate(case, save_tiny):
    overrides = dict(CASES[case])
    directory, hf = save_tiny(overrides.pop("model_type", "qwen3"), **overrides)
    engine = load(directory)
    gen = torch.Generator().manual_seed(4)
    for n in (1, 7, 23):
        ids = torch.randint(0, 512, (n,), generator=gen).tolist()
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, n, dtype=torch.long),
                              max_new_tokens=32, do_sample=False, min_new_tokens=32,
                              eos_token_id=None, pad_token_id=0)[0, n:].tolist()
        out = engine.generate(prompt_token_ids=ids, temperature=0, max_tokens=32, ignore_eos=True)
        assert out.output_token_ids == ref
        assert out.finish_reason == "length"


def test_batched_greedy_equals_single(save_tiny):
    directory, _ = save_tiny()
    engine = load(directory, block_size=8)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 17, 9, 30)]
    together = engine.generate_many(prompts, temperature=0, max_tokens=20, ignore_eos=True)
    alone = [engine.generate(prompt_token_ids=p, temperature=0, max_tokens=20, ignore_eos=True) for p in prompts]
    assert [r.output_token_ids for r in together] == [r.output_token_ids for r in alone]


def test_preemption_recomputes_and_loses_nothing(save_tiny):
    """A pool too small for all sequences at once: some are preempted, recomputed, and finish identically."""
    directory, _ = save_tiny()
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 512, (10,), generator=gen).tolist() for _ in range(4)]
    roomy = load(directory, block_size=4).generate_many(prompts, temperature=0, max_tokens=30, ignore_eos=True)
    tight = load(directory, block_size=4, kv_cache_tokens=48)  # 12 blocks; each sequence needs 10
    results = tight.generate_many(prompts, temperature=0, max_tokens=30, ignore_eos=True)
    assert [r.output_token_ids for r in results] == [r.output_token_ids for r in roomy]
    assert tight.pool.num_free_blocks == tight.pool.num_blocks


@pytest.mark.parametrize("lookahead", [False, True])
def test_logprobs_are_the_models(save_tiny, lookahead):
    """Each sampled token's log-probability and the top ones are HF's log-softmax at that position (the raw
    model distribution, whatever the sampling temperature), with and without lookahead."""
    directory, hf = save_tiny(initializer_range=0.2)
    engine = load(directory, lookahead=lookahead)
    ids = [5, 17, 3, 99, 42]
    out = engine.generate(prompt_token_ids=ids, temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=3)
    with torch.no_grad():
        ref = hf(torch.tensor([ids + out.output_token_ids])).logits[0, len(ids) - 1:-1].float().log_softmax(-1)
    assert len(out.logprobs) == 10
    for row, token, (chosen, top) in zip(ref, out.output_token_ids, out.logprobs):
        assert chosen == pytest.approx(row[token].item(), abs=1e-4)
        values, best = row.topk(3)
        assert [t for t, _ in top] == best.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
    plain = engine.generate(prompt_token_ids=ids, temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    assert plain.logprobs is None and plain.output_token_ids == out.output_token_ids
    only = engine.generate(prompt_token_ids=ids, temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    assert all(top == [] for _, top in only.logprobs)


def test_prefill_attention_at_its_bucket_length_equals_unpadded():
    """On the GPU each fresh prompt's attention runs padded to its bucket (cuDNN builds a plan per length):
    padded tokens come after the real ones, so the real tokens' outputs are unchanged, one prompt or several."""
    from llm_anatomy.models.attention import _prefill_attention, prefill_bucket

    g = torch.Generator().manual_seed(0)
    lens = (37, 130)
    q = torch.randn(sum(lens), 8, 16, generator=g)
    k, v = torch.randn(2, sum(lens), 2, 16, generator=g)
    unused = torch.zeros(1)
    for query_lens in ((37,), lens):
        tokens = sum(query_lens)
        batch = AttentionBatch(unused, unused, torch.arange(tokens), True, torch.zeros(len(query_lens), 1),
                               torch.tensor(query_lens), query_lens, (0,) * len(query_lens))
        args = (q[:tokens], k[:tokens], v[:tokens], unused, unused, batch)
        padded, plain = _prefill_attention(*args, pad=True), _prefill_attention(*args, pad=False)
        assert padded.shape == plain.shape == (tokens, 8, 16)
        torch.testing.assert_close(padded, plain)
    assert [prefill_bucket(n) for n in (1, 17, 512, 513, 2048, 2049, 3001, 4097, 8192)] == \
        [16, 32, 512, 640, 2048, 2560, 3072, 5120, 8192]
    assert all(n <= prefill_bucket(n) < 1.25 * n for n in range(513, 20000))


def test_short_fresh_prompts_of_one_bucket_are_attended_together():
    """Fresh prompts whose buckets are equal (and short) go through attention in one call per bucket, each
    padded by repeating its last row; a prompt after a cached prefix, one alone in its bucket and one past
    GROUPED_PREFILL_MAX go one at a time: every output as one prompt at a time gives it."""
    from llm_anatomy.models.attention import GROUPED_PREFILL_MAX, _prefill_attention

    g = torch.Generator().manual_seed(1)
    lens = (5, 7, 16, 3, 30, 9, GROUPED_PREFILL_MAX + 1, GROUPED_PREFILL_MAX + 2)
    prefix = (0, 0, 0, 4, 0, 0, 0, 0)
    tokens, heads, kv_heads, dim = sum(lens), 4, 2, 8
    q = torch.randn(tokens, heads, dim, generator=g)
    k, v = torch.randn(2, tokens, kv_heads, dim, generator=g)
    k_cache, v_cache = torch.randn(2, 64, 4, kv_heads, dim, generator=g)
    tables = (torch.arange(8 * 8, dtype=torch.int32).view(8, 8) * 7) % 64
    batch = AttentionBatch(k_cache, v_cache, torch.arange(tokens), True, tables,
                           torch.tensor([n + p for n, p in zip(lens, prefix)], dtype=torch.int32), lens, prefix)
    groups, grouped = batch.fresh_groups(q.device)
    assert grouped == {0, 1, 2, 5} and [rows for rows, *_ in groups] == [16]
    assert batch.fresh_groups(q.device) is batch.fresh_groups(q.device)  # once a step
    together = _prefill_attention(q, k, v, k_cache, v_cache, batch, pad=True)
    alone = _prefill_attention(q, k, v, k_cache, v_cache, batch, pad=False)
    torch.testing.assert_close(together, alone)
    # through the runner's upload: every group's indices in one copy, the same groups
    uploads = []
    uploaded = AttentionBatch(k_cache, v_cache, batch.slot_mapping, True, tables, batch.context_lens, lens, prefix,
                              upload=lambda host: uploads.append(host) or host.clone())
    groups_up, grouped_up = uploaded.fresh_groups(q.device)
    uploaded.fresh_groups(q.device)
    assert len(uploads) == 1 and uploads[0].dtype == torch.int64 and grouped_up == grouped
    assert [[x.tolist() for x in g[1:]] for g in groups_up] == [[x.tolist() for x in g[1:]] for g in groups]
    torch.testing.assert_close(_prefill_attention(q, k, v, k_cache, v_cache, uploaded, pad=True), alone)


def test_prompts_of_exactly_a_bucket_one_after_the_other_are_attended_in_place():
    """Fresh prompts of exactly their bucket's length, one after the other (an offline batch of equal prompts),
    form a group of views of the step's rows, no gathers; a padded prompt or one out of order among them, and
    another bucket's prompts, keep the gathers. Every output as one prompt at a time gives it."""
    from llm_anatomy.models.attention import _prefill_attention

    g = torch.Generator().manual_seed(2)
    for lens, dense in (((16, 16, 16), [True]), ((16, 16, 5, 16), [False]), ((32, 32, 16, 16), [True, True]),
                        ((16, 32, 16), [False])):
        tokens, heads, kv_heads, dim = sum(lens), 4, 2, 8
        q = torch.randn(tokens, heads, dim, generator=g)
        k, v = torch.randn(2, tokens, kv_heads, dim, generator=g)
        unused = torch.empty(0)
        batch = AttentionBatch(unused, unused, torch.arange(tokens), True, torch.zeros(len(lens), 1),
                               torch.tensor(lens, dtype=torch.int32), lens, (0,) * len(lens))
        groups, _ = batch.fresh_groups(q.device)
        assert [isinstance(where[0], int) for _, *where in groups] == dense, lens
        together = _prefill_attention(q, k, v, unused, unused, batch, pad=True)
        alone = _prefill_attention(q, k, v, unused, unused, batch, pad=False)
        torch.testing.assert_close(together, alone)
