"""The /tokenize and /detokenize routes, served on 127.0.0.1 by the real app over the demo model."""

import threading
import time

import httpx
import pluginhost_tokenize_endpoint
import pytest

from pluginhost import AsyncLLM, hookimpl
from pluginhost.demo import ensure_demo_model
from pluginhost.errors import PluginHookError
from pluginhost.server.app import build_app
from pluginhost.testing.server import running_server

TIMEOUT = 60
PLUGIN = "pluginhost_tokenize_endpoint"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a plugin?"}]


def new_engine(*plugins):
    return AsyncLLM(str(ensure_demo_model()), plugins=list(plugins), load_installed_plugins=False, device="cpu")


@pytest.fixture(scope="module")
def engine():
    engine = new_engine(pluginhost_tokenize_endpoint)
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    with running_server(build_app(engine, served_model_name="demo")) as base:
        yield base


def post(url, path, body, **kwargs):
    return httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT, **kwargs)


def test_tokenize_then_detokenize_round_trips(url, engine):
    tokenizer = engine.get_tokenizer()
    prompt = "A plugin is a module with functions marked `@hookimpl`."
    answer = post(url, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    assert answer["tokens"] == tokenizer(prompt)["input_ids"] and answer["tokens"][0] == tokenizer.bos_token_id
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == engine.max_model_len == 256
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    assert post(url, "/detokenize", {"tokens": answer["tokens"]}).json() == {"prompt": "</s>" + prompt}

    bare = post(url, "/tokenize", {"prompt": prompt, "add_special_tokens": False, "model": "demo"}).json()
    assert bare["tokens"] == answer["tokens"][1:] and "token_strs" not in bare
    assert post(url, "/detokenize", {"tokens": bare["tokens"]}).json() == {"prompt": prompt}


def test_counts_are_what_the_completion_endpoints_use(url):
    prompt = "The engine steps"
    count = post(url, "/tokenize", {"prompt": prompt}).json()["count"]
    completion = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == count

    chat = post(url, "/tokenize", {"messages": CHAT}).json()
    answer = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()
    assert answer["usage"]["prompt_tokens"] == chat["count"]
    text = post(url, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert text == "</s>Be brief.\n\n### User:\nWhat is a plugin?\n\n### Assistant:\n"
    without = post(url, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert chat["tokens"][: without["count"]] == without["tokens"] and without["count"] < chat["count"]
    # OpenAI's developer role is a system message to the chat route: /tokenize left it out of the count.
    developer = [{"role": "developer", "content": "Be brief."}, CHAT[1]]
    assert post(url, "/tokenize", {"messages": developer}).json()["count"] == chat["count"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "fragment"),
    [
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, None, "give either prompt (text) or messages"),
        ("/tokenize", {}, 400, None, "give either prompt (text) or messages"),
        ("/tokenize", {"prompt": 5}, 400, "prompt", "prompt: Input should be a valid string"),
        ("/tokenize", {"messages": []}, 400, "messages", "messages: List should have at least 1 item"),
        ("/tokenize", {"prompt": "a", "lang": "en"}, 400, "lang", "lang: unknown field"),
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model", "The model `gpt-4` does not exist"),
        ("/detokenize", {"tokens": [5, 4096]}, 400, "tokens", "token id(s) [4096] are outside the tokenizer's"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens", "token id(s) [-1] are outside"),
        ("/detokenize", {"tokens": ["5"]}, 400, "tokens", "tokens.0: Input should be a valid integer"),
        ("/detokenize", {"prompt": "a"}, 400, "tokens", "tokens: Field required"),
    ],
)
def test_bad_input_is_an_openai_error_object_and_the_server_goes_on(url, path, body, status, param, fragment):
    answer = post(url, path, body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert fragment in error["message"] and error["param"] == param
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert post(url, "/tokenize", {"prompt": "still here"}).status_code == 200


@pytest.mark.parametrize(
    ("raw", "param"),
    [(b'{"prompt": "a\\udce9"}', "prompt"), (b'{"messages": [{"role": "user", "content": "a\\udce9"}]}', "messages")],
)
def test_text_that_is_not_valid_unicode_is_a_400_not_a_server_error(url, raw, param):
    answer = httpx.post(f"{url}/tokenize", content=raw, headers={"Content-Type": "application/json"}, timeout=TIMEOUT)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and f"the {param} is not valid Unicode: '\\udce9'" in error["message"]


def test_a_text_far_too_long_for_the_model_is_refused_before_it_is_tokenized(url, engine):
    big = "A plugin is a module. " * 150_000  # 3.3 MB: seconds to tokenize, for 256 tokens at most
    for body, param, words in [
        ({"prompt": big}, "prompt", "the prompt has 3300000 characters, more than"),
        ({"messages": [{"role": "user", "content": big}]}, "messages", "the messages come to 33000"),
    ]:
        answer = post(url, "/tokenize", body)
        assert answer.status_code == 400, answer.text[:200]
        error = answer.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", param)
        assert words in error["message"] and f"{engine.max_model_len} tokens" in error["message"], error["message"]
    assert post(url, "/tokenize", {"prompt": "still here"}).status_code == 200


class SeesEveryRequest:
    """A plugin with an on_request hook (request_guard, say): the engine then tokenizes a text of any length,
    since the hook may shorten it."""

    @hookimpl
    def on_request(self, request):
        pass


def test_health_answers_at_once_while_a_long_text_is_tokenized():
    engine = new_engine(pluginhost_tokenize_endpoint, SeesEveryRequest())
    big = "A plugin is a module. " * 50_000  # 1.1 MB: seconds to tokenize
    answers, latencies = [], []
    try:
        with running_server(build_app(engine, served_model_name="demo")) as url:
            tokenizing = threading.Thread(target=lambda: answers.append(post(url, "/tokenize", {"prompt": big})))
            start = time.monotonic()
            tokenizing.start()
            while tokenizing.is_alive():
                asked = time.monotonic()
                assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
                latencies.append(time.monotonic() - asked)
                time.sleep(0.05)
            took = time.monotonic() - start
            tokenizing.join(TIMEOUT)
    finally:
        engine.shutdown()
    (answer,) = answers
    assert answer.status_code == 200 and answer.json()["count"] > 300_000  # 6 tokens a sentence
    # /health went on meanwhile (it waited for the whole tokenization, 6 s for 3 MB, when it ran on the event loop).
    assert len(latencies) >= 2 and max(latencies) < took / 2, (latencies, took)


def test_the_routes_are_behind_the_api_key(engine):
    with running_server(build_app(engine, served_model_name="demo", api_key="k")) as url:
        refused = post(url, "/tokenize", {"prompt": "a"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert post(url, "/detokenize", {"tokens": [5]}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = post(url, "/tokenize", {"prompt": "a"}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.json()["count"] == 2


class HealthToo:
    """A plugin taking a builtin path."""

    @hookimpl
    def register_routes(self, app):
        @app.get("/health")
        async def health():
            return {"status": "mine"}


class TokenizeToo:
    """A plugin taking this plugin's path."""

    @hookimpl
    def register_routes(self, app):
        @app.post("/tokenize")
        async def tokenize():
            return {}


@pytest.mark.parametrize(
    ("plugins", "blamed", "holder"),
    [
        ([HealthToo()], "HealthToo", "the server itself"),
        ([pluginhost_tokenize_endpoint, TokenizeToo()], "TokenizeToo", f"plugin '{PLUGIN}'"),
    ],
)
def test_a_route_taking_a_path_already_served_stops_the_server_naming_the_plugin(plugins, blamed, holder):
    engine = new_engine(*plugins)
    try:
        with pytest.raises(PluginHookError, match="already taken by") as info:
            build_app(engine, served_model_name="demo")
        assert (info.value.plugin, info.value.hook) == (blamed, "register_routes")
        path = "/health" if holder == "the server itself" else "/tokenize"
        assert f"plugin '{blamed}' failed in its register_routes hook: route {path} is already taken by {holder}" in (
            str(info.value)
        )
    finally:
        engine.shutdown()
