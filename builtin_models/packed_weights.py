"""Copies of fp32 weights in oneDNN's blocked layout, made once a weight's products want one, within a memory budget.

oneDNN multiplies a row-major ``(out, in)`` weight by first reordering it into
its blocked layout, every call; a weight reordered once ahead ("packed", as
vLLM's CPU backend and IPEX do) skips that. On an AVX-512 Xeon, with a few rows
(a decoding batch of 4-16 sequences) the packed products were 9-18% faster than
the next-best kernel's, though a step streams the weights anyway; with one row
they were slower (there the plain weight through ``F.linear`` was fastest).
``builtin_models.kernel_choice`` measures the packed kernel beside the others
and chooses it only where it wins, on the machine at hand.

Weights stay ordinary parameters, as the checkpoint has them (plugins read,
replace and patch them): a packed copy sits beside its weight, keyed by the
tensor, and is made again when the weight is written in place (its version
counter moves: ``mul_``, ``copy_``, ``load_state_dict``, under ``no_grad`` or
``inference_mode``) or given new data (``weight.data = ...``); it is freed with
the weight. Two kinds of writes bypass the version counter and are not seen:
through ``weight.data`` (``weight.data.mul_(2)``) and through a NumPy view;
after such a write, call :meth:`PackedWeights.clear` (``builtin_models.linear.
packed_weights().clear()``). And torch refuses to swap a tensor that has weak
references, so with ``torch.__future__.set_swap_module_params_on_conversion(True)``
a packed weight's ``load_state_dict`` or ``module.to()`` fails: set
``PLUGINHOST_PACKED_WEIGHTS=0`` there.

The cost is memory: a packed weight is held twice. So copies are made only up
to a budget, a quarter of the memory available when the first one is made
(``PACKED_SHARE``), shared among the processes on the machine that pack their
own (tensor-parallel ranks, ``sharers``); beyond it the products of the weights
left unpacked go through oneDNN on the plain weight (the next-best kernel at
those row counts), said once in the log. ``PLUGINHOST_PACKED_WEIGHTS=0`` never
packs: the packed kernel is then not a candidate at all.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from builtin_models.kernel_choice import PACKED_WEIGHTS_ENV

__all__ = ["PACKED_SHARE", "PackedWeights", "pack_op"]

logger = logging.getLogger(__name__)

#: The share of the memory available at the first packing that packed copies may take in all.
PACKED_SHARE = 0.25
#: The row count oneDNN is told to expect when it chooses the blocked layout: measured on an AVX-512 Xeon,
#: packed for 2, 16, 32 or 128 rows, 1-32 rows ran within 5% of each other; the layout serves any row count.
_PACK_FOR_ROWS = 32

Packer = Callable[[Tensor, int], Tensor]


def pack_op() -> Packer | None:
    """oneDNN's weight reorder, if this PyTorch has it and its packed weights multiply correctly here."""
    try:
        reorder = torch.ops.mkldnn._reorder_linear_weight.default
        multiply = torch.ops.mkldnn._linear_pointwise.default
        # Explicit device and dtype: the first import may run under a meta device or a half default dtype.
        x, w, b = (torch.arange(n, dtype=torch.float32, device="cpu").reshape(shape) for n, shape in _PROBE)
        with torch.inference_mode():
            if torch.equal(
                multiply(x, reorder(w, _PACK_FOR_ROWS), b, "none", [], ""), torch.nn.functional.linear(x, w, b)
            ):
                return reorder
        logger.warning("oneDNN's packed weights gave a wrong result on a self-check; weights are not packed")
    except (AttributeError, RuntimeError) as exc:
        logger.debug("oneDNN cannot pack weights here (%s)", exc)
    return None


_PROBE = ((6, (2, 3)), (12, (4, 3)), (4, (4,)))


@dataclass(eq=False)
class _Entry:
    weight: weakref.ref
    version: int
    data_ptr: int
    packed: Tensor
    nbytes: int
    finalizer: weakref.finalize | None = None


class PackedWeights:
    """The packed copies of one process's weights: made on demand, checked against the weight, within a budget.

    ``available`` tells the memory a new allocation can take now (``None``: unknown, no budget), ``packer``
    reorders a weight (default: :func:`pack_op`'s).
    """

    def __init__(self, packer: Packer, *, available: Callable[[], int | None], share: float = PACKED_SHARE) -> None:
        self._packer = packer
        self._available = available
        self._share = share
        self._budget: float | None = None  # bytes, fixed at the first packing
        self._entries: dict[int, _Entry] = {}  # by id() of the weight: a tensor's == compares its elements
        # Reentrant: packing allocates, an allocation may run the cyclic garbage collector, and a weight it frees
        # has its copy dropped (``_drop``) in this very thread, under the lock ``_make`` holds. ``_drop`` only
        # touches a dead weight's entry, never the live one ``_make`` is making, between whole statements.
        self._lock = threading.RLock()
        self._full_logged = self._first_logged = False
        #: Bytes the packed copies take now.
        self.nbytes = 0
        #: Processes on this machine that keep packed copies of their own (tensor-parallel ranks): the budget is
        #: divided among them. Set before the first packing (the engine's loader does).
        self.sharers = 1

    def pack(self, weight: Tensor) -> Tensor:
        """A packed copy of ``weight``, kept nowhere (calibration times its kernel on such copies)."""
        with torch.no_grad():  # a copy with a grad_fn would keep its weight alive, and so itself
            return self._packer(weight, _PACK_FOR_ROWS)

    def get(self, weight: Tensor) -> Tensor | None:
        """``weight``'s packed copy, made now if it has none or the weight changed since; ``None`` past the budget."""
        entry = self._entries.get(id(weight))
        if (
            entry is not None
            and entry.weight() is weight
            and entry.version == weight._version
            and entry.data_ptr == weight.data_ptr()
        ):
            return entry.packed
        with self._lock:
            return self._make(weight)

    def _make(self, weight: Tensor) -> Tensor | None:
        old = self._entries.pop(id(weight), None)
        if old is not None:  # a stale copy (the weight changed, or its id was reused): its memory comes back first
            self.nbytes -= old.nbytes
            if old.finalizer is not None:
                old.finalizer.detach()  # else it would hold the old copy until the weight goes
        if weight.is_inference():  # no version counter: a change in place could not be seen
            return None
        nbytes = weight.numel() * weight.element_size()
        if self._budget is None:
            available = self._available()
            share = self._share / max(1, self.sharers)
            self._budget = float("inf") if available is None else share * (available + self.nbytes)
        if self.nbytes + nbytes > self._budget:
            if not self._full_logged:
                self._full_logged = True
                logger.info(
                    "packed copies of the weights have reached their budget (%s, this process's share of a quarter "
                    "of the memory available at the first): the products of weights left unpacked use oneDNN on the "
                    "plain weight",
                    _mib(self._budget),
                )
            return None
        if not self._first_logged:
            self._first_logged = True  # RSS grows by each weight packed: say why, and how to keep it from growing
            logger.info(
                "packing weights for oneDNN, the fastest kernel measured here for some products: each weight packed "
                "is held twice, up to %s (%s=0 never packs)",
                "no limit" if self._budget == float("inf") else _mib(self._budget),
                PACKED_WEIGHTS_ENV,
            )
        packed = self.pack(weight)
        entry = _Entry(weakref.ref(weight), weight._version, weight.data_ptr(), packed, nbytes)
        entry.finalizer = weakref.finalize(weight, self._drop, id(weight), entry)
        self._entries[id(weight)] = entry
        self.nbytes += nbytes
        return packed

    def clear(self) -> None:
        """Drop every copy: each weight is packed again at its next product (after writes the copies cannot see)."""
        with self._lock:
            for entry in self._entries.values():
                if entry.finalizer is not None:
                    entry.finalizer.detach()
            self._entries.clear()
            self.nbytes = 0

    def _drop(self, key: int, entry: _Entry) -> None:
        """The weight is gone: its copy goes too (unless a newer copy already replaced it)."""
        with self._lock:
            if self._entries.get(key) is entry:
                del self._entries[key]
                self.nbytes -= entry.nbytes


def _mib(nbytes: float) -> str:
    mib = nbytes / 2**20
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.2f} MiB"
