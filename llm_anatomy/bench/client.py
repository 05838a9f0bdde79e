"""One streamed request, timed from the client's side, and the pre-flight checks of a server.

Timing follows vLLM's benchmark (vllm/benchmarks/lib/endpoint_request_func.py): the clock starts just before
the request is sent; each server-sent event is stamped when the bytes that complete it are read. One
difference: a chunk that carries no output (a chat stream's opening `role` chunk, which some servers send
before any token is computed) is not taken as the first token. TTFT is the first chunk carrying output
(text, content, reasoning or tool calls); ITL the gaps between consecutive such chunks; e2e ends at the last
chunk that has choices (the one with the finish reason).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from ..errors import AnatomyError
from .datasets import Prompt

PREFLIGHT_TIMEOUT_S = 5.0  # an unreachable server or one that does not answer fails within this
CONNECT_TIMEOUT_S = 10.0  # per connection during a run
ERROR_TEXT_CHARS = 160  # of a server's error message kept as the reason


class BenchError(AnatomyError):
    """A benchmark that cannot run as asked (unreachable server, one that does not speak the API...)."""


@dataclass
class RequestResult:
    ok: bool
    start_s: float  # perf_counter when sent
    sent_unix: float | None = None  # the wall clock when sent (set beside an llm-anatomy server's started_at_unix)
    # the wall clock when its headers went to the connection (aiohttp's trace): the client's own part of the way ends
    handed_unix: float | None = None
    error: str | None = None  # the reason, when not ok
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    end_s: float | None = None  # perf_counter at the last byte read (for the level's duration)
    output_tokens: int = 0
    tokens_from_usage: bool = False
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    anatomy_id: str | None = None


@dataclass(frozen=True)
class RequestShape:
    """What every request of a run carries besides its prompt."""

    endpoint: str  # "completions" or "chat"
    model: str
    ignore_eos: bool = True
    include_usage: bool = True

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def payload(self, prompt: Prompt) -> dict:
        body: dict = {"model": self.model, "max_tokens": prompt.output_tokens, "stream": True}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt.text}]
        else:
            body["prompt"] = list(prompt.token_ids) if prompt.token_ids is not None else prompt.text
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension (also SGLang's and llm-anatomy's)
        return body


def new_session(connections: int, read_timeout_s: float | None, api_key: str | None,
                connect_timeout_s: float = CONNECT_TIMEOUT_S) -> aiohttp.ClientSession:
    """One client for a whole level. `connections` (0: no limit) is at least the number of requests in flight,
    so no request ever waits for a connection inside the client, which would add to its TTFT."""
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=connections, keepalive_timeout=60,
                                     ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    handover = aiohttp.TraceConfig()
    handover.on_request_headers_sent.append(_headers_sent)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers, trace_configs=[handover])


async def _headers_sent(session, context, params) -> None:
    """aiohttp's trace as a request's headers are written to its connection: its result (the request's trace
    context) takes the wall clock. Until then the time is the client's own (its event loop, its connection pool)."""
    if isinstance(context.trace_request_ctx, RequestResult):
        context.trace_request_ctx.handed_unix = time.time()


class SSEBuffer:
    """Splits a byte stream into server-sent events' data fields (lines `data: ...`; comments and other fields
    are dropped; CRLF line ends accepted)."""

    def __init__(self):
        self.buffer = b""

    def feed(self, data: bytes) -> list[str]:
        data = self.buffer + data
        cr = data.endswith(b"\r")  # maybe half a CR-LF: kept until the next read says
        *events, rest = (data[:-1] if cr else data).replace(b"\r\n", b"\n").split(b"\n\n")
        self.buffer = rest + (b"\r" if cr else b"")
        out = []
        for event in events:
            lines = [ln[5:].removeprefix(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines).decode("utf-8"))
        return out


async def get_text(session: aiohttp.ClientSession, url: str, what: str,
                   reasons: dict[int, str] | None = None) -> tuple[str | None, str | None]:
    """(the body of a GET, None), or (None, why not): an HTTP status (`reasons` words some) or a failed request.
    `what` names the request in the reason ("GET /metrics")."""
    try:
        async with session.get(url) as r:
            if r.status != 200:
                return None, (reasons or {}).get(r.status) or f"{what} answered HTTP {r.status}"
            return await r.text(), None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return None, f"{what} failed: {type(e).__name__}"


def _has_output(choice: dict) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                or delta.get("tool_calls"))


def _error_message(body: bytes) -> str:
    """The message of an error body: OpenAI's {"error": {"message"}}, vLLM's {"message"}, FastAPI's {"detail"},
    or the start of the body as it is."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        err = data.get("error") if isinstance(data.get("error"), dict) else data
        for key in ("message", "detail", "error"):
            if isinstance(err.get(key), str):
                text = err[key]
                break
    return " ".join(text.split())[:ERROR_TEXT_CHARS]


def _error_reason(status: int, body: bytes) -> str:
    """'HTTP 500: <the server's message>'."""
    message = _error_message(body)
    return f"HTTP {status}: {message}" if message else f"HTTP {status}"


def _exception_reason(e: BaseException, read_timeout_s: float | None) -> str:
    if isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return f"timeout: no byte from the server for {read_timeout_s:g} s"
    if isinstance(e, aiohttp.ClientConnectorError):
        if isinstance(e.os_error, ConnectionRefusedError):
            return f"connection refused by {e.host}:{e.port} (is the server running?)"
        return f"cannot connect to {e.host}:{e.port} ({e.os_error.strerror or e.os_error})"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    if isinstance(e, aiohttp.ClientPayloadError):
        return "the response was cut off"
    if isinstance(e, json.JSONDecodeError):
        return "a streamed chunk is not JSON"
    if isinstance(e, UnicodeDecodeError):
        return "a streamed chunk is not UTF-8"
    return f"{type(e).__name__}: {e}"[:ERROR_TEXT_CHARS]


async def stream_request(session: aiohttp.ClientSession, base_url: str, shape: RequestShape, prompt: Prompt,
                         read_timeout_s: float | None = None) -> RequestResult:
    """Send one streamed request and time its chunks. Never raises for what the server does: a failure is a
    result with its reason."""
    payload = shape.payload(prompt)
    start = time.perf_counter()
    result = RequestResult(ok=False, start_s=start, sent_unix=time.time())
    last_choice_t = prev = start
    chunks = 0
    finished = done = False
    try:
        async with session.post(base_url + shape.path, json=payload, trace_request_ctx=result) as response:
            result.anatomy_id = response.headers.get("x-anatomy-id")
            if response.status != 200:
                result.error = _error_reason(response.status, await response.content.read(4096))
                result.end_s = time.perf_counter()
                return result
            sse = SSEBuffer()
            async for data in response.content.iter_any():
                now = time.perf_counter()
                for event in sse.feed(data):
                    if event == "[DONE]":
                        done = True
                        continue
                    obj = json.loads(event)
                    if not isinstance(obj, dict):
                        continue
                    if obj.get("error") is not None:
                        result.error = "error in the stream: " + _error_message(event.encode())
                        result.end_s = now
                        return result
                    usage = obj.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        result.output_tokens, result.tokens_from_usage = int(usage["completion_tokens"]), True
                        result.prompt_tokens = usage.get("prompt_tokens")
                    choices = obj.get("choices")
                    if not choices:
                        continue
                    last_choice_t = now
                    choice = choices[0]
                    if choice.get("finish_reason"):
                        finished, result.finish_reason = True, choice["finish_reason"]
                    if _has_output(choice):
                        if result.ttft_s is None:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - prev)
                        prev = now
                        chunks += 1
            result.end_s = time.perf_counter()
    except Exception as e:  # noqa: BLE001 - every failure is counted with its reason, the run goes on
        result.error, result.end_s = _exception_reason(e, read_timeout_s), time.perf_counter()
        return result
    if result.ttft_s is None:
        result.error = "the stream carried no output" + ("" if finished or done else " and ended early")
        return result
    if not (finished or done):
        result.error = "the stream ended before its finish reason or [DONE]"
        return result
    if not result.tokens_from_usage:
        result.output_tokens = chunks  # a chunk may hold several tokens: a lower bound
    result.ok, result.e2e_s = True, last_choice_t - start
    return result


async def list_models(base_url: str, api_key: str | None) -> list[dict]:
    """GET /v1/models within PREFLIGHT_TIMEOUT_S; BenchError with one clear line if the server is unreachable or
    does not answer as an OpenAI-compatible server does."""
    where = f"{base_url}/v1/models"
    try:
        async with new_session(1, PREFLIGHT_TIMEOUT_S, api_key, PREFLIGHT_TIMEOUT_S) as session:
            async with session.get(where, timeout=aiohttp.ClientTimeout(total=PREFLIGHT_TIMEOUT_S)) as r:
                body = await r.read()
                status = r.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise BenchError(f"cannot reach {base_url}: {_exception_reason(e, PREFLIGHT_TIMEOUT_S)}") from None
    if status == 401:
        raise BenchError(f"{where} answered HTTP 401: the server wants an API key (--api-key, or $OPENAI_API_KEY)")
    if status != 200:
        raise BenchError(f"{where} answered {_error_reason(status, body)}: is this an OpenAI-compatible server?")
    try:
        data = json.loads(body)["data"]
        models = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise BenchError(f"{where} did not answer with a model list: {base_url} does not speak the OpenAI API") \
            from None
    if not models:
        raise BenchError(f"{where} lists no model: the server has nothing to serve")
    return models


async def probe(base_url: str, shape: RequestShape, prompt: Prompt, api_key: str | None,
                read_timeout_s: float) -> tuple[RequestShape, RequestResult, list[str]]:
    """One short streamed request before the run: it checks that the endpoint works, drops the extensions the
    server refuses (ignore_eos, then stream_options) and says so. Returns the shape to use, the probe's result
    and notes; BenchError if no shape works."""
    short = Prompt(min(prompt.output_tokens, 4), prompt.token_ids, prompt.text)
    tries = dict.fromkeys([(shape.ignore_eos, shape.include_usage), (False, shape.include_usage),
                           (shape.ignore_eos, False), (False, False)])
    first_error = None
    async with new_session(1, read_timeout_s, api_key, PREFLIGHT_TIMEOUT_S) as session:
        for ignore_eos, include_usage in tries:
            attempt = RequestShape(shape.endpoint, shape.model, ignore_eos, include_usage)
            result = await stream_request(session, base_url, attempt, short, read_timeout_s)
            if result.ok:
                notes = []
                if shape.ignore_eos and not ignore_eos:
                    notes.append(f"the server refused ignore_eos ({first_error}): sent without it, so outputs "
                                 "may stop before --output-tokens")
                if shape.include_usage and not include_usage:
                    notes.append(f"the server refused stream_options ({first_error}): output tokens are counted "
                                 "from the streamed chunks")
                return attempt, result, notes
            first_error = first_error or result.error
            if not result.error.startswith(("HTTP 400", "HTTP 422")):
                break  # not a refused field: dropping one will not help
    raise BenchError(f"POST {base_url}{shape.path} failed: {first_error}")
