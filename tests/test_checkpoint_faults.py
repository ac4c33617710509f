"""Broken model directories: one clear error each, exit status 2, and the directory untouched."""

from __future__ import annotations

import hashlib
import json
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


def remove_config(d: Path) -> None:
    (d / "config.json").unlink()


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
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))


FAULTS = {
    "missing tensor": (drop_tensor, "lacks 1 tensor(s) the model needs: decoder.layers.1.fc2.weight"),
    "missing part of q/k/v": (
        drop_stacked_part,
        "decoder.layers.0.self_attn.qkv_proj.bias (stacked from q_proj, k_proj, v_proj; no k_proj)",
    ),
    "wrong shape of q/k/v": (
        reshape_stacked_part,
        "model.decoder.layers.1.self_attn.v_proj.weight: checkpoint shape (31, 32), model (32, 32) "
        "(the v_proj part of decoder.layers.1.self_attn.qkv_proj.weight)",
    ),
    "extra tensor": (add_tensor, "unexpected tensors (not in OPTForCausalLM): model.decoder.layers.0.extra.weight"),
    "wrong shape": (reshape_tensor, "model.decoder.layers.0.fc1.weight: checkpoint shape (64, 31), model (64, 32)"),
    "wrong dtype": (
        integer_tensor,
        "model.decoder.layers.0.fc1.bias: checkpoint dtype torch.int32, model torch.float32",
    ),
    "truncated safetensors": (truncate, "it is not a valid safetensors file"),
    "corrupt safetensors": (garbage, "it is not a valid safetensors file"),
    "missing config.json": (remove_config, "config.json is missing"),
    "invalid JSON": (invalid_json, "config.json is not valid JSON"),
    "no architectures": (no_architectures, "config.json names no architecture"),
    "unknown architecture": (unknown_architecture, "Did you mean 'OPTForCausalLM'"),
    "no weights": (no_weights, "No weights in"),
    "index naming a missing shard": (bad_index, "lists shard(s) that are missing: model-00002.safetensors"),
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


def test_bin_with_pickled_code_is_refused_and_the_code_never_runs(tiny_opt_no_tokenizer, tmp_path, capsys):
    model = tmp_path / "evil"
    model.mkdir()
    shutil.copy(tiny_opt_no_tokenizer / "config.json", model / "config.json")
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
    assert "it holds pickled objects other than tensors" in capsys.readouterr().err
    assert not marker.exists()
    assert snapshot(model) == before
