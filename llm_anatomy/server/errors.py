"""Errors as OpenAI and vLLM send them: {"error": {"message", "type", "param", "code"}}, always JSON.

A body that fails validation is a 400 `invalid_request_error` naming the field in `param` (FastAPI's own
422 never reaches a client), an unknown route a 404, and anything unexpected a JSON 500 `server_error`:
never a plain-text page.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("llm_anatomy.server")


class APIError(Exception):
    """An error answered as OpenAI does."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(e: APIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def unavailable(message: str, code: str = "unavailable") -> APIError:
    return APIError(503, message, type="server_error", code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"
                   }.get(e.status_code, str(e.detail))
        return error_response(APIError(e.status_code, message, code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        # only query and path parameters get here (bodies are parsed by protocol.parse_body)
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("query", "path", "body")]
        return error_response(APIError(400, f"{'.'.join(loc) or 'request'}: {str(first.get('msg', e)).lower()}",
                                       param=loc[0] if loc else None, code="invalid_value"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(e).__name__}; the server keeps serving",
                                       type="server_error"))
