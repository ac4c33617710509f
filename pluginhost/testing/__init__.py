"""Helpers for testing pluginhost and plugins.

Tiny offline models and tokenizers (``models``), a plugin registering one
model (``plugins``), a server run on 127.0.0.1 for a test (``server``), and
the pytest fixtures every test session gets (``pytest_plugin``: ``make_engine``,
``make_host``, ``hook_recorder``, ``model_registry``, ``tiny_opt_dir``).
"""

from pluginhost.testing.models import make_byte_tokenizer, make_tiny_model, make_tiny_opt
from pluginhost.testing.plugins import RegistersModel

__all__ = ["RegistersModel", "make_byte_tokenizer", "make_tiny_model", "make_tiny_opt"]
