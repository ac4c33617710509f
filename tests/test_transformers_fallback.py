"""The transformers fallback (``TransformersForCausalLM``) against transformers itself, on the same weights.

Parity as for the native models: log-probabilities within 1e-4 (max abs, fp32)
over whole prompts and at every cached decoding step of a batch of prompts of
different lengths, and greedy tokens equal to transformers' ``generate``, on
architectures no builtin covers (GPT-NeoX, Phi, Falcon, Gemma 2: rotary
embeddings, partial rotary, parallel blocks, grouped keys and values, an
eager-attention model with logit soft-capping and sliding-window layers).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from builtin_models.kv_cache import KVCache
from builtin_models.opt import OPTForCausalLM as NativeOPT
from builtin_models.transformers_fallback import TransformersForCausalLM
from pluginhost import LLM, AsyncLLM, SamplingParams
from pluginhost.cli import main
from pluginhost.errors import CheckpointError, ModelClassError, UnknownArchitectureError
from pluginhost.testing import RegistersModel, make_tiny_opt

TOLERANCE = 1e-4
VOCAB = 384

#: Tiny random models (hidden 32, 2 layers): (config class, model class, config fields). No builtin covers the
#: first four; Mistral (every layer sliding) may get one, so the parity tests force the fallback
#: (``model_impl="transformers"``) for all of them.
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt_neox (partial rotary, parallel residual)": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {"rotary_pct": 0.5, "intermediate_size": 64},
    ),
    "phi (partial rotary, parallel attention and MLP)": (
        "PhiConfig",
        "PhiForCausalLM",
        {"partial_rotary_factor": 0.5, "intermediate_size": 64},
    ),
    "falcon (new decoder architecture, grouped kv heads)": (
        "FalconConfig",
        "FalconForCausalLM",
        {"new_decoder_architecture": True, "num_kv_heads": 2},
    ),
    "gemma2 (eager, soft-capping, sliding-window layers of 4)": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "intermediate_size": 64,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 4,
            "final_logit_softcapping": 3.0,
            "attn_logit_softcapping": 5.0,
        },
    ),
    "mistral (sliding window of 4 on every layer)": (
        "MistralConfig",
        "MistralForCausalLM",
        {"intermediate_size": 64, "num_key_value_heads": 2, "sliding_window": 4},
    ),
}

#: Longer than the windows of 4: sliding layers see only the last 4 positions.
PROMPTS = [[2, 17, 200, 31, 99, 5, 64, 11], [2, 300], [2, 7, 7, 7, 150, 42]]


def make_tiny(path: Path, config_class: str, model_class: str, *, seed: int = 0, **fields: Any) -> Path:
    """Save a random transformers model (hidden 32, 2 layers, 4 heads) with ``save_pretrained``."""
    fields = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "initializer_range": 0.2,  # peaked distributions: a numerical slip moves log-probabilities visibly
        "bos_token_id": 2,
        "eos_token_id": 2,
        "pad_token_id": 1,
        **fields,
    }
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields)).eval()
    with torch.no_grad():  # norms start at 1/0 and biases at 0: perturb them so the tests see them
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(ARCHITECTURES), ids=[a.split()[0] for a in ARCHITECTURES])
def model_dir(request, tmp_path_factory) -> Path:
    config_class, model_class, fields = ARCHITECTURES[request.param]
    return make_tiny(tmp_path_factory.mktemp(config_class), config_class, model_class, seed=1, **fields)


@pytest.fixture(scope="module")
def pair(model_dir) -> tuple[LLM, transformers.PreTrainedModel]:
    """The fallback and transformers on one tiny model (the parity tests share them: they only read)."""
    return fallback(model_dir, model_impl="transformers"), hf_model(model_dir)


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory) -> Path:
    config_class, model_class, fields = ARCHITECTURES["gpt_neox (partial rotary, parallel residual)"]
    return make_tiny(tmp_path_factory.mktemp("neox"), config_class, model_class, seed=2, **fields)


def hf_model(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def fallback(path: Path, **settings: Any) -> LLM:
    return LLM(str(path), load_installed_plugins=False, dtype="float32", device="cpu", **settings)


@torch.no_grad()
def hf_logprobs(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # (T, V)


@torch.no_grad()
def hf_generate(model: transformers.PreTrainedModel, prompt: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=1)
    return out[0, len(prompt) :].tolist()


def greedy(n: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kwargs)


# -- parity ---------------------------------------------------------------------------


@torch.no_grad()
def test_full_forward_matches_transformers(pair):
    llm, reference = pair
    assert type(llm.model) is TransformersForCausalLM
    for ids in PROMPTS:
        hidden = llm.model(torch.tensor([ids]), torch.arange(len(ids))[None])
        ours = llm.model.compute_logits(hidden)[0].log_softmax(-1)
        assert (ours - hf_logprobs(reference, ids)).abs().max().item() <= TOLERANCE


def test_cached_decoding_matches_transformers_at_every_step(pair, assert_decoding_matches):
    """A batch of prompts of different lengths, cached greedy decoding: each step equals transformers' full forward."""
    llm, reference = pair
    assert llm.model.cache_supported and llm.engine.runner.cached  # the engine's KVCache, not recomputation
    outs = llm.generate(PROMPTS, greedy(12, logprobs=5, prompt_logprobs=5))
    assert llm.engine.runner.cache_shape[0] > 0
    assert_decoding_matches(outs, PROMPTS, reference, TOLERANCE, against="forward")


def test_greedy_tokens_equal_transformers_generate(pair):
    llm, reference = pair
    outs = llm.generate(PROMPTS, greedy(10))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_generate(reference, prompt, 10)


def test_continuous_batching_gives_each_request_what_it_gets_alone(neox_dir, monkeypatch):
    """Through AsyncLLM: requests join a running batch, rows are compacted (moved): no greedy token changes."""
    lengths = {"short": 4, "long": 30, "join": 12}
    prompts = {"short": PROMPTS[1], "long": PROMPTS[0], "join": PROMPTS[2]}
    offline = fallback(neox_dir)
    alone = {name: offline.generate([prompts[name]], greedy(n))[0].token_ids for name, n in lengths.items()}
    moves = []
    move = KVCache.move
    monkeypatch.setattr(
        KVCache, "move", lambda cache, src, dst, n: (moves.append((src, dst)), move(cache, src, dst, n))
    )
    engine = AsyncLLM(str(neox_dir), load_installed_plugins=False, dtype="float32", device="cpu")

    async def collect(name, started=None):
        last = None
        async for out in engine.generate(prompts[name], greedy(lengths[name]), name):
            last = out
            if started is not None and len(out.outputs[0].token_ids) >= 6:
                started.set()
        return name, last.outputs[0].token_ids

    async def scenario():
        long_decoding = asyncio.Event()
        first = [asyncio.create_task(collect("short")), asyncio.create_task(collect("long", long_decoding))]
        await long_decoding.wait()  # short has finished and left row 0: long moved into it
        return dict([await collect("join"), *[await task for task in first]])

    try:
        results = asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        engine.shutdown()
    assert moves  # the batch was compacted
    assert results == alone


def test_half_precision_runs_with_the_cache(neox_dir):
    llm = LLM(str(neox_dir), load_installed_plugins=False, device="cpu", dtype="bfloat16")
    assert llm.model.cache_supported
    out = llm.generate([PROMPTS[0]], greedy(6))[0]
    assert len(out.token_ids) == 6
    assert all(cache.k.dtype == torch.bfloat16 for cache in llm.model.kv_caches)


# -- picking the implementation -------------------------------------------------------


@pytest.fixture(scope="module")
def opt_dir(tmp_path_factory) -> Path:
    return make_tiny_opt(tmp_path_factory.mktemp("opt"), tokenizer=False, seed=3)


def test_forcing_the_fallback_for_opt_gives_the_native_tokens(opt_dir):
    native = fallback(opt_dir)
    forced = fallback(opt_dir, model_impl="transformers")
    assert type(native.model) is NativeOPT  # "auto" prefers the registered model
    assert type(forced.model) is TransformersForCausalLM and forced.model.cache_supported
    assert type(forced.model.hf_model).__name__ == "OPTForCausalLM"
    ours = [o.token_ids for o in forced.generate(PROMPTS, greedy(10))]
    assert ours == [o.token_ids for o in native.generate(PROMPTS, greedy(10))]
    reference = hf_model(opt_dir)
    assert ours == [hf_generate(reference, p, 10) for p in PROMPTS]


def test_auto_picks_the_fallback_for_an_architecture_only_transformers_knows(neox_dir):
    llm = fallback(neox_dir)  # model_impl="auto", the default
    assert type(llm.model) is TransformersForCausalLM
    assert llm.registration.architecture == "TransformersForCausalLM"
    assert llm.architecture == "TransformersForCausalLM"
    assert llm.hf_config.architectures == ["GPTNeoXForCausalLM"]
    # Naming the fallback as the architecture works too: transformers then goes by the config's model_type.
    named = fallback(neox_dir, model_architecture_override="TransformersForCausalLM")
    assert type(named.model.hf_model).__name__ == "GPTNeoXForCausalLM"
    assert named.generate(PROMPTS, greedy(5))[0].token_ids == llm.generate(PROMPTS, greedy(5))[0].token_ids


def test_config_command_shows_the_fallback(neox_dir, capsys):
    assert main(["config", "--model", str(neox_dir), "--no-plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["architecture"] == "TransformersForCausalLM"
    assert data["implementation"] == "builtin_models.transformers_fallback:TransformersForCausalLM"
    assert main(["config", "--model", str(neox_dir), "--no-plugins", "--model-impl", "native"]) == 2
    assert "pass model_impl='auto' (--model-impl auto)" in capsys.readouterr().err


def test_native_only_on_an_architecture_only_transformers_knows_says_to_use_auto(neox_dir):
    with pytest.raises(UnknownArchitectureError, match=r"transformers could build it: pass model_impl='auto'"):
        fallback(neox_dir, model_impl="native")


def test_a_plugin_subclass_registered_as_the_fallback_overrides_it(neox_dir):
    class AlwaysSeven(TransformersForCausalLM):
        def compute_logits(self, hidden_states):
            logits = super().compute_logits(hidden_states)
            return torch.full_like(logits, -1e9).index_fill_(-1, torch.tensor([7]), 0.0)

    llm = fallback(neox_dir, plugins=[RegistersModel("TransformersForCausalLM", AlwaysSeven)])
    assert type(llm.model) is AlwaysSeven and llm.model.cache_supported
    assert llm.registration.registered_by.name == "RegistersModel"
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(3))] == [[7, 7, 7]] * len(PROMPTS)


# -- loading --------------------------------------------------------------------------


def test_construction_allocates_nothing_and_buffers_are_recomputed(neox_dir):
    config = transformers.AutoConfig.from_pretrained(neox_dir)
    with torch.device("meta"):
        model = TransformersForCausalLM(config)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    llm = fallback(neox_dir)
    reference = hf_model(neox_dir)
    ours = dict(llm.model.hf_model.named_buffers())
    theirs = dict(reference.named_buffers())
    assert ours.keys() == theirs.keys() and ours  # the rotary inv_freq, off meta and equal
    for name, buffer in ours.items():
        assert not buffer.is_meta and torch.equal(buffer, theirs[name]), name


def rewrite(src: Path, dst: Path, edit) -> Path:  # noqa: ANN001 - a function of the tensors
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(edit(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


def test_old_checkpoint_names_and_stale_buffers_load(tmp_path, neox_dir):
    """Legacy names (GPT-NeoX's embed_out), no base-model prefix, stale buffers: as from_pretrained reads them."""

    def edit(tensors):
        assert "embed_out.weight" in tensors  # transformers saves GPT-NeoX's head under its legacy name
        tensors = {k.removeprefix("gpt_neox."): v for k, v in tensors.items()}
        tensors["layers.0.attention.rotary_emb.inv_freq"] = torch.ones(4)
        tensors["layers.1.attention.bias"] = torch.ones(1, 1, 128, 128, dtype=torch.bool).tril()  # as in Pythia
        tensors["layers.1.attention.masked_bias"] = torch.tensor(-1e9)
        return tensors

    expected = [o.token_ids for o in fallback(neox_dir).generate(PROMPTS, greedy(6))]
    old = rewrite(neox_dir, tmp_path / "old", edit)
    assert [o.token_ids for o in fallback(old).generate(PROMPTS, greedy(6))] == expected


def test_unexpected_and_mis_shaped_tensors_are_named_as_the_checkpoint_names_them(tmp_path, neox_dir):
    def edit(tensors):
        tensors["gpt_neox.layers.0.extra.weight"] = torch.ones(2)
        tensors["gpt_neox.final_layer_norm.weight"] = torch.ones(31)
        return tensors

    with pytest.raises(CheckpointError) as info:
        fallback(rewrite(neox_dir, tmp_path / "stray", edit))
    message = str(info.value)
    assert "unexpected tensors (not in TransformersForCausalLM): gpt_neox.layers.0.extra.weight" in message
    assert "gpt_neox.final_layer_norm.weight: checkpoint shape (31,), model (32,)" in message
    assert "hf_model." not in message  # the wrapper's attribute, no name of the checkpoint's


def test_a_missing_tensor_is_named_before_the_cache_is_checked(tmp_path, neox_dir, caplog):
    """The cache check ran on the half-loaded model first, and warned of a cache that "disagrees"."""

    def edit(tensors):
        del tensors["gpt_neox.layers.1.mlp.dense_4h_to_h.weight"]
        return tensors

    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError) as info:
        fallback(rewrite(neox_dir, tmp_path / "missing", edit))
    assert "lacks 1 tensor(s) the model needs: gpt_neox.layers.1.mlp.dense_4h_to_h.weight" in str(info.value)
    assert "hf_model." not in str(info.value)
    assert "disagree" not in caplog.text and "without a KV cache" not in caplog.text


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> Path:
    """Gemma 2 ties its head to the embeddings: the checkpoint holds the embeddings only."""
    config_class, model_class, fields = ARCHITECTURES["gemma2 (eager, soft-capping, sliding-window layers of 4)"]
    return make_tiny(tmp_path_factory.mktemp("tied"), config_class, model_class, seed=4, **fields)


def test_tied_head_from_either_tensor(tmp_path, tied_dir):
    assert "lm_head.weight" not in load_file(str(tied_dir / "model.safetensors"))
    llm = fallback(tied_dir)
    hf = llm.model.hf_model
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    expected = [o.token_ids for o in llm.generate(PROMPTS, greedy(6))]

    def head_only(tensors):  # the other way round: only the head saved
        tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
        return tensors

    swapped = fallback(rewrite(tied_dir, tmp_path / "head-only", head_only))
    assert [o.token_ids for o in swapped.generate(PROMPTS, greedy(6))] == expected


def test_an_architecture_without_a_usable_cache_recomputes_and_stays_exact(tmp_path, caplog):
    """BLOOM builds ALiBi from a 2D mask: no engine cache, a warning, and every step recomputed, still exact."""
    path = make_tiny(tmp_path / "bloom", "BloomConfig", "BloomForCausalLM", n_layer=2, n_head=4)
    with caplog.at_level(logging.WARNING, logger="builtin_models.transformers_fallback"):
        llm = fallback(path, max_model_len=64)
    assert not llm.model.cache_supported and not llm.engine.runner.cached
    assert "running without one (every step recomputes)" in caplog.text
    reference = hf_model(path)
    outs = llm.generate(PROMPTS, greedy(6))
    assert [o.token_ids for o in outs] == [hf_generate(reference, p, 6) for p in PROMPTS]


def test_a_window_the_model_keeps_in_its_own_masks_gives_each_batched_request_its_tokens_alone(tmp_path):
    """GPT-Neo's local layers slice a window mask as if every row's last token sat at the last slot.

    In a batch of rows at different positions, a shorter row's window was cut at the longest row's
    position: other tokens, silently (the cache probe's rows were too close together to see it).
    """
    attention = {"attention_types": [[["global", "local"], 1]], "num_layers": 2, "window_size": 4}
    path = make_tiny(tmp_path / "neo", "GPTNeoConfig", "GPTNeoForCausalLM", num_heads=4, **attention)
    llm = fallback(path)
    reference = hf_model(path)
    outs = llm.generate(PROMPTS, greedy(10))
    assert [o.token_ids for o in outs] == [hf_generate(reference, p, 10) for p in PROMPTS]


def test_layer_typed_rope_following_the_length_runs_batched_as_transformers_runs_each_alone(tmp_path):
    """Gemma 3: rotary embeddings per layer type, ``dynamic`` on the full layers, called with the layer type."""
    from pluginhost.testing import make_tiny_model

    rope = {
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    layers = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8, "rope_parameters": rope}
    sizes = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "head_dim": 16}
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1, "initializer_range": 0.2}
    path = make_tiny_model(tmp_path, "gemma3_text", seed=1, max_position_embeddings=16, **sizes, **heads, **layers)
    llm = fallback(path)  # it failed to load: transformers passes the layer type by position
    prompts = [[2, *range(10, 20)], [2, 5], [2, *range(30, 35)]]  # within the 16 positions the engine allows
    outs = llm.generate(prompts, greedy(4))
    assert [o.token_ids for o in outs] == [hf_generate(hf_model(path), p, 4) for p in prompts]


def test_a_window_the_config_class_derives_keeps_the_cache(tmp_path, caplog):
    """ModernBERT's decoder sets sliding_window from local_attention: it is the model's, not a stray key."""
    from pluginhost.testing import make_tiny_model

    fields = {"local_attention": 8, "global_attn_every_n_layers": 3, "cls_token_id": 1, "sep_token_id": 2}
    sizes = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2}
    path = make_tiny_model(
        tmp_path, "modernbert-decoder", num_hidden_layers=3, pad_token_id=0, initializer_range=0.2, **sizes, **fields
    )
    with caplog.at_level(logging.WARNING):
        llm = fallback(path, max_model_len=64)
    assert llm.model.cache_supported and "sliding_window" not in caplog.text
    prompt = [3, *range(10, 30)]  # not 1: hf_generate's padding id
    assert llm.generate([prompt], greedy(6))[0].token_ids == hf_generate(hf_model(path), prompt, 6)


def test_a_cache_that_disagrees_with_the_uncached_forward_is_switched_off(neox_dir, monkeypatch, caplog):
    """The load-time check: a cache that writes every token to slot 0 (wrong) is caught; generation stays exact."""
    update = KVCache.update

    def slot_zero(cache, rows, positions, k, v, n_slots):
        return update(cache, rows, torch.zeros_like(positions), k, v, n_slots)

    monkeypatch.setattr(KVCache, "update", slot_zero)
    with caplog.at_level(logging.WARNING, logger="builtin_models.transformers_fallback"):
        llm = fallback(neox_dir)
    assert not llm.model.cache_supported and llm.model.setup_caches is None and not llm.engine.runner.cached
    assert "cached and uncached forwards disagree" in caplog.text
    monkeypatch.undo()
    reference = hf_model(neox_dir)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(6))] == [hf_generate(reference, p, 6) for p in PROMPTS]


def test_rope_following_the_length_gives_each_request_its_tokens_alone_without_a_cache_too(tmp_path, monkeypatch):
    """Uncached, a step recomputed every text right-padded to the longest, positions running on through the
    padding: a short request batched with one past the trained length got the stretched frequencies."""
    from pluginhost.testing import make_tiny_model

    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    path = make_tiny_model(tmp_path, "llama", seed=2, max_position_embeddings=16, rope_parameters=rope)
    # As a model the engine's cache cannot serve (MLA's DeepSeek-V3, MiniCPM3): every step recomputes.
    monkeypatch.setattr(TransformersForCausalLM, "_find_cache_layout", lambda self, ids, full: False)
    llm = fallback(path, model_impl="transformers")  # 32 positions: the trained 16, stretched
    monkeypatch.undo()
    assert not llm.engine.runner.cached and llm.model.prefill_unpadded
    short, long = [2, 17, 200, 31, 99], [2, *range(10, 30)]
    alone = llm.generate([short], greedy(8))[0].token_ids
    assert alone == hf_generate(hf_model(path), short, 8)
    assert llm.generate([short, long], greedy(8))[0].token_ids == alone


# -- configs laid out otherwise: a multimodal checkpoint's language model, sizes per layer ----------------------


def _multimodal_gemma3(path: Path) -> Path:
    """Gemma 3's image-text checkpoint: the language model's sizes are in ``text_config`` only."""
    torch.manual_seed(3)
    text = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    text |= {"num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "max_position_embeddings": 128}
    text |= {"sliding_window": 5, "sliding_window_pattern": 2}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision | {"image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4,
        image_token_index=380,
        boi_token_index=381,
        eoi_token_index=382,
    )
    transformers.Gemma3ForConditionalGeneration(config).eval().save_pretrained(path)
    return path


def _per_layer_sizes(path: Path, model_type: str) -> Path:
    """Gemma 3n gives intermediate_size per layer; Gemma 4 has per-layer sizes transformers will not read globally."""
    fields = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    fields |= {"num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "max_position_embeddings": 128}
    fields |= {"sliding_window": 5}
    if model_type == "gemma3n_text":
        fields |= {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "intermediate_size": [64] * 4}
        fields |= {"layer_types": ["sliding_attention", "full_attention"] * 2, "vocab_size_per_layer_input": VOCAB}
        fields |= {"hidden_size_per_layer_input": 8, "laurel_rank": 4, "altup_num_inputs": 2}
        fields |= {"activation_sparsity_pattern": [0.0] * 4}
    torch.manual_seed(4)
    config = transformers.AutoConfig.for_model(model_type, **fields)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["gemma3 image-text", "gemma3n_text", "gemma4_text"])
def test_configs_whose_sizes_are_in_text_config_or_per_layer_run_as_transformers_runs_them(
    tmp_path, kind, assert_decoding_matches
):
    # The image-text checkpoint failed with a bare AttributeError (no vocab_size at the top) or "no
    # max_position_embeddings"; Gemma 3n was refused ("intermediate_size is [64, 64, 64, 64], not a whole number"),
    # and Gemma 4 failed with transformers' own error, reading a per-layer size.
    if kind == "gemma3 image-text":
        path = _multimodal_gemma3(tmp_path)
        reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    else:
        path = _per_layer_sizes(tmp_path, kind)
        reference = hf_model(path)
    llm = fallback(path)
    assert llm.engine.loaded.vocab_size == VOCAB and llm.engine.loaded.max_model_len == 128
    outs = llm.generate(PROMPTS, greedy(8, logprobs=5))
    assert_decoding_matches(outs, PROMPTS, reference, TOLERANCE, against="forward")


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_a_mistral_config_with_layer_types_is_the_ministral_transformers_builds(
    tmp_path, impl, assert_decoding_matches
):
    # AutoConfig reads model_type "mistral" with layer_types as "ministral" (windows on some layers only); forced
    # through the fallback it was built as MistralForCausalLM, every layer windowed, and ran uncached: 6.9 off.
    from pluginhost.testing import make_tiny_model

    layers = {"sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"]}
    path = make_tiny_model(tmp_path, "mistral", seed=1, **layers)
    reference = hf_model(path)
    assert type(reference).__name__ == "MinistralForCausalLM"
    llm = fallback(path, model_impl=impl)
    if impl == "transformers":
        assert type(llm.model.hf_model) is type(reference) and llm.engine.runner.cached
    outs = llm.generate(PROMPTS, greedy(8, logprobs=5))
    assert_decoding_matches(outs, PROMPTS, reference, TOLERANCE, against="forward")


def test_forcing_the_fallback_on_a_model_transformers_cannot_build_says_so_first(tmp_path):
    # It said "The model config has no max_position_embeddings; set max_model_len", and given that, "No weights".
    config = {"architectures": ["MyLM"], "model_type": "mine", "auto_map": {"AutoModelForCausalLM": "modeling_my.MyLM"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownArchitectureError) as info:
        fallback(tmp_path, model_impl="transformers")
    message = str(info.value)
    assert "transformers has no causal LM for this checkpoint" in message and "model_type 'mine'" in message
    assert "auto_map" in message and "max_position_embeddings" not in message


def test_a_model_attending_both_ways_is_refused_naming_is_decoder_and_runs_once_it_is_a_decoder(tmp_path):
    # BERT's LM head with is_decoder false was served without a cache: each request's tokens changed with the
    # padding of the requests batched with it.
    path = make_tiny(tmp_path, "BertConfig", "BertLMHeadModel", intermediate_size=64, is_decoder=False)
    with pytest.raises(ModelClassError, match=r"BertLMHeadModel is not a causal language model as configured.*is_dec"):
        fallback(path)
    llm = fallback(path, hf_overrides={"is_decoder": True})
    alone = [llm.generate([p], greedy(4))[0].token_ids for p in PROMPTS]
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(4))] == alone
