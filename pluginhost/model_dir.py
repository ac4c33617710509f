"""Reading a Hugging Face-format model directory's ``config.json``.

Only data is read: ``trust_remote_code`` is never set, so no code from a model
directory ever runs, and nothing is ever written into it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pluginhost.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["apply_overrides", "load_hf_config", "model_directory", "read_config_json"]

logger = logging.getLogger(__name__)


def model_directory(model: str) -> Path:
    """The model directory as a path; an error if it is not an existing directory."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(
            f"Model directory {model!r} does not exist. Pass the path of a directory holding config.json "
            "and weights (for example a downloaded facebook/opt-125m)."
        )
    if not path.is_dir():
        raise ConfigError(f"Model path {model!r} is a file; pass the directory that holds config.json.")
    return path


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of the model directory, checked to be a JSON object."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} is missing: a model directory needs a Hugging Face config.json.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"Cannot read {path}: {exc}.") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(data).__name__}.")
    return data


def load_hf_config(model_dir: Path) -> PretrainedConfig:
    """The directory's config as a transformers ``PretrainedConfig``, from one read of ``config.json``.

    Known ``model_type`` values get their transformers config class (as
    ``AutoConfig`` would pick; no remote code, nothing online); unknown ones,
    which plugins may well bring, become a generic ``PretrainedConfig``
    holding every key.
    """
    data = read_config_json(model_dir)
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.get("model_type")
    try:
        if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
            config = CONFIG_MAPPING[model_type].from_dict(data)
        else:
            logger.info("model_type %r is unknown to transformers; using a generic config", model_type)
            config = PretrainedConfig.from_dict(data)
        config.name_or_path = str(model_dir)  # as from_pretrained records it
        return config
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigError(f"{model_dir / 'config.json'} cannot be used as a {model_type} config: {exc}") from None


def apply_overrides(hf_config: PretrainedConfig, overrides: dict[str, Any], architecture: str | None) -> None:
    """Apply ``hf_overrides`` and the architecture override to ``hf_config`` in place."""
    for key, value in overrides.items():
        if not hasattr(hf_config, key):
            logger.warning("hf_overrides sets %r, which %s does not define", key, type(hf_config).__name__)
        setattr(hf_config, key, value)
    if architecture is not None:
        hf_config.architectures = [architecture]
    if not getattr(hf_config, "architectures", None):
        raise ConfigError(
            "config.json names no architecture ('architectures' is missing or empty). "
            "Pass model_architecture_override (--model-architecture-override) with a registered architecture."
        )
