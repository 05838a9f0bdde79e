"""Model resolution and strict checkpoint loading: every broken checkpoint gets an error that names the problem."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from llm_anatomy import Engine
from llm_anatomy.errors import ConfigError, ModelNotFoundError, UnsupportedModelError, WeightsError
from llm_anatomy.hub import resolve
from llm_anatomy.models.config import ModelConfig
from llm_anatomy.models.loader import build_model, hf_state_dict, init_synthetic


def load(directory, **kwargs):
    return Engine.from_pretrained(directory, device="cpu", dtype=torch.float32, kv_cache_tokens=256, **kwargs)


def shards(directory):
    return sorted(directory.glob("model-*.safetensors"))


def rewrite(path, change):
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_sharded_checkpoint_loads_every_tensor(save_tiny):
    directory, hf = save_tiny()
    assert len(shards(directory)) > 3
    engine = load(directory)
    ours = hf_state_dict(engine.model)
    theirs = hf.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    assert engine.weights.kind == "checkpoint"
    assert engine.weights.num_parameters == sum(p.numel() for p in hf.parameters())


def test_single_file_checkpoint_and_dtype_conversion(save_tiny):
    directory, hf = save_tiny(shard=None)
    assert (directory / "model.safetensors").is_file()
    engine = Engine.from_pretrained(directory, device="cpu", dtype="bfloat16", kv_cache_tokens=256)
    q = hf_state_dict(engine.model)["model.layers.1.self_attn.q_proj.weight"]
    assert q.dtype == torch.bfloat16
    assert torch.equal(q, hf.state_dict()["model.layers.1.self_attn.q_proj.weight"].to(torch.bfloat16))


def test_missing_tensor(save_tiny):
    directory, _ = save_tiny()
    name = "model.layers.1.mlp.up_proj.weight"
    shard = next(p for p in shards(directory) if name in load_file(p))
    rewrite(shard, lambda t: t.pop(name))
    with pytest.raises(WeightsError, match=r"lacks 1 tensor\(s\): model.layers.1.mlp.up_proj.weight"):
        load(directory)


def test_unexpected_tensor(save_tiny):
    directory, _ = save_tiny()
    rewrite(shards(directory)[0], lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2, 2)}))
    with pytest.raises(WeightsError, match="unexpected tensor model.layers.0.self_attn.extra.weight"):
        load(directory)


def test_misshapen_tensor(save_tiny):
    directory, _ = save_tiny()
    name = "model.layers.0.self_attn.k_proj.weight"
    shard = next(p for p in shards(directory) if name in load_file(p))
    rewrite(shard, lambda t: t.update({name: torch.zeros(32, 64)}))
    with pytest.raises(WeightsError, match=r"k_proj.weight in .* has shape \[32, 64\], expected \[64, 64\]"):
        load(directory)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_file(save_tiny, damage):
    directory, _ = save_tiny()
    shard = shards(directory)[1]
    data = shard.read_bytes()
    shard.write_bytes(b"\x00garbage" * 10 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(WeightsError, match=f"{shard.name} is not a readable safetensors file"):
        load(directory)


def test_index_names_a_missing_shard(save_tiny):
    directory, _ = save_tiny()
    shards(directory)[2].unlink()
    with pytest.raises(WeightsError, match="names shard files that are not in"):
        load(directory)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="model_type 'llama' \\(LlamaForCausalLM\\) is not supported"):
        load(tmp_path)


@pytest.mark.parametrize("change,message", [
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"hidden_size": -4}, "hidden_size must be a positive integer"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope type 'longrope' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "needs original_max_position_embeddings"),
])
def test_bad_configs(change, message):
    base = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    with pytest.raises((ConfigError, UnsupportedModelError), match=message):
        ModelConfig.from_hf({**base, **change})


def test_unknown_names_and_paths(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model 'no-such/model'"):
        resolve("no-such/model")
    with pytest.raises(ModelNotFoundError, match="holds no config.json"):
        resolve(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        resolve(tmp_path)


def test_weights_path_must_be_a_directory(save_tiny, tmp_path):
    directory, _ = save_tiny()
    with pytest.raises(WeightsError, match="is not a directory"):
        load(directory, weights=str(tmp_path / "nowhere"))


def test_auto_without_weights_is_synthetic_with_a_notice(save_tiny, caplog):
    directory, _ = save_tiny()
    for shard in directory.glob("*.safetensors*"):
        shard.unlink()
    with caplog.at_level(logging.WARNING, logger="llm_anatomy"):
        engine = load(directory)
    assert engine.weights.kind == "synthetic"
    assert "synthetic" in engine.weights.label and "not the model's" in engine.weights.label
    assert "hf download" in caplog.text


def test_synthetic_is_seeded_and_shaped():
    config = ModelConfig.from_hf({"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
                                  "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 32})
    a, b, c = (build_model(config, torch.device("cpu"), torch.float32) for _ in range(3))
    init_synthetic(a, seed=1), init_synthetic(b, seed=1), init_synthetic(c, seed=2)
    sa, sb, sc = (hf_state_dict(m) for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert sa["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)
    assert torch.all(sa["model.norm.weight"] == 1)


def test_hub_id_resolved_from_local_cache(save_tiny, tmp_path, monkeypatch):
    """A hub id found in the local HF cache loads its real weights; nothing goes to the network."""
    import huggingface_hub.constants as hub_constants

    directory, hf = save_tiny()
    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-qwen3" / "snapshots" / "0123456789abcdef"
    snapshot.parent.mkdir(parents=True)
    directory.rename(snapshot)
    (cache / "models--tiny-org--tiny-qwen3" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-qwen3" / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve("tiny-org/tiny-qwen3")
    assert source.origin == "hf-cache" and source.directory == snapshot
    engine = load("tiny-org/tiny-qwen3")
    assert engine.weights.kind == "checkpoint"
    assert torch.equal(hf_state_dict(engine.model)["lm_head.weight"], hf.state_dict()["lm_head.weight"])


def test_presets_resolve_without_files():
    source = resolve("Qwen/Qwen3-8B")
    config = ModelConfig.from_hf(source.config)
    assert source.origin == "preset" and source.directory is None
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (36, 32, 8)
    assert config.kv_bytes_per_token(torch.bfloat16) == 147_456
    assert resolve("qwen3-0.6b").name == "Qwen/Qwen3-0.6B"
    assert ModelConfig.from_hf(resolve("Qwen3-0.6B").config).tie_word_embeddings
