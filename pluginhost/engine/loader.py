"""Building an engine's model through the plugin pipeline (see ``pluginhost.build`` for the order).

``load_model`` runs the whole build once, in the order a user wants errors
(cheap checks first, weights last), and returns everything the engine needs.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from builtin_models.weights import check_all_loaded
from pluginhost.build import BuildPlan, check_combination, plan_build
from pluginhost.checkpoint import find_checkpoint, report_nonfinite
from pluginhost.config import EngineConfig, describe_validation_error
from pluginhost.device import dtype_name, resolve_device, resolve_dtype
from pluginhost.errors import CheckpointError, ConfigError, ModelClassError, PluginhostError
from pluginhost.host import PluginHost, PluginRecord
from pluginhost.logits_processors import RegisteredProcessor
from pluginhost.model_dir import text_config
from pluginhost.registry import Registration, builtin_ref
from pluginhost.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from pluginhost.engine.parallel import Agreement

__all__ = ["LoadedModel", "load_model", "validated_config"]

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A built model and what the engine needs to know about it."""

    model: nn.Module
    config: EngineConfig
    hf_config: Any
    registration: Registration
    host: PluginHost
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    eos_ids: frozenset[int]
    #: The source files of the model's code, to tell its failures from the engine's.
    code_files: frozenset[str]
    #: The logits processors plugins added (instantiated by the engine).
    logits_processors: list[RegisteredProcessor]
    #: The default ``SamplingParams`` fields of the model's ``generation_config.json`` (``generation_config="auto"``).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return self.registration.architecture

    @property
    def kv_cache_dtype(self) -> torch.dtype | None:
        """The KV cache's dtype when it is not the one the model's ``setup_caches`` gives it (``kv_cache_dtype``)."""
        wanted = self.config.kv_cache_dtype
        return None if wanted == "auto" else getattr(torch, wanted)

    @property
    def plugins(self) -> list[PluginRecord]:
        return self.host.records

    def describe(self) -> str:
        """The model's implementation and who registered it, for messages."""
        entry = self.registration
        return (
            f"{entry.implementation} (architecture {entry.architecture!r}, registered by "
            f"{entry.registered_by.describe()})"
        )


def validated_config(settings: dict[str, Any]) -> EngineConfig:
    """The ``EngineConfig`` of these settings, or one ``ConfigError`` saying what is wrong."""
    try:
        config = EngineConfig(**settings)
    except ValueError as exc:
        raise ConfigError(f"Invalid engine settings: {describe_validation_error(exc)}") from None
    check_combination(config)
    return config


def load_model(host: PluginHost, settings: dict[str, Any], *, agreement: Agreement | None = None) -> LoadedModel:
    """Build the model ``settings`` describe, with the plugins of ``host``.

    With tensor parallelism every rank calls this, with the ``agreement`` of its ranks:
    the ranks compare what they loaded before building, and each builds its shard.
    """
    config = validated_config(settings)
    ranks = agreement.ranks if agreement is not None else None
    host.ranks = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)  # what its hooks are told
    plan = plan_build(config, host)
    if config.tensor_parallel_size != (ranks.world_size if ranks is not None else 1):
        setter = config.provenance["tensor_parallel_size"]
        who = f"plugin {setter.removeprefix('plugin:')!r}'s" if setter.startswith("plugin:") else "the"
        raise ConfigError(
            f"tensor_parallel_size is {config.tensor_parallel_size} after {who} modify_config, but the engine "
            f"was started with {ranks.world_size if ranks is not None else 1} process(es): it is fixed before plugins "
            "load, so set it in the engine's settings, not in a plugin"
        )
    if agreement is not None:
        from pluginhost.engine.parallel import fingerprint

        agreement.reach("plan", fingerprint(config, plan, host))
    tokenizer = load_tokenizer(plan.model_dir)
    checkpoint = find_checkpoint(plan.model_dir, allow_external=config.allow_external_weights)
    model_class, device, dtype = settle_for_pre_load(plan, host, rank=ranks.rank if ranks is not None else None)

    model = _construct(model_class, plan.registration, plan.hf_config, dtype)
    # The whole model's size, before a rank keeps its share of it: the checkpoint's tensors are whole.
    whole = _numel(model)
    collectives = None
    if ranks is not None:
        from builtin_models.linear import packed_weights
        from builtin_models.tp import shard_model

        collectives = shard_model(model, ranks.rank, ranks.world_size)
        packed = packed_weights()
        if packed is not None:  # every rank here keeps its own packed copies: they share the budget
            packed.sharers = max(packed.sharers, ranks.on_this_machine)
    nonfinite: list[str] = []  # the checkpoint's tensors that are not finite, judged once the model has loaded
    weights = checkpoint.tensors(
        dtype=dtype,
        device=device,
        max_numel=whole,
        share=_numel(model) / whole if whole else 1.0,
        sharers=1 if ranks is None else ranks.on_this_machine,
        nonfinite=nonfinite,
    )
    loaded = _load_weights(model, weights, plan.registration, plan.hf_config)
    if ranks is not None:
        from builtin_models.tp import unshard_tied

        unshard_tied(model)
    _check_loaded(model, loaded, plan.model_dir)
    # Only what the model keeps counts: a stale buffer it skipped is no fault.
    report_nonfinite(model, nonfinite, dtype=dtype, refuse=config.refuse_nonfinite_weights)
    model.eval().requires_grad_(False)
    used = _used_settings(config, _USED_BEFORE_POST_LOAD)
    placed = _placement(model)
    host.call("post_load", config=config, model=model)
    _check_changes(config, used, "post_load", plan, host)
    _check_placement(model, placed, host)
    config.fix()
    if collectives is not None:
        from builtin_models.tp import keep_collectives

        keep_collectives(model, collectives)
    if agreement is not None:
        agreement.reach("built")
    logger.info(
        "built %s (%s) on %s as %s from %s",
        plan.architecture,
        plan.registration.implementation,
        device,
        dtype,
        plan.model_dir,
    )
    return LoadedModel(
        model=model,
        config=config,
        hf_config=plan.hf_config,
        registration=plan.registration,
        host=host,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        max_model_len=config.max_model_len,  # type: ignore[arg-type]  # settled above
        vocab_size=int(text_config(plan.hf_config).vocab_size),
        eos_ids=_eos_ids(plan.hf_config, tokenizer) | plan.generation_eos_ids,
        code_files=_code_files(model),
        logits_processors=plan.logits_processors,
        sampling_defaults=plan.sampling_defaults,
    )


class _Constructing(TorchFunctionMode):
    """While a model is constructed, in this thread only: tensors a factory would make in the
    default float dtype are made in the engine's dtype, and in-place changes of meta tensors
    (the weight initialisations, which the checkpoint replaces) are skipped.

    The same effect as ``torch.set_default_dtype`` plus switching ``torch.nn.init`` off, without
    touching process-wide state that other threads see (they may be creating tensors meanwhile).
    Skipping the initialisations also spares importing torch's meta decompositions (seconds).
    """

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.factories = _FACTORIES

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and args and isinstance(args[0], torch.Tensor):
            if args[0].is_meta:
                return args[0]
        result = func(*args, **kwargs)
        if (
            func in self.factories
            and kwargs.get("dtype") is None
            and isinstance(result, torch.Tensor)
            and result.dtype is torch.get_default_dtype()
            and result.dtype is not self.dtype
        ):
            result = result.to(self.dtype)
        return result


def settle_for_pre_load(
    plan: BuildPlan, host: PluginHost, *, rank: int | None = None
) -> tuple[type, torch.device, torch.dtype]:
    """Step 6 but the tokenizer and the weight files: the model class resolved, device and dtype decided and written
    into the config, then ``pre_load`` (its changes checked). ``pluginhost config`` stops here: the settings the
    engine runs with, but for what ``post_load`` changes with the model built."""
    config = plan.config
    model_class = plan.registry.resolve(plan.architecture)
    device = resolve_device(config.device)
    if rank is not None and device.type == "cuda":
        from pluginhost.engine.parallel import cuda_device_of

        device = cuda_device_of(rank)
    dtype = resolve_dtype(config.dtype, plan.hf_config, device)
    config.settle(device=str(device), dtype=dtype_name(dtype))
    used = _used_settings(config, _USED_BEFORE_PRE_LOAD)
    host.call("pre_load", config=config, model_class=model_class)
    _check_changes(config, used, "pre_load", plan, host)
    return model_class, device, dtype


def _factories() -> frozenset:
    try:
        from torch.utils._device import _device_constructors

        return frozenset(_device_constructors())
    except (ImportError, AttributeError):  # torch moved it: the common factories
        return frozenset({torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.tensor})


_FACTORIES = _factories()


def _construct(model_class: type, registration: Registration, hf_config: Any, dtype: torch.dtype) -> nn.Module:
    """Build the model on the meta device: no memory until its weights arrive."""
    try:
        with torch.device("meta"), _Constructing(dtype):
            return model_class(hf_config)
    except Exception as exc:
        raise ModelClassError(
            f"Constructing {registration.implementation}(config) for architecture {registration.architecture!r} "
            f"(registered by {registration.registered_by.describe()}) failed: {type(exc).__name__}: {exc}"
        ) from exc


def _load_weights(model: nn.Module, weights: Any, registration: Registration, hf_config: Any) -> object:  # noqa: ANN401
    """``model.load_weights(weights)``; a plugin's model failing there is named, as its constructor would be.

    A quantized checkpoint (``quantization_config`` in config.json: its scales are tensors no plain model has) that
    does not fit says so first: "unexpected tensors ... weight_scale" read as a damaged or mismatched checkpoint.
    """
    try:
        return model.load_weights(weights)
    except CheckpointError as exc:
        quantization = getattr(hf_config, "quantization_config", None)
        if not quantization:
            raise
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise CheckpointError(
            f"The checkpoint is quantized (config.json's quantization_config: quant_method {method!r}), and "
            f"{registration.implementation} loads unquantized weights only: use the model's unquantized checkpoint "
            "(the int8_quant sample plugin quantizes one as it loads), or a plugin whose model loads this format. "
            f"{exc}"
        ) from exc
    except PluginhostError:  # the checkpoint's or the weight checks' own message, which says what is wrong
        raise
    except Exception as exc:
        if registration.registered_by == builtin_ref():  # a builtin's failure is pluginhost's bug: reported as one
            raise
        raise ModelClassError(
            f"{registration.implementation}.load_weights for architecture {registration.architecture!r} "
            f"(registered by {registration.registered_by.describe()}) failed: {type(exc).__name__}: {exc}. "
            f"{registration.registered_by.remedy()}"
        ) from exc


#: Settings the build has acted on by the time ``pre_load`` runs: a plugin changing one there would leave the
#: engine as built and the config describing another (``modify_config`` is where they are set).
_USED_BEFORE_PRE_LOAD = (
    "model",
    "model_architecture_override",
    "model_impl",
    "hf_overrides",
    "dtype",
    "device",
    "tensor_parallel_size",
    "allow_external_weights",
)
#: And by the time ``post_load`` runs: the weights are read.
_USED_BEFORE_POST_LOAD = (*_USED_BEFORE_PRE_LOAD, "refuse_nonfinite_weights")


def _used_settings(config: EngineConfig, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: copy.deepcopy(getattr(config, name)) for name in names}  # hf_overrides may change in place


def _check_changes(config: EngineConfig, used: dict[str, Any], hook: str, plan: BuildPlan, host: PluginHost) -> None:
    """Refuse a change ``hook`` made to a setting already acted on; check the others again (``max_model_len``)."""
    hook_plugins = {ref.name: ref for ref in host.implementers(hook)}
    for name, value in used.items():
        if getattr(config, name) == value:
            continue
        plugin = hook_plugins.get(config.provenance[name].removeprefix("plugin:"))
        if plugin is None and len(hook_plugins) == 1:  # a dict changed in place: its provenance is as it was
            [plugin] = hook_plugins.values()
        who = plugin.describe() if plugin else f"one of {', '.join(hook_plugins)}"
        raise ConfigError(
            f"{who} changed {name} in {hook} ({value!r} -> {getattr(config, name)!r}), after the engine had acted "
            f"on it: the engine would be built as before, and its config would say otherwise. Set {name} in "
            f"modify_config, which runs before anything is resolved. {plugin.remedy() if plugin else ''}".rstrip()
        )
    try:
        check_combination(config, plan.hf_config)
    except ConfigError as exc:  # said to be the hook's doing, not the user's setting to lower
        set_here = {
            name: hook_plugins[source.removeprefix("plugin:")]
            for name, source in config.provenance.items()
            if source.removeprefix("plugin:") in hook_plugins
        }
        if not set_here:
            raise
        which = "; ".join(f"{name} was set by {ref.describe()} in {hook}" for name, ref in sorted(set_here.items()))
        raise ConfigError(f"{exc} ({which})") from None


#: The dtypes a model computes in: a tensor moved from one to another is a cast, not a quantizer's storage.
_COMPUTE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _placement(model: nn.Module) -> dict[str, tuple[torch.dtype, torch.device]]:
    """Each parameter's and buffer's dtype and device, by name."""
    return {name: (t.dtype, t.device) for name, t in (*model.named_parameters(), *model.named_buffers())}


def _check_placement(model: nn.Module, before: dict[str, tuple[torch.dtype, torch.device]], host: PluginHost) -> None:
    """Refuse a ``post_load`` that moved the model or changed the dtype it computes in (the hookspec's "must not").

    The engine, its KV cache and its config stay as built: a cast to float32 took twice the memory with
    ``dtype`` still saying bfloat16, one to bfloat16 changed the logprobs silently. A tensor kept under its
    name in another dtype models compute in (``_COMPUTE_DTYPES``), or on another device, is such a change;
    storing weights differently (a quantizer's int8 buffers in place of a weight, float8 weights beside
    their scales) is not.
    """
    for name, (dtype, device) in _placement(model).items():
        was = before.get(name)
        if was is None:
            continue
        changed = None
        if device != was[1]:
            changed = f"moved the model ({name}: {was[1]} -> {device})"
        elif dtype != was[0] and dtype in _COMPUTE_DTYPES and was[0] in _COMPUTE_DTYPES:
            changed = f"changed the dtype the model computes in ({name}: {was[0]} -> {dtype})"
        if changed is None:
            continue
        plugins = [ref for ref in host.implementers("post_load") if ref != builtin_ref()]
        who = plugins[0].describe() if len(plugins) == 1 else f"one of {', '.join(r.name for r in plugins)}"
        who = who if plugins else "a post_load implementation"
        remedy = f" {plugins[0].remedy()}" if len(plugins) == 1 else ""
        raise ConfigError(
            f"{who} {changed} in post_load: the engine was built for {was[0]} on {was[1]}, and its KV cache and "
            "config stay so. Set dtype and device instead (--dtype, --device); a post_load may store weights "
            f"differently, not move or cast the model.{remedy}"
        )


def _numel(model: nn.Module) -> int:
    """How many elements ``model``'s parameters and buffers hold (on the meta device: nothing allocated)."""
    return sum(t.numel() for t in (*model.parameters(), *model.buffers()))


def _check_loaded(model: nn.Module, loaded: object, model_dir: Path) -> None:
    if not isinstance(loaded, set | frozenset):
        raise ModelClassError(
            f"{type(model).__name__}.load_weights returned {type(loaded).__name__}; it must return the set of "
            "parameter names it loaded (see builtin_models.weights.assign_weights)."
        )
    check_all_loaded(model, loaded, str(model_dir))
    unset = sorted(name for name, b in model.named_buffers() if b.is_meta)
    if unset:
        raise ModelClassError(
            f"{type(model).__name__} left buffer(s) {', '.join(unset)} on the meta device: models are built on "
            "meta, so compute buffers in load_weights (or setup_caches), not in __init__."
        )


def _code_files(model: nn.Module) -> frozenset[str]:
    """The files of the code of the model's classes (and their bases), torch's own excluded, as tracebacks name them.

    Read from the code objects of the functions written in each class's body, not from the classes' modules: a
    class made in a notebook cell or by ``exec`` has no module file (or its ``__module__`` names another one,
    ``__main__``), and its failures were taken for the engine's own. A function set on the class from outside (a
    plugin's replaced method, transformers' patch of ``nn.Module``) is its author's code, not the model's.
    """
    torch_dir = os.path.dirname(torch.__file__)
    classes = {cls for module in model.modules() for cls in type(module).__mro__}
    files = set()
    for cls in classes:
        for attribute in vars(cls).values():
            if isinstance(attribute, property):
                attribute = attribute.fget
            function = inspect.unwrap(getattr(attribute, "__func__", attribute))  # staticmethod, classmethod
            code = getattr(function, "__code__", None)
            written_here = getattr(function, "__qualname__", "").startswith(f"{cls.__qualname__}.")
            if code is not None and written_here and not code.co_filename.startswith(torch_dir):
                files.add(code.co_filename)
    return frozenset(files)


def _eos_ids(hf_config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for config in {id(c): c for c in (hf_config, text_config(hf_config))}.values():  # a multimodal one's, and its LM's
        eos = getattr(config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list | tuple) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
