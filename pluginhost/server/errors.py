"""OpenAI's error object, and what is wrong with a request said in one sentence.

Every error the server answers is ``{"error": {"message", "type", "param", "code"}}`` (``APIError``); a body
pydantic refuses becomes one message naming each field and what is wrong with it, or what is wrong with the body
as a whole (not JSON, with line and column; not an object; not UTF-8; no body), never FastAPI's 422.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from fastapi.responses import JSONResponse, Response

from pluginhost.server.protocol import ErrorBody, ErrorResponse, FieldError

__all__ = ["APIError", "bad_request", "closing", "describe_validation", "first_param", "not_utf8"]

_R = TypeVar("_R", bound=Response)


class APIError(Exception):
    """An error answered as OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.type, self.code, self.param, self.headers = status, type, code, param, headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorBody(message=str(self), type=self.type, param=self.param, code=self.code))
        return _ErrorJSON(body.model_dump(), status_code=self.status, headers=self.headers)


class _ErrorJSON(JSONResponse):
    """An error body in ASCII JSON: a message quoting what the client sent (a model name holding a lone surrogate,
    JSON's ``"\\udce9"``) is still one UTF-8 can carry."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code=code)


def closing(response: _R) -> _R:
    """``response``, closing the connection after it: the body it refuses is not read to its end for nothing."""
    response.headers["connection"] = "close"
    return response


def describe_validation(errors: Sequence[Any], body: Any, content_type: str | None) -> str:
    """``Invalid request: `` and each error, as ``field.path: message`` when it is about a field.

    A problem of the whole body (not JSON, not an object, none) is said as such, and a ``FieldError``'s
    message names its field already: neither is prefixed with "body".
    """
    parts = [_body_problem(error, body, content_type) or _field_problem(error) for error in errors]
    return "Invalid request: " + "; ".join(parts)


def _field_problem(error: Mapping[str, Any]) -> str:
    """``field.path: message`` (pydantic's "Value error, " dropped), or a ``FieldError``'s message alone."""
    where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
    message = error.get("msg", "invalid").removeprefix("Value error, ")
    if error.get("type") == "extra_forbidden":
        message = "unknown field"
    if not where and isinstance(_raised(error), FieldError):
        return message
    return f"{where or 'body'}: {message}"


def _body_problem(error: Mapping[str, Any], body: Any, content_type: str | None) -> str | None:
    """What is wrong with the body as a whole, if that is what ``error`` is about; else None."""
    if error.get("type") == "json_invalid":
        return _json_problem(error, body)
    if tuple(error.get("loc", ())) != ("body",) or isinstance(_raised(error), ValueError):
        return None  # a field's error, or a model validator's refusal
    if error.get("type") == "string_unicode":  # a key: pydantic cannot take it as a field's name
        return f"a field's name in the body is not valid Unicode ({error.get('input')!r}, a lone surrogate)"
    if error.get("type") == "missing":
        return "the request has no body: send a JSON object, with Content-Type: application/json"
    if isinstance(error.get("input"), bytes):  # FastAPI parses a body as JSON only when its Content-Type says JSON
        given = f"Content-Type {content_type}" if content_type else "no Content-Type"
        return f"the body must be JSON sent with Content-Type: application/json (this request has {given})"
    return f"the body must be a JSON object, not {_json_kind(error.get('input'))}"


def _json_problem(error: Mapping[str, Any], body: Any) -> str:
    """Where the body stops being JSON: line and column (1-based, as editors count) from FastAPI's character offset."""
    at = error.get("loc", ())[-1]
    reason = _raised(error) or "JSON decode error"
    if isinstance(body, str) and isinstance(at, int):  # FastAPI gives the decoded text as the error's body
        line, column = body.count("\n", 0, at) + 1, at - body.rfind("\n", 0, at)
        return f"the body is not valid JSON: {reason} at line {line}, column {column} (character {at})"
    return f"the body is not valid JSON: {reason} at character {at}"


def _raised(error: Mapping[str, Any]) -> Any:  # noqa: ANN401 - an exception, or pydantic's text for one
    """What a pydantic error carries in its context: the exception a validator raised, or a JSON error's reason."""
    return (error.get("ctx") or {}).get("error")


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    kinds = {list: "an array", str: "a string", int: "a number", float: "a number"}
    return next((name for kind, name in kinds.items() if isinstance(value, kind)), type(value).__name__)


def not_utf8(error: UnicodeDecodeError) -> str:
    byte = error.object[error.start]
    return (
        f"Invalid request: the body is not valid UTF-8 JSON: byte {byte:#04x} at offset {error.start}, {error.reason}"
    )


def first_param(errors: Sequence[Any]) -> str | None:
    """The request's field the first error about one is in (a ``FieldError`` names its own)."""
    for error in errors:
        if error.get("type") == "json_invalid":  # its location is a character offset, no field
            continue
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        if loc:
            return loc[0]
        refused = _raised(error)  # a model validator's error has no location
        if isinstance(refused, FieldError):
            return refused.field
    return None
