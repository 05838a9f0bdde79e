"""The H200 benchmark scripts' parts that need no GPU: the summary table, rendered from a results dict like the
one bench_h200.py writes, the probes' argument checks, and their kernels' correctness (under Triton's
interpreter)."""

import importlib.util
from pathlib import Path


import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def kernel_device():
    """The device the Triton kernels run on here (CUDA, or the CPU under TRITON_INTERPRET=1), else a skip."""
    pytest.importorskip("triton")
    from llm_anatomy.kernels import use_kernels

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not use_kernels(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    return device


@pytest.fixture
def probes(monkeypatch):
    """Loads a benchmarks/ script that imports its sibling scripts (bench_h200, ...)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return load_bench


def load_bench(name: str = "bench_h200"):
    path = BENCHMARKS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_render_tables_targets_ratios_and_protocol():
    bench = load_bench()
    results = {
        "ours": {"decode_ctx512": {"tpot_ms": 4.0, "floor_ms": 3.0}, "decode_ctx32k": {"tpot_ms": 6.0, "floor_ms": 4.5},
                 "prefill_2048_ms": 50.0, "prefill_2048_floor_ms": 40.0, "prefill_8192_ms": 190.0,
                 "prefill_8192_floor_ms": 171.0, "ttft_chat_prompt": {"ttft_ms": 9.0}},
        "hf": {"decode_step_ms_median": 40.0, "prefill_128_ms": 30.0, "prefill_2048_ms": 75.0, "prefill_8192_ms": 285.0},
        "overhead": {"overhead": 0.001},
        "protocol": {"30720": {"ours": {"tok_s": 2400.0, "peak_mib": 24767.0},
                               "hf_extrapolated": {"tok_s": 430.0, "decode_step_s_median": 0.036},
                               "published_h20_sglang_tok_s": 832.67, "published_h20_transformers_tok_s": 208.98}},
    }
    lines = bench.render_tables(results).splitlines()
    row = {line.split(" | ")[0].lstrip("| "): line for line in lines}
    assert row["decode TPOT, context <= 512"].endswith("| 4.00 ms | 40.00 ms | 10.00x | 3.00 ms | 75% | yes |")
    assert "| 36.00 ms | 6.00x |" in row["decode TPOT at 32k context"]  # HF's 32k step from the protocol run
    assert row["decode TPOT at 32k context"].endswith("| no |")
    assert row["prefill, 2048 tokens, back to back"].endswith("| 1.50x | 40.00 ms | 80% | no |")
    assert row["prefill, 8192 tokens, back to back"].endswith("| yes |")
    assert "prefill, 2048 tokens, each after 1 s idle (a call on a rested GPU)" not in row  # a run without it
    results["ours"] |= {"prefill_2048_rested_ms": 44.0}
    row = {line.split(" | ")[0].lstrip("| "): line
           for line in bench.render_tables(results).splitlines()}
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


def test_splitk_gemv_candidate_is_exact_and_leaves_its_counters_at_zero(kernel_device):
    device = kernel_device
    probe = load_bench("probe_gemv_splitk")
    errors = probe.check(device, torch.float32, {"small": (96, 1024)}, [(2, 16, 128, 3), (4, 32, 256, 3)])
    assert max(errors.values()) < 1e-4, errors  # run twice each: a counter left non-zero would corrupt the second
    assert all(int(c.abs().sum()) == 0 for c in probe._COUNTERS.values())


def test_bad_sections_and_lengths_are_refused_before_any_work(capsys, probes):
    bench = load_bench()
    for argv, message in ((["--sections", "ours,nope"], "unknown section nope"),
                          (["--sections", ","], "unknown section (none given)")):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert bench.section_list("env,ours") == ["env", "ours"]
    probe = probes("probe_new_length")
    for bad in ("10,x", "0", ""):
        with pytest.raises(SystemExit) as e:
            probe.main(["--lengths", bad])
        assert e.value.code == 2 and "positive token counts" in capsys.readouterr().err
    assert probe.prompt_lengths("1025,3001") == [1025, 3001]


def test_decode_probes_refuse_bad_arguments_before_any_work(capsys, probes):
    pytest.importorskip("triton")
    parts, attention = probes("probe_decode_parts"), probes("probe_decode_attention")
    overlap, blas = probes("probe_gemv_overlap"), probes("probe_blas")
    persistent, fused, spacer = probes("probe_persistent_mlp"), probes("probe_fused_mlp"), probes("probe_spacer")
    layout, stream_mlp, step = probes("probe_kv_layout"), probes("probe_stream_mlp"), probes("probe_decode_step")
    early, prefill_gemm = probes("probe_early_launch"), probes("probe_prefill_gemm")
    fusions, gaps = probes("probe_prefill_fusions"), probes("probe_prefill_gaps")
    stream = probes("probe_stream_gemv")
    for main, argv, message in (
            (stream.main, ["--sections", "step,nope"], "unknown section nope"),
            (stream.main, ["--variants", "engine,nope"], "unknown variant nope"),
            (stream.main, ["--contexts", "1000"], "unknown context 1000"),
            (stream.main, ["--splits", "33,0"], "want a positive whole number, got '0'"),
            (stream.main, ["--rounds", "0"], "want a positive whole number, got '0'"),
            (gaps.main, ["--sustained-lengths", "2048,0"], "positive token counts"),
            (gaps.main, ["--lengths", "2k"], "positive token counts"),
            (fusions.main, ["--sections", "residual,qkv"], "unknown section qkv"),
            (fusions.main, ["--eager", "2048"], "unknown token count 2048"),
            (early.main, ["--variants", "gemv,nope"], "unknown variant nope"),
            (early.main, ["--contexts", "1000"], "unknown context 1000; pick from 512,32768"),
            (prefill_gemm.main, ["--tokens", "3000"], "unknown token count 3000"),
            (prefill_gemm.main, ["--parts", "qkv,lm_head"], "unknown part lm_head"),
            (prefill_gemm.main, ["--engine-tokens", "512"], "unknown token count 512"),
            (step.main, ["--contexts", "512,40000"], "at most 33280 tokens"),
            (step.main, ["--contexts", "0"], "positive token counts"),
            (step.main, ["--skips", "1,4"], "unknown skip 4; pick from 1,2,3"),
            (step.main, ["--rounds", "0"], "want a positive whole number, got '0'"),
            (persistent.main, ["--layers", "0"], "want a positive whole number, got '0'"),
            (stream_mlp.main, ["--rounds", "0"], "want a positive whole number, got '0'"),
            (layout.main, ["--tiles", "engine,nope"], "unknown tile nope"),
            (fused.main, ["--layers", "-1"], "want a positive whole number, got '-1'"),
            (spacer.main, ["--rounds", "0"], "want a positive whole number, got '0'"),
            (layout.main, ["--rounds", "x"], "want a positive whole number, got 'x'"),
            (overlap.main, ["--sections", "chain,nope"], "unknown section nope"),
            (blas.main, ["--rounds", "0"], "want a positive whole number, got '0'"),
            (parts.main, ["--parts", "tiles,nope"], "unknown part nope; pick from knockout,tiles,prefill"),
            (parts.main, ["--rounds", "0"], "want a positive whole number, got '0'"),
            (attention.main, ["--variants", "engine,bn999"], "unknown variant bn999"),
            (attention.main, ["--contexts", "512,x"], "positive token counts"),
            (attention.main, ["--contexts", "40000"], "at most 36864 tokens")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err, argv


def test_early_launch_clones_compute_what_the_kernels_do_and_are_put_back(kernel_device, probes):
    """The probe's variants swap each kernel family for a clone with gdc_enter's halves in either order (PDL is
    off here, so the order cannot show): the norm's output is the same, and the engine's kernels return after."""
    early = probes("probe_early_launch")
    from llm_anatomy.kernels import gemv, norm

    kernels = (norm._rmsnorm_kernel, gemv._gemv_kernel)
    x, w = torch.randn(3, 64, device=kernel_device), torch.randn(64, device=kernel_device)
    clones = {}
    with early.early(["gemv"], clones):
        assert norm._rmsnorm_kernel is clones["norm", False] and gemv._gemv_kernel is clones["gemv", True]
        y = norm.rmsnorm(x, w, 1e-6)
    assert (norm._rmsnorm_kernel, gemv._gemv_kernel) == kernels
    assert torch.equal(y, norm.rmsnorm(x, w, 1e-6))


def test_overlap_probes_gemv_variants_compute_the_same_product(kernel_device, probes, monkeypatch):
    """The no-wait clone of the GEMV kernel (timing only on a GPU, where it skips the PDL wait) and the prefetch
    variants give F.linear's product where nothing runs before them; the tiles are restored afterwards."""
    import torch.nn.functional as F

    from llm_anatomy.kernels import gemv as gemv_module

    device, overlap = kernel_device, probes("probe_gemv_overlap")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 1024, generator=g).to(device), torch.randn(64, 1024, generator=g).to(device)
    key = gemv_module.tile_key(64, 1024, False, w.dtype)
    monkeypatch.setitem(gemv_module.TILES, key, gemv_module.Tile(16, 256, 4, 3))
    kernel = gemv_module._gemv_kernel
    for name, variant in overlap.variants().items():
        with variant:
            assert (gemv_module.gemv(x, w) - F.linear(x, w)).abs().max() < 1e-3, name
        assert gemv_module.TILES[key] == gemv_module.Tile(16, 256, 4, 3) and gemv_module._gemv_kernel is kernel


def test_persistent_mlp_probe_kernel_matches_torch(kernel_device, probes):
    """The persistent MLP kernel's layers, blocks and read-ahead tiles against torch (float32). Under the
    interpreter, programs run one after another, so one program does all the work (its barriers pass at once);
    the grid-wide barriers themselves are checked on the H200 against the engine's kernels (the probe's output)."""
    device, probe = kernel_device, probes("probe_persistent_mlp")
    for hidden, inter, layers, tile in (
            (32, 96, 2, dict(bn1=16, bk1=16, bn2=32, bk2=32, pre1=2, pre2=1, warps=4, stages=3)),
            (64, 256, 3, dict(bn1=32, bk1=32, bn2=64, bk2=64, pre1=1, pre2=2, warps=4, stages=3))):
        assert probe.check(device, hidden, inter, layers, 1, tile) < 1e-4
    with pytest.raises(AssertionError, match="read ahead within K"):
        probe.check(device, 32, 96, 1, 1, dict(bn1=16, bk1=32, bn2=32, bk2=32, pre1=2, pre2=1, warps=4, stages=3))


def test_fused_mlp_probe_kernel_matches_torch(kernel_device, probes):
    """The fused MLP kernel (gate_up, SiLU*up and its rows of down, added into an fp32 accumulator with atomics)
    and the norm that reads the accumulator and zeroes it, against torch (float32). On the H200 the probe also
    compares its output with the engine's kernels: programs of 64 or more rows were wrong there (see RESULTS.md),
    so this checks the 32-row tile the probe's numbers stand on, and a 16-row one."""
    device, probe = kernel_device, probes("probe_fused_mlp")
    g = torch.Generator().manual_seed(0)
    hidden, inter = 256, 128
    gate_up = (torch.randn(2 * inter, hidden, generator=g) / hidden ** 0.5).to(device)
    down = (torch.randn(hidden, inter, generator=g) / inter ** 0.5).to(device)
    x, residual = torch.randn(1, hidden, generator=g).to(device), torch.randn(1, hidden, generator=g).to(device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device)
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
    mlp = (torch.nn.functional.silu(gate) * up) @ down.T
    for tile in (dict(rows=32, bk=128, bh=128, warps=4, stages=3), dict(rows=16, bk=64, bh=256, warps=2, stages=4)):
        acc, res = torch.zeros(1, hidden, device=device), residual.clone()
        probe.fused_mlp(x, gate_up, down.T.contiguous(), acc, tile)
        assert ((acc - mlp).norm() / mlp.norm()).item() < 1e-5
        out = probe.add_norm_from_acc(acc, res, weight)
        want = torch.nn.functional.rms_norm(mlp + residual, (hidden,), weight, probe.EPS)
        assert ((out - want).norm() / want.norm()).item() < 1e-5
        assert torch.allclose(res, mlp + residual, atol=1e-5) and (acc == 0).all()


def test_clocks_by_phase_splits_samples_at_the_early_steps():
    """The bench's clock summary: samples before the EARLY_STEPS-th step's start are early, the rest after it,
    samples outside the decode are ignored, and throttle bits are named."""
    from llm_anatomy.probe.telemetry import RawSample

    bench = load_bench()
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


def test_kv_layout_probe_overrides_the_merge_warps_only_inside_its_block(probes):
    pytest.importorskip("triton")
    from llm_anatomy.kernels import decode_attention

    probe = probes("probe_kv_layout")
    with probe.merge_warps(1):
        assert decode_attention.merge_warps(64, 128) == 1
    with probe.merge_warps(None):  # the engine's rule
        assert decode_attention.merge_warps(64, 128) == 2
    assert decode_attention.merge_warps(64, 128) == 2 and decode_attention.merge_warps(16, 128) == 1
    with probe.merge_chunks(1):
        assert decode_attention.merge_chunks(32, 128, 132) == 1
    assert decode_attention.merge_chunks(32, 128, 132) == 2


def test_cuda_probes_sources_and_launch_structs(probes):
    """The CUDA C++ probes' sources come out of their templates whole, their shared memory fits a Hopper block
    (227 KB), and the launch structures mirror the driver's CUlaunchConfig and CUlaunchAttribute."""
    import ctypes

    pytest.importorskip("triton")
    from llm_anatomy.kernels import cuda as nvrtc

    chain, mlp = probes("probe_stream_chain"), probes("probe_stream_mlp")
    source = chain.SOURCE % {"K": 4096, "N": 6144, "ROWS": 4, "STAGES": 6, "MAX_GROUPS": 12, "WAIT": 1, "XS": 6144}
    assert "%(" not in source and "#define N 6144" in source and "it % STAGES" in source
    assert "%(" not in mlp.SOURCE and "#define I 12288" in mlp.SOURCE
    assert mlp.SMEM <= 227 * 1024 and mlp.SLOT_BYTES >= max(2 * mlp.GU_ROWS * 4096 * 2, 12288 * 2)
    assert ctypes.sizeof(nvrtc.LaunchAttribute) == 72 and nvrtc.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(nvrtc.LaunchConfig) == 56
    assert (nvrtc.LaunchConfig.stream.offset, nvrtc.LaunchConfig.attrs.offset, nvrtc.LaunchConfig.num_attrs.offset) \
        == (32, 40, 48)


def test_decode_step_kernel_source_and_shapes(probes):
    """The whole-step CUDA kernel's source comes out whole for Qwen3-8B (every option defined, the helpers' %
    escapes undone), fits a Hopper block's shared memory, and `supports` says why it does not run other shapes."""
    from llm_anatomy.hub import resolve
    from llm_anatomy.models.config import ModelConfig

    pytest.importorskip("triton")
    kernel = probes("decode_step_kernel")
    eight = ModelConfig.from_hf(resolve("Qwen/Qwen3-8B").config)
    source = kernel.source(eight.hidden_size, eight.q_size, eight.kv_size, eight.intermediate_size, skip=3)
    for define in ("#define H 4096", "#define I 12288", "#define KVD 1024", "#define SKIP 3", "#define TIMELINE 0",
                   "#define NO_WEIGHTS 0", "#define INTERLEAVE 0", f"#define EVENTS_PER_LAYER {len(kernel.EVENTS)}"):
        assert define in source
    assert "%%" not in source and "asm volatile(\"mbarrier.arrive.shared::cta.b64 _, [%0];\"" in source
    assert kernel.shared_bytes(eight.intermediate_size) <= 227 * 1024
    assert kernel.supports(eight, torch.bfloat16, torch.bfloat16) is None
    assert "bf16" in kernel.supports(eight, torch.float16, torch.bfloat16)
    small = ModelConfig.from_hf(resolve("Qwen/Qwen3-0.6B").config)
    assert "rows too short" in kernel.supports(small, torch.bfloat16, torch.bfloat16)
    fourteen = ModelConfig.from_hf(resolve("Qwen/Qwen3-14B").config)
    assert "too long" in kernel.supports(fourteen, torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="skip: 0, 1, 2 or 3"):  # before any work on the model or the device
        kernel.DecodeStepKernel(None, None, None, skip=4)
