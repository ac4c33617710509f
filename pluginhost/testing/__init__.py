"""Helpers for testing pluginhost and plugins: tiny offline models and tokenizers."""

from pluginhost.testing.models import make_byte_tokenizer, make_tiny_opt

__all__ = ["make_byte_tokenizer", "make_tiny_opt"]
