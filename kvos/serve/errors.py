"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

ECHO_LIMIT = 100
"""At most this many characters of any user input (a model name, a field name) are echoed back."""

MESSAGE_LIMIT = 2000
"""No error message is longer (a last guard against echoing large inputs)."""

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict", "bytes"})
"""Union-member tags pydantic puts into an error's ``loc`` (besides ``list[str]``-style ones)."""


def clip(value: object, limit: int = ECHO_LIMIT) -> str:
    """``str(value)``, cut to ``limit`` characters with an ellipsis: how user input is echoed."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "…"


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    """The OpenAI error body; ``message`` is clipped to ``MESSAGE_LIMIT`` and ``param`` to
    ``ECHO_LIMIT`` characters."""
    param = None if param is None else clip(param)
    body = {"error": {"message": clip(message, MESSAGE_LIMIT), "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


REQUEST_FIELD = {"prompt_token_ids": "prompt"}
"""The request field behind an engine (Python API) field a message names: a completions prompt
of token ids is the engine's ``prompt_token_ids``."""


def param_of_message(message: str) -> str | None:
    """Our ValueErrors start with the field they are about (``"max_tokens must be ..."``), named
    as the request names it."""
    head = message.split(" ", 1)[0].rstrip(":")
    if not head.replace("_", "").replace(".", "").replace("[", "").replace("]", "").isalnum():
        return None
    return REQUEST_FIELD.get(head, head)


def param_of_loc(loc: tuple | list) -> str | None:
    """The field a pydantic error's ``loc`` is about, as ``"messages.0.content"``: without the
    ``body`` root, union-member tags (``"str"``, ``"list[str]"``, ``"TextPart"``) and, for a bad
    dict key, the key itself (``logit_bias``, not ``logit_bias.<key>.[key]``)."""
    parts = [x for x in loc if x != "body"]
    if "[key]" in parts:
        parts = parts[:max(parts.index("[key]") - 1, 0)]
    kept = [str(x) for x in parts if isinstance(x, int) or _is_field_name(x)]
    return ".".join(kept) or None


def _is_field_name(part: object) -> bool:
    text = str(part)
    return (text not in _TYPE_TAGS and text[:1].islower() and text.replace("_", "").isalnum()
            and text.isascii())


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        """Every 400 names its field: the first error's ``loc`` or, for a model-level check, the
        field its message starts with."""
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return error_response(400, f"invalid JSON body: {first.get('msg')}", param=None, code="invalid_json")
        loc = tuple(first.get("loc", ()))
        param = param_of_loc(loc)
        if first.get("type") == "extra_forbidden" and loc:  # the last part is the client's own key
            param = ".".join(filter(None, (param_of_loc(loc[:-1]), clip(loc[-1]))))
            return error_response(400, f"Unrecognized request argument supplied: {param}", param=param)
        if param is None and first.get("type") == "value_error":  # a model-level check names its field first
            message = str(first.get("msg", "")).removeprefix("Value error, ")
            return error_response(400, message, param=param_of_message(message))
        details = dict.fromkeys(f"{param_of_loc(err.get('loc', ())) or 'body'}: "
                                f"{str(err.get('msg')).removeprefix('Value error, ')}"
                                for err in errors)  # union members repeat the same complaint
        detail = "; ".join(list(details)[:3])
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
