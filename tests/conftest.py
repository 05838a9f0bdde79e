import os

import pytest
import torch

if not torch.cuda.is_available():
    # The Triton kernels run under Triton's interpreter on the CPU; set before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False)


def tiny_hf_config(model_type: str = "qwen3", **overrides):
    """A small HF config; head_dim (32) differs from hidden/heads (16) on purpose."""
    from transformers import Qwen2Config, Qwen3Config

    values = {**TINY, **overrides}
    if model_type == "qwen2":
        values.pop("head_dim")
        return Qwen2Config(**values)
    return Qwen3Config(**values)


def tiny_hf_model(model_type: str = "qwen3", seed: int = 0, **overrides):
    from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = tiny_hf_config(model_type, **overrides)
    cls = Qwen3ForCausalLM if model_type == "qwen3" else Qwen2ForCausalLM
    model = cls(config).eval()
    # HF zero-initialises biases and sets norms to one; perturb them so the test sees if they are loaded.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture
def save_tiny(tmp_path):
    """Write a tiny HF checkpoint (sharded) and return (directory, hf_model)."""

    def save(model_type: str = "qwen3", shard: str | None = "40KB", **overrides):
        model = tiny_hf_model(model_type, **overrides)
        directory = tmp_path / f"{model_type}-ckpt"
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(directory, **kwargs)
        return directory, model

    return save
