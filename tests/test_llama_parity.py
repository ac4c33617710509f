"""Builtin Llama, Mistral and Qwen2 against transformers on the same weights.

Parity: log-probabilities within 1e-4 over whole prompts and at each of 10
cached decoding steps (transformers' own cached ``generate`` is the reference
for the steps), on a batch of prompts of different lengths; the same greedy
tokens. Tiny random configs with a large init, so a small slip fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pluginhost import LLM, SamplingParams
from pluginhost.errors import CheckpointError, ModelClassError
from pluginhost.testing import make_tiny_model

TOLERANCE = 1e-4
STEPS = 10
PROMPTS = [[2, 17, 200, 31, 99, 5, 64, 11, 3, 9, 70], [2, 300, 4], [2, 7, 7, 7, 150, 42, 8]]

VARIANTS = {
    "llama, grouped-query (4 heads, 2 kv)": ("llama", {}),
    "llama, multi-head": ("llama", {"num_key_value_heads": 4}),
    "llama, one kv head, head_dim 24": ("llama", {"num_key_value_heads": 1, "head_dim": 24}),
    "llama, attention and mlp biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama, tied embeddings": ("llama", {"tie_word_embeddings": True}),
    "llama, linear rope scaling": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "llama 3.1 rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 500000.0,
            }
        },
    ),
    "mistral, sliding window 6": ("mistral", {}),
    "qwen2, q/k/v biases, tied": ("qwen2", {}),
    "qwen2, sliding window on layer 1": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    ),
}

#: RoPE whose frequencies follow the sequence's length, past the trained length (16 positions).
LENGTH_DEPENDENT = {
    "dynamic": (
        "llama",
        {"max_position_embeddings": 16, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
    ),
    "longrope": (
        "llama",
        {
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "original_max_position_embeddings": 16,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.3 * i for i in range(8)],
                "factor": 4.0,
            },
        },
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def variant(request, tmp_path_factory) -> Path:
    model_type, config = VARIANTS[request.param]
    return make_tiny_model(tmp_path_factory.mktemp("llama-variant"), model_type, seed=1, **config)


def hf(path: Path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=dtype).eval()


@torch.no_grad()
def test_full_forward_matches_transformers(variant):
    llm = LLM(str(variant), load_installed_plugins=False, dtype="float32", device="cpu")
    reference = hf(variant)
    for ids in PROMPTS:
        hidden = llm.model(torch.tensor([ids]), torch.arange(len(ids))[None])
        ours = llm.model.compute_logits(hidden)[0].log_softmax(-1)
        theirs = reference(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert (ours - theirs).abs().max().item() <= TOLERANCE


def test_cached_batched_decoding_matches_transformers_at_every_step(
    variant, assert_decoding_matches, decoding_attention
):
    llm = LLM(str(variant), load_installed_plugins=False, dtype="float32", device="cpu")
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=STEPS, temperature=0, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    )
    assert_decoding_matches(outs, PROMPTS, hf(variant), TOLERANCE)


@pytest.mark.parametrize("name", ["llama, grouped-query (4 heads, 2 kv)", "qwen2, q/k/v biases, tied"])
def test_cached_decoding_through_every_kernel_matches_transformers(
    tmp_path, forced_kernel, name, assert_decoding_matches
):
    model_type, config = VARIANTS[name]
    path = make_tiny_model(tmp_path, model_type, seed=1, **config)
    llm = LLM(str(path), load_installed_plugins=False, dtype="float32", device="cpu")
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=STEPS, temperature=0, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    )
    assert_decoding_matches(outs, PROMPTS, hf(path), TOLERANCE)


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
@pytest.mark.parametrize("name", list(LENGTH_DEPENDENT))
def test_rope_following_the_length_gives_each_request_what_transformers_gives_it_alone(
    tmp_path, name, model_impl, assert_decoding_matches
):
    # transformers keeps the longest length it has seen, and in a batch the longest row decides: a finished
    # long request, or a batch-mate, changed a request's tokens. Each row follows its own length here, through
    # the transformers fallback too (which runs transformers' own rotary embedding, row by row).
    model_type, config = LENGTH_DEPENDENT[name]
    path = make_tiny_model(tmp_path, model_type, seed=2, **config)
    llm = LLM(str(path), load_installed_plugins=False, dtype="float32", device="cpu", model_impl=model_impl)
    params = SamplingParams(max_tokens=STEPS, temperature=0, logprobs=5, prompt_logprobs=2, ignore_eos=True)
    llm.generate([[2, *range(10, 31)]], params)  # 22 + 10 positions: longer than any below
    prompts = [[2, *range(10, 28)], [2, 5], [2, *range(30, 41)]]  # past 16 at once, never, while decoding
    outs = llm.generate(prompts, params)  # one batch, prefilled together where padding allows
    for prompt, out in zip(prompts, outs, strict=True):
        assert_decoding_matches([out], [prompt], hf(path), TOLERANCE)  # a fresh transformers model: no history


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
@torch.no_grad()
def test_a_stray_sliding_window_on_a_llama_config_is_ignored_as_transformers_ignores_it(tmp_path, caplog, model_impl):
    # LlamaConfig has no sliding_window, but keeps the key of a config.json (a Mistral-derived checkpoint
    # relabelled as Llama, say); transformers' Llama then attends over everything, and pluginhost windowed its
    # attention: other tokens, silently.
    path = make_tiny_model(tmp_path, "llama", seed=1, sliding_window=3)
    llm = LLM(str(path), load_installed_plugins=False, dtype="float32", device="cpu", model_impl=model_impl)
    assert "sliding_window=3, which LlamaConfig does not have: ignored" in caplog.text
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True))
    reference = hf(path)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        # Without a cache: transformers' cache for generate keeps the last sliding_window keys of any config.
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, use_cache=False, eos_token_id=None
        )
        assert out.token_ids == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("model_type", "key"), [("mistral", "attention_bias"), ("mistral", "mlp_bias"), ("qwen2", "mlp_bias")]
)
@torch.no_grad()
def test_a_stray_bias_key_on_a_config_without_it_is_ignored_as_transformers_ignores_it(
    tmp_path, caplog, model_type, key
):
    # Mistral's and Qwen2's transformers classes have fixed biases and ignore Llama's attention_bias/mlp_bias keys;
    # pluginhost built the biases and refused the checkpoint, which holds none ("lacks 4 tensor(s) ...").
    path = make_tiny_model(tmp_path, model_type, seed=3, **{key: True})
    llm = LLM(str(path), load_installed_plugins=False, dtype="float32", device="cpu")
    assert f"{key}=True, which {type(llm.hf_config).__name__} does not have: ignored" in caplog.text
    reference = hf(path)
    for ids in PROMPTS:
        ours = llm.model.compute_logits(llm.model(torch.tensor([ids]), torch.arange(len(ids))[None]))[0]
        theirs = reference(torch.tensor([ids])).logits[0]
        assert (ours.log_softmax(-1) - theirs.log_softmax(-1)).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama, multi-head", "llama, linear rope scaling", "llama 3.1 rope"])
@torch.no_grad()
def test_rotary_embedding_is_transformers_bit_for_bit(name, dtype):
    """The rotation (one roll against transformers' rotate_half, the sign carried by sin) changes no bit."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from builtin_models.rope import RotaryEmbedding, apply_rotary

    config = LlamaConfig(**{"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, **VARIANTS[name][1]})
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [17, 18, 19, 40, 41, 42]])  # (B, T)
    generator = torch.Generator().manual_seed(0)
    n_kv = config.num_key_value_heads
    q, k = (torch.randn(2, n, 6, 16, generator=generator).to(dtype) * 4 for n in (4, n_kv))  # (B, H, T, D)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    theirs = apply_rotary_pos_emb(q, k, cos, sin)
    ours = apply_rotary(torch.cat((q, k), dim=1), *RotaryEmbedding(config)(positions, dtype))
    assert torch.equal(ours, torch.cat(theirs, dim=1))


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
@torch.no_grad()
def test_rms_norm_is_transformers_up_to_the_rounding_of_its_sums(scale):
    """Computed as one layer norm over [x, -x]: within a few ulps of transformers' own, and following its weight."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from builtin_models.llama import RMSNorm

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 96, generator=generator) * scale
    ours, theirs = RMSNorm(96, 1e-6), LlamaRMSNorm(96, eps=1e-6)
    for change in ("as built", "in place", "through .data", "replaced"):
        if change == "in place":
            ours.weight.mul_(3.0).add_(0.5)
        elif change == "through .data":  # no version counter sees it: nothing may be cached from the weight
            ours.weight.data.mul_(-2.0)
        elif change == "replaced":
            ours.weight = torch.nn.Parameter(torch.randn(96, generator=generator))
        theirs.weight.copy_(ours.weight)
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6 * float(theirs(x).abs().max()))
    with torch.enable_grad():  # and the weight still learns
        ours(x).sum().backward()
    assert ours.weight.grad is not None and ours.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@torch.no_grad()
def test_half_precision_stays_close_to_transformers(tmp_path, dtype):
    """bf16 sums round differently in every kernel: within 0.25 of transformers' own bf16 log-probabilities."""
    path = make_tiny_model(tmp_path, "llama", seed=3)
    llm = LLM(str(path), load_installed_plugins=False, dtype="bfloat16", device="cpu")
    reference = hf(path, torch.bfloat16)
    exact = hf(path)
    ids = PROMPTS[0]
    ours = (
        llm.model.compute_logits(llm.model(torch.tensor([ids]), torch.arange(len(ids))[None]))[0]
        .float()
        .log_softmax(-1)
    )
    theirs = reference(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    truth = exact(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert (ours - theirs).abs().max().item() <= 0.25
    assert (ours - truth).abs().max().item() <= 2 * (theirs - truth).abs().max().item() + 0.02


# -- checkpoint layouts -------------------------------------------------------------------------


def test_sharded_checkpoint_with_an_index(tmp_path, greedy_tokens):
    sharded = make_tiny_model(tmp_path / "sharded", "llama", seed=5, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").is_file()
    assert greedy_tokens(sharded) == greedy_tokens(make_tiny_model(tmp_path / "whole", "llama", seed=5))


def test_names_without_the_model_prefix_and_a_stored_rotary_buffer(tmp_path, greedy_tokens):
    from safetensors.torch import load_file, save_file

    original = make_tiny_model(tmp_path / "original", "llama", seed=6)
    state = load_file(str(original / "model.safetensors"))
    renamed = {name.removeprefix("model."): tensor for name, tensor in state.items()}
    renamed["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old checkpoints stored it; it is computed
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file(renamed, str(bare / "model.safetensors"))
    (bare / "config.json").write_text((original / "config.json").read_text())
    assert greedy_tokens(bare) == greedy_tokens(original)


def test_tied_embeddings_need_no_lm_head_and_untied_ones_do(tmp_path):
    from safetensors.torch import load_file

    tied = make_tiny_model(tmp_path / "tied", "qwen2", seed=7)
    assert "lm_head.weight" not in load_file(str(tied / "model.safetensors"))
    llm = LLM(str(tied), load_installed_plugins=False)
    assert llm.model.lm_head.weight is llm.model.model.embed_tokens.weight
    untied = make_tiny_model(tmp_path / "untied", "llama", seed=7)
    state = load_file(str(untied / "model.safetensors"))
    assert "lm_head.weight" in state
    assert not torch.equal(
        LLM(str(untied), load_installed_plugins=False).model.lm_head.weight, state["model.embed_tokens.weight"]
    )


def test_a_fused_tensor_beside_its_parts_is_refused_naming_both(tmp_path):
    from safetensors.torch import load_file, save_file

    model = make_tiny_model(tmp_path, "llama", seed=1)
    state = load_file(str(model / "model.safetensors"))
    attn = "model.layers.0.self_attn"
    # A stray copy under the engine's own fused name: it and q/k/v_proj loaded one parameter, the later silently
    # overwriting the other (other tokens than transformers', which ignores the fused name as unexpected).
    state[f"{attn}.qkv_proj.weight"] = torch.zeros(128, 64)
    save_file(state, str(model / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensors loading the same parameter") as refused:
        LLM(str(model), load_installed_plugins=False)
    assert (
        f"{attn}.qkv_proj.weight (all of it) and {attn}.k_proj.weight, {attn}.q_proj.weight, {attn}.v_proj.weight "
        f"(parts of it) both load {attn}.qkv_proj.weight"
    ) in str(refused.value)


def test_a_misshaped_head_of_a_tied_model_is_named_as_the_checkpoint_holds_it(tmp_path):
    from safetensors.torch import load_file, save_file

    model = make_tiny_model(tmp_path, "qwen2", seed=7)  # tied: the head loads the embeddings when they are absent
    state = load_file(str(model / "model.safetensors"))
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")[:, :63].contiguous()
    save_file(state, str(model / "model.safetensors"))
    with pytest.raises(CheckpointError) as refused:
        LLM(str(model), load_installed_plugins=False)
    # It was reported as model.embed_tokens.weight, a tensor the file does not hold.
    assert "tensors that do not fit: lm_head.weight: checkpoint shape (384, 63), model (384, 64)." in str(refused.value)
    assert "embed_tokens" not in str(refused.value)


@pytest.mark.parametrize("theta", ["10000", True, 0, -1.0])
def test_a_rope_theta_that_is_not_a_positive_number_is_refused_when_the_model_is_built(tmp_path, theta):
    import json

    model = make_tiny_model(tmp_path, "llama", seed=1)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = theta
    (model / "config.json").write_text(json.dumps(config))
    # Accepted before, then every request failed ("10000" ** tensor) or generated with broken positions (1, 0).
    with pytest.raises(ModelClassError, match=f"rope_theta {theta!r} cannot be used: the base frequency must be a "):
        LLM(str(model), load_installed_plugins=False)
