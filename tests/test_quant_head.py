"""lm_head in fp8 (EngineConfig.quantize_lm_head): off the fast path the engine is the model whose lm_head holds the
dequantized weights, bit for bit, tied or not; its bytes, its label and the cost model follow."""

from dataclasses import replace

import pytest
import torch

from llm_anatomy import Engine
from llm_anatomy.errors import UnsupportedModelError
from llm_anatomy.models.config import ModelConfig
from llm_anatomy.models.quant import FP8, Fp8Linear, quantize, quantize_head
from llm_anatomy.probe.cost import DEFAULT_SHAPES, decode_cost, weight_bytes_per_step

VOCAB, HIDDEN = 256, 64


def engine(directory, **settings):
    return Engine.from_pretrained(directory, device="cpu", dtype="bfloat16", kv_cache_tokens=64, **settings)


@pytest.mark.parametrize("block", [None, (16, 32)])
def test_quantized_in_slices_equals_the_whole_matrix(block):
    from llm_anatomy.models.config import WeightScheme

    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 100, bias=True, dtype=torch.bfloat16)
    stored_as = WeightScheme("block", "weight_scale_inv", block) if block else None
    fp8 = Fp8Linear.from_linear(linear, stored_as, rows=7)  # slices that do not divide the rows (whole blocks)
    q, scale = quantize(linear.weight, block)
    assert fp8.weight.dtype == FP8 and torch.equal(fp8.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fp8.weight_scale, scale) and torch.equal(fp8.bias, linear.bias)
    model = torch.nn.Module()
    model.lm_head = linear
    quantize_head(model)
    assert isinstance(model.lm_head, Fp8Linear) and model.lm_head.block is None
    with pytest.raises(UnsupportedModelError, match="lm_head is already quantized"):
        quantize_head(model)


@pytest.mark.parametrize("tied", [False, True])
def test_greedy_tokens_are_the_dequantized_heads(save_tiny, tied):
    """The fp8-head engine against the fp8 engine given a float lm_head holding the same dequantized weights: the
    same logits, bit for bit, and the same greedy continuation. A tied head gets its own fp8 copy; the embedding
    stays as it was."""
    directory, _ = save_tiny(vocab_size=VOCAB, hidden_size=HIDDEN, tie_word_embeddings=tied, initializer_range=0.2)
    head = engine(directory, quantization="fp8", quantize_lm_head=True)
    plain = engine(directory, quantization="fp8")
    assert isinstance(head.model.lm_head, Fp8Linear) and not isinstance(plain.model.lm_head, Fp8Linear)
    assert torch.equal(head.model.model.embed_tokens.weight, plain.model.model.embed_tokens.weight)
    float_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.bfloat16)
    float_head.weight.data.copy_(head.model.lm_head.dequantized(torch.bfloat16))
    plain.model.lm_head = float_head  # untied: the embedding keeps its weights
    hidden = torch.randn(3, HIDDEN, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    assert torch.equal(head.model.compute_logits(hidden, head.plan), plain.model.compute_logits(hidden, plain.plan))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    a = head.generate(prompt, temperature=0, max_tokens=12, ignore_eos=True).output_token_ids
    b = plain.generate(prompt, temperature=0, max_tokens=12, ignore_eos=True).output_token_ids
    assert a == b and len(a) == 12
    # and the quantization matters: the float model's own head gives other logits
    full = engine(directory)
    assert not torch.equal(full.model.compute_logits(hidden, full.plan), head.model.compute_logits(hidden, head.plan))


@pytest.mark.parametrize("tied", [False, True])
def test_the_weights_record_and_plan_name_the_fp8_head(save_tiny, tied):
    directory, _ = save_tiny(vocab_size=VOCAB, hidden_size=HIDDEN, tie_word_embeddings=tied)
    head = engine(directory, quantization="fp8", quantize_lm_head=True)
    plain = engine(directory, quantization="fp8")
    fp8_head = VOCAB * HIDDEN + VOCAB * 4  # a byte a weight, a float32 scale a row
    if tied:  # the fp8 copy comes on top of the float embedding
        assert head.weights.bytes - plain.weights.bytes == fp8_head
    else:  # the float head (2 bytes a weight) gives way to the fp8 one
        assert plain.weights.bytes - head.weights.bytes == VOCAB * HIDDEN * 2 - fp8_head
    assert head.weights.num_parameters == plain.weights.num_parameters
    assert "lm_head's with per-channel scales" in head.weights.quantization
    assert "the norms and lm_head in the model dtype" in plain.weights.quantization
    assert head.plan.head_dtype == "float8_e4m3fn" and plain.plan.head_dtype == "bfloat16"
    assert head.plan.describe()["head_dtype"] == "float8_e4m3fn"


def test_the_cost_model_reads_the_fp8_head_at_a_byte_a_weight():
    config = ModelConfig.from_hf({"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
                                  "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                                  "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960})
    fp8 = replace(DEFAULT_SHAPES, weight_size=1, weight_row_scale_bytes=4, w8a8=True)
    fp8_head = replace(fp8, head_size=1)
    bf16_head = weight_bytes_per_step(config, torch.bfloat16, fp8)["lm_head"]
    head = weight_bytes_per_step(config, torch.bfloat16, fp8_head)["lm_head"]
    assert bf16_head == 151936 * 4096 * 2 + 4096 * 2
    assert head == 151936 * 4096 + 151936 * 4 + 4096 * 2
    # a decode step of one sequence: the difference is the head's weights alone (its bf16 row read either way)
    one = [decode_cost(config, torch.bfloat16, [500], shapes=s) for s in (fp8, fp8_head)]
    assert one[0].bytes - one[1].bytes == bf16_head - head
    assert one[0].flops == one[1].flops
    # 64 sequences: the fp8 head's W8A8 product reads its rows quantized, after a kernel that reads them in bf16
    many = [decode_cost(config, torch.bfloat16, [500] * 64, shapes=s) for s in (fp8, fp8_head)]
    assert many[1].parts["lm_head"]["bytes"] == head + 64 * (4096 + 4)
    assert many[1].parts["quantize"]["bytes"] - many[0].parts["quantize"]["bytes"] == 64 * 4096 * 2


def test_a_call_on_the_fp8_head_reads_fewer_bytes_a_step(save_tiny):
    from llm_anatomy.probe.call import CallRequest, measure_call
    from llm_anatomy.probe.ceilings import datasheet_ceilings

    directory, _ = save_tiny(vocab_size=VOCAB, hidden_size=HIDDEN)
    request = CallRequest(prompt_token_ids=[3, 1, 4, 1, 5], sampling=dict(temperature=0, max_tokens=3, ignore_eos=True))
    records = [measure_call(e, request, datasheet_ceilings(e.device), use_telemetry=False)[1]
               for e in (engine(directory, quantization="fp8"), engine(directory, quantization="fp8",
                                                                        quantize_lm_head=True))]
    plain, head = records
    assert "lm_head's with per-channel scales" in head.model.precision
    # the cost model reads the head at the plan's head_dtype (the host's reference path too)
    assert plain.decode_steps[0].bytes - head.decode_steps[0].bytes == VOCAB * HIDDEN * 2 - (VOCAB * HIDDEN + VOCAB * 4)
