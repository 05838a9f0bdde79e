"""POST /v1/chat/completions and POST /v1/completions: one call per choice on the engine core, answered whole
or streamed as server-sent events. Every response carries `x-anatomy-id`."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .auth import OWNER
from .context import ServerContext
from .errors import APIError, error_response, unavailable
from .event_stream import EventStream
from .loop import Call, Progress
from .protocol import ChatCompletionRequest, CompletionRequest, chat_request, completion_request, parse_body
from .responses import (TextChunks, before_tool_call, chunk, completion_body, logprobs_body, now_s, split_tool_calls,
                        sse, usage)

# Bodies up to this size are parsed, templated and tokenized on the event loop (a fraction of a millisecond at this
# size), larger ones in a worker thread so that a long prompt does not hold up the streams. One interpreter takes a
# burst's requests in one after the other, and handing a small request to a thread and back costs it more than
# preparing the request (benchmarks/README.md has the A/B).
INLINE_BODY_BYTES = 8 << 10


def routes(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(ctx, request, chat=True)

    @router.post("/v1/completions")
    async def completions(request: Request):
        return await completion(ctx, request, chat=False)

    return router


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing it once past the limit (a chunked body has no Content-Length to check first)."""
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        parts.append(part)
    return b"".join(parts)


def prepare(ctx: ServerContext, raw: bytes, chat: bool, received_ns: int, owner: str | None) -> Call:
    """Parse, check, template and tokenize (a large body in a worker thread: see INLINE_BODY_BYTES)."""
    body = parse_body(raw, ChatCompletionRequest if chat else CompletionRequest)
    req = dataclasses.replace(chat_request(body) if chat else completion_request(body), fingerprint=ctx.fingerprint)
    if req.model not in ctx.options.model_names:
        raise APIError(404, f"the model {req.model[:200]!r} does not exist here; this server serves "
                            f"{ctx.options.model_names[0]!r} (GET /v1/models)", param="model", code="model_not_found")
    ctx.note_ignored(req.shown.get("ignored_fields", []))
    return ctx.loop.prepare(req, received_ns, owner)


async def completion(ctx: ServerContext, request: Request, chat: bool) -> Response:
    received = time.perf_counter_ns()
    if ctx.drain.draining:
        raise unavailable("the server is draining: it finishes the requests in flight and takes no new ones",
                          code="draining")
    raw = await read_body(request, ctx.options.max_body_bytes)
    owner = request.scope.get(OWNER)
    if len(raw) <= INLINE_BODY_BYTES:
        first = prepare(ctx, raw, chat, received, owner)
    else:
        first = await asyncio.to_thread(prepare, ctx, raw, chat, received, owner)
    calls = [first] + [ctx.loop.another_choice(first, i) for i in range(1, first.request.n)]
    try:
        for call in calls:
            ctx.loop.submit(call)
    except APIError:
        for call in calls:
            ctx.loop.abort(call)
        raise
    headers = {"x-anatomy-id": ",".join(c.id for c in calls), "x-llm-anatomy-weights": ctx.info.weights_kind}
    if first.request.stream:
        return EventStream(stream(ctx, calls), headers={**headers, "cache-control": "no-cache"})
    try:
        ends = await asyncio.gather(*(wait_done(ctx, c, request) for c in calls))
    finally:  # cancelled (shutdown), disconnected or failed: nothing of it keeps running
        for call in calls:
            ctx.loop.abort(call)
    if any(end is None for end in ends):  # the client went away
        return Response(status_code=499, headers=headers)
    failed = next((end for end in ends if isinstance(end, APIError)), None)
    if failed is not None:
        return error_response(failed, headers)
    return JSONResponse(await whole_answer(ctx, calls, ends), headers=headers)


async def whole_answer(ctx: ServerContext, calls: list[Call], ends: list[Progress]) -> dict:
    first, req, tokenizer = calls[0], calls[0].request, ctx.info.tokenizer
    out = None
    for i, (call, end) in enumerate(zip(calls, ends)):
        text = (call.prompt_text or "") + end.text if req.echo else end.text
        logprobs = None
        if end.logprobs is not None:
            logprobs = logprobs_body(req, tokenizer, end.token_ids[:end.tokens], end.logprobs[:end.tokens])
        body = completion_body(req, first.id, now_s(), text, end.finish_reason, len(call.prompt_token_ids),
                               end.tokens, logprobs)
        body["choices"][0]["index"] = i
        if out is None:
            out = body
        else:
            out["choices"] += body["choices"]
            out["usage"] = usage(len(first.prompt_token_ids), out["usage"]["completion_tokens"] + end.tokens)
    if req.want_anatomy:  # one summary, or a list of them (one per choice) when n > 1
        summaries = [await anatomy_of(ctx, c) for c in calls]
        out["anatomy"] = summaries[0] if req.n == 1 else summaries
    return out


async def wait_done(ctx: ServerContext, call: Call, request: Request) -> Progress | APIError | None:
    """The call's final Progress (or error); None if the client disconnected first (the call is aborted)."""
    poll = ctx.options.poll_disconnect_s
    next_check = time.monotonic() + poll
    while True:
        for event in await call.events.take(max(0.0, next_check - time.monotonic())):
            if isinstance(event, APIError) or (isinstance(event, Progress) and event.finish_reason is not None):
                return event
        if time.monotonic() >= next_check:
            if await request.is_disconnected():
                ctx.loop.abort(call)
                return None
            next_check = time.monotonic() + poll


async def anatomy_of(ctx: ServerContext, call: Call) -> dict | None:
    """The call's anatomy summary, asking the builder for it first and waiting until it is built."""
    ctx.loop.want(call.id)
    while not call.anatomy_built:
        await call.events.take()  # the builder posts once it is done
    return call.anatomy


class ChoiceStream:
    """One choice's SSE lines, up to and with its finish reason (`tokens` then holds its output token count)."""

    def __init__(self, ctx: ServerContext, call: Call, key: str, created: int, index: int):
        self.ctx, self.call, self.req = ctx, call, call.request
        self.key, self.created, self.index = key, created, index
        self.prompt_tokens = len(call.prompt_token_ids)
        self.sent, self.logprobs_sent = 0, 0  # characters, tokens
        self.tokens: int | None = None
        self.over = False  # its last line (the finish reason, or an error) is out
        self.want_logprobs = call.params.logprobs is not None
        self.text_chunks = TextChunks(self.req, key, created, index, self.prompt_tokens)

    def _chunk(self, tokens: int, **kw) -> str:
        so_far = usage(self.prompt_tokens, tokens) if self.req.continuous_usage else None
        return sse(chunk(self.req, self.key, self.created, index=self.index, usage_=so_far, **kw))

    def _new_logprobs(self, event: Progress) -> dict | None:
        """Logprobs of the tokens since the last chunk that carried some."""
        if not self.want_logprobs or event.tokens <= self.logprobs_sent:
            return None
        body = logprobs_body(self.req, self.ctx.info.tokenizer, event.token_ids[self.logprobs_sent:event.tokens],
                             event.logprobs[self.logprobs_sent:event.tokens], offset=self.sent)
        self.logprobs_sent = event.tokens
        return body

    def opening(self) -> list[str]:
        """The lines before any token: the chat's role, or the echoed prompt."""
        if self.req.chat:
            return [self._chunk(0, role=True)]
        if self.req.echo and self.call.prompt_text:
            return [self._chunk(0, text=self.call.prompt_text)]
        return []

    def lines_for(self, items: list) -> list[str]:
        """The lines for what arrived in the call's mailbox: one chunk for the newest progress (a client that fell
        behind gets one chunk for all of it), or the error, or the last lines (`over` is then set)."""
        event = None
        for item in items:
            if isinstance(item, APIError):
                event = item
                break
            if isinstance(item, Progress):
                event = item
        if event is None:
            return []
        if isinstance(event, APIError):
            self.over = True
            return [sse(event.body())]
        if event.finish_reason is not None:
            self.over = True
            return self._last(event)
        # What could still become a stop string never arrives before the call ends (the engine core holds it back,
        # server/core.py); what could still become a tool call is held back here.
        text = event.text
        upto = len(text)
        if self.req.parse_tool_calls:
            upto = min(upto, before_tool_call(text))
        if upto <= self.sent:
            return []
        if self.want_logprobs:
            line = self._chunk(event.tokens, text=text[self.sent:upto], logprobs=self._new_logprobs(event))
        else:
            line = self.text_chunks.line(text[self.sent:upto], event.tokens)
        self.sent = upto
        return [line]

    async def lines(self):
        for line in self.opening():
            yield line
        events = self.call.events
        while not self.over:
            for line in self.lines_for(await events.take()):
                yield line

    def _last(self, event: Progress) -> list[str]:
        rest, calls, reason = event.text[self.sent:], [], event.finish_reason
        if self.req.parse_tool_calls:
            content, calls = split_tool_calls(rest, self.call.id, None if self.req.parallel_tool_calls else 1)
            rest = content or ""
            reason = "tool_calls" if calls else reason
        lines = []
        rest_logprobs = self._new_logprobs(event)
        if rest or calls or rest_logprobs:
            lines.append(self._chunk(event.tokens, text=rest, tool_calls=calls, logprobs=rest_logprobs))
        self.tokens = event.tokens
        lines.append(self._chunk(event.tokens, finish_reason=reason))
        return lines


async def merged(streams: list):
    """Several choices' lines as they come (n > 1)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(lines):
        try:
            async for line in lines:
                await queue.put(line)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        done = 0
        while done < len(tasks):
            line = await queue.get()
            if line is None:
                done += 1
            else:
                yield line
    finally:
        for task in tasks:
            task.cancel()


async def stream(ctx: ServerContext, calls: list[Call]):
    req, key, created = calls[0].request, calls[0].id, now_s()
    try:
        choices = [ChoiceStream(ctx, c, key, created, i) for i, c in enumerate(calls)]
        if len(choices) == 1:  # its lines made here, not in a generator of their own: this runs per stream per step
            choice, events = choices[0], calls[0].events
            for line in choice.opening():
                yield line
            while not choice.over:
                for line in choice.lines_for(await events.take()):
                    yield line
        else:
            async for line in merged([c.lines() for c in choices]):
                yield line
        if all(c.tokens is not None for c in choices):  # every choice finished (none failed)
            last = None
            if req.include_usage:
                last = chunk(req, key, created, usage_=usage(len(calls[0].prompt_token_ids),
                                                             sum(c.tokens for c in choices)), no_choices=True)
            if req.want_anatomy:  # in the last chunk: one summary, or one per choice when n > 1
                summaries = [await anatomy_of(ctx, c) for c in calls]
                last = last or chunk(req, key, created, no_choices=True)
                last["anatomy"] = summaries[0] if req.n == 1 else summaries
            if last is not None:
                yield sse(last)
        yield "data: [DONE]\n\n"
    finally:
        for call in calls:
            ctx.loop.abort(call)  # a no-op once it has finished; frees its KV blocks if the client left
