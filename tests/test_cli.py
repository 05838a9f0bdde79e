"""The command line as a user meets it: every bad input is one line on stderr and exit status 2, before any model
loads; `report` refuses what is not an anatomy; a plain command prints no warning; the progress line shows only
on a terminal; `calibrate` answers from the cache, re-measures with --force and refuses to cache a busy device."""

import dataclasses
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from llm_anatomy import cli
from llm_anatomy.anatomy import SCHEMA_VERSION, Anatomy, Ceilings
from llm_anatomy.cli import main
from llm_anatomy.cli_types import INT64_MAX, INT64_MIN
from llm_anatomy.probe import ceilings as C

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from conftest import tiny_hf_model

    directory = tmp_path_factory.mktemp("cli") / "tiny"
    tiny_hf_model(initializer_range=0.2, vocab_size=151936).save_pretrained(directory)
    return directory


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if a model's weights start loading; returns the calls (none expected)."""
    from llm_anatomy.engine.engine import Engine

    calls = []

    def refuse(cls, *args, **kwargs):
        calls.append(args)
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(refuse))
    return calls


@pytest.fixture
def no_config_read(monkeypatch, no_loading):
    """Also fails the test if even the model's config is looked up: the flag alone was enough to refuse."""
    import llm_anatomy.hub

    def refuse(name):
        raise AssertionError("the model's config was read before the bad flag was refused")

    monkeypatch.setattr(llm_anatomy.hub, "resolve", refuse)
    return no_loading


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(code, err, message):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert message in lines[0] and "Traceback" not in err


def unwritable_dir(tmp_path) -> Path:
    """A directory no file can be created in: a read-only one, or where permission bits do not bind (root), /sys."""
    if os.geteuid() == 0:
        return Path("/sys")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return locked


# ---- call: refused while parsing, before even the config is read ---------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["call", ""], "prompt is empty"),
    (["call", "  \n"], "prompt is empty"),
    (["call", "hi", "--json", "/no/such/dir/a.json"], "--json names a directory that does not exist: /no/such/dir"),
    (["call", "hi", "--system", ""], "--system is empty"),
    (["call", "hi", "--stop", ""], "--stop is empty"),
    (["call", "hi", "--model", ""], "--model is empty"),
    (["call", "hi", "--weights", "/no/such/dir"], "--weights is not a directory"),
    (["call", "hi", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["call", "hi", "--max-tokens", "1e3"], "--max-tokens must be an integer, got '1e3'"),
    (["call", "hi", "--max-tokens", str(2**63)], "--max-tokens must be <= 9223372036854775807"),
    (["call", "hi", "--temperature", "-1"], "--temperature must be >= 0, got -1"),
    (["call", "hi", "--temperature", "nan"], "--temperature must be a finite number"),
    (["call", "hi", "--temperature", "inf"], "--temperature must be a finite number"),
    (["call", "hi", "--top-p", "0"], "--top-p must be in (0, 1], got 0"),
    (["call", "hi", "--quantization", "gptq"], "invalid choice: 'gptq'"),
    (["call", "hi", "--kv-cache-dtype", "fp4"], "invalid choice: 'fp4'"),
    (["call", "hi", "--quantize-lm-head"], "quantize_lm_head (--quantize-lm-head) needs quantization='fp8' "
                                           "(--quantization fp8)"),
    (["call", "hi", "--quantize-lm-head", "yes"], "unrecognized arguments: yes"),
    (["call", "hi", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["call", "hi", "--top-k", "-2"], "--top-k must be >= -1, got -2"),
    (["call", "hi", "--top-k", str(2**63)], "--top-k must be <= 9223372036854775807"),
    (["call", "hi", "--min-p", "1.01"], "--min-p must be in [0, 1], got 1.01"),
    (["call", "hi", "--min-p", "-0.1"], "--min-p must be in [0, 1], got -0.1"),
    (["call", "hi", "--presence-penalty", "3"], "--presence-penalty must be in [-2, 2], got 3"),
    (["call", "hi", "--frequency-penalty", "-2.5"], "--frequency-penalty must be in [-2, 2], got -2.5"),
    (["call", "hi", "--seed", str(2**64)], "--seed must be <= 9223372036854775807, got 18446744073709551616"),
    (["call", "hi", "--seed", str(-2**63 - 1)], "--seed must be >= -9223372036854775808"),
    (["call", "hi", "--seed", "1.5"], "--seed must be an integer, got '1.5'"),
    (["call", "hi", "--kv-cache-tokens", "0"], "--kv-cache-tokens must be >= 1, got 0"),
    (["call", "hi", "--max-tokens"], "--max-tokens: expected one argument"),
    (["call", "hi", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["call", "hi", "--temp", "0.5"], "unrecognized arguments: --temp"),  # a prefix is not a guess
    (["serve", "--max-num", "4"], "unrecognized arguments: --max-num"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "required: COMMAND"),
])
def test_bad_call_flags_are_refused_while_parsing(capsys, no_config_read, argv, message):
    code, out, err = run(capsys, *argv)
    assert_refused(code, err, message)
    assert out == "" and no_config_read == []


def test_output_paths_are_checked_before_the_call(capsys, tmp_path, no_config_read):
    code, _, err = run(capsys, "call", "hi", "--html", tmp_path)
    assert_refused(code, err, f"--html is a directory: {tmp_path}")
    code, _, err = run(capsys, "call", "hi", "--trace", unwritable_dir(tmp_path) / "t.json")
    assert_refused(code, err, "--trace cannot create a file in")
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run(capsys, "call", "hi", "--json", blocker / "a.json")
    assert_refused(code, err, f"--json is inside {blocker}, which is not a directory")
    code, _, err = run(capsys, "call", "hi", "--json", tmp_path / "a.json", "--html", tmp_path / "." / "a.json")
    assert_refused(code, err, "--html and --json name the same file")
    assert not list(tmp_path.glob(".llm-anatomy-check-*"))  # the writability probe leaves nothing behind


def test_a_missing_or_unreadable_messages_file(capsys, tmp_path, no_config_read):
    code, _, err = run(capsys, "call", "--messages", tmp_path / "missing.json")
    assert_refused(code, err, "--messages does not exist")
    code, _, err = run(capsys, "call", "--messages", tmp_path)
    assert_refused(code, err, "--messages is a directory")
    bad = tmp_path / "bad.json"
    for content, message in (("[{", "is not valid JSON"), ('[{"role": "user"}]', "messages[0].content is missing"),
                             ("[" * 100_000, "is not valid JSON")):
        bad.write_text(content)
        code, _, err = run(capsys, "call", "--messages", bad)
        assert_refused(code, err, message)
    bad.write_bytes(b"\xff\xfe[")
    code, _, err = run(capsys, "call", "--messages", bad)
    assert_refused(code, err, "is not UTF-8 text")


@pytest.mark.parametrize("argv", [
    ["--top-p", "1", "--min-p", "0", "--presence-penalty", "-2", "--frequency-penalty", "2", "--temperature", "0"],
    ["--seed", str(INT64_MIN), "--top-k", "-1"],
    ["--seed", str(INT64_MAX), "--top-k", "0", "--max-tokens", "1"],
])
def test_boundary_values_are_accepted(argv):
    args = cli.build_parser().parse_args(["call", "hi", *argv])
    for flag, value in zip(argv[::2], argv[1::2]):
        parsed = getattr(args, flag[2:].replace("-", "_"))
        assert parsed == (int(value) if isinstance(parsed, int) else float(value))


# ---- call: refused in the pre-flight, from the config and tokenizer alone ------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--top-k", "200000"], "--top-k 200000 is more than the vocabulary"),
    (["--kv-cache-tokens", "10"], "--kv-cache-tokens 10 cannot hold the prompt"),
    (["--max-tokens", "50000"], "exceeds the context"),
    (["--dtype", "int3"], "unknown dtype 'int3'"),
    (["--device", "cuda:7"], "cuda"),
    (["--raw-prompt", "--system", "x"], "--raw-prompt sends PROMPT as is"),
])
def test_bad_calls_are_refused_before_the_weights_load(capsys, checkpoint, no_loading, argv, message):
    if argv[:2] == ["--device", "cuda:7"] and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    code, _, err = run(capsys, "call", "hi", "--model", checkpoint, "--device", "cpu", *argv)
    assert_refused(code, err, message)
    assert no_loading == []


# ---- serve ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1"),
    (["--port", "65536"], "--port must be <= 65535"),
    (["--served-model-name", ""], "--served-model-name is empty"),
    (["--host", ""], "--host is empty"),
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key-file", "/no/such/keys"], "--api-key-file"),
    (["--stream-interval", "0"], "--stream-interval must be >= 1"),
    (["--quantization", "awq"], "invalid choice: 'awq'"),
    (["--kv-cache-dtype", "int4"], "invalid choice: 'int4'"),
    (["--quantize-lm-head", "--kv-cache-dtype", "fp8"], "quantize_lm_head (--quantize-lm-head) needs "
                                                         "quantization='fp8'"),
    (["--log-level", "loud"], "invalid choice: 'loud'"),
    (["--max-waiting-tokens", "-1"], "--max-waiting-tokens must be >= 0, got -1"),
    (["--max-waiting-tokens", "1000001"], "--max-waiting-tokens must be <= 1000000"),
    (["--max-waiting-tokens", "2.5"], "--max-waiting-tokens must be an integer"),
    (["--max-waiting-tokens", "4", "--waiting-served-ratio", "inf"], "--waiting-served-ratio must be a finite"),
    (["--max-waiting-tokens", "4", "--waiting-served-ratio", "-1"], "--waiting-served-ratio must be >= 0"),
    (["--waiting-served-ratio", "2"], "ends the wait that max_waiting_tokens (--max-waiting-tokens) sets"),
    (["--max-waiting-tokens", "4", "--mixed-steps"], "use one"),
])
def test_bad_serve_flags_are_refused_while_parsing(capsys, no_config_read, argv, message):
    code, _, err = run(capsys, "serve", "--device", "cpu", *argv)
    assert_refused(code, err, message)


@pytest.mark.parametrize("argv, message", [
    (["--max-model-len", "100000"], "--max-model-len 100000 is more than the context"),
    (["--dtype", "int3"], "unknown dtype 'int3'"),
    (["--gpu-memory-utilization", "0.5"], "cannot be used on the CPU"),
])
def test_bad_serve_settings_are_refused_before_the_weights_load(capsys, checkpoint, no_loading, argv, message):
    code, _, err = run(capsys, "serve", checkpoint, "--device", "cpu", "--no-calibrate", *argv)
    assert_refused(code, err, message)
    assert no_loading == []


def test_serve_run_dir_must_be_writable(capsys, tmp_path, no_config_read):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run(capsys, "serve", "--run-dir", blocker)
    assert_refused(code, err, f"--run-dir is not a directory: {blocker}")
    code, _, err = run(capsys, "serve", "--run-dir", unwritable_dir(tmp_path) / "runs")
    assert_refused(code, err, "--run-dir cannot create or write")
    args = cli.build_parser().parse_args(["serve", "--run-dir", str(tmp_path / "new" / "runs")])
    assert args.run_dir == tmp_path / "new" / "runs" and not args.run_dir.exists()  # created by the server


# ---- report --------------------------------------------------------------------------------------------------------
@pytest.fixture
def good_anatomy(tmp_path):
    from sample_anatomy import sample_cpu_anatomy

    path = tmp_path / "a.json"
    path.write_text(sample_cpu_anatomy().to_json())
    return path


def _edited(path: Path, edit) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    out = path.with_name("edited.json")
    out.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.__setitem__("schema_version", "99.0"), "schema_version 99.0, which this llm-anatomy does not read "
                                                         f"(it reads {SCHEMA_VERSION}): upgrade llm-anatomy"),
    (lambda d: d.__setitem__("schema_version", "0.1"), "run the call again"),
    (lambda d: d.__setitem__("schema_version", "one"), "is not an Anatomy JSON: schema_version is 'one'"),
    (lambda d: d.pop("schema_version"), "is not an Anatomy JSON: schema_version is None"),
    (lambda d: d.pop("prefill"), "is not an Anatomy JSON: prefill: Field required"),
    (lambda d: d.__setitem__("ttft_ms", "fast"), "is not an Anatomy JSON: ttft_ms: Input should be a valid number"),
    (lambda d: d["memory"].__setitem__("total", [1]), "is not an Anatomy JSON: memory.total:"),
    (lambda d: d.__setitem__("startup", {"total_s": 1.0}), "is not an Anatomy JSON: startup."),
])
def test_report_refuses_what_is_not_an_anatomy(capsys, good_anatomy, edit, message):
    code, out, err = run(capsys, "report", _edited(good_anatomy, edit))
    assert_refused(code, err, message)
    assert out == ""


@pytest.mark.parametrize("content, message", [
    (b"not json", "is not an Anatomy JSON: not valid JSON"),
    (b"[1, 2]", "it holds a list, not an object"),
    (b"\xff\xfe\x00", "it is not UTF-8 text"),
    (b"[" * 100_000, "is not an Anatomy JSON: not valid JSON"),
    (b"", "not valid JSON"),
])
def test_report_refuses_a_file_that_is_not_json(capsys, tmp_path, content, message):
    path = tmp_path / "x.json"
    path.write_bytes(content)
    code, _, err = run(capsys, "report", path)
    assert_refused(code, err, message)


def test_report_paths(capsys, tmp_path, good_anatomy):
    code, _, err = run(capsys, "report", tmp_path)
    assert_refused(code, err, "anatomy is a directory")
    code, _, err = run(capsys, "report", tmp_path / "missing.json")
    assert_refused(code, err, "anatomy does not exist")
    code, _, err = run(capsys, "report", good_anatomy, "--html", good_anatomy)
    assert_refused(code, err, "--html")
    assert "is the anatomy being read" in err
    assert json.loads(good_anatomy.read_text())  # not overwritten
    code, out, err = run(capsys, "report", good_anatomy, "--html", tmp_path / "a.html", "--quiet")
    assert code == 0 and out == "" and err.strip() == f"wrote html: {tmp_path / 'a.html'}"


# ---- as a process: one line, no traceback, nothing else ------------------------------------------------------------
def _process(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "llm_anatomy.cli", *map(str, argv)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_as_a_process_bad_input_is_one_line_and_status_2(tmp_path):
    (tmp_path / "x.json").write_text('{"schema_version": "9.0"}')
    for argv, message in ((["call", ""], "prompt is empty"),
                          (["call", "hi", "--json", tmp_path / "no" / "a.json"], "does not exist"),
                          (["call", "hi", "--seed", str(2**64)], "--seed must be <="),
                          (["report", tmp_path / "x.json"], "upgrade llm-anatomy"),
                          (["report", tmp_path], "anatomy is a directory")):
        done = _process(*argv)
        assert done.returncode == 2, done.stderr
        assert done.stdout == "" and len(done.stderr.splitlines()) == 1 and message in done.stderr, done.stderr


def test_a_plain_call_prints_no_warning(checkpoint, tmp_path):
    """What a call prints on stderr, when it is not a terminal, is the one line naming what it wrote."""
    done = _process("call", "hi", "--model", checkpoint, "--device", "cpu", "--dtype", "float32", "--max-tokens", "2",
                    "--no-calibrate", "--quiet", "--json", tmp_path / "a.json")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [f"wrote json: {tmp_path / 'a.json'}"]
    assert done.stdout == ""


def test_numpy_is_a_dependency():
    """Without numpy, importing torch warns "Failed to initialize NumPy" on every command."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps)


def test_every_flag_has_help():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"


# ---- progress ------------------------------------------------------------------------------------------------------
def _call_argv(checkpoint, tmp_path, *extra):
    return ["call", "hi", "--model", checkpoint, "--device", "cpu", "--dtype", "float32", "--max-tokens", "4",
            "--ignore-eos", "--no-calibrate", "--json", tmp_path / "a.json", *extra]


def test_progress_line_on_a_terminal_and_nothing_with_quiet(capsys, monkeypatch, checkpoint, tmp_path):
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich then takes stderr for a terminal
    code, _, err = run(capsys, *_call_argv(checkpoint, tmp_path))
    assert code == 0, err
    assert "prefill of" in err and "decode: " in err and "of at most 4 tokens" in err
    code, out, err = run(capsys, *_call_argv(checkpoint, tmp_path, "--quiet"))
    assert code == 0 and out == "" and err.strip() == f"wrote json: {tmp_path / 'a.json'}"


def test_no_progress_line_when_stderr_is_not_a_terminal(capsys, monkeypatch, checkpoint, tmp_path):
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("TTY_COMPATIBLE", "0")
    code, out, err = run(capsys, *_call_argv(checkpoint, tmp_path))
    assert code == 0 and "Timeline" in out
    assert err.strip() == f"wrote json: {tmp_path / 'a.json'}"


def test_the_call_observer_counts_tokens_and_leaves_the_engine_as_it_found_it():
    import io

    from rich.console import Console

    from llm_anatomy.engine.events import Step
    from llm_anatomy.progress import CallProgress, ProgressLine

    class FakeEngine:
        observers = ["recorder"]

    stream = io.StringIO()
    line = ProgressLine(console=Console(file=stream, force_terminal=True, width=100))
    engine = FakeEngine()
    with line.during_call(engine, prompt_tokens=1234, max_tokens=8):
        (observer,) = [o for o in engine.observers if isinstance(o, CallProgress)]
        observer.every_ns = 0  # redraw at every step
        observer.on_step(Step(0, True, [], [1234], [1234], 0, tokens=[42]))
        observer.on_step(Step(1, False, [], [1], [1235], 0, tokens=[43]))
    assert engine.observers == ["recorder"]
    assert "prefill of 1,234 tokens" in stream.getvalue() and "decode: 2 of at most 8 tokens" in stream.getvalue()

    quiet = ProgressLine(enabled=False, console=Console(file=io.StringIO(), force_terminal=True))
    with quiet.during_call(engine, 1, 1):
        assert engine.observers == ["recorder"]
    quiet.stage("loading")
    assert quiet.console.file.getvalue() == ""


def test_engine_start_up_stages_reach_the_progress_line(monkeypatch):
    """The engine's progress(stage) callback reaches the line's stage."""
    from llm_anatomy.engine.engine import Engine
    from llm_anatomy.progress import ProgressLine

    stages, seen = [], {}

    class Line(ProgressLine):
        def stage(self, text):
            stages.append(text)

    def with_progress(cls, name, device=None, dtype=None, weights="auto", *, seed=0, progress=None, **settings):
        seen.update(settings)
        progress("loading weights")
        progress("ready")
        return "engine"

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(with_progress))
    assert cli._load_engine("m", Line(enabled=False), device="cpu", kv_cache_tokens=8) == "engine"
    assert stages == ["loading weights", "ready"] and seen == {"kv_cache_tokens": 8}


# ---- calibrate -----------------------------------------------------------------------------------------------------
def _ceilings(read=20.0):
    from datetime import datetime, timezone

    return Ceilings(device="cpu: test", read_gbps=read, gemv_gbps=15.0, matmul_tflops=0.5, datasheet_gbps=None,
                    datasheet_tflops=None, measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    matmul_burst_tflops=0.6)


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """C.measure replaced by a queue of calibrations; the cache in tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    queue, calls = [], []

    def fake(device, quick=False, progress=None, **sizes):
        calls.append(quick)
        return queue.pop(0)

    monkeypatch.setattr(C, "measure", fake)
    return queue, calls


def test_calibrate_shows_the_cache_and_force_measures_again(capsys, measured):
    queue, calls = measured
    queue += [C.Calibration(_ceilings(20.0)), C.Calibration(_ceilings(30.0))]
    code, out, _ = run(capsys, "calibrate", "--device", "cpu")
    assert code == 0 and "read              20.0 GB/s" in out and "from the cache" not in out and calls == [False]
    code, out, _ = run(capsys, "calibrate", "--device", "cpu")
    assert code == 0 and "20.0 GB/s" in out and "from the cache" in out and "--force" in out and calls == [False]
    code, out, _ = run(capsys, "calibrate", "--device", "cpu", "--force")
    assert code == 0 and "30.0 GB/s" in out and calls == [False, False]
    assert "sustained" in out and "first 0.1 s" in out


def test_calibrate_on_a_busy_device_says_so_and_caches_nothing(capsys, caplog, measured):
    queue, calls = measured
    queue += [C.Calibration(_ceilings(2.0), busy=("1 other process(es) on the GPU (NVML)",)),
              C.Calibration(_ceilings(20.0))]
    code, out, err = run(capsys, "calibrate", "--device", "cpu", "--quick")
    assert code == 1
    assert "not cached: the device was busy (1 other process(es) on the GPU (NVML))" in out
    assert "was busy while calibrating" in caplog.text  # the warning (stderr, as a process)
    code, out, _ = run(capsys, "calibrate", "--device", "cpu", "--quick")
    assert code == 0 and "20.0 GB/s" in out and calls == [True, True]  # nothing was cached: measured again


def test_a_call_calibrates_when_nothing_is_cached_and_notes_a_busy_device(capsys, caplog, measured, checkpoint,
                                                                          tmp_path):
    queue, calls = measured
    queue += [C.Calibration(_ceilings(2.0), busy=("the read repeats disagree",)), C.Calibration(_ceilings(20.0))]
    argv = ["call", "hi", "--model", checkpoint, "--device", "cpu", "--dtype", "float32", "--max-tokens", "2",
            "--quiet", "--json", tmp_path / "a.json"]
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    a = Anatomy.from_json((tmp_path / "a.json").read_text())
    assert a.ceilings.read_gbps == 2.0 and any("measured while the device was busy" in n for n in a.notes)
    assert "the read repeats disagree" in caplog.text
    code, _, err = run(capsys, *argv)  # nothing cached: measured again, idle this time, and kept
    a = Anatomy.from_json((tmp_path / "a.json").read_text())
    assert code == 0 and a.ceilings.read_gbps == 20.0 and not any("busy" in n for n in a.notes)
    assert calls == [True, True] and C.cached_ceilings("cpu").read_gbps == 20.0


# ---- the memory census on the host ---------------------------------------------------------------------------------
def test_the_host_census_speaks_of_host_memory():
    from rich.console import Console
    from sample_anatomy import sample_cpu_anatomy

    from llm_anatomy.probe.memory import census, census_rows
    from llm_anatomy.report.terminal import render

    m = census(torch.device("cpu"), weights=1000, kv_pool=100)
    assert m.kind == "host" and "host RAM" in m.source
    rows = census_rows(m)
    assert sum(v for _, v in rows) == m.total
    assert not any("CUDA" in name or "GPU" in name or "allocator" in name for name, _ in rows)
    console = Console(record=True, width=200)
    render(dataclasses.replace(sample_cpu_anatomy(), memory=m), console)
    text = console.export_text()
    census_text = text[text.index("Memory census"):text.index("activation peak")]
    assert "CUDA" not in census_text and "rest of this process" in census_text and "available" in census_text


def test_quantize_lm_head_reaches_the_engine_of_call_and_serve(capsys, checkpoint, monkeypatch):
    """--quantize-lm-head is not accepted and dropped: call's engine and serve's engine spec get it."""
    import llm_anatomy.server.app
    from llm_anatomy.engine.engine import Engine

    class Stop(Exception):
        pass

    seen = {}

    def engine(cls, model, **settings):
        seen["call"] = settings
        raise Stop

    def server(spec, **kwargs):
        seen["serve"] = dict(spec.settings)
        raise Stop

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(engine))
    monkeypatch.setattr(llm_anatomy.server.app, "build_server", server)
    for argv in (["call", "hi", "--model", checkpoint, "--device", "cpu", "--no-calibrate"],
                 ["serve", checkpoint, "--device", "cpu", "--no-calibrate"]):
        with pytest.raises(Stop):
            main([str(a) for a in argv] + ["--quantization", "fp8", "--quantize-lm-head"])
    assert seen["call"]["quantization"] == "fp8" and seen["call"]["quantize_lm_head"] is True
    assert seen["serve"]["quantization"] == "fp8" and seen["serve"]["quantize_lm_head"] is True


def test_max_waiting_tokens_reaches_serves_engine(capsys, checkpoint, monkeypatch):
    """serve's --max-waiting-tokens and --waiting-served-ratio reach the engine spec (not accepted and dropped);
    left out, the engine's defaults (no wait)."""
    import llm_anatomy.server.app

    class Stop(Exception):
        pass

    seen = []

    def server(spec, **kwargs):
        seen.append(dict(spec.settings))
        raise Stop

    monkeypatch.setattr(llm_anatomy.server.app, "build_server", server)
    base = ["serve", str(checkpoint), "--device", "cpu", "--no-calibrate"]
    for extra in (["--max-waiting-tokens", "20", "--waiting-served-ratio", "0.5"], []):
        with pytest.raises(Stop):
            main(base + extra)
    assert seen[0]["max_waiting_tokens"] == 20 and seen[0]["waiting_served_ratio"] == 0.5
    assert seen[1]["max_waiting_tokens"] == 0 and seen[1]["waiting_served_ratio"] is None
