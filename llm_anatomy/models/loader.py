"""Weights: HF safetensors checkpoints (single or sharded) loaded strictly by HF names, or synthetic.

Tensors go one at a time from the memory-mapped file into their slice of the (fused) parameter on the
device, converting dtype on the way: no second full copy in host memory, no temporary on the device.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import WeightsError
from .config import ModelConfig
from .qwen3 import PACKED_MODULES, Qwen3ForCausalLM, RotaryEmbedding, packed_shards

# Tensors some checkpoints carry that the network recomputes; skipped, not an error.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class WeightsInfo:
    """What the anatomy says about the weights."""

    kind: str  # "checkpoint" | "synthetic"
    source: str  # the checkpoint directory, or "synthetic (seed N)"
    seed: int | None
    num_parameters: int
    bytes: int
    load_seconds: float
    files: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        if self.kind == "synthetic":
            return f"synthetic random weights (seed {self.seed}); outputs are not the model's"
        return f"checkpoint {self.source}"


def _target(params: dict[str, torch.Tensor], config: ModelConfig, hf_name: str) -> tuple[torch.Tensor, int, int] | None:
    """Where an HF tensor goes: (parameter, first row, rows); None for names the model does not have."""
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in PACKED_MODULES:
        fused, shard = PACKED_MODULES[parts[-2]]
        fused_name = ".".join(parts[:-2] + [fused, parts[-1]])
        if fused_name not in params:
            return None
        sizes = packed_shards(config)[fused]
        return params[fused_name], sum(sizes[:shard]), sizes[shard]
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        return None  # tied: the embedding is the head
    if hf_name not in params:
        return None
    p = params[hf_name]
    return p, 0, p.shape[0]


def expected_tensors(model: Qwen3ForCausalLM) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name a checkpoint must hold for this config, with its shape."""
    shards = packed_shards(model.config)
    unfused = {fused: [(hf, idx) for hf, (f, idx) in PACKED_MODULES.items() if f == fused] for fused in shards}
    out = {}
    for name, p in model.named_parameters():  # duplicates (the tied head) are listed once
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in shards:
            for hf, idx in unfused[parts[-2]]:
                out[".".join(parts[:-2] + [hf, parts[-1]])] = (shards[parts[-2]][idx], *p.shape[1:])
        else:
            out[name] = tuple(p.shape)
    return out


def checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightsError(f"{index} is not a valid safetensors index ({e})") from None
        files = [directory / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightsError(f"{index.name} names shard files that are not in {directory}: {', '.join(missing)}")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if found:
        return found
    raise WeightsError(f"no safetensors weights in {directory} (expected model.safetensors or an index); "
                       "pass weights='synthetic' to run with random weights")


def has_checkpoint(directory: Path | None) -> bool:
    return directory is not None and (
        (directory / "model.safetensors.index.json").is_file() or any(directory.glob("*.safetensors")))


def _short(names, limit: int = 5) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """The network with uninitialised parameters on the device (built on meta: no wasted init, no host copy)."""
    with torch.device("meta"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = Qwen3ForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each module its own tensor: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = RotaryEmbedding(config).to(device)  # its tables are computed, not loaded
    return model.eval().requires_grad_(False)


@torch.no_grad()
def load_checkpoint(model: Qwen3ForCausalLM, directory: Path) -> WeightsInfo:
    start = time.perf_counter()
    expected = expected_tensors(model)
    files = checkpoint_files(directory)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(IGNORED_SUFFIXES):
                        continue
                    if name in seen:
                        raise WeightsError(f"tensor {name} appears twice ({path.name} and an earlier shard)")
                    target = _target(params, model.config, name)
                    if target is None and name == "lm_head.weight" and model.config.tie_word_embeddings:
                        continue  # some tied checkpoints also store the head; the embedding is used
                    if target is None:
                        raise WeightsError(f"unexpected tensor {name} in {path.name}: the "
                                           f"{model.config.model_type} config has no such weight")
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != expected[name]:
                        raise WeightsError(f"tensor {name} in {path.name} has shape {list(shape)}, "
                                           f"expected {list(expected[name])} from config.json")
                    param, row, rows = target
                    param.data[row:row + rows].copy_(f.get_tensor(name))
                    seen.add(name)
        except SafetensorError as e:
            raise WeightsError(f"{path} is not a readable safetensors file: {e}") from None
        except OSError as e:
            raise WeightsError(f"cannot read {path}: {e}") from None
    missing = set(expected) - seen
    if missing:
        raise WeightsError(f"checkpoint {directory} lacks {len(missing)} tensor(s): {_short(missing)}")
    if model.lm_head.weight.device.type == "cuda":
        torch.cuda.synchronize()
    return WeightsInfo("checkpoint", str(directory), None, count_parameters(model), weight_bytes(model),
                       time.perf_counter() - start, tuple(p.name for p in files))


@torch.no_grad()
def init_synthetic(model: Qwen3ForCausalLM, seed: int = 0) -> WeightsInfo:
    """Random weights with the exact shapes, drawn on the device: N(0, 0.02) like HF's init, norms at 1."""
    start = time.perf_counter()
    device = model.lm_head.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=generator)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return WeightsInfo("synthetic", f"synthetic (seed {seed})", seed, count_parameters(model), weight_bytes(model),
                       time.perf_counter() - start)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def hf_state_dict(model: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """The weights under HF names (views into the fused parameters): for HF reference models and checkpoints."""
    params = dict(model.named_parameters())
    out = {}
    for name in expected_tensors(model):
        param, row, rows = _target(params, model.config, name)
        out[name] = param.data[row:row + rows]
    return out
