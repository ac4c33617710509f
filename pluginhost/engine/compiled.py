"""An optional compiled decoding step (``EngineConfig.compile_decode``): ``torch.compile`` over one decode pass.

The model's decode forward and its logits are compiled as one function. On a
GPU it runs in ``"reduce-overhead"`` mode, which records the step as a CUDA
graph and replays it, so the step's few hundred small kernels cost one launch;
on a CPU, inductor fuses the small operations between the products.

Compiled code is reused only for the shapes it was compiled for, so the step's
shapes are kept few: the batch is padded up to a bucket of rows (1, 2, 4, 8,
then multiples of 8), and attention spans every slot the KV cache holds (a
multiple of 256) rather than the batch's longest sequence. The mask keeps each
row to its own positions, so the logits are the eager step's up to the
rounding of the sums. A padding row is token 0 at position 0 in a free cache
row (the scheduler keeps the running sequences in rows ``0 .. B-1``), attending
to its own slot only; its logits are dropped.

The first step at each new shape compiles, which takes seconds (tens on a
small CPU): each is logged with its time and summed in ``compile_seconds``. If
compiling fails (no C++ compiler for inductor, an operation a plugin's model
uses that the compiler does not support), a warning says why and decoding goes
on eagerly, for good.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor, nn

__all__ = ["CompiledDecode", "padded_rows"]

logger = logging.getLogger("pluginhost")


def padded_rows(rows: int, capacity: int) -> int:
    """The rows a compiled step of ``rows`` sequences computes: the next bucket, at most ``capacity``."""
    bucket = 1 << (rows - 1).bit_length() if rows <= 8 else -(-rows // 8) * 8
    return min(bucket, capacity)


class CompiledDecode:
    """The compiled decode pass of one model, with its fallback."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        mode = "reduce-overhead" if device.type == "cuda" else None  # CUDA graphs on a GPU
        self._step = torch.compile(self._forward, mode=mode)
        self._shapes: set[tuple[int, int, int]] = set()
        #: Seconds spent in first steps at a new shape (compiling, and that step's own run).
        self.compile_seconds = 0.0
        #: Why compiling failed, once it has (decoding is eager from then on).
        self.failure: BaseException | None = None

    def _forward(self, ids: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
        hidden = self.model(ids, positions, slice(0, ids.shape[0]), mask)  # (R, 1, W)
        return self.model.compute_logits(hidden[:, -1]).float()  # (R, V)

    def logits(self, tokens: list[int], positions: list[int], *, cache_rows: int, cache_slots: int) -> Tensor | None:
        """(B, V) logits of one decode step of the B rows; ``None`` once compiling has failed (decode eagerly)."""
        if self.failure is not None:
            return None
        B = len(tokens)
        R = padded_rows(B, cache_rows)
        pad = R - B
        ids = torch.tensor(tokens + [0] * pad, device=self.device)[:, None]  # (R, 1)
        at = torch.tensor(positions + [0] * pad, device=self.device)[:, None]  # (R, 1)
        mask = (torch.arange(cache_slots, device=self.device)[None, :] <= at)[:, None, None, :]  # (R, 1, 1, S)
        shape = (R, cache_rows, cache_slots)  # the cache's size too: a grown cache compiles anew
        if shape in self._shapes:
            logits = self._step(ids, at, mask)
        else:
            start = time.perf_counter()
            try:
                logits = self._step(ids, at, mask)
            except Exception as exc:  # noqa: BLE001 - any failure to compile: decode eagerly instead
                self.failure = exc
                logger.warning(
                    "compiling the decoding step of %s failed (%s: %s); decoding without compiling from now on",
                    type(self.model).__name__,
                    type(exc).__name__,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else "",
                )
                return None
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            self._shapes.add(shape)
            logger.info("decoding step compiled for %d rows and %d cache slots: %.1f s", R, cache_slots, seconds)
        # A CUDA graph's output is overwritten by its next replay: keep this step's.
        return logits[:B].clone() if self.device.type == "cuda" else logits[:B]  # (B, V)
