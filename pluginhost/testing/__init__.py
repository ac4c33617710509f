"""Helpers for testing pluginhost and plugins: tiny offline models and tokenizers."""

from pluginhost.testing.models import make_byte_tokenizer, make_tiny_model, make_tiny_opt
from pluginhost.testing.plugins import RegistersModel

__all__ = ["RegistersModel", "make_byte_tokenizer", "make_tiny_model", "make_tiny_opt"]
