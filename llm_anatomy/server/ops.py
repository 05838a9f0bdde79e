"""GET /v1/models, GET /health and GET /metrics: what the server serves, whether it can, and how it does; POST
/start_profile and /stop_profile (vLLM's names): torch.profiler over the engine core between them, with
`serve --profile-dir` (probe/timeline.py)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from .context import ServerContext
from .errors import APIError

PROFILE_ERRORS = {400: "invalid_value", 404: "profiler_off", 409: "profile_state", 500: "profile_failed"}


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

    async def profile(action: str):
        status, answer = await ctx.loop.profile(action)
        if status != 200:
            raise APIError(status, answer, type="server_error" if status >= 500 else "invalid_request_error",
                           code=PROFILE_ERRORS.get(status))
        return answer

    @router.post("/start_profile")
    async def start_profile():
        """Profile the engine core from now on (cut after probe.timeline.PROFILE_MAX_S)."""
        return await profile("start")

    @router.post("/stop_profile")
    async def stop_profile():
        """End the window: its trace written under --profile-dir, its summary in the answer."""
        return await profile("stop")

    return router
