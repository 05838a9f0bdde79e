"""`llm-anatomy call` and the Anatomy it produces, on tiny checkpoints on the CPU."""

import json
import time

import pytest
import torch

from llm_anatomy import Engine
from llm_anatomy.anatomy import SCHEMA_VERSION, Anatomy, Ceilings
from llm_anatomy.cli import main
from llm_anatomy.probe.call import CallRequest, measure_call

SEQUENTIAL = ["parse", "template", "tokenize", "queue", "prefill", "decode"]


@pytest.fixture
def tiny(save_tiny):
    directory, _ = save_tiny(initializer_range=0.2, vocab_size=151936)  # Qwen-sized vocabulary: real prompts work
    return directory


@pytest.fixture
def measured(tiny):
    engine = Engine.from_pretrained(tiny, device="cpu", dtype=torch.float32, kv_cache_tokens=256, block_size=4)
    ceilings = Ceilings("cpu", read_gbps=20.0, gemv_gbps=15.0, matmul_tflops=0.5, datasheet_gbps=None,
                        datasheet_tflops=None, measured_at="2026-11-29")
    request = CallRequest(messages=[{"role": "user", "content": "Hello <b>there</b>"}],
                          sampling=dict(max_tokens=12, temperature=0, ignore_eos=True))
    result, anatomy = measure_call(engine, request, ceilings)
    return engine, result, anatomy


def test_phases_lie_inside_e2e_and_do_not_overlap(measured):
    _, _, a = measured
    phases = {p.name: p for p in a.phases}
    assert [p.name for p in a.phases if p.name in SEQUENTIAL] == SEQUENTIAL
    for p in a.phases:
        assert 0 <= p.start_ms <= p.end_ms <= a.e2e_ms + 1e-6, p
    ordered = [phases[n] for n in SEQUENTIAL]
    for before, after in zip(ordered, ordered[1:]):
        assert before.end_ms <= after.start_ms + 1e-6
    assert phases["prefill"].end_ms == a.ttft_ms
    for step in a.decode_steps:
        assert phases["decode"].start_ms - 1e-6 <= step.start_ms <= step.end_ms <= phases["decode"].end_ms + 1e-6
        assert step.gpu_ms > 0 and step.host_ms > 0


def test_decode_steps_and_latency_metrics(measured):
    _, result, a = measured
    assert len(a.output_token_ids) == 12 == len(result.output_token_ids)
    assert len(a.decode_steps) == len(a.output_token_ids) - 1
    assert [s.token_id for s in a.decode_steps] == a.output_token_ids[1:]
    assert [s.context_len for s in a.decode_steps] == list(range(len(a.prompt_token_ids) + 1,
                                                                len(a.prompt_token_ids) + 12))
    assert len(a.itl_ms) == 11
    assert a.tpot_ms == pytest.approx(sum(a.itl_ms) / 11)
    assert a.ttft_ms + sum(a.itl_ms) == pytest.approx(a.phases[-2].end_ms)
    assert a.prefill.tokens == len(a.prompt_token_ids)
    assert a.prefill.flops > 0 and a.prefill.roofline.bound.kind in ("compute", "memory", "overhead")


def test_kv_bytes_equal_the_allocated_tensors(measured):
    engine, _, a = measured
    kv, pool = a.kv_cache, engine.pool
    tensor_bytes = pool.k.numel() * pool.k.element_size() + pool.v.numel() * pool.v.element_size()
    assert kv.pool_bytes == tensor_bytes
    assert kv.bytes_per_token * pool.num_blocks * pool.block_size == tensor_bytes
    c = engine.config
    assert kv.bytes_per_token == c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
    n = len(a.prompt_token_ids) + len(a.output_token_ids) - 1  # the last token is sampled, never cached
    assert kv.tokens == n and kv.bytes_used == n * kv.bytes_per_token
    assert kv.blocks_allocated == -(-n // 4) and kv.bytes_allocated == kv.blocks_allocated * 4 * kv.bytes_per_token
    assert kv.bytes_after_step == [(len(a.prompt_token_ids) + i) * kv.bytes_per_token for i in range(12)]
    assert pool.num_free_blocks == pool.num_blocks  # released at the end


def test_memory_census_sums_to_total(measured):
    _, _, a = measured
    m = a.memory
    parts = m.weights + m.kv_pool + m.cuda_graphs + m.other_allocated + m.allocator_free + m.context_and_other + m.free
    assert parts == m.total


def test_json_record_has_the_documented_keys_and_round_trips(measured):
    _, _, a = measured
    d = json.loads(a.to_json())
    for key in ("schema_version", "model", "weights", "device", "prompt_token_ids", "output_token_ids", "text",
                "phases", "ttft_ms", "tpot_ms", "e2e_ms", "prefill", "decode_steps", "kv_cache", "memory",
                "gpu_samples"):
        assert key in d, key
    assert d["schema_version"] == SCHEMA_VERSION
    assert d["model"]["config"]["num_hidden_layers"] == 2 and d["model"]["config"]["model_type"] == "qwen3"
    for key in ("tokens", "ms", "flops", "bytes", "mfu"):
        assert key in d["prefill"]
    assert d["kv_cache"]["bytes_per_token"] > 0
    assert not d["telemetry"]["available"] and "cpu" in d["telemetry"]["note"]
    assert Anatomy.from_json(a.to_json()) == a
    with pytest.raises(ValueError, match="schema_version"):
        Anatomy.from_dict({**d, "schema_version": "0.1"})


def test_startup_is_recorded_apart_from_the_call(measured):
    """The engine's one-time load is in the record and in both reports, and in none of the call's timings."""
    from rich.console import Console

    from llm_anatomy.report.html import render_html
    from llm_anatomy.report.terminal import render

    engine, _, a = measured
    s = a.startup
    assert s.total_s == engine.startup_seconds > 0
    assert s.compile_and_capture_s == 0 and s.cuda_graphs == 0 and not s.programmatic_dependent_launch  # CPU: eager
    assert "startup" not in {p.name for p in a.phases}  # a field of its own, not a phase of the call
    from llm_anatomy.report.units import seconds

    line = f"{seconds(s.total_s)} once, before this call and not in its timings; eager, no CUDA graphs"
    assert line in render_html(a)
    console = Console(record=True, width=400)
    render(a, console)
    assert f"Start-up  {line}" in console.export_text()
    from dataclasses import replace

    direct = Engine(engine.model, engine.config, engine.tokenizer, engine.source, engine.weights,
                    replace(engine.engine_config, kv_cache_tokens=64, block_size=4), engine.device, engine.dtype,
                    engine.defaults)
    assert direct.startup_seconds is None


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_call_writes_json_html_trace(tiny, tmp_path, capsys):
    import gc
    from unittest import mock

    frozen, freeze = [], gc.freeze
    gc.unfreeze()
    with mock.patch.object(gc, "freeze", lambda: (freeze(), frozen.append(gc.get_freeze_count()))):
        code, out, err = run_cli(capsys, "call", "Hi <script>alert(1)</script>", "--model", str(tiny), "--device",
                                 "cpu", "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--no-calibrate",
                                 "--json", str(tmp_path / "a.json"), "--html", str(tmp_path / "a.html"),
                                 "--trace", str(tmp_path / "a.trace.json"), "--kernels")
    assert frozen and frozen[0] > 0  # start-up's heap is kept out of collections during the call
    assert gc.get_freeze_count() == 0  # and given back after it, so that exit frees it
    assert code == 0, err
    a = Anatomy.from_json((tmp_path / "a.json").read_text())
    assert len(a.output_token_ids) == 6 and "<script>alert(1)</script>" in a.prompt_text
    assert {k.phase for k in a.kernels} == {"prefill", "decode"}
    assert "Timeline" in out and "Prefill" in out and "KV cache" in out
    assert "<script>alert(1)</script>" not in (tmp_path / "a.html").read_text()
    assert json.loads((tmp_path / "a.trace.json").read_text())["traceEvents"]
    code, out, err = run_cli(capsys, "report", str(tmp_path / "a.json"))
    assert code == 0 and "Timeline" in out


def test_cli_default_model_on_the_cpu(capsys, caplog):
    """The README's main job: no model flag on a machine without a GPU runs Qwen3-0.6B, synthetic, labelled."""
    code, out, err = run_cli(capsys, "call", "--max-tokens", "3", "--no-calibrate", "--device", "cpu")
    assert code == 0, err
    assert "Qwen/Qwen3-0.6B" in out and "synthetic random weights" in out
    assert "no GPU counters" in out
    assert "hf download Qwen/Qwen3-0.6B" in caplog.text  # the one-line notice on how to get real weights


@pytest.mark.parametrize("argv,message", [
    (["--model", "no-such/model"], "unknown model 'no-such/model'"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--max-tokens", "50000"], "exceeds the context"),
    (["--raw-prompt", "--system", "x"], "--raw-prompt sends PROMPT as is"),
    (["--device", "cuda:7"], "cuda"),
    (["--dtype", "int3"], "unknown dtype"),
    (["--kv-cache-tokens", "0"], "--kv-cache-tokens must be >= 1"),
    (["--weights", "/no/such/dir"], "is not a directory"),
])
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run_cli(capsys, "call", "hi", "--no-calibrate", *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("content,message", [
    ('{"role": "user"}', "messages must be a non-empty list"),
    ('[{"content": "hi"}]', "messages[0].role must be one of"),
    ('[{"role": "user", "content": 5}]', "messages[0].content must be a string"),
    ('not json', "is not valid JSON"),
])
def test_cli_bad_messages_file(capsys, tmp_path, content, message):
    path = tmp_path / "m.json"
    path.write_text(content)
    code, out, err = run_cli(capsys, "call", "--messages", str(path), "--no-calibrate", "--device", "cpu")
    assert code == 2 and message in err and "Traceback" not in err
    code, out, err = run_cli(capsys, "call", "--messages", str(tmp_path / "missing.json"), "--device", "cpu")
    assert code == 2 and "--messages does not exist" in err


def test_cli_report_rejects_non_anatomy(capsys, tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"schema_version": "2.0"}')
    code, out, err = run_cli(capsys, "report", str(path))
    assert code == 2 and "is not an Anatomy JSON" in err


def test_a_prompt_prefilled_in_chunks(tiny):
    engine = Engine.from_pretrained(tiny, device="cpu", dtype=torch.float32, kv_cache_tokens=256, block_size=4,
                                    max_num_batched_tokens=8)
    ceilings = Ceilings("cpu", read_gbps=20.0, gemv_gbps=15.0, matmul_tflops=0.5, datasheet_gbps=None,
                        datasheet_tflops=None, measured_at="2026-11-29")
    request = CallRequest(prompt_token_ids=list(range(100, 130)), sampling=dict(max_tokens=5, temperature=0,
                                                                               ignore_eos=True))
    result, a = measure_call(engine, request, ceilings)
    assert a.prefill.steps == 4 and a.prefill.tokens == 30  # 8 + 8 + 8 + 6
    assert len(a.decode_steps) == 4 and a.output_token_ids == result.output_token_ids
    whole = Engine.from_pretrained(tiny, device="cpu", dtype=torch.float32, kv_cache_tokens=256, block_size=4)
    assert whole.generate(prompt_token_ids=list(range(100, 130)), max_tokens=5, temperature=0,
                          ignore_eos=True).output_token_ids == result.output_token_ids


def test_a_batched_request_gets_its_share_of_the_energy(tiny):
    """Two requests decoding together: each anatomy keeps the device's energy over its span and adds its own
    share, weighted by its tokens' fraction of each step."""
    from llm_anatomy.probe.call import Marks, TelemetryWindow, build_anatomy
    from llm_anatomy.probe.clock import Clock
    from llm_anatomy.probe.recorder import Recorder
    from llm_anatomy.probe.telemetry import RawSample

    engine = Engine.from_pretrained(tiny, device="cpu", dtype=torch.float32, kv_cache_tokens=256, block_size=4)
    ceilings = Ceilings("cpu", read_gbps=20.0, gemv_gbps=15.0, matmul_tflops=0.5, datasheet_gbps=None,
                        datasheet_tflops=None, measured_at="2026-11-29")
    recorder = Recorder(Clock(engine.device))
    engine.observers.append(recorder)
    params = engine.sampling_params(max_tokens=8, temperature=0, ignore_eos=True)
    t0 = time.perf_counter_ns()
    seqs = []
    for rid in ("a", "b"):
        recorder.watch(rid, t0)
        seqs.append(engine.add_request([100, 101, 102], params, request_id=rid))
    while engine.has_work():
        engine.step()
    traces = {t.request_id: t for t in recorder.take_finished()}
    end = max(t.finished_ns for t in traces.values())
    # a counter that rises 100 mJ per 10 ms (10 W), updated every 10 ms, from well before to well after
    samples = [RawSample(t, None, (t - t0 + 10**9) // 100_000, None, None, None, None, None, None, None)
               for t in range(t0 - 300_000_000, end + 300_000_000, 10_000_000)]
    for seq in seqs:
        trace = traces[seq.request_id]
        a = build_anatomy(engine, {}, engine.result(seq), trace, ceilings, TelemetryWindow(samples, True, "", 100.0),
                          "", Marks(t0, t0, t0, t0, trace.finished_ns))
        energy = {e.phase: e for e in a.telemetry.energy}
        assert a.batching.max_batch_size == 2 and energy["call"].per_token_j is None
        share = energy["call_attributed"]
        assert 0 < share.joules < energy["call"].joules and share.per_token_j == pytest.approx(share.joules / 8)
        assert a.summary()["energy_j"] == share.joules


@pytest.mark.parametrize("name,category", [
    ("_qk_norm_rope_store_kernel", "rope"),  # fused QK-norm + RoPE + cache store: not an RMSNorm
    ("_rmsnorm_kernel", "norm"),
    ("_gemv_kernel", "gemm"),
    ("_silu_mul_kernel", "activation"),
    ("_decode_attention_split_kernel", "attention"),
    ("_decode_attention_merge_kernel", "attention"),
    ("_rope_decode_attention_kernel", "attention"),  # batch 1's attention with its QK-norm and RoPE: attention's
    ("_greedy_kernel", "sampling"),  # batch 1's graphs' argmax, which advances the next step's inputs too
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0",
     "attention"),
    ("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, long, long)", "copy"),
    ("Memset (Device)", "copy"),
])
def test_kernel_categories(name, category):
    from llm_anatomy.probe.kernels import categorize

    assert categorize(name) == category


def test_cli_report_rejects_a_malformed_startup_record(measured, capsys, tmp_path):
    _, _, a = measured
    d = json.loads(a.to_json())
    d["startup"] = {"total_s": 1.0}  # the other fields missing
    path = tmp_path / "a.json"
    path.write_text(json.dumps(d))
    code, _, err = run_cli(capsys, "report", str(path))
    assert code == 2 and "is not an Anatomy JSON" in err
