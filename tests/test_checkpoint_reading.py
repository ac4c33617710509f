"""Reading safetensors files: every tensor exactly as safetensors itself reads it, in memory we own."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pluginhost.checkpoint import _read_into, find_checkpoint
from pluginhost.errors import CheckpointError

CPU = torch.device("cpu")


def tensors_of_every_kind() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"{dtype}".removeprefix("torch."): (torch.randn(3, 5, generator=generator) * 100).to(dtype)
        for dtype in (
            torch.float64,
            torch.float32,
            torch.float16,
            torch.bfloat16,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
        )
    }
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.zeros(0, 4)
    tensors["odd size"] = torch.arange(7, dtype=torch.int8)
    if hasattr(torch, "float8_e4m3fn"):  # read through safetensors itself, then copied
        tensors["float8"] = torch.randn(4, 4, generator=generator).to(torch.float8_e4m3fn)
    return tensors


def read_raw(model_dir: Path) -> dict[str, torch.Tensor]:
    checkpoint = find_checkpoint(model_dir)
    # dtype only converts floating-point tensors; float64 in, float64 out, to compare bit for bit
    return dict(checkpoint.tensors(dtype=torch.float64, device=CPU))


@pytest.mark.parametrize("saved_as", ["safetensors", "zip .bin", "legacy .bin"])
def test_every_dtype_and_shape_reads_as_safetensors_reads_it(tmp_path, saved_as):
    """A .bin too: a zip file is mapped and counted before reading, a legacy one (which cannot be mapped) read whole."""
    tensors = tensors_of_every_kind()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    expected = load_file(str(tmp_path / "model.safetensors"))
    if saved_as != "safetensors":
        (tmp_path / "model.safetensors").unlink()
        if saved_as == "legacy .bin":  # torch cannot load float8 from the legacy format (which predates it)
            expected.pop("float8", None)
        torch.save(expected, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=saved_as == "zip .bin")
    ours = read_raw(tmp_path)
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        reference = tensor.to(torch.float64) if tensor.is_floating_point() else tensor
        assert ours[name].dtype == reference.dtype and ours[name].shape == reference.shape, name
        assert torch.equal(ours[name], reference), name


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_loaded_tensors_survive_the_file_being_rewritten(tmp_path, name):
    """The engine owns its weights: nothing is backed by the file once it is read (torch maps a .bin's)."""
    weights = tmp_path / name
    tensors = {"w": torch.arange(1000, dtype=torch.float32), "ids": torch.arange(10)}
    if name.endswith(".bin"):
        torch.save(tensors, weights)
    else:
        save_file(tensors, str(weights))
    loaded = dict(find_checkpoint(tmp_path).tensors(dtype=torch.float32, device=CPU))  # nothing to convert
    with weights.open("r+b") as f:
        f.write(b"\x00" * weights.stat().st_size)  # rewritten in place under the running engine
    assert torch.equal(loaded["w"], tensors["w"]) and torch.equal(loaded["ids"], tensors["ids"])
    weights.write_bytes(b"")  # truncated: reading a mapped page past the end would kill the process
    assert torch.equal(loaded["w"], tensors["w"]) and torch.equal(loaded["ids"], tensors["ids"])


def test_a_file_ending_inside_a_tensor_is_one_clear_error():
    short = io.BytesIO(b"\x01\x02\x03")
    with pytest.raises(CheckpointError, match="the file ends inside a tensor"):
        _read_into(short, 0, torch.empty(4, dtype=torch.int8), Path("model.safetensors"))


@pytest.mark.parametrize(
    ("model_type", "saved", "parameter"),
    [
        ("opt", "model.decoder.embed_tokens.weight", "decoder.embed_tokens.weight"),
        ("gpt2", "transformer.wte.weight", "transformer.wte.weight"),
        ("qwen2", "model.embed_tokens.weight", "model.embed_tokens.weight"),
    ],
)
def test_a_tied_checkpoint_holding_the_head_instead_of_the_embeddings_loads_as_transformers_loads_it(
    tmp_path, model_type, saved, parameter
):
    # transformers ties either way round; the builtins dropped lm_head.weight, then lacked the embeddings.
    from pluginhost import LLM, SamplingParams
    from pluginhost.testing import make_tiny_model

    path = make_tiny_model(tmp_path, model_type, tie_word_embeddings=True)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    expected = LLM(str(path), load_installed_plugins=False).generate([[2, 5, 6]], params)[0].token_ids
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop(saved)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(path), load_installed_plugins=False)
    assert llm.generate([[2, 5, 6]], params)[0].token_ids == expected
    weights = dict(llm.model.named_parameters(remove_duplicate=False))
    assert weights["lm_head.weight"] is weights[parameter]  # one tensor, as tied


@pytest.mark.parametrize(
    ("model_type", "embeddings"),
    [
        ("opt", "model.decoder.embed_tokens.weight"),
        ("gpt2", "transformer.wte.weight"),
        ("qwen2", "model.embed_tokens.weight"),
    ],
)
def test_a_tied_config_with_a_different_head_in_the_checkpoint_keeps_that_head_as_transformers_does(
    tmp_path, model_type, embeddings
):
    # A fine-tune that untied its head and kept its config: the builtins tied the head to the embeddings all the
    # same, silently throwing the trained head away (log-probabilities off by up to 24, other tokens).
    from transformers import AutoModelForCausalLM

    from pluginhost import LLM, SamplingParams
    from pluginhost.testing import make_tiny_model

    path = make_tiny_model(tmp_path, model_type, tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn(tensors[embeddings].shape, generator=torch.Generator().manual_seed(5))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    prompt = [2, 5, 6, 9]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    out = LLM(str(path), load_installed_plugins=False).generate(
        [prompt], SamplingParams(max_tokens=1, logprobs=5, temperature=0)
    )[0]
    assert out.token_ids[0] == int(expected.argmax())
    for token, logprob in out.logprobs[0].items():
        assert logprob == pytest.approx(float(expected[token]), abs=1e-4)


@pytest.mark.parametrize("legacy", [True, False], ids=["legacy pickle", "zip"])
def test_a_bin_cut_short_or_garbled_anywhere_is_one_checkpoint_error(tmp_path, legacy):
    # A legacy file cut inside its pickle raised IndexError or struct.error from torch.load, not a CheckpointError;
    # a flipped byte, AssertionError, KeyError or TypeError.
    weights = tmp_path / "pytorch_model.bin"
    torch.save(
        {"a.weight": torch.ones(10, 10), "b.bias": torch.ones(10)}, weights, _use_new_zipfile_serialization=not legacy
    )
    whole = weights.read_bytes()
    for end in range(1, len(whole), 7):
        weights.write_bytes(whole[:end])
        with pytest.raises(CheckpointError, match="pytorch_model.bin"):
            dict(find_checkpoint(tmp_path).tensors(dtype=torch.float32, device=CPU))
    for at in range(0, len(whole), 3):
        garbled = bytearray(whole)
        garbled[at] ^= 0xFF
        weights.write_bytes(garbled)
        try:
            dict(find_checkpoint(tmp_path).tensors(dtype=torch.float32, device=CPU))
        except CheckpointError:
            pass  # or it loads: a flipped byte inside a tensor's data is just another value


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.uint8], ids=["transformers 2 (float32)", "3 (uint8)"])
def test_an_old_gpt2_checkpoints_causal_masks_larger_than_a_small_model_are_skipped_as_the_model_skips_them(
    tmp_path, mask_dtype, greedy_tokens
):
    """transformers < 4.2x saved GPT-2's causal mask, attn.bias, (1, 1, n_positions, n_positions): for a small model
    (sshleifer/tiny-gpt2) more than the whole model, refused as 'not this model's' before the model could skip it."""
    from pluginhost.errors import PluginhostError
    from pluginhost.testing import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "gpt2", "gpt2", n_positions=1024)  # 214,784 elements in all
    expected = greedy_tokens(model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    for layer in range(2):
        tensors[f"transformer.h.{layer}.attn.bias"] = torch.tril(torch.ones(1024, 1024, dtype=mask_dtype))[None, None]
        tensors[f"transformer.h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(tensors, model_dir / "pytorch_model.bin")
    assert greedy_tokens(model_dir) == expected
    # As large a tensor that the model does not skip is still refused, by name.
    tensors["transformer.h.0.attn.mask"] = tensors.pop("transformer.h.0.attn.bias")
    torch.save(tensors, model_dir / "pytorch_model.bin")
    with pytest.raises(
        PluginhostError, match=r"unexpected tensors \(not in GPT2LMHeadModel\): transformer.h.0.attn.mask"
    ):
        greedy_tokens(model_dir)
