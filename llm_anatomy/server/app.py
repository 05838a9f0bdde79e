"""The HTTP side: an OpenAI-compatible FastAPI app over the engine loop, and `serve` to run it with uvicorn.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics,
GET /v1/anatomy/{id} (the full Anatomy JSON) and GET /anatomy/{id} (its HTML report). docs/server.md has
the details; every completion response carries an `x-anatomy-id` header.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..anatomy import Anatomy
from .loop import Call, EngineLoop, Progress
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_request, chunk, completion_body,
                       completion_request, logprobs_body, now_s, parse_body, split_tool_calls, usage)

log = logging.getLogger("llm_anatomy.server")
TOOL_CALL_START = "<tool_call>"


@dataclass
class ServeOptions:
    model_names: tuple[str, ...]  # names a request may give as `model` (the first is the one listed)
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    poll_disconnect_s: float = 0.25


def error_response(e: APIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class Guard:
    """Bearer auth on every route but /health, and a body size limit checked before the body is read. Plain
    ASGI (not BaseHTTPMiddleware, which hides a client's disconnect from the handlers)."""

    def __init__(self, app, options: ServeOptions):
        self.app, self.options = app, options

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = self.options.api_key
        if key and scope["path"] != "/health":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                response = error_response(APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                                   code="invalid_api_key"), {"www-authenticate": "Bearer"})
                return await response(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.options.max_body_bytes):
            response = error_response(APIError(413, f"the request body is larger than {self.options.max_body_bytes} "
                                                     f"bytes", code="request_too_large"))
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(loop: EngineLoop, options: ServeOptions, on_shutdown=None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        yield
        loop.stop()  # uvicorn has drained the in-flight requests by now
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="llm-anatomy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    engine = loop.engine
    # Every response says which weights wrote it: synthetic ones write text that is not the model's.
    fingerprint = f"llm-anatomy-{__version__}-{engine.weights.kind}"

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return error_response(APIError(e.status_code, message, code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return error_response(APIError(422, str(e.errors()[0].get("msg", e))))

    app.add_middleware(Guard, options=options)

    async def read_body(request: Request) -> bytes:
        """The body, refusing it once past the limit (a chunked body has no Content-Length to check first)."""
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > options.max_body_bytes:
                raise APIError(413, f"the request body is larger than {options.max_body_bytes} bytes",
                               code="request_too_large")
            parts.append(part)
        return b"".join(parts)

    def check_model(name: str) -> None:
        if name not in options.model_names:
            raise APIError(404, f"the model {name!r} does not exist here; this server serves "
                                f"{options.model_names[0]!r} (GET /v1/models)", param="model", code="model_not_found")

    async def completion(request: Request, chat: bool):
        received = time.perf_counter_ns()
        body = parse_body(await read_body(request), ChatCompletionRequest if chat else CompletionRequest)
        req = dataclasses.replace(chat_request(body) if chat else completion_request(body), fingerprint=fingerprint)
        check_model(req.model)
        first = await asyncio.to_thread(loop.prepare, req, received, asyncio.get_running_loop())
        calls = [first] + [loop.another_choice(first, i) for i in range(1, req.n)]
        for call in calls:
            loop.submit(call)
        headers = {"x-anatomy-id": ",".join(c.id for c in calls), "x-llm-anatomy-weights": engine.weights.kind}
        if req.stream:
            return StreamingResponse(stream(calls), media_type="text/event-stream",
                                     headers={**headers, "cache-control": "no-cache"})
        try:
            ends = await asyncio.gather(*(wait_done(c, request) for c in calls))
        finally:  # cancelled (shutdown), disconnected or failed: nothing of it keeps running
            for call in calls:
                loop.abort(call)
        if any(end is None for end in ends):  # the client went away
            return Response(status_code=499, headers=headers)
        failed = next((end for end in ends if isinstance(end, APIError)), None)
        if failed is not None:
            return error_response(failed, headers)
        out = None
        for i, (call, end) in enumerate(zip(calls, ends)):
            text = (call.prompt_text or "") + end.text if req.echo else end.text
            logprobs = None
            if end.logprobs is not None:
                logprobs = logprobs_body(req, engine.tokenizer, end.token_ids[:end.tokens],
                                         end.logprobs[:end.tokens])
            body_i = completion_body(req, first.id, now_s(), text, end.finish_reason, len(call.prompt_token_ids),
                                     end.tokens, logprobs)
            body_i["choices"][0]["index"] = i
            if out is None:
                out = body_i
            else:
                out["choices"] += body_i["choices"]
                out["usage"] = usage(len(first.prompt_token_ids), out["usage"]["completion_tokens"] + end.tokens)
        if req.want_anatomy:  # one summary, or a list of them (one per choice) when n > 1
            summaries = [await anatomy_of(c) for c in calls]
            out["anatomy"] = summaries[0] if req.n == 1 else summaries
        return JSONResponse(out, headers=headers)

    async def wait_done(call: Call, request: Request) -> Progress | APIError | None:
        """The call's final Progress (or error); None if the client disconnected first (the call is aborted)."""
        next_check = time.monotonic() + options.poll_disconnect_s
        while True:
            try:
                event = await asyncio.wait_for(call.events.get(), max(0.0, next_check - time.monotonic()))
                if isinstance(event, APIError) or (isinstance(event, Progress) and event.finish_reason is not None):
                    return event
            except asyncio.TimeoutError:
                pass
            if time.monotonic() >= next_check:
                if await request.is_disconnected():
                    loop.abort(call)
                    return None
                next_check = time.monotonic() + options.poll_disconnect_s

    async def anatomy_of(call: Call) -> dict | None:
        """The call's anatomy summary, waiting for the anatomy thread if it has not finished it yet."""
        while not call.anatomy_built:
            await call.events.get()  # the anatomy thread posts once it is done
        return call.anatomy

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def choice_stream(call: Call, key: str, created: int, index: int, tokens: list[int]):
        """One choice's SSE chunks, up to and with its finish reason; its output token count lands in tokens."""
        req = call.request
        sent, lp_sent = 0, 0
        want_logprobs = call.params.logprobs is not None

        def new_logprobs(event: Progress) -> dict | None:
            """Logprobs of the tokens since the last chunk that carried some."""
            nonlocal lp_sent
            if not want_logprobs or event.tokens <= lp_sent:
                return None
            body = logprobs_body(req, engine.tokenizer, event.token_ids[lp_sent:event.tokens],
                                 event.logprobs[lp_sent:event.tokens], offset=sent)
            lp_sent = event.tokens
            return body

        longest_stop = max((len(s) for s in call.params.stop), default=0)
        # A text chunk is sent per step per stream: its JSON is cut once around a marker, then only the text
        # is encoded each time (at 64 streams, dict building and dumping per chunk costs the GIL real time).
        marker = "\x00text\x00"
        head, tail = sse(chunk(req, key, created, text=marker, index=index)).split(json.dumps(marker))
        if req.chat:
            yield sse(chunk(req, key, created, role=True, index=index))
        elif req.echo and call.prompt_text:
            yield sse(chunk(req, key, created, text=call.prompt_text, index=index))
        while True:
            event = await call.events.get()
            if not isinstance(event, (Progress, APIError)):
                continue
            while isinstance(event, Progress) and not call.events.empty():  # the client fell behind: one chunk
                nxt = call.events.get_nowait()
                if isinstance(nxt, (Progress, APIError)):
                    event = nxt
            if isinstance(event, APIError):
                yield sse(event.body())
                return
            text = event.text
            if event.finish_reason is None:
                # Hold back what could still become a stop string (cut from the text) or a tool call.
                upto = len(text) - max(0, longest_stop - 1)
                if req.parse_tool_calls:
                    upto = min(upto, _before_tool_call(text))
                if upto > sent:
                    if want_logprobs:
                        yield sse(chunk(req, key, created, text=text[sent:upto], logprobs=new_logprobs(event),
                                        index=index))
                    else:
                        yield head + json.dumps(text[sent:upto], ensure_ascii=False) + tail
                    sent = upto
                continue
            rest, calls, reason = text[sent:], [], event.finish_reason
            if req.parse_tool_calls:
                content, calls = split_tool_calls(rest, call.id, None if req.parallel_tool_calls else 1)
                rest = content or ""
                reason = "tool_calls" if calls else reason
            rest_logprobs = new_logprobs(event)
            if rest or calls or rest_logprobs:
                yield sse(chunk(req, key, created, text=rest, tool_calls=calls, logprobs=rest_logprobs, index=index))
            tokens.append(event.tokens)
            yield sse(chunk(req, key, created, finish_reason=reason, index=index))
            return

    async def merged(streams: list):
        """Several choices' chunks as they come (n > 1)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(gen):
            try:
                async for item in gen:
                    await queue.put(item)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(g)) for g in streams]
        try:
            done = 0
            while done < len(tasks):
                item = await queue.get()
                if item is None:
                    done += 1
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def stream(calls: list[Call]):
        req, key, created = calls[0].request, calls[0].id, now_s()
        tokens: list[int] = []
        try:
            streams = [choice_stream(c, key, created, i, tokens) for i, c in enumerate(calls)]
            async for item in (streams[0] if len(streams) == 1 else merged(streams)):
                yield item
            if len(tokens) == len(calls):  # every choice finished (none failed)
                last = None
                if req.include_usage:
                    last = chunk(req, key, created, usage_=usage(len(calls[0].prompt_token_ids), sum(tokens)),
                                 no_choices=True)
                if req.want_anatomy:  # in the last chunk: one summary, or one per choice when n > 1
                    summaries = [await anatomy_of(c) for c in calls]
                    last = last or chunk(req, key, created, no_choices=True)
                    last["anatomy"] = summaries[0] if req.n == 1 else summaries
                if last is not None:
                    yield sse(last)
            yield "data: [DONE]\n\n"
        finally:
            for call in calls:
                loop.abort(call)  # a no-op once it has finished; frees its KV blocks if the client left

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": options.model_names[0], "object": "model", "created": int(loop.started_at), "owned_by": "llm-anatomy",
            "root": engine.source.name, "max_model_len": engine.max_model_len,
            "weights": engine.weights.kind}]}

    @app.get("/health")
    async def health():
        if not loop.alive:
            return JSONResponse({"status": "error", "error": loop.error or "the engine loop is not running"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(loop.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def stored(anatomy_id: str) -> str:
        text = await asyncio.to_thread(loop.store.get, anatomy_id)
        if text is None:
            raise APIError(404, f"no anatomy {anatomy_id!r}: unknown id, or older than the {loop.store.keep} kept",
                           param="id", code="not_found")
        return text

    @app.get("/v1/anatomy")
    async def anatomy_list(limit: int = 20):
        """The newest anatomies, newest first, each as its summary."""
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be in 1..100, got {limit}", param="limit")

        def newest() -> list[dict]:
            out = []
            for anatomy_id in reversed(loop.store.ids()[-limit:]):
                text = loop.store.get(anatomy_id, wait_s=0)
                if text is not None:
                    out.append(Anatomy.from_json(text).summary())
            return out

        return {"object": "list", "data": await asyncio.to_thread(newest)}

    @app.get("/v1/anatomy/{anatomy_id}")
    async def anatomy_json(anatomy_id: str):
        return Response(await stored(anatomy_id), media_type="application/json")

    @app.get("/anatomy/{anatomy_id}")
    async def anatomy_html(anatomy_id: str):
        from ..report.html import render_html

        anatomy = Anatomy.from_json(await stored(anatomy_id))
        return HTMLResponse(await asyncio.to_thread(render_html, anatomy))

    return app


def _before_tool_call(text: str) -> int:
    """Where streamed content must stop: at a tool-call block, or at a partial '<tool_call>' at the end."""
    i = text.find(TOOL_CALL_START)
    if i >= 0:
        return i
    for k in range(len(TOOL_CALL_START) - 1, 0, -1):
        if text.endswith(TOOL_CALL_START[:k]):
            return len(text) - k
    return len(text)


def build_server(engine, *, host: str, port: int, model_names: tuple[str, ...], ceilings, run_dir,
                 keep_anatomies: int = 1000, api_key: str | None = None, max_body_bytes: int = 4 << 20,
                 device_why: str = "", telemetry_hz: float | None = 50.0, drain_timeout_s: float = 120.0,
                 log_level: str = "warning"):
    """The uvicorn server and its engine loop (started and stopped by the app's lifespan)."""
    import uvicorn

    from ..probe.telemetry import TelemetryStream, nvml_status
    from .metrics import Metrics
    from .store import AnatomyStore

    available, note = nvml_status(engine.device) if telemetry_hz else (False, "telemetry turned off")
    telemetry = TelemetryStream(engine.device, telemetry_hz) if available else None
    store = AnatomyStore(run_dir, keep_anatomies)
    if telemetry is not None:
        telemetry.start()
    loop = EngineLoop(engine, ceilings, store, Metrics(model_names[0], engine, telemetry), telemetry, note,
                      device_why)

    def close() -> None:
        if telemetry is not None:
            telemetry.stop()
        store.close()

    app = create_app(loop, ServeOptions(model_names, api_key, max_body_bytes), on_shutdown=close)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout_s)
    return uvicorn.Server(config), loop


def serve(engine, sockets=None, **options) -> None:
    """Run the server until SIGINT or SIGTERM: in-flight requests are drained (up to `drain_timeout_s`), then
    the engine loop stops and the files close. (uvicorn then re-raises the signal, so that the process's
    exit status says what ended it.)"""
    server, _ = build_server(engine, **options)
    server.run(sockets=sockets)
