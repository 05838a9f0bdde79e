"""The benchmark scripts' parts that need no GPU: their argument checks, their tables, bench_h200's --baseline
plumbing (with a fake child process), the serve sweep's summary of anatomies, and check_core's parity against
HF transformers on a tiny model."""

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from test_bench import Behaviour, fake, server  # noqa: F401 - fake and server are fixtures

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture
def scripts(monkeypatch):
    """Loads a benchmarks/ script as its own module; the scripts import their siblings (bench_args, check_core),
    and sys.path is restored after the test."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


def refused(main, argv, capsys) -> str:
    """The one line a script prints on stderr when it refuses argv (exit status 2)."""
    capsys.readouterr()  # what fixtures printed
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, (argv, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---- bench_h200.py ---------------------------------------------------------------------------------------------
def bench_results(tpot=4.0, rested=44.0, overhead=0.001, sections=("ours", "hf", "overhead", "protocol")) -> dict:
    results = {
        "ours": {"decode_ctx512": {"tpot_ms": tpot, "floor_ms": 3.0, "decode_step_ms_median": tpot - 0.01},
                 "decode_ctx32k": {"tpot_ms": 6.0, "floor_ms": 4.5}, "prefill_128_ms": 6.0,
                 "prefill_2048_ms": 50.0, "prefill_2048_floor_ms": 40.0, "prefill_8192_ms": 190.0,
                 "prefill_8192_floor_ms": 171.0, "prefill_2048_rested_ms": rested, "ttft_chat_prompt": {"ttft_ms": 9.0},
                 "load_s": 17.5},
        "hf": {"decode_step_ms_median": 40.0, "prefill_128_ms": 30.0, "prefill_2048_ms": 75.0,
               "prefill_8192_ms": 285.0},
        "overhead": {"overhead": overhead},
        "protocol": {"30720": {"ours": {"tok_s": 2400.0, "peak_mib": 24767.0},
                               "hf_extrapolated": {"tok_s": 430.0, "decode_step_s_median": 0.036},
                               "published_h20_sglang_tok_s": 832.67, "published_h20_transformers_tok_s": 208.98}},
    }
    return {k: v for k, v in results.items() if k in sections}


def test_render_tables_targets_ratios_and_protocol(scripts):
    bench = scripts("bench_h200")
    results = bench_results()
    del results["ours"]["prefill_2048_rested_ms"]  # as results written before the rested prefill was timed
    lines = bench.render_tables(results).splitlines()
    row = {line.split(" | ")[0].lstrip("| "): line for line in lines}
    assert row["decode TPOT, context <= 512"].endswith("| 4.00 ms | 40.00 ms | 10.00x | 3.00 ms | 75% | yes |")
    assert "| 36.00 ms | 6.00x |" in row["decode TPOT at 32k context"]  # HF's 32k step from the protocol run
    assert row["decode TPOT at 32k context"].endswith("| no |")
    assert row["prefill, 2048 tokens, back to back"].endswith("| 1.50x | 40.00 ms | 80% | no |")
    assert row["prefill, 8192 tokens, back to back"].endswith("| yes |")
    assert "prefill, 2048 tokens, each after 1 s idle (a call on a rested GPU)" not in row
    results["ours"] |= {"prefill_2048_rested_ms": 44.0}
    row = {line.split(" | ")[0].lstrip("| "): line for line in bench.render_tables(results).splitlines()}
    assert row["prefill, 2048 tokens, each after 1 s idle (a call on a rested GPU)"].endswith(
        "| 44.00 ms |  |  | 40.00 ms | 91% | yes |")
    assert row["TTFT, chat prompt (HF: a 128-token prefill alone)"].endswith("| no |")
    assert row["anatomy on vs off"].startswith("| anatomy on vs off | <= 2 % of TPOT | +0.10% |")
    assert "| 30720 | 2400.0 | 24,767 | 430.0 | 832.67 | 208.98 |" in lines
    assert not any("power limit" in line for line in lines)  # no sustained rate measured
    results["env"] = {"sustained_matmul": {"tflops": 680.4, "n": 8192, "seconds": 2.0}}
    results["ours"] |= {"prefill_2048_sustained_floor_ms": 44.0, "prefill_8192_sustained_floor_ms": 171.0}
    assert [line for line in bench.render_tables(results).splitlines() if "power limit" in line] == [(
        "The floor column is at the burst matmul rate. Under the power limit (bf16 8192^3 products back to back: "
        "680 TFLOP/s after the first 1 s) the back-to-back prefills' floors are 44.00 ms (2048 tokens, this engine "
        "at 88%) and 171.00 ms (8192 tokens, this engine at 90%).")]
    assert bench.render_tables({}) == "(no section with a target ran)"
    failed = {name: {"error": "RuntimeError: CUDA out of memory"} for name in ("ours", "hf", "protocol", "overhead")}
    assert bench.render_tables(failed) == "(no section with a target ran)"


@pytest.mark.parametrize("argv, message", [
    (["--sections", "ours,nope"], "unknown section nope; pick from env,"),
    (["--sections", ","], "unknown section (none given)"),
    (["--rounds", "0"], "argument --rounds: want a positive whole number, got '0'"),
    (["--rounds", "2"], "--rounds alternates runs of two checkouts: give --baseline too"),
    (["--baseline", "/nonexistent/checkout"], "argument --baseline: no such directory: /nonexistent/checkout"),
    (["--baseline", str(BENCHMARKS)], "holds no llm_anatomy package; make one with `git worktree add"),
    (["--baseline", str(ROOT)], "--baseline is the checkout being measured"),
    (["--package", str(BENCHMARKS)], "argument --package:"),
    (["--out", "bench.json"], "argument --out: want a directory"),
    (["--out", str(BENCHMARKS / "bench_h200.py")], "argument --out: want a directory"),
    (["--model", "nope"], "unknown model 'nope'"),
])
def test_bench_refuses_bad_input_with_one_line(scripts, capsys, argv, message):
    assert message in refused(scripts("bench_h200").main, argv, capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_bench_refuses_a_machine_without_a_gpu_before_any_work(scripts, capsys, tmp_path):
    err = refused(scripts("bench_h200").main, ["--sections", "env", "--out", str(tmp_path / "out")], capsys)
    assert "needs a CUDA GPU" in err and not (tmp_path / "out").exists()


def test_headline_comparison_and_its_table(scripts):
    bench = scripts("bench_h200")
    baseline = [bench_results(tpot=4.0, overhead=0.001), bench_results(tpot=4.2, overhead=0.003)]
    current = [bench_results(tpot=3.9, overhead=0.002, sections=("ours", "overhead"))] * 2
    baseline[1]["ours"]["prefill_2048_rested_ms"] = 44.0  # the same in both rounds: no range shown
    current[0] = {**current[0], "hf": {"error": "RuntimeError: out of memory"}}
    rows = {r["figure"]: r for r in bench.comparison_rows(baseline, current)}
    tpot = rows["decode TPOT, context <= 512"]
    assert (tpot["unit"], tpot["baseline"], tpot["current"]) == ("ms", 4.1, 3.9)
    assert tpot["baseline_range"] == (4.0, 4.2) and tpot["change"] == pytest.approx(3.9 / 4.1 - 1)
    overhead = rows["anatomy on vs off, of TPOT"]
    assert overhead["unit"] == "%" and overhead["change"] == pytest.approx(0.0)  # points: 0.2 against 0.2
    hf = rows["HF: prefill, 2048 tokens"]  # only the baseline ran HF; the current run's failed
    assert hf["baseline"] == 75.0 and hf["current"] is None and hf["change"] is None
    assert "Qwen's protocol, input 30720" in rows and "TTFT, chat prompt" in rows
    table = bench.render_comparison(list(rows.values()), rounds=2).splitlines()
    line = {row.split(" | ")[0].lstrip("| "): row for row in table}
    assert line["decode TPOT, context <= 512"] == "| decode TPOT, context <= 512 | ms | 4.1 (4-4.2) | 3.9 | -4.9% |"
    assert line["anatomy on vs off, of TPOT"].endswith("| +0.00 pt |")
    assert line["prefill, 2048 tokens, each after 1 s idle"] == \
        "| prefill, 2048 tokens, each after 1 s idle | ms | 44 | 44 | +0.0% |"
    assert line["HF: prefill, 2048 tokens"] == "| HF: prefill, 2048 tokens | ms | 75 | - |  |"
    assert line["Qwen's protocol, input 30720"].startswith("| Qwen's protocol, input 30720 | tok/s | 2,400 | - |")
    one_round = bench.render_comparison(bench.comparison_rows(baseline[:1], current[:1]), rounds=1)
    assert "| decode TPOT, context <= 512 | ms | 4 | 3.9 | -2.5% |" in one_round.splitlines()


def fake_checkout(path: Path) -> Path:
    (path / "llm_anatomy").mkdir(parents=True)
    (path / "llm_anatomy" / "__init__.py").write_text("")
    return path


def test_baseline_runs_each_checkout_in_its_own_child_alternating(scripts, tmp_path, capsys):
    """Each child is this script with --package and PYTHONPATH at its checkout; the order alternates by round;
    the children's results end up side by side in comparison.json and on stdout."""
    bench = scripts("bench_h200")
    current, baseline = fake_checkout(tmp_path / "after"), fake_checkout(tmp_path / "before")
    calls = []

    def child(command, env):
        args = dict(zip(command[2::2], command[3::2]))
        calls.append((Path(args["--package"]).name, env["PYTHONPATH"].split(os.pathsep)[0], args["--sections"]))
        assert command[:2] == [bench.sys.executable, str(BENCHMARKS / "bench_h200.py")]
        out = Path(args["--out"])
        out.mkdir(parents=True)
        tpot = 3.9 if args["--package"] == str(current) else 4.0
        results = {"package": {"root": args["--package"]}, **bench_results(tpot=tpot, sections=("ours",))}
        (out / "bench.json").write_text(json.dumps(results))
        return SimpleNamespace(returncode=0)

    out = tmp_path / "ab"
    out.mkdir()
    rows = bench.compare_checkouts(current, baseline, "Qwen/Qwen3-8B", ["env", "ours"], 3, out, run=child)
    assert calls == [("after", str(current), "env,ours"), ("before", str(baseline), "env,ours"),
                     ("before", str(baseline), "env,ours"), ("after", str(current), "env,ours"),
                     ("after", str(current), "env,ours"), ("before", str(baseline), "env,ours")]
    assert sorted(p.name for p in out.iterdir()) == ["baseline-1", "baseline-2", "baseline-3", "comparison.json",
                                                     "current-1", "current-2", "current-3"]
    saved = json.loads((out / "comparison.json").read_text())
    assert saved["rounds"] == 3 and [p["root"] for p in saved["baseline"]] == [str(baseline)] * 3
    tpot = next(r for r in saved["rows"] if r["figure"] == "decode TPOT, context <= 512")
    assert (tpot["baseline"], tpot["current"]) == (4.0, 3.9) and tpot["change"] == pytest.approx(-0.025)
    assert "| decode TPOT, context <= 512 | ms | 4 | 3.9 | -2.5% |" in capsys.readouterr().out
    assert [r["figure"] for r in rows] == [r["figure"] for r in saved["rows"]]


def test_baseline_stops_with_one_line_when_a_child_fails(scripts, tmp_path):
    bench = scripts("bench_h200")
    current, baseline = fake_checkout(tmp_path / "after"), fake_checkout(tmp_path / "before")
    with pytest.raises(SystemExit, match=re.escape(f"the current run ({current}) failed with exit status 3")):
        bench.compare_checkouts(current, baseline, "m", ["ours"], 1, tmp_path,
                                run=lambda command, env: SimpleNamespace(returncode=3))


def test_package_info_names_the_commit_of_a_checkout_only(scripts, tmp_path):
    bench = scripts("bench_h200")
    plain = bench.package_info(fake_checkout(tmp_path / "exported"))  # e.g. from git archive: no commit to name
    assert plain == {"root": str(tmp_path / "exported"), "commit": None, "uncommitted_changes": None}
    if (ROOT / ".git").exists():  # a clone or a worktree
        info = bench.package_info(ROOT)
        assert re.fullmatch(r"[0-9a-f]{40}", info["commit"]) and isinstance(info["uncommitted_changes"], bool)


def test_clocks_by_phase_splits_samples_at_the_early_steps(scripts):
    """The bench's clock summary: samples before the EARLY_STEPS-th step's start are early, the rest after it,
    samples outside the decode are ignored, and throttle bits are named."""
    from llm_anatomy.probe.telemetry import RawSample

    bench = scripts("bench_h200")
    starts = [1000 + 10 * i for i in range(30)]  # step i starts at 1000 + 10 i ns; early ends at 1200

    def sample(t, mhz, watts, mask=0):
        return RawSample(t, watts * 1000, None, mhz, None, None, None, None, None, mask)

    samples = [sample(500, 100, 1), sample(1005, 1800, 600, 0x4), sample(1150, 1900, 650, 0x4),
               sample(1250, 1980, 200), sample(1400, 1980, 210), sample(1600, 1000, 1)]
    out = bench.clocks_by_phase(samples, starts, 1500)
    assert bench.EARLY_STEPS == 20
    assert out["early"] == {"samples": 2, "sm_mhz_median": 1850.0, "power_w_median": 625.0,
                            "throttle": ["sw_power_cap"]}
    assert out["rest"] == {"samples": 2, "sm_mhz_median": 1980.0, "power_w_median": 205.0, "throttle": []}
    short = bench.clocks_by_phase(samples, starts[:3], 1300)  # fewer steps than EARLY_STEPS: all early
    assert short["early"]["samples"] == 3 and short["rest"]["samples"] == 0
    empty = bench.clocks_by_phase([], starts, 1500)
    assert empty["early"]["sm_mhz_median"] is None and empty["rest"]["throttle"] == []


# ---- check_core.py ---------------------------------------------------------------------------------------------
@pytest.fixture
def tiny_checkpoint(save_tiny):
    directory, _ = save_tiny(initializer_range=0.2)
    return directory


def test_parity_with_hf_on_a_tiny_model(scripts, tiny_checkpoint):
    """In float32 the engine's tokens are HF's argmax and its log-probabilities HF's to rounding; in bfloat16 the
    engine is also compared with HF in float32, beside HF's own bfloat16 distance from float32."""
    from llm_anatomy import Engine

    check = scripts("check_core")
    cpu = torch.device("cpu")
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=256)
    case = check.parity(engine, torch.float32, cpu, prompt_tokens=24, decode_steps=6)
    assert (case["prompt_tokens"], case["output_tokens"], case["argmax_agreement_with_hf"]) == (24, 6, 1.0)
    assert set(case) == {"prompt_tokens", "output_tokens", "argmax_agreement_with_hf", "vs_hf"}
    assert max(case["vs_hf"].values()) < 1e-4
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype=torch.bfloat16, kv_cache_tokens=256)
    case = check.parity(engine, torch.bfloat16, cpu, prompt_tokens=24, decode_steps=6)
    assert {"vs_hf", "vs_fp32", "hf_vs_fp32"} <= set(case)
    assert 0 < case["vs_fp32"]["top20_logprob_abs_err_max"] < 0.1  # bf16 rounding, not a different model


def test_logprob_errors_against_a_reference(scripts):
    ref = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]]), dim=-1)
    ours = [(ref[0, 0].item() + 0.01, [(0, ref[0, 0].item() + 0.01), (1, ref[0, 1].item() - 0.02)]),
            (ref[1, 1].item(), [(1, ref[1, 1].item()), (2, ref[1, 2].item() + 0.005)])]
    check = scripts("check_core")
    errors = check.logprob_errors(ours, [0, 1], ref)
    assert errors["chosen_logprob_abs_err_mean"] == pytest.approx(0.005, abs=1e-6)
    assert errors["chosen_logprob_abs_err_max"] == pytest.approx(0.01, abs=1e-6)
    assert errors["top20_logprob_abs_err_max"] == pytest.approx(0.02, abs=1e-6)
    tokens, generated = check.as_generated(ref)
    assert tokens == [0, 1] and generated[1][1][:2] == [(1, pytest.approx(ref[1, 1].item())),
                                                        (2, pytest.approx(ref[1, 2].item()))]


@pytest.mark.parametrize("argv, message", [
    (["--cases", "512"], "argument --cases: want PROMPT:STEPS pairs"),
    (["--cases", "512:64,0:8"], "argument --cases: want PROMPT:STEPS pairs"),
    (["--kv-cache-tokens", "0"], "want a positive whole number, got '0'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice"),
    (["--out", str(BENCHMARKS)], "argument --out: want a file name"),
    (["--model", "nope", "--device", "cpu"], "unknown model 'nope'"),
])
def test_check_core_refuses_bad_input_with_one_line(scripts, capsys, argv, message):
    assert message in refused(scripts("check_core").main, argv, capsys)


def test_check_core_refuses_a_case_longer_than_the_model_before_any_case_runs(scripts, capsys, tiny_checkpoint):
    argv = ["--model", str(tiny_checkpoint), "--device", "cpu", "--dtype", "float32", "--cases", "16:4,600:8"]
    assert "exceeds the model's context of 512 tokens" in refused(scripts("check_core").main, argv, capsys)


# ---- serve_sweep.py --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--levels", "1,0,4"], "argument --levels: want comma-separated positive whole numbers, got '1,0,4'"),
    (["--levels", ""], "argument --levels:"),
    (["--port", "70000"], "argument --port: want a TCP port, 1..65535, got '70000'"),
    (["--requests-per-stream", "0"], "argument --requests-per-stream: want a positive whole number"),
    (["--requests-per-stream", "1e9"], "argument --requests-per-stream: want a positive whole number"),
    (["--shapes", "128/0"], "argument --shapes: want comma-separated PROMPT/OUTPUT token counts"),
    (["--shapes", "128"], "argument --shapes: want comma-separated PROMPT/OUTPUT token counts"),
    (["--shapes", "128/128,"], "argument --shapes: want comma-separated PROMPT/OUTPUT token counts"),
    (["--shapes", "-1/5"], "argument --shapes"),
    (["--anatomy-sample", "0"], "argument --anatomy-sample: want a positive whole number"),
    (["--client-processes", "0"], "argument --client-processes: want a positive whole number"),
    (["--client-processes", "2.5"], "argument --client-processes: want a positive whole number"),
    (["--bench-prompts", "-3"], "argument --bench-prompts"),
    (["--stream-interval", "x"], "argument --stream-interval: want a positive whole number"),
    (["--anatomy-processes", "0"], "argument --anatomy-processes: want a positive whole number"),
    (["--max-num-batched-tokens", "x"], "argument --max-num-batched-tokens: want a positive whole number"),
    (["--out", str(BENCHMARKS)], "argument --out: want a file name"),
    (["--model", "nope"], "unknown model 'nope'"),
    (["--client-cpus", "8-"], "argument --client-cpus: want CPUs as a list such as 0-7 or 0,2,8-11, got '8-'"),
    (["--client-cpus", "7-3"], "argument --client-cpus: want CPUs as a list"),
    (["--server-cpus", "0,,1"], "argument --server-cpus: want CPUs as a list"),
    (["--server-cpus", "-1"], "argument --server-cpus: want CPUs as a list"),
    (["--server-cpus", "1e3"], "argument --server-cpus: want CPUs as a list"),
    (["--server-cpus", "100000"], "argument --server-cpus: CPU 100000 is not one this process may run on"),
    (["--profile-seconds", "0"], "argument --profile-seconds: want a positive number, got '0'"),
    (["--profile-seconds", "nan"], "argument --profile-seconds: want a positive number"),
    (["--profile-seconds", "inf"], "argument --profile-seconds: want a positive number"),
    (["--profile-seconds", "x"], "argument --profile-seconds: want a positive number"),
    (["--profile-seconds", "31"], "argument --profile-seconds: want at most 30 s"),
    (["--max-waiting-tokens", "0"], "argument --max-waiting-tokens: want a positive whole number"),
    (["--max-waiting-tokens", "4", "--waiting-served-ratio", "-1"], "argument --waiting-served-ratio: want a number"),
    (["--max-waiting-tokens", "4", "--waiting-served-ratio", "nan"], "argument --waiting-served-ratio: want a number"),
    (["--waiting-served-ratio", "1.5"], "(--waiting-served-ratio) ends the wait"),
    (["--max-waiting-tokens", "8", "--mixed-steps"], "use one"),
])
def test_serve_sweep_refuses_bad_input_with_one_line(scripts, capsys, argv, message):
    assert message in refused(scripts("serve_sweep").main, argv, capsys)


# ---- host_overhead.py -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--batch-sizes", "0,64"], "argument --batch-sizes: want comma-separated positive whole numbers"),
    (["--batch-sizes", "64,"], "argument --batch-sizes"),
    (["--output-tokens", "0"], "argument --output-tokens: want a positive whole number"),
    (["--prompt-tokens", "1.5"], "argument --prompt-tokens: want a positive whole number"),
    (["--json", str(BENCHMARKS)], "argument --json: want a file name"),
])
def test_host_overhead_refuses_bad_input_with_one_line(scripts, capsys, argv, message):
    assert message in refused(scripts("host_overhead").main, argv, capsys)


def test_host_overhead_measures_each_part_at_each_batch_size(scripts, tmp_path, capsys):
    out = tmp_path / "host.json"
    scripts("host_overhead").main(["--batch-sizes", "1,3", "--prompt-tokens", "5", "--output-tokens", "4",
                                   "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["batch"] for r in rows] == [1, 3]
    parts = ("bare_engine_ms", "core_ms", "core_cpu_ms", "core_cpu_mean_ms", "ipc_send_ms", "ipc_kb", "ipc_recv_ms",
             "http_intake_ms", "http_loop_ms", "http_us_per_chunk", "http_reader_ms", "anatomy_ms_per_call",
             "anatomy_ms_per_step")
    assert all(r[p] > 0 for r in rows for p in parts)
    # every stream written whole through HTTP: a chunk per token whose text is whole (4 at most), the finish
    # reason's, the usage, [DONE] and the body's end
    assert all(4 <= r["http_chunks_per_stream"] <= 8 for r in rows)
    assert capsys.readouterr().out.splitlines()[-1].startswith("| 3 |")


def anatomy(ttft_ms: float, batch: int, started_at_unix: float = 0.0) -> dict:
    return {"started_at_unix": started_at_unix,
            "phases": [{"name": "queue", "start_ms": 1.0, "end_ms": 3.0}], "prefill": {"batch_size": 2, "ms": 10.0},
            "decode_steps": [{"batch_size": batch, "host_ms": 0.5, "gpu_ms": 4.0}] * 3, "ttft_ms": ttft_ms,
            "tpot_ms": 4.1, "batching": {"queue_ms": 2.0, "stall_ms": 0.0}, "decode": {"roofline": {"mbu": 0.8}}}


def test_serve_sweep_server_view_skips_anatomies_the_store_rotated_out(scripts, monkeypatch):
    sweep = scripts("serve_sweep")
    held = {"a": anatomy(10.0, 4), "c": anatomy(30.0, 8)}

    def get(url, timeout):
        found = held.get(url.rsplit("/", 1)[1])
        return SimpleNamespace(status_code=200 if found else 404, json=lambda: found, raise_for_status=lambda: None)

    monkeypatch.setattr(sweep.httpx, "get", get)
    view = sweep.server_view("http://server", [{"anatomy_id": i} for i in "abc"])
    assert (view["anatomies"], view["anatomies_missing"]) == (2, 1)
    assert view["ttft_ms_p50"] in (10.0, 30.0) and view["mean_batch"] == 6 and view["max_batch"] == 8
    assert view["phases_ms_p50"]["queue"] == 2.0 and view["phases_ms_p50"]["prefill"] == 0.0
    assert sweep.server_view("http://server", [{"anatomy_id": "b"}]) == {"anatomies": 0, "anatomies_missing": 1}
    last = sweep.server_view("http://server", [{"anatomy_id": i} for i in "abc"], sample=1)  # the level's last only
    assert (last["anatomies"], last["anatomies_missing"], last["ttft_ms_p50"]) == (1, 0, 30.0)
    assert "arrival_ms_p50" not in last  # records without a send time (and anatomies without a start): no split


def test_serve_sweep_gives_a_levels_tok_s_window_by_window(scripts):
    sweep = scripts("serve_sweep")
    tokens_at = [(100.5, 10), (104.9, 10), (105.0, 30), (109.0, 5), (110.5, 99)]  # 1 s into a third window: left out
    assert sweep.by_window(tokens_at, 100.0, seconds=5) == [4.0, 7.0]
    assert sweep.by_window([], 100.0) == [] and sweep.by_window([(101.0, 5)], 100.0, seconds=5) == []
    records = [{"stream": 0, "start": 100.0, "end": 104.0, "tokens": 4, "times": [101.0, 102.0, 103.0, 104.0]},
               {"stream": 1, "start": 100.5, "end": 111.0, "tokens": 2, "times": [106.0, 111.0]}]
    held = sweep.client_steady(records)
    assert held["window_s"] == sweep.WINDOW_S and held["tok_s_by_window"] == [0.8, 0.2]


def test_serve_sweep_samples_anatomies_across_the_level_not_its_drain(scripts):
    sweep = scripts("serve_sweep")
    records = list(range(10))
    # the first and last of the nine tenths of `held` the store surely holds, and between
    assert sweep.sampled(records, 3, held=10) == [1, 5, 9]
    assert sweep.sampled(records, None, held=7) == [4, 5, 6, 7, 8, 9]
    assert sweep.sampled(records, 20, held=100) == records and sweep.sampled(records, 1, held=6) == [9]
    assert sweep.sampled([], 3, held=6) == []


def test_serve_sweep_samples_the_calls_that_finished_last_not_the_last_streams(scripts, monkeypatch):
    """The clients return records stream by stream; the store holds the calls that finished last."""
    sweep = scripts("serve_sweep")
    asked = []

    def get(url, timeout):
        asked.append(url.rsplit("/", 1)[1])
        return SimpleNamespace(status_code=200, json=lambda: anatomy(10.0, 4), raise_for_status=lambda: None)

    monkeypatch.setattr(sweep.httpx, "get", get)
    # two streams of three calls each, stream 0's records first: the two that finished last are "a3" and "b3"
    records = [{"anatomy_id": f"{s}{n}", "end": 10.0 * n + (s == "b")} for s in "ab" for n in (1, 2, 3)]
    view = sweep.server_view("http://server", records, held=3)  # nine tenths of it: the last 2
    assert sorted(asked) == ["a3", "b3"] and view["anatomies"] == 2


def test_serve_sweep_splits_the_clients_ttft_around_the_servers(scripts, monkeypatch):
    """Client TTFT = arrival (send -> the server's first mark) + the server's TTFT + delivery, per request."""
    sweep = scripts("serve_sweep")
    held = {"a": anatomy(40.0, 4, started_at_unix=1000.120), "b": anatomy(60.0, 4, started_at_unix=2000.300)}
    monkeypatch.setattr(sweep.httpx, "get", lambda url, timeout: SimpleNamespace(
        status_code=200, json=lambda: held[url.rsplit("/", 1)[1]], raise_for_status=lambda: None))
    records = [{"anatomy_id": "a", "sent_unix": 1000.0, "ttft_s": 0.170},  # 120 + 40 + 10 ms
               {"anatomy_id": "b", "sent_unix": 2000.0, "ttft_s": 0.400}]  # 300 + 60 + 40 ms
    view = sweep.server_view("http://server", records)
    assert (view["arrival_ms_p50"], view["arrival_ms_p90"]) == (pytest.approx(120.0), pytest.approx(300.0))
    assert (view["delivery_ms_p50"], view["delivery_ms_p90"]) == (pytest.approx(10.0), pytest.approx(40.0))
    assert "client_send_ms_p50" not in view  # records without the client's hand-over: the arrival whole
    # the arrival split where the client handed each request to its connection: 20 + 100 ms and 250 + 50 ms
    records[0]["handed_unix"], records[1]["handed_unix"] = 1000.020, 2000.250
    view = sweep.server_view("http://server", records)
    assert (view["client_send_ms_p50"], view["client_send_ms_p90"]) == (pytest.approx(20.0), pytest.approx(250.0))
    assert (view["to_server_ms_p50"], view["to_server_ms_p90"]) == (pytest.approx(50.0), pytest.approx(100.0))


def test_serve_sweep_runs_the_product_bench_with_the_anatomy_join(scripts, server, tmp_path):
    """--bench-prompts: `llm-anatomy bench` in a process of its own at the largest level, with --anatomy: its
    figures and where the client's TTFT went beside the server's come back."""
    sweep = scripts("serve_sweep")
    server.behaviour = Behaviour(ttft_s=0.01, itl_s=0.005, chunks=3, anatomy=True)
    found = sweep.run_bench(server.url, SimpleNamespace(levels=[1, 2], shapes=[(4, 3)], bench_prompts=4),
                            tmp_path / "bench.json")
    assert found["exit"] == 0, found["stderr_tail"]
    assert found["requests"] == 4 and found["concurrency"] == 2 and found["anatomy"]["joined"] == 4
    assert 0 <= found["anatomy"]["arrival_ms"]["p50"] < 1000 and found["anatomy"]["delivery_ms"]["p50"] is not None
    assert found["anatomy"]["client_send_ms"]["p50"] >= 0 and found["anatomy"]["to_server_ms"]["p50"] is not None


def test_serve_sweep_level_splits_the_streams_over_client_processes(scripts, server, monkeypatch):
    """The closed loop's streams over --client-processes processes (never more than the streams): every request
    comes back once, with each process's CPU share while it ran."""
    sweep = scripts("serve_sweep")
    monkeypatch.setitem(sys.modules, "serve_sweep", sweep)  # the client processes import it by name
    server.behaviour = Behaviour(ttft_s=0.01, itl_s=0.005, chunks=3, anatomy=True)
    requests = [[1, 2, i] for i in range(6)]
    records, wall, busy, ran_on = sweep.run_level(server.url, "tiny", 3, requests, 3, processes=2)
    assert len(records) == 6 and all("error" not in r for r in records) and wall > 0
    assert ran_on == [sorted(os.sched_getaffinity(0))] * 2  # no --client-cpus: where the sweep may run
    # each request's body holds its own token ids as the prompt (sent through extra_body, as they are)
    assert sorted(b["prompt"] for b in server.bodies if "prompt" in b) == sorted(requests)
    assert sorted(r["stream"] for r in records) == [0, 0, 1, 1, 2, 2]
    assert len(busy) == 2 and all(0 <= b < 2 for b in busy)
    view = sweep.server_view(server.url, records)  # the fake's anatomies start when their requests arrived
    assert view["anatomies"] == 6 and 0 <= view["arrival_ms_p50"] < 1000
    # httpx's hook marked each request's hand-over to its connection, after its send and before its arrival
    assert all(r["sent_unix"] <= r["handed_unix"] for r in records)
    assert 0 <= view["client_send_ms_p50"] <= view["arrival_ms_p90"] and view["to_server_ms_p50"] is not None
    assert len(sweep.run_level(server.url, "tiny", 1, requests[:2], 3, processes=4)[2]) == 1
    one = {max(os.sched_getaffinity(0))}  # --client-cpus: each client process keeps to them
    records, _, _, ran_on = sweep.run_level(server.url, "tiny", 2, requests[:2], 3, processes=2, cpus=one)
    assert len(records) == 2 and ran_on == [sorted(one)] * 2


def test_serve_sweep_table(scripts):
    sweep = scripts("serve_sweep")
    level = {"shape": "512/256", "concurrency": 64, "output_tok_s": 5294.4, "bare_engine_tok_s": 6451.2,
             "all_tokens": True, "errors": 0, "ttft_ms": {50: 653.94, 90: 1558.87, 99: 1574.34},
             "tpot_ms": {50: 8.559, 90: 12.337, 99: 12.344}, "itl_ms": {50: 6.87, 90: 7.31, 99: 14.2047},
             "joules_per_output_token": 0.11631, "server": {"mean_batch": 50.04}}
    result = {"model": "Qwen/Qwen3-8B", "device": "NVIDIA H200", "server_start_s": 29.5,
              "levels": [level, {**level, "concurrency": 512, "bare_engine_tok_s": None, "errors": 3,
                                 "joules_per_output_token": None, "server": {}}],
              "anatomy_build_ms_mean": 15.39, "anatomies_dropped": 12.0, "kv_cache_usage_after": 0.0,
              "running_after": 0.0, "server_exit": -15,
              "bench": {"concurrency": 512, "num_prompts": 2000, "exit": 0, "output_tok_s": 14000.4,
                        "errors": {"count": 0, "reasons": {}}}}
    lines = sweep.render_levels(result).splitlines()
    assert lines[0] == "Qwen/Qwen3-8B, NVIDIA H200; server start 30 s"
    assert lines[3] == ("| 512/256 | 64 | 5294 | 6451 | 653.9 / 1558.9 / 1574.3 | 8.56 / 12.34 / 12.34 | 14.20 | "
                        "50.0 | 0.116 | True | -, - | - (- + -) / - / - |")  # written before the clients' CPU was kept
    result["levels"][1].update(client_processes=8, client_cpu_max=0.914,
                               server={"ttft_ms_p50": 67.04, "arrival_ms_p50": 12.25, "delivery_ms_p50": 448.0,
                                       "client_send_ms_p50": 2.04, "to_server_ms_p50": 10.1})
    lines = sweep.render_levels(result).splitlines()
    assert lines[4].startswith("| 512/256 | 512 | 5294 | - |")
    assert lines[4].endswith("| 14.20 | - | - | True | 8, 0.91 | 12.2 (2.0 + 10.1) / 67.0 / 448.0 |")
    assert lines[5] == "anatomy build (off the step loop): 15.4 ms per call on average; 12 dropped unbuilt"
    assert lines[7] == "llm-anatomy bench at 512 streams, 2000 prompts: exit 0, 14000 tok/s, errors 0"
    # the short table comes last: level, shape, engine (one batch, closed loop) and server tok/s, the ratios, the
    # steady part of both closed loops and their drains, errors, TTFT p50 / p99
    assert lines[-4].startswith("| level | shape | engine tok/s: one batch / closed loop | server tok/s |")
    assert lines[-2] == ("| 64 | 512/256 | 6451 / - | 5294 | 82%, - | - / - | - / - | - / - | - / - | 0 | "
                         "653.9 / 1574.3 |")
    assert lines[-1] == "| 512 | 512/256 | - / - | 5294 | -, - | - / - | - / - | - / - | - / - | 3 | 653.9 / 1574.3 |"
    result["levels"][0].update(engine_closed_loop_tok_s=5600.0, steady_tok_s=5500.4, drain_s=1.25,
                               engine_closed_loop_steady_tok_s=5700.0, engine_closed_loop_drain_s=0.5,
                               engine_steps_per_s=61.26, engine_closed_loop_steps_per_s=48.0,
                               tokens_per_step_mean=150.04, engine_closed_loop_tokens_per_step_mean=191.0)
    assert sweep.render_levels(result).splitlines()[-2] == (
        "| 64 | 512/256 | 6451 / 5600 | 5294 | 82%, 95% | 5500 / 5700 | 1.2 / 0.5 | 61.3 / 48.0 | 150.0 / 191.0 | 0 "
        "| 653.9 / 1574.3 |")
    # --profile-seconds: the windows' table after it, server / bare engine, a side without its window as "-"
    result["levels"][0]["profile"] = {
        "server": {"seconds": 5.02, "device": {"busy_share": 0.8912, "idle_in_gaps_ms": 420.4, "gaps": 311,
                                                "category_ms": {"gemm": 3001.2, "attention": 650.7}}},
        "engine": {"error": "HTTPStatusError: 404"}}
    lines = sweep.render_levels(result).splitlines()
    assert lines[-3].startswith("| level | shape | busy | idle in gaps ms (gaps) | window s |")
    assert lines[-1] == "| 64 | 512/256 | 89.1% / - | 420 (311) / - (-) | 5.0 / - | 3001 / - | 651 / - |"
    assert sweep.shapes_list("128/128, 512/256") == [(128, 128), (512, 256)]
    assert sweep.pct([], 50) is None and sweep.pct([3.0, 1.0, 2.0], 50) == 2.0


def test_serve_sweep_steady_window_is_where_every_stream_was_busy(scripts):
    """From the last stream's first send to the first stream's last answer; tokens outside it (the ramp before,
    the drain after) are left out, and the drain is the time after it."""
    steady = scripts("serve_sweep").steady
    found = steady([0.0, 1.0], [9.0, 5.0], [(0.5, 100), (1.0, 10), (3.0, 20), (5.0, 30), (7.0, 1000)])
    assert found == {"steady_s": 4.0, "steady_tok_s": 15.0, "drain_s": 4.0}
    assert steady([0.0, 6.0], [9.0, 5.0], [(5.5, 3)]) == {"steady_s": 0.0, "steady_tok_s": None, "drain_s": 4.0}


def test_serve_sweep_client_steady_counts_the_chunks_of_each_stream(scripts):
    sweep = scripts("serve_sweep")
    records = [{"stream": 0, "start": 0.0, "end": 2.0, "tokens": 4, "times": [1.0, 2.0]},  # 2 tokens a chunk
               {"stream": 0, "start": 2.0, "end": 6.0, "tokens": 2, "times": [3.0, 6.0]},
               {"stream": 1, "start": 0.5, "end": 4.0, "tokens": 3, "times": [1.5, 2.5, 4.0]},
               {"stream": 1, "start": 4.0, "end": 4.1, "error": "ReadError", "tokens": 0}]  # no chunks: no tokens
    # window 0.5 .. 4.1 (stream 1's last answer, failed): 2 + 2 + 1 + 1 + 1 + 1 tokens in 3.6 s
    assert sweep.client_steady(records) == {"steady_s": pytest.approx(3.6), "steady_tok_s": pytest.approx(8 / 3.6),
                                            "drain_s": pytest.approx(1.9), "window_s": sweep.WINDOW_S,
                                            "tok_s_by_window": [8 / sweep.WINDOW_S]}  # 0 .. 5 s: all but the 6 s chunk


def test_serve_sweep_engine_closed_loop_runs_each_streams_requests_in_turn(scripts, tiny_checkpoint):
    """The server's workload on the bare engine: every request decoded to its length, each stream's next one only
    after its last one ended."""
    from llm_anatomy import Engine

    sweep = scripts("serve_sweep")
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=256,
                                    max_num_seqs=4)
    added = []
    add = engine.add_request
    in_flight = lambda: len(engine.scheduler.running) + len(engine.scheduler.waiting)  # noqa: E731
    engine.add_request = lambda ids, params: added.append((ids[0], in_flight())) or add(ids, params)
    streams = sweep.closed_loop_streams([[i, 5, 6] for i in range(5)], 2)  # 0, 2, 4 and 1, 3
    found = sweep.engine_closed_loop(engine, streams, 3)
    assert [i for i, _ in added] == [0, 1, 2, 3, 4] and streams == [[[0, 5, 6], [2, 5, 6], [4, 5, 6]],
                                                                     [[1, 5, 6], [3, 5, 6]]]
    assert all(before <= 1 for _, before in added)  # the other stream's request at most: never 3 in flight
    assert found["output_tok_s"] == pytest.approx(5 * 3 / found["wall_s"])
    assert found["steady_s"] > 0 and found["steady_tok_s"] > 0 and found["drain_s"] >= 0
    # its steps, as the server's /metrics count them (iteration_tokens_total): counted by an observer here
    stepped = []
    engine.observers.append(SimpleNamespace(on_add=lambda *a: None, on_launch=lambda s: None,
                                            on_launched=lambda s: None, on_finish=lambda *a: None,
                                            on_step=lambda s: stepped.append(s.num_tokens)))
    found = sweep.engine_closed_loop(engine, sweep.closed_loop_streams([[i, 5, 6] for i in range(5)], 2), 3)
    assert found["engine_steps_per_s"] * found["wall_s"] == pytest.approx(len(stepped))
    assert found["tokens_per_step_mean"] == pytest.approx(sum(stepped) / len(stepped)) == 5 * (3 + 3 - 1) / len(stepped)


def test_serve_sweep_profiles_a_window_of_the_bare_engines_loop(scripts, tiny_checkpoint, tmp_path, monkeypatch):
    """--profile-seconds on the bare engine: the window opens PROFILE_DELAY_S in and its trace is written after the
    loop; the loop's figures come back as without it."""
    from llm_anatomy import Engine
    from llm_anatomy.probe.timeline import ProfileWindow

    sweep = scripts("serve_sweep")
    monkeypatch.setattr(sweep, "PROFILE_DELAY_S", 0.0)
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype=torch.float32, kv_cache_tokens=256,
                                    max_num_seqs=4)
    window = ProfileWindow(tmp_path / "profiles", engine.device, name="bare-test")
    found = sweep.engine_closed_loop(engine, sweep.closed_loop_streams([[i, 5, 6] for i in range(4)], 2), 3,
                                     (window, 60.0))
    assert found["output_tok_s"] == pytest.approx(4 * 3 / found["wall_s"])
    profile = found["profile"]
    assert profile["host_events"] > 0 and profile["device"] is None and 0 < profile["seconds"] <= found["wall_s"]
    assert (tmp_path / "profiles").is_dir() and profile["trace"].startswith(str(tmp_path / "profiles" / "bare-test"))
    assert "profile" not in sweep.engine_closed_loop(engine, [[[1, 5, 6]]], 2)


def test_serve_sweep_profile_of_a_server_without_one_says_why(scripts, server):
    import threading

    sweep = scripts("serve_sweep")
    out: dict = {}
    sweep.profile_server(server.url, 0.0, 0.01, out, threading.Event()).join(30)
    assert "404" in out["profile"]["error"]  # the fake has no /start_profile
    over = threading.Event()
    over.set()  # a level shorter than the delay: no window
    sweep.profile_server(server.url, 60.0, 1.0, out, over).join(5)
    assert out["profile"] == {"error": "the level ended within 60 s, before its window"}


def test_serve_sweep_profile_window_ends_with_its_level(scripts, server):
    import threading

    sweep = scripts("serve_sweep")
    server.behaviour = Behaviour(profiler="anatomy")
    out, over = {}, threading.Event()
    thread = sweep.profile_server(server.url, 0.0, 60.0, out, over)
    deadline = time.monotonic() + 10
    while not server.profiles:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    over.set()  # the level is over: the window closes now, not 60 s on
    thread.join(10)
    assert not thread.is_alive() and [a for a, _ in server.profiles] == ["start", "stop"]
    assert out["profile"]["trace"] == "/tmp/trace-2"
