"""GPT-2 as a pluginhost model: learned positions, pre-LayerNorm blocks, a tied head.

Numerically the same as transformers' ``GPT2LMHeadModel`` (fp32, eager
attention), including ``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``
and ``reorder_and_upcast_attn`` (attention scores in float32). Checkpoints
store transformers' ``Conv1D`` weights as (in, out): ``load_weights``
transposes them into ordinary (out, in) linear layers, and accepts both the
``transformer.`` prefix of transformers' checkpoints and the bare names of
the original ones, whose attention-mask buffers (``attn.bias``,
``attn.masked_bias``) it skips. A decoder saved from an encoder-decoder model
(``add_cross_attention``) runs as transformers runs it alone: its
cross-attention layers attend to an encoder's states, which a causal language
model is never given, so their weights are skipped too.

Shapes: B batch, T new tokens, S cache slots attended, H heads, D head dim,
E hidden size, V vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from builtin_models.activations import activation
from builtin_models.attention import cached_attention
from builtin_models.kv_cache import CacheRows, KVCache
from builtin_models.linear import Linear
from builtin_models.tp import Colwise, Heads, Rowwise, Style, VocabParallel
from builtin_models.weights import TiedHead, assign_weights

__all__ = ["GPT2Attention", "GPT2Block", "GPT2LMHeadModel"]

logger = logging.getLogger(__name__)

#: Conv1D weights in the checkpoint, stored (in, out).
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        E = config.n_embd
        self.n_heads = config.n_head
        if E % self.n_heads:
            raise ValueError(f"n_embd {E} is not a multiple of n_head {self.n_heads}")
        self.head_dim = E // self.n_heads
        self.c_attn = Linear(E, 3 * E)  # rows [q; k; v], as the checkpoint stores them
        self.c_proj = Linear(E, E)
        self.scaling = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scaling /= float(layer_idx + 1)
        self.upcast = bool(getattr(config, "reorder_and_upcast_attn", False))
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, positions: Tensor, cache_rows: CacheRows | None, mask: Tensor) -> Tensor:
        B, T, E = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.n_heads, self.head_dim)  # (B, T, 3, H, D)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, D)
        if cache_rows is not None:
            assert self.kv_cache is not None, "call setup_caches() before passing cache_rows"
            k, v = self.kv_cache.update(
                cache_rows, positions, k, v, n_slots=mask.shape[-1], as_stored=True
            )  # (B, H, S, D)
        # reorder_and_upcast_attn: scores and softmax in float32, as transformers computes them.
        upcast = torch.float32 if self.upcast else None
        y = cached_attention(q, k, v, mask, positions, scale=self.scaling, compute_dtype=upcast)  # (B, H, T, D)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # (B, T, E / ranks)


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        E, eps = config.n_embd, config.layer_norm_epsilon
        inner = config.n_inner or 4 * E
        self.ln_1 = nn.LayerNorm(E, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(E, eps=eps)
        self.c_fc = Linear(E, inner)
        self.c_proj = Linear(inner, E)
        self.activation = activation(config.activation_function, field="activation_function")

    def forward(self, x: Tensor, positions: Tensor, cache_rows: CacheRows | None, mask: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x), positions, cache_rows, mask)
        return x + self.c_proj(self.activation(self.c_fc(self.ln_2(x))))


class GPT2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(
        self, input_ids: Tensor, positions: Tensor, cache_rows: CacheRows | None, mask: Tensor | None
    ) -> Tensor:
        x = self.wte(input_ids) + self.wpe(positions)  # (B, T, E)
        if mask is None:  # no cache: the T tokens attend causally to each other
            T = input_ids.shape[-1]
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None, None]  # (1, 1, T, T)
        if mask.dtype == torch.bool:  # converted once for all layers, not by SDPA in each
            mask = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
        for block in self.h:
            x = block(x, positions, cache_rows, mask)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 with its (tied) language-modelling head, in the pluginhost model interface.

    ``forward(input_ids, positions, cache_rows=None, mask=None)`` returns hidden
    states (B, T, E); ``compute_logits(hidden)`` returns logits (..., V). See
    ``builtin_models.opt.OPTForCausalLM`` for the arguments.
    """

    #: A prompt may be prefilled in pieces (``ModelRunner``, past ``max_num_batched_tokens``): a piece at positions
    #: p.. writes its keys and values to those slots and attends every slot up to its end, as decoding does.
    prefill_in_pieces = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.cross_attention = bool(getattr(config, "add_cross_attention", False))
        if self.cross_attention:
            logger.warning(
                "config.json sets add_cross_attention: the checkpoint's cross-attention layers are left unused (they "
                "attend to an encoder's states, which a causal language model is never given; transformers' "
                "GPT2LMHeadModel skips them alike)"
            )

    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate a static key/value cache in every block, on the model's device and dtype."""
        weight = self.transformer.wte.weight  # not lm_head's: a post_load plugin may replace the head (int8_quant does)
        for block in self.transformer.h:
            attn = block.attn
            attn.kv_cache = KVCache(
                max_batch_size, attn.n_heads, max_seq_len, attn.head_dim, dtype=weight.dtype, device=weight.device
            )

    def forward(
        self, input_ids: Tensor, positions: Tensor, cache_rows: CacheRows | None = None, mask: Tensor | None = None
    ) -> Tensor:
        return self.transformer(input_ids, positions, cache_rows, mask)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        return self.lm_head(hidden_states)  # (..., V)

    def tp_plan(self) -> dict[str, Style]:
        """How tensor parallelism splits the model (``builtin_models.tp``), as vLLM splits GPT-2."""
        return {
            "transformer.h.*.attn": Heads(),
            "transformer.h.*.attn.c_attn": Colwise(parts=3),
            "transformer.h.*.attn.c_proj": Rowwise(),
            "transformer.h.*.c_fc": Colwise(),
            "transformer.h.*.c_proj": Rowwise(),
            "lm_head": VocabParallel(),
        }

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Load transformers' (``transformer.h.N...``) or the original (``h.N...``) GPT-2 checkpoint names."""
        tied = getattr(self.config, "tie_word_embeddings", True)

        def conv1d(name: str) -> bool:  # stored (in, out): assign_weights transposes it, and reports it as stored
            return name.endswith(_CONV1D)

        def rename(name: str) -> str | None:
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                return None  # old checkpoints' causal-mask buffers
            if self.cross_attention and (".crossattention." in name or ".ln_cross_attn." in name):
                return None  # an encoder-decoder's decoder: nothing here gives it encoder states
            if not name.startswith(("transformer.", "lm_head.")):
                name = f"transformer.{name}"
            # transformers nests the MLP under "mlp."; this model keeps c_fc/c_proj on the block.
            return name.replace(".mlp.c_fc.", ".c_fc.").replace(".mlp.c_proj.", ".c_proj.")

        if not tied:
            return assign_weights(self, weights, rename, transposed=conv1d)
        head = TiedHead("lm_head.weight", "transformer.wte.weight")  # tied to the embeddings, as in transformers
        return head.tie(self, assign_weights(self, head.filter(weights, "lm_head.weight"), rename, transposed=conv1d))
