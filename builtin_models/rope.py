"""Rotary position embeddings, computed as transformers computes them, for every RoPE type it knows.

The inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS``
(``linear``, ``dynamic``, ``llama3``, ``yarn``, ``longrope``, ...) or, for the
default type, the same formula as its Llama; cos and sin are computed in
float32 from explicit positions and cast to the activations' dtype.
``dynamic`` and ``longrope`` change their frequencies with the sequence's
length, as transformers' ``dynamic_rope_update`` does for one sequence
alone: row by row, from the row's own positions, and with no memory of
earlier passes (transformers keeps the longest length it has seen, so a
finished long request would change the next one's tokens; and in a batch,
the longest row would decide for every row).

Shapes: B batch, T tokens, H heads, D head dim.
"""

from __future__ import annotations

import math
import numbers
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
        #: Whether the frequencies depend on the sequence's length (else on nothing but the config).
        self.length_dependent = "dynamic" in self.rope_type or self.rope_type == "longrope"
        self._inv_freq: Tensor | None = None  # the frequencies up to the trained length, once per device
        self._long_inv_freq: Tensor | None = None  # longrope's, past it
        self.attention_scaling = 1.0
        self._check()

    def _check(self) -> None:
        """Refuse RoPE parameters transformers cannot compute (an unknown type, a missing key, a base frequency that
        is not a number) now, not mid-request."""
        # Every type: the default one computes with it only on the first request, which would fail (a string's
        # "10000" ** tensor is a TypeError); transformers refuses such a config when it loads.
        theta = self.theta
        if isinstance(theta, bool) or not isinstance(theta, numbers.Real) or not 0 < theta < math.inf:
            raise ValueError(
                f"rope_theta {theta!r} cannot be used: the base frequency must be a positive finite number"
            )
        # Rotating part of each head needs an attention that rotates only that part: transformers' Llama, Mistral
        # and Qwen2 have none (their forward fails on such a config), nor has apply_rotary.
        partial = (getattr(self.config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        if partial is not None and partial != 1.0:
            raise ValueError(
                f"rope_parameters sets partial_rotary_factor={partial!r}, but {type(self.config).__name__}'s models "
                "rotate every dimension of a head (transformers' too): remove it from config.json (or set "
                "hf_overrides), or install a plugin with a model that rotates part of each head"
            )
        if self.rope_type == "default":
            return
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if self.rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(
                f"rope_type {self.rope_type!r} is not one transformers knows ({', '.join(sorted(ROPE_INIT_FUNCTIONS))})"
            )
        try:
            with torch.device("cpu"):  # once, on the CPU: the module itself is built on the meta device
                self._init(torch.device("cpu"))
                if self.rope_type == "longrope":
                    self._init(torch.device("cpu"), self.config.rope_parameters["original_max_position_embeddings"] + 1)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            detail = f"it lacks {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            raise ValueError(f"rope_parameters {self.config.rope_parameters} cannot be used: {detail}") from None

    def _init(self, device: torch.device, seq_len: int | Tensor | None = None) -> tuple[Tensor, float]:
        if self.rope_type == "default":
            dim = self.head_dim
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
            return inv_freq, 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kwargs = {"seq_len": seq_len} if seq_len is not None else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, device, **kwargs)
        return inv_freq.to(device=device, dtype=torch.float), float(scaling)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq, self.attention_scaling = self._init(positions.device)
            self._long_inv_freq = None
        inv_freq = self._row_frequencies(positions) if self.length_dependent else self._inv_freq  # or (D/2,)
        freqs = positions[..., None].float() * inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
        cos, sin = (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # (B, T, D) each

    def _row_frequencies(self, positions: Tensor) -> Tensor:
        """Each row's frequencies (B, 1, D/2) for its length, its last position + 1 (as transformers takes it).

        Tensor operations only: a compiled step neither waits for the lengths nor recompiles for each.
        """
        lengths = positions.amax(dim=-1, keepdim=True) + 1  # (B, 1)
        if self.rope_type == "longrope":
            original = self.config.rope_parameters["original_max_position_embeddings"]
            if self._long_inv_freq is None:
                self._long_inv_freq, _ = self._init(positions.device, original + 1)
            stretched = self._long_inv_freq  # (D/2,)
        else:  # dynamic: transformers' own formula, which takes a tensor of lengths, for every row at once
            original = self.original_max_seq_len
            stretched = self._init(positions.device, lengths)[0]  # (B, D/2)
        return torch.where(lengths > original, stretched, self._inv_freq)[:, None]  # (B, 1, D/2)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate every head of x (B, H, T, D) by :class:`RotaryEmbedding`'s cos and signed sin (B, T, D).

    Queries and keys alike, in one pass. cos and sin may come as (B, 1, T, D) already (a model unsqueezing
    them once for all its layers saves two operations a layer).
    """
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin  # roll: the halves swapped, (x2, x1)
