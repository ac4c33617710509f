"""A command's result on stdout, kept apart from everything else the process writes.

While a command runs, stdout belongs to its result alone: whatever a plugin (or a
library under it) prints goes to stderr instead, so ``--json`` output stays valid
JSON and a table stays a table. A result that cannot be written (a pipe closed
early by ``| head``, a full disk) is one ``OutputError`` rather than a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from typing import TextIO

from pluginhost.errors import PluginhostError

__all__ = ["OutputError", "ResultStream", "reserved_stdout"]


class OutputError(PluginhostError):
    """The command's result could not be written to stdout."""


class ResultStream:
    """Where a command writes its result: the process's real stdout."""

    def __init__(self, *, fd: int | None = None, stream: TextIO | None = None, encoding: str = "utf-8") -> None:
        self._fd, self._stream, self._encoding = fd, stream, encoding

    def print(self, text: str = "") -> None:
        """Write ``text`` and a newline, unbuffered (nothing is left to fail at exit)."""
        try:
            if self._fd is not None:
                data = (text + "\n").encode(self._encoding, errors="backslashreplace")
                while data:
                    data = data[os.write(self._fd, data) :]
            else:
                if self._stream is None:  # Python started with stdout closed (`>&-`): there is nowhere to write
                    raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))
                self._stream.write(text + "\n")
                self._stream.flush()
        except OSError as exc:
            raise OutputError(_describe(exc)) from None


def _describe(exc: OSError) -> str:
    if exc.errno in (errno.EPIPE, errno.ECONNRESET) or isinstance(exc, BrokenPipeError):
        return (
            "the output could not be written: stdout was closed before the command finished (a pipe such as "
            "'| head' stopped reading); the command's work is done, only its output is incomplete"
        )
    return f"the output could not be written to stdout: {exc.strerror or exc}; free space or write it elsewhere"


@contextlib.contextmanager
def reserved_stdout() -> Iterator[ResultStream]:
    """Yield the command's ``ResultStream``; meanwhile other writes to stdout go to stderr.

    When stdout and stderr are real files, file descriptor 1 itself is pointed at
    stderr, so even writes below Python (``os.write(1, ...)``, C extensions) move.
    Otherwise (a test harness capturing ``sys.stdout``) Python-level writes move.
    """
    real = sys.stdout
    try:
        out_fd, err_fd = real.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        out_fd = err_fd = None
    if out_fd is None or err_fd is None:
        with contextlib.redirect_stdout(sys.stderr):
            yield ResultStream(stream=real)
        return
    with contextlib.suppress(OSError):
        real.flush()
    saved = os.dup(out_fd)
    os.dup2(err_fd, out_fd)
    try:
        yield ResultStream(fd=saved, encoding=real.encoding or "utf-8")
    finally:
        with contextlib.suppress(OSError):
            real.flush()  # what plugins printed, to stderr, before stdout is itself again
        os.dup2(saved, out_fd)
        os.close(saved)
