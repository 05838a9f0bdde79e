"""Pre-quantized checkpoints load as published: a tiny Qwen3 written in each supported FP8 layout (the fp8 tensors and
scales written here, with safetensors, as Qwen's FP8 releases and llm-compressor lay them out) gives the same greedy
continuation, and the same log-probabilities, as the bf16 model holding the dequantized weights; broken ones fail
with a message that names the tensor."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from llm_anatomy import Engine
from llm_anatomy.errors import WeightsError
from llm_anatomy.models.config import ModelConfig
from llm_anatomy.models.loader import build_model, load_checkpoint
from llm_anatomy.models.quant import Fp8Linear, linear_weight_bytes

from conftest import tiny_hf_model

FP8 = torch.float8_e4m3fn
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Every fused part a multiple of 128 rows (Qwen's block fp8 needs it, as vLLM does); K = 192 leaves a partial block
# of columns, o_proj's and down_proj's N = 192 a partial block of rows.
BLOCK_ALIGNED = dict(hidden_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256)
ACTIVATIONS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}


def ct_config(strategy: str, **weights) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                          "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                      "dynamic": False, "strategy": strategy, **weights},
                                          "input_activations": ACTIVATIONS}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


# name -> (quantization_config, scale tensor name, scale layout, scale dtype as published, tiny config overrides)
FORMATS = {
    "qwen-fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                        "weight_block_size": [128, 128]}, "weight_scale_inv", "block", torch.float32, BLOCK_ALIGNED),
    "fp8-per-tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_scale", "scalar",
                       torch.float32, {}),
    "ct-channel": (ct_config("channel"), "weight_scale", "channel", torch.bfloat16, {}),
    "ct-tensor": (ct_config("tensor"), "weight_scale", "tensor", torch.float32, {}),
    "ct-block": (ct_config("block", block_structure=[128, 128]), "weight_scale", "block", torch.bfloat16,
                 BLOCK_ALIGNED),
}


def fp8_round_trip(w: torch.Tensor, layout: str, scale_dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale as stored, the dequantized weight in float32) of one [N, K] weight."""
    w = w.float()
    n, k = w.shape
    if layout == "block":
        rows, cols = -(-n // 128), -(-k // 128)
        amax = torch.zeros(rows, cols)
        for i in range(rows):
            for j in range(cols):
                amax[i, j] = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max()
        stored = (amax / 448).to(scale_dtype)
        full = stored.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    elif layout == "channel":
        stored = (w.abs().amax(dim=1, keepdim=True) / 448).to(scale_dtype)  # [N, 1]
        full = stored.float()
    else:  # one number: [1] (compressed-tensors) or [] (fp8 per-tensor)
        stored = (w.abs().max() / 448).to(scale_dtype)
        stored = stored.reshape(1) if layout == "tensor" else stored.reshape(())
        full = stored.float()
    q = (w / full).clamp(-448, 448).to(FP8)
    return q, stored, q.float() * full


def write_checkpoints(tmp_path, fmt: str, **extra_overrides):
    """(fp8 checkpoint dir, bf16 reference dir holding the dequantized weights); the fp8 one in two files, so
    that weights and their scales may sit in different files."""
    qc, scale_name, layout, scale_dtype, overrides = FORMATS[fmt]
    hf = tiny_hf_model(**{**overrides, **extra_overrides}).to(torch.bfloat16)
    reference_dir, fp8_dir = tmp_path / "reference", tmp_path / "fp8"
    hf.save_pretrained(reference_dir)
    hf.save_pretrained(fp8_dir)
    tensors = load_file(reference_dir / "model.safetensors")
    fp8_tensors, reference = {}, dict(tensors)
    for name, t in tensors.items():
        if name.removesuffix(".weight").rsplit(".", 1)[-1] in LINEAR:
            q, stored, real = fp8_round_trip(t, layout, scale_dtype)
            fp8_tensors[name] = q
            fp8_tensors[name.removesuffix("weight") + scale_name] = stored
            reference[name] = real.to(torch.bfloat16)
        else:
            fp8_tensors[name] = t
    (fp8_dir / "model.safetensors").unlink()
    names = sorted(fp8_tensors)
    for i in range(2):
        save_file({n: fp8_tensors[n] for n in names[i::2]}, fp8_dir / f"model-0000{i + 1}-of-00002.safetensors",
                  metadata={"format": "pt"})
    save_file(reference, reference_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    (fp8_dir / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return fp8_dir, reference_dir


def load(directory, **kwargs):
    return Engine.from_pretrained(directory, device="cpu", dtype="bfloat16", kv_cache_tokens=256, **kwargs)


@pytest.mark.parametrize("fmt", FORMATS)
def test_published_fp8_formats_equal_the_dequantized_bf16_model(tmp_path, fmt):
    fp8_dir, reference_dir = write_checkpoints(tmp_path, fmt)
    fp8, reference = load(fp8_dir), load(reference_dir)
    layers = [m for m in fp8.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 2 * 4 and type(fp8.model.lm_head) is torch.nn.Linear
    assert "as the checkpoint stores them" in fp8.weights.quantization and reference.weights.quantization is None
    ids = [5, 77, 300, 12, 9, 401, 33]
    ours = fp8.generate(prompt_token_ids=ids, temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    theirs = reference.generate(prompt_token_ids=ids, temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    assert ours.output_token_ids == theirs.output_token_ids
    assert ours.logprobs == theirs.logprobs  # bit for bit: the same bf16 weights, the same products
    assert fp8.weights.bytes < 0.75 * reference.weights.bytes


def test_quantized_at_load_equals_the_dequantized_bf16_model(tmp_path, save_tiny):
    """--quantization fp8 over a bf16 checkpoint: per-channel fp8 at load, half the linear layers' bytes, and the
    outputs of the bf16 model holding those weights dequantized."""
    directory, hf = save_tiny(shard=None)
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    cpu = torch.device("cpu")
    plain, fp8 = build_model(config, cpu, torch.bfloat16), build_model(config, cpu, torch.bfloat16, "fp8")
    load_checkpoint(plain, directory)
    info = load_checkpoint(fp8, directory)
    assert "quantized at load" in info.quantization
    head = 512 * 64 * 2
    assert 0.5 < (linear_weight_bytes(fp8) - head) / (linear_weight_bytes(plain) - head) < 0.55
    with torch.no_grad():  # the bf16 model holding the dequantized weights
        for name, m in fp8.named_modules():
            if isinstance(m, Fp8Linear):
                plain.get_submodule(name).weight.copy_(m.dequantized(torch.bfloat16))
    ids = torch.tensor([5, 77, 300, 12, 9])
    assert torch.equal(_logits(fp8, ids), _logits(plain, ids))


def _logits(model, ids):
    from llm_anatomy.engine.kv_cache import KVCachePool
    from llm_anatomy.models.attention import AttentionBatch

    pool = KVCachePool(model.config, 2, 16, torch.bfloat16, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), AttentionBatch.fresh_prompt(pool.k, pool.v, torch.arange(len(ids))))
        return model.compute_logits(hidden)


def rewrite(directory, change):
    for path in sorted(directory.glob("model-*.safetensors")):
        tensors = load_file(path)
        if change(tensors):
            save_file(tensors, path, metadata={"format": "pt"})


def test_a_missing_scale_is_named(tmp_path):
    fp8_dir, _ = write_checkpoints(tmp_path, "qwen-fp8-block")
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    rewrite(fp8_dir, lambda t: t.pop(name, None) is not None)
    with pytest.raises(WeightsError, match=f"lacks 1 tensor\\(s\\): {name}"):
        load(fp8_dir)


def test_a_misshapen_block_scale_is_named(tmp_path):
    fp8_dir, _ = write_checkpoints(tmp_path, "qwen-fp8-block")
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    rewrite(fp8_dir, lambda t: name in t and t.update({name: torch.ones(1, 2)}) is None)
    with pytest.raises(WeightsError, match=f"{name} in .* has shape \\[1, 2\\], expected \\[2, 2\\]"):
        load(fp8_dir)


def test_a_non_finite_scale_is_refused(tmp_path):
    fp8_dir, _ = write_checkpoints(tmp_path, "ct-channel")
    name = "model.layers.0.mlp.down_proj.weight_scale"
    rewrite(fp8_dir, lambda t: name in t and t[name].__setitem__(3, float("inf")) is None)
    with pytest.raises(WeightsError, match=f"{name} in .* holds scales that are not finite"):
        load(fp8_dir)


def test_a_float_weight_where_fp8_is_declared_is_refused(tmp_path):
    fp8_dir, _ = write_checkpoints(tmp_path, "ct-channel")
    name = "model.layers.1.self_attn.v_proj.weight"
    rewrite(fp8_dir, lambda t: name in t and t.update({name: t[name].to(torch.bfloat16)}) is None)
    with pytest.raises(WeightsError, match=f"{name} in .* is bfloat16; the quantization_config says .* float8_e4m3fn"):
        load(fp8_dir)


def test_fp8_tensors_without_a_quantization_config_are_refused(tmp_path):
    fp8_dir, _ = write_checkpoints(tmp_path, "ct-channel")
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    rewrite(fp8_dir, lambda t: [t.pop(n) for n in [n for n in t if n.endswith("weight_scale")]] != [])
    with pytest.raises(WeightsError, match="proj.weight in .* is float8_e4m3fn, but this layer is not quantized"):
        load(fp8_dir)


def test_block_scales_of_unaligned_fused_parts_are_refused(tmp_path):
    """qkv_proj of the default tiny config: q 128 rows, k and v 64: v starts inside a 128-row block."""
    fp8_dir, _ = write_checkpoints(tmp_path, "qwen-fp8-block", **{k: v for k, v in (
        ("hidden_size", 64), ("num_attention_heads", 4), ("num_key_value_heads", 2), ("head_dim", 32),
        ("intermediate_size", 128))})
    with pytest.raises(WeightsError, match="v_proj starts at row 192 of a fused layer.*128-row weight blocks"):
        load(fp8_dir)


def test_unsupported_method_in_a_checkpoint_is_refused_by_name(tmp_path, save_tiny):
    from llm_anatomy.errors import UnsupportedModelError

    directory, _ = save_tiny()
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}}))
    with pytest.raises(UnsupportedModelError, match="quantization method 'awq'.* is not supported.*'fp8'"):
        load(directory)


def test_a_published_fp8_checkpoint_with_its_lm_head_quantized_at_load(tmp_path):
    """Qwen's block-fp8 layout as published, with quantize_lm_head: the layers keep the checkpoint's block scales,
    lm_head is quantized per channel as it loads, and the record says both."""
    from llm_anatomy.errors import ConfigError

    fp8_dir, _ = write_checkpoints(tmp_path, "qwen-fp8-block")
    plain, head = load(fp8_dir), load(fp8_dir, quantization="fp8", quantize_lm_head=True)
    assert isinstance(head.model.lm_head, Fp8Linear) and head.model.lm_head.block is None
    assert all(m.block == (128, 128) for m in head.model.modules() if isinstance(m, Fp8Linear) and m is not
               head.model.lm_head)
    assert head.weights.quantization.startswith("fp8 e4m3 weights with 128x128 block float32 scales (as the "
                                                "checkpoint stores them)")
    assert "lm_head's with per-channel scales (quantized at load)" in head.weights.quantization
    assert plain.weights.bytes - head.weights.bytes == plain.config.vocab_size * 192 * 2 - (
        plain.config.vocab_size * 192 + plain.config.vocab_size * 4)
    ids = [5, 77, 300, 12, 9]
    assert len(head.generate(prompt_token_ids=ids, temperature=0, max_tokens=4, ignore_eos=True).output_token_ids) == 4
    ct_dir, _ = write_checkpoints(tmp_path / "ct", "ct-channel")
    with pytest.raises(ConfigError, match="leave quantization unset"):  # vLLM's rule: no --quantization over it
        load(ct_dir, quantization="fp8", quantize_lm_head=True)
