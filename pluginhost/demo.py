"""The demo model ``pluginhost generate`` uses when no ``--model`` is given.

A small OPT (4 layers, hidden size 128, about 0.9M parameters) with a byte-level
tokenizer, created on first use in ``$PLUGINHOST_CACHE_DIR`` (default
``$XDG_CACHE_HOME/pluginhost``, else ``~/.cache/pluginhost``). It needs no
network. Its weights are random, drawn from a fixed seed, so its output is the
same on every machine and means nothing: it exercises the whole pipeline
(plugins, registry, loading, generation) and nothing more.

The directory is written to a temporary sibling and renamed into place, so an
interrupted first run never leaves a half-written demo model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["DEMO_CONFIG", "demo_model_path", "ensure_demo_model"]

#: Bump when the demo's contents change, so old caches are not reused.
DEMO_VERSION = 1
DEMO_SEED = 1234
DEMO_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "ffn_dim": 512,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "word_embed_proj_dim": 128,
    "do_layer_norm_before": True,
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "dtype": "float32",
}


def demo_model_path() -> Path:
    root = (
        os.environ.get("PLUGINHOST_CACHE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pluginhost"
    )
    return Path(root) / f"demo-opt-v{DEMO_VERSION}"


def ensure_demo_model() -> Path:
    """The demo model directory, created first if it does not exist yet."""
    path = demo_model_path()
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=path.parent))
    try:
        _write_demo(staging)
        try:
            staging.rename(path)
        except OSError:  # another process finished first
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _write_demo(path: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import OPTConfig

    from builtin_models.opt import OPTForCausalLM
    from pluginhost.testing.models import make_byte_tokenizer

    make_byte_tokenizer(path, vocab_size=DEMO_CONFIG["vocab_size"])
    # The byte-level BPE learns fewer merges than asked from its small text:
    # size the vocabulary to the tokenizer, so every id the model emits decodes.
    vocab = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    config = OPTConfig(**{**DEMO_CONFIG, "vocab_size": len(vocab)})
    config.save_pretrained(path)
    with torch.device("meta"):
        names = [(name, p.shape) for name, p in OPTForCausalLM(config).named_parameters()]
    generator = torch.Generator().manual_seed(DEMO_SEED)
    tensors = {}
    for name, shape in names:
        if name == "lm_head.weight":
            continue  # tied to the embeddings
        if "layer_norm" in name:
            base = 1.0 if name.endswith("weight") else 0.0
            tensors[f"model.{name}"] = base + 0.1 * torch.randn(shape, generator=generator)
        else:
            tensors[f"model.{name}"] = 0.08 * torch.randn(shape, generator=generator)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
