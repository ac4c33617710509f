"""OPT (Zhang et al., 2022) as a pluginhost model: decoder-only, learned positions.

Numerically the same as Hugging Face transformers' ``OPTForCausalLM`` (eager
attention) for every variant: LayerNorm before (125m, 1.3b, ...) or after
(350m) each block, and ``word_embed_proj_dim != hidden_size`` (350m), where
embeddings are projected in and out of the residual width.

Shapes: B batch, T new tokens, S cache slots attended, H heads, D head dim,
E hidden size, W word embedding size, V vocabulary.

The engine passes positions explicitly (every sequence of a batch is at its
own position), names the rows of the static cache the sequences use (the cache
is set up with ``setup_caches``, apart from ``__init__``, so a model is built
once and used for any batch), and passes the attention mask over cache slots.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from builtin_models.activations import activation
from builtin_models.attention import cached_attention
from builtin_models.kv_cache import CacheRows, KVCache
from builtin_models.linear import Linear
from builtin_models.tp import Colwise, Heads, Rowwise, Style, VocabParallel
from builtin_models.weights import Stacked, TiedHead, assign_weights

if TYPE_CHECKING:
    from transformers import OPTConfig

__all__ = ["OPTAttention", "OPTDecoder", "OPTDecoderLayer", "OPTForCausalLM"]

# OPT reserves the first two rows of its position table (a fairseq legacy).
POSITION_OFFSET = 2

#: The checkpoint's attention input projections, stacked in this order into ``qkv_proj``.
QKV_PARTS = ("q_proj", "k_proj", "v_proj")


class OPTAttention(nn.Module):
    def __init__(self, config: OPTConfig) -> None:
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.n_heads
        if self.head_dim * self.n_heads != config.hidden_size:
            raise ValueError(f"hidden_size {config.hidden_size} is not divisible by num_attention_heads {self.n_heads}")
        self.scaling = self.head_dim**-0.5
        bias = config.enable_bias
        # q, k and v stacked into one (3E, E) matrix: one product instead of three (checkpoints
        # keep them apart; load_weights stacks them, rows [q; k; v]).
        self.qkv_proj = Linear(config.hidden_size, 3 * config.hidden_size, bias=bias)
        self.out_proj = Linear(config.hidden_size, config.hidden_size, bias=bias)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, positions: Tensor, cache_rows: CacheRows | None, mask: Tensor | None) -> Tensor:
        B, T, E = x.shape
        qkv = self.qkv_proj(x).view(B, T, 3, self.n_heads, self.head_dim)  # (B, T, 3, H, D)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, D)
        if cache_rows is not None:
            assert self.kv_cache is not None, "call setup_caches() before passing cache_rows"
            assert mask is not None, "a cached forward needs the mask over cache slots"
            k, v = self.kv_cache.update(
                cache_rows, positions, k, v, n_slots=mask.shape[-1], as_stored=True
            )  # (B, H, S, D)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=self.scaling)  # (B, H, T, D)
        else:
            y = cached_attention(q, k, v, mask, positions, scale=self.scaling)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, E), or E / N on a rank of N
        return self.out_proj(y)


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: OPTConfig) -> None:
        super().__init__()
        self.layer_norm_before = config.do_layer_norm_before
        affine = config.layer_norm_elementwise_affine
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        self.fc1 = Linear(config.hidden_size, config.ffn_dim, bias=config.enable_bias)
        self.fc2 = Linear(config.ffn_dim, config.hidden_size, bias=config.enable_bias)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        # In place: fc1's output is a temporary of this forward alone.
        self.activation = activation(config.activation_function, field="activation_function", in_place=True)

    def forward(self, x: Tensor, positions: Tensor, cache_rows: CacheRows | None, mask: Tensor | None) -> Tensor:
        if self.layer_norm_before:  # 125m, 1.3b and larger
            x = x + self.self_attn(self.self_attn_layer_norm(x), positions, cache_rows, mask)
            return x + self.fc2(self.activation(self.fc1(self.final_layer_norm(x))))
        # 350m: LayerNorm after each residual block
        x = self.self_attn_layer_norm(x + self.self_attn(x, positions, cache_rows, mask))
        return self.final_layer_norm(x + self.fc2(self.activation(self.fc1(x))))


class OPTDecoder(nn.Module):
    def __init__(self, config: OPTConfig) -> None:
        super().__init__()
        E, W = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, W, config.pad_token_id)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, E)
        # 350m embeds words in W < E dimensions and projects in and out of the residual stream.
        self.project_in = Linear(W, E, bias=False) if W != E else None
        self.project_out = Linear(E, W, bias=False) if W != E else None
        has_final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        affine = config.layer_norm_elementwise_affine
        self.final_layer_norm = nn.LayerNorm(E, elementwise_affine=affine) if has_final_norm else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(
        self, input_ids: Tensor, positions: Tensor, cache_rows: CacheRows | None, mask: Tensor | None
    ) -> Tensor:
        x = self.embed_tokens(input_ids)  # (B, T, W)
        if self.project_in is not None:
            x = self.project_in(x)  # (B, T, E)
        x = x + self.embed_positions(positions + POSITION_OFFSET)  # (B, T, E)
        if mask is not None and mask.dtype == torch.bool:
            # SDPA turns a boolean mask into an additive one on every call: do it once for all layers.
            mask = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
        for layer in self.layers:
            x = layer(x, positions, cache_rows, mask)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)  # (B, T, W)
        return x


class OPTForCausalLM(nn.Module):
    """OPT with a language-modelling head, in the pluginhost model interface.

    ``forward(input_ids, positions, cache_rows=None, mask=None)`` returns hidden
    states (B, T, W); ``compute_logits(hidden)`` returns logits (..., V).

    * ``positions`` (B, T): each token's position in its sequence, 0 for the
      first; its keys and values go to the cache slot of that number.
    * ``cache_rows``: the cache rows of the B sequences (``slice(start,
      start + B)`` or a (B,) tensor); ``None`` runs without the cache,
      causally over the T tokens.
    * ``mask`` (B, 1, T, S): which of the first S cache slots each new token
      may attend to (causality and padding, decided by the engine; never a
      slot past the token's own position); bool (True = attend) or an
      additive float mask.
    """

    #: A prompt may be prefilled in pieces (``ModelRunner``, past ``max_num_batched_tokens``): a piece at positions
    #: p.. writes its keys and values to those slots and attends every slot up to its end, as decoding does.
    prefill_in_pieces = True

    def __init__(self, config: OPTConfig) -> None:
        super().__init__()
        self.config = config
        self.decoder = OPTDecoder(config)
        self.lm_head = Linear(config.word_embed_proj_dim, config.vocab_size, bias=False)

    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate a static key/value cache in every layer, on the model's device and dtype."""
        # The embedding table, not lm_head: a post_load plugin may replace lm_head (and every linear
        # layer) with a module whose weights are quantized or that has no ``weight`` at all.
        weight = self.decoder.embed_tokens.weight
        for layer in self.decoder.layers:
            attn = layer.self_attn
            attn.kv_cache = KVCache(
                max_batch_size, attn.n_heads, max_seq_len, attn.head_dim, dtype=weight.dtype, device=weight.device
            )

    def forward(
        self, input_ids: Tensor, positions: Tensor, cache_rows: CacheRows | None = None, mask: Tensor | None = None
    ) -> Tensor:
        return self.decoder(input_ids, positions, cache_rows, mask)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        return self.lm_head(hidden_states)  # (..., V)

    def tp_plan(self) -> dict[str, Style]:
        """How tensor parallelism splits the model (``builtin_models.tp``), as vLLM splits OPT."""
        return {
            "decoder.layers.*.self_attn": Heads(),
            "decoder.layers.*.self_attn.qkv_proj": Colwise(parts=3),
            "decoder.layers.*.self_attn.out_proj": Rowwise(),
            "decoder.layers.*.fc1": Colwise(),
            "decoder.layers.*.fc2": Rowwise(),
            "lm_head": VocabParallel(),
        }

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Load Hugging Face OPT checkpoint names (``model.decoder.*`` or ``decoder.*``)."""
        tied = getattr(self.config, "tie_word_embeddings", True)

        def rename(name: str) -> str | Stacked | None:
            name = name.removeprefix("model.")
            module, _, leaf = name.rpartition(".")  # "decoder.layers.0.self_attn.q_proj", "weight"
            attention, _, projection = module.rpartition(".")
            if projection in QKV_PARTS and attention.endswith(".self_attn"):
                return Stacked(f"{attention}.qkv_proj.{leaf}", QKV_PARTS.index(projection), QKV_PARTS)
            return name

        if not tied:
            return assign_weights(self, weights, rename)
        head = TiedHead("lm_head.weight", "decoder.embed_tokens.weight")  # tied to the embeddings, as in transformers
        rest = head.filter(weights, "lm_head.weight", "model.lm_head.weight")
        return head.tie(self, assign_weights(self, rest, rename))
