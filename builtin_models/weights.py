"""Loading checkpoint tensors into a model's parameters, checking every name and shape.

Models are constructed on the meta device, so a parameter still on meta has
not been loaded. ``assign_weights`` replaces such a parameter with the
checkpoint tensor itself (already on the target device and dtype: the engine
converts while reading), which avoids a second copy of the model in memory;
a parameter that already holds memory is copied into instead.

Plugin authors writing a model from scratch can call ``assign_weights`` from
their ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pluginhost.errors import CheckpointError

__all__ = ["assign_weights"]


def assign_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None] = lambda name: name,
) -> set[str]:
    """Load ``(checkpoint name, tensor)`` pairs into ``model``'s parameters.

    ``rename`` maps a checkpoint name to a parameter name, or to ``None`` to
    skip that tensor on purpose. Unexpected names and shape mismatches are
    collected and raised together as one ``CheckpointError``; the names of
    the loaded parameters are returned, so the caller can report missing ones.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    unexpected: list[str] = []
    mismatched: list[str] = []
    for checkpoint_name, tensor in weights:
        name = rename(checkpoint_name)
        if name is None:
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(checkpoint_name)
            continue
        if tuple(tensor.shape) != tuple(param.shape):
            mismatched.append(f"{checkpoint_name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(param.shape)}")
            continue
        if tensor.dtype.is_floating_point != param.dtype.is_floating_point:
            mismatched.append(f"{checkpoint_name}: checkpoint dtype {tensor.dtype}, model {param.dtype}")
            continue
        _set_parameter(model, name, param, tensor)
        loaded.add(name)
    problems = []
    if unexpected:
        problems.append(f"unexpected tensors (not in {type(model).__name__}): {', '.join(sorted(unexpected))}")
    if mismatched:
        problems.append(f"tensors that do not fit: {'; '.join(mismatched)}")
    if problems:
        raise CheckpointError("The checkpoint does not fit the model: " + ". ".join(problems) + ".")
    return loaded


def _set_parameter(model: nn.Module, name: str, param: nn.Parameter, tensor: torch.Tensor) -> None:
    if param.is_meta:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        tensor = tensor.to(dtype=param.dtype)  # no copy when the engine already converted it
        setattr(owner, attr, nn.Parameter(tensor, requires_grad=False))
    else:
        with torch.no_grad():
            param.copy_(tensor)
