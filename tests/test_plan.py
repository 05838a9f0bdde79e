"""`llm-anatomy plan`: refusals, the memory arithmetic against hand counts and the engine's own
counts, and the efficiencies fitted to a sweep (recovered from points made with known ones)."""

import argparse
import json
import math
import re

import pytest
import torch

from llm_anatomy import Engine
from llm_anatomy.errors import AnatomyError
from llm_anatomy.hub import presets, resolve
from llm_anatomy.models.config import ModelConfig
from llm_anatomy.probe.cost import decode_cost, prefill_cost
from llm_anatomy.sweep.cli import add_plan_parser
from llm_anatomy.gpus import GIB, gpus
from llm_anatomy.sweep.grid import Precision
from llm_anatomy.sweep.plan import plan
from llm_anatomy.sweep.planner import (Efficiencies, Hardware, Setup, decode_features, decode_time, fit_efficiencies,
                                       eager_prefill, kv_bytes_per_token, predict_point, prefill_features, prefill_schedule,
                                       prefill_time, weight_bytes)
from llm_anatomy.sweep.report import leave_one_out

from conftest import TINY

REQUIRED = ("gpu", "model", "ttft_ms", "tpot_ms", "max_concurrent_sequences", "kv_bytes_per_token", "assumptions")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    (directory / "config.json").write_text(json.dumps({**TINY, "model_type": "qwen3", "torch_dtype": "float32"}))
    return directory


def run_plan(capsys, *argv):
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    assert args.handler(args) == 0
    return capsys.readouterr().out


def test_unknown_gpu_and_model_are_refused_with_the_known_lists(capsys):
    with pytest.raises(AnatomyError) as info:
        plan("h300", "Qwen3-8B")
    assert str(info.value) == f"unknown GPU 'h300'; known: {', '.join(gpus())}"
    with pytest.raises(AnatomyError) as info:
        run_plan(capsys, "--gpu", "h200", "--model", "Qwen3-9B")
    message = str(info.value)
    assert "unknown model 'Qwen3-9B'" in message and "Qwen/Qwen3-32B" in message and "\n" not in message


@pytest.mark.parametrize("kwargs,message", [
    (dict(context=0), "--context must be in 1..512, got 0"),
    (dict(context=513), "--context must be in 1..512, got 513"),
    (dict(prompt_tokens=0), "--prompt-tokens must be in 1..512"),
    (dict(batch=0), "--batch must be in 1..4096"),
    (dict(tpot_ms=-1.0), "--tpot-ms must be a positive number of milliseconds, got -1.0"),
    (dict(ttft_ms=float("nan")), "--ttft-ms must be a positive number"),
    (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization must be in (0, 1]"),
    (dict(quantization="int4"), "--quantization: unknown value 'int4'"),
    (dict(kv_cache_dtype="fp16"), "--kv-cache-dtype: unknown value 'fp16'"),
    (dict(max_num_batched_tokens=0), "--max-num-batched-tokens must be in 1.."),
])
def test_bad_values_are_refused(tiny, kwargs, message):
    with pytest.raises(AnatomyError, match=re.escape(message)):
        plan("h200", str(tiny), **{"context": 256, **kwargs})


def test_fp8_weights_need_fp8_tensor_cores():
    with pytest.raises(AnatomyError, match="NVIDIA A100 SXM4 80GB has no fp8 tensor cores"):
        plan("a100-80gb", "Qwen3-8B", quantization="fp8")
    kv = plan("a100-80gb", "Qwen3-8B", kv_cache_dtype="fp8")  # an fp8 KV cache is storage only
    assert kv["kv_bytes_per_token"] == 147456 // 2


def test_kv_capacity_equals_a_hand_count(tiny):
    a = plan("l4", str(tiny), context=200, prompt_tokens=100)
    # the tiny model, float32: 2 layers x (K, V) x 2 KV heads x 32 head_dim x 4 B
    per_token = 2 * 2 * 2 * 32 * 4
    per_sequence = 208 * per_token  # 200 tokens in blocks of 16: 13 blocks
    h, i, q, kv, vocab = 64, 128, 4 * 32, 2 * 32, 512
    layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + 2 * 32
    weights = (2 * layer + 2 * vocab * h + h) * 4  # layers, embedding and untied lm_head, final norm
    activations = 200 * max(2 * h + 3 * i, 2 * h + 2 * q + 2 * kv) * 4 + vocab * 4  # a 200-token prefill step
    budget = 0.9 * 24 * GIB - weights - 0.82e9 - activations
    assert a["kv_bytes_per_token"] == per_token
    assert a["memory"]["weights_bytes"] == weights and a["memory"]["activations_bytes"] == activations
    assert a["max_concurrent_sequences"] == math.floor(budget / per_sequence) and a["fits"]
    assert set(REQUIRED) <= set(a)


def test_weights_and_kv_bytes_match_the_engines_own(tiny):
    engine = Engine.from_pretrained(tiny, device="cpu", weights="synthetic", kv_cache_tokens=64)
    config = ModelConfig.from_hf(resolve(tiny).config)
    assert weight_bytes(config, torch.float32, Precision()) == engine.weights.bytes
    assert kv_bytes_per_token(config, torch.float32, Precision()) == engine.pool.bytes_per_token
    assert kv_bytes_per_token(config, torch.float32, Precision(None, "fp8")) == engine.pool.bytes_per_token // 4


def test_json_answers_for_every_qwen3_size(capsys):
    tpots = []
    for name in [k for k in presets() if not k.startswith("_")]:
        a = json.loads(run_plan(capsys, "--gpu", "h200", "--model", name, "--json", "--tpot-ms", "20",
                                "--ttft-ms", "300"))
        assert set(REQUIRED) <= set(a) and a["model"] == name and a["fits"]
        assert all(isinstance(x, str) for x in a["assumptions"]) and any(
            x.startswith("tpot_ms:") for x in a["assumptions"])
        tpots.append(a["tpot_ms"])
        b = a["max_batch_for_tpot"]["batch"]
        setup = Setup(ModelConfig.from_hf(presets()[name]), torch.bfloat16, Precision(), Hardware.of(gpus()["h200"]),
                      Efficiencies(**a["efficiencies"]), 8192, b + 1)
        assert setup.decode_step_ms(b, 4096) <= 20 < setup.decode_step_ms(b + 1, 4096) or \
            b == a["max_concurrent_sequences"]
    assert tpots == sorted(tpots)  # bigger models stream more weights
    small = json.loads(run_plan(capsys, "--gpu", "l4", "--model", "Qwen3-32B", "--json"))
    assert not small["fits"] and small["max_concurrent_sequences"] == 0 and "exceed the usable memory" in small["why_not"]
    text = run_plan(capsys, "--gpu", "h100-sxm", "--model", "Qwen3-8B")
    assert "Capacity" in text and "Assumptions" in text


TRUE = Efficiencies(decode_bw=0.7, decode_bw_gemv=0.55, decode_bw_gemm=0.6, decode_mm=0.5, decode_kv=0.6, decode_t0_ms=0.1, decode_seq_ms=0.004,
                    prefill_bw=0.5, prefill_mm=0.7, prefill_attn=0.5, prefill_t0_ms=0.5,
                    prefill_eager_ms=2.0)


def synthetic_sweep(directory, config: ModelConfig):
    """A sweep directory whose points are the planner's own model at TRUE on an H200 (what a fit must recover)."""
    hw = Hardware.of(gpus()["h200"])
    setup = Setup(config, torch.bfloat16, Precision(), hw, TRUE, 8192, 256)
    records = []
    for prompt in (128, 2048, 8192):
        for batch in (1, 16, 256):
            output = 64
            prefill = [{"parts": prefill_cost(config, torch.bfloat16, seqs).parts, "tokens": sum(n for n, _ in seqs),
                        "seqs": len(seqs), "first_tokens": done} for seqs, done in prefill_schedule(batch, prompt, 8192,
                                                                                                    256)]
            for s in prefill:
                s["wall_ms"] = prefill_time(prefill_features(s["parts"], hw, None, eager_prefill(s["seqs"], s["tokens"])),
                                            TRUE.values())
            parts = decode_cost(config, torch.bfloat16, [prompt + output / 2] * batch).parts
            step = decode_time(decode_features(parts, batch, hw, None), TRUE.values())
            records.append({"key": f"p{prompt}-b{batch}", "status": "ok", "precision": "bf16", "quantization": None,
                            "kv_cache_dtype": "auto", "prompt_tokens": prompt, "batch": batch, "output_tokens": output,
                            **predict_point(setup, batch, prompt, output),
                            "steps": {"prefill": prefill, "decode": {"steps": output - 1, "wall_ms": step * (output - 1),
                                                                     "batch": batch, "parts": parts}}})
    meta = {"identity": {"model": "Qwen/Qwen3-8B", "device": "NVIDIA H200", "dtype": "bfloat16"}, "gpu": "h200",
            "config": config.to_hf(), "ceilings": None,
            "engines": {"bf16-kvauto": {"label": "bf16", "max_num_batched_tokens": 8192, "max_num_seqs": 256}}}
    directory.mkdir()
    (directory / "sweep_meta.json").write_text(json.dumps(meta))
    (directory / "sweep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return meta, records


def test_efficiencies_fitted_to_a_sweep_are_recovered_and_leave_one_out_predicts_it(tmp_path):
    config = ModelConfig.from_hf(presets()["Qwen/Qwen3-8B"])
    meta, records = synthetic_sweep(tmp_path / "sweep", config)
    from llm_anatomy.sweep.planner import default_efficiencies

    fitted = fit_efficiencies(records, Hardware.of(gpus()["h200"]), None, default_efficiencies())
    for name in ("decode_bw", "decode_bw_gemv", "decode_kv", "prefill_mm", "prefill_attn"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.03), name
    loo = leave_one_out(meta, records)
    for metric in ("ttft_ms", "tpot_ms", "output_tokens_per_s"):  # a point left out takes its evidence with it
        v = loo["summary"][metric]
        assert v["points"] == 9 and v["median_abs_error"] < 0.01, metric
        # the grid's one memory-bound prefill (128 tokens, batch 1) is the only evidence of that efficiency: left
        # out, its TTFT comes from the compute-bound ones alone
        assert v["within_10pct"] >= (8 if metric == "ttft_ms" else 9), metric
    a = plan("h100-sxm", "Qwen3-8B", from_sweep=tmp_path / "sweep")
    assert a["efficiencies"]["source"].startswith("fitted to") and str(tmp_path / "sweep") in a["efficiencies"]["source"]
    assert a["efficiencies"]["decode_bw"] == pytest.approx(TRUE.decode_bw, rel=0.03)


def test_a_sweep_without_a_datasheet_cannot_be_carried_to_another_gpu(tmp_path):
    config = ModelConfig.from_hf(presets()["Qwen/Qwen3-0.6B"])
    meta, records = synthetic_sweep(tmp_path / "sweep", config)
    meta["gpu"] = None
    meta["identity"]["device"] = "cpu: a laptop"
    (tmp_path / "sweep" / "sweep_meta.json").write_text(json.dumps(meta))
    with pytest.raises(AnatomyError, match="it ran on cpu: a laptop, which has no datasheet entry"):
        plan("h200", "Qwen3-0.6B", from_sweep=tmp_path / "sweep")
    with pytest.raises(AnatomyError, match="not a sweep directory"):
        plan("h200", "Qwen3-0.6B", from_sweep=tmp_path / "nothing")


def test_the_planner_counts_as_eager_the_prefills_the_engine_runs_eagerly():
    """eager_prefill follows the engine's graphs: one fresh prompt up to 2048 tokens, or 2-64 fresh prompts that
    fit a batch-prefill graph (at least 8 tokens a prompt of its size), replay one; the rest run eagerly."""
    assert not eager_prefill(1, 2048) and eager_prefill(1, 2049) and eager_prefill(1, 100, cached=16)
    assert not eager_prefill(2, 20) and not eager_prefill(8, 1024) and not eager_prefill(64, 2048)
    assert eager_prefill(33, 33 * 7) and not eager_prefill(32, 32 * 7)  # a graph of 256 takes 32 prompts
    assert eager_prefill(65, 2048) and eager_prefill(2, 2049) and eager_prefill(4, 512, cached=10)
