"""What every route of the server shares: its options, its engine client, its keys and its drain state."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .auth import Keys
    from .core import EngineInfo
    from .loop import EngineClient

log = logging.getLogger("llm_anatomy.server")
MAX_API_SERVERS = 64  # HTTP processes of one server at most (--api-server-count)
MAX_WARNED = 256  # ignored field names remembered (a client inventing names must not grow memory)


@dataclass(frozen=True)
class ServeOptions:
    model_names: tuple[str, ...]  # names a request may give as `model` (the first is the one listed)
    max_body_bytes: int = 4 << 20
    poll_disconnect_s: float = 0.25  # how often a whole-answer request checks that its client is still there


@dataclass
class Drain:
    """SIGTERM or SIGINT: new completions are refused (503), /health says draining, the requests in flight
    finish (up to `timeout_s`), then the server stops."""

    timeout_s: float
    since: float | None = None  # time.monotonic() when the drain began
    active: int = 0  # HTTP requests in flight, probes (/health, /metrics) not counted

    @property
    def draining(self) -> bool:
        return self.since is not None

    def begin(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    def finished(self) -> bool:
        return self.since is not None and (self.active == 0 or time.monotonic() - self.since > self.timeout_s)


@dataclass
class ServerContext:
    loop: "EngineClient"  # the engine core, as the routes see it
    options: ServeOptions
    keys: "Keys"
    drain: Drain
    fingerprint: str  # every response's system_fingerprint: this server's version and its weights' kind
    warned: set[str] = field(default_factory=set)

    @property
    def info(self) -> "EngineInfo":
        return self.loop.info

    def note_ignored(self, names: list[str]) -> None:
        """Log request fields this server ignores, once per name (as vLLM warns of them)."""
        fresh = [n for n in names if n not in self.warned]
        if fresh and len(self.warned) < MAX_WARNED:
            self.warned.update(fresh)
            log.warning("request fields ignored (not part of the API this server implements): %s", ", ".join(fresh))
