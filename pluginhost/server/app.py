"""The OpenAI-compatible HTTP API over an ``AsyncLLM``, on FastAPI.

Routes: ``GET /health``, ``GET /v1/models`` (and ``/v1/models/{name}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` (messages through the tokenizer's chat
template), ``GET /metrics`` (Prometheus). ``stream: true`` answers
Server-Sent Events: ``data: {json}\\n\\n`` chunks, then ``data: [DONE]\\n\\n``.

Every error is OpenAI's error object ``{"error": {"message", "type", "param",
"code"}}``: 400 for a bad request (pydantic's validation included, never
FastAPI's 422; ``param`` names the request's field, and a prompt too long for
the model has ``code`` ``context_length_exceeded``, as OpenAI answers), 401 for
a missing or wrong key when an API key is set (checked on every route, plugins'
too), 404 for an unknown model or route, 503 when the engine's queue is full
or the engine has stopped for good (a tensor-parallel rank lost; ``/health``
then answers 503 too), 500 when the model fails. A stream that has begun ends with an error chunk
instead, then ``[DONE]``. A client that goes away aborts its requests, which
frees their rows at the next engine step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from pluginhost.engine.async_llm import AsyncLLM, RequestStream
from pluginhost.errors import (
    EngineOverloadedError,
    InvalidParameterError,
    KVCacheMemoryError,
    ModelRunError,
    PluginhostError,
    PromptTooLongError,
    RequestRefusedError,
    TensorParallelError,
)
from pluginhost.outputs import CompletionOutput, RequestOutput
from pluginhost.sampling import SamplingParams
from pluginhost.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from pluginhost.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    ErrorResponse,
    FieldError,
    UsageInfo,
    now,
    random_id,
)
from pluginhost.tokenizer import token_bytes

__all__ = ["APIError", "BUILTIN_ROUTES", "bad_request", "build_app"]

logger = logging.getLogger(__name__)

#: The paths the server itself answers; a plugin's route may not take them.
BUILTIN_ROUTES = (
    "/health",
    "/v1/models",
    "/v1/models/{model:path}",  # registered after the plugins' routes (it takes every path below), yet reserved
    "/v1/completions",
    "/v1/chat/completions",
    "/metrics",
)


class APIError(Exception):
    """An error answered as OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type, code, param

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorBody(message=str(self), type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code=code)


def build_app(engine: AsyncLLM, *, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The API for ``engine``, serving it as ``served_model_name``."""
    from pluginhost import __version__

    app = FastAPI(title="pluginhost", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(served_model_name)
    engine.engine.stats_listeners.append(metrics.record_step)
    app.state.engine, app.state.metrics, app.state.served_model_name = engine, metrics, served_model_name
    _install_errors(app)
    _install_auth_and_counting(app, api_key, metrics)
    api = _API(engine, served_model_name, metrics)

    @app.get("/health")
    async def health() -> Response:
        stopped = engine.engine.stopped  # a tensor-parallel rank lost: no request can be served again
        if stopped is not None:
            return JSONResponse({"status": "stopped", "error": str(stopped)}, status_code=503)
        return JSONResponse({"status": "ok"})

    card = {
        "id": served_model_name,
        "object": "model",
        "created": api.created,
        "owned_by": "pluginhost",
        "root": engine.config.model,
        "max_model_len": engine.max_model_len,
    }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _until_disconnect(request, api.completions(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _until_disconnect(request, api.chat(body))

    @app.get("/metrics")
    async def prometheus() -> Response:
        scheduler = engine.engine.scheduler
        metrics.record_queue(scheduler.num_running, scheduler.num_waiting)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    engine.plugin_host.register_routes(app, engine, BUILTIN_ROUTES)  # plugins' routes, after the builtin ones

    # After the plugins' routes: this one takes every path under /v1/models/ (names may hold "/").
    @app.get("/v1/models/{model:path}")  # what the openai client's models.retrieve() asks
    async def model(model: str) -> dict[str, Any]:
        api.check_model(model)
        return card

    return app


# -- errors, keys, counting -----------------------------------------------------------------


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message = _describe_validation(errors, exc.body, request.headers.get("content-type"))
        return bad_request(message, param=_first_param(errors)).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "There was an error parsing the body"
            return bad_request(_not_utf8(exc.__cause__)).response()
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return APIError(exc.status_code, message, type=kind).response()

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        return _internal_error(request, exc)


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A 500 for an exception no handler answered, naming the plugin whose route raised it, if one did."""
    host, plugins = request.app.state.engine.plugin_host, []
    for frame, _ in traceback.walk_tb(exc.__traceback__):  # the innermost frame of a plugin's file decides
        plugins = host.plugins_of_file(frame.f_code.co_filename) or plugins
    where = f"a route of {plugins[0].describe()}" if plugins else "the server"
    logger.error("%s failed answering %s %s", where, request.method, request.url.path, exc_info=exc)
    message = f"internal error in {where}: {type(exc).__name__}: {exc}"
    return APIError(500, message, type="server_error", code="plugin_error" if plugins else None).response()


def _install_auth_and_counting(app: FastAPI, api_key: str | None, metrics: ServerMetrics) -> None:
    expected = api_key.encode() if api_key else None

    @app.middleware("http")
    async def check_key_and_count(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if expected is not None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            # The scheme is case-insensitive (RFC 9110); the key is compared in constant time.
            if not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected)):
                response: Response = APIError(
                    401,
                    "Missing or wrong API key: send the key given to --api-key as 'Authorization: Bearer KEY'.",
                    type="invalid_request_error",
                    code="invalid_api_key",
                ).response()
                # Counted under the route the path would reach: a path of the caller's choosing is no label.
                metrics.record_http(_route_path(app, request.scope), 401)
                return response
        try:
            response = await call_next(request)
        except Exception as exc:  # noqa: BLE001 - answered here, so it is logged once (Starlette would re-raise it)
            response = _internal_error(request, exc)
        route = request.scope.get("route")
        metrics.record_http(getattr(route, "path", "unmatched"), response.status_code)
        return response


def _route_path(app: FastAPI, scope: dict[str, Any]) -> str:
    """The path template of the route a request would reach, or "unmatched"."""
    for route in app.router.routes:
        if route.matches(scope)[0] is Match.FULL:
            return getattr(route, "path", "unmatched")
    return "unmatched"


def _describe_validation(errors: Sequence[Any], body: Any, content_type: str | None) -> str:
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


def _not_utf8(error: UnicodeDecodeError) -> str:
    byte = error.object[error.start]
    return (
        f"Invalid request: the body is not valid UTF-8 JSON: byte {byte:#04x} at offset {error.start}, {error.reason}"
    )


def _first_param(errors: Sequence[Any]) -> str | None:
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


async def _until_disconnect(request: Request, answer: Awaitable[Response]) -> Response:
    """Answer, unless the client goes away first: then cancel the answer (which aborts its requests)."""
    task = asyncio.ensure_future(answer)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    return Response(status_code=499)  # nobody will read it


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- the two generation endpoints -------------------------------------------------------------


class _API:
    """Completions and chat completions over one engine."""

    def __init__(self, engine: AsyncLLM, served_model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.name = served_model_name
        self.metrics = metrics
        self.created = now()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(
                404,
                f"The model `{model}` does not exist: this server serves `{self.name}` (GET /v1/models).",
                type="not_found_error",
                code="model_not_found",
                param="model",
            )

    async def _start(
        self, prompts: Sequence[Any], params: SamplingParams, request_id: str, names: _FieldNames
    ) -> list[RequestStream]:
        """Queue one engine request per prompt, all or none (400 for bad input, 503 for a full queue)."""
        most = self.engine.config.max_waiting_seqs
        if len(prompts) * params.n > most:  # more than the queue ever holds: retrying cannot help (not a 503)
            raise bad_request(
                f"{len(prompts)} prompt(s) x n={params.n} samples are more than the server ever queues at once "
                f"({most}, --max-waiting-seqs): send fewer prompts or samples per request"
            )
        requests = [(prompt, params.clone(), f"{request_id}-{i}") for i, prompt in enumerate(prompts)]
        try:  # OpenAI's rule: a max_tokens the context cannot hold is a 400, not cut short
            return await self.engine.submit_all(requests, exact_max_tokens=True)
        except (ValueError, PluginhostError) as exc:
            if isinstance(exc, EngineOverloadedError):
                raise APIError(503, f"The server is busy: {exc}", type="server_error", code="overloaded") from None
            if isinstance(exc, ValueError):  # bad input, or a plugin's refusal
                raise names.bad_request(exc) from None
            raise APIError(_status(exc), str(exc), type="server_error", code=_error_code(exc)) from None

    def _params(self, build: Callable[[], SamplingParams], names: _FieldNames) -> SamplingParams:
        try:
            return build()
        except ValueError as exc:
            raise names.bad_request(exc) from None

    # -- completions --------------------------------------------------------------------

    async def completions(self, body: CompletionRequest) -> Response:
        self.check_model(body.model)
        try:
            prompts = body.prompts()
        except ValueError as exc:
            raise bad_request(str(exc), param="prompt") from None
        if body.logprobs is not None and self.engine.tokenizer is None:
            raise bad_request("logprobs need a tokenizer to name the tokens; this model has none", param="logprobs")
        names = _FieldNames("prompt")
        params = self._params(lambda: body.sampling_params(max_tokens=body.max_tokens, logprobs=body.logprobs), names)
        request_id = random_id("cmpl")
        streams = await self._start(prompts, params, request_id, names)
        shape = _Completions(self, request_id)
        if body.stream:
            return _sse(shape.stream(streams, _Usage.asked(body)))
        return JSONResponse(await shape.whole(streams))

    # -- chat -----------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest) -> Response:
        self.check_model(body.model)
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise bad_request(
                "this model has no chat template (its tokenizer_config.json sets none); use /v1/completions"
            )
        prompt = await self.engine.off_loop(_render_chat, tokenizer, body.conversation())  # long ones take seconds
        top = (body.top_logprobs or 0) if body.logprobs else None
        budget = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        names = _FieldNames("messages", {"max_tokens": budget, "logprobs": "top_logprobs"}, prompt_is_messages=True)
        params = self._params(lambda: body.sampling_params(max_tokens=body.token_budget, logprobs=top), names)
        request_id = random_id("chatcmpl")
        streams = await self._start([prompt], params, request_id, names)
        shape = _Chat(self, request_id, top)
        if body.stream:
            return _sse(shape.stream(streams, _Usage.asked(body)))
        return JSONResponse(await shape.whole(streams))


def _render_chat(tokenizer: Any, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The conversation through the chat template, as a prompt: its text and token ids (a 400 if it cannot be)."""
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template may raise anything (jinja's errors, raise_exception)
        raise bad_request(f"the chat template cannot render these messages: {exc}", param="messages") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate (JSON's "\udce9"): the tokenizer would raise a TypeError
        raise bad_request(
            f"the messages are not valid Unicode: {text[exc.start]!r}, {exc.reason}", param="messages"
        ) from None
    return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}


class _FieldNames:
    """The engine's refusals as 400s in the API's words: ``param`` the request's field, not the engine's.

    With ``prompt_is_messages`` (chat), the engine's one prompt is the messages through the chat template:
    its "prompt 0" is said as the messages (their tokens) or the request (its other settings).
    """

    #: chat's words for the engine's one prompt, replaced in this order.
    _MESSAGES = (
        (r"\bprompt 0 has (\d+) tokens", r"the messages come to \1 tokens with the chat template"),
        (r"\bprompt 0\b", "the request"),
        (r"\bShorten the prompt\b", "Shorten the messages"),
    )

    def __init__(
        self, prompt_field: str, renamed: Mapping[str, str] | None = None, *, prompt_is_messages: bool = False
    ) -> None:
        self.prompt_field, self.renamed = prompt_field, dict(renamed or {})
        self.words = self._MESSAGES if prompt_is_messages else ()

    def bad_request(self, exc: ValueError) -> APIError:
        message = self._in_api_words(str(exc).removeprefix("SamplingParams: "))
        if isinstance(exc, PromptTooLongError):
            return bad_request(message, param=self.prompt_field, code="context_length_exceeded")
        if isinstance(exc, RequestRefusedError):  # a plugin's refusal: about no one field
            return bad_request(message)
        if not isinstance(exc, InvalidParameterError):  # the prompt itself (ids outside the vocabulary...)
            return bad_request(message, param=self.prompt_field)
        return bad_request(message, param=self.renamed.get(exc.param, exc.param))

    def _in_api_words(self, message: str) -> str:
        for pattern, words in self.words:
            message = re.sub(pattern, words, message)
        for engine_name, api_name in self.renamed.items():
            message = re.sub(rf"\b{engine_name}\b", api_name, message)
        return message


def _choice_offsets(streams: Sequence[RequestStream]) -> list[int]:
    """The first choice index of each prompt: the samples of the prompts before it (an on_request may change n)."""
    offsets, total = [], 0
    for stream in streams:
        offsets.append(total)
        total += stream.request.params.n
    return offsets


def _text_after(sent: str, text: str, request_id: str) -> str:
    """What of ``text`` (a choice's text so far) a stream has not sent yet, given it sent ``sent``.

    The text only grows, unless an ``on_output`` hook changed the final output's text (it runs once
    the request has finished): what was sent cannot be taken back, so the rest follows the end of
    the sent text where the changed text still has it, and nothing more where it does not.
    """
    if text.startswith(sent):
        return text[len(sent) :]
    # Where an end of the sent text (8 to 32 characters; shorter only if none is found) is in the changed
    # text, ending nearest to where the sent text ended: repeated text has it more than once.
    cut = None
    longest = min(len(sent), 32)
    for sizes in (range(longest, min(longest, 8) - 1, -1), range(min(longest, 8) - 1, 0, -1)):
        found = [
            (abs(at + size - len(sent)), -size, at + size) for size in sizes for at in _occurrences(text, sent[-size:])
        ]
        if found:
            cut = min(found)[2]
            break
    logger.warning(
        "%s: an on_output hook changed text the stream had already sent; the client keeps what it got%s",
        request_id,
        "" if cut is not None else ", and no more of this choice's text",
    )
    return text[cut:] if cut is not None else ""


def _occurrences(text: str, part: str) -> list[int]:
    """Where ``part`` starts in ``text``, every time."""
    found, at = [], text.find(part)
    while at >= 0:
        found.append(at)
        at = text.find(part, at + 1)
    return found


def _error_code(error: Exception) -> str:
    if isinstance(error, KVCacheMemoryError):
        return "out_of_memory"
    if isinstance(error, TensorParallelError):
        return "engine_stopped"
    return "model_error" if isinstance(error, ModelRunError) else "plugin_error"


def _status(error: Exception) -> int:
    """503 for an engine stopped for good (a load balancer should send the request elsewhere), else 500."""
    return 503 if isinstance(error, TensorParallelError) else 500


def _usage_info(prompt: int, completion: int) -> dict[str, int]:
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion).model_dump()


class _Usage:
    """What a stream says of its token counts: ``stream_options.include_usage`` (a last chunk with the totals,
    ``"usage": null`` on the others) and vLLM's ``continuous_usage_stats`` (the counts so far on every chunk)."""

    def __init__(self, at_end: bool, every_chunk: bool) -> None:
        self.at_end, self.every_chunk = at_end, every_chunk

    @classmethod
    def asked(cls, body: CompletionRequest | ChatCompletionRequest) -> _Usage:
        options = body.stream_options
        at_end = bool(options and options.include_usage)
        return cls(at_end, at_end and bool(options and options.continuous_usage_stats))  # vLLM's rule: both


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def frames() -> AsyncIterator[str]:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come; leaving early aborts them all."""
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output, None))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, output, error = await queue.get()
            if error is not None:
                raise error
            if output is None:
                remaining -= 1
                continue
            yield index, output
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


class _Shape:
    """What both endpoints do with outputs: merge, count, time, and turn errors into answers."""

    object_whole = ""
    object_chunk = ""

    def __init__(self, api: _API, request_id: str) -> None:
        self.api, self.request_id = api, request_id
        self.created = now()
        self.tokenizer = api.engine.tokenizer

    def header(self, object_type: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_type, "created": self.created, "model": self.api.name}

    async def finals(self, streams: Sequence[RequestStream]) -> dict[int, RequestOutput]:
        last: dict[int, RequestOutput] = {}
        try:
            async for index, output in _merged(streams):
                last[index] = output
        except PluginhostError as exc:  # the model failed, or a plugin in the engine did
            raise APIError(_status(exc), str(exc), type="server_error", code=_error_code(exc)) from None
        finally:
            self.record(streams)
        return last

    def record(self, streams: Sequence[RequestStream]) -> None:
        """Count each request and its latencies; one that has not finished was given up (client gone)."""
        for stream in streams:
            self._record(stream)

    def _record(self, stream: RequestStream) -> None:
        request = stream.request
        if request.error is not None:
            reason = "error"
        elif not request.finished or request.aborted:
            reason = "abort"
        else:
            reason = request.sequences[0].finish_reason or "abort"
        self.api.metrics.record_request(
            finish_reason=reason,
            arrival=request.arrival_time,
            first_token=request.first_token_time,
            end=time.monotonic(),
            tokens=max((len(s.token_ids) for s in request.sequences), default=0),
        )

    def usage(self, finals: dict[int, RequestOutput]) -> dict[str, int]:
        prompt = sum(len(o.prompt_token_ids) for o in finals.values())
        return _usage_info(prompt, sum(len(c.token_ids) for o in finals.values() for c in o.outputs))

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    def token_bytes(self, token: int) -> list[int]:
        """The token's own bytes (a piece of a character has its bytes, not U+FFFD's)."""
        return list(token_bytes(self.tokenizer, token) if self.tokenizer is not None else str(token).encode())

    async def chunks(
        self, streams: Sequence[RequestStream], usage: _Usage, choice: Callable[..., dict[str, Any]]
    ) -> AsyncIterator[dict[str, Any]]:
        """Streamed chunks: for each choice, what its text (and tokens) grew by; errors as an error chunk."""
        sent_text: dict[int, str] = {}
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()
        last: dict[int, RequestOutput] = {}
        offsets = _choice_offsets(streams)
        try:
            async for index, output in _merged(streams):
                last[index] = output
                for completion in output.outputs:
                    number = offsets[index] + completion.index
                    if number in finished:
                        continue
                    text = completion.text or ""
                    sent, start_tokens = sent_text.get(number, ""), sent_tokens.get(number, 0)
                    first = number not in sent_text
                    delta, new_tokens = _text_after(sent, text, self.request_id), completion.token_ids[start_tokens:]
                    if not (delta or new_tokens or completion.finished or first):
                        continue
                    sent_text[number], sent_tokens[number] = sent + delta, len(completion.token_ids)
                    if completion.finished:
                        finished.add(number)
                    chunk = choice(number, completion, delta, start_tokens, first)
                    if usage.every_chunk:  # as vLLM: this choice's prompt and its tokens so far
                        chunk["usage"] = _usage_info(len(output.prompt_token_ids), len(completion.token_ids))
                    elif usage.at_end:
                        chunk["usage"] = None
                    yield chunk
        except Exception as exc:  # noqa: BLE001 - the answer has begun: whatever failed is told in the stream
            if isinstance(exc, PluginhostError):  # the model failed, or a plugin in the engine did
                error = ErrorBody(message=str(exc), type="server_error", code=_error_code(exc))
            else:
                logger.exception("internal error while streaming %s", self.request_id)
                error = ErrorBody(
                    message=f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal_error"
                )
            yield {"error": error.model_dump()}
            return
        finally:
            self.record(streams)
        if usage.at_end:
            yield {**self.header(self.object_chunk), "choices": [], "usage": self.usage(last)}


class _Completions(_Shape):
    object_whole = "text_completion"
    object_chunk = "text_completion"

    async def whole(self, streams: Sequence[RequestStream]) -> dict[str, Any]:
        finals = await self.finals(streams)
        offsets = _choice_offsets(streams)
        choices = [
            {
                "index": offsets[index] + c.index,
                "text": c.text if c.text is not None else "",
                "logprobs": self.logprobs(c)[0],
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for index in sorted(finals)
            for c in finals[index].outputs
        ]
        return {**self.header(self.object_whole), "choices": choices, "usage": self.usage(finals)}

    def stream(self, streams: Sequence[RequestStream], usage: _Usage) -> AsyncIterator[dict[str, Any]]:
        # Per choice: the text_offset of its next token, so a chunk decodes only its own tokens.
        text_offsets: dict[int, int] = {}

        def choice(number: int, c: CompletionOutput, delta: str, start: int, first: bool) -> dict[str, Any]:
            logprobs, text_offsets[number] = self.logprobs(c, start, text_offsets.get(number, 0))
            entry = {
                "index": number,
                "text": delta,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            return {**self.header(self.object_chunk), "choices": [entry]}

        return self.chunks(streams, usage, choice)

    def logprobs(self, c: CompletionOutput, start: int = 0, offset: int = 0) -> tuple[dict[str, Any] | None, int]:
        """OpenAI's completions logprobs for the tokens from ``start`` on, and the text_offset after them.

        ``offset`` is the text_offset of token ``start``: the length of the tokens' texts before it, each
        decoded alone, which a stream carries from chunk to chunk (decoding them all again for every chunk
        made a long answer's stream quadratic on the event loop).
        """
        if c.logprobs is None:
            return None, offset
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token, step in zip(c.token_ids[start:], c.logprobs[start:], strict=True):
            text = self.token_text(token)
            tokens.append(text)
            token_logprobs.append(step[token])
            top.append({self.token_text(t): v for t, v in step.items()})
            offsets.append(offset)
            offset += len(text)
        logprobs = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
        return logprobs, offset


class _Chat(_Shape):
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, api: _API, request_id: str, top_logprobs: int | None) -> None:
        super().__init__(api, request_id)
        self.top_logprobs = top_logprobs or 0

    async def whole(self, streams: Sequence[RequestStream]) -> dict[str, Any]:
        finals = await self.finals(streams)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text or ""},
                "logprobs": self.logprobs(c, 0),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in finals[0].outputs
        ]
        return {**self.header(self.object_whole), "choices": choices, "usage": self.usage(finals)}

    def stream(self, streams: Sequence[RequestStream], usage: _Usage) -> AsyncIterator[dict[str, Any]]:
        def choice(number: int, c: CompletionOutput, delta: str, start: int, first: bool) -> dict[str, Any]:
            message = {"role": "assistant", "content": delta} if first else {"content": delta}
            entry = {
                "index": number,
                "delta": message if (delta or first) else {},
                "logprobs": self.logprobs(c, start),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            return {**self.header(self.object_chunk), "choices": [entry]}

        return self.chunks(streams, usage, choice)

    def logprobs(self, c: CompletionOutput, start: int) -> dict[str, Any] | None:
        """OpenAI's chat logprobs (``content``: token, logprob, bytes, top_logprobs) from ``start`` on."""
        if c.logprobs is None:
            return None
        k = self.top_logprobs
        content = []
        for token, step in zip(c.token_ids[start:], c.logprobs[start:], strict=True):
            ranked = sorted(step.items(), key=lambda item: -item[1])[:k]
            content.append(
                {
                    "token": self.token_text(token),
                    "logprob": step[token],
                    "bytes": self.token_bytes(token),
                    "top_logprobs": [
                        {"token": self.token_text(t), "logprob": v, "bytes": self.token_bytes(t)} for t, v in ranked
                    ],
                }
            )
        return {"content": content}
