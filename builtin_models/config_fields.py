"""Which keys of config.json a model reads: those its transformers config class really has.

A Hugging Face config keeps any key of config.json as an attribute, and a stale one (a Mistral-derived
checkpoint relabelled as Llama keeping its ``sliding_window``, a Mistral config carrying Llama's
``attention_bias``) is ignored by transformers' model of a class that has no such field. The builtin
models ignore it too, with a warning, rather than window attention or expect biases the checkpoint
does not hold.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

__all__ = ["declared_field"]

logger = logging.getLogger(__name__)


def declared_field(config: Any, name: str) -> Any:
    """The config's ``name``, unless transformers' config class has no such field; then ``None`` (warned).

    A class has the field when it declares it, maps a key of its own to it, or sets it itself (ModernBERT's
    decoder derives its ``sliding_window``); a class that is not transformers' own (a plugin's) is trusted.
    """
    value = getattr(config, name, None)
    cls = type(config)
    if value is None or not cls.__module__.startswith("transformers.") or _has_field(cls, name):
        return value
    logger.warning(
        "config.json sets %s=%r, which %s does not have: ignored, as transformers ignores it.",
        name,
        value,
        cls.__name__,
    )
    return None


def _has_field(cls: type, name: str) -> bool:
    if name in inspect.signature(cls.__init__).parameters or name in getattr(cls, "attribute_map", {}):
        return True
    if any(name in getattr(klass, "__annotations__", {}) for klass in cls.__mro__):
        return True
    try:
        return hasattr(cls(), name)  # set by the class itself, from another field
    except Exception:  # noqa: BLE001 - a class that needs arguments: trust the key, as before
        return True
