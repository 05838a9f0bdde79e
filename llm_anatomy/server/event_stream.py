"""A streamed response's bytes written with as little work per chunk as can be: at hundreds of streams the event
loop writes hundreds of chunks per engine step, and Starlette's StreamingResponse spends more on each (its task
group's wrappers around every resume, a type check and a dict per chunk) than the chunk costs to make."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import Response


class EventStream(Response):
    """The lines of an async generator (str), each sent as its own chunk as soon as it comes, with Starlette's
    StreamingResponse's headers. A client that goes away ends the stream at once, as Starlette's does: the generator
    is cancelled where it waits, so its cleanup runs (the response then ends without error)."""

    def __init__(self, lines: AsyncIterator[str], headers: dict[str, str], media_type: str = "text/event-stream"):
        self.lines = lines
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope, receive, send) -> None:
        writing = asyncio.ensure_future(self._write(send))
        listening = asyncio.ensure_future(_disconnect(receive))
        try:
            await asyncio.wait((writing, listening), return_when=asyncio.FIRST_COMPLETED)
        finally:  # written, the client gone, or this response cancelled (shutdown): the other one ends too
            listening.cancel()
            writing.cancel()
            await asyncio.wait((writing, listening))
        if not writing.cancelled():
            writing.result()  # the generator's error, if it raised one

    async def _write(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for line in self.lines:
            await send({"type": "http.response.body", "body": line.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnect(receive) -> None:
    """Returns once the client has gone (the request's body was read before the response started)."""
    while (await receive())["type"] != "http.disconnect":
        pass
