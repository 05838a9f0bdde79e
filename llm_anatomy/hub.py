"""Where a model name points: a local directory, a hub id in the local Hugging Face cache, or a preset.

Never touches the network: hub ids are looked up with `local_files_only=True`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from .errors import ConfigError, ModelNotFoundError


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for, normalised to a hub id for presets
    config: dict  # HF config.json fields
    directory: Path | None  # where config/tokenizer/weights live, None for a bare preset
    origin: str  # "directory" | "hf-cache" | "preset" | "config-file"


@cache
def presets() -> dict[str, dict]:
    """Qwen3 config.json values by hub id, plus `_family_facts`; see data/PROVENANCE.md."""
    text = resources.files("llm_anatomy").joinpath("data/qwen3_configs.json").read_text()
    return json.loads(text)


def preset_names() -> list[str]:
    return [k for k in presets() if not k.startswith("_")]


def _preset_key(name: str) -> str | None:
    lowered = name.lower()
    for key in preset_names():
        if lowered in (key.lower(), key.split("/")[1].lower()):
            return key
    return None


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot directory of a hub repo that holds a config.json, or None. Never downloads."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/")):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None
    return path if (path / "config.json").is_file() else None


def resolve(name_or_path: str | os.PathLike) -> ModelSource:
    """Find the model: a directory with config.json, a config.json file, a cached hub id, or a preset."""
    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory but holds no config.json")
        return ModelSource(name, read_json(path / "config.json"), path, "directory")
    if path.is_file():
        if path.suffix != ".json":
            raise ModelNotFoundError(f"{path} is a file but not a config.json; give a model directory")
        return ModelSource(name, read_json(path), None, "config-file")
    key = _preset_key(name)
    snapshot = cached_snapshot(key or name)
    if snapshot is not None:
        return ModelSource(key or name, read_json(snapshot / "config.json"), snapshot, "hf-cache")
    if key is not None:
        config = {k: v for k, v in presets()[key].items() if not k.startswith("_")}
        return ModelSource(key, config, None, "preset")
    raise ModelNotFoundError(
        f"unknown model {name!r}: not a local directory, not in the local Hugging Face cache, "
        f"and not a preset ({', '.join(preset_names())})"
    )
