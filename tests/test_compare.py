"""`llm-anatomy compare`: the drift figures are the ones an independent computation gives, the same engine twice
drifts by nothing, bad flags fail before any weights load, and the report labels synthetic weights."""

import argparse
import json

import pytest
import torch

from llm_anatomy import Engine
from llm_anatomy.compare import add_parser, cmd_compare, compare_engines, drift, summarize, teacher_forced_logprobs
from llm_anatomy.errors import AnatomyError


def load(directory, **kwargs):
    return Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=256, **kwargs)


def test_drift_of_known_distributions():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.25, 0.25]]).log()
    q = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]]).log()
    kl, top1 = drift(p, q)
    expected = [0.7 * torch.log(torch.tensor(0.7 / 0.6)) + 0.2 * torch.log(torch.tensor(0.2 / 0.3)),
                0.5 * torch.log(torch.tensor(0.5 / 0.2)) + 0.25 * torch.log(torch.tensor(0.25 / 0.5))
                + 0.25 * torch.log(torch.tensor(0.25 / 0.3))]
    assert torch.allclose(kl, torch.tensor(expected, dtype=torch.float64), atol=1e-6)
    assert top1.tolist() == [True, False]
    same, agree = drift(p, p)
    assert same.tolist() == [0.0, 0.0] and agree.all()


def test_teacher_forcing_equals_a_full_forward(save_tiny):
    """The engine's prefill + decode steps give, at each forced position, the distribution a single forward of the
    whole sequence gives."""
    from llm_anatomy.engine.kv_cache import KVCachePool
    from llm_anatomy.models.attention import AttentionBatch

    directory, _ = save_tiny()
    engine = load(directory)
    prompt, forced = [3, 141, 59, 26], [5, 35, 89, 79, 32, 38]
    ours = teacher_forced_logprobs(engine, prompt, forced)
    ids = torch.tensor(prompt + forced[:-1])
    pool = KVCachePool(engine.config, 1, 16, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        hidden = engine.model(ids, torch.arange(len(ids)), AttentionBatch.fresh_prompt(pool.k, pool.v,
                                                                                        torch.arange(len(ids))))
        full = engine.model.compute_logits(hidden[len(prompt) - 1:]).log_softmax(-1)
    assert ours.shape == (len(forced), 512)
    assert torch.allclose(ours, full, atol=1e-5)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks  # its blocks are given back


def test_same_engine_drifts_by_nothing_and_fp8_by_a_little(save_tiny):
    directory, _ = save_tiny()
    baseline = load(directory)
    prompts = [("a", [3, 141, 59, 26, 5]), ("b", [400, 2, 77])]
    same, timings = compare_engines(baseline, load(directory), prompts, 8)
    assert timings == {"baseline": (None, None), "quantized": (None, None)}  # timed on a GPU only
    assert all(p.kl == (0.0,) * 8 and all(p.top1) and p.greedy_agreement == 8 for p in same)
    fp8 = load(directory, quantization="fp8")
    results, _ = compare_engines(baseline, fp8, prompts, 8)
    assert [p.prompt_tokens for p in results] == [5, 3] and all(p.tokens == 8 for p in results)
    s = summarize(results)
    assert 0 < s.kl_mean < 0.05 and s.kl_mean <= s.kl_p99 <= s.kl_max and 0.5 <= s.top1_agreement <= 1
    # the figures are those of the two engines' own distributions along the baseline's greedy continuation
    ref = baseline.generate(prompt_token_ids=prompts[0][1], temperature=0, max_tokens=8, ignore_eos=True)
    kl, _ = drift(teacher_forced_logprobs(baseline, prompts[0][1], ref.output_token_ids),
                  teacher_forced_logprobs(fp8, prompts[0][1], ref.output_token_ids))
    assert results[0].kl == tuple(kl.tolist())
    greedy = fp8.generate(prompt_token_ids=prompts[0][1], temperature=0, max_tokens=8, ignore_eos=True)
    diff = [a != b for a, b in zip(ref.output_token_ids, greedy.output_token_ids)] + [True]
    assert results[0].greedy_agreement == diff.index(True)


def parse(argv):
    parser = argparse.ArgumentParser(prog="llm-anatomy")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["compare", *argv])


@pytest.mark.parametrize("argv,message", [
    (["--quantization", "int4"], "--quantization 'int4' is not supported; use fp8"),
    (["--kv-cache-dtype", "fp16"], "--kv-cache-dtype 'fp16' is not supported; use auto or fp8"),
    ([], "nothing to compare: give --quantization fp8 and/or --kv-cache-dtype fp8"),
    (["--quantize-lm-head", "--kv-cache-dtype", "fp8"], r"quantize_lm_head \(--quantize-lm-head\) needs "
                                                         r"quantization='fp8'"),
    (["--quantization", "fp8", "--quantize-lm-head", "--baseline-quantization", "int8"],
     "--baseline-quantization 'int8' is not supported; use fp8"),
    (["--quantization", "fp8", "--baseline-quantization", "fp8"], "nothing to compare beyond the baseline's"),
    (["--kv-cache-dtype", "fp8", "--baseline-quantization", "fp8"], "nothing to compare beyond the baseline's"),
    (["--quantization", "fp8", "--max-tokens", "0"], "--max-tokens must be in 1..4096, got 0"),
    (["--quantization", "fp8", "--max-tokens", "5000"], "--max-tokens must be in 1..4096, got 5000"),
    (["--quantization", "fp8", "--json", "/no/such/dir/out.json"], "directory /no/such/dir does not exist"),
    (["--quantization", "fp8", "--context-tokens", "-1"], "--context-tokens must be in 0..131072, got -1"),
    (["--quantization", "fp8", "--context-tokens", "131073"], "--context-tokens must be in 0..131072"),
])
def test_bad_flags_fail_before_any_weights_load(argv, message, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an engine was loaded")

    monkeypatch.setattr(Engine, "from_pretrained", refuse)
    with pytest.raises(AnatomyError, match=message):
        cmd_compare(parse(argv))


@pytest.mark.parametrize("weights", ["auto", "synthetic"])
def test_compare_command_end_to_end(save_tiny, tmp_path, capsys, weights):
    directory, _ = save_tiny(initializer_range=0.2, vocab_size=151936)  # Qwen-sized vocabulary: real prompts work
    out = tmp_path / "compare.json"
    assert cmd_compare(parse([str(directory), "--quantization", "fp8", "--max-tokens", "3", "--device", "cpu",
                              "--dtype", "float32", "--weights", weights, "--json", str(out)])) == 0
    text = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert len(record["prompts"]) == 6 and all(len(p["kl"]) == 3 for p in record["prompts"])
    assert record["summary"]["positions"] == 18
    b, q = record["baseline"], record["quantized"]
    head = 151936 * 64 * 4
    assert 0.25 < (q["linear_weight_bytes"] - head) / (b["linear_weight_bytes"] - head) < 0.28  # float32 -> fp8
    assert q["kv_bytes_per_token"] == b["kv_bytes_per_token"] and b["tpot_ms"] is None
    assert "fp8 e4m3" in q["precision"] and "float32" in b["precision"]
    assert record["synthetic"] == (weights == "synthetic") == ("not the real model's" in text)
    assert ("note" in record) == (weights == "synthetic")
    assert "KL(baseline || quantized)" in text and "explain" in text


def test_against_an_fp8_baseline_the_head_alone_is_measured(save_tiny, tmp_path, capsys):
    """--baseline-quantization fp8: both engines run fp8 layers, so what differs is lm_head alone: its bytes, and a
    drift that is smaller than the whole fp8 model's against its float baseline."""
    directory, _ = save_tiny(initializer_range=0.2, vocab_size=151936)
    records = {}
    for name, extra in (("head", ["--baseline-quantization", "fp8"]), ("all", [])):
        out = tmp_path / f"{name}.json"
        assert cmd_compare(parse([str(directory), "--quantization", "fp8", "--quantize-lm-head", "--max-tokens", "3",
                                  "--device", "cpu", "--dtype", "float32", "--json", str(out), *extra])) == 0
        records[name] = json.loads(out.read_text())
    b, q = records["head"]["baseline"], records["head"]["quantized"]
    assert "fp8 e4m3" in b["precision"] and "lm_head in the model dtype" in b["precision"]
    assert "lm_head's with per-channel scales" in q["precision"]
    head = 151936 * 64
    assert b["linear_weight_bytes"] - q["linear_weight_bytes"] == head * 4 - (head + 151936 * 4)  # float32 -> fp8
    assert 0 < records["head"]["summary"]["kl_mean"] < records["all"]["summary"]["kl_mean"]
    assert "with quantization=fp8" in capsys.readouterr().err


def test_context_tokens_put_a_document_before_each_request(save_tiny, tmp_path, capsys):
    """--context-tokens N: each request comes after a document of at least N tokens (its drift is measured over
    the long context), said in the record and the text; a document the model's context cannot hold is refused
    before any weights load."""
    directory, _ = save_tiny(initializer_range=0.2, vocab_size=151936)  # max_position_embeddings 512
    out = tmp_path / "compare.json"
    assert cmd_compare(parse([str(directory), "--kv-cache-dtype", "fp8", "--max-tokens", "2", "--device", "cpu",
                              "--dtype", "float32", "--context-tokens", "300", "--json", str(out)])) == 0
    record = json.loads(out.read_text())
    assert record["context_tokens"] == 300 and all(300 < p["prompt_tokens"] < 420 for p in record["prompts"])
    assert "each request after a document of 300+ tokens" in capsys.readouterr().out

    def refuse(*args, **kwargs):
        raise AssertionError("an engine was loaded")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Engine, "from_pretrained", refuse)
        with pytest.raises(AnatomyError, match="more than .* context \\(512\\); lower --context-tokens"):
            cmd_compare(parse([str(directory), "--kv-cache-dtype", "fp8", "--device", "cpu", "--context-tokens",
                               "600"]))


def test_the_precision_line_says_what_the_plan_does_in_fp8():
    """A GPU engine's plan (fast accumulation, the fp8 prefill attention) shows beside the stored precisions; a CPU
    engine's plan has neither."""
    from types import SimpleNamespace

    from llm_anatomy.compare import engine_figures

    plan = {"fp8_fast_accum": True, "fp8_prefill_attention": True, "fp8_prefill_min_tokens": 2049}
    engine = SimpleNamespace(weights=SimpleNamespace(quantization="fp8 e4m3 weights", bytes=10), dtype=torch.bfloat16,
                             pool=SimpleNamespace(dtype=torch.float8_e4m3fn, bytes_per_token=4),
                             model=torch.nn.Module(), plan=SimpleNamespace(describe=lambda: plan))
    assert engine_figures(engine, (None, None)).precision == (
        "fp8 e4m3 weights; KV cache float8_e4m3fn; fp8 GEMMs summed in the tensor cores' fp8 accumulator (fast "
        "accumulation); prompts of 2049 tokens or more attended in fp8 (cuDNN) when alone in a prefill step")
    plan.clear()
    assert engine_figures(engine, (None, None)).precision == "fp8 e4m3 weights; KV cache float8_e4m3fn"
