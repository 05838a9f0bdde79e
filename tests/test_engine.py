"""The engine's request handling: validation before work, stop conditions, seeds, generation defaults."""

import json
import random

import pytest
import torch

from llm_anatomy import Engine
from llm_anatomy.errors import RequestError


@pytest.fixture
def engine(save_tiny):
    directory, _ = save_tiny(initializer_range=0.2)
    (directory / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [500, 501], "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    return Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=512,
                                  max_model_len=256)


def greedy(engine, ids, **kw):
    kw.setdefault("max_tokens", 24)
    return engine.generate(prompt_token_ids=ids, temperature=0, ignore_eos=True, **kw)


def test_generation_defaults_come_from_generation_config(engine):
    params = engine.sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    assert engine.defaults.eos_token_ids == (500, 501)
    assert engine.sampling_params(temperature=0).greedy


def test_prompt_past_the_context_is_refused_before_work(engine):
    steps = []
    engine.runner.run = lambda *a: steps.append(a)
    with pytest.raises(RequestError, match=r"prompt \(250 tokens\) plus max_tokens \(10\) exceeds the model's "
                                           r"context of 256 tokens") as info:
        engine.generate(prompt_token_ids=[1] * 250, max_tokens=10)
    assert info.value.param == "max_tokens"
    with pytest.raises(RequestError) as info:
        engine.generate(prompt_token_ids=[1] * 300, max_tokens=1)
    assert info.value.param == "prompt"
    assert not steps and not engine.has_work()


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt_token_ids=[]), "the prompt is empty"),
    (dict(prompt_token_ids=[1, 512]), "prompt token 512 is outside the model's vocabulary"),
    (dict(prompt_token_ids=[1], prompt="hi"), "exactly one of"),
    (dict(), "exactly one of"),
    (dict(prompt=5), "prompt must be a string"),
    (dict(prompt_token_ids=[1], temperature=-1), "temperature must be >= 0"),
    (dict(messages=[{"role": "user", "content": "hi"}]), "outside the model's vocabulary"),  # Qwen ids > 512
])
def test_bad_requests(engine, kwargs, message):
    with pytest.raises(RequestError, match=message):
        engine.generate(**kwargs)
    assert not engine.has_work()


def test_eos_and_stop_token_ids_end_generation(engine):
    ids = [3, 1, 4, 1, 5]
    free = greedy(engine, ids)
    stopper = free.output_token_ids[5]
    first = free.output_token_ids.index(stopper)
    out = greedy(engine, ids, stop_token_ids=[stopper])
    assert out.finish_reason == "stop"
    assert out.output_token_ids == free.output_token_ids[: first + 1]
    # EOS from generation_config ends it too, unless ignore_eos
    engine.defaults = type(engine.defaults)((stopper,))
    out = engine.generate(prompt_token_ids=ids, temperature=0, max_tokens=24)
    assert out.finish_reason == "stop" and out.output_token_ids[-1] == stopper


def test_stop_strings_cut_the_text(engine):
    ids = [9, 2, 6, 5]
    free = greedy(engine, ids, max_tokens=40)
    text = free.text
    assert len(text) > 10
    stop = text[6:9]
    first = text.find(stop)
    out = greedy(engine, ids, max_tokens=40, stop=[stop, "never-seen-stop"])
    assert out.finish_reason == "stop"
    assert out.text == text[:first]
    assert len(out.output_token_ids) < 40


def test_max_tokens_is_length(engine):
    out = greedy(engine, [1, 2, 3], max_tokens=7)
    assert len(out.output_token_ids) == 7 and out.finish_reason == "length"


def test_seed_reproduces_and_presence_penalty_avoids_repeats(engine):
    ids = [7, 7, 7]
    a = engine.generate(prompt_token_ids=ids, temperature=1.0, top_p=1.0, top_k=0, seed=11, max_tokens=30,
                        ignore_eos=True)
    b = engine.generate(prompt_token_ids=ids, temperature=1.0, top_p=1.0, top_k=0, seed=11, max_tokens=30,
                        ignore_eos=True)
    c = engine.generate(prompt_token_ids=ids, temperature=1.0, top_p=1.0, top_k=0, seed=12, max_tokens=30,
                        ignore_eos=True)
    assert a.output_token_ids == b.output_token_ids != c.output_token_ids
    plain = greedy(engine, ids, max_tokens=60)
    assert len(set(plain.output_token_ids)) < 60  # a tiny random model loops
    penalised = greedy(engine, ids, max_tokens=60, presence_penalty=2.0, frequency_penalty=2.0)
    assert len(set(penalised.output_token_ids)) >= 58 > len(set(plain.output_token_ids))


def test_top_k_one_is_greedy(engine):
    ids = [4, 4, 2]
    assert engine.generate(prompt_token_ids=ids, temperature=1.0, top_k=1, max_tokens=20, ignore_eos=True,
                           seed=3).output_token_ids == greedy(engine, ids, max_tokens=20).output_token_ids


def test_abort_frees_blocks(engine):
    seq = engine.add_request([1, 2, 3], engine.sampling_params(max_tokens=50, temperature=0))
    engine.step()
    engine.step()
    assert engine.pool.num_free_blocks < engine.pool.num_blocks
    engine.abort(seq)
    assert seq.finish_reason == "abort" and not engine.has_work()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_lookahead_gives_the_same_tokens(save_tiny):
    """Launching step n+1 before step n's tokens reach the host changes nothing: greedy, seeded sampling,
    a stop token mid-stream, batches whose members finish at different steps, and stop strings."""
    directory, _ = save_tiny(initializer_range=0.2)
    kw = dict(device="cpu", dtype=torch.float32, kv_cache_tokens=512, block_size=4)
    plain = Engine.from_pretrained(directory, lookahead=False, **kw)
    ahead = Engine.from_pretrained(directory, lookahead=True, **kw)
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6], [5, 3]]
    free = plain.generate(prompt_token_ids=prompts[0], temperature=0, max_tokens=30, ignore_eos=True)
    stopper = free.output_token_ids[9]
    for sampling in (dict(temperature=0, max_tokens=30, ignore_eos=True),
                     dict(temperature=1.0, top_k=0, top_p=1.0, seed=5, max_tokens=25, ignore_eos=True),
                     dict(temperature=0, max_tokens=30, stop_token_ids=[stopper])):
        a = [r.output_token_ids for r in plain.generate_many(prompts, **sampling)]
        b = [r.output_token_ids for r in ahead.generate_many(prompts, **sampling)]
        assert a == b
    text = free.text
    out = ahead.generate(prompt_token_ids=prompts[0], temperature=0, max_tokens=30, ignore_eos=True,
                         stop=[text[8:11]])
    assert out.text == text[:text.find(text[8:11])] and out.finish_reason == "stop"
    assert ahead.pool.num_free_blocks == ahead.pool.num_blocks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_lookahead_through_arrivals_finishes_and_chunked_prompts(save_tiny, monkeypatch, device):
    """A server's traffic: requests arriving while others run, each finishing at its own length, a prompt longer
    than a step's budget (chunked), one with penalties (its next draw needs the host). The steps launched ahead
    take some rows' tokens from the device and others' from the host, or leave out the rows that finish; new
    prompts' prefills are launched before the step before them is read back; every request gets exactly the
    tokens it gets step by step (on a GPU, through the decode graphs)."""
    directory, _ = save_tiny(initializer_range=0.2)
    kw = dict(device=device, dtype=torch.float32, kv_cache_tokens=1024, block_size=4, max_num_batched_tokens=32)
    plain = Engine.from_pretrained(directory, lookahead=False, **kw)
    ahead = Engine.from_pretrained(directory, lookahead=True, **kw)
    arrivals = {0: [([3, 1, 4], dict(max_tokens=12)), ([1, 5, 9, 2, 6], dict(max_tokens=7))],
                2: [([5, 3], dict(max_tokens=9))],
                5: [(list(range(2, 50)), dict(max_tokens=6))],  # 48 tokens: chunked at 32
                6: [([7, 7, 7], dict(max_tokens=5, temperature=1.0, seed=3, top_k=0, top_p=1.0))],
                9: [([8, 2], dict(max_tokens=8, frequency_penalty=1.5))],
                11: [([4, 4], dict(max_tokens=10))]}
    launched, prompts_ahead = [], []
    inputs, schedule_prompts = ahead.runner.ahead_inputs, ahead.scheduler.schedule_prompts
    monkeypatch.setattr(ahead.runner, "ahead_inputs",
                        lambda seqs, rows, tokens: launched.append(list(rows)) or inputs(seqs, rows, tokens))
    monkeypatch.setattr(ahead.scheduler, "schedule_prompts",
                        lambda: prompts_ahead.append(schedule_prompts()) or prompts_ahead[-1])

    def serve(engine):
        seqs, step = [], 0
        while step <= max(arrivals) or engine.has_work():
            for ids, sampling in arrivals.get(step, []):
                seqs.append(engine.add_request(ids, engine.sampling_params(
                    **{"temperature": 0, "ignore_eos": True, **sampling})))
            engine.step()
            step += 1
        return [(s.output_token_ids, s.finish_reason) for s in seqs]

    assert serve(ahead) == serve(plain)
    assert any(None in rows for rows in launched)  # host rows beside device rows (after a prefill)
    assert any(None not in rows and rows != list(range(len(rows))) for rows in launched)  # finishing rows left out
    assert any(batch is not None for batch in prompts_ahead)  # new prompts' prefill before the step before's read
    assert ahead.pool.num_free_blocks == ahead.pool.num_blocks


def test_lookahead_under_preemption_and_aborts(save_tiny):
    """A pool too small for what is admitted (sequences preempted and recomputed), requests aborted mid-way, many
    arrivals: with lookahead every request that is not aborted gets the tokens it gets step by step, and the pool
    is whole at the end."""
    directory, _ = save_tiny(initializer_range=0.2)
    kw = dict(device="cpu", dtype=torch.float32, kv_cache_tokens=96, block_size=4, max_num_seqs=6,
              max_num_batched_tokens=24)
    g = torch.Generator().manual_seed(5)
    arrivals = {step: [(torch.randint(1, 200, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist(),
                        int(torch.randint(3, 20, (1,), generator=g)))]
                for step in range(0, 40, 2)}
    aborted = {7: 1, 15: 4, 23: 9}  # at step: the index of the request to abort

    def serve(engine):
        seqs, step = [], 0
        while step <= max(arrivals) or engine.has_work():
            for ids, n in arrivals.get(step, []):
                seqs.append(engine.add_request(ids, engine.sampling_params(temperature=0, max_tokens=n,
                                                                           ignore_eos=True)))
            if step in aborted and aborted[step] < len(seqs):
                engine.abort(seqs[aborted[step]])
            engine.step()
            step += 1
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
        return {i: s.output_token_ids for i, s in enumerate(seqs) if i not in aborted.values()}, \
            sum(s.num_preemptions for s in seqs)

    (plain, _), (ahead, preempted) = (serve(Engine.from_pretrained(directory, lookahead=la, **kw))
                                      for la in (False, True))
    assert ahead == plain and preempted > 0


def test_lookahead_runs_the_steps_that_prefill_first_runs(save_tiny, monkeypatch):
    """Launching ahead changes when a step is launched, never which steps run: many prompts at once are prefilled
    in full steps before any decode (no decode steps of a half-admitted batch in between), then decoded together."""
    directory, _ = save_tiny(initializer_range=0.2)
    kw = dict(device="cpu", dtype=torch.float32, kv_cache_tokens=2048, block_size=4, max_num_batched_tokens=16)
    prompts = [[3 + i, 1, 4, 1, 5] for i in range(12)]  # 3 a prefill step, then decodes of all 12
    shapes = {}
    for lookahead in (False, True):
        engine = Engine.from_pretrained(directory, lookahead=lookahead, **kw)
        seen, run = [], engine.runner.run
        monkeypatch.setattr(engine.runner, "run", lambda batch, ahead=None, run=run, seen=seen:
                            seen.append((batch.is_prefill, len(batch.seqs))) or run(batch, ahead))
        engine.generate_many(prompts, temperature=0, max_tokens=6, ignore_eos=True)
        shapes[lookahead] = seen
    assert shapes[True] == shapes[False] == [(True, 3)] * 4 + [(False, 12)] * 5


def test_lookahead_recorder_sees_every_step(save_tiny):
    from llm_anatomy.anatomy import Ceilings
    from llm_anatomy.probe.call import CallRequest, measure_call

    directory, _ = save_tiny(initializer_range=0.2)
    engine = Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=512,
                                    lookahead=True)
    ceilings = Ceilings("cpu", 20.0, 15.0, 0.5, None, None)
    _, a = measure_call(engine, CallRequest(prompt_token_ids=[1, 2, 3], sampling=dict(temperature=0, max_tokens=9,
                                                                                       ignore_eos=True)), ceilings)
    assert len(a.decode_steps) == 8 and [s.context_len for s in a.decode_steps] == list(range(4, 12))
    assert [s.token_id for s in a.decode_steps] == a.output_token_ids[1:]


def test_bad_engine_arguments(save_tiny, monkeypatch):
    from llm_anatomy.errors import AnatomyError
    import llm_anatomy.engine.plan as plan_module

    directory, _ = save_tiny()
    kw = dict(device="cpu", dtype=torch.float32)
    with pytest.raises(AnatomyError, match="max_model_len must be in 1..512"):
        Engine.from_pretrained(directory, max_model_len=1000, kv_cache_tokens=64, **kw)
    with pytest.raises(AnatomyError, match="kv_cache_tokens must be >= 1"):
        Engine.from_pretrained(directory, kv_cache_tokens=0, **kw)
    with pytest.raises(AnatomyError, match="max_num_batched_tokens must be >= 1"):
        Engine.from_pretrained(directory, kv_cache_tokens=64, max_num_batched_tokens=0, **kw)
    for switch in ("cuda_graphs", "pdl", "stream_gemv", "mixed_steps"):
        with pytest.raises(AnatomyError, match=f"{switch} must be True or False, got 'false'"):
            Engine.from_pretrained(directory, kv_cache_tokens=64, **{switch: "false"}, **kw)
    monkeypatch.setattr(plan_module, "use_kernels", lambda device: False)
    with pytest.raises(AnatomyError, match="fast_path needs Triton and a CUDA device"):
        Engine.from_pretrained(directory, fast_path=True, kv_cache_tokens=64, **kw)


def test_prefill_graph_buckets_cover_every_whole_prompt_with_bounded_padding():
    """Every prompt the budget lets through whole has a bucket; above 512 tokens (where padding costs compute)
    it pads by less than a quarter, and a 2048-token prompt not at all. Longer prompts run eagerly."""
    from llm_anatomy.engine.graphs import prefill_graph_sizes

    assert prefill_graph_sizes(8192)[-1] == prefill_graph_sizes(2048)[-1] == 2048
    assert prefill_graph_sizes(1000)[-1] == 1024 and prefill_graph_sizes(100) == [16, 32, 64, 128]
    sizes = prefill_graph_sizes(2048)
    for n in range(1, 2049):
        bucket = min(t for t in sizes if t >= n)
        assert n <= 512 or (bucket - n) / n < 0.25
    assert 2048 in sizes


def test_engine_runs_without_triton(save_tiny):
    """Triton is not a dependency (a CPU install has none): the engine, its runner and the CLI must import and
    generate without it, on the PyTorch path."""
    import subprocess
    import sys

    directory, _ = save_tiny()
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, llm_anatomy.cli\n"
            "from llm_anatomy import Engine\n"
            f"e = Engine.from_pretrained({str(directory)!r}, device='cpu', dtype=torch.float32, kv_cache_tokens=64)\n"
            "out = e.generate(prompt_token_ids=[1, 2, 3], temperature=0, max_tokens=3, ignore_eos=True)\n"
            "assert len(out.output_token_ids) == 3 and not e.plan.kernels\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_engine_never_imports_the_probe():
    """The README's promise: the engine calls observer hooks and knows nothing of the probe, so that with no
    observer attached it does no measuring work (an import inside a function counts too)."""
    import ast
    from pathlib import Path

    import llm_anatomy

    root = Path(llm_anatomy.__file__).parent
    for package in ("engine", "models", "kernels"):
        for path in (root / package).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                assert not any(n == "probe" or n.startswith("probe.") or "llm_anatomy.probe" in n for n in names), \
                    f"{path.name} imports the probe"


def test_eager_decode_picks_the_short_context_attention_as_the_graphs_do(engine, monkeypatch):
    """A profiled (eager) decode step must run the attention the CUDA graphs run: the plan's short-context splits
    and tile for one sequence up to its short_context (in one kernel with the QK-norm and RoPE), its long_splits
    beyond it, the default splits over batch_block_n-token tiles for batches, nothing for prefills."""
    from dataclasses import replace

    from llm_anatomy.engine.plan import DecodeAttentionPlan
    from llm_anatomy.engine.runner import ModelRunner

    attention = DecodeAttentionPlan(short_context=6)
    runner = ModelRunner(engine.model, engine.pool, engine.device, replace(engine.plan, decode_attention=attention))
    seen = []
    run = runner.run

    def recording(batch, ahead=None):
        attn = runner.prepare(batch, None if ahead is None else ahead.offsets)[2]
        seen.append((batch.is_prefill, len(batch.seqs), int(attn.context_lens.max()), attn.decode_splits,
                     attn.decode_block_n, attn.decode_counts is not None))
        return run(batch, ahead)

    monkeypatch.setattr(runner, "run", recording)
    monkeypatch.setattr(engine, "runner", runner)
    greedy(engine, [3, 1, 4], max_tokens=6)
    engine.generate_many([[3, 1, 4], [1, 5]], temperature=0, max_tokens=3, ignore_eos=True)
    short = (attention.short_splits, attention.short_block_n)
    for is_prefill, n, longest, splits, block_n, one_kernel in seen:
        want = (None, None) if is_prefill else short if n == 1 and longest <= 6 else \
            (attention.long_splits, None) if n == 1 else (None, attention.batch_block_n)
        assert (splits, block_n) == want
        assert one_kernel == (not is_prefill and n == 1 and longest <= 6)  # QK-norm, RoPE and attention in one
    assert {s[3] for s in seen if not s[0]} == {attention.short_splits, attention.long_splits, None}


def test_a_decode_steps_graph_inputs_are_each_sequences_token_position_slot_and_length(engine):
    """GraphRunner's staging of a decode step, on host tensors: each sequence's newest token, its position (one
    further when launched ahead), the cache slot of that position and its context length; the rows past the
    batch padded (slot -1: stored nowhere, length 0)."""
    from llm_anatomy.engine.graphs import stage_decode_inputs

    seqs = [engine.add_request(ids, engine.sampling_params(max_tokens=4)) for ids in ([3, 1, 4], [1, 5, 9, 2, 6])]
    while not all(s.output_token_ids for s in seqs):
        engine.step()
    for ahead in (None, (1, 1), (0, 1)):
        for s in seqs:
            s.block_table.ensure(s.num_tokens + 1)
        stage, lens = torch.full((3, 4), 7, dtype=torch.int64), torch.full((4,), 7, dtype=torch.int32)
        longest = stage_decode_inputs(seqs, ahead, 3, stage, lens)
        positions = [s.num_tokens - 1 + off for s, off in zip(seqs, ahead or (0, 0))]
        assert stage[0, :2].tolist() == [s.last_token for s in seqs]
        assert stage[1, :2].tolist() == positions
        assert stage[2, :2].tolist() == [s.block_table.slot(p) for s, p in zip(seqs, positions)]
        assert lens[:2].tolist() == [p + 1 for p in positions] and longest == max(positions) + 1
        assert stage[:, 2].tolist() == [0, 0, -1] and lens[2] == 0 and stage[0, 3] == 7  # padded; past rows untouched
    for s in seqs:
        engine.abort(s)


def test_block_table_rows_follow_the_batch_through_shifts_growth_and_preemption():
    """The decode graphs' block tables (BlockTableRows, on host tensors here): after every sync each row holds
    its sequence's blocks, while sequences finish (the rows after them shift up), arrive, gain blocks and are
    preempted (same request, new blocks), and rows that did not change are not copied."""
    from types import SimpleNamespace

    from llm_anatomy.engine.graphs import BlockTableRows

    rng = random.Random(0)
    rows = BlockTableRows(16, 12, torch.device("cpu"))
    next_block, next_id = iter(range(1, 10**6)), iter(range(10**6))

    def fresh():
        return SimpleNamespace(request_id=f"r{next(next_id)}", num_preemptions=0,
                               block_table=SimpleNamespace(blocks=[next(next_block) for _ in range(rng.randint(1, 4))]))

    batch = [fresh() for _ in range(10)]
    for step in range(300):
        for _ in range(rng.randint(0, 2)):  # finishes: the rows after shift up
            if len(batch) > 1:
                batch.pop(rng.randrange(len(batch)))
        while len(batch) < 16 and rng.random() < 0.4:
            batch.insert(rng.randrange(len(batch) + 1), fresh())
        for s in batch:
            if rng.random() < 0.2 and len(s.block_table.blocks) < 12:
                s.block_table.blocks.append(next(next_block))
            if rng.random() < 0.02:  # preempted and running again: the same request, other blocks
                s.num_preemptions += 1
                s.block_table.blocks = [next(next_block) for _ in range(len(s.block_table.blocks))]
        before = rows.device_rows.clone()
        rows.sync(batch)
        for i, s in enumerate(batch):
            assert rows.device_rows[i, :len(s.block_table.blocks)].tolist() == s.block_table.blocks, (step, i)
        rows.sync(batch)  # nothing changed: nothing is written
        after = rows.device_rows.clone()
        rows.device_rows.fill_(-5)
        rows.sync(batch)
        assert (rows.device_rows == -5).all(), "a sync with nothing changed copied rows"
        rows.device_rows.copy_(after)
        assert before.shape == after.shape
    rows.reset()
    assert not rows.device_rows.any()
    rows.sync(batch[:1])
    assert rows.device_rows[0, :len(batch[0].block_table.blocks)].tolist() == batch[0].block_table.blocks


def test_varlen_attention_attends_each_packed_prompt_by_itself():
    """Packed prompts (and an empty one, and the padding's own sequence) attended by one variable-length call give
    what each prompt gets attended alone: causal, GQA, no row of one prompt seeing another's."""
    from llm_anatomy.models.attention import varlen_attention

    g = torch.Generator().manual_seed(0)
    lens, pad = [5, 1, 0, 9], 3
    total = sum(lens) + pad
    q = torch.randn(total, 4, 16, generator=g)
    k, v = torch.randn(total, 2, 16, generator=g), torch.randn(total, 2, 16, generator=g)
    bounds = torch.tensor([0, 5, 6, 6, 15, 18], dtype=torch.int32)
    out = varlen_attention(q, k, v, bounds, max(lens))
    for start, end in zip(bounds.tolist(), bounds.tolist()[1:]):
        alone = torch.nn.functional.scaled_dot_product_attention(
            *(x[start:end].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True)
        assert torch.equal(out[start:end], alone[0].transpose(0, 1))
    assert not torch.equal(out[5:15], varlen_attention(q, k, v, torch.tensor([0, 5, 15, 18], dtype=torch.int32),
                                                       10)[5:15])  # one prompt of 10 is not two of 1 and 9


def test_a_batch_of_prompts_packed_as_its_graph_replays_it_gives_the_steps_logits(engine):
    """The batch-prefill graphs' inputs (stage_prefill_batch: prompts packed, padded to the graph's size, the
    padding's tokens stored nowhere) through the model with packed attention: each prompt's last logits are those
    of the eager step, and the cache holds the same keys and values."""
    from dataclasses import replace

    from llm_anatomy.engine.graphs import stage_prefill_batch

    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    for ids in prompts:
        engine.add_request(ids, engine.sampling_params(temperature=0, max_tokens=2))
    batch = engine.scheduler.schedule()
    assert batch.is_prefill and len(batch.seqs) == 3
    runner = engine.runner
    eager = runner.run(batch)
    k_eager, v_eager = engine.pool.k.clone(), engine.pool.v.clone()
    engine.pool.k.zero_(), engine.pool.v.zero_()

    size, prompts_room = 20, 5
    stage, bounds = torch.zeros(4, size, dtype=torch.int64), torch.zeros(prompts_room + 2, dtype=torch.int32)
    stage_prefill_batch(batch.seqs, size, prompts_room, stage, bounds)
    assert bounds.tolist() == [0, 5, 7, 14, 14, 14, 20]
    assert stage[3, :prompts_room].tolist() == [4, 6, 13, 0, 0] and stage[2, 14:].eq(-1).all()
    assert stage[0, :14].tolist() == sum(prompts, []) and stage[1, :7].tolist() == [0, 1, 2, 3, 4, 0, 1]
    # the model's reference path stores every slot it is given (the GPU kernels skip -1): no padding here
    stage_prefill_batch(batch.seqs, 14, prompts_room, stage, bounds)
    assert bounds.tolist() == [0, 5, 7, 14, 14, 14, 14]
    _, _, attn, _ = runner.prepare(batch)
    attn = replace(attn, slot_mapping=stage[2, :14], varlen=(bounds, 14))
    model = runner.model
    hidden = model(stage[0, :14], stage[1, :14], attn, runner.step_plan)
    packed = model.compute_logits(hidden[stage[3, :3]], runner.step_plan)
    assert torch.allclose(packed, eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(engine.pool.k, k_eager) and torch.equal(engine.pool.v, v_eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batch_prefill_graphs_give_the_eager_steps_tokens(save_tiny, monkeypatch):
    """On a GPU, prompts arriving together are prefilled by a batch-prefill graph (varlen FlashAttention over the
    packed prompts) and decode to the tokens the eager engine gives; a batch past the graphs' prompts or tokens
    runs eagerly."""
    directory, _ = save_tiny(initializer_range=0.2, max_position_embeddings=4096)
    kw = dict(device="cuda", dtype=torch.bfloat16, kv_cache_tokens=8192, block_size=16, max_num_batched_tokens=2048,
              max_num_seqs=64)
    graphed = Engine.from_pretrained(directory, **kw)
    eager = Engine.from_pretrained(directory, cuda_graphs=False, **kw)
    assert graphed.graphs.batch_prefill_graphs and 2048 in graphed.graphs.batch_prefill_graphs
    replays, prefill_batch = [], graphed.graphs.prefill_batch
    monkeypatch.setattr(graphed.graphs, "prefill_batch",
                        lambda seqs, size: replays.append((len(seqs), size)) or prefill_batch(seqs, size))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 500, (int(n),), generator=g).tolist() for n in (3, 40, 17, 128, 128, 255, 9)]
    outs = [e.generate_many(prompts, temperature=0, max_tokens=8, ignore_eos=True) for e in (graphed, eager)]
    assert [o.output_token_ids for o in outs[0]] == [o.output_token_ids for o in outs[1]]
    assert replays == [(7, 768)]
    many = [[5 + i % 400, 7, 11] for i in range(40)]  # more prompts than a graph of 256 takes: eager, same tokens
    outs = [e.generate_many(many, temperature=0, max_tokens=3, ignore_eos=True) for e in (graphed, eager)]
    assert [o.output_token_ids for o in outs[0]] == [o.output_token_ids for o in outs[1]]
    assert replays == [(7, 768)]


def _first_token_after(save_tiny, **settings):
    """Sequence a decodes alone; b arrives after a's prefill. How many tokens a has when b gets its first one, and
    whether the engine's tokens are those of an engine without the setting."""
    directory, _ = save_tiny()
    engine = Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=512,
                                    max_num_seqs=4, **settings)
    params = engine.sampling_params(temperature=0, max_tokens=12, ignore_eos=True)
    a = engine.add_request([5, 9, 2, 7], params)
    engine.step()
    b = engine.add_request([8, 8, 1], params)
    seen = None
    while not (a.finished and b.finished):
        engine.step()
        if seen is None and b.output_token_ids:
            seen = len(a.output_token_ids)
    return seen, (a.output_token_ids, b.output_token_ids)


@pytest.mark.parametrize("lookahead", [False, True])
def test_max_waiting_tokens_holds_a_new_prompt_back_while_others_decode(save_tiny, lookahead):
    """TGI's rule: with max_waiting_tokens N a prompt that arrives while a sequence decodes is prefilled once N
    decode steps have run since prompts last joined (a's own prefill), or at once when waiting_served_ratio x the
    running sequences wait; without it, in the next step. The tokens are the same either way."""
    at_once, tokens = _first_token_after(save_tiny, lookahead=lookahead)
    waited, same = _first_token_after(save_tiny, lookahead=lookahead, max_waiting_tokens=5, waiting_served_ratio=2.0)
    ratio, also = _first_token_after(save_tiny, lookahead=lookahead, max_waiting_tokens=5, waiting_served_ratio=1.0)
    assert at_once == 1 + lookahead  # a's prefill token (and, ahead, the decode step launched beside b's arrival)
    assert waited == 1 + 5  # a's prefill token and the five decode steps b waited for
    assert ratio == at_once  # 1 waiting >= 1.0 x 1 running: no wait
    assert same == tokens == also


def test_a_prompt_is_never_held_back_when_nothing_decodes(save_tiny):
    directory, _ = save_tiny()
    engine = Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=512,
                                    max_num_seqs=4, max_waiting_tokens=1000)
    seq = engine.add_request([5, 9, 2], engine.sampling_params(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    assert seq.output_token_ids and engine.scheduler.decode_steps_since_admit == 0
    engine.step()
    assert seq.finished and engine.scheduler.decode_steps_since_admit == 1
