"""What runtime hooks are given: the batch updates logits processors follow, the prompt ``on_request`` sees.

A processor that follows ``BatchUpdate``s must always know exactly the rows
of the batch, whatever finishes, aborts or joins when; and it must never see
one request's row as another's.
"""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from pluginhost import LLM, AsyncLLM, SamplingParams, hookimpl
from pluginhost.demo import ensure_demo_model
from pluginhost.errors import PluginHookError
from pluginhost.logits_processors import LogitsProcessor, MoveDirectionality
from pluginhost.server.app import build_app
from pluginhost.testing.server import running_server

TIMEOUT = 60


class ForceTag(LogitsProcessor):
    """Forces each row to its request's ``extra_args["tag"]`` token; checks it knows exactly rows 0 .. B-1."""

    def __init__(self, config, device):
        self.rows: dict[int, int] = {}

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        if batch_update is None:
            return
        for row, params, _prompt, _output in batch_update.added:
            self.rows[row] = params.extra_args["tag"]
        for row in batch_update.removed:
            self.rows.pop(row, None)
        for a, b, kind in batch_update.moved:
            if kind == MoveDirectionality.SWAP:
                self.rows[a], self.rows[b] = self.rows[b], self.rows[a]
            else:
                self.rows[b] = self.rows.pop(a)

    def apply(self, logits):
        if sorted(self.rows) != list(range(logits.shape[0])):
            raise AssertionError(f"the processor holds rows {sorted(self.rows)} for a batch of {logits.shape[0]}")
        forced = torch.full_like(logits, float("-inf"))
        for row, tag in self.rows.items():
            forced[row, tag] = 0.0
        return forced


class ForceTagPlugin:
    @hookimpl
    def register_logits_processors(self, registry):
        registry.add(ForceTag)


def tagged(tag: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args={"tag": tag})


@pytest.fixture
def llm(tiny_opt) -> LLM:
    return LLM(str(tiny_opt), plugins=[ForceTagPlugin()], load_installed_plugins=False, device="cpu")


def test_a_row_finishing_in_a_prefill_step_is_removed_at_the_next_step(llm):
    # The last row finishes with its first token; the next step admits nobody, and must still remove it.
    outs = llm.generate([[2, 5, 6], [2, 7, 8]], [tagged(40, 5), tagged(41, 1)])
    assert [o.outputs[0].token_ids for o in outs] == [[40] * 5, [41]]


def test_rows_freed_when_nothing_is_left_to_run_are_removed_when_the_batch_grows_again(llm):
    requests = [llm._inputs.make_request(f"r{i}", [2, 5 + i], tagged(50 + i, 50)) for i in range(3)]
    llm.engine.submit(requests)
    llm.engine.step()
    llm.engine.abort(r.request_id for r in requests)
    assert llm.engine.step() is False  # the aborts are taken; no row is left to run
    assert all(r.aborted for r in requests)
    out = llm.generate([[2, 9]], tagged(60, 3))[0]
    assert out.outputs[0].token_ids == [60, 60, 60]


def test_every_request_keeps_its_own_row_through_joins_finishes_and_compaction(llm):
    rng = random.Random(0)
    for wave in range(3):
        lengths = [rng.randint(1, 7) for _ in range(9)]
        tags = [100 + 10 * wave + i for i in range(len(lengths))]
        params = [tagged(t, n) for t, n in zip(tags, lengths, strict=True)]
        outs = llm.generate([[2, 5 + i] for i in range(len(lengths))], params)
        assert [o.outputs[0].token_ids for o in outs] == [[t] * n for t, n in zip(tags, lengths, strict=True)]


def test_on_request_sees_the_text_of_a_chat_prompt():
    seen: list[str | None] = []

    class Spy:
        @hookimpl
        def on_request(self, request):
            seen.append(request.prompt)

    engine = AsyncLLM(str(ensure_demo_model()), plugins=[Spy()], load_installed_plugins=False, device="cpu")
    try:
        with running_server(build_app(engine, served_model_name="demo")) as url:
            body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT).raise_for_status()
    finally:
        engine.shutdown()
    tokenizer = engine.get_tokenizer()
    text = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
    assert seen == [text] and "Hello there" in text


class AddsAnInstruction:
    @hookimpl
    def on_request(self, request):
        request.prompt = request.prompt + " Be brief."


def test_a_chat_prompt_a_hook_rewrites_is_tokenized_as_the_template_wrote_it():
    """A chat's text carries the template's BOS: tokenized again with the tokenizer's own, it had two."""
    llm = LLM(str(ensure_demo_model()), plugins=[AddsAnInstruction()], load_installed_plugins=False)
    out = llm.chat([{"role": "user", "content": "Hello there"}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt.endswith(" Be brief.")
    assert out.prompt_token_ids == llm.get_tokenizer()(out.prompt, add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids[:2] != [2, 2]
    # a text prompt keeps the tokenizer's BOS: its ids had it
    plain = llm.generate("Hello there", SamplingParams(max_tokens=2))[0]
    assert plain.prompt_token_ids == llm.get_tokenizer()("Hello there Be brief.")["input_ids"]


class SeesPrompts:
    def __init__(self):
        self.seen: list[str | None] = []

    @hookimpl
    def on_request(self, request):
        self.seen.append(request.prompt)


def test_a_token_prompt_carrying_a_text_shows_hooks_the_text_that_runs(tiny_opt):
    # vLLM's TokensPrompt: the ids are generated from. The text beside them was shown to on_request hooks and
    # reported as the output's prompt whatever the ids said, so a guard reading it let "the secret plan" run.
    spy = SeesPrompts()
    llm = LLM(str(tiny_opt), plugins=[ForceTagPlugin(), spy], load_installed_plugins=False, device="cpu")
    ids = llm.get_tokenizer()("the secret plan")["input_ids"]
    assert ids[0] == 2  # the tokenizer's beginning-of-sequence token, which a text prompt's text leaves out
    faithful = llm.generate({"prompt": "the secret plan", "prompt_token_ids": ids}, tagged(70, 1))[0]
    disguised = llm.generate({"prompt": "a harmless plan", "prompt_token_ids": ids}, tagged(70, 1))[0]
    assert spy.seen == ["the secret plan", "</s>the secret plan"]
    assert (faithful.prompt, disguised.prompt) == ("the secret plan", "</s>the secret plan")
    assert faithful.prompt_token_ids == disguised.prompt_token_ids == ids


class RewritesPrompts:
    """Rewrites a text prompt; with ``extra_args``, changes its ids too (``"ids": ...``) or only them (``"add"``)."""

    @hookimpl
    def on_request(self, request):
        extra = request.params.extra_args or {}
        if "add" in extra:
            request.prompt_token_ids = request.prompt_token_ids + extra["add"]
            return
        request.prompt = "The engine" + request.prompt
        if "ids" in extra:
            request.prompt_token_ids = extra["ids"]


def test_a_prompt_an_on_request_hook_rewrites_is_the_prompt_that_runs(tiny_opt):
    # The new text was reported as the output's prompt, but the old text's ids ran.
    llm = LLM(str(tiny_opt), plugins=[RewritesPrompts()], load_installed_plugins=False, device="cpu")
    plain = LLM(str(tiny_opt), load_installed_plugins=False, device="cpu")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = plain.generate("The engine is", params)[0]
    out = llm.generate(" is", params)[0]
    assert (out.prompt, out.prompt_token_ids, out.token_ids) == (
        "The engine is",
        expected.prompt_token_ids,
        expected.token_ids,
    )
    # Changed together with that text's ids, the text runs; with other ids, the request is the plugin's error.
    both = params.clone(extra_args={"ids": expected.prompt_token_ids})
    assert llm.generate(" is", both)[0].token_ids == expected.token_ids
    with pytest.raises(PluginHookError, match=r"on_request hook of plugin 'RewritesPrompts': request.prompt and"):
        llm.generate(" is", params.clone(extra_args={"ids": [2, 5]}))
    # Ids changed alone take the text they stand for: the output does not report a text that never ran.
    grown = llm.generate(" is", params.clone(extra_args={"add": [224, 224]}))[0]
    assert (grown.prompt, grown.prompt_token_ids) == (
        "</s> is  ",
        [*plain.generate(" is", params)[0].prompt_token_ids, 224, 224],
    )
    # A prompt tokenized without special tokens (the server's add_special_tokens: false) is tokenized again so.
    made = llm._inputs.make_request("bare", " is", params, add_special_tokens=False)
    assert made.prompt_token_ids == llm.get_tokenizer()("The engine is", add_special_tokens=False)["input_ids"]


class BuggyValidation(ForceTag):
    @classmethod
    def validate_params(cls, params):
        return params.extra_args["needed"]  # a KeyError when absent: the plugin's bug, not a refusal


class BuggyValidationPlugin:
    @hookimpl
    def register_logits_processors(self, registry):
        registry.add(BuggyValidation)


def test_a_validate_params_failing_otherwise_than_with_valueerror_is_the_plugins_named_failure(tiny_opt):
    llm = LLM(str(tiny_opt), plugins=[BuggyValidationPlugin()], load_installed_plugins=False, device="cpu")
    with pytest.raises(PluginHookError, match=r"failed in validate_params: KeyError: 'needed'") as info:
        llm.generate([[2, 5]], tagged(40, 2))
    assert not isinstance(info.value, ValueError)  # not a refusal: the server answers 500, naming the plugin
    assert (info.value.plugin, info.value.hook) == ("BuggyValidationPlugin", "register_logits_processors")
    out = llm.generate([[2, 5]], SamplingParams(max_tokens=2, ignore_eos=True, extra_args={"tag": 40, "needed": 1}))
    assert out[0].outputs[0].token_ids == [40, 40]
