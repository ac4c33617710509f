"""A static key/value cache: fixed-size buffers written in place, slot by slot.

Allocated once per shape by ``setup_caches`` (never in a model's
``__init__``), so decoding allocates nothing per step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["KVCache"]


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

    def update(self, slots: Tensor, k: Tensor, v: Tensor, n_slots: int) -> tuple[Tensor, Tensor]:
        """Write k, v (B, H, T, D) at ``slots`` (T,); return the first ``n_slots`` slots (B, H, S, D)."""
        B = k.shape[0]
        k_cache, v_cache = self.k[:B], self.v[:B]
        k_cache.index_copy_(2, slots, k)
        v_cache.index_copy_(2, slots, v)
        return k_cache[:, :, :n_slots], v_cache[:, :, :n_slots]
