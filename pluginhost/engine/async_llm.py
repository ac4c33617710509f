"""``AsyncLLM``: streaming generation for asyncio programs (the server runs on it).

The model is built, and the engine loop runs, in a thread of its own, so model
work never blocks the event loop: ``generate`` has the request tokenized and
checked in a second thread of its own (a prompt of megabytes takes seconds to
tokenize), queues it and awaits its outputs, which the loop thread hands over
with ``call_soon_threadsafe``. Outputs are cumulative; when a consumer falls behind,
it gets the latest one (nothing is lost: each holds everything so far).
Leaving the ``async for`` early (a client that went away, a cancelled task)
aborts the request, which frees its row at the next step.

>>> engine = AsyncLLM(model="path/to/opt")                                      # doctest: +SKIP
>>> async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "r1"):  # doctest: +SKIP
...     print(out.outputs[0].text)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import operator
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from pluginhost.distributed import torchrun_rank
from pluginhost.engine.core import EngineCore
from pluginhost.engine.frontend import EngineFrontend, no_lora_or_priority
from pluginhost.engine.inputs import Prompt
from pluginhost.engine.request import EngineRequest
from pluginhost.errors import InvalidParameterError
from pluginhost.host import PluginHost
from pluginhost.outputs import RequestOutput, text_after
from pluginhost.sampling import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pluginhost.engine.parallel import Ranks

__all__ = ["AsyncLLM", "RequestStream"]

logger = logging.getLogger(__name__)

#: How often the idle loop thread looks whether it should stop.
_IDLE_WAIT_S = 0.1
#: How long ``shutdown`` waits for a step in progress (a plugin's hook may hold it) before giving up on it.
_SHUTDOWN_TIMEOUT_S = 10.0

T = TypeVar("T")


class AsyncLLM(EngineFrontend):
    """An engine for asyncio: same keywords as ``LLM``; the model runs in a thread of its own."""

    def _build(self, host: PluginHost, settings: dict[str, Any]) -> None:
        """Build the model in the engine's thread and run the engine loop there; return once it is built.

        One thread does all model work, the build included, because of how torch's OpenMP runtime
        (libgomp) behaves on CPU: once a second thread has run parallel regions, there are more
        OpenMP threads than cores, its workers stop spinning between regions, and every region pays a
        wake-up (~30 us instead of ~6). A decoding step of the OPT-125m shape at 32 rows ran 7% slower
        in a loop thread after a build in the main thread than with both in one thread. Whatever the
        build raises is raised here, in the caller's thread; if the caller stops waiting (Ctrl-C), a
        build that still completes ends its engine at once.

        Two builds stay in the caller's thread: on a torchrun rank other than 0, which serves rank 0's
        steps here and runs no loop of its own (Ctrl-C must reach it), and during an import, whose
        module lock the caller holds (a build importing that module, a plugin's ``"module:Class"``
        model for one, would wait for it forever).
        """
        #: Ids given to requests being prepared (how many of each), and those of them aborted meanwhile.
        self._preparing: Counter[str] = Counter()
        self._aborted_early: set[str] = set()
        # One thread, on purpose: requests are queued in the order they came, and ``on_request`` hooks are
        # called one at a time (a plugin may keep state without a lock). More threads would not make one long
        # prompt wait less, only let others pass it, while competing with the engine thread for the cores;
        # what one request can cost here is bounded instead: text too long for max_model_len however it
        # tokenizes is refused unread (``InputProcessor.check_text_length``), and a server reads no body
        # over its limit. Whole answers are built in the event loop's own executor, not here.
        self._loop = loop = _EngineLoop(ThreadPoolExecutor(max_workers=1, thread_name_prefix="pluginhost-inputs"))
        importing = _inside_an_import()
        if importing or torchrun_rank() not in (None, 0):
            if importing:
                logger.info(
                    "AsyncLLM built during an import: built in the importing thread, not the engine's (which would "
                    "wait for the module being imported); on a CPU its steps may then run up to ~10%% slower"
                )
            super()._build(host, settings)
            loop.engine, loop.ranks = self.engine, getattr(self, "_ranks", None)
            if self.engine is not None:
                loop.thread = threading.Thread(target=loop.run, name="pluginhost-engine", daemon=True)
                loop.thread.start()
            self._shut_down_when_dropped()
            return
        built: Future[None] = Future()
        abandoned = threading.Event()
        frontend = weakref.ref(self)  # the thread must not hold the engine, which would then never be freed

        def build_then_run() -> None:
            try:
                super(AsyncLLM, frontend())._build(host, settings)  # the caller holds it until built
                loop.engine, loop.ranks = frontend().engine, getattr(frontend(), "_ranks", None)
            except BaseException as exc:  # noqa: BLE001 - handed to the constructor's thread, which raises it
                built.set_exception(exc)
                return
            built.set_result(None)
            if loop.engine is not None:  # None on a tensor-parallel rank other than 0: it has served and ended
                loop.run()  # returns at once if the caller has stopped waiting
            if abandoned.is_set() and loop.ranks is not None:  # nobody holds this engine to shut it down
                loop.ranks.close()

        loop.thread = threading.Thread(target=build_then_run, name="pluginhost-engine", daemon=True)
        loop.thread.start()
        try:
            built.result()
        except BaseException:
            abandoned.set()
            loop.stopping.set()
            raise
        self._shut_down_when_dropped()

    def _shut_down_when_dropped(self) -> None:
        """Have ``shutdown`` run when this engine is dropped, or at the program's exit if it is still held then."""
        ranks_closer = getattr(self, "_finalizer", None)  # the frontend's: a shutdown ends the ranks too
        if ranks_closer is not None:
            ranks_closer.detach()
        self._finalizer = weakref.finalize(self, self._loop.stop, _SHUTDOWN_TIMEOUT_S)

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        lora_request: None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs as tokens arrive; the last one is finished.

        A bad prompt or parameter raises ``ValueError`` before anything runs;
        a full queue raises ``EngineOverloadedError``; a model failure raises
        ``ModelRunError`` from the ``async for``. After ``abort``, the last
        output has ``finish_reason`` ``"abort"``. Leaving the loop early
        aborts the request. vLLM's ``lora_request`` and ``priority`` are taken
        at their defaults (``None``, 0) and refused otherwise.

        ``SamplingParams.output_kind`` (as the request runs, after ``on_request`` hooks): ``DELTA`` yields what is
        new since the output before (every sample, each with its new text, tokens and logprobs; the prompt's
        logprobs in the first), ``FINAL_ONLY`` the finished output alone.
        """
        no_lora_or_priority(lora_request)
        if not _is_zero(priority):
            raise InvalidParameterError(
                f"priority={priority!r} is not supported by pluginhost (requests run first come, first served, as "
                "vLLM's default scheduling): leave it 0",
                param="priority",
            )
        stream = await self.submit(prompt, sampling_params, request_id)
        kind = stream.request.params.output_kind
        sent: dict[int, tuple[str, int]] = {}  # DELTA: each sample's text and tokens already yielded
        try:
            async for output in stream:
                if kind == RequestOutputKind.DELTA:
                    yield _delta(output, sent, stream.request_id)
                elif kind == RequestOutputKind.CUMULATIVE or output.finished:
                    yield output
        finally:
            stream.abort()

    async def submit(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        exact_max_tokens: bool = False,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """``add_request``, with the prompt tokenized and checked in the engine's input thread.

        The event loop goes on meanwhile (``on_request`` hooks run in that thread too); the
        errors are ``add_request``'s. ``exact_max_tokens``: a ``max_tokens`` the context cannot hold
        is a ``PromptTooLongError``, as the OpenAI API has it (else generation ends at
        ``max_model_len``, as in vLLM's engine), and one left unset takes the model's recommended one
        (``InputProcessor.make_request``). ``arrival_time`` (``time.monotonic()``): when the
        request arrived, if before this call (a server's HTTP request), which its latencies count from.
        """
        [stream] = await self.submit_all(
            [(prompt, sampling_params, request_id)], exact_max_tokens=exact_max_tokens, arrival_time=arrival_time
        )
        return stream

    async def submit_all(
        self,
        requests: Sequence[tuple[Prompt, SamplingParams | None, str | None]],
        *,
        exact_max_tokens: bool = False,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
    ) -> list[RequestStream]:
        """``submit`` for several ``(prompt, params, request_id)``: all prepared first, then queued together.

        All or none: an error in any of them (``prompt 2 has ...``) queues none, and a caller
        cancelled while they are prepared leaves nothing behind. ``arrival_time`` is theirs, as in ``submit``;
        ``add_special_tokens=False`` tokenizes text prompts without the tokenizer's special tokens.
        """
        self._check_open()
        loop = asyncio.get_running_loop()
        streams = [RequestStream(self.engine, loop) for _ in requests]
        picked = [request_id is None for _, _, request_id in requests]
        make = [
            self._maker(stream, prompt, params, request_id, index, exact_max_tokens, arrival_time, add_special_tokens)
            for index, ((prompt, params, request_id), stream) in enumerate(zip(requests, streams, strict=True))
        ]
        given = [request_id for _, _, request_id in requests if request_id is not None]
        self._preparing.update(given)  # an abort of these ids meanwhile must not be lost
        try:
            prepared = await self.off_loop(lambda: [m() for m in make])  # one hop, in order
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._loop.stopping.is_set() and task is not None and not task.cancelling():  # shutdown dropped it
                raise RuntimeError("this AsyncLLM was shut down") from None
            raise
        finally:
            self._preparing.subtract(given)
            aborted = {i for i in given if i in self._aborted_early}
            for request_id in given:
                if self._preparing[request_id] <= 0:
                    del self._preparing[request_id]
                    self._aborted_early.discard(request_id)
        self._check_open()  # shut down while they were prepared
        for stream, request, engine_picked in zip(streams, prepared, picked, strict=True):
            stream.request = request
            if engine_picked and self.engine.is_running(request.request_id):  # a caller took it meanwhile
                request.request_id = self._new_request_id()
        self.engine.submit(prepared)
        for stream in streams:
            if stream.request.request_id in aborted:  # aborted while it was prepared: it ends at the next step
                stream.abort()
        return streams

    def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        index: int = 0,
    ) -> RequestStream:
        """Check and queue a request now (``ValueError``, ``EngineOverloadedError``); iterate the stream for outputs.

        Must be called from the event loop that will consume the stream; tokenizes in it (``submit``
        does not). ``index`` names the prompt in error messages (``prompt 2 has ...``), for a caller
        that sends a list of them.
        """
        self._check_open()
        stream = RequestStream(self.engine, asyncio.get_running_loop())
        stream.request = self._maker(stream, prompt, sampling_params, request_id, index)()
        self.engine.submit([stream.request])
        return stream

    def _maker(
        self,
        stream: RequestStream,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        index: int,
        exact_max_tokens: bool = False,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
    ) -> Callable[[], EngineRequest]:
        """What makes the request ``stream`` delivers, once called (in the input thread, or at once)."""
        _checked_request_id(request_id)
        return functools.partial(
            self._inputs.make_request,
            request_id if request_id is not None else self._new_request_id(),
            prompt,
            params if params is not None else self.get_default_sampling_params(),
            index=index,
            on_output=stream.deliver,
            streaming=True,
            exact_max_tokens=exact_max_tokens,
            arrival_time=arrival_time,
            add_special_tokens=add_special_tokens,
        )

    async def off_loop(self, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)`` in the engine's input thread, where requests are prepared; awaited, never blocking the loop."""
        return await asyncio.get_running_loop().run_in_executor(self._loop.inputs_thread, fn, *args)

    def _check_open(self) -> None:
        self._check_generates()
        if self._loop.stopping.is_set():
            raise RuntimeError("this AsyncLLM was shut down")

    def abort(self, request_id: str | Iterable[str]) -> Awaitable[None]:
        """End a request (or several: an iterable of ids, as vLLM takes) at the next step; its stream ends with
        ``finish_reason`` ``"abort"``.

        Also a request still being prepared (tokenized, checked) under that id: it is queued, then ended at
        the next step. The id is free at once: a new request may take it before the old one's stream has ended.
        Done when it returns; the result may be awaited, as code written for vLLM's coroutine does
        (``await engine.abort(request_id)``).
        """
        ids = [request_id] if isinstance(request_id, str) else _as_list(request_id)
        if ids is None or not all(isinstance(i, str) for i in ids):
            raise TypeError(f"abort takes a request id (str) or an iterable of them, got {request_id!r}")
        for i in ids:
            if i in self._preparing:
                self._aborted_early.add(i)
        self.engine.abort(ids)
        return _DONE

    def shutdown(self, timeout: float = _SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the loop thread (requests still running end as aborted); idempotent.

        An engine dropped, or still held when the program ends, gets it then: the loop thread must not
        be mid-step when the interpreter goes (torch's C++ then aborts the process, exit status 134). A step
        compiling (``compile_decode``: the first at a new shape, seconds) is waited for past ``timeout``.
        """
        if self._finalizer.detach() is not None:
            self._loop.stop(timeout)


class _EngineLoop:
    """The engine loop's thread and what it runs on, apart from the ``AsyncLLM``: nothing here refers to it, so
    an engine its program drops is freed (its ``weakref.finalize`` stops this) instead of kept by its own thread."""

    def __init__(self, inputs_thread: ThreadPoolExecutor) -> None:
        self.stopping = threading.Event()
        #: Where requests are prepared (``AsyncLLM.off_loop``).
        self.inputs_thread = inputs_thread
        #: Set once the model is built; the engine is None on a tensor-parallel rank other than 0 (no loop there).
        self.engine: EngineCore | None = None
        self.ranks: Ranks | None = None
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        while not self.stopping.is_set():
            if not self.engine.wait_for_work(_IDLE_WAIT_S):
                continue
            try:
                self.engine.step()
            except BaseException as exc:  # noqa: BLE001 - the loop must outlive a bug in one step, a sys.exit() too
                logger.exception("the engine loop failed a step; its requests end with the error")
                if not isinstance(exc, Exception):  # a plugin's sys.exit(): the thread would end, every stream hang
                    exc = RuntimeError(f"the engine loop failed a step: {type(exc).__name__}: {exc}")
                self.engine.fail_all(exc)
        # Stopped by shutdown, whose own step gives up when this thread's outlasts its timeout: the aborts it
        # queued are handed out here (every stream hung), and anything else ends with an error.
        self.engine.fail_all(RuntimeError("this AsyncLLM was shut down"))

    def stop(self, timeout: float) -> None:
        """``AsyncLLM.shutdown``'s work; called once."""
        if self.thread is not None and self.thread is threading.current_thread():
            # Dropped in a cycle the garbage collector freed while this thread was mid-step: the step must end
            # before the aborts are handed out and the ranks closed (they are in its collectives).
            threading.Thread(target=self.stop, args=(timeout,), name="pluginhost-shutdown", daemon=True).start()
            return
        if self.engine is None:  # a tensor-parallel rank other than 0: no loop, its ranks end with rank 0's
            self.stopping.set()
        else:
            deadline = time.monotonic() + timeout  # one for the whole shutdown, not one per wait
            compiled = self.engine.runner.compiled
            if compiled is not None:
                compiled.closed = True  # no new shape compiles from now on; one compiling is waited for below
            self.engine.abort_all(close=True)  # a request submitted from now on is refused, not left running
            self.engine.step(timeout=timeout)  # hand the aborts out, unless a step stuck in a plugin holds the engine
            self.stopping.set()
            self.inputs_thread.shutdown(wait=False, cancel_futures=True)  # what is not prepared yet never will be
            self.thread.join(max(0.0, deadline - time.monotonic()))
            if self.thread.is_alive() and compiled is not None and compiled.compiling:
                # Past the timeout: a program ending under a compiling step aborts (status 134).
                while compiled.compiling:
                    self.thread.join(0.1)
                self.thread.join(timeout)  # then the rest of that step
        if self.ranks is not None:
            self.ranks.close()


class RequestStream:
    """The outputs of one submitted request, as they arrive: ``async for output in stream``.

    Cumulative outputs; a consumer that falls behind gets the latest (only the latest is kept, as
    vLLM's output collector keeps it: a client that stops reading holds one output, not every one
    so far). The iteration ends after the finished output, and raises the error that ended the
    request, if one did; nothing delivered after either is shown. ``abort()`` ends it early
    (idempotent).
    """

    request: EngineRequest

    def __init__(self, engine: EngineCore, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop
        self._latest: tuple[RequestOutput | None, BaseException | None] | None = None
        self._ready = asyncio.Event()
        self._done = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def deliver(self, output: RequestOutput | None, error: BaseException | None) -> None:
        """Called by the thread that stepped the engine."""
        try:
            self._loop.call_soon_threadsafe(self._keep, output, error)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _keep(self, output: RequestOutput | None, error: BaseException | None) -> None:
        """In the event loop: the newest output replaces the one not yet read, unless that one ended the stream."""
        kept = self._latest
        if kept is not None and (kept[1] is not None or (kept[0] is not None and kept[0].finished)):
            return
        self._latest = (output, error)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while self._latest is None:
            self._ready.clear()
            await self._ready.wait()
        (output, error), self._latest = self._latest, None
        if error is not None:
            self._done = True
            raise error
        assert output is not None
        self._done = output.finished
        return output

    def abort(self) -> None:
        """End the request at the next step, unless it has finished."""
        if not self.request.finished:
            self._engine.abort_request(self.request)


class _Done(Coroutine[None, None, None]):
    """A coroutine already done: awaited, or run as a task (``asyncio.create_task``), it returns ``None`` at once."""

    __slots__ = ()

    def __await__(self) -> Iterator[None]:
        return iter(())

    def send(self, value: object) -> None:
        raise StopIteration

    def throw(self, *exc: Any) -> None:  # noqa: ANN401 - any exception, as a coroutine takes it
        raise exc[1] if len(exc) > 1 and exc[1] is not None else exc[0]

    def close(self) -> None:
        pass


_DONE = _Done()


def _checked_request_id(request_id: object) -> None:
    """Refuse an id ``abort`` could not name (vLLM's ids are strings): an int ran on, unabortable, to its end."""
    if request_id is not None and not isinstance(request_id, str):
        raise TypeError(
            f"request_id must be a str (or None for one the engine picks), got {type(request_id).__name__} "
            f"{request_id!r}"
        )


def _as_list(items: object) -> list[object] | None:
    try:
        return list(items)  # type: ignore[call-overload]
    except TypeError:
        return None


def _inside_an_import() -> bool:
    """Whether this thread is running a module's body for an import (and so holds that module's import lock)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _delta(output: RequestOutput, sent: dict[int, tuple[str, int]], request_id: str) -> RequestOutput:
    """``output`` as what is new since the outputs of ``sent`` (each sample's text and tokens yielded so far,
    updated): every sample, with its new text, tokens and logprobs; the prompt's logprobs only the first time.

    A stream's text only grows (text that a stop string may still cut is held back), unless an ``on_output`` hook
    changed the finished output: what was yielded cannot be taken back (``text_after``, as the server's streams).
    """
    first = not sent
    samples = []
    for sample in output.outputs:
        text_sent, tokens_sent = sent.get(sample.index, ("", 0))
        text = text_after(text_sent, sample.text, request_id) if sample.text is not None else None
        sent[sample.index] = (text_sent + (text or ""), max(tokens_sent, len(sample.token_ids)))
        logprobs = sample.logprobs[tokens_sent:] if sample.logprobs is not None else None
        samples.append(replace(sample, text=text, token_ids=sample.token_ids[tokens_sent:], logprobs=logprobs))
    return replace(output, outputs=samples, prompt_logprobs=output.prompt_logprobs if first else None)


def _is_zero(priority: object) -> bool:
    """Whether ``priority`` is vLLM's default, 0 (an int; NumPy's too)."""
    try:
        return operator.index(priority) == 0  # type: ignore[arg-type]
    except TypeError:
        return False
