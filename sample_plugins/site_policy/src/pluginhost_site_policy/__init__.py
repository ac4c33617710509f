"""pluginhost-site-policy: an operator's limits, applied to every engine on the machine.

``modify_config`` enforces, from the environment:

* ``PLUGINHOST_SITE_MAX_NUM_SEQS`` (default 8): the most sequences decoded
  together, which bounds KV-cache memory;
* ``PLUGINHOST_SITE_MAX_MODEL_LEN`` (unset: no cap): an upper bound on
  ``max_model_len``: a length asked for above it is lowered to it; none asked
  for is the model's own, lowered to the cap in ``pre_load`` (once the engine
  has read the model's positions: a cap above them never raises it);
* ``PLUGINHOST_SITE_DTYPE`` (unset: leave it): force this parameter dtype.

``pluginhost config`` shows each field it changed as ``plugin:site_policy``.
A malformed variable stops the engine with a message naming it.
"""

import os

from pluginhost import hookimpl

__all__ = ["DEFAULT_MAX_NUM_SEQS", "modify_config", "pre_load"]

DEFAULT_MAX_NUM_SEQS = 8


def _positive_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:  # isdigit alone takes "²", which int() does not
        raise ValueError(f"{name}={raw!r} must be a positive integer")
    return int(raw)


@hookimpl
def modify_config(config):
    max_num_seqs = _positive_int("PLUGINHOST_SITE_MAX_NUM_SEQS", DEFAULT_MAX_NUM_SEQS)
    if config.max_num_seqs > max_num_seqs:
        config.max_num_seqs = max_num_seqs
    max_model_len = _positive_int("PLUGINHOST_SITE_MAX_MODEL_LEN", None)
    if max_model_len is not None and config.max_model_len is not None and config.max_model_len > max_model_len:
        config.max_model_len = max_model_len
    dtype = os.environ.get("PLUGINHOST_SITE_DTYPE", "").strip()
    if dtype and config.dtype != dtype:
        try:
            config.dtype = dtype  # validated by EngineConfig
        except ValueError as exc:  # the error names this plugin; say which variable held the value
            from pluginhost.config import describe_validation_error

            raise ValueError(f"PLUGINHOST_SITE_DTYPE={dtype!r}: {describe_validation_error(exc)}") from None


@hookimpl
def pre_load(config):
    # The model's own length, settled by now: capped here, so a cap above a small model's positions leaves it be.
    max_model_len = _positive_int("PLUGINHOST_SITE_MAX_MODEL_LEN", None)
    if max_model_len is not None and config.max_model_len > max_model_len:
        config.max_model_len = max_model_len
