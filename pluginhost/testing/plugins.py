"""Small in-process plugins for tests."""

from __future__ import annotations

from hookspecs import hookimpl

__all__ = ["RegistersModel"]


class RegistersModel:
    """A plugin whose ``register_models`` registers one architecture.

    ``LLM(path, plugins=[RegistersModel("OPTForCausalLM", MyOPT)])`` builds ``MyOPT``
    for every OPT checkpoint; ``model`` may be a class or a ``"module:Class"`` string.
    Its plugin name is ``RegistersModel`` (``#2``, ``#3``... for further instances).
    """

    def __init__(self, architecture: str, model: type | str) -> None:
        self.architecture, self.model = architecture, model

    @hookimpl
    def register_models(self, registry) -> None:  # noqa: ANN001 - the hook's argument
        registry.register_model(self.architecture, self.model)
