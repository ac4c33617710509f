"""Rotary position embeddings, computed as transformers computes them, for every RoPE type it knows.

The inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS``
(``linear``, ``dynamic``, ``llama3``, ``yarn``, ``longrope``, ...) or, for the
default type, the same formula as its Llama; cos and sin are computed in
float32 from explicit positions and cast to the activations' dtype.
``dynamic`` and ``longrope`` change their frequencies with the longest
position of each forward pass, as transformers' ``dynamic_rope_update`` does
(in a batch, the longest sequence decides, as in transformers).

Shapes: B batch, T tokens, H heads, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["RotaryEmbedding", "apply_rotary"]


class RotaryEmbedding(nn.Module):
    """cos and signed sin (B, T, D) for positions (B, T), as :func:`apply_rotary` takes them.

    The sin's first half is negated: rotating a head is then ``x * cos +
    roll(x) * sin``, where transformers writes ``x * cos + rotate_half(x) *
    sin`` with ``rotate_half(x) = cat(-x2, x1)``. Both give the same bits (a
    sign moved between the factors of a product changes no rounding), and the
    roll is one operation where ``rotate_half`` is three.

    Holds no buffer: frequencies are computed on first use on the positions'
    device, so the module can be built on the meta device.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        params = getattr(config, "rope_parameters", None) or {}
        self.rope_type = params.get("rope_type", "default")
        self.theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.original_max_seq_len = config.max_position_embeddings
        self.max_seq_len_cached = config.max_position_embeddings
        self.inv_freq: Tensor | None = None
        self.original_inv_freq: Tensor | None = None
        self.long_inv_freq: Tensor | None = None
        self.attention_scaling = 1.0

    def _init(self, device: torch.device, seq_len: int | None = None) -> tuple[Tensor, float]:
        if self.rope_type == "default":
            dim = self.head_dim
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
            return inv_freq, 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kwargs = {"seq_len": seq_len} if seq_len is not None else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, device, **kwargs)
        return inv_freq.to(device=device, dtype=torch.float), float(scaling)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.inv_freq is None or self.inv_freq.device != positions.device:
            self.inv_freq, self.attention_scaling = self._init(positions.device)
            self.original_inv_freq = self.inv_freq
        if "dynamic" in self.rope_type:
            self._dynamic_update(positions)
        elif self.rope_type == "longrope":
            self._longrope_update(positions)
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
        cos, sin = (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # (B, T, D) each

    def _dynamic_update(self, positions: Tensor) -> None:
        """Grow the frequencies past the trained length; back to the originals below it (transformers' rule)."""
        seq_len = int(positions.max()) + 1
        if seq_len > self.max_seq_len_cached:
            self.inv_freq, self.attention_scaling = self._init(positions.device, seq_len)
            self.max_seq_len_cached = seq_len
        if seq_len < self.original_max_seq_len < self.max_seq_len_cached:
            self.inv_freq = self.original_inv_freq
            self.max_seq_len_cached = self.original_max_seq_len

    def _longrope_update(self, positions: Tensor) -> None:
        """The long factors past the original trained length, the short ones below it."""
        original = self.config.rope_parameters["original_max_position_embeddings"]
        if self.long_inv_freq is None:
            self.long_inv_freq, _ = self._init(positions.device, original + 1)
        seq_len = int(positions.max()) + 1
        self.inv_freq = self.long_inv_freq if seq_len > original else self.original_inv_freq


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate every head of x (B, H, T, D) by :class:`RotaryEmbedding`'s cos and signed sin (B, T, D).

    Queries and keys alike, in one pass.
    """
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin  # roll: the halves swapped, (x2, x1)
