"""Shared fixtures: a clean plugin environment, installed test plugins, tiny models."""

from __future__ import annotations

import importlib
import os
import resource
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pluginhost.testing import make_tiny_opt

if TYPE_CHECKING:
    from pluginhost import LLM

PLUGINHOST_ENV = (
    "PLUGINHOST_PLUGINS",
    "PLUGINHOST_DISABLED_PLUGINS",
    "PLUGINHOST_SKIP_BROKEN_PLUGINS",
)


@pytest.fixture(autouse=True, scope="session")
def private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """What the engine learns (kernel choices) goes to a temporary cache, not the user's, in every process."""
    previous = os.environ.get("PLUGINHOST_CACHE_DIR")
    path = tmp_path_factory.mktemp("pluginhost-cache")
    os.environ["PLUGINHOST_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        del os.environ["PLUGINHOST_CACHE_DIR"]
    else:
        os.environ["PLUGINHOST_CACHE_DIR"] = previous


@pytest.fixture(autouse=True)
def clean_plugin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the selection variables of the shell that runs it."""
    for name in PLUGINHOST_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def isolated_registry(model_registry: object) -> None:
    """No registration a test makes through ``ModelRegistry`` reaches the next one (the plugin kit's fixture)."""


InstallPlugin = Callable[..., Path]


@pytest.fixture
def install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[InstallPlugin]:
    """Install a plugin distribution (dist-info metadata + module) on ``sys.path``.

    ``install_plugin("name", code)`` writes module ``name`` holding ``code`` and
    a distribution ``dist`` (default ``pluginhost-<name>``) whose entry point
    ``name`` in group ``pluginhost.plugins`` points at it: to importlib.metadata
    this is an installed package, exactly as pip would leave it.
    """
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    modules: list[str] = []

    def install(
        name: str,
        code: str = "",
        *,
        dist: str | None = None,
        version: str = "1.0",
        module: str | None = None,
        target: str | None = None,
    ) -> Path:
        dist = dist or f"pluginhost-{name}".replace("_", "-")
        module = module or name
        (site / f"{module}.py").write_text(textwrap.dedent(code))
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        with (info / "entry_points.txt").open("a") as f:
            f.write(f"[pluginhost.plugins]\n{name} = {target or module}\n\n")
        modules.append(module)
        importlib.invalidate_caches()
        return site

    yield install
    for module in modules:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()


@pytest.fixture(scope="session")
def tiny_opt(tiny_opt_dir: Path) -> Path:
    """A pre-LayerNorm OPT (opt-125m-like) with a tokenizer, as safetensors: the kit's ``tiny_opt_dir``."""
    return tiny_opt_dir


@pytest.fixture(scope="module")
def llm(tiny_opt: Path) -> LLM:
    """An engine on ``tiny_opt`` (no installed plugins, on the CPU): one per test module that asks for it."""
    from pluginhost import LLM

    return LLM(str(tiny_opt), load_installed_plugins=False, device="cpu")


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    """An engine on the demo model (real words, a real tokenizer), on the default device, as a server's engine built
    beside it is (seeded draws then come from the same kind of generator): one per test module that asks for it."""
    from pluginhost import LLM
    from pluginhost.demo import ensure_demo_model

    return LLM(str(ensure_demo_model()), load_installed_plugins=False)


@pytest.fixture(scope="session")
def tiny_opt_no_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_opt(tmp_path_factory.mktemp("tiny-opt-no-tok"), tokenizer=False)


RunPluginhost = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture
def run_pluginhost() -> RunPluginhost:
    """Run ``python -m pluginhost ARGS`` in a fresh process, bounded in time and memory.

    The fault harness for whatever must be seen from outside: exit statuses, what
    reaches stdout and stderr, a process that must end. The child sees this test's
    environment (``env`` adds to it) and ``sys.path``, so plugins installed with
    ``install_plugin`` are installed there too. ``stdout`` may be a file or file
    descriptor to write to instead of capturing. A run past ``timeout`` seconds
    fails the test (``subprocess.TimeoutExpired``); past ``memory_gib`` of address
    space the child fails to allocate.
    """

    def run(
        *args: str | bytes,
        env: dict[str, str] | None = None,
        timeout: float = 60,
        memory_gib: float = 3,
        stdout: object = subprocess.PIPE,
    ) -> subprocess.CompletedProcess[str]:
        limit = int(memory_gib * 2**30)
        child_env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
        return subprocess.run(
            [sys.executable, "-m", "pluginhost", *args],
            stdout=stdout,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=timeout,
            env=child_env,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
        )

    return run


@pytest.fixture
def signal_as_torch_imports_numpy() -> str:
    """A program running ``pluginhost ARGS`` that sends itself the signal named by ``$SIGNAL`` (``SIGINT``...)
    as torch imports numpy, from C (``torch._C``): where an exception a signal's handler raises was swallowed."""
    return """
import os, signal, sys

class SignalAsTorchImportsNumpy:
    sent = False

    def find_spec(self, name, path=None, target=None):
        if name == "numpy" and "torch" in sys.modules and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.Signals[os.environ["SIGNAL"]])
        return None

sys.meta_path.insert(0, SignalAsTorchImportsNumpy())
from pluginhost.cli import run
sys.argv = ["pluginhost", *sys.argv[1:]]
run()
"""


@pytest.fixture(params=["f_linear", "onednn", "onednn_swapped", "onednn_packed"])
def forced_kernel(request):
    """Every product through one kernel, each of ``builtin_models.kernel_choice.KERNELS`` in turn.

    A parity test using it holds whatever a calibration chooses on any machine (an unknown name
    here would fail: ``make_kernel_table`` accepts only the kernels it has).
    """
    import builtin_models.linear

    builtin_models.linear.use_kernel_table(builtin_models.linear.make_kernel_table(mode=request.param))
    yield request.param
    builtin_models.linear.use_kernel_table(None)


@pytest.fixture
def flaky_opt() -> Callable[[int], object]:
    """``flaky_opt(failures=1)``: a plugin registering ``Flaky`` for OPTForCausalLM, the builtin OPT whose logits
    raise ``RuntimeError: kernel fault`` the first ``failures`` times (a model failing while generating)."""
    from builtin_models.opt import OPTForCausalLM
    from pluginhost.testing import RegistersModel

    def plugin(failures: int = 1) -> object:
        class Flaky(OPTForCausalLM):
            left = failures

            def compute_logits(self, hidden_states):
                if Flaky.left:
                    Flaky.left -= 1
                    raise RuntimeError("kernel fault")
                return super().compute_logits(hidden_states)

        return RegistersModel("OPTForCausalLM", Flaky)

    return plugin


@pytest.fixture
def greedy_tokens() -> Callable[..., list[list[int]]]:
    """Greedy tokens (6 each, end-of-sequence ignored) on three prompts of a model directory, in float32 (or of an
    engine built already).

    ``settings``: more of ``LLM``'s (``hf_overrides``, say).

    Two layouts of one checkpoint (sharded, legacy .bin, renamed tensors) must give the same.
    """
    from pluginhost import LLM, SamplingParams

    prompts = [[2, 17, 200, 31, 99, 5, 64, 11], [2, 300, 4], [2, 7, 7, 7, 150, 42, 8]]

    def tokens(model: Path | LLM, **settings: Any) -> list[list[int]]:
        if not isinstance(model, LLM):
            model = LLM(str(model), load_installed_plugins=False, dtype="float32", device="cpu", **settings)
        outputs = model.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        return [o.token_ids for o in outputs]

    return tokens


@pytest.fixture
def doubled_token() -> Callable[[Any], int]:
    """A token a tokenizer spells ``decode([t, t])`` with again as ``[t, t]``: ``bad_words=[decode([t, t])]`` then bans
    t right after t (with ``allowed_token_ids=[t]``, a request left no token once it has generated one)."""

    def find(tokenizer: Any) -> int:
        return next(
            t
            for t in range(3, len(tokenizer))
            if tokenizer.encode(tokenizer.decode([t, t]).lstrip(), add_special_tokens=False) == [t, t]
        )

    return find


@pytest.fixture(params=["padded", "row by row"])
def decoding_attention(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Decoding steps attend over the batch's padded slots, or each row over its own (forced, checked to happen).

    Which one the engine picks depends on the bytes padding would waste (``builtin_models.attention``),
    so tiny test models would never attend row by row on their own.
    """
    import builtin_models.attention as attention

    if request.param == "padded":
        monkeypatch.setattr(attention, "ROW_BY_ROW_BYTES", float("inf"))
        yield request.param
        return
    monkeypatch.setattr(attention, "ROW_BY_ROW_BYTES", 0)
    chosen: list[bool] = []
    row_ends = attention.row_ends

    def recording(*args: Any) -> list[int] | None:
        ends = row_ends(*args)
        chosen.append(ends is not None)
        return ends

    monkeypatch.setattr(attention, "row_ends", recording)
    yield request.param
    assert any(chosen), "no decoding step attended row by row: the test did not test it"


@pytest.fixture
def assert_decoding_matches() -> Callable[..., None]:
    """Check pluginhost's outputs (greedy, with logprobs) against a transformers model on the same weights.

    ``check(outputs, prompts, reference, tolerance=1e-4, against="generate")``: for each prompt, at
    every step, the token transformers picks and each reported log-probability within ``tolerance``
    of its own. ``against="generate"``: transformers' cached ``generate``; ``"forward"``: one full
    forward over the prompt and pluginhost's tokens (no cache on transformers' side). An output with
    ``prompt_logprobs`` has them checked against transformers' forward over the prompt too.
    """
    import torch

    def check(
        outputs: Any, prompts: list[list[int]], reference: Any, tolerance: float = 1e-4, against: str = "generate"
    ) -> None:
        for prompt, out in zip(prompts, outputs, strict=True):
            if out.prompt_logprobs is not None:  # first: transformers' dynamic RoPE keeps the longest length it ran
                check_prompt(out.prompt_logprobs, prompt, reference, tolerance)
            with torch.no_grad():
                if against == "forward":
                    logits = reference(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
                    tokens = logits.argmax(-1).tolist()
                else:
                    generated = reference.generate(
                        torch.tensor([prompt]),
                        max_new_tokens=len(out.token_ids),
                        do_sample=False,
                        output_logits=True,
                        return_dict_in_generate=True,
                        eos_token_id=None,
                        pad_token_id=0,
                    )
                    logits = torch.stack(generated.logits)[:, 0]
                    tokens = generated.sequences[0, len(prompt) :].tolist()
            assert out.token_ids == tokens
            steps = logits.float().log_softmax(-1)  # (steps, V): the distribution each token was drawn from
            for step, candidates in zip(steps, out.logprobs, strict=True):
                assert max(abs(v - float(step[t])) for t, v in candidates.items()) <= tolerance

    def check_prompt(scores: list[Any], prompt: list[int], reference: Any, tolerance: float) -> None:
        """Each prompt token's log-probability and its most likely ones, as transformers' forward over the prompt."""
        with torch.no_grad():
            steps = reference(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)  # (T - 1, V)
        assert len(scores) == len(prompt) and scores[0] is None
        for token, step, reported in zip(prompt[1:], steps, scores[1:], strict=True):
            assert token in reported and max(abs(v - float(step[t])) for t, v in reported.items()) <= tolerance
            likeliest = [float(step[t]) for t in reported if t != token]  # the top k: none less likely than others
            assert not likeliest or min(likeliest) >= float(step.topk(len(reported)).values[-1]) - tolerance

    return check
