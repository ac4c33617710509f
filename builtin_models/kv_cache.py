"""A static key/value cache: one row per sequence, one slot per position, written in place.

Created by a model's ``setup_caches`` (never in its ``__init__``); the engine
then owns its shape: it grows the cache (keeping what it holds) as longer or
more sequences arrive, and moves a sequence's row when it compacts the batch.
Decoding allocates nothing per step: the keys and values of the token at
position p of the sequence in row r go to slot p of row r.

Shapes: R rows, H heads, S slots, D head dim; B sequences, T new tokens.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor, nn

__all__ = ["CacheRows", "KVCache"]

logger = logging.getLogger("pluginhost")

#: Which rows a forward pass uses: ``slice(start, start + B)`` (a view, as in decoding) or a
#: (B,) tensor of row indices (gathered; fine for the few rows of a prefill).
CacheRows = slice | Tensor


class KVCache(nn.Module):
    def __init__(
        self,
        max_batch_size: int,
        n_heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        # Each row's own index, for writing one token a row: made once, not per layer and step.
        self.register_buffer("row_index", torch.arange(max_batch_size, device=device)[:, None], persistent=False)

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, slots)."""
        return self.k.shape[0], self.k.shape[2]

    def update(
        self, rows: CacheRows, positions: Tensor, k: Tensor, v: Tensor, n_slots: int, *, as_stored: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Write k, v (B, H, T, D) at ``positions`` (B, T) of ``rows``; return their first ``n_slots`` slots.

        The result is (B, H, S, D): a view for a slice of rows, a gathered copy for a tensor of rows. A
        cache held in another dtype than the model's (``kv_cache_dtype``) stores k and v converted, and
        returns its slots converted back to k's dtype (a copy, each step), unless ``as_stored``: then as
        they are stored, for attention that takes them so (``builtin_models.attention.cached_attention``,
        which reads half the bytes of a bfloat16 cache).
        """
        B, _, T, _ = k.shape
        wanted = k.dtype
        if wanted != self.k.dtype:  # a cache in another dtype than the model's (kv_cache_dtype)
            k, v = k.to(self.k.dtype), v.to(self.v.dtype)
            if not as_stored:
                _converting_each_step()
                k_slots, v_slots = self.update(rows, positions, k, v, n_slots, as_stored=True)
                return k_slots.to(wanted), v_slots.to(wanted)
        if isinstance(rows, slice):
            k_rows, v_rows = self.k[rows], self.v[rows]  # (B, H, S_max, D) views
            # Decoding one sequence: a slice copy costs a third of indexing. Not on a GPU (int() would
            # wait for it) nor while compiling (a position read on the host would split the graph).
            if B == 1 and T == 1 and k.is_cpu and not torch.compiler.is_compiling():
                p = int(positions)
                k_rows[:, :, p : p + 1].copy_(k)  # (1, H, 1, D)
                v_rows[:, :, p : p + 1].copy_(v)
            else:
                # Into the cache itself, not through the rows' view: compiled, a write through a view had inductor
                # copy the rows' every slot out and back, four copies of the whole cache rows a layer and step.
                batch = self.row_index[rows]  # (B, 1)
                self.k[batch, :, positions] = k.transpose(1, 2)  # (B, T, H, D) into (B, [H], T slots)
                self.v[batch, :, positions] = v.transpose(1, 2)  # likewise
            return k_rows[:, :, :n_slots], v_rows[:, :, :n_slots]  # (B, H, S, D) views
        self.k[rows[:, None], :, positions] = k.transpose(1, 2)  # (B, T, H, D) into rows (B,), T slots each
        self.v[rows[:, None], :, positions] = v.transpose(1, 2)
        return self.k[rows, :, :n_slots], self.v[rows, :, :n_slots]  # (B, H, S, D) gathered

    def resize(self, rows: int, slots: int) -> None:
        """Make the cache ``rows`` x ``slots``, keeping what fits of its contents."""
        old_rows, old_slots = self.shape
        if (rows, slots) == (old_rows, old_slots):
            return
        keep_rows, keep_slots = min(rows, old_rows), min(slots, old_slots)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros((rows, old.shape[1], slots, old.shape[3]))
            new[:keep_rows, :, :keep_slots] = old[:keep_rows, :, :keep_slots]
            setattr(self, name, new)
        self.row_index = torch.arange(rows, device=self.k.device)[:, None]

    def cast(self, dtype: torch.dtype) -> None:
        """Hold keys and values in ``dtype`` from now on (what they held is converted); ``update`` converts new ones."""
        self.k, self.v = self.k.to(dtype), self.v.to(dtype)

    def move(self, src: int, dst: int, n_slots: int) -> None:
        """Copy the first ``n_slots`` slots of row ``src`` into row ``dst``."""
        self.k[dst, :, :n_slots] = self.k[src, :, :n_slots]
        self.v[dst, :, :n_slots] = self.v[src, :, :n_slots]


@functools.cache
def _converting_each_step() -> None:
    """Say once that a model reads a cache held in another dtype through a conversion: memory saved, time not."""
    logger.warning(
        "the KV cache is held in another dtype than the model computes in (kv_cache_dtype), and the model's attention "
        "reads it converted back, a copy each step: it takes less memory, but decoding is slower than with a cache "
        "in the model's dtype (attention through builtin_models.attention.cached_attention reads it as it is held)"
    )
