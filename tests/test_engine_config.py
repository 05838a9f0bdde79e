"""EngineConfig (every setting, frozen, checked in one place) and the ExecutionPlan chosen from it per engine."""

import dataclasses

import pytest
import torch

from llm_anatomy import Engine, EngineConfig
from llm_anatomy.engine.plan import REFERENCE_PLAN, DecodeAttentionPlan, ExecutionPlan, choose_plan
from llm_anatomy.errors import AnatomyError


def test_engine_config_is_frozen_and_exported():
    config = EngineConfig(model="some/model", max_num_seqs=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 9
    assert config.describe()["max_num_seqs"] == 8 and "quantization" in EngineConfig.setting_names()


@pytest.mark.parametrize("settings,message", [
    (dict(max_num_seqs=0), "max_num_seqs must be in 1..65536, got 0"),
    (dict(max_num_seqs=True), "max_num_seqs must be an integer, got True"),
    (dict(max_num_seqs=2.5), "max_num_seqs must be an integer"),
    (dict(kv_cache_tokens=-3), "kv_cache_tokens must be >= 1, got -3"),
    (dict(max_model_len=0), "max_model_len must be >= 1"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
    (dict(block_size=12), "block_size must be a power of two, got 12"),
    (dict(block_size=0), "block_size must be in 1..1024"),
    (dict(prefill_graph_tokens=-1), "prefill_graph_tokens must be >= 0"),
    (dict(seed=1 << 64), "seed must be in"),
    (dict(seed=-(1 << 63) - 1), "seed must be in"),
    (dict(gpu_memory_utilization=0), r"gpu_memory_utilization must be a fraction in \(0, 1\]"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be a fraction"),
    (dict(gpu_memory_utilization="0.9"), "gpu_memory_utilization must be a fraction"),
    (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization must be a fraction"),
    (dict(gpu_memory_utilization=True), "gpu_memory_utilization must be a fraction"),
    (dict(quantization="awq"), "quantization 'awq' is not supported; use one of: fp8"),
    (dict(quantize_lm_head=True), r"quantize_lm_head \(--quantize-lm-head\) needs quantization='fp8'"),
    (dict(quantize_lm_head="yes", quantization="fp8"), "quantize_lm_head must be True or False, got 'yes'"),
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype 'int4' is not supported; use one of: auto, fp8, fp8_e4m3"),
    (dict(cuda_graphs="false"), "cuda_graphs must be True or False, got 'false'"),
    (dict(fast_path=1), "fast_path must be True or False or None, got 1"),
    (dict(model=""), "model must be a non-empty string"),
    (dict(device=0), "device must be a string or None"),
    (dict(max_waiting_tokens=-1), "max_waiting_tokens must be in 0..1000000, got -1"),
    (dict(max_waiting_tokens=1_000_001), "max_waiting_tokens must be in 0..1000000"),
    (dict(max_waiting_tokens=2.5), "max_waiting_tokens must be an integer"),
    (dict(max_waiting_tokens=True), "max_waiting_tokens must be an integer"),
    (dict(max_waiting_tokens=4, waiting_served_ratio=float("nan")), "waiting_served_ratio must be a finite number"),
    (dict(max_waiting_tokens=4, waiting_served_ratio=-0.5), "waiting_served_ratio must be a finite number >= 0"),
    (dict(max_waiting_tokens=4, waiting_served_ratio="1.2"), "waiting_served_ratio must be a finite number"),
    (dict(waiting_served_ratio=1.0), r"waiting_served_ratio \(--waiting-served-ratio\) ends the wait"),
    (dict(max_waiting_tokens=4, mixed_steps=True), r"mixed steps \(--mixed-steps\) admit them"),
])
def test_engine_config_refuses_bad_settings(settings, message):
    with pytest.raises(AnatomyError, match=message):
        EngineConfig(**settings)


def test_unknown_settings_are_refused_not_ignored(save_tiny):
    directory, _ = save_tiny()
    with pytest.raises(AnatomyError, match="unknown engine setting\\(s\\) max_num_seq;"):
        Engine.from_pretrained(directory, device="cpu", max_num_seq=4)


def test_from_pretrained_builds_its_config_and_a_reference_plan_on_the_cpu(save_tiny):
    directory, _ = save_tiny()
    engine = Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=64, max_num_seqs=3)
    cfg = engine.engine_config
    assert (cfg.model, cfg.device, cfg.dtype, cfg.kv_cache_tokens, cfg.max_num_seqs) == \
        (str(directory), "cpu", "float32", 64, 3)
    assert engine.plan == dataclasses.replace(REFERENCE_PLAN, weight_dtype="float32", head_dtype="float32",
                                              kv_cache_dtype="float32")
    assert engine.graphs is None and engine.describe()["plan"]["kernels"] is False
    same = Engine.from_config(cfg)
    assert same.engine_config == cfg
    ids = [3, 1, 4, 1, 5]
    a = engine.generate(prompt_token_ids=ids, temperature=0, max_tokens=4, ignore_eos=True).output_token_ids
    b = same.generate(prompt_token_ids=ids, temperature=0, max_tokens=4, ignore_eos=True).output_token_ids
    assert a == b


def test_progress_names_the_stages(save_tiny):
    directory, _ = save_tiny()
    stages = []
    Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=64, progress=stages.append)
    assert stages[0] == "resolving the model" and stages[-1] == "ready"
    assert "sizing the KV cache" in stages and any(s.startswith("loading weights") for s in stages)


def test_choose_plan_follows_the_config_on_the_cpu():
    cpu = torch.device("cpu")
    plan = choose_plan(EngineConfig(), cpu, "bfloat16", "bfloat16")
    assert not (plan.kernels or plan.cuda_graphs or plan.pdl or plan.stream_gemv or plan.lookahead)
    assert choose_plan(EngineConfig(lookahead=True), cpu, "bfloat16", "bfloat16").lookahead
    assert plan.eager() == plan and plan.describe()["decode_attention"]["long_splits"] == 48
    assert not choose_plan(EngineConfig(), cpu, "bfloat16", "float8_e4m3fn").decode_attention.fp8_cuda
    fp8 = choose_plan(EngineConfig(), cpu, "float8_e4m3fn", "float8_e4m3fn")  # no torch._scaled_mm on a CPU
    assert not fp8.fp8_fast_accum and fp8.describe()["fp8_fast_accum"] is False


def test_fp8_prefill_attention_is_a_gpu_plan_taken_by_a_long_fresh_prompt_alone():
    from llm_anatomy.models.attention import AttentionBatch, fp8_prefill_rows, prefill_bucket

    cpu = torch.device("cpu")
    for kv in ("bfloat16", "float8_e4m3fn"):
        plan = choose_plan(EngineConfig(fast_path=False), cpu, "float8_e4m3fn", kv, attention_heads=(32, 8, 128))
        assert not plan.fp8_prefill_attention and plan.describe()["fp8_prefill_attention"] is False
    from llm_anatomy.probe.cost import DEFAULT_SHAPES, prefill_cost
    from llm_anatomy.models.config import ModelConfig
    from conftest import TINY

    c = ModelConfig.from_hf({**TINY, "model_type": "qwen3"})
    w8a8 = dataclasses.replace(DEFAULT_SHAPES, weight_size=1, weight_row_scale_bytes=4, w8a8=True, kv_size=1)
    fp8_attention = dataclasses.replace(w8a8, fp8_prefill_attention=True)
    for seqs, taken in (([(3000, 0)], True), ([(2048, 0)], False), ([(3000, 16)], False), ([(3000, 0)] * 2, False)):
        before, after = (prefill_cost(c, torch.bfloat16, seqs, shapes=s).parts for s in (w8a8, fp8_attention))
        tokens = sum(n for n, _ in seqs)
        # the queries read in fp8, o_proj's input written quantized by the attention (no quantization kernel), in
        # every layer but the last, which attends the prompt's last row alone, in bf16
        saved = (c.num_hidden_layers - 1) * tokens * c.q_size * (1 if taken else 0)
        assert before["attention"]["bytes"] - after["attention"]["bytes"] == saved
        assert before["quantize"]["bytes"] - after["quantize"]["bytes"] == 2 * saved
        assert before["attention"]["flops"] == after["attention"]["flops"]
    cache = torch.zeros(1, 2, 16, 1, 8)

    def batch(query_lens, prefix_lens=None, num_decodes=0, varlen=None, is_prefill=True):
        n = sum(query_lens)
        return AttentionBatch(cache, cache, torch.zeros(n, dtype=torch.int64), is_prefill,
                              torch.zeros(len(query_lens), 1, dtype=torch.int32), torch.tensor(query_lens),
                              tuple(query_lens), tuple(prefix_lens or [0] * len(query_lens)), num_decodes,
                              varlen=varlen)

    from llm_anatomy.engine.graphs import PREFILL_GRAPH_TOKENS

    assert fp8_prefill_rows(batch((2049,))) == prefill_bucket(2049) == 2560
    assert fp8_prefill_rows(batch((3000,))) == 3072
    assert fp8_prefill_rows(batch((8192,))) == 8192
    assert fp8_prefill_rows(batch((PREFILL_GRAPH_TOKENS,))) is None  # the prefill graphs': FlashAttention, bf16
    assert fp8_prefill_rows(batch((3000,), (16,))) is None  # after a cached prefix (a chunk)
    assert fp8_prefill_rows(batch((3000, 3000))) is None  # not alone
    assert fp8_prefill_rows(batch((1, 3000), num_decodes=1)) is None  # a mixed step
    assert fp8_prefill_rows(batch((3000,), varlen=(torch.zeros(2), 3000))) is None  # a CUDA graph's
    assert fp8_prefill_rows(batch((1,), is_prefill=False)) is None


def test_plan_decode_attention_and_tiles():
    attention = DecodeAttentionPlan(short_context=100, short_splits=4, short_block_n=32, long_splits=7)
    assert attention.for_step(1, 100) == (4, 32) and attention.for_step(1, 101) == (7, None)
    assert attention.for_step(2, 10) == attention.for_step(2, 10 ** 5) == (None, attention.batch_block_n)
    cuda_fp8 = DecodeAttentionPlan(short_context=100, short_splits=4, short_block_n=32, long_splits=7, fp8_cuda=True)
    assert cuda_fp8.for_step(1, 100) == (4, 32) and cuda_fp8.for_step(1, 101) == (None, None)  # its own splits
    assert not cuda_fp8.uses_fp8_cuda(1, 100) and cuda_fp8.uses_fp8_cuda(1, 101) and cuda_fp8.uses_fp8_cuda(8, 10)
    assert not attention.uses_fp8_cuda(8, 10)
    from llm_anatomy.kernels.gemv import DEFAULT_TILE, Tile

    key = (80, 1024, False, "bfloat16")
    plan = ExecutionPlan(kernels=True, cuda_graphs=True, pdl=True).with_tiles({key: Tile(16, 512, 4, 3)})
    assert plan.gemv_tile(key) == Tile(16, 512, 4, 3) and plan.gemv_tile((80, 1024, True, "bfloat16")) == DEFAULT_TILE[2]
    assert plan.gemv_tile((80, 1024, False, "float32")) == DEFAULT_TILE[4]
    eager = plan.eager()
    assert not eager.cuda_graphs and not eager.pdl and eager.kernels and eager.gemv_tiles == plan.gemv_tiles


def test_a_failed_step_ends_its_requests_with_an_error_and_the_engine_goes_on(save_tiny, monkeypatch):
    """The failure contract: a whole step that raises ends every sequence of that step with finish_reason "error"
    and a message, frees their KV blocks, and the next request runs as if nothing happened; a failure confined to
    one sequence (here its detokenizer) ends that sequence alone."""
    directory, _ = save_tiny()
    engine = Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=64, block_size=4)
    free = engine.pool.num_free_blocks
    params = engine.sampling_params(temperature=0, max_tokens=5, ignore_eos=True)
    seqs = [engine.add_request([1, 2, 3], params), engine.add_request([4, 5], params)]
    run = engine.runner.run

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.runner, "run", broken)
    done = engine.step()
    assert done == seqs and all(s.finish_reason == "error" and "injected" in s.error for s in seqs)
    assert engine.pool.num_free_blocks == free and not engine.has_work()
    monkeypatch.setattr(engine.runner, "run", run)
    good = engine.generate(prompt_token_ids=[1, 2, 3], temperature=0, max_tokens=5, ignore_eos=True)
    assert good.finish_reason == "length" and len(good.output_token_ids) == 5

    a, b = engine.add_request([1, 2, 3], params), engine.add_request([4, 5], params)
    monkeypatch.setattr(a.detokenizer, "add", broken)
    while engine.has_work():
        engine.step()
    assert a.finish_reason == "error" and "injected" in a.error
    assert b.finish_reason == "length" and len(b.output_token_ids) == 5
    assert engine.pool.num_free_blocks == free


def test_the_default_device_is_resolved_to_an_indexed_one():
    """`serve` without --device hands None to the engine core's process, which calls torch.cuda.set_device:
    a bare "cuda" made it refuse to start on every GPU machine."""
    from llm_anatomy.engine.engine import parse_device

    dev = parse_device(None)
    if torch.cuda.is_available():
        assert dev.type == "cuda" and dev.index == torch.cuda.current_device()
        assert parse_device("cuda").index is not None
    else:
        assert dev == torch.device("cpu")
    with pytest.raises(AnatomyError, match="unknown device"):
        parse_device("gpu0")
