"""Broken model directories: one clear error each, exit status 2, and the directory untouched."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pluginhost import LLM
from pluginhost.cli import main
from pluginhost.errors import PluginhostError


def snapshot(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(path.rglob("*"))
    }


def edit_tensors(model_dir: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    weights = model_dir / "model.safetensors"
    tensors = load_file(str(weights))
    change(tensors)
    save_file(tensors, str(weights))


def drop_tensor(d: Path) -> None:
    edit_tensors(d, lambda t: t.pop("model.decoder.layers.1.fc2.weight"))


def drop_stacked_part(d: Path) -> None:
    edit_tensors(d, lambda t: t.pop("model.decoder.layers.0.self_attn.k_proj.bias"))


def reshape_stacked_part(d: Path) -> None:
    edit_tensors(d, lambda t: t.update({"model.decoder.layers.1.self_attn.v_proj.weight": torch.zeros(31, 32)}))


def add_tensor(d: Path) -> None:
    edit_tensors(d, lambda t: t.update({"model.decoder.layers.0.extra.weight": torch.zeros(2)}))


def fp8_quantized(d: Path) -> None:
    """An FP8 checkpoint as vLLM and llm-compressor write them: float8 weights, each with its scale."""

    def quantize(tensors: dict) -> None:
        weight = tensors["model.decoder.layers.0.fc1.weight"]
        scale = weight.abs().max() / 448
        tensors["model.decoder.layers.0.fc1.weight"] = (weight / scale).to(torch.float8_e4m3fn)
        tensors["model.decoder.layers.0.fc1.weight_scale"] = scale.reshape(1)

    edit_tensors(d, quantize)
    edit_config(lambda c: c.update(quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"}))(d)


def reshape_tensor(d: Path) -> None:
    edit_tensors(d, lambda t: t.update({"model.decoder.layers.0.fc1.weight": torch.zeros(64, 31)}))


def integer_tensor(d: Path) -> None:
    edit_tensors(d, lambda t: t.update({"model.decoder.layers.0.fc1.bias": torch.zeros(64, dtype=torch.int32)}))


def truncate(d: Path) -> None:
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])


def garbage(d: Path) -> None:
    (d / "model.safetensors").write_bytes(b"\x00\x01not a safetensors file at all")


def as_bin(d: Path) -> Path:
    """The safetensors weights rewritten as a ``pytorch_model.bin`` (what older checkpoints hold)."""
    weights = d / "pytorch_model.bin"
    torch.save(load_file(str(d / "model.safetensors")), weights)
    (d / "model.safetensors").unlink()
    return weights


def garbage_bin(d: Path) -> None:
    as_bin(d).write_bytes(b"\x00garbage" * 100)


def truncated_bin(d: Path) -> None:
    weights = as_bin(d)
    weights.write_bytes(weights.read_bytes()[:4000])


def bin_with_a_key_that_is_no_name(d: Path) -> None:
    """A state dict keyed by an int besides the names (torch.load's weights_only allows it)."""
    weights = as_bin(d)
    torch.save({**torch.load(weights), 7: torch.zeros(1)}, weights)


def bin_shards_with_index(d: Path, extra: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The weights as two ``.bin`` shards and their index (plus ``extra`` index entries); the tensors."""
    tensors = load_file(str(d / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({name: tensors[name] for name in part}, d / shard)
        weight_map.update(dict.fromkeys(part, shard))
    weight_map.update(extra or {})
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors


def bin_index_naming_an_absent_tensor(d: Path) -> None:
    bin_shards_with_index(d, {"model.decoder.layers.0.extra.weight": "pytorch_model-00001-of-00002.bin"})
    (d / "model.safetensors").unlink()


def remove_config(d: Path) -> None:
    (d / "config.json").unlink()


def config_is_a_directory(d: Path) -> None:
    (d / "config.json").unlink()
    (d / "config.json").mkdir()


def config_is_a_link_loop(d: Path) -> None:
    (d / "config.json").unlink()
    (d / "config.json").symlink_to("config.json")


def invalid_json(d: Path) -> None:
    (d / "config.json").write_text('{"architectures": ["OPTForCausalLM"],')


def no_architectures(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    del config["architectures"]
    (d / "config.json").write_text(json.dumps(config))


def unknown_architecture(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["OPTForCausalLMM"]
    (d / "config.json").write_text(json.dumps(config))


def no_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()


def bad_index(d: Path) -> None:
    (d / "model.safetensors").rename(d / "model-00001.safetensors")  # beside model.safetensors, an index is not read
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))


def fifo_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")  # reading it would block forever


def stray_copy_of_a_tensor(d: Path) -> None:
    """Files read together (no model.safetensors, no index: every *.safetensors), one tensor in two of them."""
    (d / "model.safetensors").rename(d / "weights.safetensors")
    save_file({"model.decoder.final_layer_norm.weight": torch.zeros(32)}, str(d / "stray.safetensors"))


def one_tensor_under_two_spellings(d: Path) -> None:
    """The real weights, and a stray file holding one of them under its other spelling (no "model." prefix)."""
    (d / "model.safetensors").rename(d / "weights.safetensors")
    save_file({"decoder.layers.0.fc1.weight": torch.zeros(64, 32)}, str(d / "stray.safetensors"))


def tensor_in_two_shards(d: Path) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    first = dict(list(tensors.items())[:5])
    save_file(first, str(d / "model-00001-of-00002.safetensors"))
    save_file(tensors, str(d / "model-00002-of-00002.safetensors"))  # holds the first five again
    (d / "model.safetensors").unlink()
    weight_map = {name: "model-00002-of-00002.safetensors" for name in tensors}
    weight_map.update({name: "model-00001-of-00002.safetensors" for name in first})  # the index says shard 1
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def index_outside_the_directory(d: Path) -> None:
    outside = d.parent / "elsewhere.safetensors"
    shutil.move(d / "model.safetensors", outside)
    names = load_file(str(outside)).keys()
    weight_map = {name: "../elsewhere.safetensors" for name in names}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def link_outside_the_directory(d: Path) -> None:
    outside = d.parent / "elsewhere.safetensors"
    shutil.move(d / "model.safetensors", outside)
    (d / "model.safetensors").symlink_to(outside)


def huge_declared_tensor(d: Path) -> None:
    """A header declaring 6 GB of data in a sparse file: nothing must be read before it is refused."""
    shape = [50_000, 30_000]
    header = json.dumps(
        {
            "model.decoder.layers.0.huge.weight": {
                "dtype": "F32",
                "shape": shape,
                "data_offsets": [0, 4 * shape[0] * shape[1]],
            }
        }
    )
    header += " " * (-len(header) % 8)
    with (d / "model.safetensors").open("wb") as f:  # in the file that is read
        f.write(len(header).to_bytes(8, "little") + header.encode())
        f.truncate(8 + len(header) + 4 * shape[0] * shape[1])


def edit_config(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        change(config)
        (d / "config.json").write_text(json.dumps(config))

    return damage


def huge_config(d: Path) -> None:
    (d / "config.json").write_text('{"architectures": ["OPTForCausalLM"], "junk": [' + "0," * 9_000_000 + "0]}")


def deeply_nested_config(d: Path) -> None:
    (d / "config.json").write_text(
        '{"architectures": ["OPTForCausalLM"], "junk": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )


FAULTS = {
    "missing tensor": (drop_tensor, "lacks 1 tensor(s) the model needs: decoder.layers.1.fc2.weight"),
    "missing part of q/k/v": (
        drop_stacked_part,
        "lacks 1 tensor(s) the model needs: decoder.layers.0.self_attn.qkv_proj.bias",
    ),
    "wrong shape of q/k/v": (
        reshape_stacked_part,
        "model.decoder.layers.1.self_attn.v_proj.weight: checkpoint shape (31, 32), model (32, 32) "
        "(the v_proj part of decoder.layers.1.self_attn.qkv_proj.weight)",
    ),
    "extra tensor": (add_tensor, "unexpected tensors (not in OPTForCausalLM): model.decoder.layers.0.extra.weight"),
    "an FP8 quantized checkpoint": (  # said as unexpected tensors only: read as a damaged or mismatched checkpoint
        fp8_quantized,
        "The checkpoint is quantized (config.json's quantization_config: quant_method 'fp8'), and "
        "builtin_models.opt:OPTForCausalLM loads unquantized weights only",
    ),
    "wrong shape": (reshape_tensor, "model.decoder.layers.0.fc1.weight: checkpoint shape (64, 31), model (64, 32)"),
    "wrong dtype": (
        integer_tensor,
        "model.decoder.layers.0.fc1.bias: checkpoint dtype torch.int32, model torch.float32",
    ),
    "truncated safetensors": (truncate, "it is not a valid safetensors file"),
    "corrupt safetensors": (garbage, "it is not a valid safetensors file"),
    "corrupt .bin": (garbage_bin, "pytorch_model.bin: it is not a valid PyTorch checkpoint"),
    "truncated .bin": (truncated_bin, "pytorch_model.bin: it is not a valid PyTorch checkpoint"),
    "a .bin keyed by an int": (bin_with_a_key_that_is_no_name, "does not hold a flat dictionary of tensors"),
    "missing config.json": (remove_config, "config.json is missing"),
    "config.json a directory": (config_is_a_directory, "config.json is a directory"),
    "config.json a link loop": (config_is_a_link_loop, "config.json is a broken symbolic link (or a loop of them)"),
    "invalid JSON": (invalid_json, "config.json is not valid JSON"),
    "no architectures": (no_architectures, "config.json names no architecture"),
    "unknown architecture": (unknown_architecture, "Did you mean 'OPTForCausalLM'"),
    "no weights": (no_weights, "No weights in"),
    "index naming a missing shard": (bad_index, "lists shard(s) that are missing: model-00002.safetensors"),
    "weights that are a FIFO": (fifo_weights, "is not a regular file (a FIFO, socket or device)"),
    "a tensor in two files": (stray_copy_of_a_tensor, "is in both stray.safetensors and weights.safetensors"),
    "one tensor under two spellings": (  # the file read last won, silently: zeros in place of the weights
        one_tensor_under_two_spellings,
        "decoder.layers.0.fc1.weight and model.decoder.layers.0.fc1.weight both load decoder.layers.0.fc1.weight",
    ),
    "a tensor in two shards": (tensor_in_two_shards, "but the index places it in model-00001-of-00002.safetensors"),
    "a .bin index naming a tensor no shard holds": (
        bin_index_naming_an_absent_tensor,
        "The index names 1 tensor(s) its shards do not hold: model.decoder.layers.0.extra.weight",
    ),
    "an index naming ../": (index_outside_the_directory, "outside the model directory"),
    "a link out of the directory": (link_outside_the_directory, "outside the model directory"),
    "a 6 GB tensor in a sparse file": (huge_declared_tensor, "more than the whole model"),
    "a vocabulary of '300'": (edit_config(lambda c: c.update(vocab_size="300")), "vocab_size"),
    "2.0 layers": (edit_config(lambda c: c.update(num_hidden_layers=2.0)), "num_hidden_layers"),
    "zero heads": (edit_config(lambda c: c.update(num_attention_heads=0)), "num_attention_heads"),
    "negative hidden size": (edit_config(lambda c: c.update(hidden_size=-32)), "hidden_size"),
    "ten million layers": (
        edit_config(lambda c: c.update(num_hidden_layers=10_000_000)),
        "num_hidden_layers is 10000000",
    ),
    "architectures a string": (edit_config(lambda c: c.update(architectures="OPTForCausalLM")), "architectures"),
    "architectures [null]": (edit_config(lambda c: c.update(architectures=[None])), "architectures"),
    "architectures [1]": (edit_config(lambda c: c.update(architectures=[1])), "architectures"),
    "architectures an object": (edit_config(lambda c: c.update(architectures={"a": 1})), "architectures"),
    "a 100 MB config.json": (huge_config, "a real config.json is far smaller"),
    "deeply nested JSON": (deeply_nested_config, "nests its JSON too deeply"),
}


@pytest.fixture
def broken_copy(tiny_opt, tmp_path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(tiny_opt, copy)
    return copy


@pytest.mark.parametrize("fault", list(FAULTS), ids=list(FAULTS))
def test_checkpoint_fault_is_one_clear_error_and_nothing_is_written(broken_copy, capsys, fault):
    damage, message = FAULTS[fault]
    damage(broken_copy)
    before = snapshot(broken_copy)
    with pytest.raises(PluginhostError) as info:
        LLM(str(broken_copy), load_installed_plugins=False)
    assert message in str(info.value)
    assert main(["generate", "--model", str(broken_copy), "--prompt", "Hi", "--no-plugins"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert snapshot(broken_copy) == before


def test_missing_model_directory(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "Hi"]) == 2
    assert "does not exist" in capsys.readouterr().err


PAYLOAD = """
import os
class Exploit:
    def __reduce__(self):
        return (os.system, ("touch {marker}",))
"""


def test_bin_with_pickled_code_is_refused_and_the_code_never_runs(tiny_opt, tmp_path, capsys):
    model = tmp_path / "evil"
    model.mkdir()
    for source in tiny_opt.iterdir():  # config and tokenizer: the CLI gets as far as the weights
        if source.is_file() and not source.name.endswith(".safetensors"):
            shutil.copy(source, model / source.name)
    marker = tmp_path / "code-ran"
    namespace: dict = {}
    exec(PAYLOAD.format(marker=marker), namespace)
    torch.save(
        {"model.decoder.embed_tokens.weight": torch.zeros(1), "boom": namespace["Exploit"]()},
        model / "pytorch_model.bin",
    )
    before = snapshot(model)
    with pytest.raises(
        PluginhostError, match="Refused to load .*pytorch_model.bin: it holds pickled objects other than tensors"
    ):
        LLM(str(model), load_installed_plugins=False)
    assert main(["generate", "--model", str(model), "--prompt", "Hi", "--no-plugins"]) == 2
    err = capsys.readouterr().err
    assert "it holds pickled objects other than tensors (posix.system), which could run code" in err
    # Neither torch's advice to load it anyway (weights_only=False runs the code) nor its terminal colour codes.
    assert "weights_only" not in err and "\x1b" not in err
    assert not marker.exists()
    assert snapshot(model) == before


@pytest.mark.parametrize("damage", [garbage_bin, truncated_bin], ids=["corrupt", "truncated"])
def test_an_unreadable_bin_is_called_invalid_not_dangerous_and_no_unsafe_advice_is_given(broken_copy, damage):
    """torch's refusal says weights_only=False "will likely succeed": for a file that is no checkpoint at all."""
    damage(broken_copy)
    with pytest.raises(PluginhostError) as info:
        LLM(str(broken_copy), load_installed_plugins=False)
    message = str(info.value)
    assert "it is not a valid PyTorch checkpoint" in message
    assert "pickled objects" not in message and "weights_only" not in message and "\x1b" not in message


def test_a_models_own_code_is_never_run_and_the_refusal_says_so(tiny_opt_no_tokenizer, tmp_path):
    import json

    model = tmp_path / "custom"
    shutil.copytree(tiny_opt_no_tokenizer, model)
    config = json.loads((model / "config.json").read_text())
    config |= {"architectures": ["MyCustomLM"], "auto_map": {"AutoModelForCausalLM": "modeling_my.MyCustomLM"}}
    (model / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "code-ran"
    (model / "modeling_my.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass MyCustomLM: pass\n")
    refused = r"'MyCustomLM' is not registered.*auto_map.*never runs.*install a plugin"
    with pytest.raises(PluginhostError, match=refused):
        LLM(str(model), load_installed_plugins=False)
    assert not marker.exists()


def test_a_tokenizers_own_code_is_never_run_and_the_refusal_says_what_to_do(tmp_path):
    # transformers' own message advised "pass the argument trust_remote_code=True", which pluginhost has not.
    import json

    from pluginhost.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "custom-tokenizer", "llama", tokenizer=True)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings |= {"auto_map": {"AutoTokenizer": ["tokenization_my.MyTokenizer", None]}, "tokenizer_class": "MyTokenizer"}
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    marker = tmp_path / "code-ran"
    (model / "tokenization_my.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass MyTokenizer: pass\n")
    with pytest.raises(
        PluginhostError, match=r"needs code of its own \(auto_map.*never runs.*standard tokenizer"
    ) as info:
        LLM(str(model), load_installed_plugins=False)
    assert "trust_remote_code" not in str(info.value)
    assert not marker.exists()


# -- what the table above cannot express: warnings, opt-ins, limits -------------------------


def test_non_finite_weights_are_named_in_a_warning_or_refused(broken_copy, caplog):
    edit_tensors(broken_copy, lambda t: t["model.decoder.layers.0.fc2.bias"].__setitem__(3, float("inf")))
    with caplog.at_level("WARNING", logger="pluginhost"):
        LLM(str(broken_copy), load_installed_plugins=False)
    # Named as the model names them: the model's tensors are what is judged (see the test below).
    assert "1 tensor(s) the model loaded hold values that are not finite" in caplog.text
    assert "decoder.layers.0.fc2.bias" in caplog.text
    with pytest.raises(
        PluginhostError, match=r"not finite \(inf or nan\) in torch.float32: decoder.layers.0.fc2.bias: re"
    ):
        LLM(str(broken_copy), load_installed_plugins=False, refuse_nonfinite_weights=True)


def test_a_stale_buffer_the_model_skips_is_no_fault_even_when_it_is_not_finite(tmp_path, caplog):
    """Old GPT-NeoX (Pythia) checkpoints hold attention.masked_bias, -1e9: -inf once saved in float16. The model
    skips it, yet it was warned about as garbage, and refuse_nonfinite_weights refused a good checkpoint."""
    from pluginhost.testing import make_tiny_model

    model_dir = make_tiny_model(
        tmp_path / "neox", "gpt_neox", hidden_size=64, num_attention_heads=4, num_hidden_layers=2
    )
    stale = {f"gpt_neox.layers.{i}.attention.masked_bias": torch.tensor(-1e9).half() for i in range(2)}
    edit_tensors(model_dir, lambda t: t.update(stale))
    with caplog.at_level("WARNING", logger="pluginhost"):
        LLM(str(model_dir), load_installed_plugins=False, dtype="float32")
        LLM(str(model_dir), load_installed_plugins=False, dtype="float32", refuse_nonfinite_weights=True)
    assert "not finite" not in caplog.text
    # A weight the model keeps is still named (and refused when asked), the stale buffer beside it not.
    edit_tensors(model_dir, lambda t: t["gpt_neox.layers.1.mlp.dense_h_to_4h.bias"].__setitem__(0, float("nan")))
    with caplog.at_level("WARNING", logger="pluginhost"):
        LLM(str(model_dir), load_installed_plugins=False, dtype="float32")
    assert "1 tensor(s) the model loaded hold values that are not finite" in caplog.text
    assert "gpt_neox.layers.1.mlp.dense_h_to_4h.bias" in caplog.text and "masked_bias" not in caplog.text
    with pytest.raises(PluginhostError, match=r"dense_h_to_4h.bias: refused \(refuse_nonfinite_weights is on\)"):
        LLM(str(model_dir), load_installed_plugins=False, dtype="float32", refuse_nonfinite_weights=True)


def test_weights_outside_the_directory_load_when_allowed(broken_copy):
    link_outside_the_directory(broken_copy)
    llm = LLM(str(broken_copy), load_installed_plugins=False, allow_external_weights=True)
    assert llm.generate([[2, 5]])[0].token_ids


def test_a_hugging_face_cache_snapshot_links_into_its_blobs(tiny_opt, tmp_path):
    """The Hugging Face cache's layout: snapshots/<rev>/model.safetensors -> ../../blobs/<hash>."""
    repo = tmp_path / "models--org--tiny"
    snapshot_dir, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot_dir.mkdir(parents=True)
    blobs.mkdir()
    for f in tiny_opt.iterdir():
        blob = blobs / hashlib.sha256(f.name.encode()).hexdigest()
        shutil.copy(f, blob)
        (snapshot_dir / f.name).symlink_to(os.path.relpath(blob, snapshot_dir))
    assert LLM(str(snapshot_dir), load_installed_plugins=False).generate([[2, 5]])[0].token_ids


def test_a_local_dir_download_by_an_older_huggingface_hub_links_into_the_caches_blobs(tiny_opt, tmp_path):
    """`hf download ... --local-dir ./opt` with huggingface_hub < 0.23 (local_dir_use_symlinks="auto") links its large
    files to ~/.cache/huggingface/hub/models--<org>--<name>/blobs/<hash>: refused as outside the model directory,
    though vLLM and transformers load it. A link to a blobs folder elsewhere is still refused."""
    blobs = tmp_path / "home" / ".cache" / "huggingface" / "hub" / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    local = tmp_path / "tiny"
    shutil.copytree(tiny_opt, local)
    weights = local / "model.safetensors"
    blob = blobs / hashlib.sha256(weights.read_bytes()).hexdigest()
    shutil.move(weights, blob)
    weights.symlink_to(os.path.relpath(blob, local))  # relative, as huggingface_hub makes it
    assert LLM(str(local), load_installed_plugins=False).generate([[2, 5]])[0].token_ids
    elsewhere = tmp_path / "not-a-cache" / "blobs"
    elsewhere.mkdir(parents=True)
    shutil.move(blob, elsewhere / blob.name)
    weights.unlink()
    weights.symlink_to(elsewhere / blob.name)
    with pytest.raises(PluginhostError, match="outside the model directory"):
        LLM(str(local), load_installed_plugins=False)


def bin_shards(d: Path) -> None:
    bin_shards_with_index(d)
    (d / "model.safetensors").unlink()


@pytest.mark.parametrize(
    "layout", [lambda d: None, as_bin, bin_shards], ids=["safetensors", "pytorch_model.bin", ".bin shards"]
)
def test_weights_larger_than_the_memory_available_are_one_clear_error(broken_copy, monkeypatch, capsys, layout):
    """A .bin was read with no memory check at all (only safetensors were counted before reading)."""
    import pluginhost.checkpoint

    layout(broken_copy)
    monkeypatch.setattr(pluginhost.checkpoint, "_available_memory", lambda: 1000)
    # In KiB or MiB below a GiB, never 0 (a small model's "need 0.0 GiB ... only 0.0 GiB" said nothing); a 16-bit
    # dtype is advised while the weights are float32, and not once they are 16-bit already.
    need = r"The weights need [1-9]\d* KiB in memory and only 1 KiB is available\. .*--dtype bfloat16"
    with pytest.raises(PluginhostError, match=need):
        LLM(str(broken_copy), load_installed_plugins=False, dtype="float32")
    with pytest.raises(PluginhostError, match=r"only 1 KiB is available\. Free memory, or use a smaller model\.$"):
        LLM(str(broken_copy), load_installed_plugins=False, dtype="bfloat16")
    assert main(["generate", "--model", str(broken_copy), "--prompt", "Hi", "--no-plugins"]) == 2


@pytest.mark.parametrize(
    "damage",
    [edit_config(lambda c: c.update(num_hidden_layers=10_000_000)), huge_config, huge_declared_tensor],
    ids=["ten million layers", "100 MB config.json", "6 GB tensor"],
)
def test_a_config_or_checkpoint_cannot_run_the_machine_out_of_memory(broken_copy, damage, run_pluginhost):
    """In a process limited to 3 GiB and 60 s: refused in a moment, exit 2, whatever the directory claims."""
    damage(broken_copy)
    result = run_pluginhost("generate", "--model", str(broken_copy), "--prompt", "Hi", "--no-plugins")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_bin_rewritten_or_truncated_under_a_running_engine_changes_nothing(broken_copy, greedy_tokens):
    """The engine owns its weights: a float32 .bin read as float32 stayed mapped (then all zeros, or a bus error)."""
    expected = greedy_tokens(broken_copy)
    weights = as_bin(broken_copy)
    llm = LLM(str(broken_copy), load_installed_plugins=False, dtype="float32")
    assert greedy_tokens(llm) == expected
    size = weights.stat().st_size
    with weights.open("r+b") as f:  # rewritten in place, as a download or a copy over it would
        f.write(b"\x00" * size)
    assert greedy_tokens(llm) == expected
    with weights.open("r+b") as f:
        f.truncate(0)
    assert greedy_tokens(llm) == expected


def test_every_missing_tensor_is_named_in_one_message_a_stacked_part_too(broken_copy):
    """A missing part of q/k/v was reported alone; the other missing tensors only once it was fixed."""
    edit_tensors(
        broken_copy,
        lambda t: [t.pop("model.decoder.layers.0.self_attn.k_proj.bias"), t.pop("model.decoder.layers.1.fc2.weight")],
    )
    with pytest.raises(PluginhostError) as info:
        LLM(str(broken_copy), load_installed_plugins=False)
    message = str(info.value)
    assert "lacks 2 tensor(s) the model needs" in message
    assert "decoder.layers.0.self_attn.qkv_proj.bias (stacked from q_proj, k_proj, v_proj; no k_proj)" in message
    assert "decoder.layers.1.fc2.weight" in message


def test_a_mis_shaped_part_of_a_stacked_parameter_is_not_called_missing(broken_copy):
    reshape_stacked_part(broken_copy)
    with pytest.raises(PluginhostError) as info:
        LLM(str(broken_copy), load_installed_plugins=False)
    message = str(info.value)
    assert "v_proj.weight: checkpoint shape (31, 32), model (32, 32)" in message
    assert "missing" not in message and "no v_proj" not in message


def test_model_safetensors_is_read_alone_as_transformers_reads_it(broken_copy, greedy_tokens):
    """Beside it: Mistral's consolidated.safetensors, a LoRA adapter, a .bin index of other weights: all ignored."""
    expected = greedy_tokens(broken_copy)
    tensors = bin_shards_with_index(broken_copy)
    for name in list(broken_copy.glob("pytorch_model-*.bin")):  # other weights: the tokens would change
        torch.save({k: torch.zeros_like(v) for k, v in torch.load(name).items()}, name)
    save_file(
        {k.replace("model.decoder.", ""): v for k, v in tensors.items()}, str(broken_copy / "consolidated.safetensors")
    )
    save_file(
        {"base_model.model.q_proj.lora_A.weight": torch.zeros(4, 32)}, str(broken_copy / "adapter_model.safetensors")
    )
    assert greedy_tokens(broken_copy) == expected


def test_an_index_reads_only_its_shards(broken_copy, greedy_tokens):
    expected = greedy_tokens(broken_copy)
    tensors = load_file(str(broken_copy / "model.safetensors"))
    (broken_copy / "model.safetensors").rename(broken_copy / "model-00001-of-00001.safetensors")
    weight_map = dict.fromkeys(tensors, "model-00001-of-00001.safetensors")
    (broken_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file(
        {"base_model.model.q_proj.lora_A.weight": torch.zeros(4, 32)}, str(broken_copy / "adapter_model.safetensors")
    )
    assert greedy_tokens(broken_copy) == expected


@pytest.fixture
def wide_opt(tmp_path) -> Path:
    """One layer with a 4096x32 fc1: a whole tensor larger than rank 0 of 4's share of the model (87,384 elements)."""
    from pluginhost.testing import make_tiny_opt

    return make_tiny_opt(tmp_path / "wide", tokenizer=False, num_hidden_layers=1, ffn_dim=4096)


def build_rank_0_of_4(model_dir: Path):  # noqa: ANN201 - a LoadedModel
    """Rank 0 of a 4-way tensor-parallel engine, built in this process alone (no other rank, nothing to agree)."""
    from types import SimpleNamespace

    from pluginhost.engine.loader import load_model
    from pluginhost.engine.parallel import Ranks
    from pluginhost.host import PluginHost

    ranks = Ranks(0, 4, processes={}, control=None, timeout_s=60, threads_before=None)
    rank_0_of_4 = SimpleNamespace(ranks=ranks, reach=lambda *args: None)
    settings = {"model": str(model_dir), "dtype": "float32", "tensor_parallel_size": 4}
    return load_model(PluginHost(load_installed=False), settings, agreement=rank_0_of_4)


def test_a_tensor_parallel_rank_reads_whole_tensors_larger_than_its_share_of_the_model(wide_opt):
    """A rank's model holds a share of the weights, the checkpoint whole tensors: fc1 was refused as 'more than
    the whole model' (rank 0's share)."""
    loaded = build_rank_0_of_4(wide_opt)
    assert tuple(loaded.model.decoder.layers[0].fc1.weight.shape) == (1024, 32)  # its quarter of the whole (4096, 32)


def checkpoint_bytes(model_dir: Path) -> tuple[int, int]:
    """The float32 checkpoint's bytes, and its largest tensor's."""
    sizes = [t.numel() * 4 for t in load_file(str(model_dir / "model.safetensors")).values()]
    return sum(sizes), max(sizes)


def test_a_tensor_parallel_rank_needs_host_memory_for_its_share_and_its_machines_other_ranks_for_theirs(
    wide_opt, monkeypatch
):
    """The whole checkpoint was counted against each rank's host memory, even a rank alone on its machine
    (torchrun over several machines); the ranks of one machine share its memory, so their shares add up."""
    import pluginhost.checkpoint

    total, largest = checkpoint_bytes(wide_opt)
    # Rank 0's share (87,384 of 299,424 elements) and the tensor it cuts it from fit; the whole checkpoint does not.
    monkeypatch.setattr(pluginhost.checkpoint, "_available_memory", lambda: total * 7 // 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert build_rank_0_of_4(wide_opt).model.decoder.layers[0].fc1.weight.shape[0] == 1024
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    shares = r"The weights need [1-9]\d* [KM]iB \(4 tensor-parallel ranks on this machine\)"
    with pytest.raises(PluginhostError, match=shares):
        build_rank_0_of_4(wide_opt)


def test_weights_for_a_gpu_need_its_free_memory_and_host_memory_only_for_a_tensor_in_passing(tiny_opt, monkeypatch):
    """The whole checkpoint was counted against host memory, though a GPU's weights pass through it one at a time;
    the GPU's own memory was not asked. (No GPU needed: the check runs before any tensor is read.)"""
    import pluginhost.checkpoint as checkpoint

    gib, cuda = 2**30, torch.device("cuda", 0)
    monkeypatch.setattr(checkpoint, "_available_memory", lambda: 3 * gib)
    # Through the reader: refused for the GPU's memory before anything is read (or sent to a GPU there is not).
    total, _ = checkpoint_bytes(tiny_opt)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total // 2, 140 * gib))  # (free, total)
    with pytest.raises(PluginhostError, match=r"on cuda:0 and only [1-9]\d* [KM]iB of its memory is free"):
        next(checkpoint.find_checkpoint(tiny_opt).tensors(dtype=torch.float32, device=cuda))
    # The arithmetic, in GiB.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * gib, 140 * gib))
    checkpoint._check_memory(10 * gib, gib, cuda)  # 11 GiB on the GPU, 1 GiB at a time through the host
    with pytest.raises(PluginhostError, match=r"The weights need 11.0 GiB in memory and only 3.0 GiB"):
        checkpoint._check_memory(10 * gib, gib, torch.device("cpu"))
    with pytest.raises(PluginhostError, match=r"pass through host memory one tensor at a time: that needs 4.0 GiB \("):
        checkpoint._check_memory(10 * gib, gib, cuda, sharers=4)  # four ranks' tensors in passing at once
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (9 * gib, 140 * gib))
    with pytest.raises(PluginhostError, match=r"need 11.0 GiB on cuda:0 and only 9.0 GiB of its memory is free"):
        checkpoint._check_memory(10 * gib, gib, cuda)
