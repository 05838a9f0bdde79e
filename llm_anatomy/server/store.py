"""Anatomies of served calls: one JSON line each in RUN_DIR/anatomies.jsonl, the newest `keep` of them.

The file is appended to as calls finish and read back at start, so a restart keeps earlier anatomies. When
it holds a quarter more than `keep` lines it is rewritten with the newest `keep` (atomically: a new file,
then a rename). An id whose anatomy is still being built can be waited for.

A record made with an API key carries its owner (the key's salted hash, never the key) in a wrapper,
`{"id": ..., "owner": ..., "anatomy": {...}}`; one made without a key is the bare anatomy. Either way `get`
returns the anatomy's own JSON, sliced from the line without parsing it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from ..anatomy import Anatomy

log = logging.getLogger("llm_anatomy.server")


class AnatomyStore:
    def __init__(self, run_dir: str | os.PathLike, keep: int = 1000):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.dir = Path(run_dir).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "anatomies.jsonl"
        self.keep = keep
        # id -> (offset, length) of its anatomy's JSON in the file, and its owner; oldest first
        self._index: OrderedDict[str, tuple[int, int, str | None]] = OrderedDict()
        self._pending: dict[str, str | None] = {}  # ids being built -> their owners
        self._lock = threading.Condition()
        self._lines = 0
        self._load()
        self._file = open(self.path, "ab")

    def _load(self) -> None:
        if not self.path.exists():
            return
        offset, bad, torn = 0, 0, False
        with open(self.path, "rb") as f:
            for line in f:
                torn = not line.endswith(b"\n")
                try:
                    record = json.loads(line)
                    anatomy_id, wrapped = record["id"], "anatomy" in record
                    owner = record["owner"] if wrapped else None
                    head = _wrapper_head(anatomy_id, owner) if wrapped else b""
                    if not line.startswith(head):
                        raise ValueError("not a record this store wrote")
                    tail = len(line) - len(line.rstrip(b"\n")) + (1 if wrapped else 0)  # newline, wrapper's brace
                    self._index[anatomy_id] = (offset + len(head), len(line) - len(head) - tail, owner)
                    self._index.move_to_end(anatomy_id)
                except (ValueError, KeyError, TypeError, AttributeError):
                    bad += 1  # a line cut short by a crash: skipped, dropped at the next compaction
                offset += len(line)
                self._lines += 1
        if bad:
            log.warning("%s: skipped %d unreadable line(s)", self.path, bad)
        if torn:
            with open(self.path, "ab") as f:  # a torn last line must not swallow the next record
                f.write(b"\n")
        while len(self._index) > self.keep:
            self._index.popitem(last=False)

    def __len__(self) -> int:
        return len(self._index)

    def ids(self, owner: str | None = None) -> list[str]:
        """Ids, oldest first: all of them, or those whose owner is `owner` when one is given."""
        with self._lock:
            return [i for i, (_, _, o) in self._index.items() if owner is None or o == owner]

    def owner_of(self, anatomy_id: str) -> tuple[bool, str | None]:
        """(whether the id is stored or being built, its owner)."""
        with self._lock:
            if anatomy_id in self._index:
                return True, self._index[anatomy_id][2]
            if anatomy_id in self._pending:
                return True, self._pending[anatomy_id]
            return False, None

    def expect(self, anatomy_id: str, owner: str | None = None) -> None:
        """An anatomy for this id is being built: `get` waits for it rather than saying it does not exist."""
        with self._lock:
            self._pending[anatomy_id] = owner

    def give_up(self, anatomy_id: str) -> None:
        with self._lock:
            self._pending.pop(anatomy_id, None)
            self._lock.notify_all()

    def add(self, anatomy: Anatomy, owner: str | None = None) -> None:
        self.add_json(anatomy.id, anatomy.to_json().encode(), owner)

    def add_json(self, anatomy_id: str, body: bytes, owner: str | None = None) -> None:
        """An anatomy already turned into JSON (Anatomy.to_json, encoded), where it was built."""
        head = _wrapper_head(anatomy_id, owner) if owner is not None else b""
        line = head + body + (_WRAPPER_TAIL if owner is not None else b"\n")
        with self._lock:
            offset = self._file.seek(0, os.SEEK_END)
            self._file.write(line)
            self._file.flush()
            self._index[anatomy_id] = (offset + len(head), len(body), owner)
            self._lines += 1
            while len(self._index) > self.keep:
                self._index.popitem(last=False)
            if self._lines > self.keep + max(1, self.keep // 4):
                self._compact()
            self._pending.pop(anatomy_id, None)
            self._lock.notify_all()

    def _compact(self) -> None:
        """Rewrite the file with the records still indexed (the newest `keep`). Called with the lock held."""
        tmp = self.path.with_suffix(".jsonl.tmp")
        index = OrderedDict()
        with open(self.path, "rb") as src, open(tmp, "wb") as dst:
            for anatomy_id, (offset, length, owner) in self._index.items():
                src.seek(offset)
                head = _wrapper_head(anatomy_id, owner) if owner is not None else b""
                index[anatomy_id] = (dst.tell() + len(head), length, owner)
                dst.write(head + src.read(length) + (_WRAPPER_TAIL if owner is not None else b"\n"))
            dst.flush()
            os.fsync(dst.fileno())
        self._file.close()
        os.replace(tmp, self.path)
        self._file = open(self.path, "ab")
        self._index, self._lines = index, len(index)

    def get(self, anatomy_id: str, wait_s: float = 10.0) -> str | None:
        """The anatomy's JSON text, or None if there is none (waiting up to `wait_s` for one being built)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while anatomy_id in self._pending and anatomy_id not in self._index:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(left)
            where = self._index.get(anatomy_id)
            if where is None:
                return None
            with open(self.path, "rb") as f:
                f.seek(where[0])
                return f.read(where[1]).decode()

    def close(self) -> None:
        with self._lock:
            self._file.close()


_WRAPPER_TAIL = b"}\n"


def _wrapper_head(anatomy_id: str, owner: str | None) -> bytes:
    return f'{{"id": {json.dumps(anatomy_id)}, "owner": {json.dumps(owner)}, "anatomy": '.encode()
