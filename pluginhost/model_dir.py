"""Checking a Hugging Face-format model directory and reading its ``config.json``.

Only data is read: ``trust_remote_code`` is never set, so no code from a model
directory ever runs, and nothing is ever written into it. Before anything is
read, the directory is checked: an entry that is not a regular file or folder
(a FIFO, a socket, a device: reading one can hang forever) and a JSON file
larger than any real one of its kind are refused. The config's sizes are
checked before anything is built from them, so a config cannot make the
engine build something absurd (ten million layers) or fail obscurely (a
vocabulary of ``"300"``, zero heads).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pluginhost.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "JSON_SIZE_LIMITS",
    "apply_overrides",
    "check_model_config",
    "generation_defaults",
    "generation_eos_ids",
    "load_hf_config",
    "model_directory",
    "read_config_json",
    "read_generation_config",
    "read_json",
    "text_config",
]

logger = logging.getLogger(__name__)

_MiB = 2**20
#: The largest JSON file of each kind read from a model directory (tokenizers of the largest
#: vocabularies are tens of MiB; configs a few KiB).
JSON_SIZE_LIMITS = {
    "config.json": 16 * _MiB,
    "generation_config.json": 16 * _MiB,
    "tokenizer_config.json": 16 * _MiB,
    "special_tokens_map.json": 16 * _MiB,
    "model.safetensors.index.json": 64 * _MiB,
    "pytorch_model.bin.index.json": 64 * _MiB,
    "tokenizer.json": 512 * _MiB,
    "vocab.json": 512 * _MiB,
}


def model_directory(model: str | os.PathLike[str]) -> Path:
    """The model directory as a path, checked (see the module docstring); a ``ConfigError`` says what is wrong."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(
            f"Model directory {str(model)!r} does not exist. Pass the path of a directory holding config.json "
            "and weights (for example a downloaded facebook/opt-125m)."
        )
    if not path.is_dir():
        raise ConfigError(f"Model path {str(model)!r} is a file; pass the directory that holds config.json.")
    try:
        entries = list(path.iterdir())
    except OSError as exc:
        raise ConfigError(f"Cannot list model directory {path}: {exc.strerror or exc}.") from None
    for entry in entries:
        try:
            mode = entry.stat().st_mode  # follows symlinks: a link to a FIFO is one too
        except OSError:
            continue  # a dangling link: reported by whatever needs the file
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ConfigError(
                f"{entry} is not a regular file (a FIFO, socket or device): reading it could hang. "
                "Remove it from the model directory."
            )
        limit = JSON_SIZE_LIMITS.get(entry.name)
        if limit is not None and entry.stat().st_size > limit:
            raise ConfigError(
                f"{entry} is {entry.stat().st_size / _MiB:.0f} MiB; a real {entry.name} is far smaller "
                f"(at most {limit // _MiB} MiB is read). Is it the right file?"
            )
    return path


def read_json(path: Path) -> Any:
    """The parsed JSON of ``path`` (within its size limit); one clear ``ConfigError`` for any problem."""
    limit = JSON_SIZE_LIMITS.get(path.name, 16 * _MiB)
    try:
        if path.stat().st_size > limit:
            raise ConfigError(f"{path} is larger than the {limit // _MiB} MiB read for a {path.name}.")
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"Cannot read {path}: {exc}.") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}.") from None
    except RecursionError:
        raise ConfigError(f"{path} nests its JSON too deeply to be a real {path.name}.") from None


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of the model directory, checked to be a JSON object."""
    path = model_dir / "config.json"
    if not path.is_file():
        if path.is_symlink() and not path.exists():
            what = "a broken symbolic link (or a loop of them)"
        elif path.exists():
            what = "a directory" if path.is_dir() else "not a regular file"
        else:
            what = "missing"
        hint = ""
        if (model_dir / "snapshots").is_dir() and (model_dir / "blobs").is_dir():
            hint = f" {model_dir} is a Hugging Face cache's folder of a model: pass one of its snapshots/<revision>."
        raise ConfigError(f"{path} is {what}: a model directory needs a Hugging Face config.json file.{hint}")
    data = read_json(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(data).__name__}.")
    return data


def read_generation_config(model_dir: Path) -> dict[str, Any]:
    """The directory's ``generation_config.json`` (empty without one, or for one holding no JSON object)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    data = read_json(path)
    return data if isinstance(data, dict) else {}


def generation_eos_ids(model_dir: Path, data: dict[str, Any]) -> frozenset[int]:
    """The end-of-sequence ids of the directory's ``generation_config.json`` (``data``; none without one).

    Chat models often list their end-of-turn ids only there (Llama 3's
    ``<|eot_id|>`` beside ``<|end_of_text|>``); transformers' ``generate`` and
    vLLM stop at every one of them, and so does the engine.
    """
    path = model_dir / "generation_config.json"
    eos = data.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(
            f"{path}: eos_token_id must be a token id or a list of token ids, not {eos!r}. Fix or remove the file."
        )
    return frozenset(ids)


#: The sampling fields of ``generation_config.json`` that become the default ``SamplingParams`` (vLLM's
#: ``generation_config="auto"``), with transformers' own defaults, which a file repeating them does not change.
_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def generation_defaults(model_dir: Path, data: dict[str, Any]) -> dict[str, Any]:
    """The default ``SamplingParams`` fields the directory's ``generation_config.json`` (``data``) recommends (vLLM's
    rule).

    ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` where they differ from transformers'
    defaults, and ``max_new_tokens`` as ``max_tokens``; checked as ``SamplingParams`` checks them.
    """
    path = model_dir / "generation_config.json"
    defaults = {k: data[k] for k, neutral in _SAMPLING_DEFAULTS.items() if data.get(k) not in (None, neutral)}
    if data.get("max_new_tokens") is not None:
        defaults["max_tokens"] = data["max_new_tokens"]
    from pluginhost.sampling import SamplingParams

    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ConfigError(
            f"{path} recommends sampling defaults SamplingParams refuses ({exc}). Fix the file, or leave its "
            "defaults out: generation_config='vllm' (--generation-config vllm)."
        ) from None
    return defaults


def load_hf_config(model_dir: Path, overrides: dict[str, Any] | None = None) -> PretrainedConfig:
    """The directory's config as a transformers ``PretrainedConfig``, from one read of ``config.json``.

    Known ``model_type`` values get their transformers config class (as
    ``AutoConfig`` would pick; no remote code, nothing online); unknown ones,
    which plugins may well bring, become a generic ``PretrainedConfig``
    holding every key. ``overrides`` (``hf_overrides``, applied afterwards by ``apply_overrides``) count in
    the sizes checked before transformers reads the file.
    """
    data = read_config_json(model_dir)
    _refuse_oversized({**data, **(overrides or {})})
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.get("model_type")
    if model_type == "mistral" and "layer_types" in data and "ministral" in CONFIG_MAPPING:
        model_type = "ministral"  # AutoConfig's own rule: alternating windows per layer, as transformers builds it
    try:
        if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
            config = CONFIG_MAPPING[model_type].from_dict(data)
        else:
            logger.info("model_type %r is unknown to transformers; using a generic config", model_type)
            config = PretrainedConfig.from_dict(data)
        config.name_or_path = str(model_dir)  # as from_pretrained records it
        return config
    except Exception as exc:  # noqa: BLE001 - transformers' configs validate their fields with many error types
        detail = " ".join(str(exc).split())
        raise ConfigError(
            f"{model_dir / 'config.json'} cannot be used as a config of model type {model_type!r}: {detail}"
        ) from None


#: Config sizes and their largest sane value: far above any real model, far below what would exhaust the machine.
SIZE_LIMITS = {
    "num_hidden_layers": 4096,
    "n_layer": 4096,
    "hidden_size": 2**17,
    "n_embd": 2**17,
    "intermediate_size": 2**20,
    "ffn_dim": 2**20,
    "n_inner": 2**20,
    "num_attention_heads": 2**12,
    "n_head": 2**12,
    "num_key_value_heads": 2**12,
    "head_dim": 2**12,
    "vocab_size": 2**24,
    "max_position_embeddings": 2**24,
    "n_positions": 2**24,
    "word_embed_proj_dim": 2**17,
}


def _refuse_oversized(data: dict[str, Any]) -> None:
    """Refuse sizes past ``SIZE_LIMITS`` in config.json itself, before transformers reads it.

    Some config classes build per-layer lists as they are read (Qwen2's ``layer_types``): 10**10
    layers never came back. ``data`` holds the ``hf_overrides`` too, which may mend a size. Only what is
    too large: what is merely wrong waits for ``check_model_config``.
    """
    nested = data.get("text_config")
    for section in (data, nested if isinstance(nested, dict) else {}):
        for name, limit in SIZE_LIMITS.items():
            value = section.get(name)
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, int) and not isinstance(v, bool) and v > limit for v in values):
                raise _unbuildable([f"{name} is {value}, outside 1..{limit}"])


def text_config(hf_config: Any) -> Any:  # noqa: ANN401 - a transformers config, or a plugin's
    """The language model's config: a multimodal checkpoint's ``text_config`` (Gemma 3's
    ``*ForConditionalGeneration``), which holds the sizes (vocabulary, positions, end-of-sequence); else itself."""
    get = getattr(hf_config, "get_text_config", None)
    if get is None:
        return hf_config
    try:
        return get(decoder=True)
    except Exception:  # noqa: BLE001 - a config class of a plugin's that does not follow transformers'
        return hf_config


def check_model_config(hf_config: PretrainedConfig) -> None:
    """Refuse sizes no model has (wrong types, zero or negative, absurdly large) before anything is built.

    The language model's sizes (``text_config``'s in a multimodal checkpoint); a size given per layer (Gemma 3n's
    ``intermediate_size``) is checked layer by layer.
    """
    problems = []
    config = text_config(hf_config)
    for name, limit in SIZE_LIMITS.items():
        try:
            value = getattr(config, name, None)
        except Exception:  # noqa: BLE001 - transformers refuses to read some per-layer sizes globally (Gemma 4)
            continue
        if value is None and name in ("n_inner", "head_dim", "num_key_value_heads"):
            continue  # optional: derived from the others
        if value is None:
            continue
        values = value if isinstance(value, list | tuple) and value else [value]
        for item in values:
            if not isinstance(item, int) or isinstance(item, bool):
                each = " for each layer" if values is value else ""
                problems.append(f"{name} is {value!r}, not a whole number{each}")
                break
            if not 0 < item <= limit:
                problems.append(f"{name} is {value}, outside 1..{limit}")
                break
    if problems:
        raise _unbuildable(problems)


def _unbuildable(problems: list[str]) -> ConfigError:
    """The error for config sizes no model has (``problems``: what is wrong with each)."""
    return ConfigError(
        f"The model config does not describe a model that can be built: {'; '.join(problems)}. "
        "Fix config.json (or --hf-overrides)."
    )


#: RoPE fields config.json may give beside the RoPE dict, which transformers 5 moves into ``rope_parameters`` when
#: it reads the file, and reads from there only.
_ROPE_FIELDS = ("rope_theta", "partial_rotary_factor")


def _with_rope_theta(value: Any, hf_config: PretrainedConfig) -> Any:
    """A flat RoPE dict given without ``rope_theta`` (or ``partial_rotary_factor``), with the config's (left as it
    is when there is none)."""
    if not isinstance(value, dict) or not ({"rope_type", "type"} & value.keys()):
        return value  # not a flat RoPE dict (a per-layer-type one, say): transformers' to judge
    current = getattr(hf_config, "rope_parameters", None)
    kept = {}
    for field in _ROPE_FIELDS:
        setting = current.get(field) if isinstance(current, dict) else None
        setting = setting if setting is not None else getattr(hf_config, field, None)
        if field not in value and setting is not None:
            kept[field] = setting
    return {**value, **kept}


def _into_rope_parameters(hf_config: PretrainedConfig, field: str, value: Any) -> bool:
    """Set RoPE field ``field`` (``_ROPE_FIELDS``) where transformers reads it, in ``rope_parameters``; False when
    the config has no RoPE dict (a model that reads it itself).

    RoPE parameters per layer type (Gemma 3's full and sliding layers) are refused: transformers gives such a
    field in config.json to some types only, by rules of each config class.
    """
    current = getattr(hf_config, "rope_parameters", None)
    if not isinstance(current, dict):
        return False
    per_type = sorted(name for name, params in current.items() if isinstance(params, dict))
    if per_type:
        raise ConfigError(
            f"hf_overrides sets {field}, but {type(hf_config).__name__}'s RoPE parameters are per layer type "
            f"({', '.join(per_type)}), and which of them it applies to is the config class's rule. Give each "
            f'type\'s instead: --hf-overrides \'{{"rope_parameters": {{"{per_type[0]}": {{..., "{field}": ...}}, '
            "...}}'."
        )
    hf_config.rope_parameters = {**copy.deepcopy(current), field: value}
    return True


def apply_overrides(hf_config: PretrainedConfig, overrides: dict[str, Any], architecture: str | None) -> None:
    """Apply ``hf_overrides`` and the architecture override to ``hf_config`` in place.

    Each value is copied first (transformers completes some dicts in place; the user's stay as given). A
    RoPE dict without ``rope_theta`` keeps the config's, as transformers does reading one from config.json:
    ``{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, ...}}``, vLLM's usual override, changes the
    scaling, not the base frequency. A ``rope_theta`` (or ``partial_rotary_factor``) given beside goes into
    the RoPE dict, where transformers 5 reads it (as vLLM moves it), in whichever order the two are given.
    """
    for key, given in overrides.items():
        value = copy.deepcopy(given)
        if key in ("rope_scaling", "rope_parameters"):
            value = _with_rope_theta(value, hf_config)
        moved = key in _ROPE_FIELDS and _into_rope_parameters(hf_config, key, value)
        if not moved and not hasattr(hf_config, key):
            logger.warning(
                "hf_overrides sets %r, which %s does not define: it is added for the model to read (a plugin's "
                "model may); if it is a misspelt name, it changes nothing",
                key,
                type(hf_config).__name__,
            )
        try:
            setattr(hf_config, key, value)
        except Exception as exc:  # noqa: BLE001 - transformers' typed configs raise their validators' own errors
            raise ConfigError(
                f"The model config does not describe a model that can be built: hf_overrides sets {key} to "
                f"{given!r}, which {type(hf_config).__name__} refuses ({str(exc).splitlines()[-1].strip()}). "
                "Fix the value in hf_overrides (--hf-overrides)."
            ) from None
    if architecture is not None:
        hf_config.architectures = [architecture]
    architectures = getattr(hf_config, "architectures", None)
    overridden = "architectures" in overrides
    source, source_of = ("hf_overrides", "hf_overrides'") if overridden else ("config.json", "config.json's")
    if not architectures:
        raise ConfigError(
            f"{source} names no architecture ('architectures' is missing or empty). "
            "Pass model_architecture_override (--model-architecture-override) with a registered architecture."
        )
    if not isinstance(architectures, list) or not all(isinstance(a, str) and a for a in architectures):
        raise ConfigError(
            f"{source_of} 'architectures' must be a list of class names such as [\"OPTForCausalLM\"], "
            f"got {architectures!r}."
        )
    check_model_config(hf_config)
