"""Weights: HF safetensors checkpoints (single or sharded) loaded strictly by HF names, or synthetic.

Tensors go one at a time from the memory-mapped file into their slice of the (fused) parameter on the
device, converting dtype on the way: no second full copy in host memory, no temporary on the device.

Quantized layers (models/quant.py): a pre-quantized checkpoint's fp8 weights and their scales are copied as
published; float weights of a layer quantized at load are quantized per output channel as they arrive.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import WeightsError
from .config import ModelConfig, resolve_quantization
from .quant import FP8, Fp8Linear, precision_label, quantize, quantize_head, quantize_linear_layers
from .qwen3 import PACKED_MODULES, Qwen3ForCausalLM, RotaryEmbedding, packed_shards

# Tensors some checkpoints carry that the network recomputes; skipped, not an error.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


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
    quantization: str | None = None  # the fp8 layers, in words (quant.precision_label); None: all in the dtype

    @property
    def label(self) -> str:
        if self.kind == "synthetic":
            return f"synthetic random weights (seed {self.seed}); outputs are not the model's"
        return f"checkpoint {self.source}"


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: rows [row, row + rows) of `dest` (a parameter or buffer of the model),
    from a tensor of `shape`, and what happens on the way (`kind`): "copy" (a float tensor, converted to the
    destination's dtype), "fp8" (fp8 weights stored as published), "quantize" (float weights of an fp8 layer,
    quantized per output channel as they load), "scale" (an fp8 layer's scales; a per-tensor one fills the rows
    of its part)."""

    dest: torch.Tensor
    row: int
    rows: int
    shape: tuple[int, ...]
    kind: str
    module: Fp8Linear | None = None

    def accepts(self, shape: tuple[int, ...]) -> bool:
        """The checkpoint's shape is this slot's; a per-channel scale may also come as [N], a per-tensor one as [1]."""
        if shape == self.shape:
            return True
        if self.kind != "scale":
            return False
        return shape == (self.rows,) if self.shape == (self.rows, 1) else (self.shape == () and shape == (1,))


def _parts(name: str, config: ModelConfig, rows: int) -> list[tuple[str, int, int]]:
    """(HF module name, first row, rows) of each part a module of ours holds: a fused projection's, else itself."""
    prefix, _, leaf = name.rpartition(".")
    sizes = packed_shards(config).get(leaf)
    if sizes is None:
        return [(name, 0, rows)]
    hf = sorted((idx, part) for part, (fused, idx) in PACKED_MODULES.items() if fused == leaf)
    return [(f"{prefix}.{part}", sum(sizes[:idx]), sizes[idx]) for idx, part in hf]


def _scale_slot(module: Fp8Linear, part: str, row: int, rows: int) -> Slot:
    scheme = module.stored_as
    if scheme.scales == "channel":
        return Slot(module.weight_scale, row, rows, (rows, 1), "scale", module)
    if scheme.scales == "tensor":
        return Slot(module.weight_scale, row, rows, (), "scale", module)
    block_rows, block_cols = scheme.block
    if row % block_rows:
        raise WeightsError(f"{part} starts at row {row} of a fused layer, not on a boundary of the checkpoint's "
                           f"{block_rows}-row weight blocks: its block scales cannot be fused (every part but the "
                           f"last must have a multiple of {block_rows} rows)")
    blocks = -(-rows // block_rows)
    return Slot(module.weight_scale, row // block_rows, blocks, (blocks, -(-module.in_features // block_cols)),
                "scale", module)


def checkpoint_slots(model: Qwen3ForCausalLM) -> dict[str, Slot]:
    """Every tensor a checkpoint must hold for this model, by HF name, and where it goes."""
    modules = dict(model.named_modules())
    slots = {}
    for name, p in model.named_parameters():  # duplicates (the tied head) are listed once
        owner, _, leaf = name.rpartition(".")
        module = modules[owner]
        for part, row, rows in _parts(owner, model.config, p.shape[0]):
            shape = (rows, *p.shape[1:])
            if isinstance(module, Fp8Linear) and leaf == "weight":
                stored = module.stored_as
                slots[f"{part}.weight"] = Slot(p, row, rows, shape, "fp8" if stored else "quantize", module)
                if stored is not None:
                    slots[f"{part}.{stored.scale_name}"] = _scale_slot(module, part, row, rows)
            else:
                slots[f"{part}.{leaf}"] = Slot(p, row, rows, shape, "copy", module)
    return slots


def expected_tensors(model: Qwen3ForCausalLM) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name a checkpoint must hold for this config, with its shape."""
    return {name: slot.shape for name, slot in checkpoint_slots(model).items()}


def _put(slot: Slot, tensor: torch.Tensor, name: str, file: str) -> None:
    """One checkpoint tensor into its slot, after checking that its dtype is the one the slot stores."""
    where = f"tensor {name} in {file} is {str(tensor.dtype).removeprefix('torch.')}"
    if slot.kind == "fp8":
        if tensor.dtype != FP8:
            raise WeightsError(f"{where}; the quantization_config says this layer is stored in float8_e4m3fn")
        slot.dest.data[slot.row:slot.row + slot.rows].copy_(tensor)
        return
    if tensor.dtype in FLOAT8 or not tensor.is_floating_point():
        why = ("this layer is not quantized (config.json's quantization_config leaves it out, or there is none)"
               if slot.kind in ("copy", "quantize") else "scales must be float")
        raise WeightsError(f"{where}, but {why}")
    if slot.kind == "copy":
        slot.dest.data[slot.row:slot.row + slot.rows].copy_(tensor)
    elif slot.kind == "quantize":
        q, scale = quantize(tensor.to(slot.dest.device))
        slot.dest.data[slot.row:slot.row + slot.rows].copy_(q)
        slot.module.weight_scale[slot.row:slot.row + slot.rows].copy_(scale)
    else:
        values = tensor.float()
        if not torch.isfinite(values).all():
            raise WeightsError(f"tensor {name} in {file} holds scales that are not finite")
        rows = slot.dest[slot.row:slot.row + slot.rows]
        rows.copy_(values.view(rows.shape) if slot.module.block else values.reshape(-1).expand(slot.rows))


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


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                quantization: str | None = None) -> Qwen3ForCausalLM:
    """The network with uninitialised parameters on the device (built on meta: no wasted init, no host copy).
    Its linear layers are fp8 (models/quant.py) where the checkpoint's quantization_config says so, or all but
    lm_head with quantization="fp8" (vLLM's --quantization) over float weights."""
    scheme = resolve_quantization(config, quantization)
    with torch.device("meta"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = Qwen3ForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
        if scheme is not None:
            quantize_linear_layers(model, quantization=scheme)
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each module its own tensor: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = RotaryEmbedding(config).to(device)  # its tables are computed, not loaded
    return model.eval().requires_grad_(False)


@torch.no_grad()
def load_checkpoint(model: Qwen3ForCausalLM, directory: Path) -> WeightsInfo:
    start = time.perf_counter()
    slots = checkpoint_slots(model)
    files = checkpoint_files(directory)
    seen: set[str] = set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(IGNORED_SUFFIXES):
                        continue
                    if name in seen:
                        raise WeightsError(f"tensor {name} appears twice ({path.name} and an earlier shard)")
                    slot = slots.get(name)
                    if slot is None and name == "lm_head.weight" and model.config.tie_word_embeddings:
                        continue  # some tied checkpoints also store the head; the embedding is used
                    if slot is None:
                        raise WeightsError(f"unexpected tensor {name} in {path.name}: the "
                                           f"{model.config.model_type} config has no such weight")
                    shape = tuple(f.get_slice(name).get_shape())
                    if not slot.accepts(shape):
                        raise WeightsError(f"tensor {name} in {path.name} has shape {list(shape)}, "
                                           f"expected {list(slot.shape)} from config.json")
                    _put(slot, f.get_tensor(name), name, path.name)
                    seen.add(name)
        except SafetensorError as e:
            raise WeightsError(f"{path} is not a readable safetensors file: {e}") from None
        except OSError as e:
            raise WeightsError(f"cannot read {path}: {e}") from None
    missing = set(slots) - seen
    if missing:
        raise WeightsError(f"checkpoint {directory} lacks {len(missing)} tensor(s): {_short(missing)}")
    if model.lm_head.weight.device.type == "cuda":
        torch.cuda.synchronize()
    return WeightsInfo("checkpoint", str(directory), None, count_parameters(model), weight_bytes(model),
                       time.perf_counter() - start, tuple(p.name for p in files), precision_label(model))


@torch.no_grad()
def init_synthetic(model: Qwen3ForCausalLM, seed: int = 0) -> WeightsInfo:
    """Random weights with the exact shapes, drawn on the device: N(0, 0.02) like HF's init, norms at 1. An fp8
    layer's weights are drawn as the float model's (same seed, same order, same values), then quantized."""
    start = time.perf_counter()
    device = model.lm_head.weight.device
    dtype = model.model.embed_tokens.weight.dtype
    modules = dict(model.named_modules())
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dtype == FP8:
            layer = modules[name.rpartition(".")[0]]
            drawn = torch.empty(p.shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=generator)
            q, scale = quantize(drawn, layer.block)
            p.copy_(q)
            layer.weight_scale.copy_(scale)
        else:
            p.normal_(0.0, 0.02, generator=generator)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return WeightsInfo("synthetic", f"synthetic (seed {seed})", seed, count_parameters(model), weight_bytes(model),
                       time.perf_counter() - start, quantization=precision_label(model))


@torch.no_grad()
def quantize_loaded_head(model: Qwen3ForCausalLM, info: WeightsInfo) -> WeightsInfo:
    """lm_head quantized to fp8 per output channel once its weights are in (quant.quantize_head), and the weights'
    record with it: their bytes (a tied head's fp8 copy on top of the embedding), the precision in words and the
    load time (the quantization counted in). The parameter count stays the model's."""
    start = time.perf_counter()
    quantize_head(model)
    if model.lm_head.weight.device.type == "cuda":
        torch.cuda.synchronize()
    return replace(info, bytes=weight_bytes(model), quantization=precision_label(model),
                   load_seconds=info.load_seconds + time.perf_counter() - start)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight: the parameters (fp8 ones at a byte each) and the fp8 layers' float32 scales."""
    scales = sum(m.weight_scale.numel() * m.weight_scale.element_size()
                 for m in model.modules() if isinstance(m, Fp8Linear))
    return sum(p.numel() * p.element_size() for p in model.parameters()) + scales


def hf_state_dict(model: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """The weights under HF names (views into the fused parameters): for HF reference models and checkpoints.
    An fp8 layer's scales are given in its own layout (per-channel, or its part's rows of blocks)."""
    return {name: slot.dest.data[slot.row:slot.row + slot.rows] for name, slot in checkpoint_slots(model).items()}
