"""Running the server: a socket bound up front, uvicorn on it, and a clean exit on SIGINT or SIGTERM.

Binding the socket here, before uvicorn starts, turns "address in use" into
one clear error. On SIGINT or SIGTERM the server stops accepting
connections, gives requests in flight ``shutdown_timeout`` seconds to end,
then aborts what is left: each answer still ends as the API says (its
choices' ``finish_reason`` ``"abort"``; a stream then ``data: [DONE]``), not
cut off mid-body. Then it stops the engine loop and returns, so the command
exits 0 (uvicorn alone would re-raise the signal at the end). A second
Ctrl-C quits at once: it aborts every request then, and the server quits as
soon as their answers have ended so (at most ``_FORCED_EXIT_WAIT`` seconds
later; a third Ctrl-C does not wait). An answer the forced exit still cuts
short ends with an error (``code: shutting_down``), never a traceback. An
engine that stops for good (a tensor-parallel rank lost) ends the server the
same way as a signal, and ``run_server`` then raises its error.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import ipaddress
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI

from pluginhost.device import dtype_name
from pluginhost.engine.async_llm import AsyncLLM
from pluginhost.errors import ConfigError

__all__ = ["bind", "is_loopback", "listen", "run_server"]

logger = logging.getLogger(__name__)

#: Seconds uvicorn still waits, after the grace period, for the aborted answers to be sent.
_ABORTED_ANSWERS_TIMEOUT = 5.0

#: Connections waiting to be accepted (uvicorn's default).
_BACKLOG = 2048

#: Seconds a second Ctrl-C leaves the aborted answers to be sent before the server quits regardless.
_FORCED_EXIT_WAIT = 2.0


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (``ConfigError`` saying why when it cannot be had).

    It does not listen yet: ``run_server`` listens once the app is built, so no connection is taken (and left
    hanging, or reset when the model fails to load) before the server can answer. A port another server
    listens on fails here already.
    """
    if not 0 <= port <= 65535:  # getaddrinfo would wrap 99999 round to another port, or blame the host
        raise ConfigError(f"Cannot listen on {host}:{port}: a port is a number from 0 to 65535 (0: any free one).")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(
            f"Cannot listen on {host}:{port}: {host!r} is not a known host name ({exc.strerror})."
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the port of a server just stopped (TIME_WAIT)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise _cannot_listen(host, port, exc) from None
    # Until it listens, a socket bound with SO_REUSEADDR holds the port against nobody else binding so: a second
    # server would load its whole model, then one of the two fail to listen. Off, the port is this one's.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    sock.set_inheritable(True)
    return sock


def listen(sock: socket.socket) -> None:
    """Start taking connections on a socket of ``bind`` (``ConfigError`` when another server took the port since)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as bound: TIME_WAIT connections do not block
        sock.listen(_BACKLOG)
    except OSError as exc:
        raise _cannot_listen(*sock.getsockname()[:2], exc) from None


def _cannot_listen(host: str, port: int, exc: OSError) -> ConfigError:
    hint = " Pass another --port, or stop what uses it." if exc.errno == errno.EADDRINUSE else ""
    return ConfigError(f"Cannot listen on {host}:{port}: {exc.strerror or exc}.{hint}")


class _Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        url: str,
        describe: str,
        *,
        grace: float,
        abort_all: Callable[[], None],
        requires_key: bool,
        stopped: Callable[[], Exception | None],
    ) -> None:
        super().__init__(config)
        self._stopped = stopped
        #: The error that stopped the engine, once the server has seen it.
        self.engine_stopped: Exception | None = None
        self._url, self._describe = url, describe
        self._note = "API key required; Ctrl-C to stop" if requires_key else "Ctrl-C to stop"
        self._grace, self._abort_all = grace, abort_all
        self._loop: asyncio.AbstractEventLoop | None = None
        self._quitting = False

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn stops listening, waits for the answers in flight, then cancels them, cutting streams
        # mid-body. The engine's requests are ended first, at the grace period's end (counted from here,
        # once nothing new is accepted), so the answers finish while uvicorn still waits.
        why = f"requests still running after {self._grace:.1f} s"
        ending = asyncio.get_running_loop().call_later(self._grace, self._end_requests, why)
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()

    def _end_requests(self, why: str) -> None:
        logger.info("%s: aborting them", why)
        self._abort_all()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's second Ctrl-C stops waiting at once: the tasks still answering were cancelled, each
        # logged as an ASGI error and answered a plain-text 500. Here it aborts every request first (from
        # the event loop: a signal handler must not take the engine's locks, which the loop may hold), and
        # the server quits once their answers have ended as aborted, or after _FORCED_EXIT_WAIT seconds.
        loop = self._loop
        if sig == signal.SIGINT and self.should_exit and not self._quitting and loop is not None:
            self._quitting = True
            loop.call_soon_threadsafe(self._quit_soon)
            return
        super().handle_exit(sig, frame)  # the first signal; or a third Ctrl-C, which quits without waiting

    def _quit_soon(self) -> None:
        self._end_requests("Ctrl-C again")
        assert self._loop is not None
        self._loop.call_later(_FORCED_EXIT_WAIT, setattr, self, "force_exit", True)

    async def on_tick(self, counter: int) -> bool:
        # Once a second: an engine stopped for good (a tensor-parallel rank lost) ends the server, so a
        # supervisor restarts it instead of a load balancer sending requests that can only fail.
        if counter % 10 == 0 and self.engine_stopped is None:
            self.engine_stopped = self._stopped()
            if self.engine_stopped is not None:
                logger.error("the engine has stopped (%s): the server stops", self.engine_stopped)
                self.should_exit = True
        return await super().on_tick(counter)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            print(f"pluginhost: serving {self._describe} at {self._url} ({self._note})", file=sys.stderr, flush=True)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's graceful handling of SIGINT/SIGTERM, without re-raising the signal when done."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run_server(
    app: FastAPI,
    engine: AsyncLLM,
    sock: socket.socket,
    *,
    served_model_name: str,
    shutdown_timeout: float = 10.0,
    requires_key: bool = False,
) -> None:
    """Serve ``app`` on ``sock`` until SIGINT or SIGTERM; then end cleanly and stop ``engine``."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    if not is_loopback(host):
        logger.warning("listening on %s: reachable from other machines", host)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=shutdown_timeout + _ABORTED_ANSWERS_TIMEOUT,
        lifespan="off",
    )

    # What an operator checks first: which model, in which dtype, on which device (dtype "auto" decided by now).
    what = f"{served_model_name!r} ({engine.architecture}, {dtype_name(engine.dtype)} on {engine.device})"
    server = _Server(
        config,
        f"http://{shown}:{port}",
        what,
        grace=shutdown_timeout,
        abort_all=engine.engine.abort_all,
        requires_key=requires_key,
        stopped=lambda: engine.engine.stopped,
    )
    # What is built by now (torch, transformers, the model and its modules) lives as long as the server. Frozen
    # out of the collector's reach, it is no longer walked by every full collection: one set off by a large
    # answer (chat, n=32, 20 top log-probabilities a token) stalled the event loop 0.2 s, and 0.03 s frozen.
    gc.collect()
    gc.freeze()
    try:
        listen(sock)  # the app is built: connections can be answered from now on
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
        gc.unfreeze()  # an embedder's process goes on: what the server held may be collected again
    if server.engine_stopped is not None:
        raise server.engine_stopped


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) is this machine's loopback (say which address a name
    stands for with the socket bound to it: ``sock.getsockname()[0]``)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
