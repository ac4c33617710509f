"""``TransformersForCausalLM``: any causal LM transformers can build, in pluginhost's model interface.

The fallback wraps the transformers model class the checkpoint's
``config.json`` names (the first of ``config.architectures`` transformers
has, else the class ``AutoModelForCausalLM`` maps the config's type to; never
remote code) and runs it the way pluginhost runs its native models: built on the
meta device, weights streamed in by pluginhost's checkpoint reader, the static
per-row ``KVCache`` the engine grows and compacts, the engine's positions and
masks, the engine's batching and sampling.

How each part maps onto transformers (5.x):

* **Construction.** ``cls(config)`` under the engine's ``torch.device("meta")``
  and default dtype, with ``attn_implementation="sdpa"`` (``"eager"`` where the
  class has no SDPA path, as Gemma 2 with its attention soft-capping).
  transformers skips weight initialisation on meta, so nothing is allocated.
* **Weights.** ``load_weights`` assigns checkpoint tensors to the wrapped
  model's parameters (and persistent buffers) by their state-dict names
  (``builtin_models.weights.assign_weights``: names and shapes checked).
  Names are mapped as ``from_pretrained`` maps them, with transformers' own
  tables: legacy names (GPT-NeoX saves its head as ``embed_out``), with or
  without the base model's prefix. Tensors transformers fuses or splits while
  loading (``WeightConverter``s: per-expert MoE weights...) are refused with
  a message saying so. Output embeddings are tied as transformers ties them
  (a checkpoint holding only one of two tied tensors is fine), and the stale
  buffers old checkpoints carry are skipped (``rotary_emb.inv_freq``,
  ``attention.masked_bias``...: transformers' own
  ``_keys_to_ignore_on_load_unexpected`` patterns plus the model's
  non-persistent buffers). Anything else unexpected is an error; so is a
  missing parameter, found before the model first runs. Messages name
  tensors as the checkpoint does (``gpt_neox.foo``, not the wrapper's
  ``hf_model.gpt_neox.foo``).
* **Buffers.** Buffers transformers computes in ``__init__`` (rotary
  ``inv_freq``, GPT-J's sinusoid table...) were created on meta. They are
  recomputed the way ``from_pretrained`` does it: each is re-created empty on
  the target device and the owning model's ``_init_weights`` is run on the
  module that holds it, with every loaded tensor flagged as initialised so
  nothing loaded is touched. A buffer that stays unset is an error.
* **Cache.** A ``transformers.Cache`` subclass (``EngineCache``) routes each
  layer's ``update(key, value, layer_idx)`` into that layer's ``KVCache``:
  the rows and positions of the current forward, returning the first
  ``n_slots`` slots, (B, H, S, D). Head counts and sizes are not guessed from
  the config: a short forward at load records the keys and values each layer
  hands the cache. The same forward checks the cached path against the
  uncached one (two rows of different lengths, a prefill then a decode
  step); where they disagree, or the architecture cannot use such a cache
  (recurrent layers, keys and values of different shapes, ALiBi models that
  need a 2D mask), the cache is switched off with a warning (the instance's
  ``setup_caches`` becomes ``None``, which the engine reads as "no cache")
  and the engine recomputes every step: slower, still correct.
* **Masks.** The engine's (B, 1, T, S) mask goes to transformers as a custom
  4D additive mask (transformers returns 4D masks untouched, so it never
  builds a causal mask over the wrong length); positions go as
  ``position_ids``. Sliding-window layers get the window cut into their
  mask (slot p of a row holds position p, so the window is a comparison of
  positions): one mask for models that slide every layer (Mistral-like), a
  ``{layer_type: mask}`` dict for models whose ``config.layer_types`` mix
  full and sliding layers (Gemma 2, Qwen 2...). Layer types without a known
  mask (chunked, linear attention) leave mask building to transformers,
  uncached. Without the cache a causal mask (what the engine passes when it
  recomputes) is left to transformers altogether.
* **Logits.** ``forward`` returns the decoder's last hidden states, the
  decoder being the module ``*ForCausalLM.forward`` calls for them (found at
  load with hooks on one reference forward: ``model`` for most, OPT's
  ``model.decoder``). ``compute_logits`` runs transformers' own
  ``*ForCausalLM.forward`` with that module's forward swapped for one that
  returns the given hidden states, so whatever an architecture does after
  its decoder (output embeddings, logit soft-capping, logit scales...) is
  transformers' code, not a copy that could drift. The load checks it
  against the reference forward's logits.

A plugin overrides the fallback by registering its own class under
``TransformersForCausalLM`` (typically a subclass of this one).
"""

from __future__ import annotations

import copy
import functools
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import BaseModelOutputWithPast

from builtin_models.config_fields import declared_field
from builtin_models.kv_cache import CacheRows, KVCache
from builtin_models.weights import assign_weights, check_all_loaded, same_tensor
from pluginhost.errors import CheckpointError, ModelClassError

__all__ = ["EngineCache", "TransformersForCausalLM"]

logger = logging.getLogger(__name__)

#: Checkpoint tensors old checkpoints carry that transformers ignores for every model (see
#: ``PreTrainedModel._adjust_missing_and_unexpected_keys``); each model adds its own patterns.
_STALE_BUFFER_PATTERNS = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")

#: Layer types whose mask the fallback builds from the engine's (``config.layer_types``).
_MASKED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
#: Config keys of attention windows a model keeps in masks of its own (GPT-Neo's local layers).
_OWN_MASK_WINDOWS = ("window_size",)

#: How far the cached path may drift from the uncached one at load, relative to the hidden
#: states' scale, before the cache is switched off (a wrong cache is off by the scale itself).
_SELF_CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
_SELF_CHECK_HALF_TOLERANCE = 5e-2


def _transformers_class(config: Any) -> type[PreTrainedModel]:
    """The transformers causal-LM class the config names, else the one ``AutoModelForCausalLM`` maps its type to.

    Only transformers' own classes: never remote code (a config's ``auto_map`` is not looked at).
    """
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from pluginhost.build import no_causal_lm, transformers_causal_lms

    known = transformers_causal_lms()
    names = [name for name in getattr(config, "architectures", None) or [] if name in known]
    named = [getattr(transformers, name, None) for name in names]
    named = [cls for cls in named if isinstance(cls, type) and issubclass(cls, PreTrainedModel)]
    # A named class made for another config is not what transformers builds: "MistralForCausalLM" over a config
    # with layer_types is a MinistralConfig, which AutoModelForCausalLM builds as MinistralForCausalLM.
    for cls in named:
        if getattr(cls, "config_class", None) is type(config):
            return cls
    try:  # e.g. the architecture is "TransformersForCausalLM" itself: go by the config's model_type
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        if named:
            return named[0]
        architectures = getattr(config, "architectures", None) or []
        raise ModelClassError(no_causal_lm(architectures, getattr(config, "model_type", None))) from None


class TransformersForCausalLM(nn.Module):
    """A transformers causal LM in the pluginhost model interface (see the module docstring).

    ``forward(input_ids, positions, cache_rows=None, mask=None)`` returns the
    last hidden states (B, T, W); ``compute_logits(hidden)`` the logits
    (..., V), exactly as transformers computes them. The wrapped model is
    ``self.hf_model``; ``self.decoder`` is the module of it whose hidden states
    the head turns into logits (found at load).
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        config = copy.deepcopy(config)  # transformers writes into it (attention implementation, ...)
        cls = _transformers_class(config)
        # SDPA where the class has it; eager otherwise (Gemma 2: SDPA has no attention soft-capping).
        config._attn_implementation = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
        hf_model = cls(config)
        self.hf_model: PreTrainedModel = hf_model.eval()
        self.config = hf_model.config
        self.text_config = self.config.get_text_config()
        #: Set by load_weights: whether the architecture runs with the engine's KVCache.
        self.cache_supported = False
        #: layer_idx -> (kv heads, head dim, dtype) of the layers that use the cache (found at load).
        self._cache_layers: dict[int, tuple[int, int, torch.dtype]] = {}
        self._cache: EngineCache | None = None
        self._decoder_name: str | None = None
        self.kv_caches: nn.ModuleList | None = None
        self._mask_mode, self._window = self._mask_plan()
        #: Whether padding a prompt would change its tokens (the engine then prefills rows unpadded).
        self.prefill_unpadded = _rotary_row_by_row(hf_model)

    # -- the decoder and its head ----------------------------------------------------

    @property
    def decoder(self) -> nn.Module:
        """The module ``*ForCausalLM.forward`` calls for hidden states (found at load; the base model before)."""
        hf = self.hf_model
        if self._decoder_name is not None:
            return hf.get_submodule(self._decoder_name)
        base = getattr(hf, hf.base_model_prefix, None)
        return base if isinstance(base, nn.Module) else hf.get_decoder()

    @property
    def _weight(self) -> Tensor:
        """A parameter that tells the model's device and dtype: the input embeddings', else the first one."""
        embeddings = self.hf_model.get_input_embeddings()
        weight = getattr(embeddings, "weight", None)
        return weight if isinstance(weight, Tensor) else next(self.hf_model.parameters())

    @property
    def dtype(self) -> torch.dtype:
        return self._weight.dtype

    def forward(
        self, input_ids: Tensor, positions: Tensor, cache_rows: CacheRows | None = None, mask: Tensor | None = None
    ) -> Tensor:
        cache = None
        if cache_rows is not None:
            if self._cache is None:
                raise ModelClassError("call setup_caches() before passing cache_rows")
            if mask is None:
                raise ModelClassError("a cached forward needs the mask over cache slots")
            cache = self._cache
            cache.bind(cache_rows, positions, mask.shape[-1], input_ids.shape[1])
        try:
            return self._run(input_ids, positions, cache, mask)
        finally:
            if cache is not None:
                cache.unbind()

    def _run(self, input_ids: Tensor, positions: Tensor, cache: Cache | None, mask: Tensor | None) -> Tensor:
        attention_mask = self._attention_mask(mask, positions, cached=cache is not None)
        out = self.decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            cache=cache,
            use_cache=cache is not None,
        )
        return out[0]  # last_hidden_state, (B, T, W)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """transformers' own head: ``*ForCausalLM.forward`` with the decoder answering ``hidden_states``."""
        return self._head(hidden_states)

    # Not traced by a compiled decoding step: dynamo cannot follow the decoder's forward swapped for a moment (it
    # failed with "no attribute 'forward'", and every fallback model decoded eagerly); the decoder still compiles.
    @torch.compiler.disable
    def _head(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        hidden = hidden_states.reshape(1, -1, shape[-1])  # (1, N, W): the head works token by token
        decoder = self.decoder
        own = decoder.__dict__.get("forward")  # an instance forward someone installed (hooks, compilers), if any
        decoder.forward = lambda *args, **kwargs: _HiddenStates(last_hidden_state=hidden)
        try:
            logits = self.hf_model(inputs_embeds=hidden, use_cache=False).logits  # (1, N, V)
        finally:
            if own is None:
                del decoder.forward  # the class's forward again
            else:
                decoder.forward = own
        return logits.reshape(*shape[:-1], logits.shape[-1])  # (..., V)

    # -- masks -----------------------------------------------------------------------

    def _mask_plan(self) -> tuple[str, int | None]:
        """How the engine's mask reaches the layers: ``"single"``, ``"by_layer_type"`` or ``"own"``.

        ``"own"``: the layer types include some whose mask the fallback cannot
        build (chunked attention, linear attention...): transformers builds its
        masks itself, which is right only without a cache and for causal masks.
        """
        config = self.text_config
        window = declared_field(config, "sliding_window")
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            kinds = set(layer_types)
            if not kinds <= _MASKED_LAYER_TYPES:
                return "own", window
            if "sliding_attention" in kinds:
                if not window:
                    return "own", window
                return "by_layer_type", int(window)
            return "single", None
        return "single", int(window) if window else None

    def _attention_mask(self, mask: Tensor | None, positions: Tensor, *, cached: bool) -> Tensor | dict | None:
        if mask is None or (not cached and _is_causal(mask)):
            # transformers' own causal (and sliding) masks over the T tokens: the same, and the only masks some
            # architectures take (ALiBi models build their biases from a 2D mask).
            return None
        if self._mask_mode == "own":
            raise ModelClassError(
                f"{type(self.hf_model).__name__} has layer types the transformers fallback cannot mask "
                f"({sorted(set(self.text_config.layer_types) - _MASKED_LAYER_TYPES)}): it runs without a cache "
                "and only with causal masks."
            )
        additive = _additive(mask, self.dtype)  # (B, 1, T, S)
        if self._window is None:
            return additive
        # Slot p of a row holds position p; without a cache the keys are the T tokens themselves.
        key_positions = torch.arange(mask.shape[-1], device=mask.device) if cached else positions[:, None, None, :]
        outside = key_positions <= positions[:, None, :, None] - self._window  # (B, 1, T, S)
        windowed = additive.masked_fill(outside, torch.finfo(additive.dtype).min)
        if self._mask_mode == "single":
            return windowed
        return {"full_attention": additive, "sliding_attention": windowed}

    # -- the KV cache ----------------------------------------------------------------

    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """One ``KVCache`` per layer that uses the cache, shaped as that layer's keys (found at load)."""
        if not self.cache_supported:
            raise ModelClassError(f"{type(self.hf_model).__name__} runs without a cache (see the load warning)")
        device = self._weight.device
        caches = {
            layer: KVCache(max_batch_size, heads, max_seq_len, head_dim, dtype=dtype, device=device)
            for layer, (heads, head_dim, dtype) in self._cache_layers.items()
        }
        self.kv_caches = nn.ModuleList(caches.values())
        self._cache = EngineCache(caches, self._num_layers())

    def _num_layers(self) -> int:
        return int(getattr(self.text_config, "num_hidden_layers", 0) or 0)

    # -- loading ---------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Load transformers-format checkpoint names; recompute buffers; find and check the cache layout."""
        hf = self.hf_model
        prefix = "hf_model."
        state = hf.state_dict()  # no data on meta: cheap
        param_names = {name for name, _ in hf.named_parameters(remove_duplicate=False)}
        buffer_names = set(state) - param_names  # persistent buffers
        tied = dict(getattr(hf, "all_tied_weights_keys", None) or {})  # target -> source
        rename = _checkpoint_renamer(hf, state)
        ignore = self._ignored_checkpoint_names()
        held: dict[str, Tensor] = {}  # tied targets, kept until we know whether their source came
        buffers: list[tuple[str, Tensor]] = []
        unconverted: list[str] = []
        targets: dict[str, str] = {}  # checkpoint name -> our parameter's: messages name the checkpoint's

        def params_only(stream: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
            for checkpoint_name, tensor in stream:
                name, needs_conversion = rename(checkpoint_name)
                if needs_conversion:
                    unconverted.append(checkpoint_name)
                elif name in tied:
                    held[name] = tensor
                elif name in buffer_names:
                    buffers.append((name, tensor))
                elif name in param_names or not ignore(name):
                    targets[checkpoint_name] = prefix + name
                    yield checkpoint_name, tensor  # assign_weights reports the unexpected ones

        loaded = assign_weights(self, params_only(weights), targets.__getitem__)
        if unconverted:
            raise CheckpointError(
                f"transformers converts these tensors of {type(hf).__name__} checkpoints while loading them (fusing "
                f"or splitting them), which the transformers fallback does not do: {', '.join(unconverted[:8])}"
                + (" ..." if len(unconverted) > 8 else "")
                + ". Use a native implementation of the architecture, or a checkpoint saved in the model's own layout."
            )
        loaded = {name.removeprefix(prefix) for name in loaded}
        loaded |= self._tie(tied, held, loaded)
        for name, tensor in buffers:
            self._set_buffer(name, tensor)
        hf.tie_weights(recompute_mapping=False)
        # Before the cache check runs the model: half-loaded, it would warn of a cache that "disagrees". Named
        # as the checkpoint names them (the loader checks again, as the wrapper names them).
        check_all_loaded(self.hf_model, loaded, getattr(hf.config, "name_or_path", "") or "")
        self._materialize_buffers()
        self._check_head_and_cache()
        return {prefix + name for name in loaded}

    def _ignored_checkpoint_names(self):  # noqa: ANN202 - a predicate
        hf = self.hf_model
        patterns = list(_STALE_BUFFER_PATTERNS) + list(getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or [])
        regex = re.compile("|".join(f"({p})" for p in patterns))
        non_persistent = {name for name, _ in hf.named_buffers()} - set(hf.state_dict().keys())
        return lambda name: name in non_persistent or regex.search(name) is not None

    def _tie(self, tied: dict[str, str], held: dict[str, Tensor], loaded: set[str]) -> set[str]:
        """Resolve tied tensors as transformers does; the names this makes loaded."""
        prefix = "hf_model."
        done: set[str] = set()
        for target, source in tied.items():
            tensor = held.get(target)
            if source in loaded:
                if tensor is not None and not same_tensor(tensor, self.hf_model.get_parameter(source)):
                    # Both in the checkpoint, and different: transformers does not tie them either.
                    logger.warning("%s and %s differ in the checkpoint: not tying them", target, source)
                    self.hf_model.all_tied_weights_keys.pop(target, None)
                    assign_weights(self, [(target, tensor)], lambda name: prefix + name)
                done.add(target)
            elif tensor is not None:  # only the target was saved: tie the other way round
                assign_weights(self, [(target, tensor)], {target: prefix + source}.get)  # named as saved
                done |= {source, target}
        return done

    def _set_buffer(self, name: str, tensor: Tensor) -> None:
        owner_name, _, attr = name.rpartition(".")
        owner = self.hf_model.get_submodule(owner_name) if owner_name else self.hf_model
        old = owner._buffers[attr]
        if old is not None and tuple(old.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"The checkpoint does not fit the model: buffer {name}: checkpoint shape {tuple(tensor.shape)}, "
                f"model {tuple(old.shape)}."
            )
        owner._buffers[attr] = tensor.to(old.dtype) if old is not None else tensor

    @torch.no_grad()
    def _materialize_buffers(self) -> None:
        """Recompute the buffers left on meta, as ``from_pretrained`` does (``_init_weights`` on their owners)."""
        from transformers import initialization

        hf = self.hf_model
        device = self._weight.device
        owners = []
        for module_name, module in hf.named_modules():
            meta = [name for name, b in module._buffers.items() if b is not None and b.is_meta]
            if not meta:
                continue
            for name in meta:
                old = module._buffers[name]
                new = torch.empty_like(old, device=device)
                if new.is_floating_point():
                    new.fill_(float("nan"))  # to tell afterwards whether transformers set it
                module._buffers[name] = new
            owners.append((module_name, module, meta))
        if not owners:
            return
        recomputed = {id(module._buffers[name]) for _, module, meta in owners for name in meta}
        for _, tensor in [*hf.named_parameters(remove_duplicate=False), *hf.named_buffers()]:
            if id(tensor) not in recomputed and not tensor.is_meta:
                tensor._is_hf_initialized = True  # loaded: transformers' init functions leave these alone
        initializers = _initializers(hf)
        unset = []
        with initialization.guard_torch_init_functions():
            for module_name, module, meta in owners:
                initializers(module_name)._init_weights(module)
                for name in meta:
                    value = module._buffers[name]
                    if value.is_floating_point() and value.isnan().any():
                        unset.append(f"{module_name}.{name}".lstrip("."))
        for _, tensor in [*hf.named_parameters(remove_duplicate=False), *hf.named_buffers()]:
            if hasattr(tensor, "_is_hf_initialized"):
                del tensor._is_hf_initialized
        if unset:
            raise ModelClassError(
                f"transformers' {type(hf).__name__}._init_weights does not compute buffer(s) {', '.join(unset)}: the "
                "transformers fallback cannot build them off the meta device."
            )

    # -- finding the cache layout ----------------------------------------------------

    @torch.no_grad()
    def _check_head_and_cache(self) -> None:
        """Find the decoder and check ``compute_logits`` on a reference forward, then find the cache layout."""
        hf = self.hf_model
        device = self._weight.device
        vocab = int(getattr(self.text_config, "vocab_size", None) or 2)
        n = self._probe_length()
        ids = (torch.arange(2 * n, device=device).view(2, n) * 7 + 3) % vocab  # (2, n)
        name, hidden, logits = _reference_forward(hf, ids)
        if name is None:
            raise ModelClassError(
                f"{type(hf).__name__}.forward called no module returning last_hidden_state: the transformers fallback "
                "needs a decoder it can call for hidden states."
            )
        self._decoder_name = name
        self._check_causal(ids, logits)
        ours = self._head(hidden)  # not compute_logits: a subclass may change the logits on purpose
        drift = _relative_error(ours, logits)
        if drift > _SELF_CHECK_TOLERANCE.get(logits.dtype, _SELF_CHECK_HALF_TOLERANCE):
            raise ModelClassError(
                f"{type(hf).__name__}: the logits of its head over the hidden states of {name or 'itself'} differ from "
                f"its own logits (relative error {drift:.2g}): the transformers fallback cannot serve it."
            )
        self.cache_supported = self._find_cache_layout(ids, hidden)
        if not self.cache_supported:
            # The engine's runner takes a model without a callable setup_caches as one to recompute every step.
            self.setup_caches = None

    def _check_causal(self, ids: Tensor, logits: Tensor) -> None:
        """Refuse a model whose tokens attend to later ones (BERT's LM head with ``is_decoder`` false): generating
        with it, each request's tokens would depend on the padding of the requests batched with it."""
        prefix = self.hf_model(input_ids=ids[:, :-1], use_cache=False).logits  # (2, n - 1, V)
        drift = _relative_error(prefix, logits[:, :-1])
        if not drift > _SELF_CHECK_TOLERANCE.get(logits.dtype, _SELF_CHECK_HALF_TOLERANCE):
            return  # causal; or logits not finite (weights that are not: told after loading), nothing to judge
        hint = ""
        if getattr(self.text_config, "is_decoder", None) is False:
            hint = (
                " Its config has is_decoder false: if it is meant to generate, set it true "
                """(--hf-overrides '{"is_decoder": true}', or is_decoder in config.json)."""
            )
        raise ModelClassError(
            f"{type(self.hf_model).__name__} is not a causal language model as configured: its logits for a token "
            f"change with the tokens after it (relative error {drift:.2g}), so it attends both ways and cannot "
            f"generate token by token.{hint}"
        )

    def _probe_length(self) -> int:
        """How many positions the cache probe runs: 4, or more than a window of ``_OWN_MASK_WINDOWS``.

        The engine's masks carry ``sliding_window``. A window a model keeps in masks of its own (GPT-Neo's
        ``window_size``: a buffer it slices as if every row's last token sat at the last slot) is right
        only while the rows of a step are at most that far apart; the probe's rows must be further apart
        for a wrong answer to show.
        """
        config = self.text_config
        if self._mask_mode == "own":
            return 4  # no cache for it anyway
        windows = [getattr(config, key, None) for key in _OWN_MASK_WINDOWS]
        window = max((w for w in windows if type(w) is int and w > 0), default=0)
        # A window as long as the positions cuts nothing: probing past it is neither needed nor possible.
        longest = getattr(config, "max_position_embeddings", None)
        return max(4, min(window + 2, longest) if type(longest) is int and longest > 0 else window + 2)

    def _find_cache_layout(self, ids: Tensor, full: Tensor) -> bool:
        """Run two rows through the cache as the engine does: record each layer's cache shape; ``False`` if it fails.

        Row 0: a prompt of n - 1 tokens, then its n-th decoded; row 1: a prompt of 2, right-padded to n - 1
        in the same prefill, then its 3rd decoded at position 2, over the padding's slots, n - 3 positions
        behind row 0 (more than any window the model keeps in its own masks: ``_probe_length``). ``full``:
        the uncached hidden states of ``ids`` (2, n), the reference.
        """
        name = type(self.hf_model).__name__
        if self._mask_mode == "own":
            logger.warning(
                "%s: layer types %s have no engine mask: running without a KV cache (every step recomputes)",
                name,
                sorted(set(self.text_config.layer_types)),
            )
            return False
        device = ids.device
        n = ids.shape[1]
        positions = torch.arange(n, device=device).expand(2, n)
        probe = EngineCache(None, self._num_layers(), probe_shape=(2, n))
        try:
            prompts = ids[:, : n - 1].clone()
            prompts[1, 2:] = (prompts[1, 2:] + 1) % int(getattr(self.text_config, "vocab_size", None) or 2)  # padding
            causal = torch.ones(n - 1, n - 1, dtype=torch.bool, device=device).tril()[None, None].expand(2, 1, -1, -1)
            probe.bind(torch.arange(2, device=device), positions[:, : n - 1], n - 1, n - 1)
            prefill = self._run(prompts, positions[:, : n - 1], probe, causal)  # (2, n - 1, W)
            probe.unbind()
            step = torch.tensor([[n - 1], [2]], device=device)  # (2, 1): each row's next position
            step_ids = ids.gather(1, step)
            mask = (torch.arange(n, device=device)[None, :] <= step)[:, None, None, :]  # (2, 1, 1, n)
            probe.bind(slice(0, 2), step, n, 1)
            decode = self._run(step_ids, step, probe, mask)[:, 0]  # (2, W)
            probe.unbind()
        except Exception as exc:  # noqa: BLE001 - any failure means: no cache
            logger.warning(
                "%s cannot run with the engine's KV cache (%s: %s): running without one (every step recomputes)",
                name,
                type(exc).__name__,
                exc,
            )
            return False
        expected_decode = torch.stack([full[0, n - 1], full[1, 2]])
        drift = max(
            _relative_error(prefill[0], full[0, : n - 1]),  # row 1's tokens from the third were padding
            _relative_error(prefill[1, :2], full[1, :2]),
            _relative_error(decode, expected_decode),
        )
        tolerance = _SELF_CHECK_TOLERANCE.get(full.dtype, _SELF_CHECK_HALF_TOLERANCE)
        if not probe.layouts or drift > tolerance:
            reason = "it never used the cache" if not probe.layouts else f"relative error {drift:.2g}"
            logger.warning(
                "%s: cached and uncached forwards disagree (%s): running without a KV cache (every step recomputes)",
                name,
                reason,
            )
            return False
        self._cache_layers = probe.layouts
        return True


def _rotary_row_by_row(hf: nn.Module) -> bool:
    """Make RoPE whose frequencies follow the length (``dynamic``, ``longrope``) follow each row's; whether any does.

    transformers takes one length for a whole batch, its longest position, and ``dynamic`` keeps the
    longest it has seen: a batch-mate, or a request that ended, changed a request's tokens. Each row
    now gets the frequencies a fresh transformers model gives it alone, as the builtin Llama does.
    """
    found = False
    for module in hf.modules():
        kinds = getattr(module, "rope_type", None)
        kinds = kinds if isinstance(kinds, dict) else {None: kinds}  # per layer type, or one for all
        following = {t: k for t, k in kinds.items() if isinstance(k, str) and ("dynamic" in k or k == "longrope")}
        if following and callable(getattr(module, "forward", None)):
            module.forward = functools.partial(_rotary_of_each_row, module, module.forward, following)
            found = True
    return found


def _rotary_of_each_row(
    module: nn.Module, forward: Any, kinds: dict, x: Tensor, position_ids: Tensor, *args: Any, **kwargs: Any
):
    """``forward`` (transformers' rotary embedding) for one row at a time, from its original frequencies each time.

    ``args``: what else the model passes (``layer_type``, by position in Gemma 3 and others).
    """
    rows = []
    for b in range(position_ids.shape[0]):
        for layer_type, kind in kinds.items():
            if "dynamic" in kind:  # forget the longest length seen: grown again, from the original, for this row
                prefix = f"{layer_type}_" if layer_type is not None else ""
                original = getattr(module, f"{prefix}original_inv_freq")
                module.register_buffer(f"{prefix}inv_freq", original.to(x.device), persistent=False)
                setattr(module, f"{prefix}max_seq_len_cached", module.original_max_seq_len)
        rows.append(forward(x, position_ids[b : b + 1], *args, **kwargs))  # (cos, sin), each (1, T, D)
    return tuple(torch.cat(parts) for parts in zip(*rows, strict=True))  # (B, T, D) each


def _checkpoint_renamer(hf: PreTrainedModel, state: dict[str, Tensor]):  # noqa: ANN202 - a function
    """checkpoint name -> (state-dict name, whether transformers would convert the tensor), as ``from_pretrained``.

    transformers renames legacy names (GPT-NeoX's ``embed_out`` is ``lm_head`` now, ``LayerNorm.gamma``...)
    and adds or strips the base model's prefix; both are applied here, with transformers' own tables.
    Tensors it fuses or splits (``WeightConverter``: per-expert MoE weights...) are reported instead.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(hf)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def rename(name: str) -> tuple[str, bool]:
        renamed, converted_by = rename_source_key(name, renamings, converters, hf.base_model_prefix, state)
        return renamed, converted_by is not None

    return rename


def _reference_forward(hf: PreTrainedModel, ids: Tensor) -> tuple[str | None, Tensor, Tensor]:
    """transformers' own forward over ``ids``: (the decoder's name, its hidden states, the logits).

    The decoder is the first module the forward calls that returns ``last_hidden_state`` (OPT's
    head, say, calls ``model.decoder``, not ``model``).
    """
    started: list[str] = []
    outputs: dict[str, Tensor] = {}
    handles = []
    for module_name, module in hf.named_modules():
        if module is hf:
            continue

        def before(module: nn.Module, args: Any, module_name: str = module_name) -> None:
            started.append(module_name)

        def after(module: nn.Module, args: Any, output: Any, module_name: str = module_name) -> None:
            hidden = getattr(output, "last_hidden_state", None)
            if isinstance(hidden, Tensor) and module_name not in outputs:
                outputs[module_name] = hidden

        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        logits = hf(input_ids=ids, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    name = next((n for n in started if n in outputs), None)
    return name, outputs.get(name) if name is not None else None, logits


def _relative_error(ours: Tensor, reference: Tensor) -> float:
    scale = reference.float().abs().max().clamp_min(1e-6)
    return float(((ours.float() - reference.float()).abs().max() / scale).item())


def _initializers(hf: PreTrainedModel):  # noqa: ANN202 - a lookup
    """module name -> the innermost ``PreTrainedModel`` holding it (whose ``_init_weights`` applies)."""
    models = [(name, module) for name, module in hf.named_modules() if isinstance(module, PreTrainedModel)]

    def find(module_name: str) -> PreTrainedModel:
        best = hf
        depth = -1
        for name, model in models:
            if (name == "" or module_name == name or module_name.startswith(name + ".")) and len(name) > depth:
                best, depth = model, len(name)
        return best

    return find


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = attend) as an additive one; an additive mask as it is.

    A mask expanded over the batch (the engine's prefill mask) stays one, so a long prefill does not
    allocate B copies of a (T, T) mask.
    """
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    if mask.shape[0] > 1 and mask.stride(0) == 0:
        return _additive(mask[:1], dtype).expand(mask.shape)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def _is_causal(mask: Tensor) -> bool:
    """Whether a (B, 1, T, T) mask lets each token see exactly itself and those before it."""
    T, S = mask.shape[-2], mask.shape[-1]
    if T != S:
        return False
    causal = torch.ones(T, S, dtype=torch.bool, device=mask.device).tril()
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return bool(torch.equal(allowed, causal.expand_as(allowed)))


class _HiddenStates(BaseModelOutputWithPast):
    """The decoder's output in ``compute_logits``: hidden states, and ``None`` for whatever else is asked."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _EngineLayer(CacheLayerMixin):
    """One layer's cache: its ``KVCache`` at the rows and positions of the current forward."""

    is_compileable = False

    def __init__(self, cache: EngineCache, layer_idx: int, kv: KVCache | None) -> None:
        super().__init__()
        self.cache, self.layer_idx, self.kv = cache, layer_idx, kv
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        cache = self.cache
        if cache.rows is None:
            raise RuntimeError("the engine cache is used outside a forward pass")
        if self.kv is None:  # the load-time probe: a cache shaped as this layer's keys
            if key_states.shape != value_states.shape:
                raise ValueError(f"keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} differ")
            _, H, _, D = key_states.shape
            rows, slots = cache.probe_shape
            self.kv = KVCache(rows, H, slots, D, dtype=key_states.dtype, device=key_states.device)
            cache.layouts[self.layer_idx] = (H, D, key_states.dtype)
        # In the model's dtype: transformers' attention takes no other (a kv_cache_dtype cache is converted back).
        return self.kv.update(cache.rows, cache.positions, key_states, value_states, cache.n_slots)

    def get_seq_length(self) -> int:
        return self.cache.past_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.n_slots, 0

    def get_max_length(self) -> int:
        return -1 if self.kv is None else self.kv.shape[1]

    def reset(self) -> None:
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("the engine moves cache rows itself (KVCache.move)")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the engine owns the cache")


class EngineCache(Cache):
    """A ``transformers.Cache`` over the engine's per-layer ``KVCache`` modules.

    ``bind(rows, positions, n_slots, new_tokens)`` before each forward (the
    model does it), ``unbind()`` after. ``get_seq_length()`` is the number of
    slots before this forward's tokens in the longest row (transformers uses it
    only where positions are not given; they always are); ``get_mask_sizes``
    is ``(n_slots, 0)``, the length of the engine's mask.
    With ``caches=None`` each layer allocates a small cache shaped as its
    first keys (the load-time probe) and records the shape in ``layouts``.
    """

    def __init__(
        self, caches: dict[int, KVCache] | None, num_layers: int, probe_shape: tuple[int, int] = (0, 0)
    ) -> None:
        caches = caches or {}
        count = max(num_layers, max(caches, default=-1) + 1, 1)
        super().__init__(layers=[_EngineLayer(self, i, caches.get(i)) for i in range(count)])
        #: Probe mode (no caches given): (rows, slots) of the caches layers allocate on their first update.
        self.probe_shape = probe_shape if not caches else None
        #: layer_idx -> (heads, head dim, dtype) of the keys each layer handed the cache (probe mode).
        self.layouts: dict[int, tuple[int, int, torch.dtype]] = {}
        self.rows: CacheRows | None = None
        self.positions: Tensor | None = None
        self.n_slots = 0
        self.past_length = 0

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        while layer_idx >= len(self.layers) and self.probe_shape:  # a config that undercounts its layers
            self.layers.append(_EngineLayer(self, len(self.layers), None))
        layer = self.layers[layer_idx]
        if layer.kv is None and not self.probe_shape:
            raise RuntimeError(f"layer {layer_idx} did not use the cache at load, but does now")
        return layer.update(key_states, value_states)

    def bind(self, rows: CacheRows, positions: Tensor, n_slots: int, new_tokens: int) -> None:
        self.rows, self.positions, self.n_slots = rows, positions, int(n_slots)
        self.past_length = max(int(n_slots) - int(new_tokens), 0)

    def unbind(self) -> None:
        self.rows = self.positions = None
