"""pluginhost-stats-logger: each engine step's figures as one JSON line, through the ``record_stats`` hook.

``PLUGINHOST_STATS_FILE`` names the file (appended to, created if missing);
unset or empty, nothing is written. The variable is read at every step, so
setting or changing it in a running process takes effect at the next step.
The file is opened once and kept open; each line is flushed as it is
written (``tail -f`` sees every step). One line per step::

    {"time": 1767052800.123, "num_running": 2, "num_waiting": 0, "num_generated_tokens": 2,
     "num_prompt_tokens": 0, "num_finished": 1, "step_time_s": 0.0123, "cache_shape": [8, 256],
     "num_preempted": 0}

``time`` is when the step ended (seconds since the epoch); the others are
``pluginhost.engine.core.EngineStats``. Every engine of the process writes to
the same file, a whole line at a time. A file that cannot be opened or
written is logged once by the engine, naming this plugin, which it then stops
calling (generation goes on).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import TextIO

from pluginhost import hookimpl

VARIABLE = "PLUGINHOST_STATS_FILE"

__all__ = ["VARIABLE", "record_stats"]


class _Writer:
    """One open file at a time, for every thread that steps an engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.path: str | None = None
        self.file: TextIO | None = None

    def write(self, path: str, line: str) -> None:
        with self._lock:
            if path != self.path or self.file is None:
                self._close()
                self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across steps
                self.path = path
            self.file.write(line)
            self.file.flush()

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self.file is not None:
            self.file.close()
        self.file = self.path = None


_writer = _Writer()
atexit.register(_writer.close)


@hookimpl
def record_stats(stats):
    path = os.environ.get(VARIABLE)
    if not path:
        return
    record = {
        "time": round(time.time(), 6),
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_generated_tokens": stats.num_generated_tokens,
        "num_prompt_tokens": stats.num_prompt_tokens,
        "num_finished": stats.num_finished,
        "step_time_s": round(stats.step_time_s, 6),
        "cache_shape": list(stats.cache_shape),
        "num_preempted": stats.num_preempted,
    }
    _writer.write(path, json.dumps(record, separators=(", ", ": ")) + "\n")
