"""Linear layers whose CPU kernel is the fastest one on this machine, for the shape and rows at hand.

Decoding multiplies a few rows of activations (one per sequence) by every
weight matrix; prefilling multiplies many. Which of PyTorch's fp32 CPU kernels
does each best (MKL behind ``F.linear``, oneDNN's ``x @ weight.T``, oneDNN's
``weight @ x.T``, which streams the weight as the large operand, or oneDNN over
a copy of the weight packed ahead in its own layout) depends on
the CPU, so ``builtin_models.kernel_choice`` measures it on first use and
remembers it (its docstring has the switches).

Weights stay ordinary row-major ``(out, in)`` parameters, exactly as in the
checkpoint: plugins can inspect, replace or patch them (a packed copy follows
the weight: ``builtin_models.packed_weights``), and any device or
dtype other than fp32 on CPU, autograd, or a weight that is not contiguous
goes to ``F.linear``. Only the rounding of the sums differs between kernels,
as it does between any two BLAS libraries (parity with transformers is tested
through every kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from builtin_models.kernel_choice import (
    F_LINEAR,
    KERNELS,
    ONEDNN,
    ONEDNN_PACKED,
    ONEDNN_SWAPPED,
    PLAIN_LINEAR_ENV,
    KernelTable,
    onednn_op,
    packing_allowed,
)
from builtin_models.packed_weights import PackedWeights, pack_op

__all__ = [
    "KERNELS",
    "PLAIN_LINEAR_ENV",
    "Linear",
    "kernel_choices",
    "kernel_table",
    "linear",
    "make_kernel_table",
    "onednn_in_use",
    "packed_weights",
    "use_kernel_table",
]

# Device and dtype explicit: this module may first be imported under a meta-device or
# default-dtype context (a plugin's model constructor, say).
_ZERO = torch.zeros((), dtype=torch.float32, device="cpu")
_onednn = onednn_op()


def _run_onednn(x2d: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _onednn(x2d, weight, bias, "none", [], "")  # (rows, out)


def _run_swapped(x2d: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    rows, out_features = x2d.shape[0], weight.shape[0]
    y_t = _onednn(weight, x2d, None, "none", [], "")  # (out, rows) = weight @ x2d.T
    if rows == 1 and bias is None:
        return y_t.view(1, out_features)  # (1, out): one column is one row
    # Transpose back while adding the bias (or zero): add's kernel is several times faster than
    # copy_'s at writing a transposed tensor out contiguously.
    y = torch.empty(rows, out_features, dtype=x2d.dtype, device=x2d.device)
    return torch.add(y_t.t(), _ZERO if bias is None else bias, out=y)


class _PackedKernel:
    """oneDNN over the weight's packed copy (:func:`packed_weights`); on the plain weight where it has none."""

    def __call__(self, x2d: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        packed = packed_weights().get(weight)  # type: ignore[union-attr]
        return _run_onednn(x2d, weight if packed is None else packed, bias)  # the plain weight past the budget

    def prepare(self, weight: Tensor) -> Tensor:
        """A packed copy of ``weight``, kept nowhere: calibration times the kernel on such copies."""
        return packed_weights().pack(weight)  # type: ignore[union-attr]

    def run_prepared(self, x2d: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        return _run_onednn(x2d, packed, bias)


_run_packed = _PackedKernel()
_RUNNERS = {F_LINEAR: F.linear, ONEDNN: _run_onednn, ONEDNN_SWAPPED: _run_swapped, ONEDNN_PACKED: _run_packed}
_packed_weights: PackedWeights | None = None
_pack = pack_op() if _onednn is not None else None


def packed_weights() -> PackedWeights | None:
    """The process's packed copies of weights (``None`` where oneDNN cannot pack them)."""
    global _packed_weights
    if _packed_weights is None and _pack is not None:
        from pluginhost.engine.memory import available_bytes

        _packed_weights = PackedWeights(_pack, available=lambda: available_bytes(torch.device("cpu")))
    return _packed_weights


def _runners() -> dict:
    """The kernels this PyTorch has, as the environment allows them."""
    names = [F_LINEAR]
    if _onednn is not None:
        names += [ONEDNN, ONEDNN_SWAPPED]
        if _pack is not None and packing_allowed():
            names.append(ONEDNN_PACKED)
    return {name: _RUNNERS[name] for name in names}


_table: KernelTable | None = None


def make_kernel_table(mode: str = "measure", **options: object) -> KernelTable:
    """A kernel table over this module's kernels: ``mode`` "measure", "fallback" or a kernel's name.

    ``options`` go to ``KernelTable`` (``cache_file``, ``timer``). With
    :func:`use_kernel_table`, this forces a kernel (tests) or measures afresh.
    """
    return KernelTable(_runners(), mode=mode, **options)  # type: ignore[arg-type]


def kernel_table() -> KernelTable:
    """The process's kernel table (created on first use, from the environment)."""
    global _table
    if _table is None:
        _table = KernelTable.from_environment(_runners())
    return _table


def use_kernel_table(table: KernelTable | None) -> None:
    """Replace the process's kernel table (``None``: build it again from the environment on next use)."""
    global _table
    _table = table


def kernel_choices() -> dict[str, str]:
    """The kernel chosen for each (shape, bias, rows) met so far: what calibration decided here."""
    return kernel_table().choices()


def onednn_in_use() -> bool:
    """Whether products may go to oneDNN here (``False``: ``F.linear`` throughout, see the log for why)."""
    return _onednn is not None and kernel_table().mode != F_LINEAR


class Linear(nn.Linear):
    """``nn.Linear`` whose forward goes through :func:`linear`; parameters are unchanged."""

    def forward(self, input: Tensor) -> Tensor:
        return linear(input, self.weight, self.bias)


def _plain_bias(bias: Tensor, out_features: int) -> bool:
    """Whether oneDNN reads ``bias`` right: one fp32 value per output, side by side. It reads any bias as if it
    were so: a strided or expanded view (a plugin's replacement) gave wrong sums, a (1,) bias a crash."""
    return (
        bias.dtype is torch.float32
        and bias.is_cpu
        and bias.shape == (out_features,)
        and bias.is_contiguous()
        and not (bias.requires_grad and torch.is_grad_enabled())
    )


_PLAIN_WEIGHT_TYPES = (Tensor, nn.Parameter)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, by the fastest kernel for fp32 on CPU."""
    # First a choice already made, if it is F.linear (every product of batch-1 decoding on some CPUs): F.linear is
    # right for any input, so none of the checks below, which guard the other kernels, is needed. A decode step
    # runs this ~50 times with the weights streaming past; each check skipped is a little of the step. Only with
    # a table already built (it is built for fp32 CPU products only), and not under a tracer (fx's proxies, jit's
    # tensor-valued numel) or a compiler, which take the path below.
    table = _table
    if (
        table is not None
        and type(x) is Tensor
        and type(weight) in _PLAIN_WEIGHT_TYPES
        and weight.dim() == 2
        and weight.shape[1]
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and table.known(weight.shape[0], weight.shape[1], bias is not None, x.numel() // weight.shape[1]) == F_LINEAR
    ):
        return F.linear(x, weight, bias)
    # Checked cheapest first.
    if not (
        _onednn is not None
        and x.dtype is torch.float32
        and weight.dtype is torch.float32
        and x.is_cpu
        and weight.is_cpu
        and weight.dim() == 2
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]  # else F.linear says what does not fit
        and weight.is_contiguous()  # oneDNN's products stream it as it lies
        and (bias is None or _plain_bias(bias, weight.shape[0]))
        and not ((x.requires_grad or weight.requires_grad) and torch.is_grad_enabled())  # oneDNN has no backward
    ):
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():  # one opaque operation: the choice is made when the step runs
        return _linear_op(x, weight, bias)
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    if rows == 0:
        return F.linear(x, weight, bias)
    table = _table if _table is not None else kernel_table()
    kernel = table.kernel(weight, bias, rows)
    if kernel == F_LINEAR:
        return F.linear(x, weight, bias)
    # oneDNN takes a strided operand (say, the last position of a batch) at a crawl: copy it.
    x2d = x.reshape(rows, in_features).contiguous()  # (rows, in)
    y = _RUNNERS[kernel](x2d, weight, bias)  # (rows, out)
    return y.view(x.shape[:-1] + (out_features,))  # (..., out)


@torch.library.custom_op("pluginhost::linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`linear` as a PyTorch operator, for compiled code (``torch.compile`` cannot follow a kernel table)."""
    return linear(x, weight, bias)


@_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[:-1] + (weight.shape[0],))
