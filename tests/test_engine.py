"""The engine: sampling, batching, limits, bad requests, and plugins changing what is built."""

from __future__ import annotations

import json
import logging
import math
import pickle
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from builtin_models import opt
from builtin_models.opt import OPTForCausalLM
from pluginhost import LLM, SamplingParams, hookimpl
from pluginhost.cli import main
from pluginhost.errors import ConfigError, KVCacheMemoryError, ModelClassError, ModelRunError, PluginHookError
from pluginhost.outputs import CompletionOutput, TokenLogprobs
from pluginhost.testing import RegistersModel, make_tiny_model

PROMPTS = [[2, 17, 200, 31, 99, 5, 64, 11], [2, 300], [2, 7, 7, 7, 150, 42], [2, 9, 9]]
FORCED = 7


def test_generate_returns_one_output_per_prompt_in_order(llm):
    outs = llm.generate(["Hello world", [2, 100, 7]], SamplingParams(max_tokens=5, temperature=0))
    assert [o.prompt_token_ids[:1] for o in outs] == [[2], [2]]  # the tokenizer prepends </s>, like OPT's
    assert outs[1].prompt_token_ids == [2, 100, 7]
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in outs)
    decoded = llm.tokenizer.decode(outs[0].token_ids, skip_special_tokens=True)
    assert outs[0].text == decoded.removesuffix("\ufffd")  # the tokens' text, a last cut-off character left out
    assert outs[0].logprobs is None


def test_outputs_have_vllms_shape(llm):
    # Ported code calls vLLM's CompletionOutput.finished() (a method there; RequestOutput.finished an attribute),
    # and builds outputs positionally in vLLM's order: the property raised "'bool' object is not callable", and
    # cumulative_logprob and logprobs were swapped.
    out = llm.generate([[2, 100, 7]], SamplingParams(max_tokens=2, temperature=0, logprobs=1))[0]
    assert out.finished is True and out.outputs[0].finished() is True
    completion = CompletionOutput(0, "x", [5], -0.25, [{5: -0.25}], "length")
    assert completion.cumulative_logprob == -0.25 and completion.logprobs == [{5: -0.25}] and completion.finished()
    assert not CompletionOutput(0, "", []).finished()


def assert_same_logprobs(one: list | None, other: list | None, tolerance: float = 1e-5) -> None:
    """Two lists of ``logprobs`` or ``prompt_logprobs``: the same tokens at each step, values within ``tolerance``."""
    assert (one is None) == (other is None) and len(one or ()) == len(other or ())
    for a, b in zip(one or (), other or (), strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) < tolerance


def test_batched_results_equal_one_by_one(llm):
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, prompt_logprobs=3, ignore_eos=True)
    batched = llm.generate(PROMPTS, params)
    for prompt, together in zip(PROMPTS, batched, strict=True):
        alone = llm.generate([prompt], params)[0]
        assert alone.token_ids == together.token_ids
        assert_same_logprobs(alone.logprobs, together.logprobs)
        assert_same_logprobs(alone.prompt_logprobs, together.prompt_logprobs)  # padded beside longer prompts


@pytest.mark.parametrize("model_type", ["opt", "llama", "mistral", "gpt2"])
def test_a_prompt_longer_than_max_num_batched_tokens_is_prefilled_in_pieces_to_the_same_tokens(
    tmp_path, tiny_opt, model_type, assert_decoding_matches
):
    # One pass over a whole prompt of T tokens holds a T x T mask and attention: a 16k-token prompt took 1.5 GiB
    # more for a tiny model, a 64k one would take ~24. Pieces of at most max_num_batched_tokens hold T x that.
    path = tiny_opt if model_type == "opt" else make_tiny_model(tmp_path, model_type, seed=1)
    llm = LLM(str(path), load_installed_plugins=False, dtype="float32", device="cpu", max_num_batched_tokens=16)
    passes = []
    llm.model.register_forward_pre_hook(lambda module, args: passes.append(tuple(args[0].shape)))
    prompts = [[2, *range(10, 50)], [2, 5, 6]]  # 41 tokens; the second waits for the next prefill step
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert passes[:3] == [(1, 16), (1, 16), (1, 9)] and (1, 3) in passes  # (rows, tokens) of each pass
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert_decoding_matches(outs, prompts, reference)  # the sliding window of 6 (Mistral) across pieces too


def test_batches_larger_than_max_num_seqs_are_split(tiny_opt, llm):
    small = LLM(str(tiny_opt), load_installed_plugins=False, max_num_seqs=2)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in small.generate(PROMPTS, params)] == [
        o.token_ids for o in llm.generate(PROMPTS, params)
    ]


def test_same_seed_same_output_whatever_the_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].token_ids
    in_batch = llm.generate(PROMPTS, [params, *[SamplingParams(max_tokens=3, seed=i) for i in range(3)]])[0].token_ids
    assert alone == in_batch
    other = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=1.0, seed=43, ignore_eos=True))
    assert other[0].token_ids != alone


def test_unseeded_requests_follow_the_engine_seed(tiny_opt):
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    first = LLM(str(tiny_opt), load_installed_plugins=False, seed=7).generate(PROMPTS, params)
    second = LLM(str(tiny_opt), load_installed_plugins=False, seed=7).generate(PROMPTS, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=8, temperature=0.7, top_k=1, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.7, top_p=1e-6, seed=1, ignore_eos=True),
        # Below float32's smallest value: these once ended in "probability tensor contains inf or nan".
        SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-300, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1e-300, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1e-300, top_p=1e-300, min_p=1e-300, seed=1, ignore_eos=True),
    ],
    ids=["top_k=1", "tiny top_p", "top_p=1e-300", "temperature=1e-300", "all 1e-300"],
)
def test_top_k_1_and_tiny_top_p_are_greedy(llm, params):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in llm.generate(PROMPTS, greedy)]


def test_top_k_limits_the_tokens_sampled(llm):
    prompt = PROMPTS[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=3))[0]
    top3 = set(list(out.logprobs[0])[1:]) | {out.token_ids[0]}
    seen = {
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=5.0, top_k=3, seed=s))[0].token_ids[0]
        for s in range(40)
    }
    assert seen <= top3 and len(seen) > 1


@pytest.mark.parametrize("k", [1, 2])
def test_logprobs_report_the_chosen_token_and_the_top_k(llm, k):
    prompt = PROMPTS[0]
    with torch.no_grad():  # the first step's distribution, computed independently
        hidden = llm.model(torch.tensor([prompt]), torch.arange(len(prompt))[None])
        first = llm.model.compute_logits(hidden)[0, -1].log_softmax(-1)
    values, ids = first.topk(k)
    for seed in range(30):  # a first token drawn outside the top k, which are then reported beside it
        out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=1.0, seed=seed, logprobs=k))[0]
        if out.token_ids[0] not in ids.tolist():
            break
    else:
        pytest.fail("no seed drew a token outside the top k: the test did not test it")
    assert len(out.logprobs) == 4
    expected = dict(zip(ids.tolist(), values.tolist(), strict=True))
    expected[out.token_ids[0]] = float(first[out.token_ids[0]])
    assert out.logprobs[0].keys() == expected.keys()  # logprobs=1: the chosen token and the most likely one
    assert all(abs(out.logprobs[0][t] - v) < 1e-5 for t, v in expected.items())
    for token, step in zip(out.token_ids, out.logprobs, strict=True):
        assert token in step and k <= len(step) <= k + 1 and all(v <= 0 for v in step.values())


def test_stop_token_ids_end_generation_and_are_included(llm):
    free = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    stop_at = free[2]
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free[: free.index(stop_at) + 1]
    assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", stop_at)
    # As in vLLM: the stop token is in token_ids, its text is not in the text.
    before = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=free.index(stop_at), temperature=0))[0]
    assert before.text and out.text == before.text


class AlwaysPicks(OPTForCausalLM):
    """The seed's mock OPT: a subclass whose logits always pick one token."""

    token = FORCED

    def compute_logits(self, hidden_states):
        logits = super().compute_logits(hidden_states)
        forced = torch.full_like(logits, -1e9)
        forced[..., self.token] = 0.0
        return forced


class AlwaysEos(AlwaysPicks):
    token = 2


def test_eos_stops_generation_unless_ignored(tiny_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[RegistersModel("OPTForCausalLM", AlwaysEos)])
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0))[0]
    assert (out.token_ids, out.finish_reason) == ([2], "stop")
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert (out.token_ids, out.finish_reason) == ([2] * 5, "length")


def test_generation_config_end_of_sequence_ids_stop_too(tiny_opt, tmp_path, llm):
    # Llama 3 Instruct names <|eot_id|> only in generation_config.json: a chat answer must stop there.
    params = SamplingParams(max_tokens=8, temperature=0)
    free = llm.generate([PROMPTS[0]], params)[0].token_ids
    assert len(free) == 8 and 2 not in free
    model = shutil.copytree(tiny_opt, tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, free[2]]}))
    out = LLM(str(model), load_installed_plugins=False).generate([PROMPTS[0]], params)[0]
    assert (out.token_ids, out.finish_reason) == (free[:3], "stop")

    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ConfigError, match=r"generation_config.json: eos_token_id must be a token id"):
        LLM(str(model), load_installed_plugins=False)


def test_plugin_overriding_the_builtin_changes_generation(tiny_opt, llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert llm.generate([PROMPTS[0]], params)[0].token_ids != [FORCED] * 6
    patched = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[RegistersModel("OPTForCausalLM", AlwaysPicks)])
    assert patched.generate([PROMPTS[0]], params)[0].token_ids == [FORCED] * 6
    assert type(patched.model) is AlwaysPicks


def test_architecture_override_selects_a_plugin_architecture(tiny_opt):
    plugin = RegistersModel("MockOPT", AlwaysPicks)
    plain = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[plugin])
    assert type(plain.model) is OPTForCausalLM  # registered, but config.json names OPTForCausalLM
    mocked = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[plugin], model_architecture_override="MockOPT")
    assert mocked.architecture == "MockOPT"
    out = mocked.generate([PROMPTS[1]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == [FORCED] * 4


def test_subclass_overriding_forward_with_super_just_works(tiny_opt, llm):
    class ShiftedHidden(OPTForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs) * 0.0  # all-zero hidden states: every logit is 0

    engine = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[RegistersModel("OPTForCausalLM", ShiftedHidden)])
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0, logprobs=0, ignore_eos=True))[0]
    uniform = -torch.log(torch.tensor(float(engine.vocab_size))).item()
    assert all(abs(next(iter(step.values())) - uniform) < 1e-5 for step in out.logprobs)


def test_a_model_without_setup_caches_is_recomputed_each_step_with_the_same_result(tiny_opt, llm):
    class NoCache(OPTForCausalLM):
        setup_caches = None  # a minimal plugin model: forward and compute_logits only

    engine = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[RegistersModel("OPTForCausalLM", NoCache)])
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    recomputed, cached = engine.generate(PROMPTS, params), llm.generate(PROMPTS, params)
    for a, b in zip(recomputed, cached, strict=True):
        assert a.token_ids == b.token_ids
        assert_same_logprobs(a.logprobs, b.logprobs, 1e-4)
        assert_same_logprobs(a.prompt_logprobs, b.prompt_logprobs, 1e-4)


class ChecksActivations:
    """Installs a forward hook on the model in post_load; the hook fails once, while generating."""

    failures = 1

    @hookimpl
    def post_load(self, config, model):
        model.decoder.layers[0].register_forward_hook(self.check)

    def check(self, module, args, output):
        if ChecksActivations.failures:
            ChecksActivations.failures -= 1
            raise RuntimeError("activations out of range")


class ReplacesLayerForward:
    """Replaces the decoder layers' class's forward in post_load (through ``patch``, undone after the test); the
    replacement fails once, while generating."""

    def __init__(self, patch: Callable[[object, str, object], None]) -> None:
        self.patch, self.failures = patch, 1

    @hookimpl
    def post_load(self, config, model):
        layer_class = type(model.decoder.layers[0])
        original = layer_class.forward

        def forward(layer, *args, **kwargs):
            if self.failures:
                self.failures -= 1
                raise RuntimeError("activations out of range")
            return original(layer, *args, **kwargs)

        self.patch(layer_class, "forward", forward)


@pytest.mark.parametrize("kind", ["forward hook", "replaced method"])
def test_code_a_plugin_installed_failing_while_generating_is_named_with_the_plugin(tiny_opt, monkeypatch, kind):
    # A replaced method, set on the model's class, was taken for the model's own code for a while (the model's
    # files were read from every function its classes hold, the plugin's too).
    plugin = ChecksActivations() if kind == "forward hook" else ReplacesLayerForward(monkeypatch.setattr)
    name = type(plugin).__name__
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[plugin])
    with pytest.raises(ModelRunError) as info:
        llm.generate([[2, 5]], SamplingParams(max_tokens=3))
    assert str(info.value).startswith(
        f"Code of plugin '{name}' (in {__file__}) failed while the model builtin_models.opt:OPTForCausalLM"
    )
    assert "(a forward hook, a replaced method): RuntimeError: activations out of range." in str(info.value)
    assert len(llm.generate([[2, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_a_step_interrupted_in_its_forward_pass_changes_nothing_for_the_others(llm):
    """Ctrl-C in a thread's generate ends its requests; a request of another caller in the same step goes on."""
    ours, theirs = (llm._inputs.make_request(f"interrupted-{i}", p, GREEDY_8) for i, p in enumerate(PROMPTS[:2]))
    llm.engine.submit([ours, theirs])

    def interrupt(module, args, output):
        handle.remove()
        raise KeyboardInterrupt

    handle = llm.model.decoder.layers[1].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.engine.step()  # prefills both: interrupted half-way
    llm.engine.abort_request(ours)
    llm.engine.run_until(lambda: theirs.finished)
    assert theirs.error is None and ours.aborted
    assert theirs.output().outputs[0].token_ids == llm.generate([PROMPTS[1]], GREEDY_8)[0].token_ids


GREEDY_8 = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_a_ctrl_c_while_a_step_takes_new_requests_loses_none_of_them(llm, monkeypatch):
    # The step had taken the whole inbox: an interrupt half-way dropped the rest, whose ids stayed taken, and
    # another thread's generate waited for them for ever.
    requests = [llm._inputs.make_request(f"inbox-{i}", p, GREEDY_8) for i, p in enumerate(PROMPTS)]
    llm.engine.submit(requests)
    add = llm.engine.scheduler.add

    def interrupted(sequences):
        monkeypatch.setattr(llm.engine.scheduler, "add", add)  # once
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.engine.scheduler, "add", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.engine.step()
    for _ in range(50):  # bounded: a lost request never finishes
        llm.engine.step()
    assert [r.output().outputs[0].token_ids for r in requests] == [o.token_ids for o in llm.generate(PROMPTS, GREEDY_8)]


@pytest.mark.parametrize("where", ["placing", "forward", "handing out"])
def test_a_ctrl_c_in_a_step_that_moves_rows_leaves_every_sequence_its_own_cache(llm, monkeypatch, where):
    # The scheduler compacts the batch (the last sequence into the row a finished one left), and the cache's rows
    # must follow exactly once. Interrupted before they did, the moved sequence read the finished one's keys and
    # values; moved again after the forward, with its new length, its newest slot was overwritten. Both silently.
    import pluginhost.engine.scheduler

    short = llm._inputs.make_request("moves-short", PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True))
    others = [llm._inputs.make_request(f"moves-{i}", p, GREEDY_8) for i, p in enumerate(PROMPTS[1:])]
    llm.engine.submit([short, *others])
    llm.engine.run_until(lambda: short.finished)
    fired = []

    def interrupt() -> None:
        if not fired:
            fired.append(where)
            raise KeyboardInterrupt

    if where == "placing":  # inside schedule(), the sequences placed
        made = pluginhost.engine.scheduler.ScheduledStep
        monkeypatch.setattr(pluginhost.engine.scheduler, "ScheduledStep", lambda *args: interrupt() or made(*args))
    elif where == "forward":
        execute = llm.engine.runner.execute
        monkeypatch.setattr(llm.engine.runner, "execute", lambda plan: interrupt() or execute(plan))
    else:  # the step's outputs are being handed out (a callback, a progress bar)
        others[0].on_output = lambda output, error: interrupt()
    with pytest.raises(KeyboardInterrupt):
        llm.engine.step()
    monkeypatch.undo()
    assert fired and others[-1].sequences[0].row == 0  # the last sequence moved into the finished one's row
    llm.engine.run_until(lambda: all(r.finished for r in others))
    alone = [llm.generate([p], GREEDY_8)[0].token_ids for p in PROMPTS[1:]]
    assert [r.output().outputs[0].token_ids for r in others] == alone


def test_an_abort_interrupted_while_it_is_handed_out_still_ends_its_stream(llm):
    # Taken again at the next step, the half-taken abort was skipped: its stream never got its last output.
    request = llm._inputs.make_request("half-abort", PROMPTS[0], GREEDY_8)
    outputs, ended = [], []

    def on_end() -> None:
        ended.append(True)
        if len(ended) == 1:
            raise KeyboardInterrupt

    request.on_output, request.on_end = lambda output, error: outputs.append(output), on_end
    llm.engine.submit([request])
    llm.engine.step()
    llm.engine.abort([request.request_id])
    with pytest.raises(KeyboardInterrupt):
        llm.engine.step()
    llm.engine.step()
    assert outputs[-1].outputs[0].finish_reason == "abort" and len(ended) == 1
    assert llm.engine.scheduler.num_running == 0 and not llm.engine.has_work()


def test_a_model_failing_while_generating_is_named_and_the_engine_recovers(tiny_opt, flaky_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[flaky_opt()])
    with pytest.raises(
        ModelRunError,
        match=r"Flaky \(architecture 'OPTForCausalLM', registered by plugin 'RegistersModel'\) "
        r"failed while generating: RuntimeError: kernel fault",
    ):
        llm.generate([[2, 5]], SamplingParams(max_tokens=3))
    assert len(llm.generate([[2, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_a_model_class_made_in_a_notebook_cell_failing_is_named(tiny_opt):
    # Its failure was taken for the engine's own ("internal error", a bare RuntimeError): the class's module,
    # __main__, is another file (or none, in a notebook), and the model's code files were looked up through it.
    cell = "class Flaky(OPTForCausalLM):\n    def compute_logits(self, hidden):\n        raise RuntimeError('nan')\n"
    namespace = {"__name__": "__main__", "OPTForCausalLM": OPTForCausalLM}
    exec(compile(cell, "<notebook cell 3>", "exec"), namespace)  # noqa: S102 - the test's own source
    plugin = RegistersModel("OPTForCausalLM", namespace["Flaky"])
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[plugin])
    with pytest.raises(ModelRunError, match=r"^The model __main__:Flaky .* failed while generating: RuntimeError: nan"):
        llm.generate([[2, 5]], SamplingParams(max_tokens=2))


class ForgetsReturn(OPTForCausalLM):
    def compute_logits(self, hidden_states):
        super().compute_logits(hidden_states)


class ShortVocabulary(OPTForCausalLM):
    def compute_logits(self, hidden_states):
        return super().compute_logits(hidden_states)[..., :100]


class ReturnsATuple(OPTForCausalLM):
    def forward(self, input_ids, positions, cache_rows=None, mask=None):
        return (super().forward(input_ids, positions, cache_rows, mask),)  # transformers' habit


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (ForgetsReturn, "its compute_logits returned NoneType, not a tensor of logits"),
        (
            ShortVocabulary,
            r"its compute_logits returned logits of shape \(1, 100\) for 1 token\(s\): it must return one row",
        ),
        (ReturnsATuple, "its forward returned tuple, not a tensor of hidden states"),
    ],
)
def test_a_model_breaking_the_interface_is_named_and_told_what_to_return(tiny_opt, model, message):
    # A compute_logits that forgot its return, or a forward returning a tuple, was pluginhost's own "internal error"
    # with a traceback; logits over 100 of the vocabulary's tokens were sampled from, silently.
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[RegistersModel("OPTForCausalLM", model)])
    named = rf"The model .*{model.__name__} \(architecture 'OPTForCausalLM', registered by plugin 'RegistersModel'\) "
    with pytest.raises(ModelRunError, match=named + "does not follow the model interface: " + message):
        llm.generate([[2, 5]], SamplingParams(max_tokens=3))


class BigramLM(torch.nn.Module):
    """A whole new architecture in a few lines: next token from the current one."""

    def __init__(self, config):
        super().__init__()
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, cache_rows=None, mask=None):
        return self.embed(input_ids)

    def compute_logits(self, hidden_states):
        return self.head(hidden_states)

    def load_weights(self, weights):
        from builtin_models.weights import assign_weights

        return assign_weights(self, weights)


def test_a_new_architecture_unknown_to_transformers(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "bigram",
                "architectures": ["BigramLM"],
                "vocab_size": 50,
                "hidden_size": 8,
                "max_position_embeddings": 64,
                "eos_token_id": 0,
            }
        )
    )
    embed = torch.eye(50, 8)
    head = torch.zeros(50, 8)
    for token in range(8):  # token t -> t + 1 (embedding one-hot for the first 8 ids)
        head[token + 1, token] = 5.0
    save_file({"embed.weight": embed, "head.weight": head}, str(tmp_path / "model.safetensors"))
    llm = LLM(str(tmp_path), load_installed_plugins=False, plugins=[RegistersModel("BigramLM", BigramLM)])
    assert type(llm.hf_config) is transformers.PretrainedConfig  # no config class needed
    out = llm.generate([[1]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == [2, 3, 4, 5, 6]


def test_load_weights_must_report_what_it_loaded(tiny_opt):
    class Forgetful(OPTForCausalLM):
        def load_weights(self, weights):
            super().load_weights(weights)  # forgets to return the names

    with pytest.raises(ModelClassError, match="Forgetful.load_weights returned NoneType; it must return the set"):
        LLM(str(tiny_opt), load_installed_plugins=False, plugins=[RegistersModel("OPTForCausalLM", Forgetful)])


INSTALLED_MOCK = """
import torch
from pluginhost import hookimpl
from builtin_models.opt import OPTForCausalLM

class MockOPT(OPTForCausalLM):
    def compute_logits(self, hidden_states):
        logits = super().compute_logits(hidden_states)
        logits = torch.full_like(logits, -1e9)
        logits[..., 7] = 0.0
        return logits

@hookimpl
def register_models(registry):
    registry.register_model("{arch}", "mock_installed:MockOPT")
"""


@pytest.mark.parametrize("arch", ["MockOPT", "OPTForCausalLM"])
def test_cli_generate_with_an_installed_mock_plugin(install_plugin, capsys, tiny_opt, arch):
    install_plugin("mock_installed", INSTALLED_MOCK.replace("{arch}", arch))
    argv = [
        "generate",
        "--model",
        str(tiny_opt),
        "--prompt",
        "Hello",
        "--prompt",
        "world",
        "--max-tokens",
        "3",
        "--json",
    ]
    if arch == "MockOPT":
        argv += ["--model-architecture-override", "MockOPT", "--ignore-eos"]
    else:
        argv += ["--ignore-eos"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["prompt"] for r in rows] == ["Hello", "world"]
    assert all(r["token_ids"] == [7, 7, 7] and r["finish_reason"] == "length" for r in rows)
    assert all(isinstance(r["text"], str) for r in rows)


def test_cli_generate_on_the_demo_model(tmp_path, monkeypatch, capsys):
    # The old demo was written into this cache on first use; the shipped one is read where it is installed.
    monkeypatch.setenv("PLUGINHOST_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["generate", "--prompt", "Hello", "--max-tokens", "4", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(["generate", "--prompt", "Hello", "--max-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == first  # deterministic
    assert len(first[0]["token_ids"]) <= 4 and first[0]["text"] is not None
    assert not (tmp_path / "cache").exists()


# -- the hooks, in order --------------------------------------------------------------


def test_the_four_hooks_run_in_order_with_what_they_promise(tiny_opt):
    events = []
    constructed = []

    class Tracked(OPTForCausalLM):
        def __init__(self, config):
            constructed.append(True)
            super().__init__(config)

    class Observer:
        @hookimpl
        def register_models(self, registry):
            events.append("register_models")
            registry.register_model("OPTForCausalLM", Tracked)

        @hookimpl
        def modify_config(self, config):
            events.append("modify_config")
            config.max_model_len = 40

        @hookimpl
        def pre_load(self, config, model_class):
            events.append("pre_load")
            assert model_class is Tracked and not constructed  # nothing built, nothing allocated
            assert config.max_model_len == 40

        @hookimpl
        def post_load(self, config, model):
            events.append("post_load")
            assert isinstance(model, Tracked) and not model.training
            assert not any(p.is_meta for p in model.parameters())

    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[Observer()])
    assert events == ["register_models", "modify_config", "pre_load", "post_load"]  # the four it implements
    assert llm.max_model_len == 40 and llm.config.provenance["max_model_len"] == "plugin:Observer"


def test_post_load_may_replace_the_lm_head_with_a_module_without_a_weight(tiny_opt, llm):
    """The contract lets post_load replace submodules: the KV cache must not depend on ``lm_head.weight``."""

    class Wrapped(torch.nn.Module):  # the same product, its weight kept under another name
        def __init__(self, linear):
            super().__init__()
            self.kept = linear

        def forward(self, x):
            return self.kept(x)

    class ReplacesLMHead:
        @hookimpl
        def post_load(self, config, model):
            model.lm_head = Wrapped(model.lm_head)

    replaced = LLM(str(tiny_opt), load_installed_plugins=False, device="cpu", plugins=[ReplacesLMHead()])
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in replaced.generate(PROMPTS, params)] == [
        o.token_ids for o in llm.generate(PROMPTS, params)
    ]


@pytest.mark.parametrize("hook", ["register_models", "modify_config", "pre_load", "post_load"])
def test_exception_in_any_hook_aborts_the_build_and_the_next_build_works(tiny_opt, hook):
    def fail():
        raise RuntimeError(f"refused in {hook}")

    implementations = {
        "register_models": lambda self, registry: fail(),
        "modify_config": lambda self, config: fail(),
        "pre_load": lambda self, config, model_class: fail(),
        "post_load": lambda self, config, model: fail(),
    }
    Failing = type("Failing", (), {hook: hookimpl(implementations[hook])})
    with pytest.raises(PluginHookError) as info:
        LLM(str(tiny_opt), load_installed_plugins=False, plugins=[Failing()])
    assert (info.value.plugin, info.value.hook) == ("Failing", hook)
    assert f"RuntimeError: refused in {hook}" in str(info.value)
    assert LLM(str(tiny_opt), load_installed_plugins=False).generate([[2, 5]], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float64], ids=["to-bfloat16", "to-float64"])
def test_a_post_load_changing_the_dtype_the_model_computes_in_is_refused_naming_the_plugin(tiny_opt, cast):
    """The hookspec forbids it: the engine, its KV cache and its config stayed float32, the logprobs moved silently."""

    class Cast:
        @hookimpl
        def post_load(self, config, model):
            model.to(cast)

    with pytest.raises(ConfigError) as info:
        LLM(str(tiny_opt), load_installed_plugins=False, dtype="float32", plugins=[Cast()])
    message = str(info.value)
    assert "plugin 'Cast'" in message and "post_load" in message
    assert f"torch.float32 -> {cast}" in message and "dtype" in message


def test_a_post_load_storing_weights_as_float8_beside_their_scales_is_a_quantizer_not_a_cast(tiny_opt):
    class Float8Linear(torch.nn.Module):  # the same names, the weight stored in float8, computed in float32
        def __init__(self, linear: torch.nn.Module) -> None:
            super().__init__()
            w = linear.weight.detach()
            self.scale = torch.nn.Parameter(w.abs().amax(dim=1).clamp(min=1e-12) / 448, requires_grad=False)
            self.weight = torch.nn.Parameter((w / self.scale[:, None]).to(torch.float8_e4m3fn), requires_grad=False)
            self.bias = linear.bias

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, self.weight.to(x.dtype) * self.scale[:, None], self.bias)

    class Float8:
        @hookimpl
        def post_load(self, config, model):
            model.decoder.layers[0].fc1 = Float8Linear(model.decoder.layers[0].fc1)

    llm = LLM(str(tiny_opt), load_installed_plugins=False, dtype="float32", plugins=[Float8()])
    assert llm.model.decoder.layers[0].fc1.weight.dtype == torch.float8_e4m3fn
    assert len(llm.generate([[2, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3


# -- limits and bad requests ----------------------------------------------------------


def test_max_model_len_ends_generation_as_in_vllm_and_a_prompt_it_cannot_hold_is_a_clear_error(tiny_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False, max_model_len=12)
    # 8 prompt tokens + max_tokens=5 > 12: generation ends at max_model_len, finish_reason "length" (vLLM's engine).
    capped = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert (len(capped.token_ids), capped.finish_reason) == (4, "length")
    exact = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert exact.token_ids == capped.token_ids
    with pytest.raises(ValueError, match=r"prompt 0 has 12 tokens, which leaves no room to generate within max_model"):
        llm.generate([[2, *range(10, 21)]], SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match=r"prompt 0 has 12 tokens, which leaves no room to generate within max_model"):
        llm.generate([[2, *range(10, 21)]], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match=r"leaves room for 4 within max_model_len=12: fewer than min_tokens=6"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=None, min_tokens=6))
    with pytest.raises(ConfigError, match="max_model_len=4096 is more than the model's 128 positions"):
        LLM(str(tiny_opt), load_installed_plugins=False, max_model_len=4096)


def test_a_max_model_len_a_plugin_set_is_named_as_the_plugins_in_the_prompts_error(tiny_opt):
    class SitePolicy:
        @hookimpl
        def modify_config(self, config):
            config.max_model_len = 4

    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[SitePolicy()])
    with pytest.raises(ValueError, match=r"no room to generate within max_model_len=4 \(set by plugin 'SitePolicy'\)"):
        llm.generate([[2, 5, 6, 7]], SamplingParams(max_tokens=2))


def test_no_prompts_give_no_outputs(llm):
    assert llm.generate([]) == [] and llm.generate([], []) == []  # vLLM's LLM.generate([]) too


#: vLLM's SamplingParams, as a leftover import in a ported program passes it.
VLLM_SAMPLING_PARAMS = type("SamplingParams", (), {"__module__": "vllm.sampling_params"})()


def test_chat_needs_a_chat_template_and_says_so(llm):
    conversation = [{"role": "user", "content": "Hi"}]
    with pytest.raises(
        ValueError, match=r"the model's tokenizer has no chat template .* pass one \(chat_template=\.\.\.\)"
    ):
        llm.chat(conversation)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    answer = llm.chat(conversation, SamplingParams(max_tokens=2, ignore_eos=True), chat_template=template)[0]
    assert answer.prompt == "user: Hi\nassistant:" and len(answer.token_ids) == 2
    with pytest.raises(ValueError, match="set add_generation_prompt=False to continue") as caught:
        llm.chat(conversation, chat_template=template, continue_final_message=True)
    assert caught.value.param == "continue_final_message"


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        ([""], None, "prompt 0 is an empty string"),
        (["ok", "caf\udce9"], None, r"prompt 1 is not valid Unicode: character 3 is '\\udce9', surrogates not allowed"),
        ([[]], None, "prompt 0 is an empty list of token ids"),
        ([[2, 5], [2, 384]], None, r"prompt 1 has token id\(s\) \[384\] outside the vocabulary \[0, 384\)"),
        ([[2, -1]], None, r"token id\(s\) \[-1\]"),
        ([[2, 5.0]], None, "must hold only int token ids"),
        ([[2, 5]], [SamplingParams(), SamplingParams()], "one per prompt"),
        (
            [[2, 5], [2, 6]],
            [SamplingParams(stop_token_ids=[100000], min_tokens=2), SamplingParams()],
            r"prompt 0 has stop_token_ids \[100000\] outside the vocabulary \[0, 384\)",
        ),
        ([[2, 5]], SamplingParams(n=10**7), r"n=10000000 samples are more than the engine ever takes in at once"),
        # Once taken as token ids, a list of keys, or a TypeError.
        (b"hello", None, "prompts must be a string, a list of token ids, or a list of prompts, got bytes"),
        ({"a": 1}, None, r"prompt 0 is a dict with 'a', which pluginhost does not take: its models read text"),
        (None, None, "got NoneType"),
        ([None], None, "prompt 0 must be a string, a list of token ids or a prompt dict, got NoneType"),
        # Ids given as text ran as a text prompt; a bad item of a list of params was "got 1 items".
        ([{"prompt_token_ids": "2, 5"}], None, "prompt 0: 'prompt_token_ids' must be a list of int token ids, got str"),
        ([{"prompt_token_ids": None}], None, "prompt 0: 'prompt_token_ids' must be a list of int token ids, got None"),
        ([{"prompt": [2, 5]}], None, r"prompt 0: 'prompt' must be text \(a str\), got list"),
        # Keys beyond the text and ids were dropped: an image ran as its text alone, a misspelt key ran the text.
        (
            [[2, 5], {"prompt": "hi", "multi_modal_data": {"image": object()}}],
            None,
            r"prompt 1 is a dict with 'multi_modal_data', which pluginhost does not take: its models read text",
        ),
        ([{"prompt": "hi", "prompt_token_id": [2, 5]}], None, "prompt 0 is a dict with 'prompt_token_id', which"),
        ([{"prompt_embeds": [[0.5]]}], None, "prompt 0 is a dict with 'prompt_embeds', which pluginhost does not"),
        ([{"prompt": "hi", "token_type_ids": np.zeros(2)}], None, "prompt 0 is a dict with 'token_type_ids', which"),
        ([[2, 5]], [None], r"sampling_params\[0\] is NoneType, not SamplingParams: give one per prompt"),
        # A leftover vLLM import: "sampling_params[0] is SamplingParams, not SamplingParams".
        (
            [[2, 5]],
            [VLLM_SAMPLING_PARAMS],
            r"sampling_params\[0\] is vllm\.sampling_params\.SamplingParams \(import SamplingParams from pluginhost",
        ),
        ([[2, 5]], VLLM_SAMPLING_PARAMS, "got vllm.sampling_params.SamplingParams .import SamplingParams from"),
    ],
)
def test_bad_requests_raise_value_error_and_the_engine_keeps_serving(llm, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params)
    assert llm.generate([[2, 5]], SamplingParams(max_tokens=2, temperature=0))[0].token_ids


def test_vllm_prompt_dict_keys_that_ask_nothing_of_a_text_model_are_taken(llm):
    """vLLM's TokensPrompt with its other keys empty (as a port builds it), and a prefix-cache salt."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    plain = llm.generate([[2, 5, 9]], params)[0].token_ids
    prompt = {"prompt_token_ids": [2, 5, 9], "multi_modal_data": None, "mm_processor_kwargs": {}, "cache_salt": "u1"}
    assert llm.generate([prompt], params)[0].token_ids == plain


def test_a_request_whose_logits_are_not_numbers_ends_with_a_clear_error_and_the_others_go_on(tiny_opt):
    """NaN logits (a float16 overflow, say): greedy decoding chose token 0 for ever, sampling crashed."""
    llm = LLM(str(tiny_opt), load_installed_plugins=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].token_ids
    compute_logits, overflow = llm.model.compute_logits, []
    llm.model.compute_logits = lambda hidden: (
        compute_logits(hidden).fill_(float("nan")) if overflow and overflow.pop() else compute_logits(hidden)
    )
    first = llm._inputs.make_request("first", PROMPTS[0], params)
    llm.engine.submit([first])
    llm.engine.step(), llm.engine.step()  # its prefill, then a decoding step (a prefill step is followed by one)
    second = llm._inputs.make_request("second", PROMPTS[1], params)
    llm.engine.submit([second])
    overflow.append(True)  # the next step, the second's prefill alone, overflows
    while not (first.finished and second.finished):
        llm.engine.step()
    assert isinstance(second.error, ModelRunError)
    assert "gave logits that are not finite numbers (NaN or infinity) for this request" in str(second.error)
    assert first.error is None and first.output().token_ids == alone
    # A prompt scored for prompt_logprobs is checked at every position: a NaN at one was a NaN in its answer (and a
    # 500 from the server, whose JSON holds no NaN), while its last position's logits were fine.
    nan_at_position_1 = [True]

    def scoring_overflows(hidden):
        logits = compute_logits(hidden)
        if len(hidden) > 1 and nan_at_position_1 and nan_at_position_1.pop():  # the first call: the prompt's scores
            logits[1] = float("nan")
        return logits

    llm.model.compute_logits = scoring_overflows
    scored = llm._inputs.make_request("scored", PROMPTS[0], params.clone(prompt_logprobs=1))
    llm.engine.submit([scored])
    while not scored.finished:
        llm.engine.step()
    assert isinstance(scored.error, ModelRunError) and not nan_at_position_1
    assert "not finite numbers (NaN or infinity) at a position of this request's prompt" in str(scored.error)
    assert llm.generate([PROMPTS[0]], params.clone(prompt_logprobs=1))[0].token_ids == alone  # the engine goes on


def test_running_requests_keep_decoding_while_newcomers_arrive_before_every_step(tiny_opt):
    """A busy server: a request arrives before each step. Admitting at most every other step while others run keeps
    the running ones decoding (each newcomer admitted at once made every step a prefill: the stream got nothing)."""
    llm = LLM(str(tiny_opt), load_installed_plugins=False, max_num_seqs=64, max_waiting_seqs=64)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    first = llm._inputs.make_request("first", PROMPTS[0], params)
    llm.engine.submit([first])
    llm.engine.step(), llm.engine.step()  # its prefill, then a decoding step
    before = len(first.sequences[0].token_ids)
    for i in range(20):
        llm.engine.submit([llm._inputs.make_request(f"new-{i}", PROMPTS[1], params)])
        llm.engine.step()
    assert len(first.sequences[0].token_ids) - before >= 10


def test_text_encoding_outside_the_models_vocabulary_is_refused_before_it_reaches_the_model(tmp_path):
    """A tokenizer with more tokens than the model's embedding: the prompt is refused, not the whole batch."""
    from pluginhost.testing import make_tiny_opt
    from pluginhost.testing.models import make_byte_tokenizer

    path = make_tiny_opt(tmp_path, tokenizer=False, vocab_size=200)
    make_byte_tokenizer(path, vocab_size=320)
    llm = LLM(str(path), load_installed_plugins=False)
    with pytest.raises(ValueError, match=r"prompt 1 encodes to token id\(s\) \[.*\] outside the model's vocabulary "):
        llm.generate(["Hi", "The quick brown fox"], SamplingParams(max_tokens=2))
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0))[0].token_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be an integer >= 0"),
        ({"logprobs": -2}, "logprobs must be None, an integer >= 0, or -1 for the whole vocabulary"),
        ({"stop_token_ids": [-3]}, "stop_token_ids must be a list of token ids >= 0"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids >= 0, got 5"),
        ({"seed": 2**64}, r"seed must be in \[-2\*\*63, 2\*\*64 - n\]"),
        ({"seed": 2**64 - 1, "n": 2}, r"sample i draws from seed \+ i\), got 18446744073709551615"),
        ({"seed": -(2**63) - 1}, "seed must be in"),
        # Each is looked for after every token of every sample, in the loop serving everyone (20,000 with n=8: the
        # other requests ran 23 times slower).
        ({"stop": [f"s{i}" for i in range(65)]}, r"stop may hold at most 64 strings .*, got 65"),
    ],
)
def test_invalid_sampling_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_as_many_stop_strings_as_the_limit_are_taken():
    from pluginhost.sampling import MAX_STOP_STRINGS

    assert len(SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]).stop) == MAX_STOP_STRINGS == 64
    with pytest.raises(ValueError) as refused:
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    assert refused.value.param == "stop"


def test_text_prompt_without_a_tokenizer(tiny_opt_no_tokenizer):
    llm = LLM(str(tiny_opt_no_tokenizer), load_installed_plugins=False)
    with pytest.raises(ValueError, match="prompt 0 is text, but .* has no tokenizer files; pass token ids"):
        llm.generate(["Hello"])
    out = llm.generate([[2, 5, 9]], SamplingParams(max_tokens=3))[0]
    assert out.text is None and len(out.token_ids) >= 1


def test_logprobs_are_capped_by_max_logprobs(tiny_opt, llm):
    with pytest.raises(ValueError, match=r"logprobs=21 is more than this engine allows \(20\): ask for fewer"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, logprobs=21))
    wide = LLM(str(tiny_opt), load_installed_plugins=False, max_logprobs=100)
    out = wide.generate(PROMPTS[:1], SamplingParams(max_tokens=1, logprobs=50))[0]
    assert len(out.logprobs[0]) >= 50


def test_logprobs_minus_one_reports_the_whole_vocabulary_as_vllm_does(tiny_opt, llm):
    vocabulary = llm.vocab_size
    with pytest.raises(ValueError, match=rf"logprobs=-1 \(the whole vocabulary, {vocabulary}\) is more than this"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, logprobs=-1))  # max_logprobs 20, as in vLLM
    every = LLM(str(tiny_opt), load_installed_plugins=False, max_logprobs=-1)
    out = every.generate(PROMPTS[:1], SamplingParams(max_tokens=2, logprobs=-1, temperature=0))[0]
    for token, step in zip(out.token_ids, out.logprobs, strict=True):
        assert sorted(step) == list(range(vocabulary))
        assert max(step, key=step.get) == token  # greedy: the most likely
        assert math.isclose(sum(math.exp(v) for v in step.values()), 1.0, rel_tol=1e-4)


def test_prompt_logprobs_score_each_prompt_once_as_vllm_reports_them(tiny_opt, llm):
    """vLLM's ``prompt_logprobs``: ``None`` for the first token, then each token's and the top k's, given the tokens
    before it; once per request, whatever its n; within ``max_logprobs``; the model's own distribution."""
    prompt = PROMPTS[0]
    with torch.no_grad():  # the model's own forward over the prompt: position p predicts token p + 1
        steps = llm.model.compute_logits(llm.model(torch.tensor([prompt]), torch.arange(len(prompt))[None]))
    steps = steps[0, :-1].log_softmax(-1)
    params = SamplingParams(max_tokens=3, n=3, temperature=1.0, seed=5, prompt_logprobs=2, logit_bias={41: 5.0})
    out, one_token = llm.generate([prompt, [2]], params)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for token, step, reported in zip(prompt[1:], steps, out.prompt_logprobs[1:], strict=True):
        values, ids = step.topk(2)
        assert list(reported)[0] == token and set(ids.tolist()) <= set(reported) <= {token, *ids.tolist()}
        assert max(abs(v - float(step[t])) for t, v in reported.items()) < 1e-5  # no bias: the model's own
    assert one_token.prompt_logprobs == [None]  # nothing precedes its only token
    assert llm.generate([prompt], SamplingParams(max_tokens=1))[0].prompt_logprobs is None  # not asked for
    own = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    assert [list(step) for step in own[1:]] == [[t] for t in prompt[1:]]  # k = 0: the prompt's own tokens
    with pytest.raises(TypeError, match="read-only"):
        own[1][5] = 0.0
    with pytest.raises(ValueError, match=r"prompt_logprobs=21 is more than this engine allows \(20\)") as refused:
        llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=21))
    assert refused.value.param == "prompt_logprobs"
    with pytest.raises(ValueError, match="prompt_logprobs must be None, an integer >= 0, or -1"):
        SamplingParams(prompt_logprobs=-2)
    every = LLM(str(tiny_opt), load_installed_plugins=False, max_logprobs=-1)
    whole = every.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=-1))[0].prompt_logprobs
    assert all(sorted(step) == list(range(llm.vocab_size)) for step in whole[1:])
    assert all(math.isclose(sum(math.exp(v) for v in step.values()), 1.0, rel_tol=1e-4) for step in whole[1:])


def test_each_tokens_logprobs_know_its_rank_in_the_vocabulary_as_vllm_ranks_it(llm):
    """``TokenLogprobs.rank``: vLLM's ``Logprob.rank``: the token's place among the top k where it is one of them,
    else how many tokens are at least as likely; ``ranks()``: the top k's places too. Prompt and generated tokens."""
    prompt = PROMPTS[0]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0].token_ids
    text = prompt + greedy  # its last three tokens are each the most likely after the tokens before them
    with torch.no_grad():
        steps = llm.model.compute_logits(llm.model(torch.tensor([text]), torch.arange(len(text))[None]))
    steps = steps[0, :-1].log_softmax(-1)
    scored = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    outside = 0
    for token, step, reported in zip(text[1:], steps, scored[1:], strict=True):
        top = step.topk(2).indices.tolist()
        rank = top.index(token) + 1 if token in top else int((step >= step[token]).sum())
        outside += token not in top
        assert reported.rank == rank
        assert reported.ranks() == {token: rank, **{t: i + 1 for i, t in enumerate(top) if t != token}}
    assert [step.rank for step in scored[-3:]] == [1, 1, 1] and outside  # both ways of ranking were tested
    assert pickle.loads(pickle.dumps(scored[1])).ranks() == scored[1].ranks()
    for seed in range(30):  # a generated token outside the top 1
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=1.0, seed=seed, logprobs=1))[0]
        if out.logprobs[0].rank > 1:
            break
    else:
        pytest.fail("no seed drew a token outside the top 1: the test did not test it")
    first = steps[len(prompt) - 1]  # the distribution after the prompt
    token = out.token_ids[0]
    assert out.logprobs[0].rank == int((first >= first[token]).sum())
    assert out.logprobs[0].ranks() == {token: out.logprobs[0].rank, int(first.argmax()): 1}
    assert TokenLogprobs({token: -1.0}).ranks() == {}  # built by hand: not known


def test_offline_generate_takes_more_prompts_than_a_server_would_queue(tiny_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False, max_waiting_seqs=3, max_num_seqs=2)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    outputs = llm.generate([[2, 10 + i] for i in range(10)], params)
    assert [len(o.token_ids) for o in outputs] == [2] * 10


def test_the_queue_bound_holds_while_the_engine_takes_in_what_was_submitted(tiny_opt, monkeypatch):
    """Sequences the engine loop has taken from the inbox and not yet queued still count.

    In that moment they were counted nowhere: with 4 rows and room for 2 to wait, all taken, 6 more were accepted.
    """
    import threading
    import time

    from pluginhost.engine.scheduler import Scheduler
    from pluginhost.errors import EngineOverloadedError

    llm = LLM(str(tiny_opt), load_installed_plugins=False, max_num_seqs=4, max_waiting_seqs=2)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    made = iter(range(100))
    engine = llm.engine
    engine.submit([llm._inputs.make_request(f"r{next(made)}", PROMPTS[0], params.clone()) for _ in range(6)])
    taking, add = threading.Event(), Scheduler.add

    def slowly(scheduler, sequences):  # the engine loop, between taking the inbox and queueing what it held
        taking.set()
        time.sleep(0.3)
        add(scheduler, sequences)

    monkeypatch.setattr(Scheduler, "add", slowly)
    stepping = threading.Thread(target=engine.step)
    stepping.start()
    try:
        assert taking.wait(60)
        with pytest.raises(EngineOverloadedError):
            engine.submit([llm._inputs.make_request(f"r{next(made)}", PROMPTS[0], params.clone())])
    finally:
        stepping.join(60)


def test_the_queue_bound_counts_only_what_cannot_start_at_the_next_step(tiny_opt):
    """Free rows of the batch take sequences beside the queue: an idle engine takes max_num_seqs + max_waiting_seqs.

    It refused all but max_waiting_seqs of a burst while every row was free (a server answered 503 to an idle
    burst, and 400 to n=3 with max_waiting_seqs=2).
    """
    from pluginhost.errors import EngineOverloadedError

    llm = LLM(str(tiny_opt), load_installed_plugins=False, max_num_seqs=4, max_waiting_seqs=2)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    made = iter(range(100))

    def request(n: int = 1):
        return llm._inputs.make_request(f"r{next(made)}", PROMPTS[0], params.clone(n=n))

    engine = llm.engine
    burst = [request(n=3), request(), request(), request()]  # 6 sequences: 4 rows free, 2 to wait
    engine.submit(burst)
    with pytest.raises(EngineOverloadedError, match=r"--max-waiting-seqs\) or max_num_seqs \(--max-num-seqs\)"):
        engine.submit([request()])
    engine.step()  # admits 4 of them: the 2 others wait, and no row is free
    assert (engine.scheduler.num_running, engine.scheduler.num_waiting) == (4, 2)
    with pytest.raises(EngineOverloadedError, match=r"2 sequences wait to start, 1 more asked for, and at most 2"):
        engine.submit([request()])
    engine.run_until(lambda: all(r.finished for r in burst))
    assert [len(s.token_ids) for r in burst for s in r.sequences] == [4] * 6
    late = [request(n=2), request(n=4)]  # idle again: 6 sequences at once, none refused
    engine.submit(late)
    engine.run_until(lambda: all(r.finished for r in late))
    with pytest.raises(
        ValueError, match=r"n=7 samples are more than the engine ever takes in at once \(6: max_num_seqs=4"
    ):
        request(n=7)


def test_text_far_too_long_for_the_context_is_refused_before_it_is_tokenized(tiny_opt, monkeypatch):
    """Megabytes of text took seconds (and gigabytes) to tokenize, only to be refused as too long then."""
    from pluginhost.errors import PromptTooLongError
    from pluginhost.tokenizer import most_chars_per_token

    llm = LLM(str(tiny_opt), load_installed_plugins=False, max_model_len=64)
    most = most_chars_per_token(llm.tokenizer)
    assert most is not None
    tokenized: list[int] = []
    encode = type(llm.tokenizer).__call__
    monkeypatch.setattr(
        type(llm.tokenizer), "__call__", lambda self, *a, **k: tokenized.append(1) or encode(self, *a, **k)
    )
    with pytest.raises(
        PromptTooLongError, match=rf"prompt 1 has {64 * most + 1} characters, more than max_model_len=64"
    ):
        llm.generate(["fine", "x" * (64 * most + 1)], SamplingParams(max_tokens=2))
    assert tokenized == [1]  # the first prompt only
    # As long as the bound allows, a text is tokenized and judged on its tokens, as before.
    with pytest.raises(PromptTooLongError, match=r"prompt 0 has \d+ tokens"):
        llm.generate(["x" * 64 * most], SamplingParams(max_tokens=2))
    # The longest piece of the vocabulary, as many times as fit: never refused by the bound.
    piece = max(range(llm.vocab_size), key=lambda t: len(llm.tokenizer.decode([t])))
    text = llm.tokenizer.decode([piece] * 60)
    assert llm.generate([text], SamplingParams(max_tokens=2, temperature=0))[0].token_ids


def _tokenizers_of_every_kind():
    """Fast tokenizers the way model directories hold them, with what a text may go through on its way to tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["The quick brown fox jumps over the lazy dog. Plugins extend the engine through hooks."] * 4
    corpus += ["Ça déborde: ﬁn, Ǆ, 가각, ἂ, e\u0301, 0123456789 — αβγ"] * 4
    corpus += ["ᾂ" * 64, "각" * 64] * 4  # long tokens of characters NFC composes from several code points
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]

    def build(model, trainer, *, normalizer=None, pre_tokenizer=None, decoder=None, added=()):
        tokenizer = Tokenizer(model)
        tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, pre_tokenizer
        if decoder is not None:
            tokenizer.decoder = decoder
        tokenizer.train_from_iterator(corpus, trainer)
        tokenizer.add_special_tokens(list(added))
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")

    def bpe_trainer(specials=("<unk>", "<s>", "</s>")):
        return trainers.BpeTrainer(vocab_size=400, special_tokens=list(specials), show_progress=False)

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    return {
        # GPT-2 / OPT: byte-level BPE, bounded.
        "byte-level": build(
            models.BPE(unk_token="<unk>"),
            trainers.BpeTrainer(
                vocab_size=400, special_tokens=["<unk>"], initial_alphabet=alphabet, show_progress=False
            ),
            pre_tokenizer=byte_level,
            decoder=decoders.ByteLevel(),
        ),
        # Qwen2: byte-level after NFC, which composes up to 4 code points into one character.
        "NFC byte-level": build(
            models.BPE(unk_token="<unk>"),
            trainers.BpeTrainer(
                vocab_size=400, special_tokens=["<unk>"], initial_alphabet=alphabet, show_progress=False
            ),
            normalizer=normalizers.NFC(),
            pre_tokenizer=pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\d"), "isolated"), byte_level]),
            decoder=decoders.ByteLevel(),
        ),
        # Characters as they are, after NFC: a token of "ᾂ" stands for four times its characters.
        "NFC pieces": build(models.BPE(unk_token="<unk>"), bpe_trainer(), normalizer=normalizers.NFC()),
        # Llama 2 / Mistral: SentencePiece BPE with byte fallback, spaces made "▁".
        "byte fallback": build(
            models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True),
            bpe_trainer(("<unk>", "<s>", "</s>", *byte_pieces)),
            normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
        ),
        # Unbounded: unknown runs fused into one token, whitespace dropped, accents stripped, tokens taking spaces.
        "fused unknown": build(models.BPE(unk_token="<unk>", fuse_unk=True), bpe_trainer()),
        "whitespace split": build(
            models.WordPiece(unk_token="<unk>"),
            trainers.WordPieceTrainer(vocab_size=400, special_tokens=["<unk>"], show_progress=False),
            normalizer=normalizers.BertNormalizer(),
            pre_tokenizer=pre_tokenizers.BertPreTokenizer(),
        ),
        "unigram": build(
            models.Unigram(), trainers.UnigramTrainer(vocab_size=200, special_tokens=["<unk>"], unk_token="<unk>")
        ),
        # Characters its vocabulary lacks are dropped, no token for them ("€" x 10000 + "fox": 2 tokens).
        "BPE without an unknown token": build(models.BPE(), bpe_trainer()),
        "byte-level lacking bytes": build(models.BPE(), bpe_trainer(), pre_tokenizer=byte_level),
        # Any word it cannot split, however long, is one unknown token ("a" x 100000: 1 token).
        "whole words": build(
            models.WordPiece(unk_token="<unk>"),
            trainers.WordPieceTrainer(vocab_size=400, special_tokens=["<unk>"], show_progress=False),
            pre_tokenizer=pre_tokenizers.Metaspace(),
        ),
        "stripping special token": build(
            models.BPE(unk_token="<unk>"),
            trainers.BpeTrainer(
                vocab_size=400, special_tokens=["<unk>"], initial_alphabet=alphabet, show_progress=False
            ),
            pre_tokenizer=byte_level,
            added=[__import__("tokenizers").AddedToken("<mask>", lstrip=True, special=True)],
        ),
    }


def test_the_most_characters_a_token_stands_for_is_never_too_few():
    """The bound that refuses a text unread must hold for every text, or a prompt that fits would be refused."""
    from pluginhost.tokenizer import most_chars_per_token

    kinds = _tokenizers_of_every_kind()
    bounds = {name: most_chars_per_token(tokenizer) for name, tokenizer in kinds.items()}
    unbounded = {
        "fused unknown",
        "whitespace split",
        "unigram",
        "stripping special token",
        "BPE without an unknown token",
        "byte-level lacking bytes",
        "whole words",
    }
    assert {name for name, most in bounds.items() if most is None} == unbounded, bounds
    for name, tokenizer in kinds.items():
        most = bounds[name]
        if most is None:
            continue
        pieces = [tokenizer.decode([t]) for t in range(len(tokenizer))]
        texts = [piece * 50 for piece in pieces if piece]
        texts += [
            "e\u0301" * 500,  # composed by NFC: two code points, one character
            "\u1100\u1161\u11a8" * 300,  # Hangul jamo: three code points, one syllable
            "\u03b1\u0313\u0300\u0345" * 300,  # four code points, one character (U+1F82)
            " " * 3000,
            "\n\n\t " * 500,
            "ﬁ" * 500,
            "<unk>" * 300 + "<s></s>" * 100,
            "".join(chr(c) for c in range(0x20, 0x3000, 7)),
        ]
        for text in texts:
            tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            assert tokens * most >= len(text), (name, most, tokens, text[:40])


def test_the_model_may_be_a_path(tiny_opt, llm):
    by_path = LLM(Path(tiny_opt), load_installed_plugins=False)
    assert by_path.config.model == str(tiny_opt)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert by_path.generate(PROMPTS, params)[0].token_ids == llm.generate(PROMPTS, params)[0].token_ids


@pytest.mark.parametrize(
    ("plugins", "message"),
    [
        ([None], r"plugins\[0\] is None, not a plugin"),
        (
            [object, "my_plugin"],
            r"plugins\[1\] is 'my_plugin', not a plugin: .* chosen by name with PLUGINHOST_PLUGINS",
        ),
        ("my_plugin", "plugins must be a list of plugin objects .* got str"),
        ({"name": object}, "plugins must be a list of plugin objects .* got dict"),
    ],
)
def test_plugins_that_are_not_plugin_objects_are_one_value_error(tiny_opt, plugins, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_opt), plugins=plugins, load_installed_plugins=False)


def test_invalid_engine_settings_are_one_clear_error(tiny_opt):
    with pytest.raises(
        ConfigError, match=r"Invalid engine settings: dtype: 'fp64' is not a dtype pluginhost runs: use "
    ):
        LLM(str(tiny_opt), load_installed_plugins=False, dtype="fp64")
    with pytest.raises(ConfigError, match="unknown setting"):
        LLM(str(tiny_opt), load_installed_plugins=False, max_len=3)
    with pytest.raises(ConfigError, match=r"seed: Input should be less than or equal to 18446744073709551615"):
        LLM(str(tiny_opt), load_installed_plugins=False, seed=2**70)  # torch.manual_seed's range, not an overflow


def test_a_checkpoint_declaring_no_dtype_loads_without_transformers_deprecation_warning(tmp_path):
    import json
    import subprocess
    import sys

    from pluginhost.testing import make_tiny_opt

    path = make_tiny_opt(tmp_path, tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(config))
    # A fresh process: transformers says it once per process, and where pytest cannot capture it.
    code = f"from pluginhost import LLM; print(LLM({str(path)!r}, load_installed_plugins=False).dtype)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "torch.float32", result.stderr
    assert "torch_dtype" not in result.stderr  # "`torch_dtype` is deprecated! Use `dtype` instead!"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: CUDA is available")
def test_asking_for_cuda_without_it_is_one_clear_error(tiny_opt):
    with pytest.raises(ConfigError, match="device 'cuda' was asked for, but CUDA is not available here"):
        LLM(str(tiny_opt), load_installed_plugins=False, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cuda_engine_generates_what_the_cpu_engine_does(tiny_opt, llm):
    gpu = LLM(str(tiny_opt), load_installed_plugins=False, device="cuda", dtype="float32")
    assert next(gpu.model.parameters()).is_cuda and gpu.config.device.startswith("cuda")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in gpu.generate(PROMPTS, params)] == [o.token_ids for o in llm.generate(PROMPTS, params)]


# -- the build: a straight line ---------------------------------------------------------


def test_the_build_reads_checks_and_resolves_each_thing_once(tiny_opt, monkeypatch):
    import pluginhost.build
    import pluginhost.engine.loader
    import pluginhost.model_dir
    from pluginhost.registry import ArchitectureRegistry

    calls: Counter[str] = Counter()

    def count(owner, name):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    count(pluginhost.model_dir, "read_config_json")
    count(pluginhost.build, "model_directory")
    count(pluginhost.engine.loader, "load_tokenizer")
    count(pluginhost.engine.loader, "find_checkpoint")
    count(ArchitectureRegistry, "resolve")
    LLM(str(tiny_opt), load_installed_plugins=False)
    assert calls == {
        n: 1 for n in ("read_config_json", "model_directory", "load_tokenizer", "find_checkpoint", "resolve")
    }


def test_pre_load_sees_the_device_dtype_and_length_the_engine_decided(tiny_opt):
    seen = {}

    class Peek:
        @hookimpl
        def pre_load(self, config):
            seen.update(device=config.device, dtype=config.dtype, max_model_len=config.max_model_len)

    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[Peek()])
    assert seen == {"device": "cpu", "dtype": "float32", "max_model_len": 128}
    assert llm.config.provenance["device"] == "default"  # decided from the default "auto", not set by anyone


def test_max_model_len_a_build_hook_sets_is_the_engines_and_checked_against_the_model(tiny_opt):
    # Raised past the model's positions in pre_load, it was taken unchecked: every long request then failed.
    class Length:
        value = 4096

        @hookimpl
        def pre_load(self, config):
            config.max_model_len = self.value

    with pytest.raises(ConfigError, match="max_model_len=4096 is more than the model's 128 positions") as refused:
        LLM(str(tiny_opt), load_installed_plugins=False, plugins=[Length()])
    assert "(max_model_len was set by plugin 'Length' in pre_load)" in str(refused.value)  # not the user's to lower
    lowered = Length()
    lowered.value = 16
    llm = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[lowered])
    assert llm.config.max_model_len == 16
    with pytest.raises(
        ValueError, match="prompt 0 has 20 tokens, which leaves no room to generate within max_model_len=16"
    ):
        llm.generate([[2] * 20], SamplingParams(max_tokens=2))


@pytest.mark.parametrize(
    ("model_type", "overrides", "message"),
    [
        ("llama", {"rope_parameters": {"rope_type": "ntk", "rope_theta": 1e4}}, "rope_type 'ntk' is not one"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "cannot be used: it lacks 'factor'"),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "linear",
                    "factor": 2.0,
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor=0.5, but LlamaConfig's models rotate every dimension of a head",
        ),
        ("llama", {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
        ("mistral", {"sliding_window": 0}, "sliding_window must be a number of positions >= 1"),
        ("llama", {"hidden_act": "mish"}, "hidden_act 'mish' is not supported by the builtin models; use one of "),
        ("gpt2", {"n_head": 3}, "n_embd 64 is not a multiple of n_head 3"),
    ],
)
def test_config_values_the_model_cannot_use_are_refused_when_it_is_built(tmp_path, model_type, overrides, message):
    # They were accepted, then failed every request (KeyError: 'ntk'; a shape mismatch for a partial rotary
    # factor, or none and other tokens than intended), or generated garbage (a window of 0).
    model = make_tiny_model(tmp_path, model_type)
    with pytest.raises(ModelClassError, match=message):
        LLM(str(model), load_installed_plugins=False, hf_overrides=overrides)


def test_an_activation_the_builtin_models_lack_runs_through_transformers_as_the_refusal_advises(tmp_path):
    model = make_tiny_model(tmp_path, "llama", hidden_act="mish")
    with pytest.raises(ModelClassError, match=r"model_impl='transformers' \(--model-impl transformers\)"):
        LLM(str(model), load_installed_plugins=False)
    llm = LLM(str(model), load_installed_plugins=False, model_impl="transformers")
    assert (
        len(llm.generate([[2, 5, 9]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0].token_ids) == 3
    )


def test_a_broken_tokenizer_fails_before_anything_heavy(tiny_opt, tmp_path):
    model = shutil.copytree(tiny_opt, tmp_path / "model")
    (model / "tokenizer.json").write_text("{ not json")
    (model / "model.safetensors").unlink()
    reached = []

    class Watch:
        @hookimpl
        def pre_load(self):
            reached.append("pre_load")

    with pytest.raises(ConfigError, match="tokenizer files in .* could not be loaded"):
        LLM(str(model), load_installed_plugins=False, plugins=[Watch()])
    assert reached == []  # neither pre_load nor the (missing) weights were reached


def test_an_engine_failure_is_not_blamed_on_the_model(llm, monkeypatch):
    import pluginhost.engine.core

    def broken_sampler(logits, states):
        raise RuntimeError("a bug in the sampler")

    monkeypatch.setattr(pluginhost.engine.core, "sample", broken_sampler)
    with pytest.raises(RuntimeError, match="a bug in the sampler") as info:
        llm.generate([[2, 5]], SamplingParams(max_tokens=2))
    assert not isinstance(info.value, ModelRunError)


def test_prompts_of_very_different_lengths_join_together_and_match_alone(llm, decoding_attention):
    """Joining prompts are prefilled in passes of similar length (less padding); results do not change."""
    prompts = [[2, *range(10, 10 + n)] for n in (4, 90, 30, 100, 8)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1)
    together = llm.generate(prompts, params)
    for prompt, out in zip(prompts, together, strict=True):
        alone = llm.generate([prompt], params)[0]
        assert alone.token_ids == out.token_ids
        assert all(abs(a[k] - b[k]) < 1e-4 for a, b in zip(alone.logprobs, out.logprobs, strict=True) for k in a)


def test_joining_prompts_are_grouped_by_length():
    from pluginhost.engine.runner import _similar_lengths

    lengths = [5, 250, 30, 240, 8, 120, 40]
    groups = _similar_lengths(list(range(len(lengths))), lengths)
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))  # every row, once
    for group in groups:
        sizes = [lengths[r] for r in group]
        padded = len(sizes) * max(sizes)
        assert padded <= 64 or padded <= 1.25 * sum(sizes)
    assert [3, 1] in groups and [0, 4] in groups  # 240 and 250 share a pass, so do 5 and 8; 5 and 250 do not


# -- the KV cache and the memory left ---------------------------------------------------------------


@pytest.fixture(scope="module")
def long_opt(tmp_path_factory) -> Path:
    """The tiny OPT with room for 1024 positions: sequences longer than the cache's first block."""
    from pluginhost.testing import make_tiny_opt

    return make_tiny_opt(tmp_path_factory.mktemp("long-opt"), tokenizer=False, max_position_embeddings=1024)


def test_processes_pluginhost_owns_keep_freed_memory_unless_the_user_tuned_malloc(monkeypatch):
    # Set in generate, serve and the spawned ranks: glibc then keeps a step's freed temporaries for the next
    # step instead of faulting them in again page by page. A user's own malloc settings win.
    import os
    import platform
    import subprocess
    import sys

    from pluginhost.engine.memory import keep_freed_memory

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_memory() is False
    if platform.libc_ver()[0] == "glibc":
        code = "from pluginhost.engine.memory import keep_freed_memory as k; raise SystemExit(0 if k() else 1)"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0


def memory_for(llm: LLM, rows: int, slots: int):  # noqa: ANN201 - what available_bytes returns
    """An ``available_bytes`` under which the cache may grow to ``rows`` x ``slots`` and no more."""
    from pluginhost.engine.memory import CACHE_SHARE

    runner = llm.engine.runner
    runner.check_memory(1, 1)  # the caches set up: what a slot costs
    per_slot = runner.slot_bytes()
    return lambda device: int(rows * slots * per_slot / CACHE_SHARE) + 1


def memory_beside_cache(llm: LLM, slots: int):  # noqa: ANN201 - what available_bytes returns
    """An ``available_bytes`` as a machine reports it: the memory of ``slots`` slots, less what the cache holds."""
    runner = llm.engine.runner
    runner.check_memory(1, 1)  # the caches set up: what a slot costs
    per_slot = runner.slot_bytes()
    return lambda device: (slots - math.prod(runner.cache_shape)) * per_slot


def test_compiled_decoding_under_a_memory_shortage_runs_eagerly_rather_than_compile_each_cache_size(
    tiny_opt, monkeypatch
):
    # The cache's rows follow the memory free when it is short: each count compiled anew (seconds each, the batch
    # waiting), as often as the memory changed.
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[2, 10 + i, 20 + i] for i in range(12)]
    expected = [o.token_ids for o in LLM(str(tiny_opt), load_installed_plugins=False).generate(prompts, params)]
    llm = LLM(str(tiny_opt), load_installed_plugins=False, compile_decode=True, max_num_seqs=32)
    for rows in (3, 5, 6, 7, 9):  # the memory free drifts
        monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_for(llm, rows, 256))
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.engine.runner.cache_shape[0] < 32  # capped by the memory
    assert llm.engine.runner.compiled.compile_seconds == 0


def decode_until_slot_256(llm: LLM, requests: list) -> list:
    """Submit ``requests`` and step until the first needs slot 256 at its next step; the stats of every step."""
    stats: list = []
    llm.engine.stats_listeners.append(stats.append)
    llm.engine.submit(requests)
    while requests[0].sequences[0].num_computed < 256:
        llm.engine.step()
    return stats


def test_a_request_longer_than_the_memory_allows_is_ended_and_the_others_go_on(long_opt, monkeypatch):
    llm = LLM(str(long_opt), load_installed_plugins=False)
    expected = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))[0]
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_for(llm, 2, 256))
    # The long one (600 tokens, room for 512 alone) waits for the short one's row, then is ended at 512.
    short, long = step_requests(llm, [(PROMPTS[0], 120), ([2, *[5] * 199], 400)])
    assert short.error is None and short.output().token_ids == expected.token_ids
    assert isinstance(long.error, KVCacheMemoryError)
    assert "The KV cache cannot grow to 1 rows x 768 slots" in str(long.error)
    assert "so it holds 1 sequences of up to 512 tokens" in str(long.error)
    assert len(long.output().token_ids) < 400  # what it had generated, as far as it got
    assert llm.generate([PROMPTS[2]], SamplingParams(max_tokens=9))[0].finish_reason == "length"  # and it serves on


def test_a_long_request_takes_the_slots_of_rows_no_sequence_holds_and_gives_them_back(long_opt, monkeypatch, caplog):
    # Eight short requests grew the cache to 8 rows; with room for 8 x 256 slots, a request of 1000 tokens was
    # ended at 256, though alone it fits in 2 rows x 1024. Afterwards 2 sequences at most ran, for good.
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    shorts = [[2, 10 + i, 20 + i] for i in range(8)]
    long_prompt, long = [2, *[5] * 199], SamplingParams(max_tokens=800, temperature=0, ignore_eos=True)
    unbounded = LLM(str(long_opt), load_installed_plugins=False)
    expected_shorts = [o.token_ids for o in unbounded.generate(shorts, params)]
    expected_long = unbounded.generate([long_prompt], long)[0].token_ids
    llm = LLM(str(long_opt), load_installed_plugins=False)
    assert [o.token_ids for o in llm.generate(shorts, params)] == expected_shorts
    assert llm.engine.runner.cache_shape == (8, 256)
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_for(llm, 8, 256))
    request = llm._inputs.make_request("long", long_prompt, long)
    llm.engine.submit([request])
    while not request.finished and request.sequences[0].num_computed < 600:
        llm.engine.step()
    assert request.error is None and llm.engine.runner.cache_shape == (2, 768)  # rows no sequence held, for slots
    with caplog.at_level("WARNING", logger="pluginhost"):  # three newcomers: one beside it, two wait for a row
        newcomers = step_requests(llm, [(shorts[i], 5) for i in range(3)])
    assert "room for 2 sequences of up to 1024 tokens in the memory available: at most 2 run at once" in caplog.text
    while not request.finished:
        llm.engine.step()
    assert request.error is None and request.output().token_ids == expected_long
    assert [r.output().token_ids for r in newcomers] == expected_shorts[:3]
    assert llm.engine.runner.cache_shape == (2, 1024)
    # Once it has ended, the cache gives its slots back and the eight run at once again.
    assert [o.token_ids for o in llm.generate(shorts, params)] == expected_shorts
    assert llm.engine.runner.cache_shape == (8, 256)
    assert llm.engine.scheduler.max_num_seqs == llm.engine.loaded.config.max_num_seqs


def test_newcomers_beyond_the_rows_memory_allows_wait_for_a_free_row(long_opt, monkeypatch, caplog):
    llm = LLM(str(long_opt), load_installed_plugins=False)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[2, 10 + i, 20 + i] for i in range(28)]
    expected = [llm.generate([p], params)[0].token_ids for p in prompts]
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_for(llm, 16, 256))
    running: list[int] = []
    llm.engine.stats_listeners.append(lambda stats: running.append(stats.num_running))
    with caplog.at_level("WARNING", logger="pluginhost"):
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected  # 28 asked, 16 at a time
    assert llm.engine.runner.cache_shape == (16, 256) and max(running) == 16
    # The cap was lifted when none of the first 16 ran any more: growing is checked against the memory again.
    assert llm.engine.scheduler.max_num_seqs == llm.engine.loaded.config.max_num_seqs
    assert "room for 16 sequences of up to 256 tokens in the memory available: at most 16 run at once" in caplog.text


def test_the_capacity_warning_says_when_not_one_sequence_fits_its_full_length(long_opt, monkeypatch, caplog):
    # Room for 256 slots of one row, and three requests that may each reach 400 tokens: it said "room for 1
    # sequences of up to 512 tokens", when not one fits that far. One runs at a time, as far as the memory allows.
    llm = LLM(str(long_opt), load_installed_plugins=False)
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_for(llm, 1, 256))
    with caplog.at_level("WARNING", logger="pluginhost"):
        requests = step_requests(llm, [([2, 10 + i, 20 + i], 397) for i in range(3)])
    assert "room for 1 sequences of up to 512" not in caplog.text
    assert "room for 0 sequences of up to 512 tokens in the memory available: 1 runs at once" in caplog.text
    assert all(isinstance(r.error, KVCacheMemoryError) for r in requests)  # each ended where the memory ran out
    assert all(len(r.output().token_ids) >= 250 for r in requests)


def test_a_batch_larger_than_the_rows_memory_allowed_earlier_waits_instead_of_failing(long_opt, monkeypatch):
    # Three sequences grew the cache to the 5 rows that fit (not 8); six later asked for a 6th row, the cache
    # was not grown past 5, and the forward failed every request (IndexError: index 5 is out of bounds).
    llm = LLM(str(long_opt), load_installed_plugins=False, max_num_seqs=16)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    jobs = [[2, 10 + i, 20 + i] for i in range(6)]
    expected = [o.token_ids for o in llm.generate(jobs, params)]
    fresh = LLM(str(long_opt), load_installed_plugins=False, max_num_seqs=16)
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_for(fresh, 5, 256))
    assert [o.token_ids for o in fresh.generate(jobs[:3], params)] == expected[:3]
    assert fresh.engine.runner.cache_shape == (5, 256)
    running: list[int] = []
    fresh.engine.stats_listeners.append(lambda stats: running.append(stats.num_running))
    assert [o.token_ids for o in fresh.generate(jobs, params)] == expected  # the sixth waits for a row
    assert fresh.engine.runner.cache_shape == (5, 256) and max(running) == 5


def step_requests(llm: LLM, jobs: list[tuple[list[int], int]]) -> list:
    """Submit (prompt, max_tokens) greedy requests at once and step the engine until all end; their requests."""
    requests = [
        llm._inputs.make_request(f"job-{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        for i, (prompt, n) in enumerate(jobs)
    ]
    llm.engine.submit(requests)
    while not all(r.finished for r in requests):
        llm.engine.step()
    return requests


def run_staged(llm: LLM, stages: list[tuple[list, int]]) -> list:
    """Submit each stage's requests, then step the engine that many times; then to the end. All the requests."""
    submitted = []
    for requests, steps in stages:
        llm.engine.submit(requests)
        submitted += requests
        for _ in range(steps):
            llm.engine.step()
    for _ in range(5000):
        if all(r.finished for r in submitted):
            return submitted
        llm.engine.step()
    raise AssertionError("the requests did not finish")


@pytest.mark.parametrize(
    ("room", "first", "steps", "then"),
    [
        # Eight requests of 300 tokens were all ended at 256 (8 x 512 slots do not fit): 4 at a time serves them.
        ((4, 512), [([2, 10 + i, 20 + i], 300) for i in range(8)], 0, []),
        # A 300-token prompt arriving beside 6 running requests was ended, though it fits once they leave.
        ((8, 256), [([2, 10 + i, 20], 100) for i in range(6)], 5, [([2, *[5 + i for i in range(299)]], 10)]),
        # Newcomers in rows the cache held counted as rows in use: the running one, needing slot 256, was ended.
        ((6, 512), [([2, *[5] * 199], 100)], 57, [([2, 10 + i, 20], 3) for i in range(7)]),
        # Its slots given back as the 400-token one ended, newcomers filled the rows; 4 running ones then needed
        # slot 256, which 8 rows could not have, and were ended.
        ((4, 512), [([2, 7, 8], 400)], 258, [([2, 10 + i, 20 + i], 300) for i in range(8)]),
    ],
    ids=["many-long-ones-run-by-turns", "a-long-prompt-waits", "newcomers-wait-for-room", "a-give-back-waits"],
)
def test_under_a_memory_shortage_no_request_is_ended_that_waiting_would_serve(
    long_opt, monkeypatch, room, first, steps, then
):
    def requests(jobs: list, tag: str) -> list:
        greedy = SamplingParams(temperature=0, ignore_eos=True)
        return [llm._inputs.make_request(f"{tag}-{i}", p, greedy.clone(max_tokens=n)) for i, (p, n) in enumerate(jobs)]

    unbounded = LLM(str(long_opt), load_installed_plugins=False)
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    expected = [unbounded.generate([p], greedy.clone(max_tokens=n))[0].token_ids for p, n in first + then]
    llm = LLM(str(long_opt), load_installed_plugins=False)
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_for(llm, *room))
    done = run_staged(llm, [(requests(first, "first"), steps), (requests(then, "then"), 0)])
    assert [r.error for r in done] == [None] * len(expected)
    assert [r.output().token_ids for r in done] == expected


def test_under_a_memory_shortage_requests_without_max_tokens_reserve_nothing_ahead(long_opt, monkeypatch):
    # Priced at all of what max_model_len leaves (1021 tokens each), 8 such requests ran 2 at a time.
    llm = LLM(str(long_opt), load_installed_plugins=False)
    llm.generate([[2, 10 + i, 20] for i in range(8)], SamplingParams(max_tokens=2))  # the cache: 8 rows x 256
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_for(llm, 8, 256))
    open_ended = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    requests = [llm._inputs.make_request(f"open-{i}", [2, 10 + i, 20], open_ended) for i in range(8)]
    llm.engine.submit(requests)
    for _ in range(3):
        llm.engine.step()
    assert llm.engine.scheduler.num_running == 8
    llm.engine.abort([r.request_id for r in requests])
    for _ in range(10):
        llm.engine.step()
    assert all(r.finished for r in requests)


def test_a_memory_refusal_right_after_the_batch_was_compacted_keeps_every_row_its_own(long_opt, monkeypatch):
    """The step that finds no room comes after one request left: the row moved then must still move in the cache."""
    jobs = [([2, 7, 8], 57), ([2, *[5] * 199], 300), ([2, 30, 31, 32], 100)]
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    unbounded = LLM(str(long_opt), load_installed_plugins=False)
    alone = [unbounded.generate([p], greedy.clone(max_tokens=n))[0].token_ids for p, n in jobs]
    llm = LLM(str(long_opt), load_installed_plugins=False)
    # The first ends one step before the second needs slot 256; the third then moves into the first's row. The
    # memory runs short as the first ends (another process took it): too late to keep the second from starting.
    room = {"now": memory_for(llm, 8, 512), "then": memory_for(llm, 3, 256)}
    first, second, third = [
        llm._inputs.make_request(f"job-{i}", p, greedy.clone(max_tokens=n)) for i, (p, n) in enumerate(jobs)
    ]
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", lambda device: room["now"](device))
    preempted: list[int] = []
    llm.engine.stats_listeners.append(lambda stats: preempted.append(stats.num_preempted))
    llm.engine.submit([first, second, third])
    for _ in range(100):  # until the first has ended: the rows move at the next step
        if first.finished:
            break
        llm.engine.step()
    assert first.finished and second.sequences[0].num_computed == 256  # it needs slot 256 at the next step
    room["now"] = room["then"]  # room for 1 row of 512 slots: the third, the newest, is preempted
    for _ in range(500):
        if second.finished and third.finished:
            break
        llm.engine.step()
    assert sum(preempted) == 1
    assert [r.error for r in (first, second, third)] == [None] * 3
    assert [r.output().token_ids for r in (first, second, third)] == alone


def test_a_sequence_waiting_while_newcomers_are_prefilled_keeps_the_room_its_next_token_needs(long_opt, monkeypatch):
    # 15 newcomers were prefilled into 16 rows x 256 slots; the long one's next token needed 512 slots, which
    # 16 rows could not have, so it was ended at the very next step, for the newcomers' sake.
    llm = LLM(str(long_opt), load_installed_plugins=False, max_num_seqs=64)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    expected = llm.generate([[2, *[5] * 199]], params)[0].token_ids
    llm = LLM(str(long_opt), load_installed_plugins=False, max_num_seqs=64)
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_for(llm, 8, 512))
    long = llm._inputs.make_request("long", [2, *[5] * 199], params)
    llm.engine.submit([long])
    while not long.finished and long.sequences[0].num_computed < 256:  # it needs slot 256 at its next step
        llm.engine.step()
    newcomers = [llm._inputs.make_request(f"new-{i}", [2, 10 + i, 20], params.clone(max_tokens=3)) for i in range(20)]
    llm.engine.submit(newcomers)
    llm.engine.step()  # their prefill step: 24 rows x 512 slots do not fit, 8 do
    llm.engine.step()  # so 7 of them are prefilled, beside it
    assert long.error is None and sum(r.sequences[0].num_computed > 0 for r in newcomers) == 7
    for _ in range(1000):
        if long.finished and all(r.finished for r in newcomers):
            break
        llm.engine.step()
    assert long.error is None and long.output().token_ids == expected
    assert all(r.error is None and len(r.output().token_ids) == 3 for r in newcomers)


def test_requests_the_cache_cannot_grow_for_are_preempted_and_recomputed_not_ended(long_opt, monkeypatch, caplog):
    # Without max_tokens (the server's chat default) nothing is reserved ahead: two such requests grew to 512
    # slots each, the memory holds 1 x 1024, and the one that needed slot 512 first was ended.
    open_ended = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    prompts = [[2, 10, 20], [2, 11, 21]]
    unbounded = LLM(str(long_opt), load_installed_plugins=False)
    expected = [o.token_ids for o in unbounded.generate(prompts, open_ended)]
    llm = LLM(str(long_opt), load_installed_plugins=False)
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_for(llm, 2, 512))
    stats: list = []
    llm.engine.stats_listeners.append(stats.append)
    with caplog.at_level("WARNING", logger="pluginhost"):
        outputs = llm.generate(prompts, open_ended)
    assert [o.token_ids for o in outputs] == expected and len(expected[0]) == 1021  # to max_model_len, both
    assert "cannot grow for 2 running sequences in the memory available: 1 preempted" in caplog.text
    assert sum(s.num_preempted for s in stats) == 1
    assert sum(s.num_prompt_tokens for s in stats) == 6  # a recomputed sequence's prompt is not counted again
    assert llm.engine.scheduler.max_num_seqs == llm.engine.loaded.config.max_num_seqs  # both ran at once again


def test_the_row_cap_holds_while_open_ended_sequences_run_so_none_is_preempted_twice(long_opt, monkeypatch, caplog):
    # After a long one ended, the cache shrank to what the running ones (no max_tokens) held, and the cap was lifted
    # although they went on growing: a preempted sequence came back, to be preempted again as they grew.
    open_ended = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    prompts = [[2, *[10 + j % 300 for j in range(3 + 60 * i)]] for i in range(8)]
    llm = LLM(str(long_opt), load_installed_plugins=False, max_num_seqs=8)
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_for(llm, 3, 1024))
    stats: list = []
    llm.engine.stats_listeners.append(stats.append)
    with caplog.at_level("WARNING", logger="pluginhost"):
        outputs = llm.generate(prompts, open_ended)
    assert [len(p) + len(o.token_ids) for p, o in zip(prompts, outputs, strict=True)] == [1024] * 8
    assert sum(s.num_preempted for s in stats) == caplog.text.count("The KV cache cannot grow") == 3  # was 4


def test_when_the_memory_shrinks_the_newest_sequences_wait_and_resume_where_they_were(long_opt, monkeypatch):
    """Preempted sequences keep their tokens, sampling state and penalties: each output is the one it has alone (its
    prompt's log-probabilities too, scored once)."""
    greedy = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, prompt_logprobs=2)
    params = [
        greedy,
        greedy.clone(presence_penalty=0.5),
        greedy.clone(temperature=1.0, seed=7),
        greedy.clone(temperature=0.8, top_k=20, seed=11, repetition_penalty=1.3),
    ]
    prompts = [[2, 10 + i, 20 + i] for i in range(4)]
    unbounded = LLM(str(long_opt), load_installed_plugins=False)
    alone = [unbounded.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    expected = [out.token_ids for out in alone]
    llm = LLM(str(long_opt), load_installed_plugins=False)
    room = {"now": memory_for(llm, 8, 512)}
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", lambda device: room["now"](device))
    sent: list = []  # what a tensor-parallel engine sends its other ranks, and the logits of each step
    run = llm.engine.runner.run
    monkeypatch.setattr(llm.engine.runner, "run", lambda inputs: sent.append((inputs, run(inputs))) or sent[-1][1])
    requests = [llm._inputs.make_request(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
    stats = decode_until_slot_256(llm, requests)  # every one needs slot 256 at its next step
    room["now"] = memory_for(llm, 2, 512)  # another process took memory: two of the four fit
    after = len(stats)
    for _ in range(2000):
        if all(r.finished for r in requests):
            break
        llm.engine.step()
    assert [r.error for r in requests] == [None] * 4
    assert [r.output().token_ids for r in requests] == expected
    for request, out in zip(requests, alone, strict=True):
        assert_same_logprobs(request.output().prompt_logprobs, out.prompt_logprobs)
    assert sum(s.num_preempted for s in stats) == 2 and max(s.num_running for s in stats[after:]) == 2
    recomputed = [inputs for inputs, _ in sent if inputs.kind == "prefill" and len(inputs.texts[0]) > 256]
    assert recomputed and not any(inputs.scored for inputs in recomputed)  # a prompt is scored once
    other_rank = LLM(str(long_opt), load_installed_plugins=False).engine.runner  # runs what it is sent, as a rank does
    for inputs, output in sent:
        replayed = other_rank.run(inputs)
        assert (replayed is None) == (output is None)
        if output is not None:
            assert torch.equal(replayed.logits, output.logits)
            assert replayed.prompt_scores.keys() == output.prompt_scores.keys()
    assert other_rank.cache_shape == llm.engine.runner.cache_shape


def test_a_preempted_sequence_with_rope_following_the_length_resumes_with_the_tokens_it_gets_alone(
    tmp_path, monkeypatch
):
    # Recomputed in one pass, its keys took the frequencies of its whole length, where decoding had written each at
    # the length it had then: its later tokens changed. Its tokens are replayed one at a time instead.
    rope = {"rope_type": "dynamic", "factor": 8.0, "rope_theta": 1e4}
    path = make_tiny_model(tmp_path, "llama", seed=2, max_position_embeddings=128, rope_parameters=rope)
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [[2, *range(10, 20)], [2, *range(40, 48)]]
    unbounded = LLM(str(path), load_installed_plugins=False, dtype="float32")
    expected = [unbounded.generate([p], params)[0].token_ids for p in prompts]
    llm = LLM(str(path), load_installed_plugins=False, dtype="float32")
    room = {"now": memory_for(llm, 8, 512)}
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", lambda device: room["now"](device))
    requests = [llm._inputs.make_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    stats = decode_until_slot_256(llm, requests)  # past the 128 trained positions: stretched frequencies
    room["now"] = memory_for(llm, 1, 512)  # one of the two fits
    for _ in range(2000):
        if all(r.finished for r in requests):
            break
        llm.engine.step()
    assert sum(s.num_preempted for s in stats) == 1
    assert [r.output().token_ids for r in requests] == expected


def test_once_the_memory_comes_back_the_preempted_sequences_run_again_at_once(long_opt, monkeypatch):
    # A shortage of one step capped the batch at the 2 sequences it kept, for as long as they ran, however
    # much memory came back: the preempted ones waited, and every newcomer behind them.
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    prompts = [[2, 10 + i, 20 + i] for i in range(4)]
    llm = LLM(str(long_opt), load_installed_plugins=False)
    room = {"now": memory_for(llm, 8, 512)}
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", lambda device: room["now"](device))
    requests = [llm._inputs.make_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    stats = decode_until_slot_256(llm, requests)  # every one needs slot 256 at its next step
    room["now"] = memory_for(llm, 2, 512)
    llm.engine.step()  # refused: two are preempted
    assert llm.engine.scheduler.num_running == 2 and llm.engine.scheduler.num_waiting == 2
    room["now"] = memory_for(llm, 8, 512)  # the other process has let go
    for _ in range(4):
        llm.engine.step()
    assert llm.engine.scheduler.num_running == 4 and sum(s.num_preempted for s in stats) == 2
    while not all(r.finished for r in requests):
        llm.engine.step()
    assert [r.error for r in requests] == [None] * 4
    assert llm.engine.scheduler.max_num_seqs == llm.engine.loaded.config.max_num_seqs  # nothing runs: no cap


def test_rows_left_empty_are_given_back_before_a_running_sequence_is_ended_for_memory(long_opt, monkeypatch):
    # Memory as a machine reports it: what the cache holds is not available. After the first ended, the cache
    # held 4 rows x 512 for 2 sequences; growing holds the old block while filling the new one, so 1 row of 768
    # did not fit beside it, and both were ended at 510 tokens, though each runs to max_model_len alone.
    open_ended = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    prompts = [[2, 10 + i, 10 + i] for i in range(3)]
    expected = [o.token_ids for o in LLM(str(long_opt), load_installed_plugins=False).generate(prompts, open_ended)]
    llm = LLM(str(long_opt), load_installed_plugins=False)
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_beside_cache(llm, 2800))
    assert [o.token_ids for o in llm.generate(prompts, open_ended)] == expected


def test_newcomers_that_came_together_wait_in_their_order_when_held_back(long_opt, monkeypatch):
    # A server's list of prompts shares one arrival time: held back for memory, they went back to the queue
    # reversed, and finished p0-3, p8-11, p4-7.
    llm = LLM(str(long_opt), load_installed_plugins=False)
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_for(llm, 4, 256))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    requests = [llm._inputs.make_request(f"p{i}", [2, 10 + i, 20 + i], params) for i in range(12)]
    for request in requests:
        request.arrival_time = requests[0].arrival_time  # as submit_all(arrival_time=...) gives them
    llm.engine.submit(requests)
    llm.engine.step()  # 8 admitted, room for 4: the last 4 of them go back to the queue
    assert [s.request.request_id for s in llm.engine.scheduler.waiting] == [f"p{i}" for i in range(4, 12)]


def test_an_idle_engine_takes_a_whole_batch_again_after_a_memory_shortage(long_opt, monkeypatch):
    # The cap set for memory stayed until a later step ran: an idle engine refused a burst its free rows could
    # take ("1 free rows of the running batch"), and admitted one sequence at its next step.
    llm = LLM(str(long_opt), load_installed_plugins=False, max_num_seqs=8, max_waiting_seqs=4)
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_beside_cache(llm, 2508))
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    jobs = [(92, None), (46, None), (117, None), (100, 593), (17, None), (5, None)]
    prompts = [[2, *[7 + i] * (n - 1)] for i, (n, _) in enumerate(jobs)]
    # Every one is served: three were ended for memory (at 769 tokens, say), each of which runs to its end alone,
    # judged with the rows the others held still held.
    llm.generate(prompts, [greedy.clone(max_tokens=m) for _, m in jobs])
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", lambda device: 1 << 40)  # memory back
    assert llm.engine.scheduler.max_num_seqs == 8
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    burst = [llm._inputs.make_request(f"b{i}", [2, 30 + i], short) for i in range(12)]
    llm.engine.submit(burst)  # 8 rows free and 4 to wait
    llm.engine.step()
    assert llm.engine.scheduler.num_running == 8


def test_a_rank_running_the_steps_sent_grows_its_cache_as_the_memory_check_allowed(long_opt, monkeypatch):
    """With tensor parallelism only rank 0 checks the memory: another rank's cache takes the shape its steps say."""
    llm = LLM(str(long_opt), load_installed_plugins=False)
    other_rank = LLM(str(long_opt), load_installed_plugins=False).engine.runner  # runs what it is sent, as a rank does
    sent = []
    run = llm.engine.runner.run
    monkeypatch.setattr(llm.engine.runner, "run", lambda inputs: (sent.append(inputs), run(inputs))[1])
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_for(llm, 3, 256))
    llm.generate([[2, 10 + i, 20 + i] for i in range(5)], SamplingParams(max_tokens=5, temperature=0))
    for inputs in sent:
        other_rank.run(inputs)
    assert other_rank.cache_shape == llm.engine.runner.cache_shape == (3, 256)  # not the 8 rows it grows by


def test_the_memory_available_is_known_on_this_machine():
    from pluginhost.engine.memory import available_bytes

    available = available_bytes(torch.device("cpu"))
    assert available is None or 0 < available < 1 << 50


def test_a_cgroup_limit_counts_with_its_parents_and_without_reclaimable_page_cache(tmp_path, monkeypatch):
    from pluginhost.engine import memory

    root = tmp_path / "cgroup"
    child = root / "box" / "job"
    child.mkdir(parents=True)
    (root / "memory.max").write_text("max\n")
    (root / "box" / "memory.max").write_text("5000\n")  # the parent's limit is the tighter one
    (root / "box" / "memory.current").write_text("4000\n")
    (root / "box" / "memory.stat").write_text("anon 3000\ninactive_file 500\n")
    (child / "memory.max").write_text("100000\n")
    (child / "memory.current").write_text("4000\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("0::/box/job\n")
    monkeypatch.setattr(memory, "_CGROUP_V2", root)
    monkeypatch.setattr(memory, "_PROC_CGROUP", str(proc))
    assert memory._cgroup_headroom() == 5000 - 4000 + 500
    proc.write_text("0::/\n")
    assert memory._cgroup_headroom() is None  # the root: no limit


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the process's size from /proc")
def test_an_address_space_limit_counts_as_the_memory_left(tmp_path):
    # Under ulimit -v, MemAvailable promised what the process could not map: a cache growth the check allowed
    # failed in the allocator, an "internal error" with a traceback, instead of the cache's own capping.
    import subprocess
    import sys

    code = """
import resource, torch
from pluginhost.engine.memory import _kib, available_bytes
size = _kib("/proc/self/status")["VmSize"]
resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
print(available_bytes(torch.device("cpu")) >> 20)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert 0 < int(result.stdout) <= 256


@pytest.mark.parametrize(
    ("settings", "rows", "prompts"),
    [({}, 5, 8), ({"max_num_seqs": 4}, 3, 4), ({"compile_decode": True}, 4, 2)],
    ids=["fewer-rows-than-a-row-step", "max-num-seqs-below-a-row-step", "compiled"],
)
def test_room_for_fewer_rows_than_the_cache_grows_by_still_serves_everyone(
    long_opt, monkeypatch, settings, rows, prompts
):
    """The cache grows 8 rows at a time (all of them when compiled): with room for fewer, it takes what fits."""
    llm = LLM(str(long_opt), load_installed_plugins=False, **settings)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    jobs = [[2, 10 + i, 20 + i] for i in range(prompts)]
    expected = [o.token_ids for o in LLM(str(long_opt), load_installed_plugins=False).generate(jobs, params)]
    monkeypatch.setattr("pluginhost.engine.runner.available_bytes", memory_for(llm, rows, 256))
    assert [o.token_ids for o in llm.generate(jobs, params)] == expected  # no refusal loops for ever
    assert llm.engine.runner.cache_shape == (rows, 256)


def test_generate_counts_its_requests_as_they_end_instead_of_looking_at_each_after_every_step(llm, monkeypatch):
    # Every request was looked at twice after every step: 20,000 prompts spent a quarter of the call doing so.
    from pluginhost.engine.request import EngineRequest

    looked = {"n": 0}
    finished = EngineRequest.finished

    def counted(request) -> bool:
        looked["n"] += 1
        return finished.fget(request)

    monkeypatch.setattr(EngineRequest, "finished", property(counted))
    prompts = [[2, 5 + i % 50, 6] for i in range(400)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
    assert [len(o.outputs[0].token_ids) for o in outs] == [2] * 400
    # The engine looks at the requests a step changes; the call at each of its own once, at the end.
    assert looked["n"] < 10 * len(prompts), looked["n"]


# -- a bfloat16 KV cache (kv_cache_dtype) ------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "config"),
    [
        ("opt", {}),
        ("llama", {}),  # grouped-query: 4 query heads on 2 key/value heads
        ("gpt2", {"reorder_and_upcast_attn": True}),  # attends in float32 over the bfloat16 cache
    ],
    ids=["opt", "llama", "gpt2 upcast"],
)
def test_a_bfloat16_kv_cache_halves_the_cache_and_scores_as_float32_does(
    tmp_path, model_type, config, decoding_attention
):
    _check_bfloat16_cache(make_tiny_model(tmp_path / model_type, model_type, **config))


def test_a_bfloat16_kv_cache_under_transformers_own_attention(tmp_path):
    _check_bfloat16_cache(make_tiny_model(tmp_path / "llama", "llama"), model_impl="transformers")


def _check_bfloat16_cache(path, **settings) -> None:
    """Generate with a bfloat16 cache; check it is one, half the bytes, and scores as the float32 engine does."""
    plain = LLM(str(path), load_installed_plugins=False, **settings)
    halved = LLM(str(path), load_installed_plugins=False, kv_cache_dtype="bfloat16", **settings)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]  # decoding rows of different lengths
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    answers = halved.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert {c.k.dtype for c in halved.engine.runner._caches} == {torch.bfloat16}
    # Each token the bfloat16 engine chose, scored by the float32 engine over the same text: keys and values
    # rounded to 8 bits of mantissa move a log-probability by hundredths, in prefill and decoding alike.
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for prompt, answer in zip(prompts, answers, strict=True):
        tokens = answer.outputs[0].token_ids
        assert len(tokens) == 8
        text = {"prompt_token_ids": prompt + list(tokens)}
        scored = plain.generate([text], scoring, use_tqdm=False)[0].prompt_logprobs[len(prompt) :]
        ours = [step[token] for step, token in zip(answer.outputs[0].logprobs, tokens, strict=True)]
        theirs = [step[token] for step, token in zip(scored, tokens, strict=True)]
        assert ours == pytest.approx(theirs, abs=0.08)  # 0.026 at most here
    assert 2 * halved.engine.runner.slot_bytes() == plain.engine.runner.slot_bytes() > 0


class _OwnAttention(opt.OPTAttention):
    """A plugin's attention, as the model contract allows: plain sdpa over what ``KVCache.update`` returns."""

    def forward(self, x, positions, cache_rows, mask):
        B, T, E = x.shape
        qkv = self.qkv_proj(x).view(B, T, 3, self.n_heads, self.head_dim)  # (B, T, 3, H, D)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, D)
        k, v = self.kv_cache.update(cache_rows, positions, k, v, n_slots=mask.shape[-1])  # (B, H, S, D)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)  # (B, H, T, D)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, E))


class _OwnAttentionOPT(opt.OPTForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        for layer in self.decoder.layers:
            layer.self_attn.__class__ = _OwnAttention


def test_a_plugins_own_attention_gets_the_bfloat16_cache_back_in_its_dtype_and_is_told_the_cost(tiny_opt, caplog):
    # It got bfloat16 keys for float32 queries: sdpa refused them, and every request failed, blaming the plugin.
    from builtin_models import kv_cache

    kv_cache._converting_each_step.cache_clear()
    plugin = RegistersModel("OPTForCausalLM", _OwnAttentionOPT)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17)]
    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        halved = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[plugin], kv_cache_dtype="bfloat16")
        answers = halved.generate(prompts, params, use_tqdm=False)
    plain = LLM(str(tiny_opt), load_installed_plugins=False, plugins=[plugin]).generate(prompts, params, use_tqdm=False)
    assert caplog.text.count("the model's attention reads it converted back, a copy each step") == 1
    assert {c.k.dtype for c in halved.engine.runner._caches} == {torch.bfloat16}
    for a, b in zip(answers, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids  # a peaked tiny model: the rounding changes no token
        ours, theirs = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert [next(iter(x.values())) for x in ours] == pytest.approx(
            [next(iter(x.values())) for x in theirs], abs=0.08
        )


def test_kv_cache_dtype_says_when_it_changes_nothing_or_saves_no_memory(tmp_path, tiny_opt, caplog):
    class NoCache(opt.OPTForCausalLM):
        setup_caches = None

    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        LLM(str(tiny_opt), load_installed_plugins=False, plugins=[RegistersModel("OPTForCausalLM", NoCache)],
            kv_cache_dtype="bfloat16")  # fmt: skip
    assert "kv_cache_dtype has no effect on NoCache: it has no KV cache" in caplog.text
    caplog.clear()
    half = LLM(str(make_tiny_model(tmp_path / "llama", "llama")), load_installed_plugins=False, dtype="float16",
               kv_cache_dtype="bfloat16")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        half.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert "kv_cache_dtype bfloat16 over a float16 cache saves no memory" in caplog.text
