"""Tiny OPT model directories built offline, the way a real checkpoint is laid out.

``make_tiny_opt`` uses transformers itself (``OPTConfig`` + ``save_pretrained``),
so tests compare pluginhost with exactly what transformers writes and reads.
``make_byte_tokenizer`` trains a small byte-level BPE with the ``tokenizers``
package on a fixed text, deterministically, with OPT's special tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TINY_OPT", "byte_fallback_tokenizer", "make_byte_tokenizer", "make_tiny_model", "make_tiny_opt"]

#: A pre-LayerNorm OPT (like opt-125m), small enough for a test to build in a second.
TINY_OPT: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "ffn_dim": 64,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "word_embed_proj_dim": 32,
    "do_layer_norm_before": True,
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 2,
    # Ten times transformers' default: peaked distributions, so a numerical
    # slip (a wrong scale, a misplaced LayerNorm) moves log-probabilities visibly.
    "init_std": 0.2,
}

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Plugins extend the engine through hooks. "
    "Hello world! A model registry maps architectures to classes; the builtin OPT loads "
    "Hugging Face checkpoints and generates text on the CPU or a GPU. 0123456789"
)


def make_byte_tokenizer(path: Path | str, vocab_size: int = 320) -> Path:
    """Save a byte-level BPE tokenizer (OPT's specials: <s>=0 <pad>=1 </s>=2 <unk>=3) into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer)
    # OPT prefixes every prompt with </s> (its BOS).
    tokenizer.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 2)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="</s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(path)
    return path


def byte_fallback_tokenizer():  # noqa: ANN201 - a transformers tokenizer, imported only when called
    """A SentencePiece-style tokenizer with byte fallback (Llama 2's, Mistral's), 262 tokens, built in memory.

    Spaces are drawn ``▁`` and begin a word's piece (``▁snow``, ``▁a``), the decoder drops the space that
    begins a text, and any other character is spelt in UTF-8 bytes (``<0xE2>``), ids 3 to 258.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({piece: len(vocab) + i for i, piece in enumerate(["\u2581", "\u2581snow", "\u2581a"])})
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    model.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_tiny_opt(
    path: Path | str,
    *,
    tokenizer: bool = True,
    seed: int = 0,
    weights: str = "safetensors",
    max_shard_size: str | None = None,
    **config: Any,
) -> Path:
    """Save a random OPT into ``path`` with transformers' ``save_pretrained``.

    ``config`` overrides ``TINY_OPT`` fields (e.g. ``do_layer_norm_before=False,
    word_embed_proj_dim=16`` for a 350m-like model). ``weights="bin"`` writes a
    legacy ``pytorch_model.bin`` with ``torch.save`` instead of safetensors.
    """
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    hf_config = OPTConfig(**{**TINY_OPT, **config})
    model = OPTForCausalLM(hf_config).eval()
    with torch.no_grad():  # transformers initialises LayerNorms to 1/0 and biases to 0: perturb them so tests see them
        for name, param in model.named_parameters():
            if "layer_norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    if weights == "safetensors":
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, **kwargs)
    elif weights == "bin":
        hf_config.architectures = ["OPTForCausalLM"]  # as model.save_pretrained would record
        hf_config.save_pretrained(path)
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        torch.save(state, path / "pytorch_model.bin")
    else:
        raise ValueError(f"weights must be 'safetensors' or 'bin', got {weights!r}")
    if tokenizer:
        make_byte_tokenizer(path, vocab_size=min(320, hf_config.vocab_size))
    return path


#: Tiny configs, by model type, for ``make_tiny_model`` (Llama-shaped ones share most fields).
_TINY_LLAMA = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "tie_word_embeddings": False,
    # Ten times transformers' default: peaked distributions, so a numerical slip shows.
    "initializer_range": 0.2,
}
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": _TINY_LLAMA,
    "mistral": {**_TINY_LLAMA, "sliding_window": 6},
    "qwen2": {**_TINY_LLAMA, "tie_word_embeddings": True},
    "gpt2": {
        "vocab_size": 384,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 128,
        "bos_token_id": 2,
        "eos_token_id": 2,
        "initializer_range": 0.2,
    },
}


def make_tiny_model(
    path: Path | str,
    model_type: str,
    *,
    tokenizer: bool = False,
    seed: int = 0,
    max_shard_size: str | None = None,
    **config: Any,
) -> Path:
    """Save a random model of ``model_type`` (``TINY_CONFIGS`` plus ``config``) with transformers' ``save_pretrained``.

    Norm weights and biases are perturbed away from transformers' 1 and 0, so
    tests comparing against transformers see them.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(model_type, **{**TINY_CONFIGS.get(model_type, {}), **config})
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        make_byte_tokenizer(path, vocab_size=min(320, hf_config.vocab_size))
    return path
