"""fp8 linear layers (models/quant.py) and quantization_config parsing: the numerics off the fast path are those of the
float model holding the dequantized weights, bit for bit; the bytes roughly halve; bad configs are refused."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from llm_anatomy.errors import ConfigError, UnsupportedModelError
from llm_anatomy.hub import resolve
from llm_anatomy.models.config import ModelConfig, QuantizationConfig, WeightScheme, resolve_quantization
from llm_anatomy.models.loader import build_model, hf_state_dict, init_synthetic, weight_bytes
from llm_anatomy.models.quant import (FP8, Fp8Linear, decoder_layer_linear_bytes, dequantize, fp8_linear_bytes,
                                      linear_weight_bytes, quantize, quantize_linear_layers)

TINY = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512}


def tiny_model(quantization=None, dtype=torch.bfloat16, seed=0, **overrides):
    model = build_model(ModelConfig.from_hf({**TINY, **overrides}), torch.device("cpu"), dtype, quantization)
    init_synthetic(model, seed)
    return model


@pytest.mark.parametrize("block", [None, (32, 128), (128, 128)])
def test_quantize_round_trip(block):
    w = torch.randn(96, 320, generator=torch.Generator().manual_seed(0)) * 0.05
    w[3] = 0  # an all-zero channel: zeros back, no NaN
    q, scale = quantize(w, block)
    assert q.dtype == FP8 and scale.dtype == torch.float32
    assert scale.shape == ((96,) if block is None else (-(-96 // block[0]), -(-320 // block[1])))
    back = dequantize(q, scale, block)
    assert torch.equal(back[3], torch.zeros(320))
    # each channel's (block's) largest magnitude is 448 after scaling; e4m3 keeps 3 mantissa bits: error <= 1/16
    assert q.float().abs().amax() == 448
    assert ((back - w).abs() <= w.abs() / 16 + scale.max() * 2 ** -9).all()


def test_fp8_linear_equals_the_float_linear_with_dequantized_weights():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True, dtype=torch.bfloat16)
    fp8 = Fp8Linear.from_linear(linear)
    x = torch.randn(5, 7, 64, dtype=torch.bfloat16)
    reference = F.linear(x, dequantize(fp8.weight, fp8.weight_scale, None).to(torch.bfloat16), linear.bias)
    assert torch.equal(fp8(x), reference)
    assert fp8(x).shape == (5, 7, 48)
    gate, up = reference.chunk(2, dim=-1)
    assert torch.equal(fp8.fast_product(x.reshape(-1, 64), gated=True), (F.silu(gate) * up).reshape(-1, 24))
    assert fp8.weight_bytes() == 48 * 64 + 48 * 4 + 48 * 2 == fp8_linear_bytes(48, 64) + 48 * 2


def test_quantize_linear_layers_swaps_all_but_lm_head_and_keeps_the_numerics():
    model = tiny_model()
    before = linear_weight_bytes(model)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    qkv = model.model.layers[0].self_attn.qkv_proj
    swapped = quantize_linear_layers(model)
    assert len(swapped) == 2 * 4 and "lm_head" not in swapped
    assert isinstance(model.model.layers[1].mlp.gate_up_proj, Fp8Linear)
    assert type(model.lm_head) is torch.nn.Linear
    new = model.model.layers[0].self_attn.qkv_proj
    # the fused projection: each row is its own channel, whichever part it came from
    q, scale = quantize(qkv.weight)
    assert torch.equal(new.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(new.weight_scale, scale)
    assert torch.equal(new(x), F.linear(x, dequantize(q, scale, None).to(torch.bfloat16)))
    ratio = linear_weight_bytes(model) / before
    lm_head = 512 * 64 * 2
    assert 0.5 < (linear_weight_bytes(model) - lm_head) / (before - lm_head) < 0.55 and ratio < 0.8


def test_w8a8_gemms_are_those_of_per_channel_fp8_layers_over_bf16_rows_on_hopper(monkeypatch):
    """What the plan's fp8 fast accumulation applies to (quant.w8a8_gemms): a model with per-channel fp8 layers over
    bf16 rows on an sm_90+ GPU; not one of bf16 layers, not block-scaled layers (W8A16), not float32 rows, not a CPU."""
    from llm_anatomy.models import quant

    model, cpu = tiny_model(), torch.device("cpu")
    quantize_linear_layers(model)
    assert not quant.w8a8_gemms(model, cpu, torch.bfloat16)  # no torch._scaled_mm on a CPU
    monkeypatch.setattr(quant, "_rowwise_scaled_mm", lambda device: True)  # as on a Hopper GPU
    assert quant.w8a8_gemms(model, cpu, torch.bfloat16)
    assert not quant.w8a8_gemms(model, cpu, torch.float32)
    assert not quant.w8a8_gemms(tiny_model(), cpu, torch.bfloat16)  # bf16 layers
    blocks = torch.nn.Sequential(Fp8Linear.from_linear(torch.nn.Linear(64, 64).bfloat16(),
                                                       WeightScheme("block", "weight_scale_inv", (32, 32))))
    assert not quant.w8a8_gemms(blocks, cpu, torch.bfloat16)


def test_quantized_at_load_roughly_halves_the_linear_layers_of_qwen3_8b():
    """The real shapes, on the meta device (nothing allocated): the figure the anatomy reports."""
    config = ModelConfig.from_hf(resolve("Qwen/Qwen3-8B").config)
    meta = torch.device("meta")
    plain = build_model(config, meta, torch.bfloat16)
    fp8 = build_model(config, meta, torch.bfloat16, quantization="fp8")
    head = config.vocab_size * config.hidden_size * 2
    layers_plain, layers_fp8 = linear_weight_bytes(plain) - head, linear_weight_bytes(fp8) - head
    assert 0.5 < layers_fp8 / layers_plain < 0.5005  # a float32 scale per row of 4096 or 12288 columns
    assert weight_bytes(plain) - weight_bytes(fp8) == layers_plain - layers_fp8
    # the cost model's figure from the config alone is the model's
    layers = config.num_hidden_layers
    assert decoder_layer_linear_bytes(config, torch.bfloat16, None) * layers == layers_plain
    assert decoder_layer_linear_bytes(config, torch.bfloat16, QuantizationConfig.at_load()) * layers == layers_fp8
    qwen_fp8 = QuantizationConfig.from_hf(FP8_BLOCK)
    block = build_model(replace(config, quantization=qwen_fp8), meta, torch.bfloat16)
    assert decoder_layer_linear_bytes(config, torch.bfloat16, qwen_fp8) * layers == linear_weight_bytes(block) - head
    assert sum(p.numel() for p in fp8.parameters()) == sum(p.numel() for p in plain.parameters())


def test_synthetic_fp8_weights_are_the_quantized_float_ones():
    """Same seed: the fp8 model's weights are the float model's, quantized (so compare measures quantization)."""
    plain, fp8 = tiny_model(), tiny_model("fp8")
    theirs, ours = hf_state_dict(plain), hf_state_dict(fp8)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        q, _ = quantize(theirs[name])
        assert torch.equal(ours[name].view(torch.uint8), q.view(torch.uint8)), name
    assert torch.equal(ours["lm_head.weight"], theirs["lm_head.weight"])
    assert torch.equal(ours["model.norm.weight"], theirs["model.norm.weight"])
    # a block-scaled model (a synthetic Qwen FP8 release): each fused layer quantized in 32 x 32 blocks
    blocked = tiny_model(quantization_config={**FP8_BLOCK, "weight_block_size": [32, 32]})
    layer = blocked.model.layers[1].mlp.gate_up_proj
    q, scale = quantize(plain.model.layers[1].mlp.gate_up_proj.weight, (32, 32))
    assert layer.weight_scale.shape == (8, 2) and torch.equal(layer.weight_scale, scale)
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))


FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def ct(weights, activations=None, **extra):
    group = {"targets": ["Linear"], "format": "float-quantized",
             "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, **weights},
             "input_activations": activations}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group},
            "ignore": ["lm_head"], **extra}


def test_parse_qwen_fp8_and_compressed_tensors():
    qwen = QuantizationConfig.from_hf(FP8_BLOCK)
    assert qwen.serialized and qwen.scheme_for("model.layers.0.mlp.up_proj") == WeightScheme(
        "block", "weight_scale_inv", (128, 128))
    assert qwen.scheme_for("lm_head") is None
    channel = QuantizationConfig.from_hf(ct({"strategy": "channel"}, {"num_bits": 8, "type": "float",
                                                                       "strategy": "token", "dynamic": True}))
    assert channel.scheme_for("model.layers.3.self_attn.o_proj") == WeightScheme("channel", "weight_scale")
    assert channel.scheme_for("lm_head") is None and "dynamic per token" in channel.describe()
    partial = QuantizationConfig.from_hf({**ct({"strategy": "tensor"}), "ignore": ["lm_head", "re:.*mlp\\.down_proj$",
                                                                                   "model.layers.1.self_attn"]})
    assert partial.scheme_for("model.layers.0.mlp.down_proj") is None
    assert partial.scheme_for("model.layers.1.self_attn.q_proj") is None
    assert partial.scheme_for("model.layers.10.self_attn.q_proj") == WeightScheme("tensor", "weight_scale")
    assert "weight-only" in QuantizationConfig.from_hf(ct({"strategy": "channel"})).describe()


@pytest.mark.parametrize("qc,error,message", [
    ({"quant_method": "awq", "bits": 4}, UnsupportedModelError,
     "quantization method 'awq'.*'fp8'.*'compressed-tensors'"),
    ({"quant_method": "gptq", "bits": 4}, UnsupportedModelError, "quantization method 'gptq' .*not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, UnsupportedModelError, "'bitsandbytes'"),
    ({"bits": 4}, UnsupportedModelError, "without quant_method"),
    ([1, 2], ConfigError, "must be an object"),
    ({**FP8_BLOCK, "activation_scheme": "static"}, UnsupportedModelError, "activation_scheme 'static'"),
    ({**FP8_BLOCK, "fmt": "e5m2"}, UnsupportedModelError, "fmt 'e5m2'"),
    ({**FP8_BLOCK, "weight_block_size": [128]}, ConfigError, "weight_block_size must be two positive integers"),
    ({**FP8_BLOCK, "weight_block_size": [0, 128]}, ConfigError, "weight_block_size must be two positive integers"),
    ({**FP8_BLOCK, "ignored_layers": "lm_head"}, ConfigError, "ignored_layers must be a list"),
    (ct({"strategy": "channel", "num_bits": 4, "type": "int"}), UnsupportedModelError, "4 bits, type 'int'"),
    (ct({"strategy": "group", "group_size": 128}), UnsupportedModelError, "weight strategy 'group'"),
    (ct({"strategy": "block"}), ConfigError, "block_structure must be two positive integers"),
    (ct({"strategy": "channel"}, {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
     UnsupportedModelError, "static input_activations"),
    (ct({"strategy": "channel"}, kv_cache_scheme={"num_bits": 8, "type": "float"}), UnsupportedModelError,
     "kv_cache_scheme"),
    ({**ct({"strategy": "channel"}), "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     UnsupportedModelError, "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, ConfigError, "no config_groups"),
    (ct({"strategy": "channel"}, transform_config={"config_groups": {}}), UnsupportedModelError, "transform_config"),
    (ct({"strategy": "channel"}, sparsity_config={"format": "sparse-24-bitmask"}), UnsupportedModelError,
     "sparsity_config format 'sparse-24-bitmask'"),
])
def test_unsupported_quantization_is_refused_by_name(qc, error, message):
    with pytest.raises(error, match=message):
        ModelConfig.from_hf({**TINY, "quantization_config": qc})


def test_requested_quantization_against_the_checkpoints():
    plain = ModelConfig.from_hf(TINY)
    assert resolve_quantization(plain, None) is None
    assert resolve_quantization(plain, "fp8") == QuantizationConfig.at_load()
    qwen = ModelConfig.from_hf({**TINY, "quantization_config": FP8_BLOCK})
    assert resolve_quantization(qwen, "fp8") is qwen.quantization is resolve_quantization(qwen, None)
    with pytest.raises(ConfigError, match="quantization 'int4' is not supported; use fp8"):
        resolve_quantization(plain, "int4")
    channel = ModelConfig.from_hf({**TINY, "quantization_config": ct({"strategy": "channel"})})
    with pytest.raises(ConfigError, match="quantized with 'compressed-tensors'.*leave quantization unset"):
        resolve_quantization(channel, "fp8")
    assert channel.to_hf()["quantization_config"]["quant_method"] == "compressed-tensors"
    assert "quantization_config" not in plain.to_hf()


def test_a_quantized_lm_head_or_unevenly_quantized_fused_parts_are_refused():
    device = torch.device("meta")
    head = ModelConfig.from_hf({**TINY, "quantization_config": {**ct({"strategy": "channel"}), "ignore": []}})
    with pytest.raises(UnsupportedModelError, match="stores lm_head in fp8"):
        build_model(head, device, torch.bfloat16)
    uneven = ModelConfig.from_hf({**TINY, "quantization_config": {
        **ct({"strategy": "channel"}), "ignore": ["lm_head", "model.layers.0.self_attn.k_proj"]}})
    with pytest.raises(UnsupportedModelError, match="parts of model.layers.0.self_attn.qkv_proj .*quantized alike"):
        build_model(uneven, device, torch.bfloat16)


def test_the_anatomy_says_which_precision_ran(save_tiny):
    """A call on an fp8 engine: its record names the fp8 layers and the KV cache's dtype, the reports show them,
    and its bytes follow (the linear layers' weights at a byte each, the KV cache at half the bytes)."""
    from rich.console import Console

    from llm_anatomy import Engine
    from llm_anatomy.probe.call import CallRequest, measure_call
    from llm_anatomy.probe.ceilings import datasheet_ceilings
    from llm_anatomy.report.html import render_html
    from llm_anatomy.report.terminal import render

    directory, _ = save_tiny()
    request = CallRequest(prompt_token_ids=[3, 1, 4, 1, 5], sampling=dict(temperature=0, max_tokens=3, ignore_eos=True))
    records = {}
    for name, settings in (("bf16", {}), ("fp8", {"quantization": "fp8", "kv_cache_dtype": "fp8"})):
        engine = Engine.from_pretrained(directory, device="cpu", dtype="bfloat16", kv_cache_tokens=64, **settings)
        records[name] = measure_call(engine, request, datasheet_ceilings(engine.device), use_telemetry=False)[1]
    fp8, bf16 = records["fp8"], records["bf16"]
    assert bf16.model.precision is None and bf16.model.kv_cache_dtype == "bfloat16"
    assert "fp8 e4m3 weights" in fp8.model.precision and fp8.model.kv_cache_dtype == "float8_e4m3fn"
    assert fp8.kv_cache.bytes_per_token * 2 == bf16.kv_cache.bytes_per_token
    assert fp8.decode_steps[0].bytes < bf16.decode_steps[0].bytes
    console = Console(record=True, width=300)
    render(fp8, console)
    text = " ".join(console.export_text().split())
    assert "Precision fp8 e4m3 weights" in text and "KV cache in float8_e4m3fn" in text
    assert "KV cache in <b>float8_e4m3fn</b>" in render_html(fp8)
    assert "attended in fp8" not in text and "fast accumulation" not in text  # neither on a CPU

    # an engine whose plan attends long prompts in fp8 (a GPU's) says so, with the plan's threshold
    from dataclasses import replace

    from llm_anatomy.anatomy import StartupRecord

    planned = replace(fp8, startup=StartupRecord(
        total_s=1.0, compile_and_capture_s=0.5, cuda_graphs=2, programmatic_dependent_launch=True,
        streaming_gemv=True, tile_tuning_s=0.0, plan={"fp8_fast_accum": True, "fp8_prefill_attention": True,
                                                      "fp8_prefill_min_tokens": 2049}))
    console = Console(record=True, width=300)
    render(planned, console)
    words = ("fp8 GEMMs summed in the tensor cores' fp8 accumulator (fast accumulation); prompts of 2049 tokens or "
             "more attended in fp8 (cuDNN) when alone in a prefill step")
    html = render_html(planned).replace("&#39;", "'")
    assert words in " ".join(console.export_text().split()) and words in html
