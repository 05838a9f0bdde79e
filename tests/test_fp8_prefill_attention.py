"""cuDNN's fp8 prefill attention (kernels/fp8_prefill_attention.py) against float32 attention over the same fp8
values, and the engine's prefill with it against the same step attended in bf16. GPU only (Hopper and later, with
cudnn-frontend); the plan's choice and the store kernel's fp8 rows are checked on the CPU
(tests/test_engine_config.py, tests/test_kernels.py)."""

import pytest
import torch
import torch.nn.functional as F

HEADS, KV_HEADS, D = 8, 2, 128


def _available() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    from llm_anatomy.kernels.fp8_prefill_attention import available

    return available(torch.device("cuda"), HEADS, KV_HEADS, D)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _available(), reason="needs a Hopper GPU and cudnn-frontend")]


def _fp8_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    from llm_anatomy.models.attention import as_cached

    out = torch.zeros(rows, *x.shape[1:], dtype=torch.float8_e4m3fn, device=x.device)
    out[:len(x)] = as_cached(x, out)
    return out


def _reference(q, k, v) -> torch.Tensor:
    """Causal GQA attention in float32, [n, H, D]."""
    qi, ki, vi = (x.float().transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("n,rows", [(1000, 1024), (2048, 2048), (2100, 2560)])
def test_fp8_attention_against_float32_over_the_same_values(n, rows):
    from llm_anatomy.kernels.fp8_prefill_attention import O_MARGIN, attention

    g = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(n, HEADS, D, device="cuda", generator=g)  # as QK-norm leaves them
    k = torch.randn(n, KV_HEADS, D, device="cuda", generator=g)
    v = torch.randn(n, KV_HEADS, D, device="cuda", generator=g) * 0.3
    q8, k8, v8 = (_fp8_rows(x, rows) for x in (q, k, v))
    v_amax = v8.float().abs().amax().view(1)
    values, scale = attention(q8, k8, v8, v_amax, tokens=n)
    assert values.shape == (n, HEADS * D) and values.dtype == torch.float8_e4m3fn and scale.shape == (n, 1)
    assert torch.allclose(scale, (v_amax * O_MARGIN / 448).expand(n, 1), rtol=1e-6, atol=0)
    got = (values.float() * scale).view(n, HEADS, D)
    assert got.isfinite().all()
    same_values = _reference(q8[:n], k8[:n], v8[:n])  # the probabilities' and the output's fp8 rounding only
    assert ((got - same_values).norm() / same_values.norm()).item() < 0.05
    exact = _reference(q, k, v)  # and the inputs' too
    assert ((got - exact).norm() / exact.norm()).item() < 0.08


def test_fp8_attention_of_all_zero_values_is_zero():
    from llm_anatomy.kernels.fp8_prefill_attention import attention

    q8 = _fp8_rows(torch.randn(1024, HEADS, D, device="cuda"), 1024)
    zeros = torch.zeros(1024, KV_HEADS, D, dtype=torch.float8_e4m3fn, device="cuda")
    values, scale = attention(q8, _fp8_rows(torch.randn(1024, KV_HEADS, D, device="cuda"), 1024), zeros,
                              torch.zeros(1, device="cuda"), tokens=1024)
    assert torch.equal(values.float() * scale, torch.zeros(1024, HEADS * D, device="cuda"))


def test_the_engine_prefills_a_long_prompt_in_fp8_close_to_bf16_attention(save_tiny, monkeypatch):
    """An engine with fp8 weights and KV cache plans the fp8 prefill attention (bf16 weights with an fp8 cache do
    not: its output is o_proj's W8A8 input); a 2100-token prompt's prefill step takes it in every layer but the last
    (which attends the prompt's last row alone, attention.attends_last_row_alone) and gives logits near the same
    step attended in bf16 (the plan's fp8_prefill_attention off: the layer's attention output then differs by the
    fp8 rounding, about 5%, which random layers carry to the logits); generation goes on from it."""
    from dataclasses import replace

    from llm_anatomy import Engine
    from llm_anatomy.engine.runner import ModelRunner
    from llm_anatomy.engine.scheduler import ScheduledBatch
    from llm_anatomy.kernels import fp8_prefill_attention

    directory, _ = save_tiny(hidden_size=256, intermediate_size=512, num_attention_heads=HEADS,
                             num_key_value_heads=KV_HEADS, head_dim=D, num_hidden_layers=2, initializer_range=0.2,
                             max_position_embeddings=4096, shard=None)
    settings = dict(device="cuda", dtype=torch.bfloat16, kv_cache_tokens=4096, max_num_seqs=2, kv_cache_dtype="fp8")
    assert not Engine.from_pretrained(directory, **settings).plan.fp8_prefill_attention
    engine = Engine.from_pretrained(directory, quantization="fp8", **settings)
    assert engine.plan.fp8_prefill_attention and engine.plan.describe()["fp8_prefill_attention"]
    calls = []
    real = fp8_prefill_attention.attention
    monkeypatch.setattr(fp8_prefill_attention, "attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    prompt = torch.randint(0, 500, (2100,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = engine.add_request(prompt, engine.sampling_params(temperature=0, max_tokens=8, ignore_eos=True))
    assert seq.block_table.ensure(len(prompt))
    batch = ScheduledBatch([seq], [len(prompt)], True, [seq], 0)
    logits = {fp8: ModelRunner(engine.model, engine.pool, engine.device,
                               replace(engine.plan, fp8_prefill_attention=fp8)).run(batch).float()
              for fp8 in (True, False)}
    assert calls == [(2560, HEADS, D)]  # the first layer, at the prompt's bucket length; the second is the last
    assert logits[True].isfinite().all()
    assert ((logits[True] - logits[False]).norm() / logits[False].norm()).item() < 0.25
    while not seq.finished:
        engine.step()
    assert seq.finish_reason == "length" and len(seq.output_token_ids) == 8 and len(calls) == 2
