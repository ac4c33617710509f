"""The server's ASGI guards, around every route (plugins' too): the key on WebSockets, the ``Host`` a request
names, the body's size, and the last words of a request a forced shutdown cancels.

HTTP requests have their key checked (and are counted) by the app's own middleware (``app.build_app``); a
WebSocket never reaches an HTTP middleware, so ``KeyOnWebSockets`` checks its handshake.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pluginhost.server.errors import APIError
from pluginhost.server.protocol import ErrorBody, ErrorResponse

__all__ = [
    "LAST_WORDS_S",
    "WRONG_KEY",
    "AnswerWhenCancelled",
    "BodyTooLarge",
    "KeyOnWebSockets",
    "LimitBody",
    "OnlyHosts",
    "host_name",
    "key_matches",
]

logger = logging.getLogger(__name__)

WRONG_KEY = "Missing or wrong API key: send the key given to --api-key as 'Authorization: Bearer KEY'."


def key_matches(headers: Headers, expected: bytes) -> bool:
    """Whether ``Authorization`` is ``Bearer`` and the key: the scheme case-insensitive (RFC 9110), the key compared
    in constant time, as the bytes sent (headers arrive decoded as Latin-1; ``expected`` is the key's UTF-8)."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("latin-1"), expected)


class KeyOnWebSockets:
    """The API key on a WebSocket's opening handshake: a connection without it is closed (1008, policy violation)
    before any route runs, which the client sees as the handshake refused (HTTP 403)."""

    def __init__(self, app: ASGIApp, expected: bytes) -> None:
        self.app, self.expected = app, expected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and not key_matches(Headers(scope=scope), self.expected):
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008, "reason": WRONG_KEY})
            return
        await self.app(scope, receive, send)


class OnlyHosts:
    """Requests and WebSockets whose ``Host`` header names one of ``hosts`` (any port); none: not a browser's."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str]) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = Headers(scope=scope).get("host") if scope["type"] in ("http", "websocket") else None
        name = host_name(given) if given is not None else None
        # *.localhost is this machine's by definition (RFC 6761: browsers resolve it to loopback themselves).
        if name is None or name in self.hosts or name == "localhost" or name.endswith(".localhost"):
            await self.app(scope, receive, send)
            return
        message = (
            f"Host {given!r} is not a name of this server, which listens on this machine only: a web page of "
            f"another site whose name was made to point here would send that. Use {sorted(self.hosts)[0]}, or serve "
            "with --allowed-host NAME (a proxy on this machine) or --host (other machines) to be reached by other "
            "names."
        )
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
            return
        await APIError(400, message, type="invalid_request_error", code="invalid_host").response()(scope, receive, send)


def host_name(host: str) -> str:
    """``Host``'s name, without its port: ``localhost:8000`` -> ``localhost``, ``[::1]:8000`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return name.removesuffix(".")  # "localhost." is "localhost", fully qualified


class BodyTooLarge(StarletteHTTPException):
    """A request body over the limit: raised where a route reads it (FastAPI passes HTTP errors on as they are)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"Invalid request: the body is larger than {limit} bytes ({limit / 2**20:g} MiB), the most this server "
            "reads: send shorter prompts, or fewer per request",
        )


class LimitBody:
    """Refuses a request body over ``limit`` bytes: at once when its Content-Length says so, else once it has sent more.

    Nothing is kept beyond the limit, so a client cannot make the server hold a body of any size in memory, and
    the connection is closed after the answer (``closing``), so the rest is not read either.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        received = 0

        async def limited() -> Message:
            nonlocal received
            if declared is not None and declared > self.limit:
                raise BodyTooLarge(self.limit)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses such a request before it gets here
    return None


class AnswerWhenCancelled:
    """A request cancelled mid-answer (the server forced to quit) still ends as the API says, and is not logged.

    uvicorn logged each as "Exception in ASGI application" with a traceback and answered a plain-text 500.
    Here an answer not yet begun is a 503 error object (``code: shutting_down``); a stream that has begun
    ends with an error event and ``data: [DONE]``. The cancellation ends there: uvicorn cancels a request
    only as it quits (its graceful timeout, or a forced exit). These last words get ``LAST_WORDS_S`` at
    most: a client that stopped reading would otherwise hold the process for ever, as the task is not
    cancelled again.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "stream": False, "done": False}

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers", ())).get(b"content-type", b"")
                state["started"], state["stream"] = True, content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if not state["done"]:
                await _answer_cancelled(scope, receive, send, started=state["started"], stream=state["stream"])


async def _answer_cancelled(scope: Scope, receive: Receive, send: Send, *, started: bool, stream: bool) -> None:
    """End the answer of a request cancelled by a forced shutdown as well as what was sent of it allows."""
    error = ErrorBody(
        message="the server was stopped before this request was answered", type="server_error", code="shutting_down"
    )
    try:
        if not started:
            answer = JSONResponse(ErrorResponse(error=error).model_dump(), status_code=503)(scope, receive, send)
        else:  # a stream's events are whole (one per body message), so one more follows the last
            events = f"data: {json.dumps({'error': error.model_dump()})}\n\ndata: [DONE]\n\n" if stream else ""
            answer = send({"type": "http.response.body", "body": events.encode(), "more_body": False})
        await asyncio.wait_for(answer, LAST_WORDS_S)
    except Exception:  # noqa: BLE001 - the client is gone already, or reads nothing: nothing is left to tell it
        logger.debug("could not end the answer of a cancelled request", exc_info=True)


#: How long a request cut short by a forced shutdown may take to send its last words.
LAST_WORDS_S = 1.0
