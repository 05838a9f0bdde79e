"""GET /v1/anatomy (the caller's newest anatomies), GET /v1/anatomy/{id} (one, as JSON) and GET /anatomy/{id}
(its HTML report). With API keys a caller sees only the anatomies its own key made: any other id is a 404,
whether it exists or not."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from ..anatomy import Anatomy
from .auth import OWNER
from .context import ServerContext
from .errors import APIError

MAX_LIST = 100
# The HTML report is one self-contained page: its scripts and styles are inline (plotly.js included), its
# images data: URIs. Nothing else may load, nothing may frame it, no form may post from it.
REPORT_CSP = ("default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; "
              "img-src data: blob:; font-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
REPORT_HEADERS = {"content-security-policy": REPORT_CSP, "x-content-type-options": "nosniff",
                  "referrer-policy": "no-referrer", "cache-control": "private, no-store"}


def routes(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/anatomy")
    async def anatomy_list(request: Request, limit: int = 20):
        """The caller's newest anatomies, newest first, each as its summary."""
        if not 1 <= limit <= MAX_LIST:
            raise APIError(400, f"limit must be in 1..{MAX_LIST}, got {limit}", param="limit", code="invalid_value")
        owner = request.scope.get(OWNER) if ctx.keys.required else None
        return {"object": "list", "data": await asyncio.to_thread(newest, ctx, owner, limit)}

    @router.get("/v1/anatomy/{anatomy_id}")
    async def anatomy_json(request: Request, anatomy_id: str):
        return Response(await stored(ctx, request, anatomy_id), media_type="application/json")

    @router.get("/anatomy/{anatomy_id}")
    async def anatomy_html(request: Request, anatomy_id: str):
        from ..report.html import render_html

        anatomy = Anatomy.from_json(await stored(ctx, request, anatomy_id))
        return HTMLResponse(await asyncio.to_thread(render_html, anatomy), headers=REPORT_HEADERS)

    return router


def newest(ctx: ServerContext, owner: str | None, limit: int) -> list[dict]:
    store, out = ctx.loop.store, []
    for anatomy_id in reversed(store.ids(owner)[-limit:]):
        text = store.get(anatomy_id, wait_s=0)
        if text is not None:
            out.append(Anatomy.from_json(text).summary())
    return out


async def stored(ctx: ServerContext, request: Request, anatomy_id: str) -> str:
    """The anatomy's JSON, if the caller may read it (built now if the builder had not got to it yet)."""
    store = ctx.loop.store
    known, owner = store.owner_of(anatomy_id)
    text = None
    if known and (not ctx.keys.required or owner == request.scope.get(OWNER)):
        ctx.loop.want(anatomy_id)
        text = await asyncio.to_thread(store.get, anatomy_id)
    if text is None:
        raise APIError(404, f"no anatomy {anatomy_id[:64]!r} for this key: unknown id, made with another key, or "
                            f"older than the {store.keep} kept", param="id", code="not_found")
    return text
