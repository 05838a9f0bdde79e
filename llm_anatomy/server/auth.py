"""Who may call the server, and whose anatomies a caller may read.

With API keys, every route but /health needs `Authorization: Bearer KEY`. Keys are kept only as salted
hashes (HMAC-SHA256 with a random salt stored in the run directory, so that the same key owns the same records
after a restart); the hash of the key that made a call is the owner of its anatomy, and only that key can read
it. Without keys every record is readable, as on a server bound to localhost.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from ..errors import AnatomyError
from .context import Drain
from .errors import APIError, error_response

OWNER = "llm_anatomy.owner"  # the ASGI scope key holding the caller's owner hash (None without keys)
SALT_FILE = "owner-salt"
SALT_BYTES = 32
UNCOUNTED = ("/health", "/metrics")  # probes: not work a drain waits for


def load_salt(run_dir: str | os.PathLike) -> bytes:
    """The run directory's salt, created (readable by this user only) on first use."""
    path = Path(run_dir).expanduser() / SALT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(SALT_BYTES))
    salt = path.read_bytes()
    if len(salt) != SALT_BYTES:
        raise AnatomyError(f"{path} is damaged ({len(salt)} bytes, not {SALT_BYTES}); delete it (the anatomies made "
                           f"with keys so far then become unreadable) and start again")
    return salt


def read_key_file(path: str | os.PathLike) -> list[str]:
    """API keys from a file, one a line; blank lines and lines starting with # are skipped."""
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise AnatomyError(f"--api-key-file {path}: cannot read it ({e})") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise AnatomyError(f"--api-key-file {path} holds no key (one a line; # starts a comment)")
    return keys


def api_keys(given: list[str] | None, key_file: str | os.PathLike | None, environment: str | None) -> tuple[str, ...]:
    """The keys a server takes: each --api-key, those of --api-key-file, else $LLM_ANATOMY_API_KEY's one."""
    keys = list(given or [])
    if key_file is not None:
        keys += read_key_file(key_file)
    if not keys and environment:
        keys = [environment]
    for key in keys:
        if not key.strip():
            raise AnatomyError("--api-key is empty; give a key, or leave it out to serve without one")
        if key != key.strip() or any(c.isspace() for c in key):
            raise AnatomyError("an API key cannot hold spaces (a Bearer token is one word)")
    return tuple(dict.fromkeys(keys))


class Keys:
    """The accepted keys as salted hashes; a key's hash is the owner of the anatomies its calls make."""

    def __init__(self, keys: tuple[str, ...], salt: bytes):
        self._salt = salt
        self._owners = tuple(self.owner(k) for k in keys)

    def owner(self, key: str) -> str:
        return hmac.new(self._salt, key.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:32]

    @property
    def required(self) -> bool:
        return bool(self._owners)

    def check(self, token: str) -> str | None:
        """The owner of this token, or None if it is not an accepted key (every hash compared, in constant time)."""
        presented, found = self.owner(token), None
        for owner in self._owners:
            if hmac.compare_digest(owner, presented):
                found = owner
        return found


class Guard:
    """Bearer auth on every route but /health, a body size limit checked before the body is read, and the count
    of requests in flight that a drain waits for. Plain ASGI (not BaseHTTPMiddleware, which hides a client's
    disconnect from the handlers)."""

    def __init__(self, app, keys: Keys, max_body_bytes: int, drain: Drain):
        self.app, self.keys, self.max_body_bytes, self.drain = app, keys, max_body_bytes, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = {k.lower(): v for k, v in scope["headers"] if k.lower() in (b"authorization", b"content-length")}
        scope[OWNER] = None
        if self.keys.required and path != "/health":
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            owner = self.keys.check(token.strip()) if scheme.lower() == "bearer" else None
            if owner is None:
                response = error_response(APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                                   code="invalid_api_key"), {"www-authenticate": "Bearer"})
                return await response(scope, receive, send)
            scope[OWNER] = owner
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or len(length) > 18 or int(length) > self.max_body_bytes):
            response = error_response(APIError(413, f"the request body is larger than {self.max_body_bytes} bytes",
                                               code="request_too_large"))
            return await response(scope, receive, send)
        if path in UNCOUNTED:
            return await self.app(scope, receive, send)
        self.drain.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.active -= 1
