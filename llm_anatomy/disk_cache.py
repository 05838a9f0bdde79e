"""Small JSON caches kept across runs under $XDG_CACHE_HOME/llm-anatomy (~/.cache when unset): the device's
measured ceilings, the decode GEMVs' tuned tiles. Each file holds {"format": n, "entries": {key: object}}; a
file that is absent, unreadable, corrupt or of another format reads as empty, and writes are atomic."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def cache_file(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """$XDG_CACHE_HOME/llm-anatomy/<name> (~/.cache when unset), or cache_dir/<name>."""
    if cache_dir is not None:
        return Path(cache_dir) / name
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llm-anatomy" / name


def read_entries(path: Path, fmt: int) -> dict[str, dict]:
    """The file's entries that are objects under string keys; {} for anything unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(data, dict) or data.get("format") != fmt or not isinstance(data.get("entries"), dict):
        return {}
    return {k: v for k, v in data["entries"].items() if isinstance(k, str) and isinstance(v, dict)}


def write_entry(path: Path, fmt: int, key: str, entry: dict) -> Path:
    """Set one entry (the others kept; a corrupt file replaced). Atomic: a reader sees the old file or the new."""
    entries = read_entries(path, fmt)
    entries[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"format": fmt, "entries": entries}, indent=2, sort_keys=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
