"""Running an app (``pluginhost.server.app.build_app``) on 127.0.0.1 for tests, always stopped afterwards.

``wait_until`` bounds the waits such tests make for something the engine loop or the server does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["running_server", "wait_until"]


def wait_until(condition: Callable[[], object], timeout: float = 10.0) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return bool(condition())


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
