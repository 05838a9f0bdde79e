"""The streamed response's own parts, driven as ASGI apps without a socket: EventStream (bytes, headers, a client
that goes away, a generator that fails), the pre-cut SSE chunks against json.dumps, and the collector's setting
while serving."""

import asyncio
import gc
import json
import types

import pytest
from starlette.responses import StreamingResponse

from llm_anatomy.server.app import collector_while_serving
from llm_anatomy.server.event_stream import EventStream
from llm_anatomy.server.responses import TextChunks, chunk, sse, usage

HEADERS = {"x-anatomy-id": "abc", "x-llm-anatomy-weights": "synthetic", "cache-control": "no-cache"}
HOSTILE = ["plain", 'quo"te', "back\\slash", "new\nline\r\ttab", "\x00\x1f\x7f", "é 漢字 🙂", "\u2028\u2029",
           "\ud800", "a\udfffb", "</script>", "\\u0000", "\x00text\x00"]


async def run_app(app, disconnect_after: int | None = None) -> list[dict]:
    """Call `app` as uvicorn would; the client goes away after `disconnect_after` body messages (None: never)."""
    sent: list[dict] = []
    gone = asyncio.Event()
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        bodies = sum(m["type"] == "http.response.body" for m in sent)
        if disconnect_after is not None and bodies >= disconnect_after:
            gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "headers": []}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


async def lines(n: int, log: list, fail: bool = False):
    try:
        for i in range(n):
            await asyncio.sleep(0)
            yield f"data: {i} é\n\n"
        if fail:
            raise RuntimeError("the generator failed")
    finally:
        log.append("cleaned up")


def test_event_stream_writes_what_starlettes_streaming_response_writes():
    ours = asyncio.run(run_app(EventStream(lines(5, []), headers=HEADERS)))
    theirs = asyncio.run(run_app(StreamingResponse(lines(5, []), media_type="text/event-stream", headers=HEADERS)))
    assert ours == theirs
    assert (b"content-type", b"text/event-stream; charset=utf-8") in ours[0]["headers"]
    assert [m.get("body") for m in ours[1:]] == [f"data: {i} é\n\n".encode() for i in range(5)] + [b""]


def test_event_stream_ends_its_generator_when_the_client_goes_away():
    log: list = []
    sent = asyncio.run(run_app(EventStream(lines(10_000, log), headers=HEADERS), disconnect_after=3))
    assert log == ["cleaned up"]  # the generator's cleanup ran (the server aborts the calls there)
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert 3 <= len(bodies) < 10 and all(m["more_body"] for m in bodies)  # ended, no closing message


def test_event_stream_raises_what_its_generator_raises():
    log: list = []
    with pytest.raises(RuntimeError, match="the generator failed"):
        asyncio.run(run_app(EventStream(lines(2, log, fail=True), headers=HEADERS)))
    assert log == ["cleaned up"]


def test_event_stream_cancelled_cancels_its_generator():
    log: list = []

    async def cancel_midway():
        task = asyncio.ensure_future(run_app(EventStream(lines(10_000, log), headers=HEADERS)))
        for _ in range(20):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    assert log == ["cleaned up"]


def request(chat: bool, continuous: bool):
    return types.SimpleNamespace(chat=chat, model="m\"odel", fingerprint="fp\\1", include_usage=continuous,
                                 continuous_usage=continuous)


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("continuous", [True, False])
@pytest.mark.parametrize("text", HOSTILE)
def test_a_pre_cut_chunk_is_the_json_dumps_chunk(chat, continuous, text):
    """(A stream cuts a chunk only for new text, never an empty one.)"""
    req = request(chat, continuous)
    chunks = TextChunks(req, "id1", 1700000000, 2, 17)
    so_far = usage(17, 5) if continuous else None
    expected = sse(chunk(req, "id1", 1700000000, text=text, index=2, usage_=so_far))
    assert chunks.line(text, 5) == expected
    if "\ud800" not in text and "\udfff" not in text:  # a lone surrogate is not JSON a client can read back
        body = json.loads(expected[len("data: "):])
        assert (body["choices"][0]["delta"]["content"] if chat else body["choices"][0]["text"]) == text


def test_the_collector_setting_holds_while_serving_and_is_put_back():
    before = gc.get_threshold()
    with collector_while_serving(12_345):
        assert gc.get_threshold() == (12_345, *before[1:])
    assert gc.get_threshold() == before
    with pytest.raises(KeyError), collector_while_serving(54_321):
        raise KeyError("a failure while serving")
    assert gc.get_threshold() == before
    with collector_while_serving(None):
        assert gc.get_threshold() == before
