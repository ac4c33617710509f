"""Running an app (``pluginhost.server.app.build_app``) on 127.0.0.1 for tests, always stopped afterwards.

``served_url`` reads the URL a ``pluginhost serve`` process announces; ``wait_until`` bounds the
waits such tests make for something the engine loop or the server does; ``metric`` reads one figure of
``/metrics``.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["metric", "running_server", "served_url", "wait_until"]


def served_url(process: subprocess.Popen[str], timeout: float) -> tuple[str | None, list[str]]:
    """The base URL a ``pluginhost serve`` process prints on stderr ("... at http://HOST:PORT"), and its lines.

    ``None`` when no URL comes within ``timeout`` seconds or the process ends first. The lines are
    every stderr line so far, and keep growing: a thread reads stderr to its end, so the server never
    blocks on a full pipe.
    """
    url: list[str] = []
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in process.stderr:  # type: ignore[union-attr]
            lines.append(line)
            found = re.search(r"at (http://\S+)", line)
            if found and not url:
                url.append(found.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, name="pluginhost-serve-stderr", daemon=True).start()
    ready.wait(timeout)
    return (url[0] if url else None), lines


def wait_until(condition: Callable[[], object], timeout: float = 10.0) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return bool(condition())


def metric(url: str, sample: str, *, timeout: float = 30.0, headers: dict[str, str] | None = None) -> float:
    """The value of the first ``/metrics`` line of the server at ``url`` that starts with ``sample`` (0 if none).

    ``sample`` is a name with its labels as Prometheus writes them, sorted by name:
    ``'pluginhost_request_success_total{finish_reason="stop",model_name="demo"}'``.
    """
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=timeout, headers=headers).text
    line = next((x for x in text.splitlines() if x.startswith(sample)), "")
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


@contextmanager
def running_server(app, *, start_timeout: float = 30.0, stop_timeout: float = 30.0) -> Iterator[str]:  # noqa: ANN001
    """Serve ``app`` with uvicorn in a thread on a free port of 127.0.0.1; yield its base URL.

    The server is stopped when the block ends, however it ends, and the
    engine behind it is left running (its owner shuts it down).
    """
    import uvicorn

    from pluginhost.server.run import bind

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="pluginhost-test-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(stop_timeout)
        sock.close()
