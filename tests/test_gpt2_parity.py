"""Builtin GPT-2 against transformers on the same weights, and the layouts of real GPT-2 checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel as HFGPT2

from pluginhost import LLM, SamplingParams
from pluginhost.errors import CheckpointError
from pluginhost.testing import make_tiny_model

TOLERANCE = 1e-4
STEPS = 10
PROMPTS = [[2, 17, 200, 31, 99, 5, 64, 11, 3, 9, 70], [2, 300, 4], [2, 7, 7, 7, 150, 42, 8]]

VARIANTS = {
    "gpt2": {},
    "attention scaled by inverse layer index": {"scale_attn_by_inverse_layer_idx": True},
    "reordered and upcast attention": {"reorder_and_upcast_attn": True},
    "unscaled attention, n_inner 80, exact gelu": {
        "scale_attn_weights": False,
        "n_inner": 80,
        "activation_function": "gelu",
    },
    "untied head": {"tie_word_embeddings": False},
    # An encoder-decoder's decoder saved alone: its cross-attention weights were "unexpected tensors".
    "cross-attention layers, unused": {"add_cross_attention": True},
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def variant(request, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpt2-variant"), "gpt2", seed=1, **VARIANTS[request.param])


def hf(path: Path) -> HFGPT2:
    return HFGPT2.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


@torch.no_grad()
def test_full_forward_matches_transformers(variant):
    llm = LLM(str(variant), load_installed_plugins=False, dtype="float32", device="cpu")
    reference = hf(variant)
    for ids in PROMPTS:
        ours = llm.model.compute_logits(llm.model(torch.tensor([ids]), torch.arange(len(ids))[None]))[0].log_softmax(-1)
        theirs = reference(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert (ours - theirs).abs().max().item() <= TOLERANCE


def test_cached_batched_decoding_matches_transformers_at_every_step(
    variant, assert_decoding_matches, decoding_attention
):
    llm = LLM(str(variant), load_installed_plugins=False, dtype="float32", device="cpu")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=STEPS, temperature=0, logprobs=5, ignore_eos=True))
    assert_decoding_matches(outs, PROMPTS, hf(variant), TOLERANCE)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpt2-ref"), "gpt2", seed=4)


def test_the_original_checkpoint_layout(tmp_path, reference_dir, greedy_tokens):
    """OpenAI's GPT-2 checkpoints: no ``transformer.`` prefix, causal-mask buffers, a ``.bin`` file."""
    state = load_file(str(reference_dir / "model.safetensors"))
    old = {name.removeprefix("transformer."): tensor for name, tensor in state.items()}
    for i in range(2):
        old[f"h.{i}.attn.bias"] = torch.tril(torch.ones(128, 128)).view(1, 1, 128, 128)
        old[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(old, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((reference_dir / "config.json").read_text())
    assert greedy_tokens(tmp_path) == greedy_tokens(reference_dir)


def test_sharded_checkpoint_with_an_index(tmp_path, greedy_tokens):
    sharded = make_tiny_model(tmp_path / "sharded", "gpt2", seed=4, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    whole = make_tiny_model(tmp_path / "whole", "gpt2", seed=4)
    assert greedy_tokens(sharded) == greedy_tokens(whole)


def test_conv1d_weights_are_transposed_into_contiguous_linear_weights(reference_dir):
    llm = LLM(str(reference_dir), load_installed_plugins=False, dtype="float32", device="cpu")
    state = load_file(str(reference_dir / "model.safetensors"))
    block = llm.model.transformer.h[0]
    assert torch.equal(block.attn.c_attn.weight, state["transformer.h.0.attn.c_attn.weight"].t())
    assert all(p.is_contiguous() for p in llm.model.parameters())


def test_a_misshaped_conv1d_weight_is_reported_in_the_shape_the_checkpoint_stores(tmp_path, reference_dir):
    from safetensors.torch import save_file

    state = load_file(str(reference_dir / "model.safetensors"))
    state["transformer.h.0.mlp.c_fc.weight"] = torch.zeros(64, 255)  # (in, out), one output short of 256
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((reference_dir / "config.json").read_text())
    with pytest.raises(CheckpointError) as refused:
        LLM(str(tmp_path), load_installed_plugins=False)
    # It said "checkpoint shape (255, 64)": the tensor transposed, not as the file holds it.
    assert (
        "transformer.h.0.mlp.c_fc.weight: checkpoint shape (64, 255), model (64, 256) in the stored (in, out) layout"
    ) in str(refused.value)
