"""The streaming batch-1 GEMV (CUDA C++ through NVRTC): against float32 products and the Triton GEMV, the same
bits every run, and chained inside a CUDA graph with programmatic dependent launch. CUDA only, but for `supports`."""

import pytest
import torch

from llm_anatomy.kernels import stream_gemv as sg

cuda = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                          reason="needs a Hopper-or-later CUDA device")


def reference(x, w, gated):
    y = x.float() @ w.float().T
    if not gated:
        return y
    n = w.shape[0] // 2
    gate, up = y[:, :n].bfloat16().float(), y[:, n:].bfloat16().float()
    return torch.nn.functional.silu(gate).bfloat16().float() * up


def test_supports_only_single_bf16_rows_on_cuda():
    w = torch.zeros(64, 2048, dtype=torch.bfloat16)
    assert not sg.supports(torch.zeros(1, 2048, dtype=torch.bfloat16), w, False)  # CPU tensors


def test_plan_fits_a_hopper_block_and_stages_are_whole():
    for n, k, gated in ((6144, 4096, False), (12288, 4096, True), (4096, 12288, False), (151936, 4096, False),
                        (2560, 2560, False), (9728, 2560, True), (5120, 25600, False), (151936, 2560, False)):
        for weight_bytes in (2, 1):  # bf16, fp8
            stages, shared = sg.plan(n, k, gated, 132, weight_bytes)
            rows = sg.rows_per_stage(n, k, gated, weight_bytes)
            assert stages >= 2 and shared <= sg.SHARED_LIMIT and n % rows == 0
            assert rows * k * weight_bytes * (2 if gated else 1) <= sg.STAGE_BYTES[weight_bytes] or rows == 1
    assert sg.rows_per_stage(4096, 4096, False) == 4 and sg.rows_per_stage(12288, 4096, True) == 2
    assert sg.rows_per_stage(4096, 4096, False, 1) == 16 and sg.rows_per_stage(4096, 12288, False, 1) == 4
    assert sg.rows_per_stage(2560, 2560, False) == 5  # 6 fit, 5 divide
    for n, k in ((6144, 4096), (6144, 2560), (7168, 5120)):  # Qwen3-8B's, 4B's and 14B's qkv
        # fp8 qkv's ring before the attention: at least two stages, and the attention kernel's 36 KB beside it
        stages, shared = sg.plan(n, k, False, 132, 1, sg.RING_BEFORE_ATTENTION)
        assert stages >= 2 and shared + 1024 + 36 * 1024 + 1024 <= 228 * 1024


def test_a_stage_is_read_in_whole_16_byte_copies():
    """A stage's half goes in COPIES bulk copies where each is a whole number of 16-byte pieces (Qwen3's shapes),
    else in one (a bulk copy takes nothing else): 5 rows of 2056 bf16 columns are 20,560 bytes, not 4 x 16 x n."""
    for n, k, gated in ((6144, 4096, False), (12288, 4096, True), (4096, 12288, False), (151936, 4096, False),
                        (2560, 2560, False), (9728, 2560, True), (2055, 2056, False)):
        for weight_bytes in (2, 1) if sg.mma_layout(n, k, gated) else (2,):
            half = sg.rows_per_stage(n, k, gated, weight_bytes) * k * weight_bytes
            copies = sg.copies(half)
            assert half % (16 * copies) == 0
            assert copies == (1 if (n, k) == (2055, 2056) else sg.COPIES), (n, k, weight_bytes)
            assert f"#define COPIES {copies}" in sg.source(n, k, gated, weight_bytes=weight_bytes)


@pytest.fixture
def streaming():
    assert sg.available(torch.device("cuda"))


@cuda
@pytest.mark.gpu
# Qwen3-8B's shapes but the LM head, and the family's K not a multiple of the consumers' 2048 (4B: 2560, 9728; 14B:
# 17408), with rows that a stage's most does not divide
@pytest.mark.parametrize("n,k,gated", [(2048, 2048, False), (6144, 4096, False), (3072, 2048, True),
                                       (2048, 6144, False), (151936, 2048, False), (2560, 2560, False),
                                       (9728, 2560, True), (2560, 9728, False), (5120, 17408, False)])
def test_matches_float32_and_triton(n, k, gated, streaming):
    from llm_anatomy.kernels import gemv

    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(2 * n if gated else n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    assert sg.supports(x, w, gated)
    y = sg.stream_gemv(x, w, gated)
    ref = reference(x, w, gated)
    assert y.shape == (1, n) and y.dtype == torch.bfloat16
    assert ((y.float() - ref).norm() / ref.norm()).item() < 4e-3
    triton_y = gemv.gemv(x, w, gated, tile=gemv.DEFAULT_TILE[2])
    assert (y.float() - triton_y.float()).abs().max().item() <= 0.02 * ref.abs().max().item()
    assert torch.equal(sg.stream_gemv(x, w, gated), y)  # partial sums added in a fixed order


@cuda
@pytest.mark.gpu
def test_a_stage_in_one_copy_matches_float32(streaming):
    """5 rows of 2056 columns a stage: read by one bulk copy (copies), not COPIES (the Triton GEMV takes no such K)."""
    n, k = 2055, 2056
    assert sg.copies(sg.rows_per_stage(n, k, False) * k * 2) == 1
    g = torch.Generator(device="cuda").manual_seed(7)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    assert sg.supports(x, w, False)
    ref = reference(x, w, False)
    assert ((sg.stream_gemv(x, w).float() - ref).norm() / ref.norm()).item() < 4e-3


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (12288, 4096, True), (9728, 2560, True)])
def test_norm_in_the_gemv_matches_the_norm_kernel_then_the_gemv(n, k, gated, streaming):
    """With `norm`, the GEMV adds x to the residual stream, writes the new stream (the residual given is left
    alone) and multiplies RMSNorm(stream) * weight, as the Triton norm kernel followed by the plain GEMV does."""
    from llm_anatomy.kernels import norm

    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(2 * n if gated else n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    residual = (4 * torch.randn(1, k, device="cuda", generator=g)).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    before, new_residual = residual.clone(), torch.full_like(residual, float("nan"))
    assert sg.supports_norm(x, residual, norm_weight)
    y = sg.stream_gemv(x, w, gated, norm=(residual, new_residual, norm_weight, 1e-6))
    stream = residual.clone()
    normed = norm.rmsnorm(x, norm_weight, 1e-6, residual=stream)
    assert torch.equal(residual, before) and torch.equal(new_residual, stream)
    ref = reference(normed, w, gated)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 4e-3
    # the norm's sum of squares in another order than the Triton kernel's may round a few inputs the other way
    assert (y != sg.stream_gemv(normed, w, gated)).float().mean().item() < 0.02
    assert torch.equal(sg.stream_gemv(x, w, gated, norm=(residual, new_residual, norm_weight, 1e-6)), y)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_the_first_layers_gemv_gathers_its_row_of_the_table(fp8, streaming):
    """With x_row, x is a table (the embedding) and the input its row x_row[0]; with no residual stream yet
    (norm's residual None) the GEMV normalises that row, writes it as the new stream and multiplies: the same bits
    as the row given itself over a stream of zeros (x + 0 is x)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    n, k = 6144, 4096
    table = torch.randn(300, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    w, scale = quantize_rows(w.float()) if fp8 else (w, None)
    norm_weight = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    row = torch.tensor([217], device="cuda")
    stream, stream_ref = (torch.full((1, k), float("nan"), device="cuda").bfloat16(),
                          torch.empty(1, k, device="cuda").bfloat16())
    y = sg.stream_gemv(table, w, norm=(None, stream, norm_weight, 1e-6), scale=scale, x_row=row)
    want = sg.stream_gemv(table[217:218].clone(), w, norm=(torch.zeros(1, k, device="cuda").bfloat16(), stream_ref,
                                                           norm_weight, 1e-6), scale=scale)
    assert torch.equal(y, want) and torch.equal(stream, table[217:218])
    row.fill_(3)  # read on the device at each launch
    assert torch.equal(sg.stream_gemv(table, w, norm=(None, stream, norm_weight, 1e-6), scale=scale, x_row=row),
                       sg.stream_gemv(table[3:4].clone(), w, norm=(torch.zeros_like(stream), stream_ref, norm_weight,
                                                                   1e-6), scale=scale))
    with pytest.raises(ValueError, match="first layer"):
        sg.stream_gemv(table[:1], w, norm=(None, stream, norm_weight, 1e-6), scale=scale)
    with pytest.raises(ValueError, match="int64"):
        sg.stream_gemv(table, w, norm=(None, stream, norm_weight, 1e-6), scale=scale, x_row=row.int())


@cuda
@pytest.mark.gpu
def test_chain_in_a_cuda_graph_with_pdl(streaming):
    """Each product waits for the one before (its producer reads weights early, its consumers read x late)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    ws = [(torch.randn(2048, 2048, device="cuda", generator=g) / 2048 ** 0.5).bfloat16() for _ in range(8)]
    x0 = torch.randn(1, 2048, device="cuda", generator=g).bfloat16()

    def chain():
        x = x0
        for w in ws:
            x = sg.stream_gemv(x, w, pdl=True)
        return x

    eager = chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    ref = x0.float()
    for w in ws:
        ref = (ref @ w.float().T).bfloat16().float()
    assert ((eager.float() - ref).norm() / ref.norm()).item() < 2e-2


@cuda
@pytest.mark.gpu
def test_engine_decode_with_streaming_gemvs_matches_triton(save_tiny, tmp_path, monkeypatch):
    """A bf16 model whose every decode GEMV streams (K multiples of 2048), the norms before qkv and gate_up inside
    them (the engine's plan) or not (the same plan without norm_in_gemv, eager): the same greedy tokens and logits
    within bf16 rounding of the engine with the Triton GEMV at batch 1, graphs and programmatic launch on."""
    from dataclasses import replace

    from llm_anatomy import Engine
    from llm_anatomy.engine.runner import ModelRunner

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # tiles tuned here stay here
    normed_launches = []
    real = sg.stream_gemv
    monkeypatch.setattr(sg, "stream_gemv", lambda *a, **kw: normed_launches.append(kw.get("norm") is not None)
                        or real(*a, **kw))
    directory, _ = save_tiny(hidden_size=2048, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4,
                             head_dim=128, num_hidden_layers=2, vocab_size=4096, initializer_range=0.02, shard=None)
    out, launches = {}, {}
    engines = {}
    for streaming in (True, False):  # graph capture runs the Python of every decode step: its launches count
        normed_launches.clear()
        engines[streaming] = Engine.from_pretrained(directory, device="cuda", dtype=torch.bfloat16,
                                                    kv_cache_tokens=512, max_num_seqs=2, stream_gemv=streaming)
        launches["fused" if streaming else "triton"] = list(normed_launches)
    assert engines[True].plan.stream_gemv and engines[True].plan.norm_in_gemv and not engines[False].plan.stream_gemv
    apart = engines[True]
    variants = {"fused": engines[True], "triton": engines[False], "norms apart": apart}
    for name, engine in variants.items():
        runner = engine.runner
        if name == "norms apart":  # eager: every step's launches run in Python
            runner = ModelRunner(engine.model, engine.pool, engine.device, replace(engine.plan, norm_in_gemv=False))
            monkeypatch.setattr(engine, "runner", runner)
        rows = []
        run = runner.run
        monkeypatch.setattr(runner, "run", lambda batch, ahead=None, run=run, rows=rows:
                            rows.append(run(batch, ahead).clone()) or rows[-1])
        monkeypatch.setattr(runner, "run_greedy", lambda batch, ahead=None: None)  # every step's logits through run
        normed_launches.clear()
        tokens = engine.generate_many([[5, 9, 2, 7, 1, 3]], temperature=0, max_tokens=12, ignore_eos=True)
        out[name] = torch.cat(rows), tokens[0].output_token_ids
        if name == "norms apart":
            launches[name] = list(normed_launches)
    assert out["fused"][1] == out["triton"][1] == out["norms apart"][1]
    assert any(launches["fused"]) and launches["norms apart"] and not any(launches["norms apart"])
    assert not launches["triton"]
    for name in ("fused", "norms apart"):
        a, b = out[name][0], out["triton"][0]
        assert ((a - b).norm() / b.norm()).item() < 2e-2, name


def test_the_first_layers_pending_norm_gathers_and_norms_by_itself_where_no_gemv_takes_it():
    """The first layer's PendingNorm (the embedding's row, no residual stream yet) for a product the streaming GEMV
    does not take: the gather, then the norm kernel; the row becomes the residual stream."""
    pytest.importorskip("triton")
    from llm_anatomy.engine.plan import ExecutionPlan
    from llm_anatomy.kernels import use_kernels
    from llm_anatomy.models.qwen3 import PendingNorm, RMSNorm

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not use_kernels(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(5)
    table = torch.randn(50, 64, generator=g).to(device)
    layernorm = RMSNorm(64, 1e-6).to(device)
    with torch.no_grad():
        layernorm.weight.copy_(1 + 0.1 * torch.randn(64, generator=g))
    stream = torch.full((1, 64), float("nan"), device=device)
    pending = PendingNorm(table, None, layernorm, stream, row=torch.tensor([31], device=device))
    out = pending.normed(ExecutionPlan(kernels=True))
    assert torch.equal(stream, table[31:32])
    assert torch.allclose(out, layernorm(table[31:32]), atol=1e-5)


def test_fp8_stages_hold_twice_the_rows():
    """fp8 weights are half the bytes: a stage holds twice the rows of bf16 ones, and K must come in 16 weights."""
    for n, k, gated in ((6144, 4096, False), (12288, 4096, True), (4096, 12288, False), (151936, 4096, False)):
        stages, shared = sg.plan(n, k, gated, 132, weight_bytes=1)
        assert stages >= 2 and shared <= sg.SHARED_LIMIT
        assert sg.rows_per_stage(n, k, gated, 1) >= 2 * sg.rows_per_stage(n, k, gated) or n % 2
    assert "#define FP8 1" in sg.source(4096, 4096, False, weight_bytes=1)
    assert "#define FP8 0" in sg.source(4096, 4096, False)


def test_fp8_tensor_core_layout_fits_the_qwen3_family():
    """Every decoder-layer product of Qwen3 1.7B-32B (K >= 2048) fits the tensor cores' layout: a stage's rows of
    each half times the pieces of K make the MMA's 16 rows, pieces in whole 128-byte windows, at most 8 windows a
    warp; a K that does not come in 128-byte pieces has no layout, and the streaming GEMV refuses it."""
    import json
    from importlib.resources import files

    configs = json.loads(files("llm_anatomy").joinpath("data/qwen3_configs.json").read_text())
    seen = 0
    for name, c in configs.items():
        if name.startswith("_") or c["hidden_size"] < sg.MIN_K:
            continue
        h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
        q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
        for n, k, gated in ((q + 2 * kv, h, False), (h, q, False), (i, h, True), (h, i, False)):
            rows, segs, windows = sg.mma_layout(n, k, gated)
            assert rows * (2 if gated else 1) * segs == 16 and n % rows == 0, (name, n, k)
            assert k % (segs * 128) == 0 and windows <= 8 and sg.plan(n, k, gated, 132, 1)[0] >= 2
            seen += 1
    assert seen == 20
    assert sg.mma_layout(4096, 4096 + 64, False) is None
    with pytest.raises(ValueError, match="tensor cores"):
        sg.rows_per_stage(4096, 4096 + 64, False, 1)


def quantize_rows(w):
    """w [N, K] -> (float8 e4m3 weights, float32 scale per row): each row's largest magnitude maps to 448."""
    scale = (w.float().abs().amax(1) / 448.0).clamp(min=1e-12)
    return (w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (12288, 4096, True), (4096, 12288, False),
                                       (2560, 2560, False), (9728, 2560, True)])
@pytest.mark.parametrize("normed", [False, True])
def test_fp8_weights_match_their_dequantized_product(n, k, gated, normed, streaming):
    """fp8 weights with a scale per row: the product (and SiLU*up, and the norm before it) equals x times the
    dequantized weights in float32, rounded as the bf16 kernel rounds; on the tensor cores (mma_layout) x is first
    quantized per token exactly as fp8_quant.quantize_rows quantizes it (W8A8), elsewhere it stays bf16."""
    from llm_anatomy.kernels.fp8_quant import quantize_rows_reference

    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(2 * n if gated else n, k, device="cuda", generator=g) / k ** 0.5
    w8, scale = quantize_rows(w)
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    norm = None
    x_ref = x
    if normed:
        residual = torch.randn(1, k, device="cuda", generator=g).bfloat16()
        norm_weight = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16()
        new_residual = torch.empty_like(residual)
        norm = (residual, new_residual, norm_weight, 1e-6)
        summed = (x.float() + residual.float()).bfloat16().float()
        x_ref = ((summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16().float()
                 * norm_weight.float()).bfloat16()
    y = sg.stream_gemv(x, w8, gated, norm=norm, scale=scale)
    deq = w8.float() * scale[:, None]
    if sg.mma_layout(n, k, gated) is not None:
        xq, x_scale = quantize_rows_reference(x_ref)
        x_ref = xq.float() * x_scale
    want = reference(x_ref, deq, gated)
    assert y.dtype == torch.bfloat16 and y.shape == (1, n)
    assert ((y.float() - want).norm() / want.norm()).item() < 1e-2
    assert torch.equal(sg.stream_gemv(x, w8, gated, norm=norm, scale=scale), y)  # the same bits every run
    if normed:  # the residual stream's new copy is written anew
        new_residual.zero_()
    # qkv's smaller ring before the attention: the same sums, the same bits
    assert torch.equal(sg.stream_gemv(x, w8, gated, norm=norm, scale=scale, before_attention=True), y)
    if normed:
        assert torch.equal(new_residual, summed.bfloat16())
    with pytest.raises(ValueError, match="per-row scale"):
        sg.stream_gemv(x, w8, gated)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (12288, 4096, True), (4096, 12288, False),
                                       (5120, 17408, False), (151936, 4096, False)])  # the last: an fp8 lm_head
def test_fp8_tensor_cores_agree_with_the_w8a8_gemv(n, k, gated, streaming):
    """The streaming GEMV on the tensor cores and the 2-16-row W8A8 Triton GEMV take the same quantized operands:
    x quantized per token as quantize_rows does (an x of hostile magnitudes: zeros, a huge value, values
    that land on 448 and below e4m3's smallest normal), and the products agree to float32 summation order."""
    from llm_anatomy.kernels import fp8_gemv, fp8_quant

    assert sg.mma_layout(n, k, gated) is not None
    g = torch.Generator(device="cuda").manual_seed(n * 3 + k)
    w8, scale = quantize_rows(torch.randn(2 * n if gated else n, k, device="cuda", generator=g) / k ** 0.5)
    x = torch.randn(1, k, device="cuda", generator=g)
    x[0, :64] = 0
    x[0, 64] = 3e4
    x[0, 65:70] = torch.tensor([1e-3, -2e-3, 4e-4, 3e4 * 0.999, -3e4])
    x = x.bfloat16()
    xq, x_scale = fp8_quant.quantize_rows(x)
    want = fp8_gemv.w8a8_gemv(xq, x_scale, w8, scale, torch.bfloat16, gated).float()
    y = sg.stream_gemv(x, w8, gated, scale=scale).float()
    assert ((y - want).norm() / want.norm()).item() < 2e-3
    assert ((y - want).abs() > 2e-2 * want.abs().max()).sum().item() == 0
