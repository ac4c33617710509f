"""Loading checkpoint tensors into a model's parameters, checking every name and shape.

Models are constructed on the meta device, so a parameter still on meta has
not been loaded. ``assign_weights`` replaces such a parameter with the
checkpoint tensor itself (already on the target device and dtype, in memory
the engine owns, never mapped from a file: the engine converts and copies while
reading), which avoids a second copy of the model in memory; a parameter that
already holds memory is copied into instead. A parameter stacked from several
checkpoint tensors (see ``Stacked``) is allocated once and each part copied
into its rows. One with a part absent from the checkpoint is left out of the
loaded names, so the loader names it with every other missing parameter, in
one message; its ``PARTS_MISSING_ATTR`` says which parts it lacks.

A parameter may also hold only a slice of its checkpoint tensor (tensor
parallelism: ``builtin_models.tp`` marks such parameters with a ``Shard``);
the slice is cut from each tensor as it arrives, before the shape is checked.

Plugin authors writing a model from scratch can call ``assign_weights`` from
their ``load_weights``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass

import torch
from torch import nn

from pluginhost.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = [
    "PARTS_MISSING_ATTR",
    "SHARD_ATTR",
    "Shard",
    "Stacked",
    "TiedHead",
    "assign_weights",
    "check_all_loaded",
    "same_tensor",
]

#: The attribute of a (meta) parameter holding its ``Shard``.
SHARD_ATTR = "tp_shard"
#: The attribute of a stacked parameter some of whose parts the checkpoint lacks: which ones, for messages
#: ("stacked from q_proj, k_proj, v_proj; no k_proj").
PARTS_MISSING_ATTR = "parts_missing"


@dataclass(frozen=True)
class Stacked:
    """Where a checkpoint tensor goes when the model stacks several into one parameter.

    ``param`` is made of parts along dim 0, named ``parts`` in order (say
    ``("q_proj", "k_proj", "v_proj")`` for a fused attention input
    projection); this tensor is part ``parts[part]``. The parts are equal,
    unless ``sizes`` gives each one's rows (grouped-query attention has fewer
    key and value rows than query rows). One matrix product then does the
    work of several.
    """

    param: str
    part: int
    parts: tuple[str, ...]
    sizes: tuple[int, ...] | None = None

    def rows(self, total: int) -> tuple[int, int]:
        """(start, stop) rows of this part in a parameter of ``total`` rows."""
        sizes = self.sizes or (total // len(self.parts),) * len(self.parts)
        start = sum(sizes[: self.part])
        return start, start + sizes[self.part]


@dataclass(frozen=True)
class Shard:
    """The slice of a checkpoint tensor a parameter holds, on one of ``world`` ranks.

    Along ``dim``, the tensor is cut into ``world`` equal chunks and this rank
    keeps chunk ``rank``; a fused tensor (``parts``: the full sizes of its parts
    along ``dim``, such as q, k and v stacked) is cut part by part. A part may
    be cut into fewer chunks than ranks (``chunks``: each part's count, a
    divisor of ``world``; key/value heads fewer than the ranks): rank r keeps
    chunk ``r * chunks // world``, a copy of what its neighbours keep. ``pad``
    (a vocabulary split): chunks of ``ceil(size / world)``, the last one padded
    with zeros. ``rank0_only`` (the bias of a row-parallel product, whose
    outputs are summed over ranks): rank 0 keeps the tensor, the others zeros.
    """

    rank: int
    world: int
    dim: int = 0
    parts: tuple[int, ...] | None = None
    chunks: tuple[int, ...] | None = None
    pad: bool = False
    rank0_only: bool = False

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full ``tensor`` (a copy: the full one can be freed)."""
        if self.rank0_only:
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if self.dim >= tensor.dim():
            return tensor  # the shape check reports the mismatch
        size = tensor.shape[self.dim]
        if self.pad:
            chunk = -(-size // self.world)
            start = min(self.rank * chunk, size)
            piece = tensor.narrow(self.dim, start, min(chunk, size - start))
            missing = chunk - piece.shape[self.dim]
            if missing:
                shape = list(piece.shape)
                shape[self.dim] = missing
                piece = torch.cat([piece, piece.new_zeros(shape)], dim=self.dim)
            return _own(piece)
        parts = self.parts or (size,)
        if sum(parts) != size or any(p % self._chunks(i) for i, p in enumerate(parts)):
            return tensor  # not this model's tensor: the shape check reports it
        pieces = tensor.split(list(parts), dim=self.dim)
        mine = [self._mine(piece, self.dim, self._chunks(i)) for i, piece in enumerate(pieces)]
        return torch.cat(mine, dim=self.dim) if len(mine) > 1 else _own(mine[0])

    def take_part(self, tensor: torch.Tensor, part: int) -> torch.Tensor:
        """This rank's slice of part ``part`` of a stacked parameter (its rows, cut into that part's chunks)."""
        size, chunks = tensor.shape[0] if tensor.dim() else 0, self._chunks(part)
        if self.dim != 0 or size % chunks:
            return tensor  # the shape check reports it
        return _own(self._mine(tensor, 0, chunks))

    def _chunks(self, part: int) -> int:
        return self.chunks[part] if self.chunks is not None else self.world

    def _mine(self, piece: torch.Tensor, dim: int, chunks: int) -> torch.Tensor:
        """This rank's chunk of ``piece`` cut into ``chunks`` along ``dim`` (shared by ``world // chunks`` ranks)."""
        length = piece.shape[dim] // chunks
        return piece.narrow(dim, self.rank * chunks // self.world * length, length)


def _own(piece: torch.Tensor) -> torch.Tensor:
    """``piece`` in memory of its own: a slice of rows is contiguous already, and ``contiguous()`` would keep the
    whole tensor alive behind it (every rank holding the whole checkpoint tensor for its share)."""
    return piece.clone(memory_format=torch.contiguous_format)


def assign_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | Stacked | None] = lambda name: name,
    transposed: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Load ``(checkpoint name, tensor)`` pairs into ``model``'s parameters.

    ``rename`` maps a checkpoint name to a parameter name, to a :class:`Stacked`
    part of one, or to ``None`` to skip that tensor on purpose. Unexpected
    names, tensors that do not fit (shape, or floating point for an integer
    parameter and back) and two tensors loading one parameter (two spellings
    of its name, or a tensor of all of a stacked parameter beside its parts)
    are collected and raised together as one
    ``CheckpointError``, which also names the stacked parameters with parts
    absent. The names of the loaded parameters are returned, so the caller can
    report missing ones: a stacked parameter is loaded when all its parts are.

    ``transposed`` names the checkpoint tensors stored (in, out), such as
    transformers' ``Conv1D`` weights: a 2-D one is transposed into its (out,
    in) parameter as it loads, and a misfit is reported in the layout the
    checkpoint stores.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    # Read once: a parameter replaced as it loads no longer carries its Shard.
    shards = {name: getattr(p, SHARD_ATTR) for name, p in params.items() if hasattr(p, SHARD_ATTR)}
    loaded: set[str] = set()
    stacked_parts: dict[str, tuple[Stacked, set[int]]] = {}  # parameter -> its parts the checkpoint holds
    unexpected: list[str] = []
    mismatched: list[str] = []
    twice: list[str] = []
    filled: dict[str, dict[int | None, str]] = {}  # parameter -> {stacked part, None if whole: the checkpoint name}
    whole_and_parts: dict[str, tuple[str, list[str]]] = {}  # parameter -> the tensor of all of it, those of parts
    for checkpoint_name, tensor in weights:
        target = rename(checkpoint_name)
        if target is None:
            continue
        name = target.param if isinstance(target, Stacked) else target
        param = params.get(name)
        if param is None:
            unexpected.append(checkpoint_name)
            continue
        part = target.part if isinstance(target, Stacked) else None
        fills = filled.setdefault(name, {})
        if part in fills:  # two spellings of one name ("model.decoder.X" and "decoder.X"): the last would win
            what = name if part is None else f"the {target.parts[part]} part of {name}"  # type: ignore[union-attr]
            twice.append(f"{fills[part]} and {checkpoint_name} both load {what}")
            continue
        if fills and (part is None or None in fills):
            # The whole parameter and parts of it (a fused "qkv_proj" beside q/k/v_proj): the later would overwrite
            # the earlier; transformers, which knows only one of the layouts, ignores the other as unexpected.
            if name not in whole_and_parts:
                parts = [earlier for p, earlier in fills.items() if p is not None]
                whole_and_parts[name] = (fills.get(None, checkpoint_name), parts)
            if part is not None:
                whole_and_parts[name][1].append(checkpoint_name)
            fills[part] = checkpoint_name  # the parts that come later join this message, not one of their own
            continue
        fills[part] = checkpoint_name
        flipped = transposed(checkpoint_name) and tensor.dim() == 2
        if flipped:
            tensor = tensor.t().contiguous()  # before the shard is cut: it slices the (out, in) parameter's rows
        shard = shards.get(name)
        if shard is not None:
            tensor = shard.take_part(tensor, target.part) if isinstance(target, Stacked) else shard.take(tensor)
        if isinstance(target, Stacked):  # held, even if it does not fit: that is reported, not "no k_proj"
            stacked_parts.setdefault(name, (target, set()))[1].add(target.part)
        expected = _part_shape(param, target) if isinstance(target, Stacked) else tuple(param.shape)
        if tuple(tensor.shape) != expected:
            shape = tuple(tensor.shape)
            if flipped:  # as the checkpoint stores it, not as this model holds it
                shape, expected = shape[::-1], expected[::-1]
            where = f"model {expected}" + (" in the stored (in, out) layout" if flipped else "")
            if isinstance(target, Stacked):
                where += f" (the {target.parts[target.part]} part of {name})"
            mismatched.append(f"{checkpoint_name}: checkpoint shape {shape}, {where}")
            continue
        if tensor.dtype.is_floating_point != param.dtype.is_floating_point:
            mismatched.append(f"{checkpoint_name}: checkpoint dtype {tensor.dtype}, model {param.dtype}")
            continue
        if isinstance(target, Stacked):
            params[name] = _set_part(model, name, param, target, tensor)
        else:
            params[name] = _set_parameter(model, name, param, tensor)
            loaded.add(name)
    incomplete = []
    for name, (stacked, present) in sorted(stacked_parts.items()):
        if name in whole_and_parts:  # named as loaded both ways, not as lacking the parts refused
            continue
        if len(present) == len(stacked.parts):
            loaded.add(name)
            continue
        # Not raised here: left out of the loaded names, it is reported with every other missing parameter.
        absent = ", ".join(part for i, part in enumerate(stacked.parts) if i not in present)
        setattr(params[name], PARTS_MISSING_ATTR, f"stacked from {', '.join(stacked.parts)}; no {absent}")
        incomplete.append(f"{name} ({getattr(params[name], PARTS_MISSING_ATTR)})")
    for name, (whole, parts) in whole_and_parts.items():
        twice.append(f"{whole} (all of it) and {', '.join(parts)} (parts of it) both load {name}")
    problems = []
    if unexpected:
        problems.append(f"unexpected tensors (not in {type(model).__name__}): {', '.join(sorted(unexpected))}")
    if mismatched:
        problems.append(f"tensors that do not fit: {'; '.join(mismatched)}")
    if twice:
        problems.append(f"tensors loading the same parameter: {'; '.join(twice)} (keep one of each)")
    if problems:  # raised anyway: the stacked parameters with parts missing are named too
        if incomplete:
            problems.append(f"parameters with parts missing: {'; '.join(incomplete)}")
        raise CheckpointError("The checkpoint does not fit the model: " + ". ".join(problems) + ".")
    return loaded


def check_all_loaded(model: nn.Module, loaded: Set[str], where: str = "") -> None:
    """One ``CheckpointError`` naming every parameter of ``model`` the checkpoint (in ``where``) did not fill.

    A parameter is filled when ``loaded`` names it and it left the meta device; a stacked one says
    which of its parts were absent.
    """
    missing = [
        name + (f" ({getattr(p, PARTS_MISSING_ATTR)})" if hasattr(p, PARTS_MISSING_ATTR) else "")
        for name, p in sorted(model.named_parameters(remove_duplicate=False))
        if p.is_meta or name not in loaded
    ]
    if missing:
        raise CheckpointError(
            f"The checkpoint{f' in {where}' if where else ''} lacks {len(missing)} tensor(s) the model needs: "
            + ", ".join(missing[:20])
            + (" ..." if len(missing) > 20 else "")
            + ". Is it the right checkpoint for this architecture?"
        )


def _part_shape(param: nn.Parameter, stacked: Stacked) -> tuple[int, ...]:
    start, stop = stacked.rows(param.shape[0])
    return (stop - start, *param.shape[1:])


def _set_parameter(model: nn.Module, name: str, param: nn.Parameter, tensor: torch.Tensor) -> nn.Parameter:
    if param.is_meta:
        tensor = tensor.to(dtype=param.dtype)  # no copy when the engine already converted it
        return _replace_parameter(model, name, tensor)
    with torch.no_grad():
        param.copy_(tensor)
    return param


def _set_part(model: nn.Module, name: str, param: nn.Parameter, stacked: Stacked, tensor: torch.Tensor) -> nn.Parameter:
    if param.is_meta:  # the first part to arrive allocates the whole parameter
        param = _replace_parameter(model, name, torch.empty(param.shape, dtype=param.dtype, device=tensor.device))
    start, stop = stacked.rows(param.shape[0])
    with torch.no_grad():
        param[start:stop].copy_(tensor)
    return param


def _replace_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> nn.Parameter:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    param = nn.Parameter(tensor, requires_grad=False)
    setattr(owner, attr, param)
    return param


class TiedHead:
    """The output head of a model whose head and input embeddings are one tensor (``tie_word_embeddings``).

    Checkpoints usually hold the embeddings and leave the head out; some hold
    only the head, and transformers then ties the other way round. ``filter``
    holds the head's tensor back while the rest loads; ``tie`` then shares the
    embeddings with the head, loading them from the held head if the
    checkpoint had no embeddings. A checkpoint holding both, different (a
    fine-tune that untied its head, its config unchanged), keeps both, as
    transformers does: tying them would throw the trained head away.
    """

    def __init__(self, head: str, embeddings: str) -> None:
        self.head, self.embeddings = head, embeddings  # parameter names, as the model names them
        self._held: tuple[str, torch.Tensor] | None = None  # the head's checkpoint name, and its tensor

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]], *names: str) -> Iterable[tuple[str, torch.Tensor]]:
        """``weights`` without the head, whose checkpoint ``names`` are given (held back for ``tie``)."""
        for name, tensor in weights:
            if name in names:
                self._held = name, tensor
                continue
            yield name, tensor

    def tie(self, model: nn.Module, loaded: set[str]) -> set[str]:
        """Load the embeddings from the held head if they were missing; share them with the head. ``loaded``, grown."""
        held_name, held = self._held or (self.head, None)
        self._held = None
        # Loaded under the checkpoint's own name: a tensor that does not fit is named as the file holds it.
        if self.embeddings not in loaded and held is not None:
            loaded |= assign_weights(model, [(held_name, held)], lambda name: self.embeddings)
        elif held is not None and not same_tensor(held, model.get_parameter(self.embeddings)):
            logger.warning(
                "The checkpoint holds %s and %s, and they differ: they are not tied, though the config says "
                "tie_word_embeddings (as transformers does).",
                held_name,
                self.embeddings,
            )
            return loaded | assign_weights(model, [(held_name, held)], lambda name: self.head)
        if self.embeddings in loaded:
            *path, leaf = self.head.split(".")
            owner = model.get_submodule(".".join(path))
            setattr(owner, leaf, model.get_parameter(self.embeddings))
            loaded.add(self.head)
        return loaded


def same_tensor(held: torch.Tensor, parameter: torch.Tensor) -> bool:
    """Whether a checkpoint's tensor is what ``parameter`` holds (as loaded: in its dtype, on its device)."""
    return tuple(held.shape) == tuple(parameter.shape) and torch.equal(
        held.to(device=parameter.device, dtype=parameter.dtype), parameter
    )
