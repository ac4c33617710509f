"""Tensor parallelism as a transformation of a built model, as gpt-fast's ``tp.py`` does it.

A model declares how it splits (``tp_plan()``: module name patterns and a
style each); ``shard_model`` applies the plan to the model while it is still on
the meta device, so each rank allocates and loads only its slices. The styles
are vLLM's (Megatron-LM's):

* ``Colwise``: a linear layer's outputs are split, rank r computing chunk r of
  them (q/k/v and the MLP's first product). A fused weight (q, k and v
  stacked) is split part by part; key/value heads fewer than the ranks are
  copied, each rank keeping the one its query heads use (as vLLM does).
* ``Rowwise``: a linear layer's inputs are split; each rank's partial product
  is summed over ranks by one all-reduce, the bias added on rank 0 only (the
  attention output and the MLP's second product).
* ``Heads``: an attention module's head counts (and q/k/v sizes) are divided,
  so its reshapes and its KV cache follow.
* ``VocabParallel``: the language-model head's vocabulary is split (padded to
  a multiple of the ranks) and the logits all-gathered.

Embeddings stay whole on every rank: a lookup costs no arithmetic, only the
table's memory. Each split layer pays one collective per forward: two
all-reduces per transformer block and one all-gather for the logits.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from builtin_models.weights import SHARD_ATTR, Shard
from pluginhost.errors import ModelClassError

__all__ = [
    "Collectives",
    "Colwise",
    "Heads",
    "Rowwise",
    "Style",
    "VocabParallel",
    "has_tp_plan",
    "keep_collectives",
    "shard_model",
    "unshard_tied",
]


@dataclass(frozen=True)
class Colwise:
    """Split the outputs; ``parts``: a fused weight's parts (a count of equal ones, or their sizes).

    ``heads``: each part's attention heads, when a part may have fewer heads than there are ranks
    (grouped-query key/value): such a part is cut into its heads, each copied on ``world // heads`` ranks.
    """

    parts: int | tuple[int, ...] = 1
    heads: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Rowwise:
    """Split the inputs; the outputs are all-reduced."""


@dataclass(frozen=True)
class Heads:
    """Divide an attention module's ``n_heads``, ``n_kv_heads`` and ``sizes`` (q, then k and v) by the ranks.

    Key/value heads fewer than the ranks, whose count divides them, are copied instead: one a rank.
    """


@dataclass(frozen=True)
class VocabParallel:
    """Split the vocabulary of the head; the logits are all-gathered."""


Style = Colwise | Rowwise | Heads | VocabParallel


def has_tp_plan(model: nn.Module) -> bool:
    return callable(getattr(model, "tp_plan", None))


#: The split layers whose outputs are combined over the ranks: module name -> (the module split, its hook).
Collectives = dict[str, tuple[nn.Module, Callable[..., Tensor]]]


def shard_model(model: nn.Module, rank: int, world: int, group: Any = None) -> Collectives:
    """Apply ``model.tp_plan()`` for ``rank`` of ``world``; the model must still be on the meta device.

    Returns the layers whose outputs an all-reduce or all-gather completes, for :func:`keep_collectives`.
    """
    if not has_tp_plan(model):
        raise ModelClassError(
            f"{type(model).__name__} has no tensor-parallel plan (a tp_plan() method), so it cannot be split over "
            f"{world} ranks: use tensor_parallel_size=1, or give the class a tp_plan (see builtin_models.tp)."
        )
    modules = dict(model.named_modules())
    collectives: Collectives = {}
    for pattern, style in model.tp_plan().items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))  # "*": one name, never a dotted path
        matched = [name for name in modules if regex.fullmatch(name)]
        if not matched:
            raise ModelClassError(f"{type(model).__name__}.tp_plan() names {pattern!r}, which matches no module")
        for name in matched:
            hook = _apply(style, name, modules[name], rank, world, group)
            if hook is not None:
                collectives[name] = (modules[name], hook)
    return collectives


def keep_collectives(model: nn.Module, collectives: Collectives) -> None:
    """After ``post_load``: a split layer a plugin replaced still has its output summed or gathered over the ranks.

    The collective belongs to the layer's place in the model, not to the module object: a
    replacement computing from this rank's shard (``int8_quant``'s ``Int8Linear``) gives a partial
    result too, and takes the same hook. A split module still in the model (kept inside a wrapper,
    say) keeps its own hook, so no output is summed twice.
    """
    modules = dict(model.named_modules())
    present = {id(module) for module in modules.values()}
    for name, (split, hook) in collectives.items():
        if id(split) in present:
            continue
        replacement = modules.get(name)
        if replacement is None:
            raise ModelClassError(
                f"{name} was split over the ranks and is gone from the model after post_load: its partial "
                "results can no longer be combined. A post_load hook may replace a split layer (the replacement "
                "computes from this rank's shard), not remove it."
            )
        if hook not in replacement._forward_hooks.values():  # unless the plugin moved the hooks over itself
            replacement.register_forward_hook(hook)  # (as torch.ao.quantization.swap_module does)


def unshard_tied(model: nn.Module) -> None:
    """After loading: a vocabulary-split head tied to the (whole) embedding table takes its slice of it."""
    for module in model.modules():
        vocab = getattr(module, "tp_vocab", None)
        if vocab is not None and module.weight.shape[0] == vocab:
            shard: Shard = module.tp_vocab_shard
            module.weight = nn.Parameter(shard.take(module.weight.data), requires_grad=False)


def _apply(style: Style, name: str, module: nn.Module, rank: int, world: int, group: Any) -> Callable | None:
    """Split ``module`` as ``style`` says; the forward hook that completes its output, if it needs one."""
    if isinstance(style, Heads):
        _split_heads(name, module, world)
        return None
    if not isinstance(module, nn.Linear):
        raise ModelClassError(f"tp_plan: {name} is a {type(module).__name__}; {type(style).__name__} splits nn.Linear")
    out_features, in_features = module.weight.shape
    if isinstance(style, Colwise):
        parts = style.parts if isinstance(style.parts, tuple) else (out_features // style.parts,) * style.parts
        chunks = tuple(_chunks(h, world) for h in style.heads) if style.heads else (world,) * len(parts)
        if sum(parts) != out_features or any(not c or p % c for p, c in zip(parts, chunks, strict=True)):
            raise ModelClassError(
                f"{name} cannot be split over {world} ranks: its {out_features} outputs (in parts {list(parts)}) "
                f"are not divisible by {world}"
                + (f", nor are its parts' heads {list(style.heads)} copies for {world} ranks" if style.heads else "")
            )
        shard = Shard(
            rank, world, dim=0, parts=parts if len(parts) > 1 else None, chunks=chunks if style.heads else None
        )
        outputs = sum(p // c for p, c in zip(parts, chunks, strict=True))
        _replace(module, "weight", (outputs, in_features), shard)
        if module.bias is not None:
            _replace(module, "bias", (outputs,), shard)
        module.out_features = outputs
    elif isinstance(style, Rowwise):
        if in_features % world:
            raise ModelClassError(f"{name} cannot be split over {world} ranks: {in_features} inputs")
        _replace(module, "weight", (out_features, in_features // world), Shard(rank, world, dim=1))
        if module.bias is not None:
            _replace(module, "bias", (out_features,), Shard(rank, world, rank0_only=True))
        module.in_features = in_features // world
        hook = _all_reduce_output(group)
        module.register_forward_hook(hook)
        return hook
    elif isinstance(style, VocabParallel):
        chunk = -(-out_features // world)
        shard = Shard(rank, world, dim=0, pad=True)
        _replace(module, "weight", (chunk, in_features), shard)
        if module.bias is not None:
            _replace(module, "bias", (chunk,), shard)
        module.tp_vocab, module.tp_vocab_shard = out_features, shard
        hook = _gather_vocab(out_features, world, group)
        module.register_forward_hook(hook)
        return hook
    return None


def _split_heads(name: str, module: nn.Module, world: int) -> None:
    n_heads = module.n_heads
    if n_heads % world:
        raise ModelClassError(
            f"{name} has {n_heads} heads, which do not split over {world} ranks: use a tensor_parallel_size "
            f"that divides {n_heads}"
        )
    module.n_heads = n_heads // world
    kv_chunks = world
    n_kv = getattr(module, "n_kv_heads", None)
    if n_kv is not None:
        kv_chunks = _chunks(n_kv, world)
        if not kv_chunks:
            raise ModelClassError(
                f"{name} has {n_kv} key/value heads, which neither split over {world} ranks nor can be copied "
                f"onto them: use a tensor_parallel_size that divides {n_kv}, or a multiple of {n_kv} that divides "
                f"{n_heads}"
            )
        module.n_kv_heads = n_kv // kv_chunks
    sizes = getattr(module, "sizes", None)
    if sizes is not None:  # q, then key and value
        module.sizes = (sizes[0] // world, *(size // kv_chunks for size in sizes[1:]))


def _chunks(heads: int, world: int) -> int:
    """Into how many chunks a part of ``heads`` heads is cut over ``world`` ranks: ``world``, or its heads
    when there are fewer (each copied on ``world // heads`` ranks); 0 when neither divides the other."""
    if heads % world == 0:
        return world
    return heads if world % heads == 0 else 0


def _replace(module: nn.Module, attr: str, shape: tuple[int, ...], shard: Shard) -> None:
    old = getattr(module, attr)
    if not old.is_meta:
        raise ModelClassError("shard_model needs the model on the meta device, before its weights load")
    param = nn.Parameter(torch.empty(shape, dtype=old.dtype, device="meta"), requires_grad=False)
    setattr(param, SHARD_ATTR, shard)
    setattr(module, attr, param)


def _all_reduce_output(group: Any):  # noqa: ANN202
    def hook(module: nn.Module, args: Any, output: Tensor) -> Tensor:
        output = output.contiguous()
        dist.all_reduce(output, group=group)  # the partial products of every rank, summed
        return output

    return hook


def _gather_vocab(vocab: int, world: int, group: Any):  # noqa: ANN202
    def hook(module: nn.Module, args: Any, output: Tensor) -> Tensor:
        output = output.contiguous()  # (..., V / world)
        pieces = [torch.empty_like(output) for _ in range(world)]
        dist.all_gather(pieces, output, group=group)
        return torch.cat(pieces, dim=-1)[..., :vocab]  # (..., V), the padding dropped

    return hook
