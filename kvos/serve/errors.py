"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def param_of_message(message: str) -> str | None:
    """Our ValueErrors start with the field they are about (``"max_tokens must be ..."``)."""
    head = message.split(" ", 1)[0].rstrip(":")
    return head if head.replace("_", "").replace(".", "").replace("[", "").replace("]", "").isalnum() else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if param is None and first.get("type") == "value_error":  # a model-level check names its field first
            param = param_of_message(str(first.get("msg", "")).removeprefix("Value error, "))
        if first.get("type") == "json_invalid":
            return error_response(400, f"invalid JSON body: {first.get('msg')}", param=None, code="invalid_json")
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"Unrecognized request argument supplied: {param}", param=param)
        detail = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: "
                           f"{err.get('msg')}" for err in errors[:3])
        return error_response(400, detail, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), type_, headers=getattr(e, "headers", None))

    @app.exception_handler(ValueError)
    async def _value(_: Request, e: ValueError):
        return error_response(400, str(e), param=param_of_message(str(e)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        # runs outside the app's middleware (Starlette's ServerErrorMiddleware): set the request id here
        rid = request.scope.get("state", {}).get("request_id")
        return error_response(500, f"internal error: {type(e).__name__}", "internal_error",
                              headers={"x-request-id": rid} if rid else None)
