"""The Llama family as pluginhost models: Llama (2, 3, 3.1), Mistral and Qwen2.

One decoder, numerically the same as transformers' (fp32, eager attention)
for every variant its configs allow: grouped-query attention (fewer key and
value heads than query heads), RoPE of every type transformers knows
(``builtin_models.rope``), RMSNorm in float32, attention and MLP biases
(Llama's ``attention_bias``/``mlp_bias``; Qwen2's q/k/v biases), tied or
untied embeddings, and sliding-window attention where the config sets it
(Mistral's ``sliding_window``; Qwen2's ``layer_types``).

Shapes: B batch, T new tokens, S cache slots attended, Hq query heads, Hkv
key/value heads, D head dim, E hidden size, I MLP width, V vocabulary.

As in ``builtin_models.opt``: explicit positions, a static KV cache (of Hkv
heads) set up apart from ``__init__``, q/k/v and gate/up each stacked into
one product.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from builtin_models.activations import activation
from builtin_models.attention import cached_attention
from builtin_models.config_fields import declared_field
from builtin_models.kv_cache import CacheRows, KVCache
from builtin_models.linear import Linear
from builtin_models.rope import RotaryEmbedding, apply_rotary
from builtin_models.tp import Colwise, Heads, Rowwise, Style, VocabParallel
from builtin_models.weights import Stacked, TiedHead, assign_weights

__all__ = ["LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaModel", "Qwen2ForCausalLM", "RMSNorm"]

QKV_PARTS = ("q_proj", "k_proj", "v_proj")
GATE_UP_PARTS = ("gate_proj", "up_proj")


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as transformers does, then scaled in the input dtype.

    In float32, as one layer norm over ``[x, -x]``: its mean is zero, so it divides by the root of the mean
    square plus eps, exactly the RMS norm's formula. PyTorch's CPU ``F.rms_norm`` is a dozen operations, this
    five; decoding runs 2 a layer, and at batch 1 on a 2-core Xeon this took 0.3-0.5 ms off a 20 ms step
    (Llama, 12 layers). The results differ from transformers' by the rounding of the sums (a few float32
    ulps: at most about 5e-7 for activations of size 1), as the products' kernels do.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype is torch.float32 and self.weight.dtype is torch.float32:
            size = x.shape[-1]
            signed = torch.cat((x, x.neg()), dim=-1)  # (..., 2E), mean 0
            return F.layer_norm(signed, (2 * size,), None, None, self.eps)[..., :size] * self.weight  # (..., E)
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, *, qkv_bias: bool, out_bias: bool, window: int | None) -> None:
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.n_heads} is not a multiple of num_key_value_heads {self.n_kv_heads}"
            )
        self.sizes = (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim)
        self.qkv_proj = Linear(config.hidden_size, sum(self.sizes), bias=qkv_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, config.hidden_size, bias=out_bias)
        self.scaling = self.head_dim**-0.5
        self.sliding_window = _sliding_window(config, layer_idx, window)
        self.kv_cache: KVCache | None = None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, cache_rows: CacheRows | None, mask: Tensor
    ) -> Tensor:
        B, T, _ = x.shape
        Hq, Hkv = self.n_heads, self.n_kv_heads
        qkv = self.qkv_proj(x).view(B, T, Hq + 2 * Hkv, self.head_dim).transpose(1, 2)  # (B, Hq + 2 Hkv, T, D)
        # Queries and keys are adjacent heads of the stacked product: rotated together, one pass per layer.
        qk = apply_rotary(qkv[:, : Hq + Hkv], cos, sin)  # (B, Hq + Hkv, T, D)
        q, k, v = qk[:, :Hq], qk[:, Hq:], qkv[:, Hq + Hkv :]  # (B, Hq, T, D), (B, Hkv, T, D), (B, Hkv, T, D)
        if cache_rows is not None:
            assert self.kv_cache is not None, "call setup_caches() before passing cache_rows"
            k, v = self.kv_cache.update(
                cache_rows, positions, k, v, n_slots=mask.shape[-1], as_stored=True
            )  # (B, Hkv, S, D)
        y = cached_attention(
            q, k, v, mask, positions, scale=self.scaling, enable_gqa=self.n_kv_heads != self.n_heads
        )  # (B, Hq, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # (B, T, Hq*D) -> (B, T, E)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, bias: bool) -> None:
        super().__init__()
        # gate and up stacked into one (2I, E) matrix: one product instead of two.
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.activation = activation(config.hidden_act, field="hidden_act")

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # 2 x (B, T, I)
        return self.down_proj(self.activation(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, *, qkv_bias: bool, out_bias: bool, mlp_bias: bool, window: int | None
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config, layer_idx, qkv_bias=qkv_bias, out_bias=out_bias, window=window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = LlamaMLP(config, bias=mlp_bias)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, cache_rows: CacheRows | None, masks: dict
    ) -> Tensor:
        attention_mask = masks[self.self_attn.sliding_window]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache_rows, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: Any, *, qkv_bias: bool, out_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        window = declared_field(config, "sliding_window")  # the model's window, for the layers that have one
        mlp_bias = bool(declared_field(config, "mlp_bias"))  # Llama's; Mistral and Qwen2 have none
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias=qkv_bias, out_bias=out_bias, mlp_bias=mlp_bias, window=window)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self, input_ids: Tensor, positions: Tensor, cache_rows: CacheRows | None, mask: Tensor | None
    ) -> Tensor:
        x = self.embed_tokens(input_ids)  # (B, T, E)
        cos, sin = (t[:, None] for t in self.rotary_emb(positions, x.dtype))  # (B, 1, T, D): once, not per layer
        masks = self._masks(mask, positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, positions, cache_rows, masks)
        return self.norm(x)

    def _masks(self, mask: Tensor | None, positions: Tensor, dtype: torch.dtype) -> dict[int | None, Tensor]:
        """Additive masks by sliding window (``None``: full), made once for every layer."""
        if mask is None:  # no cache: the T tokens attend causally to each other
            T = positions.shape[-1]
            mask = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()[None, None]  # (1, 1, T, T)
        masks = {}
        for window in {layer.self_attn.sliding_window for layer in self.layers}:
            allowed = mask
            if window is not None and allowed.dtype == torch.bool:
                slots = torch.arange(mask.shape[-1], device=mask.device)  # slot s holds position s
                allowed = allowed & (slots > positions[:, None, :, None] - window)  # (B, 1, T, S)
            elif window is not None:
                raise ValueError("sliding-window attention needs a boolean mask")
            masks[window] = _additive(allowed, dtype)
        return masks


class LlamaForCausalLM(nn.Module):
    """A Llama-family model with a language-modelling head, in the pluginhost model interface.

    ``forward(input_ids, positions, cache_rows=None, mask=None)`` returns hidden
    states (B, T, E); ``compute_logits(hidden)`` returns logits (..., V). See
    ``builtin_models.opt.OPTForCausalLM`` for the arguments.
    """

    #: A prompt may be prefilled in pieces (``ModelRunner``, past ``max_num_batched_tokens``): a piece at positions
    #: p.. writes its keys and values to those slots and attends every slot up to its end, as decoding does.
    prefill_in_pieces = True

    #: Biases of the q/k/v and output projections; ``None``: the config's ``attention_bias`` for both.
    qkv_bias: bool | None = None
    out_bias: bool | None = None

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        default = bool(declared_field(config, "attention_bias"))  # Llama's; Mistral has none
        qkv_bias = default if self.qkv_bias is None else self.qkv_bias
        out_bias = default if self.out_bias is None else self.out_bias
        self.model = LlamaModel(config, qkv_bias=qkv_bias, out_bias=out_bias)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def prefill_unpadded(self) -> bool:
        """Whether padding a prompt would change its tokens: RoPE whose frequencies follow the row's length."""
        return self.model.rotary_emb.length_dependent

    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate a static key/value cache in every layer, on the model's device and dtype."""
        weight = self.model.embed_tokens.weight  # not lm_head's: a plugin may replace the head (int8_quant)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.kv_cache = KVCache(
                max_batch_size, attn.n_kv_heads, max_seq_len, attn.head_dim, dtype=weight.dtype, device=weight.device
            )

    def forward(
        self, input_ids: Tensor, positions: Tensor, cache_rows: CacheRows | None = None, mask: Tensor | None = None
    ) -> Tensor:
        return self.model(input_ids, positions, cache_rows, mask)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        return self.lm_head(hidden_states)  # (..., V)

    def tp_plan(self) -> dict[str, Style]:
        """How tensor parallelism splits the model (``builtin_models.tp``), as vLLM splits Llama."""
        attn = self.model.layers[0].self_attn if len(self.model.layers) else None
        return {
            "model.layers.*.self_attn": Heads(),
            "model.layers.*.self_attn.qkv_proj": Colwise(
                parts=attn.sizes if attn is not None else 1,
                heads=(attn.n_heads, attn.n_kv_heads, attn.n_kv_heads) if attn is not None else None,
            ),
            "model.layers.*.self_attn.o_proj": Rowwise(),
            "model.layers.*.mlp.gate_up_proj": Colwise(parts=2),
            "model.layers.*.mlp.down_proj": Rowwise(),
            "lm_head": VocabParallel(),
        }

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Load Hugging Face checkpoint names (``model.layers.N...``, ``lm_head.weight``)."""
        tied = getattr(self.config, "tie_word_embeddings", False)
        attn = self.model.layers[0].self_attn if len(self.model.layers) else None
        qkv_sizes = attn.sizes if attn is not None else None
        mlp_sizes = None  # gate and up: equal parts, whatever a rank's share of them

        def rename(name: str) -> str | Stacked | None:
            if name.endswith("rotary_emb.inv_freq"):
                return None  # computed, not loaded
            if not name.startswith(("model.", "lm_head.")):
                name = f"model.{name}"  # checkpoints saved from the bare model
            module, _, leaf = name.rpartition(".")
            parent, _, projection = module.rpartition(".")
            if projection in QKV_PARTS and parent.endswith(".self_attn"):
                return Stacked(f"{parent}.qkv_proj.{leaf}", QKV_PARTS.index(projection), QKV_PARTS, qkv_sizes)
            if projection in GATE_UP_PARTS and parent.endswith(".mlp"):
                return Stacked(
                    f"{parent}.gate_up_proj.{leaf}", GATE_UP_PARTS.index(projection), GATE_UP_PARTS, mlp_sizes
                )
            return name

        if not tied:
            return assign_weights(self, weights, rename)
        head = TiedHead("lm_head.weight", "model.embed_tokens.weight")  # tied to the embeddings, as in transformers
        return head.tie(self, assign_weights(self, head.filter(weights, "lm_head.weight"), rename))


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama's decoder with biases on q, k and v (not on the output projection)."""

    qkv_bias = True
    out_bias = False


def _sliding_window(config: Any, layer_idx: int, window: int | None) -> int | None:
    """The layer's attention window: Qwen2's ``layer_types``, else Mistral's ``sliding_window``; ``None``: full."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    if window is not None and not (isinstance(window, int) and window >= 1):  # 0 would mask every key
        raise ValueError(f"sliding_window must be a number of positions >= 1 (or null for none), got {window!r}")
    return window


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask (True = attend) as an additive one: SDPA would convert it again in every layer."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
