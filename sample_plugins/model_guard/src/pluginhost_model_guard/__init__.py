"""pluginhost-model-guard: refuse what a site does not run, and check what it loads.

* ``pre_load``: refuses architectures or classes named in
  ``PLUGINHOST_GUARD_DENY`` (comma-separated), before any memory is allocated:
  the checkpoint's architecture (``config.json``), an override of it, and the
  class that implements it, whichever plugin registered that class.
* ``post_load``: refuses a model with NaN or infinite weights (a corrupt or
  badly converted checkpoint), and logs its parameter count and memory, weights
  another plugin keeps in buffers included (``int8_quant``'s).
  The report is also kept on the model as ``model.guard_report``.
"""

import json
import logging
import os
from pathlib import Path

from pluginhost import hookimpl

__all__ = ["denied", "post_load", "pre_load"]

logger = logging.getLogger(__name__)


def denied() -> set[str]:
    return {name.strip() for name in os.environ.get("PLUGINHOST_GUARD_DENY", "").split(",") if name.strip()}


def _architectures(config) -> list[str]:
    """The architectures the engine resolved from: ``hf_overrides``' if it names them, else ``config.json``'s (read
    from the directory as the engine found it: ``~`` expanded)."""
    architectures = config.hf_overrides.get("architectures")
    if architectures is None:
        try:
            path = Path(config.model).expanduser() / "config.json"
            architectures = json.loads(path.read_text(encoding="utf-8")).get("architectures")
        except (OSError, ValueError, AttributeError):
            return []
    return [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else []


@hookimpl
def pre_load(config, model_class):
    # The class alone is not enough: another plugin may serve a denied architecture with a class of its own.
    names = {model_class.__name__, config.model_architecture_override, *_architectures(config)}
    refused = (names - {None}) & denied()
    if refused:
        raise PermissionError(
            f"{', '.join(sorted(refused))} is denied on this site (PLUGINHOST_GUARD_DENY); ask the operator"
        )


@hookimpl
def post_load(config, model):
    import torch

    parameters = 0
    nbytes = 0
    bad = []
    seen = set()
    # Weights a plugin keeps in buffers (int8_quant's qweight and scales) count too: every tensor the
    # model saves, each once (a tied head is the embedding).
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        parameters += tensor.numel()
        nbytes += tensor.numel() * tensor.element_size()
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad.append(name)
    if bad:
        raise ValueError(f"the checkpoint has NaN or infinite values in {', '.join(bad[:5])}")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    model.guard_report = {"parameters": parameters, "bytes": nbytes, "dtype": str(dtype)}
    logger.info("%s: %.2fM parameters, %.1f MiB", type(model).__name__, parameters / 1e6, nbytes / 2**20)
