"""Builtin OPT against Hugging Face transformers' OPTForCausalLM on the same weights.

Parity means: log-probabilities within 1e-4 (max abs) over whole prompts and at
every cached decoding step, and the same greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import OPTForCausalLM as HFOPTForCausalLM

from pluginhost import LLM, SamplingParams
from pluginhost.testing import make_tiny_opt

TOLERANCE = 1e-4

VARIANTS = {
    "pre-layernorm (opt-125m-like)": {},
    "post-layernorm, projected embeddings (opt-350m-like)": {"do_layer_norm_before": False, "word_embed_proj_dim": 16},
    "pre-layernorm, projected embeddings": {"word_embed_proj_dim": 24},
    "three heads of 16": {"hidden_size": 48, "num_attention_heads": 3, "word_embed_proj_dim": 48},
    "one head": {"num_attention_heads": 1},
    "no biases, no affine layernorm, gelu": {
        "enable_bias": False,
        "layer_norm_elementwise_affine": False,
        "activation_function": "gelu",
    },
    "untied lm_head": {"tie_word_embeddings": False},
}

PROMPTS = [[2, 17, 200, 31, 99, 5, 64, 11], [2, 300], [2, 7, 7, 7, 150, 42]]


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def variant_dir(request, tmp_path_factory) -> Path:
    return make_tiny_opt(tmp_path_factory.mktemp("variant"), tokenizer=False, seed=1, **VARIANTS[request.param])


def hf_model(path: Path) -> HFOPTForCausalLM:
    return HFOPTForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model: HFOPTForCausalLM, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # (T, V)


@torch.no_grad()
def test_full_forward_matches_transformers(variant_dir):
    llm = LLM(str(variant_dir), load_installed_plugins=False, dtype="float32", device="cpu")
    reference = hf_model(variant_dir)
    for ids in PROMPTS:
        T = len(ids)
        hidden = llm.model(torch.tensor([ids]), torch.arange(T)[None])
        ours = llm.model.compute_logits(hidden)[0].log_softmax(-1)
        assert (ours - hf_logprobs(reference, ids)).abs().max().item() <= TOLERANCE


def test_cached_decoding_matches_transformers_at_every_step(variant_dir, assert_decoding_matches, decoding_attention):
    """Batched, left-padded, cached greedy decoding: each step equals a full forward of transformers."""
    llm = LLM(str(variant_dir), load_installed_plugins=False, dtype="float32", device="cpu")
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    )
    assert_decoding_matches(outs, PROMPTS, hf_model(variant_dir), TOLERANCE, against="forward")


def test_greedy_tokens_equal_transformers_generate(variant_dir):
    llm = LLM(str(variant_dir), load_installed_plugins=False, dtype="float32", device="cpu")
    reference = hf_model(variant_dir)
    prompt = PROMPTS[0]
    ours = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    with torch.no_grad():
        theirs = reference.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=1
        )[0, len(prompt) :].tolist()
    assert ours == theirs


@pytest.mark.parametrize("batch, length", [(1, 1), (3, 7), (2, 40), (1, 200)])
@torch.no_grad()
def test_every_cpu_kernel_matches_transformers(tmp_path, forced_kernel, batch, length):
    model_dir = make_tiny_opt(tmp_path, tokenizer=False, seed=3, max_position_embeddings=256)
    llm = LLM(str(model_dir), load_installed_plugins=False, dtype="float32", device="cpu")
    reference = hf_model(model_dir)
    ids = torch.randint(3, 384, (batch, length), generator=torch.Generator().manual_seed(length))
    hidden = llm.model(ids, torch.arange(length).expand(batch, length))  # (batch, length, W)
    ours = llm.model.compute_logits(hidden).log_softmax(-1)
    theirs = reference(ids).logits.float().log_softmax(-1)
    assert (ours - theirs).abs().max().item() <= TOLERANCE


def test_cached_decoding_through_every_kernel_matches_transformers(tmp_path, forced_kernel, assert_decoding_matches):
    test_cached_decoding_matches_transformers_at_every_step(
        make_tiny_opt(tmp_path, tokenizer=False, seed=4), assert_decoding_matches, "as the engine picks"
    )


def test_q_k_v_are_stacked_in_order(reference_dir):
    llm = LLM(str(reference_dir), load_installed_plugins=False, dtype="float32", device="cpu")
    tensors = load_file(str(reference_dir / "model.safetensors"))
    for i, layer in enumerate(llm.model.decoder.layers):
        for leaf in ("weight", "bias"):
            parts = [tensors[f"model.decoder.layers.{i}.self_attn.{p}_proj.{leaf}"] for p in "qkv"]
            assert torch.equal(getattr(layer.self_attn.qkv_proj, leaf), torch.cat(parts))


# -- checkpoint formats ---------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    return make_tiny_opt(tmp_path_factory.mktemp("reference"), tokenizer=False, seed=2)


def test_sharded_safetensors_with_index(tmp_path, reference_dir, greedy_tokens):
    sharded = make_tiny_opt(tmp_path / "sharded", tokenizer=False, seed=2, max_shard_size="20KB")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    assert greedy_tokens(sharded) == greedy_tokens(reference_dir)


def test_legacy_pytorch_model_bin(tmp_path, reference_dir, greedy_tokens):
    legacy = make_tiny_opt(tmp_path / "bin", tokenizer=False, seed=2, weights="bin")
    assert (legacy / "pytorch_model.bin").is_file() and not list(legacy.glob("*.safetensors"))
    assert greedy_tokens(legacy) == greedy_tokens(reference_dir)


def test_names_without_the_model_prefix(tmp_path, reference_dir, greedy_tokens):
    stripped = tmp_path / "stripped"
    stripped.mkdir()
    (stripped / "config.json").write_text((reference_dir / "config.json").read_text())
    tensors = load_file(str(reference_dir / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in tensors.items()}, str(stripped / "model.safetensors"))
    assert greedy_tokens(stripped) == greedy_tokens(reference_dir)


def stored_as(reference_dir: Path, directory: Path, dtype: torch.dtype) -> Path:
    """A copy of the reference checkpoint stored in ``dtype``, its config.json saying so."""
    directory.mkdir()
    config = (reference_dir / "config.json").read_text()
    (directory / "config.json").write_text(config.replace('"dtype": "float32"', f'"dtype": "{str(dtype)[6:]}"'))
    tensors = load_file(str(reference_dir / "model.safetensors"))
    save_file({k: v.to(dtype) for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def test_half_precision_checkpoint_runs_in_float32_on_cpu_unless_asked(tmp_path, reference_dir):
    half = stored_as(reference_dir, tmp_path / "half", torch.float16)
    auto = LLM(str(half), load_installed_plugins=False, device="cpu")
    assert auto.dtype == torch.float32 and auto.model.lm_head.weight.dtype == torch.float32
    asked = LLM(str(half), load_installed_plugins=False, device="cpu", dtype="bfloat16")
    assert asked.model.lm_head.weight.dtype == torch.bfloat16
    out = asked.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("computes_bfloat16", [True, False], ids=["AMX or AVX512-BF16", "no bfloat16 arithmetic"])
def test_a_bfloat16_checkpoint_stays_bfloat16_on_a_cpu_that_computes_it(
    tmp_path, reference_dir, monkeypatch, computes_bfloat16
):
    """As vLLM and transformers: float32 doubled its memory and, with AMX, took 3x as long to prefill."""
    import pluginhost.device

    half = stored_as(reference_dir, tmp_path / "bf16", torch.bfloat16)
    monkeypatch.setattr(pluginhost.device, "cpu_computes_bfloat16", lambda: computes_bfloat16)
    auto = LLM(str(half), load_installed_plugins=False, device="cpu")
    expected = torch.bfloat16 if computes_bfloat16 else torch.float32
    assert auto.dtype == expected and auto.model.lm_head.weight.dtype == expected


# -- half precision -------------------------------------------------------------------

#: Max abs log-probability difference from fp32 transformers. bfloat16 keeps 8 bits of
#: mantissa, float16 11: rounding alone moves log-probabilities this much on the test
#: model, for transformers in the same dtype too (the test checks we are no worse).
HALF_TOLERANCE = {"bfloat16": 0.15, "float16": 0.02}


@pytest.mark.parametrize("dtype", list(HALF_TOLERANCE))
def test_half_precision_stays_close_to_float32(reference_dir, dtype):
    ids = [2, 17, 200, 31, 99, 5, 64, 11, 45, 300, 12, 9]
    reference = hf_logprobs(hf_model(reference_dir), ids)
    half_hf = HFOPTForCausalLM.from_pretrained(reference_dir, attn_implementation="eager", dtype=getattr(torch, dtype))
    with torch.no_grad():
        theirs = half_hf.eval()(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    llm = LLM(str(reference_dir), load_installed_plugins=False, device="cpu", dtype=dtype)
    assert llm.model.lm_head.weight.dtype == getattr(torch, dtype)
    with torch.no_grad():
        hidden = llm.model(torch.tensor([ids]), torch.arange(len(ids))[None])
        ours = llm.model.compute_logits(hidden)[0].float().log_softmax(-1)
    our_error = (ours - reference).abs().max().item()
    their_error = (theirs - reference).abs().max().item()
    assert our_error <= HALF_TOLERANCE[dtype]
    assert our_error <= 2 * their_error + 1e-3
    # Cached decoding in half precision runs and agrees with its own full forward.
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True))[0]
    with torch.no_grad():
        sequence = ids + out.token_ids
        full = llm.model.compute_logits(llm.model(torch.tensor([sequence]), torch.arange(len(sequence))[None]))
        full = full[0].float().log_softmax(-1)
    for step, (token, logprobs) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert abs(logprobs[token] - full[len(ids) + step - 1, token].item()) <= HALF_TOLERANCE[dtype]
