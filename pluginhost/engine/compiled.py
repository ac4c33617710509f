"""An optional compiled decoding step (``EngineConfig.compile_decode``): ``torch.compile`` over one decode pass.

The model's decode forward and its logits are compiled as one function. On a
GPU it runs in ``"reduce-overhead"`` mode, which records the step as a CUDA
graph and replays it, so the step's few hundred small kernels cost one launch;
on a CPU, inductor fuses the small operations between the products.

Compiled code is reused only for the shapes it was compiled for (the KV
cache's included), so the shapes are kept few: the batch is padded up to a
bucket of rows (1, 2, 4, 8, then multiples of 8), attention spans every slot
the cache holds rather than the batch's longest sequence, and the runner
gives the cache all of its rows at once and doubles its slots as sequences
grow (256, 512, ... up to ``max_model_len``). With 32 rows and 2048 slots
that is at most 7 x 4 shapes, each compiled at its first step. The mask keeps
each row to its own positions, so the logits are the eager step's up to the
rounding of the sums. A padding row is token 0 at position 0 in a free cache
row (the scheduler keeps the running sequences in rows ``0 .. B-1``),
attending to its own slot only; its logits are dropped.

Each first step at a new shape compiles, which takes seconds (several on a
small CPU): it is logged with its time and summed in ``compile_seconds``. An
operation the compiler cannot follow splits the compiled graph (slower, still
right). If compiling fails outright (no C++ compiler for inductor, a model the
compiler refuses, more shapes than dynamo will keep), the step is run eagerly:
when that succeeds, a warning says why compiling failed and decoding stays
eager for good; when it fails too, the failure is the model's, raised as such.

On a GPU, CUDA graphs are recorded per thread: an ``LLM`` whose ``generate`` is
called from several threads at once records them once per stepping thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["CompiledDecode", "padded_rows"]

logger = logging.getLogger("pluginhost")

#: Compiled shapes dynamo keeps for the step's code, per engine design at most a few dozen, but
#: counted over every engine of the process (the code is shared); beyond it, compiling fails over
#: to eager decoding instead of dynamo silently running the padded step uncompiled.
_RECOMPILE_LIMIT = 4096


def padded_rows(rows: int, capacity: int) -> int:
    """The rows a compiled step of ``rows`` sequences computes: the next bucket, at most ``capacity``."""
    bucket = 1 << (rows - 1).bit_length() if rows <= 8 else -(-rows // 8) * 8
    return min(bucket, capacity)


class CompiledDecode:
    """The compiled decode pass of one model, with its fallback to ``eager(tokens, positions)``."""

    def __init__(self, model: nn.Module, device: torch.device, eager: Callable[[list[int], list[int]], Tensor]) -> None:
        self.model = model
        self.device = device
        self._eager = eager
        self._limits, self._limit_hit = _dynamo_limits()
        self._shapes: set[tuple[int, int, int]] = set()
        #: Seconds spent in first steps at a new shape (compiling, and that step's own run).
        self.compile_seconds = 0.0
        #: Why compiling failed, once it has (decoding is eager from then on).
        self.failure: BaseException | None = None
        #: Whether a step is compiling now (a first at a new shape, seconds): a shutdown at exit waits for it, as
        #: the interpreter must not end under it (torch's C++ then aborts the process, status 134).
        self.compiling = False
        #: Set as the engine shuts down: no new shape is compiled from then on (its steps run eagerly).
        self.closed = False
        mode = "reduce-overhead" if device.type == "cuda" else None  # CUDA graphs on a GPU
        try:
            self._step = torch.compile(self._forward, mode=mode)
        except Exception as exc:  # noqa: BLE001 - torch refusing to compile here (Python 3.15+, free-threaded builds)
            self._compiling_failed(exc)

    def _compiling_failed(self, failure: BaseException) -> None:
        """Decode eagerly from now on, saying why once."""
        self.failure = failure
        first_line = (str(failure).strip().splitlines() or [""])[0]
        logger.warning(
            "compiling the decoding step of %s failed (%s: %s); decoding without compiling from now on",
            type(self.model).__name__,
            type(failure).__name__,
            first_line,
        )

    def _forward(self, ids: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
        hidden = self.model(ids, positions, slice(0, ids.shape[0]), mask)  # (R, 1, W)
        return self.model.compute_logits(hidden[:, -1]).float()  # (R, V)

    def logits(self, tokens: list[int], positions: list[int], *, cache_rows: int, cache_slots: int) -> Tensor:
        """(B, V) float32 logits of one decode step of the B rows of the cache (``cache_rows`` x ``cache_slots``)."""
        if self.failure is not None:
            return self._eager(tokens, positions)
        B = len(tokens)
        R = padded_rows(B, cache_rows)
        pad = R - B
        ids = torch.tensor(tokens + [0] * pad, device=self.device)[:, None]  # (R, 1)
        at = torch.tensor(positions + [0] * pad, device=self.device)[:, None]  # (R, 1)
        mask = (torch.arange(cache_slots, device=self.device)[None, :] <= at)[:, None, None, :]  # (R, 1, 1, S)
        shape = (R, cache_rows, cache_slots)
        seen = shape in self._shapes
        if not seen and self.closed:  # shutting down: compiling now could outlast the program
            return self._eager(tokens, positions)
        start = time.perf_counter()
        failure = None
        self.compiling = not seen
        try:
            with torch._dynamo.config.patch(**self._limits):
                logits = self._step(ids, at, mask)
        except Exception as exc:  # noqa: BLE001 - sorted out below: the compiler's failure or the model's
            if seen and not isinstance(exc, self._limit_hit):
                raise  # this shape ran compiled before: the model failed, not the compiler
            failure = exc
        finally:
            self.compiling = False
        if failure is not None:
            logits = self._eager(tokens, positions)  # a failure of the model's own raises here, as it would eagerly
            self._compiling_failed(failure)
            return logits
        if not seen:
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            self._shapes.add(shape)
            logger.info(
                "decoding step compiled for %d of %d cache rows and %d cache slots: %.1f s",
                R,
                cache_rows,
                cache_slots,
                seconds,
            )
        # A CUDA graph's output is overwritten by its next replay: keep this step's.
        return logits[:B].clone() if self.device.type == "cuda" else logits[:B]  # (B, V)


def _dynamo_limits() -> tuple[dict[str, object], tuple[type[BaseException], ...]]:
    """The dynamo settings for the step, and the exceptions of its limit (names differ across torch versions)."""
    config, exc = torch._dynamo.config, torch._dynamo.exc
    limits: dict[str, object] = {}
    for names, value in (
        (("recompile_limit", "cache_size_limit"), _RECOMPILE_LIMIT),
        (("accumulated_recompile_limit", "accumulated_cache_size_limit"), _RECOMPILE_LIMIT),
        (("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"), True),
    ):
        name = next((n for n in names if hasattr(config, n)), None)
        if name is not None:
            limits[name] = value
    hit = tuple(getattr(exc, n) for n in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit") if hasattr(exc, n))
    return limits, hit
