"""Anatomies of served calls, the newest `keep` of them, in RUN_DIR/anatomies.db (SQLite).

SQLite because the server may take requests in several HTTP processes (`--api-server-count`): each writes the
anatomies of its own calls to the same database, and any of them answers GET /v1/anatomy/{id}, whichever took
the call in. The database is kept across restarts. One table, `anatomies`: `seq` (the order they were stored
in), `id`, `owner` (the salted hash of the API key that made the call, never the key; NULL without keys) and
`json` (the anatomy, as Anatomy.to_json wrote it; NULL while it is being built, so that a GET from any process
waits for it rather than saying it does not exist).

    sqlite3 RUN_DIR/anatomies.db "select json from anatomies order by seq" > anatomies.jsonl

A run directory of an earlier version holds anatomies.jsonl instead: its records are taken in once, and the file
renamed anatomies.jsonl.imported.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

from ..anatomy import Anatomy

log = logging.getLogger("llm_anatomy.server")
BUSY_TIMEOUT_MS = 10_000  # how long a write waits for another process's (each takes well under a millisecond)
POLL_S = (0.005, 0.05)  # a GET of an anatomy being built looks again after 5 ms, then twice as long, up to 50 ms


class AnatomyStore:
    def __init__(self, run_dir: str | os.PathLike, keep: int = 1000, clear_pending: bool = True):
        """`clear_pending`: forget anatomies marked as being built (by a server that stopped before it built
        them); the first process of a server does, the other HTTP processes, started after it, do not."""
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        self.dir = Path(run_dir).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "anatomies.db"
        self.keep = keep
        self._lock = threading.Lock()  # one connection, shared by the reading thread and the routes' workers
        self._closed = False
        self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1e3, check_same_thread=False,
                                   isolation_level=None)  # autocommit: each statement its own transaction
        self._db.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer, nor it for them
        self._db.execute("PRAGMA synchronous=NORMAL")  # a power cut may lose the last anatomies, never the file
        self._db.execute("CREATE TABLE IF NOT EXISTS anatomies (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                         "id TEXT NOT NULL UNIQUE, owner TEXT, json BLOB)")
        if clear_pending:
            self._db.execute("DELETE FROM anatomies WHERE json IS NULL")
        self._import_jsonl(self.dir / "anatomies.jsonl")
        with self._lock:
            self._trim()

    def __len__(self) -> int:
        return self._one("SELECT count(*) FROM anatomies WHERE json IS NOT NULL")[0]

    def ids(self, owner: str | None = None) -> list[str]:
        """Ids, oldest first: all of them, or those whose owner is `owner` when one is given."""
        with self._lock:
            if owner is None:
                rows = self._db.execute("SELECT id FROM anatomies WHERE json IS NOT NULL ORDER BY seq")
            else:
                rows = self._db.execute("SELECT id FROM anatomies WHERE json IS NOT NULL AND owner = ? ORDER BY seq",
                                        (owner,))
            return [r[0] for r in rows.fetchall()]

    def owner_of(self, anatomy_id: str) -> tuple[bool, str | None]:
        """(whether the id is stored or being built, its owner)."""
        row = self._one("SELECT owner FROM anatomies WHERE id = ?", (anatomy_id,))
        return (True, row[0]) if row is not None else (False, None)

    def expect(self, anatomy_id: str, owner: str | None = None) -> None:
        """An anatomy for this id is being built: `get` (in any process) waits for it rather than saying it does
        not exist."""
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO anatomies (id, owner) VALUES (?, ?)", (anatomy_id, owner))

    def give_up(self, anatomy_id: str) -> None:
        """It will not be built after all (a no-op once the store is closed: a server failing its last calls)."""
        with self._lock:
            if self._closed:
                return
            self._db.execute("DELETE FROM anatomies WHERE id = ? AND json IS NULL", (anatomy_id,))

    def add(self, anatomy: Anatomy, owner: str | None = None) -> None:
        self.add_json(anatomy.id, anatomy.to_json().encode(), owner)

    def add_json(self, anatomy_id: str, body: bytes, owner: str | None = None) -> None:
        """An anatomy already turned into JSON (Anatomy.to_json, encoded), where it was built. The oldest beyond
        `keep` go."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO anatomies (id, owner, json) VALUES (?, ?, ?)",
                             (anatomy_id, owner, body))
            self._trim()

    def _trim(self) -> None:
        """Called with the lock held."""
        self._db.execute("DELETE FROM anatomies WHERE json IS NOT NULL AND seq <= (SELECT seq FROM anatomies "
                         "WHERE json IS NOT NULL ORDER BY seq DESC LIMIT 1 OFFSET ?)", (self.keep,))

    def get(self, anatomy_id: str, wait_s: float = 10.0) -> str | None:
        """The anatomy's JSON text, or None if there is none (waiting up to `wait_s` for one being built, here or
        in another of the server's processes)."""
        deadline, pause = time.monotonic() + wait_s, POLL_S[0]
        while True:
            row = self._one("SELECT json FROM anatomies WHERE id = ?", (anatomy_id,))
            if row is None:
                return None
            if row[0] is not None:
                return bytes(row[0]).decode()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(2 * pause, POLL_S[1])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._db.close()

    def _one(self, sql: str, args: tuple = ()):
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _import_jsonl(self, path: Path) -> None:
        """Take in the records of an earlier version's anatomies.jsonl (a bare anatomy a line, or {"id", "owner",
        "anatomy"} for one made with a key), then rename it, so that this happens once."""
        if not path.exists():
            return
        rows, bad = [], 0
        with open(path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                    if "anatomy" in record:
                        rows.append((record["id"], record["owner"], json.dumps(record["anatomy"]).encode()))
                    else:
                        rows.append((record["id"], None, line.rstrip(b"\n")))
                except (ValueError, KeyError, TypeError):
                    bad += 1  # a line cut short by a crash
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("INSERT OR REPLACE INTO anatomies (id, owner, json) VALUES (?, ?, ?)", rows)
            self._db.execute("COMMIT")
        os.replace(path, path.with_name(path.name + ".imported"))
        log.warning("%s: %d anatomies taken into %s%s", path, len(rows), self.path.name,
                    f" ({bad} unreadable line(s) skipped)" if bad else "")
