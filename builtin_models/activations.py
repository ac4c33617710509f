"""Activation functions by their Hugging Face config names.

A small table instead of ``transformers.activations``, whose import pulls in
much of transformers and torch.distributed (seconds of start-up).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ACTIVATIONS", "IN_PLACE", "activation"]


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


#: In-place versions, for a caller whose input is a temporary nobody else holds.
IN_PLACE: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": torch.relu_,
    "silu": partial(F.silu, inplace=True),
    "swish": partial(F.silu, inplace=True),
    "tanh": torch.tanh_,
    "sigmoid": torch.sigmoid_,
}


def activation(name: str, *, field: str, in_place: bool = False) -> Callable[[Tensor], Tensor]:
    """The function for config name ``name`` (of config field ``field``); an unknown one is an error listing the known.

    ``in_place=True`` returns a version that overwrites its input where one
    exists (relu, silu, tanh, sigmoid): it saves allocating, and on a fresh
    large tensor first touching, a second buffer of the same size.
    """
    try:
        if in_place and name in IN_PLACE:
            return IN_PLACE[name]
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"{field} {name!r} is not supported by the builtin models; use one of {', '.join(sorted(ACTIVATIONS))}, "
            "or run the checkpoint through transformers' own model: model_impl='transformers' (--model-impl "
            "transformers)"
        ) from None
