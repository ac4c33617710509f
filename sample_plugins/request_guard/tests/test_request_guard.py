"""The request guard, tested with pluginhost's pytest fixtures, and through the server."""

import httpx
import pluginhost_request_guard
import pytest

from pluginhost import AsyncLLM, SamplingParams
from pluginhost.demo import ensure_demo_model
from pluginhost.errors import PluginHookError, RequestRefusedError
from pluginhost.server.app import build_app
from pluginhost.testing.server import running_server

PLUGIN = "pluginhost_request_guard"
REFUSED = f"plugin '{PLUGIN}' refused the request: "
TIMEOUT = 60


@pytest.fixture(autouse=True)
def no_limits(monkeypatch):
    """Each test sets the limits it tests; none leaks in from the shell."""
    for name in pluginhost_request_guard.VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def llm(make_engine):
    return make_engine(pluginhost_request_guard)


def greedy(max_tokens=4, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def refused(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message) as info:
        llm.generate(prompt, params)
    assert isinstance(info.value, RequestRefusedError)
    assert (info.value.plugin, info.value.hook) == (PLUGIN, "on_request")
    assert str(info.value).startswith(REFUSED)
    return str(info.value)


def test_without_limits_requests_are_untouched(llm, hook_recorder):
    out = llm.generate([[2] * 100], greedy(max_tokens=None, n=3))[0]
    assert [len(o.token_ids) for o in out.outputs] == [128 - 100] * 3  # as many as max_model_len leaves
    assert hook_recorder.last("on_request").plugins == (PLUGIN,)


@pytest.mark.parametrize(
    ("variable", "value", "prompt", "params", "message"),
    [
        (
            "PLUGINHOST_GUARD_MAX_PROMPT_TOKENS",
            "10",
            [2] * 11,
            greedy(),
            r"the prompt has 11 tokens, more than this server allows \(10, PLUGINHOST_GUARD_MAX_PROMPT_TOKENS\); "
            r"shorten it, or ask the operator to raise the limit",
        ),
        (
            "PLUGINHOST_GUARD_MAX_TOKENS",
            "8",
            [2, 5],
            greedy(9),
            r"max_tokens=9 is more than this server allows \(8, PLUGINHOST_GUARD_MAX_TOKENS\); ask for at most 8, "
            r".*PLUGINHOST_GUARD_MAX_TOKENS_ACTION=cap",
        ),
        (
            "PLUGINHOST_GUARD_MAX_N",
            "2",
            [2, 5],
            greedy(n=3),
            r"n=3 samples is more than this server allows \(2, PLUGINHOST_GUARD_MAX_N\); ask for at most 2",
        ),
    ],
)
def test_a_request_over_a_limit_is_refused_saying_which_and_how_to_change_it(
    llm, monkeypatch, variable, value, prompt, params, message
):
    monkeypatch.setenv(variable, value)
    refused(llm, prompt, params, message)
    # At the limit it runs.
    at_limit = {"PLUGINHOST_GUARD_MAX_PROMPT_TOKENS": ([2] * 10, greedy())}.get(variable, ([2, 5], greedy(8, n=2)))
    assert llm.generate(*at_limit)[0].outputs[0].token_ids


def test_max_tokens_are_capped_when_asked_and_a_request_without_max_tokens_gets_the_limit(llm, monkeypatch):
    monkeypatch.setenv("PLUGINHOST_GUARD_MAX_TOKENS", "5")
    assert len(llm.generate([2, 5], greedy(None))[0].outputs[0].token_ids) == 5
    monkeypatch.setenv("PLUGINHOST_GUARD_MAX_TOKENS_ACTION", "cap")
    out = llm.generate([2, 5], greedy(50))[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (5, "length")
    refused(llm, [2, 5], greedy(50, min_tokens=6), r"min_tokens=6 is more than the 5 tokens this server lets")


def test_blocked_words_are_whole_words_in_any_case_and_token_prompts_are_refused(llm, monkeypatch):
    monkeypatch.setenv("PLUGINHOST_GUARD_BLOCKED_WORDS", "fox, lazy dog")
    message = refused(llm, "The quick brown FOX!", greedy(), r"the prompt contains 'FOX', a word this server blocks")
    assert "PLUGINHOST_GUARD_BLOCKED_WORDS" in message
    refused(llm, "over the Lazy dog.", greedy(), r"the prompt contains 'Lazy dog'")
    refused(llm, "over the lazy   dog", greedy(), r"the prompt contains 'lazy   dog'")  # spaced out: the same
    assert llm.generate(["foxes and a lazy cat", "firefox"], greedy())[1].outputs[0].token_ids
    refused(llm, [2, 5], greedy(), r"cannot read a prompt given as token ids; send it as text")


@pytest.mark.parametrize("value", ["lots", "²"])  # "²" is a digit to str.isdigit, not to int(): its error named nothing
def test_a_malformed_variable_stops_the_engine_at_build_naming_it(make_engine, monkeypatch, value):
    monkeypatch.setenv("PLUGINHOST_GUARD_MAX_TOKENS", value)
    with pytest.raises(
        PluginHookError, match=rf"PLUGINHOST_GUARD_MAX_TOKENS='{value}' must be a positive integer"
    ) as info:
        make_engine(pluginhost_request_guard)
    assert (info.value.plugin, info.value.hook) == (PLUGIN, "pre_load")


def test_a_variable_broken_after_the_build_is_the_plugins_failure_not_the_clients(llm, monkeypatch):
    monkeypatch.setenv("PLUGINHOST_GUARD_MAX_TOKENS_ACTION", "clamp")
    with pytest.raises(PluginHookError, match=r"failed in its on_request hook: GuardSettingsError") as info:
        llm.generate([2, 5], greedy())
    assert not isinstance(info.value, ValueError)  # the server answers 500, not 400


def test_the_server_answers_400_with_the_reason_and_keeps_serving(monkeypatch):
    monkeypatch.setenv("PLUGINHOST_GUARD_MAX_TOKENS", "6")
    monkeypatch.setenv("PLUGINHOST_GUARD_BLOCKED_WORDS", "fox")
    engine = AsyncLLM(str(ensure_demo_model()), plugins=[pluginhost_request_guard], load_installed_plugins=False)
    try:
        with running_server(build_app(engine, served_model_name="demo")) as url:
            answer = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 7}, timeout=TIMEOUT)
            assert answer.status_code == 400
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["message"].startswith(REFUSED + "max_tokens=7 is more than this server allows (6, ")

            # Chat prompts are checked on the text their template renders.
            chat = {"messages": [{"role": "user", "content": "the fox"}], "max_tokens": 2}
            answer = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=TIMEOUT)
            assert answer.status_code == 400 and "the prompt contains 'fox'" in answer.json()["error"]["message"]
            chat["messages"][0]["content"] = "the dog"
            assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=TIMEOUT).status_code == 200
            ok = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 6}, timeout=TIMEOUT)
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 6
            blocked = httpx.post(f"{url}/v1/completions", json={"prompt": "A Fox.", "max_tokens": 2}, timeout=TIMEOUT)
            assert blocked.status_code == 400 and "the prompt contains 'Fox'" in blocked.json()["error"]["message"]
            assert httpx.get(f"{url}/health", timeout=TIMEOUT).json() == {"status": "ok"}
    finally:
        engine.shutdown()
