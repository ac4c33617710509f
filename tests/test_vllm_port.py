"""vLLM's out-of-tree model tests, ported the way a plugin author would port them.

``sample_plugins/vllm_add_dummy_model`` is vLLM's own test plugin with its
imports and entry-point group changed, installed here by pip as a real
distribution. The tests below are vLLM's ``tests/models/test_oot_registration.py``
with the same changes (``VLLM_PLUGINS`` -> ``PLUGINHOST_PLUGINS``, vLLM's opt-125m
config copy -> a tiny OPT with the same ``architectures`` edit), plus what a
user meets around them: the CLI, in-process use, the guard vLLM plugins write,
and the compute_logits signature vLLM used to have.
"""

from __future__ import annotations

import importlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from builtin_models.opt import OPTForCausalLM
from pluginhost import LLM, ModelRegistry, SamplingParams
from pluginhost.errors import ConfigError
from pluginhost.testing import RegistersModel, make_tiny_opt

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_SOURCE = ROOT / "sample_plugins" / "vllm_add_dummy_model"


@pytest.fixture(scope="session")
def dummy_plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vllm_add_dummy_model installed by pip (a wheel built from its setup.py) into a folder of its own."""
    work = tmp_path_factory.mktemp("vllm-dummy-plugin")
    source = work / "source"
    shutil.copytree(PLUGIN_SOURCE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = work / "site-packages"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(site), str(source)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    return site


@pytest.fixture
def dummy_plugin(dummy_plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The installed plugin visible to this process, as if pip had put it into site-packages."""
    monkeypatch.syspath_prepend(str(dummy_plugin_site))
    importlib.invalidate_caches()
    yield dummy_plugin_site
    for name in [m for m in sys.modules if m.split(".")[0] == "vllm_add_dummy_model"]:
        del sys.modules[name]


@pytest.fixture(scope="session")
def dummy_opt_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """vLLM's fixture: an OPT checkpoint whose config.json names ``MyOPTForCausalLM``."""
    path = make_tiny_opt(tmp_path_factory.mktemp("dummy-opt"))
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MyOPTForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


# -- vLLM's tests/models/test_oot_registration.py, ported ------------------------------------


def test_plugin(dummy_plugin, monkeypatch: pytest.MonkeyPatch, dummy_opt_path: str):
    with monkeypatch.context() as m:
        m.setenv("PLUGINHOST_PLUGINS", "")

        with pytest.raises(ValueError, match="'MyOPTForCausalLM' is not registered"):
            LLM(model=dummy_opt_path)


def test_oot_registration_text_generation(dummy_plugin, monkeypatch: pytest.MonkeyPatch, dummy_opt_path: str):
    with monkeypatch.context() as m:
        m.setenv("PLUGINHOST_PLUGINS", "register_dummy_model")
        prompts = ["Hello, my name is", "The text does not matter"]
        sampling_params = SamplingParams(temperature=0)
        llm = LLM(model=dummy_opt_path)
        first_token = llm.get_tokenizer().decode(0)
        outputs = llm.generate(prompts, sampling_params)

        for output in outputs:
            generated_text = output.outputs[0].text
            # make sure only the first token is generated
            rest = generated_text.replace(first_token, "")
            assert rest == ""
            # Stronger than vLLM's check, whose first token (<s>) is special and decodes to "" anyway:
            assert output.outputs[0].token_ids == [0] * 16


def test_oot_registration_in_memory(dummy_plugin):
    """vLLM's older form of the same test: the program itself registers, overriding a builtin."""
    from vllm_add_dummy_model.my_opt import MyOPTForCausalLM

    ModelRegistry.register_model("OPTForCausalLM", MyOPTForCausalLM)
    prompts = ["Hello, my name is", "The text does not matter"]
    llm = LLM(model=str(make_tiny_opt(dummy_plugin.parent / "plain-opt")), load_installed_plugins=False)
    for output in llm.generate(prompts, SamplingParams(temperature=0)):
        assert output.outputs[0].token_ids == [0] * 16


# -- around them: what a porter meets ------------------------------------------------------


def test_the_register_function_works_in_process_too(dummy_plugin, dummy_opt_path: str):
    from vllm_add_dummy_model import register

    llm = LLM(model=dummy_opt_path, plugins=[register], load_installed_plugins=False)
    assert type(llm.model).__name__ == "MyOPTForCausalLM"
    assert llm.generate([[2, 7]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids == [0, 0, 0]
    assert "MyOPTForCausalLM" in ModelRegistry.get_supported_archs()  # listed, as every registration made so far
    with pytest.raises(ValueError, match="not registered"):  # it belongs to the engines passing register alone
        LLM(model=dummy_opt_path, load_installed_plugins=False)


def test_the_register_function_works_in_process_after_the_installed_plugin_ran(dummy_plugin, dummy_opt_path: str):
    """The error below advises plugins=[register]: it must work whichever engine called register() first."""
    from vllm_add_dummy_model import register

    assert type(LLM(model=dummy_opt_path).model).__name__ == "MyOPTForCausalLM"  # installed, loaded
    llm = LLM(model=dummy_opt_path, plugins=[register], load_installed_plugins=False)
    assert llm.generate([[2, 7]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids == [0, 0, 0]


def test_the_guard_and_a_second_register_call_are_silent(dummy_plugin, caplog: pytest.LogCaptureFixture):
    from vllm_add_dummy_model import register
    from vllm_add_dummy_model.my_opt import MyOPTForCausalLM

    assert "OPTForCausalLM" in ModelRegistry.get_supported_archs()  # builtins are listed, as in vLLM
    with caplog.at_level(logging.INFO, logger="pluginhost"):
        register()
        register()
    assert caplog.records == []
    entry = ModelRegistry.get("MyOPTForCausalLM")
    assert entry.model_class is MyOPTForCausalLM
    assert (entry.registered_by.name, entry.registered_by.distribution) == (
        "register_dummy_model",
        "vllm_add_dummy_model",
    )


def test_a_registration_by_a_plugin_this_engine_does_not_load_is_explained(dummy_plugin, dummy_opt_path: str):
    """vLLM's tests call the installed plugin's register() themselves; here it counts where the plugin is loaded."""
    from vllm_add_dummy_model import register

    register()
    assert "MyOPTForCausalLM" in ModelRegistry.get_supported_archs()
    with pytest.raises(
        ValueError,
        match=r"registered in this process by code of plugin 'register_dummy_model'.*"
        r"does not load.*plugins=\[register\]",
    ):
        LLM(model=dummy_opt_path, load_installed_plugins=False)


SOFTCAP_PLUGIN = """
import torch
from builtin_models.opt import OPTForCausalLM  # was: from vllm.model_executor.models.opt import OPTForCausalLM

def register():
    original = OPTForCausalLM.compute_logits

    def compute_logits(self, hidden_states):
        return 2.0 * torch.tanh(original(self, hidden_states) / 2.0)  # Gemma-2's soft-capping

    OPTForCausalLM.compute_logits = compute_logits
"""


def test_a_general_plugin_that_patches_the_model_patches_it_once(install_plugin, monkeypatch, tiny_opt):
    """vLLM's plugins_loaded guard: register() runs once per process, not once per engine (patches piled up)."""
    monkeypatch.setattr(OPTForCausalLM, "compute_logits", OPTForCausalLM.compute_logits)  # undone after the test
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=0)

    def logprob() -> float:
        out = LLM(str(tiny_opt)).generate([[2, 5, 9]], params)[0]
        return out.logprobs[0][out.token_ids[0]]

    plain = logprob()
    install_plugin("softcap", SOFTCAP_PLUGIN, target="softcap:register")
    capped = [logprob() for _ in range(3)]
    assert capped[0] != pytest.approx(plain, abs=1e-3)  # the patch is there
    assert capped == [capped[0]] * 3  # and there once


def test_the_test_kit_applies_what_the_test_registered_itself(dummy_plugin, make_engine, model_registry):
    """A vLLM test calls the plugin's register() and builds: the same installed or from a source checkout."""
    from vllm_add_dummy_model import register

    register()
    assert "MyOPTForCausalLM" in model_registry.get_supported_archs()
    llm = make_engine(model_architecture_override="MyOPTForCausalLM")
    assert llm.generate([[2, 7]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids == [0, 0, 0]


AUTHOR_TESTS = """
import pytest
from pluginhost import LLM, SamplingParams
from vllm_add_dummy_model import register

GREEDY = SamplingParams(temperature=0, max_tokens=3)


@pytest.fixture(scope="session")
def installed_llm(tiny_opt_dir):  # the plugin as users get it: installed, loaded by LLM()
    return LLM(str(tiny_opt_dir), model_architecture_override="MyOPTForCausalLM")


def test_installed(installed_llm):
    assert installed_llm.generate([[2, 7]], GREEDY)[0].token_ids == [0, 0, 0]


def test_register_called_directly(make_engine, model_registry):
    register()
    assert "MyOPTForCausalLM" in model_registry.get_supported_archs()
    llm = make_engine(model_architecture_override="MyOPTForCausalLM")
    assert llm.generate([[2, 7]], GREEDY)[0].token_ids == [0, 0, 0]


def test_in_process(make_engine):
    llm = make_engine(register, model_architecture_override="MyOPTForCausalLM")
    assert llm.generate([[2, 7]], GREEDY)[0].token_ids == [0, 0, 0]
"""


@pytest.mark.parametrize("order", ["installed first", "installed last"])
def test_a_plugin_authors_kit_tests_pass_in_any_order(dummy_plugin_site: Path, tmp_path: Path, order: str):
    """A plain LLM() earlier in the session (loading the installed plugin) must not change what the kit's tests see."""
    head, installed, rest = re.split(r"\n(?=def test_)", AUTHOR_TESTS, maxsplit=2)
    code = "\n".join([head, installed, rest] if order == "installed first" else [head, rest, installed])
    (tmp_path / "test_author.py").write_text(code)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "test_author.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(dummy_plugin_site), *sys.path])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "3 passed" in result.stdout


def test_an_unguarded_register_function_applied_to_every_engine_is_silent(install_plugin, caplog, tiny_opt):
    install_plugin(
        "unguarded",
        "from pluginhost import ModelRegistry\n"
        "def register():\n"
        "    ModelRegistry.register_model('OPTForCausalLM', 'builtin_models.opt:OPTForCausalLM')\n",
        target="unguarded:register",
    )
    with caplog.at_level(logging.INFO, logger="pluginhost.registry"):
        for _ in range(2):
            LLM(str(tiny_opt))  # the first load calls register(), the second replays what it registered
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []  # overriding a builtin is what registration is for: logged, not warned about
    entry = ModelRegistry.get("OPTForCausalLM")
    assert entry.registered_by.name == "unguarded" and [o.registered_by.name for o in entry.overrides] == [
        "builtin_models"
    ]


def test_builtins_are_listed_in_a_fresh_process():
    code = "from pluginhost import ModelRegistry; print(ModelRegistry.get_supported_archs())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "OPTForCausalLM" in result.stdout


def test_vllms_older_compute_logits_signature_is_refused_when_resolved(tiny_opt):
    class OldStyleOPT(OPTForCausalLM):
        def compute_logits(self, hidden_states: torch.Tensor, sampling_metadata) -> torch.Tensor:
            return super().compute_logits(hidden_states)

    with pytest.raises(ValueError) as info:
        LLM(str(tiny_opt), plugins=[RegistersModel("OPTForCausalLM", OldStyleOPT)], load_installed_plugins=False)
    message = str(info.value)
    assert "OldStyleOPT" in message and "registered by plugin 'RegistersModel'" in message
    assert "defines compute_logits(self, hidden_states, sampling_metadata)" in message
    assert "calls compute_logits(hidden_states)" in message


def test_a_plugin_left_in_vllms_entry_point_group_is_named_when_its_architecture_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_opt
):
    """A port that kept vllm.general_plugins loads nothing: the unknown architecture says where the plugin is."""
    site = tmp_path / "site-packages"
    (site / "left_behind-0.1.dist-info").mkdir(parents=True)
    (site / "left_behind-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: left-behind\nVersion: 0.1\n"
    )
    (site / "left_behind-0.1.dist-info" / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nregister_left = left_behind:register\n"
    )
    (site / "left_behind.py").write_text("raise ImportError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setenv("VLLM_PLUGINS", "register_left")
    with pytest.raises(ValueError) as info:
        LLM(str(tiny_opt), model_architecture_override="LeftArch")
    message = str(info.value)
    assert "Architecture 'LeftArch' is not registered" in message
    assert "in vLLM's group vllm.general_plugins, which pluginhost does not read: register_left = " in message
    assert "left_behind:register (distribution left-behind)" in message
    assert "move it to the group pluginhost.plugins" in message
    assert "VLLM_PLUGINS is set but not read: pluginhost's selection is PLUGINHOST_PLUGINS" in message
    assert "left_behind" not in sys.modules


def test_vllms_v1_model_constructor_is_refused_when_resolved(tiny_opt):
    class V1InitOPT(OPTForCausalLM):
        def __init__(self, *, vllm_config, prefix: str = "") -> None:
            super().__init__(vllm_config)

    with pytest.raises(ValueError) as info:
        LLM(str(tiny_opt), plugins=[RegistersModel("OPTForCausalLM", V1InitOPT)], load_installed_plugins=False)
    message = str(info.value)
    assert "V1InitOPT" in message and "registered by plugin 'RegistersModel'" in message
    assert "defines __init__(self, *, vllm_config, prefix)" in message
    assert "constructs a model with the Hugging Face config alone, as V1InitOPT(config)" in message
    assert "'What does not port' in docs/porting-from-vllm.md" in message
    assert "TypeError" not in message


class VllmForwardOPT(OPTForCausalLM):
    """vLLM's forward: the engine's cache rows and mask would land in the last two parameters and be dropped."""

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return super().forward(input_ids, positions)


class ShortForwardOPT(OPTForCausalLM):
    """A forward that cannot take the engine's arguments at all."""

    def forward(self, input_ids, positions):
        return super().forward(input_ids, positions)


@pytest.mark.parametrize(
    ("model_class", "signature", "why"),
    [
        (
            VllmForwardOPT,
            "forward(self, input_ids, positions, intermediate_tensors, inputs_embeds)",
            "would arrive as intermediate_tensors and inputs_embeds",
        ),
        (ShortForwardOPT, "forward(self, input_ids, positions)", "it cannot take them"),
    ],
)
def test_a_forward_that_cannot_take_the_engines_arguments_is_refused_when_resolved(
    tiny_opt, model_class, signature, why
):
    """Not wrong tokens (vLLM's signature) or an internal error at the first step (too few parameters)."""
    with pytest.raises(ValueError) as info:
        LLM(str(tiny_opt), plugins=[RegistersModel("OPTForCausalLM", model_class)], load_installed_plugins=False)
    message = str(info.value)
    assert model_class.__name__ in message and "registered by plugin 'RegistersModel'" in message
    assert f"defines {signature}" in message and why in message
    assert "Write forward(self, input_ids, positions, cache_rows=None, mask=None)" in message
    assert "'What does not port' in docs/porting-from-vllm.md" in message


class CallsItselfOPT(OPTForCausalLM):
    """Answers the call itself, passing the engine's four arguments on to a forward of another shape."""

    def __call__(self, input_ids, positions, cache_rows=None, mask=None):
        return self.forward(input_ids, (positions, cache_rows, mask))

    def forward(self, input_ids, state):
        return super().forward(input_ids, *state)


def test_a_model_answering_the_call_itself_is_not_refused_for_its_forward(tiny_opt):
    # It was refused: the check bound the engine's arguments to forward, which the engine never calls directly.
    llm = LLM(str(tiny_opt), plugins=[RegistersModel("OPTForCausalLM", CallsItselfOPT)], load_installed_plugins=False)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    plain = LLM(str(tiny_opt), load_installed_plugins=False)
    assert llm.generate([[2, 5]], params)[0].token_ids == plain.generate([[2, 5]], params)[0].token_ids


VLLM_PROCESSOR_IMPORTS = """
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor, BatchUpdate, BatchUpdateBuilder, LogitsProcessor
from vllm.v1.sample.logits_processor import MoveDirectionality
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllm.v1.sample.logits_processor.state import BatchUpdateBuilder
"""


def test_vllms_logits_processor_imports_port_by_changing_the_package_name():
    """The porting guide's rule, for every module path a vLLM v1 processor (or its test) imports from."""
    exec(VLLM_PROCESSOR_IMPORTS.replace("vllm.v1.sample.logits_processor", "pluginhost.logits_processors"), {})


def test_a_processor_driven_by_vllms_batch_update_builder_follows_the_batch():
    """vLLM's processor tests build each step's BatchUpdate with BatchUpdateBuilder: the same code runs here."""
    from pluginhost.logits_processors.builtin import process_dict_updates
    from pluginhost.logits_processors.interface import BatchUpdate, LogitsProcessor, MoveDirectionality
    from pluginhost.logits_processors.state import BatchUpdateBuilder

    class TargetToken(LogitsProcessor):  # vLLM's DummyLogitsProcessor, imports changed
        def __init__(self, vllm_config, device, is_pin_memory):
            self.req_info: dict[int, int] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            process_dict_updates(self.req_info, batch_update, lambda params, _, __: (params.extra_args or {}).get("t"))

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            for row, token in self.req_info.items():
                kept = logits[row, token].clone()
                logits[row] = float("-inf")
                logits[row, token] = kept
            return logits

    def winners(processor: TargetToken, batch_size: int) -> list[int]:
        return processor.apply(torch.zeros(batch_size, 8)).argmax(-1).tolist()

    processor, builder = TargetToken(None, torch.device("cpu"), False), BatchUpdateBuilder()
    for row, target in enumerate([5, 3, None]):
        builder.added.append((row, SamplingParams(extra_args={"t": target} if target else None), [2], []))
    processor.update_state(builder.get_and_reset(batch_size=3))
    assert winners(processor, 3) == [5, 3, 0]
    assert builder.get_and_reset(batch_size=3) is None  # nothing changed since

    builder.removed_append(1)
    builder.removed_append(0)
    assert builder.pop_removed() == 0  # the lowest row, which the newcomer takes
    builder.added.append((0, SamplingParams(extra_args={"t": 7}), [2], []))
    builder.moved.append((2, 1, MoveDirectionality.UNIDIRECTIONAL))  # compacted: row 2 fills the hole at 1
    update = builder.get_and_reset(batch_size=2)
    assert (update.removed, update.batch_size) == ([1], 2)
    processor.update_state(update)
    assert winners(processor, 2) == [7, 0]
    builder.removed_append(1)
    assert builder.removed == [1]
    with pytest.raises(RuntimeError, match="after self.removed has been read"):  # vLLM's rule for one step
        builder.removed_append(0)


def test_the_installed_plugin_through_the_cli(dummy_plugin_site: Path, dummy_opt_path: str, run_pluginhost):
    def run_cli(*args: str):
        path = os.pathsep.join([str(dummy_plugin_site), *sys.path])
        return run_pluginhost(*args, env={"PYTHONPATH": path}, timeout=120)

    listing = run_cli("plugins", "--json")
    assert listing.returncode == 0, listing.stderr
    record = next(r for r in json.loads(listing.stdout) if r["name"] == "register_dummy_model")
    assert (record["status"], record["hooks"], record["version"]) == ("loaded", ["register"], "0.1")

    models = run_cli("models", "--json")
    row = next(r for r in json.loads(models.stdout) if r["architecture"] == "MyOPTForCausalLM")
    assert (row["implementation"], row["registered_by"]) == (
        "vllm_add_dummy_model.my_opt:MyOPTForCausalLM",
        "register_dummy_model",
    )

    generated = run_cli("generate", "--model", dummy_opt_path, "--prompt", "Hello", "--max-tokens", "4", "--json")
    assert generated.returncode == 0, generated.stderr
    assert json.loads(generated.stdout)[0]["token_ids"] == [0, 0, 0, 0]

    disabled = run_cli(
        "generate",
        "--model",
        dummy_opt_path,
        "--prompt",
        "Hello",
        "--disable-plugin",
        "register_dummy_model",
    )
    assert disabled.returncode == 2
    assert "Architecture 'MyOPTForCausalLM' is not registered" in disabled.stderr
    assert "Traceback" not in disabled.stderr


def test_lm_evals_loglikelihood_requests_port_by_changing_the_import(tiny_opt):
    """lm-eval's vLLM backend scores a continuation with ``prompt_logprobs=1, max_tokens=1, detokenize=False`` and
    reads each entry through ``getattr(logprob, "logprob", logprob)``: pluginhost's floats read as vLLM's Logprobs."""
    from transformers import AutoModelForCausalLM

    from pluginhost import TokensPrompt  # lm-eval's `from vllm import LLM, SamplingParams, TokensPrompt`

    context, continuation = [2, 17, 200, 31, 99], [5, 64, 11]
    params = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
    # lm-eval's engine and call, as they are: max_num_seqs (its max_batch_size) and lora_request None unless given
    llm = LLM(str(tiny_opt), load_installed_plugins=False, max_num_seqs=None, max_num_batched_tokens=None, seed=1234)
    assert llm.config.max_num_seqs == 32 and llm.config.provenance["max_num_seqs"] == "default"
    prompt = TokensPrompt(prompt_token_ids=context + continuation)
    output = llm.generate([prompt], sampling_params=params, use_tqdm=False, lora_request=None)[0]
    # lm-eval's _parse_logprobs, as it is
    dicts = [
        {token: getattr(logprob, "logprob", logprob) for token, logprob in step.items()} if step is not None else None
        for step in output.prompt_logprobs
    ]
    tokens = context + continuation
    score = sum(step.get(token) for token, step in zip(tokens[len(context) :], dicts[len(context) :], strict=True))
    is_greedy = all(max(step, key=step.get) == token for token, step in zip(tokens[5:], dicts[5:], strict=True))
    reference = AutoModelForCausalLM.from_pretrained(tiny_opt, dtype=torch.float32).eval()
    with torch.no_grad():
        steps = reference(torch.tensor([tokens])).logits[0, :-1].float().log_softmax(-1)  # position p predicts p + 1
    expected = sum(float(steps[p - 1, tokens[p]]) for p in range(len(context), len(tokens)))
    assert score == pytest.approx(expected, abs=1e-4)
    assert is_greedy == all(int(steps[p - 1].argmax()) == tokens[p] for p in range(len(context), len(tokens)))
    assert output.outputs[0].text == "" and len(output.outputs[0].token_ids) == 1  # as vLLM: no text, not None
    said = llm.generate([{"prompt_token_ids": tokens}], params.clone(detokenize=True, max_tokens=6, ignore_eos=True))
    assert said[0].outputs[0].text and said[0].outputs[0].token_ids[0] == output.outputs[0].token_ids[0]
    with pytest.raises(ValueError, match="stop strings are looked for in the text, which detokenize=False leaves out"):
        SamplingParams(detokenize=False, stop=["."])
    with pytest.raises(ValueError, match="lora_request=.* is not supported by pluginhost .*only None") as refused:
        llm.generate([[2, 5]], params, lora_request=object())
    assert refused.value.param == "lora_request"
    assert llm.generate([[2, 5]], params, priority=[0])[0].outputs[0].token_ids  # vLLM's default priority
    with pytest.raises(ValueError, match="priority is not supported by pluginhost"):
        llm.generate([[2, 5]], params, priority=[1])
    with pytest.raises(ValueError, match=r"priority lists 1 priorities for 2 prompt\(s\): give one per prompt"):
        llm.generate([[2, 5], [2, 6]], params, priority=[0])  # vLLM refuses it too
    with pytest.raises(ValueError, match="priority must be a list of ints, one per prompt, got int"):
        llm.generate([[2, 5]], params, priority=0)


def test_vllms_async_generate_arguments_at_their_defaults_are_taken(tiny_opt):
    """vLLM's ``AsyncLLM.generate(prompt, params, request_id, lora_request=None, priority=0)``."""
    import asyncio

    from pluginhost import AsyncLLM, TextPrompt

    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False)

    async def last(prompt, **vllm_arguments):
        params = SamplingParams(max_tokens=3, temperature=0)
        return [out async for out in engine.generate(prompt, params, "r", **vllm_arguments)][-1]

    try:
        taken = asyncio.run(last(TextPrompt(prompt="Hello"), lora_request=None, priority=0))
        assert taken.outputs[0].token_ids == asyncio.run(last("Hello")).outputs[0].token_ids
        with pytest.raises(ValueError, match=r"priority=2 is not supported by pluginhost .*: leave it 0") as refused:
            asyncio.run(last("Hello", priority=2))
        assert refused.value.param == "priority"
        with pytest.raises(ValueError, match=r"priority=array\(\[0, 0\]\) is not supported by pluginhost"):
            asyncio.run(last("Hello", priority=np.zeros(2, dtype=int)))  # was NumPy's "truth value ... ambiguous"
    finally:
        engine.shutdown()


#: What ports pass to vLLM's ``LLM()`` for vLLM's own machinery, at values that ask for nothing else.
VLLM_SETTINGS_AT_NEUTRAL = {
    "trust_remote_code": False,
    "tokenizer_mode": "auto",
    "revision": None,
    "download_dir": None,
    "load_format": "auto",
    "quantization": None,
    "kv_cache_dtype": "auto",
    "gpu_memory_utilization": np.float32(0.9),  # read from a NumPy-typed config: 0.8999999761581421
    "swap_space": 0,  # any: nothing is swapped
    "cpu_offload_gb": np.int64(0),
    "enforce_eager": None,  # vLLM 0.6-0.7's "unset"
    "max_seq_len_to_capture": 8192,
    "block_size": 16,
    "hf_token": None,
    "allowed_local_media_path": "",
    "disable_async_output_proc": False,
    "pipeline_parallel_size": 1,
    "distributed_executor_backend": None,
    "enable_lora": False,
    "task": "generate",
    "enable_prefix_caching": True,
    "enable_chunked_prefill": False,
    "disable_log_stats": True,
}


def test_a_ports_vllm_settings_at_values_asking_nothing_else_build_the_same_engine(tiny_opt, llm, make_engine):
    # They were each an "unknown setting": a port had to find and drop every one.
    params = SamplingParams(max_tokens=8, temperature=0)
    ported = LLM(str(tiny_opt), load_installed_plugins=False, tokenizer=str(tiny_opt), **VLLM_SETTINGS_AT_NEUTRAL)
    assert ported.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids == (
        llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
    )
    assert ported.engine.loaded.config.model_dump() == llm.engine.loaded.config.model_dump()  # nothing reached it
    make_engine(model=str(tiny_opt), enforce_eager=True, gpu_memory_utilization=0.9)  # the test kit's engines too


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"kv_cache_dtype": "fp8"},
            r"kv_cache_dtype: 'fp8' is not a KV cache dtype pluginhost runs: use 'auto'",
        ),
        ({"cpu_offload_gb": 4}, r"cpu_offload_gb: 4 is not supported: the weights stay on the model's device"),
        ({"trust_remote_code": True}, r"trust_remote_code: True .*never runs code from a model directory"),
        ({"gpu_memory_utilization": 0.5}, r"gpu_memory_utilization: 0.5 .*the KV cache grows as sequences need it"),
        ({"quantization": "awq"}, r"quantization: 'awq' .*taken as None only"),
        ({"load_format": "dummy"}, r"load_format: 'dummy' .*build a tiny checkpoint"),
        ({"tokenizer": "/some/other/tokenizer"}, r"tokenizer: '/some/other/tokenizer' .*the model directory's own"),
        ({"enforce_eager": 1}, r"enforce_eager: 1 .*taken as True or False or None only"),
        ({"enforce_eager": True, "compile_decode": True}, r"enforce_eager: True asks for eager decoding"),
    ],
)
def test_a_vllm_setting_asking_for_what_pluginhost_does_not_do_is_refused_by_name(
    tiny_opt, given, message, install_plugin, tmp_path
):
    marker = tmp_path / "plugin-loaded"
    install_plugin("watching", f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(ConfigError, match=r"^Invalid engine settings: " + message):
        LLM(str(tiny_opt), **given)
    assert not marker.exists()  # refused before any plugin loaded


def test_both_refusals_of_a_port_are_said_at_once_and_unknown_settings_stay_unknown(tiny_opt):
    with pytest.raises(ConfigError) as info:
        LLM(str(tiny_opt), load_installed_plugins=False, cpu_offload_gb=4, pipeline_parallel_size=2)
    assert "cpu_offload_gb: 4" in str(info.value) and "pipeline_parallel_size: 2" in str(info.value)
    with pytest.raises(ConfigError, match="max_len: unknown setting"):
        LLM(str(tiny_opt), load_installed_plugins=False, max_len=3, gpu_memory_utilization=0.9)


def test_generate_takes_vllms_use_tqdm(tiny_opt):
    """``use_tqdm=False`` is in most vLLM scripts; a callable makes the bar, which counts every prompt done."""
    from tqdm import tqdm

    llm = LLM(str(tiny_opt), load_installed_plugins=False)
    params = SamplingParams(max_tokens=3, temperature=0)
    quiet = llm.generate([[2, 5], [2, 6, 7]], params, use_tqdm=False)
    bars: list[tqdm] = []

    def make_bar(**kwargs) -> tqdm:
        bars.append(tqdm(**kwargs, file=io.StringIO()))  # the caller's settings: drawn, even off a terminal
        return bars[-1]

    shown = llm.generate([[2, 5], [2, 6, 7]], params, use_tqdm=make_bar)
    assert [o.token_ids for o in shown] == [o.token_ids for o in quiet]
    assert len(bars) == 1 and bars[0].n == bars[0].total == 2 and bars[0].desc.startswith("Processed prompts")
    assert "2/2" in bars[0].fp.getvalue()
    before = len(llm.engine._live)
    with pytest.raises(KeyError, match="no_such_setting"):  # a bar that cannot be made: nothing was submitted
        llm.generate([[2, 5]], params, use_tqdm=lambda **kwargs: tqdm(**kwargs, no_such_setting=1))
    assert len(llm.engine._live) == before


# -- a vLLM program with tensor parallelism ---------------------------------------------------

TP_PROGRAM = """
import sys
from builtin_models.opt import OPTForCausalLM
from pluginhost import LLM, ModelRegistry, SamplingParams

class DirectOPT(OPTForCausalLM):
    pass

class PluginOPT(OPTForCausalLM):
    pass

ModelRegistry.register_model("DirectOPT", DirectOPT)  # the program's own registration, at the top level

def register():  # docs/writing-plugins.md's register(), passed in-process
    if "PluginOPT" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("PluginOPT", PluginOPT)

if __name__ == "__main__":
    for architecture, size in [("PluginOPT", 1), ("PluginOPT", 2), ("DirectOPT", 2)]:
        llm = LLM(sys.argv[1], plugins=[register], load_installed_plugins=False, tensor_parallel_size=size,
                  model_architecture_override=architecture)
        tokens = llm.generate([[2, 5, 6]], SamplingParams(max_tokens=3, temperature=0))[0].token_ids
        print(architecture, size, type(llm.model).__name__, tokens)
        llm.close()
    ModelRegistry.register_model("GuardedOPT", DirectOPT)  # made by this process alone: the ranks do not run this
    try:
        LLM(sys.argv[1], load_installed_plugins=False, tensor_parallel_size=2, model_architecture_override="GuardedOPT")
    except ValueError as exc:
        print("refused", exc)
"""


def test_a_programs_own_registrations_build_a_tensor_parallel_engine(tmp_path, tiny_opt):
    """A spawned rank imports the script as __mp_main__: its registrations are still the script's (__main__'s).
    One made under the script's main guard is refused before any rank starts."""
    script = tmp_path / "generate.py"
    script.write_text(TP_PROGRAM)
    result = subprocess.run(
        [sys.executable, str(script), str(tiny_opt)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr  # was: "The ranks did not load the same plugins, architectures ..."
    lines = [line.split(" ", 3) for line in result.stdout.splitlines()]
    assert [line[:3] for line in lines[:3]] == [
        ["PluginOPT", "1", "PluginOPT"],
        ["PluginOPT", "2", "PluginOPT"],
        ["DirectOPT", "2", "DirectOPT"],
    ]
    assert lines[0][3] == lines[1][3] == lines[2][3]  # the same tokens as one process
    # Was: rank 1 failed to build with a bare "Architecture 'GuardedOPT' is not registered".
    refused = "refused architecture 'GuardedOPT' is registered inside the script's `if __name__ == \"__main__\":` block"
    assert result.stdout.splitlines()[3].startswith(refused + " (line 25)")
    assert "register it above that block, at the top level." in result.stdout
