"""`--dram`: Nsight Compute's CSV parsed, split at the marker kernel and set beside the cost model, on the CPU with
output in ncu's documented --csv format (one row per kernel launch and metric, after the application's own
output and ==PROF== lines); and a clear note, never a failure, where it cannot run."""

import json
import stat

import pytest
import torch

from llm_anatomy.anatomy import Anatomy, DramRecord
from llm_anatomy.models.config import ModelConfig
from llm_anatomy.probe.cost import DEFAULT_SHAPES, decode_cost, prefill_cost
from llm_anatomy.probe.dram import (DramReplay, KernelBytes, apply_dram, ncu_command, parse_ncu_csv, phase_record,
                                    split_at_marker)

from conftest import tiny_hf_config

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(launch: int, kernel: str, metric: str, unit: str, value: str) -> str:
    return (f'"{launch}","4242","python3","h200","{kernel}","1","7","(128, 1, 1)","(132, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


LAUNCHES = [  # kernel, read, write (bytes), as --print-units base prints them
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>"
     "(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, at::cuda::detail::TensorInfo<c10::BFloat16, unsigned "
     "int>, at::cuda::detail::TensorInfo<long, unsigned int>, int, int, unsigned int, unsigned int, long)",
     "16,826,368", "16,777,216"),
    ("_rmsnorm_kernel", "16,785,408", "0"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "168,165,376", "2,097,152"),
    ("_qk_norm_rope_store_kernel", "26,214,400", "7,340,032"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0",
     "25,165,824", "1,048,576"),
    ("_matmul_kernel", "396,361,728", "12,582,912"),
    ("_gemv_kernel", "1,245,708,288", "0"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", "607,744",
     "64"),
    ("at::cuda::(anonymous namespace)::spin_kernel(long)", "0", "0"),
    ("stream_gemv_kernel", "13,892,000,000", "65,536"),
    ("_decode_attention_split_kernel", "75,497,472", "9,437,184"),
    ("_decode_attention_merge_kernel", "9,437,184", "8,192"),
]


def ncu_output(launches=LAUNCHES) -> str:
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3.12)",
             "llm-anatomy: No local weights for Qwen/Qwen3-8B: running synthetic random weights", HEADER]
    for i, (kernel, read, write) in enumerate(launches):
        lines.append(row(i, kernel, "dram__bytes_read.sum", "byte", read))
        lines.append(row(i, kernel, "dram__bytes_write.sum", "byte", write))
    lines.append("==PROF== Disconnected from process 4242")
    return "\n".join(lines) + "\n"


def test_parse_the_csv_launch_by_launch():
    launches = parse_ncu_csv(ncu_output())
    assert len(launches) == len(LAUNCHES)
    assert [k.name for k in launches] == [k for k, _, _ in LAUNCHES]
    assert (launches[0].read, launches[0].write) == (16_826_368, 16_777_216)
    assert launches[9].read == 13_892_000_000


def test_units_and_other_metrics():
    text = "\n".join([HEADER, row(0, "k", "dram__bytes_read.sum", "Mbyte", "1,234.5"),
                      row(0, "k", "dram__bytes_write.sum", "Kbyte", "2"),
                      row(0, "k", "gpu__time_duration.sum", "nsecond", "5,000")])
    (k,) = parse_ncu_csv(text)
    assert (k.read, k.write) == (1_234_500_000, 2_000)


@pytest.mark.parametrize("text,message", [
    ("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters",
     "no CSV rows"),
    ('"ID","Kernel Name","Metric Name","Metric Value"\n"0","k","dram__bytes_read.sum","5"', "Metric Unit"),
    ("\n".join([HEADER, row(0, "k", "dram__bytes_read.sum", "furlong", "5")]), "unknown unit"),
    ("\n".join([HEADER, row(0, "k", "dram__bytes_read.sum", "byte", "n/a")]), "not a number"),
])
def test_bad_csv_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_ncu_csv(text)


def test_split_at_the_marker():
    prefill, decode = split_at_marker(parse_ncu_csv(ncu_output()))
    assert len(prefill) == 8 and len(decode) == 3 and decode[0].name == "stream_gemv_kernel"
    with pytest.raises(ValueError, match="found 0"):
        split_at_marker([KernelBytes("a"), KernelBytes("b")])
    with pytest.raises(ValueError, match="found 2"):
        split_at_marker([KernelBytes("spin_kernel(long)"), KernelBytes("x"), KernelBytes("spin_kernel(long)")])


def test_phase_record_by_category_beside_the_model():
    prefill, _ = split_at_marker(parse_ncu_csv(ncu_output()))
    modelled = {"gemm": 1.9e9, "norm": 16.8e6, "rope": 30e6, "attention": 25e6, "copy": 16.8e6, "sampling": 0.6e6,
                "activation": 0.0}
    phase = phase_record("prefill", 2048, 2048, prefill, modelled)
    cats = {c.category: c for c in phase.categories}
    assert cats["gemm"].kernels == 3 and cats["gemm"].read_bytes == 168_165_376 + 396_361_728 + 1_245_708_288
    assert cats["copy"].measured_bytes == 16_826_368 + 16_777_216 and cats["copy"].modelled_bytes == 16.8e6
    assert cats["sampling"].kernels == 1 and cats["rope"].kernels == 1 and cats["norm"].kernels == 1
    assert cats["activation"].kernels == 0 and cats["activation"].measured_bytes == 0  # modelled only
    assert phase.read_bytes == sum(k.read for k in prefill) and phase.write_bytes == sum(k.write for k in prefill)
    assert phase.modelled_bytes == sum(modelled.values())
    assert phase.top_kernels[0]["name"] == "_gemv_kernel" and phase.top_kernels[0]["category"] == "gemm"


def test_the_command_is_the_documented_one(tmp_path):
    cmd = ncu_command("/opt/ncu", tmp_path / "spec.json")
    text = " ".join(cmd)
    assert cmd[0] == "/opt/ncu" and "--metrics dram__bytes_read.sum,dram__bytes_write.sum" in text
    assert "--profile-from-start off" in text and "--clock-control none" in text and "--csv" in text
    assert cmd[-3:] == ["-m", "llm_anatomy.probe.dram", str(tmp_path / "spec.json")]


def replay(device_type="cuda", settings=None) -> DramReplay:
    config = ModelConfig.from_hf(tiny_hf_config().to_dict())
    return DramReplay(settings if settings is not None else {"model": "tiny", "kv_cache_tokens": 64},
                      list(range(12)), {"temperature": 0}, config, torch.bfloat16, DEFAULT_SHAPES, device_type)


def fake_ncu(tmp_path, body: str) -> str:
    path = tmp_path / "ncu"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_measure_through_a_fake_ncu(tmp_path):
    csv_path = tmp_path / "out.csv"
    csv_path.write_text(ncu_output())
    record = replay().measure(fake_ncu(tmp_path, f"cat {csv_path}\n"))
    assert record.available, record.note
    assert [p.phase for p in record.phases] == ["prefill", "decode"]
    config = ModelConfig.from_hf(tiny_hf_config().to_dict())
    assert record.phases[0].modelled_bytes == prefill_cost(config, torch.bfloat16, [(12, 0)]).bytes
    assert record.phases[1].modelled_bytes == decode_cost(config, torch.bfloat16, [13]).bytes
    assert record.phases[1].context_len == 13 and record.phases[0].tokens == 12
    assert "--profile-from-start off" in record.command and "SPEC.json" in record.command


@pytest.mark.parametrize("body,message", [
    ("echo '==ERROR== the profiler failed' >&2\nexit 3\n", "failed (exit 3): ==ERROR== the profiler failed"),
    ("echo 'no csv here'\n", "no CSV rows"),
    ("sleep 5\n", "took over"),
])
def test_a_failing_replay_is_a_note(tmp_path, body, message):
    record = replay().measure(fake_ncu(tmp_path, body), timeout_s=1.0)
    assert not record.available and message in record.note


def test_where_it_cannot_run(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no ncu
    assert "not on PATH" in replay().measure().note
    assert "ran on the host" in replay("cpu").measure().note
    assert "no EngineConfig" in DramReplay(None, [1], {}, None, None, DEFAULT_SHAPES, "cuda").measure("/opt/ncu").note


def test_apply_places_the_roofline_by_measured_bytes():
    from sample_anatomy import sample_anatomy

    a = sample_anatomy(batching=None)
    a.prefill.batch_size = 1
    prefill_line, decode_line = a.prefill.roofline, a.decode.roofline
    prefill, decode = split_at_marker(parse_ncu_csv(ncu_output()))
    phases = replay().phases(prefill, decode)
    apply_dram(a, DramRecord(True, "measured", "ncu ...", phases))
    assert prefill_line.dram_bytes == phases[0].measured_bytes
    assert prefill_line.dram_intensity == pytest.approx(prefill_line.flops / phases[0].measured_bytes)
    assert prefill_line.dram_gbps == pytest.approx(prefill_line.achieved_gbps * prefill_line.dram_bytes
                                                   / prefill_line.bytes)
    step = phases[1]
    assert decode_line.dram_bytes == pytest.approx(decode_line.bytes + a.decode.steps * (step.measured_bytes
                                                                                         - step.modelled_bytes))
    assert decode_line.dram_mbu == pytest.approx(decode_line.dram_gbps / a.ceilings.read_gbps)
    assert Anatomy.from_json(a.to_json()) == a


def test_apply_without_a_measurement_adds_its_note():
    from sample_anatomy import sample_anatomy

    a = sample_anatomy()
    apply_dram(a, DramRecord(False, "DRAM bytes not measured: Nsight Compute (ncu) is not on PATH"))
    assert a.prefill.roofline.dram_bytes is None and a.notes[-1].endswith("not on PATH")


def test_cli_dram_on_the_cpu_is_a_note(save_tiny, tmp_path, capsys):
    from llm_anatomy.cli import main

    directory, _ = save_tiny(vocab_size=151936)  # Qwen-sized vocabulary: the chat template's tokens exist
    code = main(["call", "hi", "--model", str(directory), "--device", "cpu", "--max-tokens", "3", "--no-calibrate",
                 "--dram", "--quiet", "--json", str(tmp_path / "a.json")])
    assert code == 0, capsys.readouterr().err
    d = json.loads((tmp_path / "a.json").read_text())
    assert d["dram"]["available"] is False and "ran on the host" in d["dram"]["note"]
    assert d["prefill"]["roofline"]["dram_bytes"] is None
