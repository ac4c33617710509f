"""The OpenAI-compatible HTTP API over an ``AsyncLLM``, on FastAPI.

Routes: ``GET /health`` (``HEAD`` too), ``GET /v1/models`` (and ``/v1/models/{name}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` (messages through the tokenizer's chat
template), ``GET /metrics`` (Prometheus). ``stream: true`` answers
Server-Sent Events: ``data: {json}\\n\\n`` chunks, then ``data: [DONE]\\n\\n``.

Every error is OpenAI's error object ``{"error": {"message", "type", "param",
"code"}}``: 400 for a bad request (pydantic's validation included, never
FastAPI's 422; ``param`` names the request's field, and a prompt too long for
the model has ``code`` ``context_length_exceeded``, as OpenAI answers), 401 for
a missing or wrong key when an API key is set (checked on every route, plugins'
too), 404 for an unknown model or route, 413 for a body over ``MAX_BODY_BYTES``
(not read), 503 when the engine's queue is full (more sequences waiting to
start than the batch's free rows and ``max_waiting_seqs`` together) or the
engine has stopped for good (a tensor-parallel rank lost; ``/health`` then
answers 503 too), 500 when the model fails. A stream that has begun ends with an error chunk
instead, then ``[DONE]``; a request a forced shutdown cuts short too (503, ``code``
``shutting_down``). A client that goes away aborts its requests, which
frees their rows at the next engine step. Latencies in ``/metrics`` count from
when the HTTP request came in; ``pluginhost_request_success`` counts each
choice, by its own finish reason.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import re
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from pluginhost.chat import render_chat
from pluginhost.engine.async_llm import AsyncLLM, RequestStream
from pluginhost.engine.request import EngineRequest
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
from pluginhost.outputs import CompletionOutput, RequestOutput, TokenLogprobs, text_after
from pluginhost.sampling import SamplingParams
from pluginhost.server.errors import APIError, bad_request, closing, describe_validation, first_param, not_utf8
from pluginhost.server.guards import (
    WRONG_KEY,
    AnswerWhenCancelled,
    BodyTooLarge,
    KeyOnWebSockets,
    LimitBody,
    OnlyHosts,
    host_name,
    key_matches,
)
from pluginhost.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from pluginhost.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    UsageInfo,
    now,
    random_id,
    wider_logprobs,
)
from pluginhost.tokenizer import token_bytes, token_text

__all__ = ["APIError", "BUILTIN_ROUTES", "MAX_BODY_BYTES", "bad_request", "build_app"]

logger = logging.getLogger(__name__)

#: The largest request body the server reads (a 413 beyond): far more than a prompt that fits any model's context
#: takes (a 128k-token prompt is about 1 MB of text or of token ids), so only what could never be served is refused
#: before it is read.
MAX_BODY_BYTES = 32 * 2**20

#: The paths the server itself answers; a plugin's route may not take them.
BUILTIN_ROUTES = (
    "/health",
    "/v1/models",
    "/v1/models/{model:path}",  # registered after the plugins' routes (it takes every path below), yet reserved
    "/v1/completions",
    "/v1/chat/completions",
    "/metrics",
)


def build_app(
    engine: AsyncLLM,
    *,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    allowed_hosts: Collection[str] | None = None,
) -> FastAPI:
    """The API for ``engine``, serving it as ``served_model_name``; bodies over ``max_body_bytes`` are a 413.

    With ``api_key``, every route needs ``Authorization: Bearer KEY``; a blank key is a ``ValueError``.
    With ``allowed_hosts`` (host names, without ports), a request whose ``Host`` names another is refused:
    ``pluginhost serve`` on a loopback address gives its names, so a web page of another site, its name
    rebound to this machine (DNS rebinding), cannot use it.
    """
    if api_key is not None and not api_key.strip():
        raise ValueError(f"api_key is blank ({api_key!r}): give the key, or None to serve without one")
    from pluginhost import __version__

    app = FastAPI(title="pluginhost", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(served_model_name)
    engine.engine.stats_listeners.append(metrics.record_step)
    app.state.engine, app.state.metrics, app.state.served_model_name = engine, metrics, served_model_name
    _install_errors(app)
    # Innermost of the three: a body over the limit raises where a route reads it, answered by the error handlers
    # and counted as any answer (a middleware outside the counting one would answer uncounted).
    app.add_middleware(LimitBody, limit=max_body_bytes)
    if allowed_hosts is not None:  # inside the counting middleware: a refused Host is counted as any answer
        app.add_middleware(OnlyHosts, hosts=frozenset(host_name(h) for h in allowed_hosts))
    _install_auth_and_counting(app, api_key, metrics)
    app.add_middleware(AnswerWhenCancelled)  # outermost: nothing a cancellation passes through is left unanswered
    api = _API(engine, served_model_name, metrics)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: what load balancers and uptime probes often send
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
        return await _until_disconnect(request, api.completions(_named(body, request), _arrival(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _until_disconnect(request, api.chat(_named(body, request), _arrival(request)))

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.record_queue(*engine.engine.queue_counts())
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
        message = describe_validation(errors, exc.body, request.headers.get("content-type"))
        return bad_request(message, param=first_param(errors)).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "There was an error parsing the body"
            return bad_request(not_utf8(exc.__cause__)).response()
        if isinstance(exc, BodyTooLarge):
            response = APIError(413, str(exc.detail), type="invalid_request_error", code="request_too_large").response()
            return closing(response)
        message = f"{request.method} {request.url.path}: {exc.detail}"  # OpenAI's type for any bad URL or method
        return APIError(exc.status_code, message, type="invalid_request_error", headers=exc.headers).response()

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
    # Stripped as the key a client sends is: spaces around it (a secret file's newline) made it one none could send.
    expected = api_key.strip().encode() if api_key else None
    if expected is not None:  # an HTTP middleware never sees a WebSocket (a plugin's route may be one)
        app.add_middleware(KeyOnWebSockets, expected=expected)

    @app.middleware("http")
    async def check_key_and_count(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        request.state.arrival = time.monotonic()  # before its body is read: latencies count from here (``_arrival``)
        if expected is not None and not key_matches(request.headers, expected):
            response: Response = APIError(
                401, WRONG_KEY, type="invalid_request_error", code="invalid_api_key"
            ).response()
            # Counted under the route the path would reach: a path of the caller's choosing is no label.
            metrics.record_http(_route_path(app, request.scope), 401)
            return closing(response)
        try:
            response = await call_next(request)
        except Exception as exc:  # noqa: BLE001 - answered here, so it is logged once (Starlette would re-raise it)
            response = _internal_error(request, exc)
        route = request.scope.get("route")
        metrics.record_http(getattr(route, "path", "unmatched"), response.status_code)
        return response


_Body = TypeVar("_Body", CompletionRequest, ChatCompletionRequest)


def _named(body: _Body, request: Request) -> _Body:
    """The body, its ``request_id`` the ``X-Request-Id`` header's when there is one (a gateway's), as vLLM's."""
    header = request.headers.get("x-request-id")
    return body.model_copy(update={"request_id": header}) if header else body


def _arrival(request: Request) -> float:
    """When the HTTP request came in (``time.monotonic()``), as the counting middleware saw it; else now."""
    return getattr(request.state, "arrival", None) or time.monotonic()


def _route_path(app: FastAPI, scope: dict[str, Any]) -> str:
    """The path template of the route a request would reach, or "unmatched"."""
    for route in app.router.routes:
        if route.matches(scope)[0] is Match.FULL:
            return getattr(route, "path", "unmatched")
    return "unmatched"


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
                type="invalid_request_error",  # OpenAI's answer, param and all
                code="model_not_found",
            )

    async def _start(
        self,
        prompts: Sequence[Any],
        params: SamplingParams,
        request_id: str,
        names: _FieldNames,
        arrival: float,
        add_special_tokens: bool = True,
    ) -> list[RequestStream]:
        """Queue one engine request per prompt, all or none (400 for bad input, 503 for a full queue).

        As OpenAI's server (``exact_max_tokens``): a ``max_tokens`` the context cannot hold is a 400; one left out
        takes the model's recommended one, cut to fit.
        """
        config = self.engine.config
        most = config.max_sequences_taken
        if len(prompts) * params.n > most:  # more than the server ever takes in: retrying cannot help (not a 503)
            raise bad_request(
                f"{len(prompts)} prompt(s) x n={params.n} samples are more than the server ever takes in at once "
                f"({most}: {config.max_num_seqs} running, --max-num-seqs, + {config.max_waiting_seqs} waiting, "
                "--max-waiting-seqs): send fewer prompts or samples per request",
                # n is what to lower when it alone is too many, or when there are several samples per prompt.
                param="n" if params.n > 1 else names.prompt_field,
            )
        # One params for every prompt: the engine copies them for each, off the event loop.
        requests = [(prompt, params, f"{request_id}-{i}") for i, prompt in enumerate(prompts)]
        try:  # OpenAI's rule: a max_tokens the context cannot hold is a 400, not cut short
            return await self.engine.submit_all(
                requests, exact_max_tokens=True, arrival_time=arrival, add_special_tokens=add_special_tokens
            )
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

    async def completions(self, body: CompletionRequest, arrival: float) -> Response:
        """``POST /v1/completions``; ``arrival`` (``time.monotonic()``): when the HTTP request came in."""
        self.check_model(body.model)
        try:
            prompts = body.prompts()
        except ValueError as exc:
            raise bad_request(str(exc), param="prompt") from None
        names = _FieldNames("prompt", prompt_only=body.prompt_only)
        defaults = self.engine.sampling_defaults
        params = self._params(lambda: body.completion_params(defaults), names)
        request_id = random_id("cmpl")
        streams = await self._start(prompts, params, request_id, names, arrival, body.add_special_tokens)
        shape = _Completions(self, _answer_id("cmpl", body, request_id), body)
        if body.stream:
            return _sse(shape.stream(streams, _Usage.asked(body)))
        return await shape.answer(streams)

    # -- chat -----------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, arrival: float) -> Response:
        """``POST /v1/chat/completions``; ``arrival`` as for ``completions``."""
        self.check_model(body.model)
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise bad_request(
                "this model has no chat template (its tokenizer_config.json sets none); use /v1/completions"
            )
        top = (body.top_logprobs or 0) if body.logprobs else None
        budget = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        names = _FieldNames("messages", {"max_tokens": budget, "logprobs": "top_logprobs"}, prompt_is_messages=True)
        inputs = self.engine.input_processor
        try:  # in the input thread: long conversations take seconds to render and tokenize
            variables, add_generation_prompt, continue_final_message = body.template_arguments()
            prompt = await self.engine.off_loop(
                functools.partial(
                    _render_chat,
                    tokenizer,
                    body.conversation(),
                    inputs.check_text_length,
                    variables,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                )
            )
        except PromptTooLongError as exc:
            raise names.bad_request(exc) from None
        defaults = self.engine.sampling_defaults
        params = self._params(
            lambda: body.sampling_params(max_tokens=body.token_budget, logprobs=top, defaults=defaults), names
        )
        request_id = random_id("chatcmpl")
        streams = await self._start([prompt], params, request_id, names, arrival)
        # As vLLM: the answer is the assistant's, or, the request going on with the last message, in its role (the
        # request's own field decides, not chat_template_kwargs, as vLLM's get_chat_request_role reads it).
        role = "assistant" if body.add_generation_prompt else body.messages[-1].role
        shape = _Chat(self, _answer_id("chatcmpl", body, request_id), body, top, role)
        if body.stream:
            return _sse(shape.stream(streams, _Usage.asked(body)))
        return await shape.answer(streams)


def _render_chat(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    check_length: Callable[[int, str], None],
    variables: dict[str, Any],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> dict[str, Any]:
    """The conversation through the chat template, as a prompt (``pluginhost.chat``); a 400 if it cannot be."""
    try:
        return render_chat(
            tokenizer,
            conversation,
            variables=variables,
            check_length=check_length,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except InvalidParameterError as exc:  # not a PromptTooLongError: that is the caller's to say in chat's words
        raise bad_request(str(exc), param=exc.param) from None


class _FieldNames:
    """The engine's refusals as 400s in the API's words: ``param`` the request's field, not the engine's.

    With ``prompt_is_messages`` (chat), the engine's one prompt is the messages through the chat template:
    its "prompt 0" is said as the messages (their tokens) or the request (its other settings).
    """

    #: chat's words for the engine's one prompt, replaced in this order.
    _MESSAGES = (
        (r"\bprompt 0 has (\d+) tokens", r"the messages come to \1 tokens with the chat template"),
        (r"\bprompt 0 has (\d+) characters", r"the messages come to \1 characters with the chat template"),
        (r"\bprompt 0\b", "the request"),
        (r"\bShorten the prompt\b", "Shorten the messages"),
    )

    #: With max_tokens 0 the engine still generates the one token the answer leaves out: a full prompt has no room.
    _PROMPT_ONLY = (
        (
            r"which leaves no room to generate within (max_model_len=.*?)\. Shorten the prompt\.",
            r"which leaves no room within \1 for the one token the engine generates with max_tokens 0 (the answer "
            r"leaves it out): a prompt alone may have at most max_model_len - 1 tokens. Shorten the prompt.",
        ),
    )

    def __init__(
        self,
        prompt_field: str,
        renamed: Mapping[str, str] | None = None,
        *,
        prompt_is_messages: bool = False,
        prompt_only: bool = False,
    ) -> None:
        self.prompt_field, self.renamed = prompt_field, dict(renamed or {})
        self.words = (self._MESSAGES if prompt_is_messages else ()) + (self._PROMPT_ONLY if prompt_only else ())

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


def _answer_id(prefix: str, body: CompletionRequest | ChatCompletionRequest, request_id: str) -> str:
    """The answer's ``id``: the request's own (vLLM's ``request_id``) after the route's prefix, else the engine's id.
    (The engine's requests keep ids of their own: two clients may send one ``request_id``.)"""
    return f"{prefix}-{body.request_id}" if body.request_id else request_id


def _choice_offsets(streams: Sequence[RequestStream]) -> list[int]:
    """The first choice index of each prompt: the samples of the prompts before it (an on_request may change n)."""
    offsets, total = [], 0
    for stream in streams:
        offsets.append(total)
        total += stream.request.params.n
    return offsets


def _error_code(error: Exception) -> str:
    if isinstance(error, KVCacheMemoryError):
        return "out_of_memory"
    if isinstance(error, TensorParallelError):
        return "engine_stopped"
    return "model_error" if isinstance(error, ModelRunError) else "plugin_error"


def _status(error: Exception) -> int:
    """503 for an engine stopped for good (a load balancer should send the request elsewhere), else 500."""
    return 503 if isinstance(error, TensorParallelError) else 500


def _answer_json(body: dict[str, Any]) -> bytes:
    """``body`` as JSON (as ``JSONResponse`` writes it), its choices written one at a time.

    ``json.dumps`` holds the GIL for all it is given: one call over a 10 MB answer stalled the event loop
    for a fifth of a second even from another thread; one choice at a time, it gets its turns between them.
    """
    parts = [
        f"{_dumps(key)}:" + ("[" + ",".join(_dumps(c) for c in value) + "]" if key == "choices" else _dumps(value))
        for key, value in body.items()
    ]
    return ("{" + ",".join(parts) + "}").encode()


_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

#: An answer with fewer tokens and log-probabilities than this is built on the event loop (a millisecond or so).
_ON_LOOP_ENTRIES = 2000


def _answer_entries(finals: dict[int, RequestOutput]) -> int:
    """How big an answer is to build: its tokens, and the log-probabilities reported for each (an echoed prompt's
    too, in each of its choices)."""
    entries = 0
    for o in finals.values():
        prompt = len(o.prompt_logprobs) * (1 + len(o.prompt_logprobs[-1] or ())) if o.prompt_logprobs else 0
        entries += sum(prompt + len(c.token_ids) * (1 + (len(c.logprobs[0]) if c.logprobs else 0)) for c in o.outputs)
    return entries


def _finish_reasons(request: EngineRequest) -> list[str]:
    """Why each sample of a request ended, as ``/metrics`` counts them (one per choice, as vLLM does).

    An error ends every sample of the request (its answer is the error): ``refused`` when a plugin refused it, or
    its own settings left a sample no token to choose (a 400, not a failure), ``error`` otherwise; a sample not
    finished was given up (an abort, or a client gone).
    """
    if request.error is not None:
        refused = isinstance(request.error, RequestRefusedError | InvalidParameterError)
        return ["refused" if refused else "error"] * len(request.sequences)
    return [s.finish_reason or "abort" for s in request.sequences]


def _within(step: dict[int, float], token: int, k: int | None) -> dict[int, float]:
    """Of one position's log-probabilities, those of ``token`` and the ``k`` most likely (``None``: all): the engine
    scores a prompt once for both ``prompt_logprobs`` and an echo's ``logprobs``, as many as the wider asks. A dict a
    plugin rebuilt (no ranks) is kept whole."""
    ranks = step.ranks() if k is not None and isinstance(step, TokenLogprobs) else {}
    return {t: v for t, v in step.items() if t == token or ranks[t] <= k} if ranks else step


#: What an answer says for a token the model gave no chance (log-probability -inf), as vLLM's server does: JSON has
#: no infinity (a strict parser refuses ``-Infinity``, and the whole answer failed with a 500).
LEAST_LOGPROB = -9999.0


def _json_logprob(value: float) -> float:
    return max(value, LEAST_LOGPROB)


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
    """(prompt index, output) from every stream as they come; leaving early aborts them all.

    Only each stream's latest output waits to be taken (each holds everything so far): a client that reads
    slowly, or not at all, makes the server hold one output per prompt, not every one so far.
    """
    latest: dict[int, RequestOutput] = {}
    failures: list[BaseException] = []
    ended = 0
    changed = asyncio.Event()

    async def pump(index: int, stream: RequestStream) -> None:
        nonlocal ended
        try:
            async for output in stream:
                latest[index] = output
                changed.set()
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            failures.append(exc)
        finally:
            ended += 1
            changed.set()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while True:
            if failures:
                raise failures[0]
            if latest:
                index = min(latest)
                yield index, latest.pop(index)
            elif ended == len(tasks):
                return
            else:
                changed.clear()
                await changed.wait()
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


class _Shape:
    """What both endpoints do with outputs: merge, count, time, and turn errors into answers."""

    object_whole = ""
    object_chunk = ""

    def __init__(self, api: _API, request_id: str, body: CompletionRequest | ChatCompletionRequest) -> None:
        self.api, self.request_id = api, request_id
        self.created = now()
        self.tokenizer = api.engine.tokenizer
        # Without a tokenizer the text is empty: the ids are all the answer has, so they are always in it.
        self.with_token_ids = body.return_token_ids or self.tokenizer is None
        #: vLLM's ``prompt_logprobs``: how many of the most likely tokens the answer lists at each prompt position, and
        #: how many of those the engine scored it lists (``None``: all; more when an echo's ``logprobs`` asked more).
        self.prompt_top = body.prompt_logprobs
        self.prompt_cut = self.prompt_top if self.scored_width(body) != self.prompt_top else None
        self.tokens_as_ids = body.return_tokens_as_token_ids or self.tokenizer is None
        # Each token's text and bytes, decoded once per answer: a logprobs answer names the same tokens many times.
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def header(self, object_type: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_type, "created": self.created, "model": self.api.name}

    async def finals(self, streams: Sequence[RequestStream]) -> dict[int, RequestOutput]:
        last: dict[int, RequestOutput] = {}
        try:
            async for index, output in _merged(streams):
                last[index] = self.shown(output)
        except RequestRefusedError as exc:  # a logits processor refused a request as it joined the batch
            raise bad_request(str(exc)) from None
        except InvalidParameterError as exc:  # its own settings left a sample no token to choose (bad_words)
            raise bad_request(str(exc), param=exc.param) from None
        except PluginhostError as exc:  # the model failed, or a plugin in the engine did
            raise APIError(_status(exc), str(exc), type="server_error", code=_error_code(exc)) from None
        finally:
            self.record(streams)
        return last

    def shown(self, output: RequestOutput) -> RequestOutput:
        """What the answer shows of an output: all of it (completions' ``max_tokens`` 0 leaves the choices out)."""
        return output

    def record(self, streams: Sequence[RequestStream]) -> None:
        """Count each request and its latencies; one that has not finished was given up (client gone)."""
        for stream in streams:
            self._record(stream)

    def _record(self, stream: RequestStream) -> None:
        request = stream.request
        self.api.metrics.record_request(
            finish_reasons=_finish_reasons(request),
            arrival=request.arrival_time,
            first_token=request.first_token_time,
            last_token=request.last_token_time,
            # Its own end: a prompt of several that ended first is not timed to the last one's end. A request not
            # ended yet was given up (its client gone, before the engine took the abort): now.
            end=request.end_time or time.monotonic(),
            tokens=max((len(s.token_ids) for s in request.sequences), default=0),
        )

    def usage(self, finals: dict[int, RequestOutput]) -> dict[str, int]:
        prompt = sum(len(o.prompt_token_ids) for o in finals.values())
        return _usage_info(prompt, sum(len(c.token_ids) for o in finals.values() for c in o.outputs))

    def token_text(self, token: int) -> str:
        """How logprobs name ``token``: its text, or ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``)."""
        text = self._texts.get(token)
        if text is None:
            named = f"token_id:{token}" if self.tokens_as_ids else token_text(self.tokenizer, token)
            text = self._texts[token] = named
        return text

    def token_bytes(self, token: int) -> list[int]:
        """The token's own bytes (a piece of a character has its bytes, not U+FFFD's); of its name, by id."""
        found = self._bytes.get(token)
        if found is None:
            raw = self.token_text(token).encode() if self.tokens_as_ids else token_bytes(self.tokenizer, token)
            found = self._bytes[token] = list(raw)
        return found

    def prompt_ids(self, output: RequestOutput) -> dict[str, list[int]]:
        """``prompt_token_ids`` when the answer carries ids (``return_token_ids``), else nothing."""
        return {"prompt_token_ids": list(output.prompt_token_ids)} if self.with_token_ids else {}

    @staticmethod
    def scored_width(body: CompletionRequest | ChatCompletionRequest) -> int | None:
        """How many of the most likely tokens the engine scores at each prompt position for this request."""
        return body.prompt_logprobs

    def prompt_scores(self, output: RequestOutput) -> dict[str, list[dict[str, dict[str, Any]] | None] | None]:
        """``prompt_logprobs`` in vLLM's shape when the request asked for them, else nothing: ``None`` for the first
        token, then ``{token_id: {"logprob", "rank", "decoded_token"}}`` of the prompt's token and the top k (as
        many as asked: echo with more logprobs scores more). ``rank``: ``None`` where a plugin rebuilt the dicts."""
        if self.prompt_top is None:
            return {}
        if output.prompt_logprobs is None:  # an on_output hook took them out
            return {"prompt_logprobs": None}
        entries: list[dict[str, dict[str, Any]] | None] = []
        for token, step in zip(output.prompt_token_ids, output.prompt_logprobs, strict=True):
            if step is None:
                entries.append(None)
                continue
            ranks = step.ranks() if isinstance(step, TokenLogprobs) else {}
            entries.append(
                {
                    str(t): {"logprob": _json_logprob(v), "rank": ranks.get(t), "decoded_token": self.token_text(t)}
                    for t, v in _within(step, token, self.prompt_cut).items()
                }
            )
        return {"prompt_logprobs": entries}

    def new_ids(self, c: CompletionOutput, start: int) -> dict[str, list[int]]:
        """A choice's ``token_ids`` from ``start`` on when the answer carries ids, else nothing."""
        return {"token_ids": list(c.token_ids[start:])} if self.with_token_ids else {}

    async def answer(self, streams: Sequence[RequestStream]) -> Response:
        """The whole answer, once every request has finished; a big one is built off the event loop.

        Building and serialising n=32 choices of 250 tokens with 20 logprobs each held the loop for
        seconds, every other client waiting. It is built in the loop's default executor, not in the
        engine's input thread, where it would hold up the tokenization of every request behind it.
        """
        finals = await self.finals(streams)
        build = functools.partial(self._response, streams, finals)
        if _answer_entries(finals) < _ON_LOOP_ENTRIES:
            return build()
        return await asyncio.get_running_loop().run_in_executor(None, build)

    def _response(self, streams: Sequence[RequestStream], finals: dict[int, RequestOutput]) -> Response:
        return Response(_answer_json(self.whole(streams, finals)), media_type="application/json")

    def whole(self, streams: Sequence[RequestStream], finals: dict[int, RequestOutput]) -> dict[str, Any]:
        """The whole answer's body, from every prompt's final output."""
        raise NotImplementedError

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
                last[index] = output = self.shown(output)
                for completion in output.outputs:
                    number = offsets[index] + completion.index
                    if number in finished:
                        continue
                    text = completion.text or ""
                    sent, start_tokens = sent_text.get(number, ""), sent_tokens.get(number, 0)
                    first = number not in sent_text
                    delta, new_tokens = text_after(sent, text, self.request_id), completion.token_ids[start_tokens:]
                    if not (delta or new_tokens or completion.finished() or first):
                        continue
                    sent_text[number], sent_tokens[number] = sent + delta, len(completion.token_ids)
                    if completion.finished():
                        finished.add(number)
                    chunk = choice(number, output, completion, delta, start_tokens, first)
                    if usage.every_chunk:  # as vLLM: this choice's prompt and its tokens so far
                        chunk["usage"] = _usage_info(len(output.prompt_token_ids), len(completion.token_ids))
                    elif usage.at_end:
                        chunk["usage"] = None
                    yield chunk
        except Exception as exc:  # noqa: BLE001 - the answer has begun: whatever failed is told in the stream
            if isinstance(exc, RequestRefusedError):  # a logits processor refused it as it joined the batch
                error = ErrorBody(message=str(exc), type="invalid_request_error")
            elif isinstance(exc, InvalidParameterError):  # its own settings left a sample no token to choose
                error = ErrorBody(message=str(exc), type="invalid_request_error", param=exc.param)
            elif isinstance(exc, PluginhostError):  # the model failed, or a plugin in the engine did
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

    def __init__(self, api: _API, request_id: str, body: CompletionRequest) -> None:
        super().__init__(api, request_id, body)
        self.echo, self.prompt_only = body.echo, body.prompt_only
        #: Whether choices carry logprobs: a choice still waiting for its row has none yet, but its first chunk, the
        #: echo, carries the prompt's.
        self.with_logprobs = body.logprobs is not None
        #: How many of the most likely tokens an echoed prompt lists, when the engine scored it for more (``None``:
        #: all it scored).
        self.echo_cut = body.logprobs if self.scored_width(body) != body.logprobs else None
        #: Each prompt's echoed text, by its request: decoded once, not for each of its n choices.
        self._echoes: dict[str, str] = {}

    @staticmethod
    def scored_width(body: CompletionRequest | ChatCompletionRequest) -> int | None:
        assert isinstance(body, CompletionRequest)
        return wider_logprobs(body.prompt_logprobs, body.logprobs if body.echo else None)

    def shown(self, output: RequestOutput) -> RequestOutput:
        """With ``max_tokens`` 0 (``echo``: the prompt alone), each choice as if nothing was generated: the engine's
        one token is left out, and a finished choice ended at its length."""
        if not self.prompt_only:
            return output
        empty = [
            CompletionOutput(
                c.index,
                "",
                [],
                logprobs=[] if self.with_logprobs else None,
                finish_reason="length" if c.finished() else None,
            )
            for c in output.outputs
        ]
        return replace(output, outputs=empty)

    def echoed(self, output: RequestOutput) -> str:
        """What ``echo`` puts before a choice's text: its prompt, as given, or the text of a prompt of token ids,
        special tokens and all, as the model read them (as vLLM decodes it)."""
        if not self.echo:
            return ""
        if output.prompt is not None or self.tokenizer is None:
            return output.prompt or ""
        if output.request_id not in self._echoes:
            self._echoes[output.request_id] = self.tokenizer.decode(output.prompt_token_ids)
        return self._echoes[output.request_id]

    def whole(self, streams: Sequence[RequestStream], finals: dict[int, RequestOutput]) -> dict[str, Any]:
        offsets = _choice_offsets(streams)
        choices = [
            {
                "index": offsets[index] + c.index,
                "text": self.echoed(finals[index]) + (c.text if c.text is not None else ""),
                "logprobs": self.logprobs(c, prompt=finals[index])[0],
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **self.prompt_scores(finals[index]),
                **self.prompt_ids(finals[index]),
                **self.new_ids(c, 0),
            }
            for index in sorted(finals)
            for c in finals[index].outputs
        ]
        return {**self.header(self.object_whole), "choices": choices, "usage": self.usage(finals)}

    def stream(self, streams: Sequence[RequestStream], usage: _Usage) -> AsyncIterator[dict[str, Any]]:
        # Per choice: the text_offset of its next token, so a chunk decodes only its own tokens.
        text_offsets: dict[int, int] = {}

        def choice(
            number: int, output: RequestOutput, c: CompletionOutput, delta: str, start: int, first: bool
        ) -> dict[str, Any]:
            prompt = output if first else None
            logprobs, text_offsets[number] = self.logprobs(c, start, text_offsets.get(number, 0), prompt)
            entry = {
                "index": number,
                "text": self.echoed(output) + delta if first else delta,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **(self.prompt_scores(output) | self.prompt_ids(output) if first else {}),
                **self.new_ids(c, start),
            }
            return {**self.header(self.object_chunk), "choices": [entry]}

        return self.chunks(streams, usage, choice)

    def logprobs(
        self, c: CompletionOutput, start: int = 0, offset: int = 0, prompt: RequestOutput | None = None
    ) -> tuple[dict[str, Any] | None, int]:
        """OpenAI's completions logprobs for the tokens from ``start`` on, and the text_offset after them; with
        ``echo``, the ``prompt``'s tokens first (its first token's ``null``: nothing precedes it).

        ``offset`` is the text_offset of token ``start``: the length of the tokens' texts before it, each
        decoded alone, which a stream carries from chunk to chunk (decoding them all again for every chunk
        made a long answer's stream quadratic on the event loop).
        """
        if not self.with_logprobs or (c.logprobs is None and c.token_ids[start:]):  # a plugin took them out
            return None, offset
        steps: Iterable[tuple[int, dict[int, float] | None]] = zip(
            c.token_ids[start:], (c.logprobs or [])[start:], strict=True
        )
        if self.echo and prompt is not None and prompt.prompt_logprobs is not None:
            echoed = zip(prompt.prompt_token_ids, prompt.prompt_logprobs, strict=True)
            if self.echo_cut is not None:  # scored for a wider prompt_logprobs too
                echoed = ((t, step and _within(step, t, self.echo_cut)) for t, step in echoed)  # type: ignore[assignment]
            steps = itertools.chain(echoed, steps)
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token, step in steps:
            text = self.token_text(token)
            tokens.append(text)
            token_logprobs.append(None if step is None else _json_logprob(step[token]))
            top.append(None if step is None else {self.token_text(t): _json_logprob(v) for t, v in step.items()})
            offsets.append(offset)
            offset += len(text)
        logprobs = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
        return logprobs, offset


class _Chat(_Shape):
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(
        self, api: _API, request_id: str, body: ChatCompletionRequest, top_logprobs: int | None, role: str
    ) -> None:
        super().__init__(api, request_id, body)
        self.top_logprobs, self.role = top_logprobs or 0, role

    def whole(self, streams: Sequence[RequestStream], finals: dict[int, RequestOutput]) -> dict[str, Any]:
        output = finals[0]
        choices = [
            {
                "index": c.index,
                "message": {"role": self.role, "content": c.text or ""},
                "logprobs": self.logprobs(c, 0),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **self.new_ids(c, 0),
            }
            for c in output.outputs
        ]
        # vLLM's chat answer: the prompt's ids and log-probabilities once, beside the choices.
        header = {**self.header(self.object_whole), **self.prompt_scores(output), **self.prompt_ids(output)}
        return {**header, "choices": choices, "usage": self.usage(finals)}

    def stream(self, streams: Sequence[RequestStream], usage: _Usage) -> AsyncIterator[dict[str, Any]]:
        def choice(
            number: int, output: RequestOutput, c: CompletionOutput, delta: str, start: int, first: bool
        ) -> dict[str, Any]:
            message = {"role": self.role, "content": delta} if first else {"content": delta}
            entry = {
                "index": number,
                "delta": message if (delta or first) else {},
                "logprobs": self.logprobs(c, start),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **self.new_ids(c, start),
            }
            # Beside the choices, in a choice's first chunk.
            prompt = self.prompt_scores(output) | self.prompt_ids(output) if first else {}
            return {**self.header(self.object_chunk), **prompt, "choices": [entry]}

        return self.chunks(streams, usage, choice)

    def logprobs(self, c: CompletionOutput, start: int) -> dict[str, Any] | None:
        """OpenAI's chat logprobs (``content``: token, logprob, bytes, top_logprobs) from ``start`` on."""
        if c.logprobs is None:
            return None
        k = self.top_logprobs
        content = []
        for token, step in zip(c.token_ids[start:], c.logprobs[start:], strict=True):
            ranked = sorted(step.items(), key=lambda item: -item[1])[: None if k == -1 else k]  # -1: all
            content.append(
                {
                    "token": self.token_text(token),
                    "logprob": _json_logprob(step[token]),
                    "bytes": self.token_bytes(token),
                    "top_logprobs": [
                        {"token": self.token_text(t), "logprob": _json_logprob(v), "bytes": self.token_bytes(t)}
                        for t, v in ranked
                    ],
                }
            )
        return {"content": content}
