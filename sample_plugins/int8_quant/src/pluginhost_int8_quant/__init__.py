"""pluginhost-int8-quant: weight-only int8 quantization of every linear layer, in ``post_load``.

Installed, it acts on every engine built in that environment; in-process, on
the engines given it (``LLM(path, plugins=[pluginhost_int8_quant])``). Each
``torch.nn.Linear`` (pluginhost's ``builtin_models.linear.Linear`` included)
becomes an :class:`~pluginhost_int8_quant.int8_linear.Int8Linear`: int8
weights, one bfloat16 scale per output channel, the bias as it was.

Environment:

* ``PLUGINHOST_INT8`` (default on): ``0``/``false``/``no``/``off`` leaves the
  model as loaded, with a log line;
* ``PLUGINHOST_INT8_SKIP`` (default empty: quantize everything, the LM head
  included): comma-separated ``fnmatch`` patterns of module names to keep in
  float, e.g. ``lm_head`` or ``decoder.layers.0.*``;
* ``PLUGINHOST_INT8_KERNEL``: force one kernel (``int8pack``, ``dequant_bf16``,
  ``dequant``) instead of measuring which is fastest.

A model on a device other than CPU or CUDA, or with weights that are not
float32, bfloat16 or float16, is refused: ``post_load`` raises, and the
engine build stops with an error naming this plugin and the way out
(``PLUGINHOST_INT8=0``). What was done is logged and kept as
``model.int8_report``.
"""

from __future__ import annotations

import ctypes
import logging
import os

from pluginhost import hookimpl

__all__ = ["ENABLE_ENV", "SKIP_ENV", "enabled", "post_load", "skip_patterns"]

logger = logging.getLogger(__name__)

ENABLE_ENV = "PLUGINHOST_INT8"
SKIP_ENV = "PLUGINHOST_INT8_SKIP"

_ON = {"", "1", "true", "yes", "on"}
_OFF = {"0", "false", "no", "off"}


def enabled() -> bool:
    """Whether ``PLUGINHOST_INT8`` lets the plugin act (unset: yes)."""
    raw = os.environ.get(ENABLE_ENV, "").strip().lower()
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise ValueError(f"{ENABLE_ENV}={raw!r} must be 1 or 0 (true/false, yes/no, on/off)")


def skip_patterns() -> list[str]:
    """The module-name patterns ``PLUGINHOST_INT8_SKIP`` keeps in float."""
    return [p.strip() for p in os.environ.get(SKIP_ENV, "").split(",") if p.strip()]


@hookimpl
def post_load(config, model):
    if not enabled():
        logger.info("int8_quant: off (%s=%s); the model stays as loaded", ENABLE_ENV, os.environ[ENABLE_ENV])
        return
    from pluginhost_int8_quant.int8_linear import configure_kernels, quantize_model

    configure_kernels()  # a malformed PLUGINHOST_INT8_KERNEL stops the build here, not the first request
    report = quantize_model(model, skip=skip_patterns())
    model.int8_report = report
    if not report.quantized:
        logger.warning("int8_quant: %s has no linear layer to quantize; nothing changed", type(model).__name__)
        return
    logger.info("int8_quant: %s", report.summary())
    if next(model.parameters()).device.type == "cpu":
        _give_back_freed_memory()


def _give_back_freed_memory() -> None:
    """Hand the float weights just freed back to the system: glibc's malloc keeps them otherwise, and the int8
    engine's process stayed larger than the float one's."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass
