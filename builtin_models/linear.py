"""Linear layers that pick the fastest CPU kernel for the number of rows at hand.

Decoding multiplies a few rows of activations (one per sequence) by every
weight matrix, so a step is a string of skinny matrix products. On CPU,
PyTorch's default kernel for those (MKL's sgemm, behind ``F.linear``) streams
weights at a fraction of memory bandwidth; oneDNN, which PyTorch also ships,
does much better when asked for ``weight @ x.T``: the weight becomes the
streamed operand and the few activation rows the small, reused one. Large row
counts (prefill) stay with MKL, the fastest there. benchmarks/README.md has
the figures behind each threshold.

Weights stay ordinary row-major ``(out, in)`` parameters, exactly as in the
checkpoint: plugins can inspect, replace or patch them, and any device or
dtype other than fp32 on CPU (or a missing oneDNN) goes to ``F.linear``.
Only the rounding of the sums differs between kernels, as it does between
any two BLAS libraries (parity with transformers is tested).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pluginhost.envflags import env_flag

__all__ = ["Linear", "linear", "onednn_in_use"]

logger = logging.getLogger(__name__)

#: Up to this many rows, compute ``weight @ x.T`` with oneDNN (decode).
SWAPPED_MAX_ROWS = 24
#: Up to this many rows, compute ``x @ weight.T`` with oneDNN; more go to ``F.linear`` (MKL).
ONEDNN_MAX_ROWS = 128

#: Smaller weights go to ``F.linear``: oneDNN's fixed cost per call (about 25 µs here, against 4 for
#: ``F.linear``) outweighs its faster streaming below roughly a 384 x 384 matrix.
ONEDNN_MIN_WEIGHT_ELEMENTS = 2**17

#: Set to 1 to send every product to ``F.linear`` (to compare kernels, or to rule this module out).
PLAIN_LINEAR_ENV = "PLUGINHOST_PLAIN_LINEAR"


# Device and dtype explicit: this module may first be imported under a meta-device or
# default-dtype context (a plugin's model constructor, say).
_ZERO = torch.zeros((), dtype=torch.float32, device="cpu")


class Linear(nn.Linear):
    """``nn.Linear`` whose forward goes through :func:`linear`; parameters are unchanged."""

    def forward(self, input: Tensor) -> Tensor:
        return linear(input, self.weight, self.bias)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, by the fastest kernel for fp32 on CPU."""
    # Checked cheapest first: this runs for every product of every step.
    if not (
        _onednn is not None
        and x.dtype is torch.float32
        and weight.dtype is torch.float32
        and x.is_cpu
        and weight.is_cpu
        and weight.dim() == 2
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]  # else F.linear says what does not fit
        and weight.numel() >= ONEDNN_MIN_WEIGHT_ELEMENTS
        and weight.is_contiguous()  # the swapped product streams it as it lies
        and not ((x.requires_grad or weight.requires_grad) and torch.is_grad_enabled())  # oneDNN has no backward
    ):
        return F.linear(x, weight, bias)
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    if rows == 0 or rows > ONEDNN_MAX_ROWS:
        return F.linear(x, weight, bias)
    # oneDNN takes a strided operand (say, the last position of a batch) at a crawl: copy it.
    x2d = x.reshape(rows, in_features).contiguous()
    # One row with a bias: the plain product adds the bias in the same pass, which beats the
    # swapped one plus a separate add.
    if rows <= SWAPPED_MAX_ROWS and not (rows == 1 and bias is not None):
        y_t = _onednn(weight, x2d, None, "none", [], "")  # (out, rows) = weight @ x2d.T
        if rows == 1:
            y = y_t.view(1, out_features)  # (1, out): one column is one row
        else:
            # Transpose back while adding the bias (or zero): add's kernel is several times faster
            # than copy_'s at writing a transposed tensor out contiguously.
            y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
            torch.add(y_t.t(), _ZERO if bias is None else bias, out=y)
    else:
        y = _onednn(x2d, weight, bias, "none", [], "")  # (rows, out)
    return y.view(x.shape[:-1] + (out_features,))


def onednn_in_use() -> bool:
    """Whether products may go to oneDNN here (``False``: ``F.linear`` throughout, see the log for why)."""
    return _onednn is not None


def _usable_onednn_linear() -> Callable[..., Tensor] | None:
    """oneDNN's linear kernel, if this PyTorch build has it and the user has not turned it off."""
    if env_flag(PLAIN_LINEAR_ENV):
        logger.debug("CPU linear layers: F.linear for every product (%s is set)", PLAIN_LINEAR_ENV)
        return None
    if not torch.backends.mkldnn.is_available():
        logger.debug("CPU linear layers: F.linear for every product (this PyTorch has no oneDNN)")
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise.default
        x, w, b = (torch.ones(shape, dtype=torch.float32, device="cpu") for shape in ((2, 3), (4, 3), (4,)))
        if torch.equal(op(x, w, b, "none", [], ""), F.linear(x, w, b)):
            return op
        logger.warning("oneDNN's linear kernel gave a wrong result on a self-check; using F.linear throughout")
    except (AttributeError, RuntimeError) as exc:
        logger.debug("CPU linear layers: F.linear for every product (oneDNN's linear kernel is missing: %s)", exc)
    return None


_onednn = _usable_onednn_linear()
