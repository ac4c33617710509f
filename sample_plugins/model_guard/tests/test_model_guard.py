"""The model guard, tested with pluginhost's pytest fixtures."""

import shutil

import pluginhost_model_guard
import pytest
from safetensors.torch import load_file, save_file

from pluginhost import hookimpl
from pluginhost.errors import PluginHookError


def test_reports_the_loaded_model(make_engine, hook_recorder):
    llm = make_engine(pluginhost_model_guard)
    report = llm.model.guard_report
    assert report["parameters"] == sum(p.numel() for p in set(llm.model.parameters()))
    assert report["bytes"] == report["parameters"] * 4 and report["dtype"] == "torch.float32"
    assert hook_recorder.last("post_load").plugins == ("pluginhost_model_guard",)


class StoresWeightsInBuffers:
    """What a quantizing plugin does first (``int8_quant``): fc1's weight becomes an int8 buffer and float scales."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    @hookimpl(tryfirst=True)
    def post_load(self, config, model):
        import torch

        layer = model.decoder.layers[0].fc1
        weight = layer.weight.detach()
        del layer.weight
        layer.register_buffer("qweight", weight.to(torch.int8))
        layer.register_buffer("scales", torch.full((weight.shape[0],), self.scale))


def test_counts_and_checks_weights_another_plugin_keeps_in_buffers(make_engine):
    # The report left them out (int8_quant's model showed a fraction of its size), and so did the NaN check.
    llm = make_engine(pluginhost_model_guard, StoresWeightsInBuffers(0.5))
    fc1 = llm.model.decoder.layers[0].fc1
    parameters = sum(p.numel() for p in set(llm.model.parameters()))
    assert llm.model.guard_report["parameters"] == parameters + fc1.qweight.numel() + fc1.scales.numel()
    with pytest.raises(PluginHookError, match=r"NaN or infinite values in decoder.layers.0.fc1.scales"):
        make_engine(pluginhost_model_guard, StoresWeightsInBuffers(float("nan")))


def test_refuses_denied_architectures_before_loading(make_engine, monkeypatch):
    monkeypatch.setenv("PLUGINHOST_GUARD_DENY", "OPTForCausalLM")
    with pytest.raises(PluginHookError, match="OPTForCausalLM is denied on this site") as info:
        make_engine(pluginhost_model_guard)
    assert info.value.hook == "pre_load"


def test_refuses_a_denied_architecture_served_by_another_plugins_class(make_engine, monkeypatch):
    from builtin_models.opt import OPTForCausalLM
    from pluginhost.testing.plugins import RegistersModel

    class SiteOPT(OPTForCausalLM):  # another plugin's class for the denied architecture
        pass

    monkeypatch.setenv("PLUGINHOST_GUARD_DENY", "OPTForCausalLM")
    with pytest.raises(PluginHookError, match="OPTForCausalLM is denied on this site"):
        make_engine(pluginhost_model_guard, RegistersModel("OPTForCausalLM", SiteOPT))


def test_refuses_a_denied_architecture_however_the_model_is_named(make_engine, monkeypatch, tiny_opt_dir, tmp_path):
    # Another plugin's class serves it, so only the checkpoint's architecture gives it away: a path given with ~
    # (which the engine expands) and an architecture from hf_overrides slipped past the guard.
    from builtin_models.opt import OPTForCausalLM
    from pluginhost.testing.plugins import RegistersModel

    class SiteOPT(OPTForCausalLM):
        pass

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(tiny_opt_dir, tmp_path / "opt")
    monkeypatch.setenv("PLUGINHOST_GUARD_DENY", "OPTForCausalLM")
    serves = RegistersModel("OPTForCausalLM", SiteOPT)
    with pytest.raises(PluginHookError, match="OPTForCausalLM is denied on this site"):
        make_engine(pluginhost_model_guard, serves, model="~/opt")
    monkeypatch.setenv("PLUGINHOST_GUARD_DENY", "SiteArchitecture")
    renamed = RegistersModel("SiteArchitecture", SiteOPT)
    with pytest.raises(PluginHookError, match="SiteArchitecture is denied on this site"):
        make_engine(pluginhost_model_guard, renamed, hf_overrides={"architectures": ["SiteArchitecture"]})


def test_refuses_non_finite_weights(make_engine, tiny_opt_dir, tmp_path):
    broken = tmp_path / "nan-model"
    shutil.copytree(tiny_opt_dir, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["model.decoder.layers.0.fc1.weight"][0, 0] = float("nan")
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(PluginHookError, match=r"NaN or infinite values in decoder.layers.0.fc1.weight") as info:
        make_engine(pluginhost_model_guard, model=str(broken))
    assert info.value.hook == "post_load"
