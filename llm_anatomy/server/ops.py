"""GET /v1/models, GET /health and GET /metrics: what the server serves, whether it can, and how it does."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from .context import ServerContext


def routes(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    info = ctx.info

    @router.get("/v1/models")
    async def models():
        # max_model_len: the longest prompt + max_tokens a request may have here (the KV pool may hold less
        # than the model's context)
        return {"object": "list", "data": [{
            "id": ctx.options.model_names[0], "object": "model", "created": int(ctx.loop.started_at),
            "owned_by": "llm-anatomy", "root": info.name, "parent": None,
            "max_model_len": ctx.loop.accepted_len, "weights": info.weights_kind}]}

    @router.get("/health")
    async def health():
        if ctx.drain.draining:
            return JSONResponse({"status": "draining", "message": "finishing the requests in flight, taking no new "
                                 "ones", "in_flight": ctx.drain.active}, 503)
        why = ctx.loop.unhealthy()
        if why is not None:
            return JSONResponse({"status": "error", "error": why}, 503)
        return {"status": "ok"}

    @router.get("/metrics")
    async def metrics():
        return Response(ctx.loop.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return router
