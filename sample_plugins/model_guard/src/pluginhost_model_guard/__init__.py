"""pluginhost-model-guard: refuse what a site does not run, and check what it loads.

* ``pre_load``: refuses architectures or classes named in
  ``PLUGINHOST_GUARD_DENY`` (comma-separated), before any memory is allocated.
* ``post_load``: refuses a model with NaN or infinite parameters (a corrupt or
  badly converted checkpoint), and logs its parameter count and memory.
  The report is also kept on the model as ``model.guard_report``.
"""

import logging
import os

from pluginhost import hookimpl

__all__ = ["denied", "post_load", "pre_load"]

logger = logging.getLogger(__name__)


def denied() -> set[str]:
    return {name.strip() for name in os.environ.get("PLUGINHOST_GUARD_DENY", "").split(",") if name.strip()}


@hookimpl
def pre_load(config, model_class):
    names = {model_class.__name__, config.model_architecture_override} - {None}
    refused = names & denied()
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
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        parameters += param.numel()
        nbytes += param.numel() * param.element_size()
        if param.is_floating_point() and not bool(torch.isfinite(param).all()):
            bad.append(name)
    if bad:
        raise ValueError(f"the checkpoint has NaN or infinite values in {', '.join(bad[:5])}")
    model.guard_report = {"parameters": parameters, "bytes": nbytes, "dtype": str(next(model.parameters()).dtype)}
    logger.info("%s: %.2fM parameters, %.1f MiB", type(model).__name__, parameters / 1e6, nbytes / 2**20)
