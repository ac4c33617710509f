"""The OpenAI-compatible server, tested as a user would: the official openai client, on 127.0.0.1.

Every server here runs in a thread on a free loopback port and is stopped by
its fixture; every request is bounded in time. Answers are compared with the
offline engine on the same (demo) model, greedy, so they must be equal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections import Counter

import httpx
import openai
import pytest
from fastapi import WebSocket

from pluginhost import LLM, AsyncLLM, SamplingParams, hookimpl
from pluginhost.demo import ensure_demo_model
from pluginhost.server.app import build_app
from pluginhost.testing import RegistersModel, make_tiny_opt
from pluginhost.testing.models import byte_fallback_tokenizer
from pluginhost.testing.scripted import scripted_opt
from pluginhost.testing.server import metric, running_server, wait_until
from pluginhost.tokenizer import token_text

TIMEOUT = 60
JSON = {"content-type": "application/json"}
PROMPTS = [
    "A plugin is",
    "The builtin architectures",
    "Hello, my name is",
    "pluginhost models",
    "When a plugin is broken",
    "An exception inside a hook",
    "Selection is read",
    "The demo model",
]


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLM(str(ensure_demo_model()), load_installed_plugins=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(demo_llm) -> LLM:
    return demo_llm


@pytest.fixture(scope="module")
def url(engine):
    with running_server(build_app(engine, served_model_name="demo")) as base:
        yield base


@pytest.fixture
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)


def chat_ids(offline: LLM, messages: list[dict]) -> list[int]:
    tokenizer = offline.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# -- the four routes, with the official client ------------------------------------------------


def test_health_and_models(url, client):
    assert httpx.get(f"{url}/health", timeout=TIMEOUT).json() == {"status": "ok"}
    probed = httpx.head(f"{url}/health", timeout=TIMEOUT)  # what load balancers often send (it was a 405)
    assert probed.status_code == 200 and probed.content == b""
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    assert client.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-9")


def test_completion_equals_the_offline_engine_with_real_usage(client, offline):
    answer = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=20, temperature=0)
    expected = offline.generate([PROMPTS[0]], greedy(20))[0]
    assert answer.choices[0].text == expected.text and answer.choices[0].finish_reason == expected.finish_reason
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert answer.usage.completion_tokens == len(expected.token_ids) == 20
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 20


def test_streamed_completion_adds_up_to_the_whole(client, offline):
    stream = client.completions.create(
        model="demo",
        prompt=PROMPTS[1],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    expected = offline.generate([PROMPTS[1]], greedy(24))[0]
    assert text == expected.text and len([c for c in chunks if c.choices]) > 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_echo_puts_each_prompt_before_its_choices_whole_and_streamed(client, offline):
    params = SamplingParams(max_tokens=6, n=2, seed=3, temperature=0.8)
    expected = offline.generate(PROMPTS[:2], params)
    wanted = sorted(out.prompt + c.text for out in expected for c in out.outputs)
    for stream in (False, True):
        answer = client.completions.create(
            model="demo", prompt=PROMPTS[:2], max_tokens=6, n=2, seed=3, temperature=0.8, echo=True, stream=stream
        )
        if stream:
            texts: dict[int, str] = {}
            for chunk in answer:
                texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
            got = sorted(texts.values())
        else:
            got = sorted(c.text for c in answer.choices)
            assert answer.usage.completion_tokens == 4 * 6  # the prompt echoed is not generated
        assert got == wanted
    ids = offline.get_tokenizer()(PROMPTS[2])["input_ids"]  # a prompt of ids echoes their text
    answer = client.completions.create(model="demo", prompt=ids, max_tokens=4, temperature=0, echo=True)
    echoed = offline.get_tokenizer().decode(ids)  # special tokens and all, as the model read them (and vLLM echoes)
    assert echoed == "</s>" + PROMPTS[2]
    assert answer.choices[0].text == echoed + offline.generate([ids], greedy(4))[0].text


def test_chat_through_the_template(client, offline):
    messages = [{"role": "user", "content": "What is a plugin?"}]
    answer = client.chat.completions.create(model="demo", messages=messages, max_tokens=40, temperature=0)
    expected = offline.generate([chat_ids(offline, messages)], greedy(40))[0]
    message = answer.choices[0].message
    assert message.role == "assistant" and message.content == expected.text
    assert "plugin" in message.content.lower() or "hookimpl" in message.content  # the demo model knows its docs
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)

    stream = client.chat.completions.create(model="demo", messages=messages, max_tokens=40, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_llm_chat_answers_each_conversation_as_the_chat_route(client, offline):
    """vLLM's offline ``llm.chat``: the same messages, the same template, the same tokens as served."""
    brief = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    as_template = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    answers = offline.chat([USER, brief], greedy(12), use_tqdm=False)
    for conversation, rendered, answer in zip([USER, brief], [USER, as_template], answers, strict=True):
        served = client.chat.completions.create(model="demo", messages=conversation, max_tokens=12, temperature=0)
        assert answer.outputs[0].text == served.choices[0].message.content
        assert answer.prompt_token_ids == chat_ids(offline, rendered)
    # Going on with the assistant's last message instead of starting a new one (vLLM's continue_final_message); as
    # in vLLM, chat_template_kwargs override the arguments (tokenize dropped), and a generator is one conversation.
    begun = [*USER, {"role": "assistant", "content": "A plugin is"}]
    going_on = offline.chat(begun, greedy(6), add_generation_prompt=False, continue_final_message=True)[0]
    assert going_on.prompt.endswith("A plugin is") and going_on.outputs[0].text
    overridden = {"add_generation_prompt": False, "continue_final_message": True, "tokenize": True}
    assert offline.chat(iter(begun), greedy(6), chat_template_kwargs=overridden)[0].outputs == going_on.outputs
    # Served too, with vLLM's request fields (they were refused as not supported)
    going_on_served = client.chat.completions.create(
        model="demo",
        messages=begun,
        max_tokens=6,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert going_on_served.choices[0].message.content == going_on.outputs[0].text
    overriding = {"chat_template_kwargs": {"add_generation_prompt": False, "continue_final_message": True}}
    overridden_served = client.chat.completions.create(
        model="demo", messages=begun, max_tokens=6, temperature=0, extra_body=overriding
    )  # as vLLM's server and LLM.chat: the kwargs override the fields
    assert overridden_served.choices[0].message.content == going_on.outputs[0].text
    user_goes_on = client.chat.completions.create(  # as vLLM: going on with a message, in its role
        model="demo", messages=USER, max_tokens=3, extra_body={"add_generation_prompt": False}
    )
    assert user_goes_on.choices[0].message.role == "user"
    through_kwargs = client.chat.completions.create(  # vLLM reads the role from the field, not the kwargs
        model="demo", messages=USER, max_tokens=3, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}
    )
    assert through_kwargs.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError, match="set add_generation_prompt=False to continue") as both:
        client.chat.completions.create(
            model="demo", messages=begun, max_tokens=6, extra_body={"continue_final_message": True}
        )
    assert both.value.body["param"] == "continue_final_message"
    assert offline.chat([]) == []
    with pytest.raises(ValueError, match=r"chat_template_kwargs cannot set return_dict: apply_chat_template's own"):
        offline.chat(USER, chat_template_kwargs={"return_dict": True})
    with pytest.raises(ValueError, match=r"conversation 1: message 0: role: Input should be 'system', 'user'"):
        offline.chat([USER, [{"role": "wizard", "content": "x"}]])
    with pytest.raises(ValueError, match="content parts of type 'image_url' are not supported"):
        offline.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_a_messages_text_parts_are_joined_by_newlines_as_vllm_joins_them(client, offline):
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "a plugin?"}]
    answer = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": parts}], max_tokens=12, temperature=0
    )
    joined = [{"role": "user", "content": "What is\na plugin?"}]
    expected = offline.generate([chat_ids(offline, joined)], greedy(12))[0]
    assert answer.choices[0].message.content == expected.text
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_stop_strings_n_seed_and_logprobs(client, offline):
    free = offline.generate([PROMPTS[0]], greedy(20))[0].text
    stop = free[8:12]
    answer = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=[stop])
    assert answer.choices[0].text == free[: free.index(stop)] and answer.choices[0].finish_reason == "stop"

    samples = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=8, n=3, seed=5, temperature=1.0)
    again = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=8, n=3, seed=5, temperature=1.0)
    assert [c.index for c in samples.choices] == [0, 1, 2]
    assert [c.text for c in samples.choices] == [c.text for c in again.choices]

    scored = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    logprobs = scored.choices[0].logprobs
    expected = offline.generate([PROMPTS[0]], greedy(4, logprobs=2))[0]
    assert logprobs.token_logprobs == pytest.approx(
        [s[t] for s, t in zip(expected.logprobs, expected.token_ids, strict=True)], abs=1e-4
    )
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs)


def merged_completion(answer, stream: bool) -> tuple[str, dict[str, list], list[str]]:
    """A one-choice completion's text, logprobs (each list joined across a stream's chunks) and finish reasons."""
    choices = [c.choices[0] for c in answer if c.choices] if stream else answer.choices
    logprobs: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for choice in choices:
        for name, values in logprobs.items():
            values.extend(getattr(choice.logprobs, name) if choice.logprobs else [])
    return "".join(c.text for c in choices), logprobs, [c.finish_reason for c in choices if c.finish_reason]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(client, offline, stream):
    """lm-eval's loglikelihood requests: echo with logprobs (and max_tokens 1, or 0 for the prompt alone) answer
    each prompt token's log-probability given those before it, the first one null, then the generated tokens'."""
    tokenizer = offline.get_tokenizer()
    expected = offline.generate([PROMPTS[0]], greedy(3, logprobs=1, prompt_logprobs=1))[0]
    prompt, generated = expected.prompt_token_ids, expected.token_ids
    scores = [None] + [step[token] for step, token in zip(expected.prompt_logprobs[1:], prompt[1:], strict=True)]
    names = [token_text(tokenizer, token) for token in prompt + generated]
    for max_tokens, shown in ((3, len(prompt) + 3), (0, len(prompt))):
        answer = client.completions.create(
            model="demo", prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0, echo=True, logprobs=1, stream=stream
        )
        text, logprobs, finish_reasons = merged_completion(answer, stream)
        assert text == PROMPTS[0] + (expected.text if max_tokens else "") and finish_reasons == ["length"]
        assert logprobs["tokens"] == names[:shown]
        wanted = scores + [step[token] for step, token in zip(expected.logprobs, generated, strict=True)]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx(wanted[1:shown], abs=1e-4)
        assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"][1:])
        assert logprobs["text_offset"] == [sum(len(name) for name in names[:i]) for i in range(shown)]
        if not stream:  # nothing generated is counted for the prompt alone
            assert answer.usage.completion_tokens == (3 if max_tokens else 0)


def vllm_prompt_logprobs(offline: LLM, output, k: int) -> list[dict | None]:
    """What vLLM's server answers for ``output``'s ``prompt_logprobs`` (scored offline with at least ``k``)."""
    tokenizer = offline.get_tokenizer()
    shaped: list[dict | None] = [None]
    for token, step in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:], strict=True):
        ranks = step.ranks()
        kept = [t for t in step if t == token or ranks[t] <= k]
        shaped.append(
            {str(t): {"logprob": step[t], "rank": ranks[t], "decoded_token": token_text(tokenizer, t)} for t in kept}
        )
    return shaped


def assert_same_scores(answered: list[dict | None], expected: list[dict | None]) -> None:
    assert len(answered) == len(expected) and answered[0] is None
    for got, wanted in zip(answered[1:], expected[1:], strict=True):
        assert list(got) == list(wanted)  # the prompt's token first, then the top k, the most likely first
        for token, entry in wanted.items():
            assert got[token] == {**entry, "logprob": pytest.approx(entry["logprob"], abs=1e-4)}


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_are_answered_in_vllms_shape_with_each_tokens_rank(url, offline, stream):
    """vLLM's ``prompt_logprobs`` on both routes: completions' every choice, chat's answer (a stream's first chunk of
    each), ``null`` first, then ``{token_id: {logprob, rank, decoded_token}}``, as the offline engine scores them."""
    wide = offline.generate([PROMPTS[1]], greedy(1, prompt_logprobs=3))[0]
    body = {"model": "demo", "prompt": PROMPTS[1], "max_tokens": 2, "n": 2, "prompt_logprobs": 3, "stream": stream}
    answered = _answer_parts(httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT), stream)
    scores = [c["prompt_logprobs"] for part in answered for c in part["choices"] if "prompt_logprobs" in c]
    assert len(scores) == 2  # one per choice (a stream: in its first chunk)
    for each in scores:
        assert_same_scores(each, vllm_prompt_logprobs(offline, wide, 3))
    # echo with logprobs beside prompt_logprobs: one scoring, for the wider; each part cut to its own count
    for top, logprobs in ((0, 1), (3, 1)):
        body.update(prompt_logprobs=top, echo=True, logprobs=logprobs, n=1)
        answered = _answer_parts(httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT), stream)
        (own,) = [c["prompt_logprobs"] for part in answered for c in part["choices"] if "prompt_logprobs" in c]
        assert_same_scores(own, vllm_prompt_logprobs(offline, wide, top))
        echoed = [
            t for part in answered for c in part["choices"] if c["logprobs"] for t in c["logprobs"]["top_logprobs"]
        ]
        assert echoed[0] is None and all(1 <= len(t) <= 1 + logprobs for t in echoed[1 : len(wide.prompt_token_ids)])
    # chat: beside the choices
    ids = chat_ids(offline, USER)
    expected = vllm_prompt_logprobs(offline, offline.generate([ids], greedy(1, prompt_logprobs=2))[0], 2)
    body = {"model": "demo", "messages": USER, "max_tokens": 2, "prompt_logprobs": 2, "stream": stream}
    answered = _answer_parts(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT), stream)
    (chat,) = [part["prompt_logprobs"] for part in answered if "prompt_logprobs" in part]
    assert_same_scores(chat, expected)
    plain = httpx.post(f"{url}/v1/chat/completions", json={**body, "prompt_logprobs": None}, timeout=TIMEOUT)
    assert "prompt_logprobs" not in plain.text  # not asked for: not in the answer


def _answer_parts(response: httpx.Response, stream: bool) -> list[dict]:
    """An answer's JSON, or each of a stream's chunks."""
    assert response.status_code == 200, response.text
    if not stream:
        return [response.json()]
    frames = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(frame) for frame in frames[:-1]]


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_a_streamed_choice_waiting_for_a_row_still_echoes_the_prompts_logprobs(client, offline, max_tokens):
    """n beyond the batch's rows (32): a choice's first chunk, its echo, comes before it runs; it carried no logprobs,
    so the prompt's were missing from it (and from every choice with max_tokens 0)."""
    tokenizer = offline.get_tokenizer()
    names = [token_text(tokenizer, token) for token in tokenizer(PROMPTS[0])["input_ids"]]
    stream = client.completions.create(
        model="demo", prompt=PROMPTS[0], max_tokens=max_tokens, n=40, temperature=0, echo=True, logprobs=0, stream=True
    )
    tokens: dict[int, list[str]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens if choice.logprobs else [])
    assert sorted(tokens) == list(range(40))
    assert all(t == names + t[len(names) :] and len(t) == len(names) + max_tokens for t in tokens.values())


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_text_with_stop_strings_adds_up_to_the_whole(client, offline, chat):
    """Stop strings longer than the text so far: what is held back is never sent, then cut."""
    free = offline.generate([PROMPTS[0]], greedy(24))[0].text
    stops = [free[9:25], free[5:9] + "never"]  # the first ends the text; the second starts like its text
    if chat:
        messages = [{"role": "user", "content": PROMPTS[0]}]
        ids = chat_ids(offline, messages)
        expected = offline.generate([ids], greedy(24, stop=stops))[0]
        chunks = client.chat.completions.create(
            model="demo", messages=messages, max_tokens=24, temperature=0, stop=stops, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        expected = offline.generate([PROMPTS[0]], greedy(24, stop=stops))[0]
        chunks = client.completions.create(
            model="demo", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stops, stream=True
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    if not chat:
        assert text == free[:9] and expected.finish_reason == "stop"


def completion_texts(client: openai.OpenAI, **request) -> tuple[str, str]:
    """The completion's text for ``request`` (one prompt, one choice), answered whole, then streamed."""
    whole = client.completions.create(model="demo", **request).choices[0].text
    chunks = client.completions.create(model="demo", stream=True, **request)
    return whole, "".join(c.choices[0].text for c in chunks)


def test_include_stop_str_in_output_keeps_the_stop_string_whole_and_streamed(client, offline):
    plain = offline.generate([PROMPTS[0]], greedy(20))[0].text
    stop = plain.split()[2]  # a word the answer has
    expected = offline.generate([PROMPTS[0]], greedy(20, stop=[stop], include_stop_str_in_output=True))[0]
    assert expected.text.endswith(stop) and expected.text == plain[: plain.index(stop) + len(stop)]
    asked = {"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0, "stop": [stop]}
    texts = completion_texts(client, **asked, extra_body={"include_stop_str_in_output": True})
    assert texts == (expected.text, expected.text)


def test_vllm_extras_through_extra_body(client, offline):
    answer = client.completions.create(
        model="demo",
        prompt=PROMPTS[2],
        max_tokens=16,
        temperature=0,
        extra_body={"repetition_penalty": 1.5, "min_tokens": 4, "extra_args": {"note": "for plugins"}},
    )
    expected = offline.generate([PROMPTS[2]], greedy(16, repetition_penalty=1.5, min_tokens=4))[0]
    assert answer.choices[0].text == expected.text


def test_logit_bias_allowed_token_ids_and_bad_words_answer_as_the_offline_engine(client, offline):
    tokenizer = offline.get_tokenizer()
    module = tokenizer.encode(" module", add_special_tokens=False)[0]
    asked = {"logit_bias": {module: 5.0}, "bad_words": ["plugin"]}
    expected = offline.generate([PROMPTS[0]], greedy(10, **asked))[0].text
    assert expected != offline.generate([PROMPTS[0]], greedy(10))[0].text
    texts = completion_texts(
        client,
        prompt=PROMPTS[0],
        max_tokens=10,
        temperature=0,
        logit_bias={str(module): 5},  # the client's own field; JSON's keys are strings
        extra_body={"bad_words": ["plugin"]},
    )
    assert texts == (expected, expected)
    allowed = tokenizer.encode(" a plugin is", add_special_tokens=False)
    chat = client.chat.completions.create(
        model="demo", messages=USER, max_tokens=6, temperature=0, extra_body={"allowed_token_ids": allowed}
    )
    assert (
        chat.choices[0].message.content
        == offline.generate([chat_ids(offline, USER)], greedy(6, allowed_token_ids=allowed))[0].text
    )


def test_a_request_its_own_choices_leave_no_token_mid_answer_is_a_400_about_them(url, client, offline, doubled_token):
    # It was a 500 "plugin_error" naming no field, counted as a server error.
    tokenizer = offline.get_tokenizer()
    a = doubled_token(tokenizer)
    stuck = {"allowed_token_ids": [a], "bad_words": [tokenizer.decode([a, a])], "ignore_eos": True}
    refused = metric(url, 'pluginhost_request_success_total{finish_reason="refused",model_name="demo"}')
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=4, extra_body=stuck)
    error = caught.value.body
    assert error["param"] == "allowed_token_ids" and error["type"] == "invalid_request_error"
    assert "allowed_token_ids and bad_words left no token to choose after 1 generated tokens" in error["message"]
    body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 4, "stream": True, **stuck}
    events = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "allowed_token_ids")
    assert metric(url, 'pluginhost_request_success_total{finish_reason="refused",model_name="demo"}') == refused + 2


# -- continuous batching, as clients see it --------------------------------------------------------


def test_32_concurrent_clients_each_get_what_the_offline_engine_gives(url, offline):
    requests = [(PROMPTS[i % len(PROMPTS)], 8 + (i * 7) % 40) for i in range(32)]

    async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, stream: bool) -> str:
        if not stream:
            answer = await client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens, temperature=0)
            return answer.choices[0].text
        chunks = await client.completions.create(
            model="demo", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in chunks])

    async def everyone() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        try:
            return await asyncio.gather(*(one(client, p, n, i % 2 == 0) for i, (p, n) in enumerate(requests)))
        finally:
            await client.close()

    got = asyncio.run(asyncio.wait_for(everyone(), TIMEOUT))
    expected = [offline.generate([p], greedy(n))[0].text for p, n in requests]
    assert got == expected


def test_a_short_request_sent_while_a_long_one_streams_finishes_first(url, client, offline):
    order = []

    async def scenario():
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        try:
            long = await aclient.completions.create(
                model="demo",
                prompt=PROMPTS[3],
                max_tokens=200,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            chunks = 0
            short = None
            async for _ in long:
                chunks += 1
                if chunks == 3:  # the long one is streaming: now the short one
                    short = asyncio.ensure_future(
                        aclient.completions.create(model="demo", prompt=PROMPTS[4], max_tokens=3, temperature=0)
                    )
                    short.add_done_callback(lambda _: order.append("short"))
            order.append("long")
            await short
        finally:
            await aclient.close()

    asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))
    assert order == ["short", "long"]


def aborted(url: str) -> float:
    return metric(url, 'pluginhost_request_success_total{finish_reason="abort"')


def test_a_client_killed_mid_stream_changes_nothing_for_the_others(url, engine, offline):
    before = aborted(url)
    body = {
        "model": "demo",
        "prompt": PROMPTS[5],
        "max_tokens": 240,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=TIMEOUT) as raw:
        with raw.stream("POST", f"{url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        # the connection is closed here, mid-stream
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
    others = [client.completions.create(model="demo", prompt=p, max_tokens=12, temperature=0) for p in PROMPTS[:3]]
    assert [o.choices[0].text for o in others] == [offline.generate([p], greedy(12))[0].text for p in PROMPTS[:3]]
    assert wait_until(lambda: aborted(url) == before + 1)  # given up, not run to its 240 tokens
    assert wait_until(lambda: engine.engine.scheduler.num_running == 0 and not engine.engine.has_work())


def test_a_client_gone_before_a_whole_answer_aborts_it(url, engine):
    import socket

    before = aborted(url)
    body = json.dumps({"model": "demo", "prompt": PROMPTS[6], "max_tokens": 240, "ignore_eos": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_until(lambda: engine.engine.scheduler.num_running > 0)
        assert metric(url, "pluginhost_num_requests_running{") == 1
    assert wait_until(lambda: aborted(url) == before + 1)
    assert wait_until(lambda: engine.engine.scheduler.num_running == 0 and not engine.engine.has_work())
    assert metric(url, "pluginhost_num_requests_running{") == 0  # idle now: no step follows, the gauge says so


def test_sse_framing_is_exact(url):
    body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "stream": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        assert json.loads(event.removeprefix("data: "))["object"] == "text_completion"


# -- bad requests ----------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "What is a plugin?"}]


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/completions", {"model": "demo", "prompt": "x", "max_tokenz": 5}, 400, "max_tokenz: unknown field"),
        ("/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        # Strict types, as OpenAI's API: no string for a number, no boolean for a float, no floats as token ids.
        ("/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens: Input should be"),
        ("/v1/completions", {"model": "demo", "prompt": "x", "temperature": True}, 400, "temperature: Input should"),
        ("/v1/completions", {"model": "demo", "prompt": [1.0, 2.0]}, 400, "prompt"),
        (
            "/v1/completions",
            {"model": "demo", "prompt": "x", "max_tokens": 0},
            400,
            "max_tokens must be at least 1 (0 only with echo: the prompt alone)",
        ),
        ("/v1/completions", {"model": "demo", "prompt": "x", "top_p": 2}, 400, "top_p must be in (0, 1]"),
        ("/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 10**6}, 400, "more than max_model_len=256"),
        ("/v1/completions", {"model": "demo", "prompt": [10**7]}, 400, "outside the vocabulary"),
        (  # the prompt alone still has the engine generate one token, which the answer leaves out
            "/v1/completions",
            {"model": "demo", "prompt": [2] + [5] * 255, "echo": True, "max_tokens": 0},
            400,
            "prompt 0 has 256 tokens, which leaves no room within max_model_len=256 for the one token the engine "
            "generates with max_tokens 0 (the answer leaves it out): a prompt alone may have at most max_model_len - 1 "
            "tokens. Shorten the prompt.",
        ),
        ("/v1/completions", {"model": "demo", "prompt": "caf\udce9"}, 400, "prompt 0 is not valid Unicode"),
        (
            "/v1/chat/completions",
            {"model": "demo", "messages": [{"role": "user", "content": "caf\udce9"}]},
            400,
            "the messages are not valid Unicode: '\\udce9', surrogates not allowed",
        ),
        (
            "/v1/completions",
            {"model": "demo", "prompt": "x", "n": 10**7},
            400,
            "1 prompt(s) x n=10000000 samples are more than the server ever takes in at once (1056: 32 running, "
            "--max-num-seqs, + 1024 waiting, --max-waiting-seqs)",
        ),
        ("/v1/completions", {"model": "demo", "prompt": ["x"] * 600, "n": 2}, 400, "600 prompt(s) x n=2 samples"),
        ("/v1/completions", {"model": "demo", "prompt": []}, 400, "prompt is empty"),
        ("/v1/completions", {"model": "demo"}, 400, "prompt: Field required"),
        (
            "/v1/completions",
            {"model": "demo", "prompt": "x", "logit_bias": {"hello": 1}},
            400,
            "logit_bias keys must be token ids (integers as strings",
        ),
        (
            "/v1/chat/completions",
            {"model": "demo", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}},
            400,
            "logit_bias values must be in [-100, 100], got 101.0 for token 5",
        ),
        (
            "/v1/completions",
            {"model": "demo", "prompt": "x", "logit_bias": {"99999": 1}},
            400,
            "logit_bias token ids [99999] outside the vocabulary [0, 2048)",
        ),
        (
            "/v1/completions",
            {"model": "demo", "prompt": "x", "allowed_token_ids": []},
            400,
            "allowed_token_ids is empty",
        ),
        (  # Python's own "Exceeds the limit (4300 digits)", as a 400 about the prompt
            "/v1/completions",
            {"model": "demo", "prompt": "x", "logit_bias": {"9" * 5000: 1}},
            400,
            "logit_bias keys must be token ids (integers as strings, e.g. \"50256\"), got '99999999999999999999'... "
            "(5000 characters)",
        ),
        ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "The model `gpt-9` does not exist"),
        ("/v1/chat/completions", {"model": "demo", "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        (
            "/v1/chat/completions",
            {"model": "demo", "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
            400,
            "tools are not supported",
        ),
        (
            "/v1/chat/completions",
            {"model": "demo", "messages": [{"role": "tool", "content": "42"}]},
            400,
            "tool messages are not supported",
        ),
        (  # as clients send one: with the id of the call it answers (which is no unknown field)
            "/v1/chat/completions",
            {"model": "demo", "messages": [USER[0], {"role": "tool", "tool_call_id": "c1", "content": "42"}]},
            400,
            "Invalid request: messages.1: tool messages are not supported",
        ),
        (
            "/v1/chat/completions",
            {"model": "demo", "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
            400,
            "tool calls are not supported",
        ),
        # pydantic listed every branch of the content union ("Input should be 'text'; ... refusal: unknown field").
        (
            "/v1/chat/completions",
            {"model": "demo", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
            "messages.0.content: content parts of type 'image_url' are not supported: pluginhost's models read text "
            "only",
        ),
        (  # a parameter of transformers 5's apply_chat_template, not a template variable: blamed on the messages
            "/v1/chat/completions",
            {"model": "demo", "messages": USER, "chat_template_kwargs": {"sanitize_control_tokens": True}},
            400,
            "sanitize_control_tokens cannot be set here: the request's own fields decide it",
        ),
        ("/v1/nothing-here", {}, 404, "Not Found"),
    ],
)
def test_bad_requests_get_openai_error_objects_and_the_server_keeps_serving(url, client, path, body, status, fragment):
    # JSON escapes as a client sends them: a lone surrogate travels as "\udce9" (httpx's json= cannot encode it).
    content, headers = json.dumps(body), {"content-type": "application/json"}
    response = httpx.post(f"{url}{path}", content=content, headers=headers, timeout=TIMEOUT)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and {"message", "type", "param", "code"} <= error.keys()
    assert client.completions.create(model="demo", prompt="A plugin", max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize(
    ("path", "body", "param", "code", "fragment"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, "prompt", "context_length_exceeded", "max_model_len"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 10**6}, "messages", "context_length_exceeded", "256"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", None, "temperature must be >= 0"),
        # The engine's names are the API's: chat's budget and top_logprobs are named as the client sent them.
        (
            "/v1/chat/completions",
            {"messages": USER, "max_completion_tokens": 0},
            "max_completion_tokens",
            None,
            "max_completion_tokens must be an integer >= 1",
        ),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, "max_tokens", None, "max_tokens must be"),
        (
            "/v1/chat/completions",
            {"messages": USER, "logprobs": True, "top_logprobs": 30},
            "top_logprobs",
            None,
            "top_logprobs=30 is more than this engine allows",
        ),
        # Which prompt of a list is wrong.
        ("/v1/completions", {"prompt": [[1, 2], [1, 10**7]]}, "prompt", None, "prompt 1 has token id(s) [10000000]"),
        (
            "/v1/chat/completions",
            {"messages": USER, "max_completion_tokens": 3, "min_tokens": 5},
            "min_tokens",
            None,
            "min_tokens (5) must be at most max_completion_tokens (3)",
        ),
        ("/v1/completions", {"prompt": ["fine", "x " * 300]}, "prompt", "context_length_exceeded", "prompt 1 has"),
        # A chat request has no "prompt 0": its prompt is the messages through the chat template.
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x " * 300}]},
            "messages",
            "context_length_exceeded",
            "tokens with the chat template, which leaves no room to generate within max_model_len=256. "
            "Shorten the messages.",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "max_completion_tokens": 300},
            "messages",
            "context_length_exceeded",
            "Shorten the messages or lower max_completion_tokens.",
        ),
        # Megabytes of text: refused unread, as no tokenization could make them fit (they took seconds and GBs).
        (
            "/v1/completions",
            {"prompt": ["fine", "word " * 400_000]},
            "prompt",
            "context_length_exceeded",
            "prompt 1 has 2000000 characters, more than max_model_len=256 tokens can hold",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "word " * 400_000}]},
            "messages",
            "context_length_exceeded",
            "characters with the chat template, more than max_model_len=256 tokens can hold",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "prompt_logprobs": 21},
            "prompt_logprobs",
            None,
            "prompt_logprobs=21 is more than this engine allows (20): ask for fewer, or raise max_logprobs",
        ),
        # More samples than the server ever takes in (param was null).
        ("/v1/completions", {"prompt": "x", "n": 100_000}, "n", None, "more than the server ever takes in at once"),
        # Counted before the body is validated, on the event loop: a million of them held it for seconds.
        ("/v1/completions", {"prompt": [[2]] * 70_000}, "prompt", None, "prompt holds 70000 prompts, more than"),
        ("/v1/completions", {"prompt": [[2], [2] * (2**20 + 1)]}, "prompt", None, "prompt 1 holds 1048577 token ids"),
        ("/v1/chat/completions", {"messages": USER * 9_000}, "messages", None, "messages holds 9000 messages, more"),
        ("/v1/completions", {"prompt": "x", "stop": ["x"] * 65}, "stop", None, "stop may hold at most 64 strings"),
        # A message with no content (OpenAI refuses it; this one was taken as an empty message).
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": None}]},
            "messages",
            None,
            "messages.0.content: a user message needs content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [USER[0], {"role": "system"}]},
            "messages",
            None,
            "messages.1.content: a system message needs content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": []}]},
            "messages",
            None,
            "messages.0.content: content is an empty list of parts",
        ),
    ],
)
def test_errors_name_the_field_and_say_when_the_context_is_exceeded(url, path, body, param, code, fragment):
    response = httpx.post(f"{url}{path}", json={"model": "demo", **body}, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and "SamplingParams" not in error["message"]
    assert (error["param"], error["code"]) == (param, code)
    if path == "/v1/chat/completions" and code == "context_length_exceeded":  # no "prompt 0" in a chat request
        assert "prompt" not in error["message"] and error["message"].startswith("the messages come to ")


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (
            "/v1/completions",
            {"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 2},
            "min_tokens",
            "min_tokens (2) must be 0 with max_tokens 0",
        ),
        ("/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix", "suffix is not supported"),
        (
            "/v1/completions",
            {"prompt": "x", "best_of": 2},
            "best_of",
            "best_of is not supported (it must equal n, or be left out)",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
            "stream_options is only allowed with stream: true",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "extra_args": {}, "vllm_xargs": {}},
            "vllm_xargs",
            "give extra_args or vllm_xargs, not both",
        ),
        ("/v1/chat/completions", {"messages": USER, "tools": [{}]}, "tools", "tools are not supported"),
        (
            "/v1/chat/completions",
            {"messages": USER, "tool_choice": "required"},
            "tool_choice",
            "tool_choice is not supported",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "response_format": {"type": "json_object"}},
            "response_format",
            'response_format is not supported (only {"type": "text"})',
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "top_logprobs": 2},
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ),
        # fields of OpenAI's or vLLM's API this server does not honour, at a value that asks for it
        (
            "/v1/chat/completions",
            {"messages": USER, "reasoning_effort": "low"},
            "reasoning_effort",
            "reasoning_effort is not supported (only null)",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "modalities": ["text", "audio"]},
            "modalities",
            'modalities is not supported (only ["text"] or null)',
        ),
        (  # checked by the request, not only by the engine: echo with logprobs takes the wider of the two counts
            "/v1/completions",
            {"prompt": "x", "prompt_logprobs": -2, "echo": True, "logprobs": 1},
            "prompt_logprobs",
            "prompt_logprobs: must be an integer >= 0, or -1 for every token's, got -2",
        ),
        (  # a boolean only as a boolean
            "/v1/completions",
            {"prompt": "x", "spaces_between_special_tokens": 1},
            "spaces_between_special_tokens",
            "spaces_between_special_tokens is not supported (only true or false or null)",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "chat_template_kwargs": {"messages": [], "add_generation_prompt": False}},
            "chat_template_kwargs",
            "chat_template_kwargs: messages cannot be set here: the request's own fields decide it",
        ),
        ("/v1/completions", {"prompt": "x", "temprature": 0}, "temprature", "temprature: unknown field"),
    ],
)
def test_refusals_of_a_field_by_the_request_checks_name_it_as_param(url, path, body, param, message):
    """Refusals that weigh fields against each other (pydantic's model validators) name their field too."""
    response = httpx.post(f"{url}{path}", json={"model": "demo", **body}, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error == {
        "message": f"Invalid request: {message}",
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }


def test_null_means_the_default_as_the_openai_client_sends_it(url, client, offline):
    """Wrappers pass unset options on as None, which the client sends as null."""
    expected = offline.generate([chat_ids(offline, USER)], greedy(12))[0].text
    answer = client.chat.completions.create(
        model="demo",
        messages=USER,
        max_tokens=12,
        temperature=0,
        n=None,
        presence_penalty=None,
        frequency_penalty=None,
        logprobs=None,
        stream=None,
    )
    assert answer.choices[0].message.content == expected
    body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
    nulls = {name: None for name in ("n", "stream", "echo", "min_tokens", "ignore_eos", "presence_penalty")}
    response = httpx.post(f"{url}/v1/completions", json={**body, **nulls}, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == offline.generate([PROMPTS[0]], greedy(6))[0].text
    # A field that takes null keeps its meaning: completions' max_tokens null is as many as the context allows.
    unbounded = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": None}, timeout=TIMEOUT).json()
    assert unbounded["usage"]["completion_tokens"] > 6


def test_completions_add_special_tokens_false_tokenizes_the_prompt_without_them(client, offline):
    """vLLM's field, for a client that rendered a chat template itself: the template wrote the BOS (it was refused)."""
    bare = offline.get_tokenizer()(PROMPTS[0], add_special_tokens=False)["input_ids"]
    assert offline.get_tokenizer()(PROMPTS[0])["input_ids"] != bare  # the demo tokenizer adds a BOS
    for stream in (False, True):
        answer = client.completions.create(
            model="demo",
            prompt=PROMPTS[0],
            max_tokens=6,
            temperature=0,
            stream=stream,
            extra_body={"add_special_tokens": False, "return_token_ids": True},
        )
        chunks = list(answer) if stream else [answer]
        assert chunks[0].choices[0].model_extra["prompt_token_ids"] == bare
        assert "".join(c.choices[0].text for c in chunks if c.choices) == offline.generate([bare], greedy(6))[0].text


def test_a_request_id_names_the_answer_as_in_vllm(client):
    """vLLM's ``request_id``: the answer's id is the route's prefix and it (and its cache_salt is taken)."""
    for stream in (False, True):
        answer = client.completions.create(
            model="demo",
            prompt=PROMPTS[0],
            max_tokens=2,
            stream=stream,
            extra_body={"request_id": "job-7", "cache_salt": "tenant-a"},
        )
        assert {chunk.id for chunk in answer} == {"cmpl-job-7"} if stream else answer.id == "cmpl-job-7"
        chat = client.chat.completions.create(
            model="demo", messages=USER, max_tokens=2, stream=stream, extra_body={"request_id": "job-7"}
        )
        assert {chunk.id for chunk in chat} == {"chatcmpl-job-7"} if stream else chat.id == "chatcmpl-job-7"
    # A gateway's X-Request-Id header wins, as in vLLM; an empty request_id is the server's own
    long_id = "x" * 300  # a gateway's id, however long, as vLLM takes it
    named = client.completions.create(
        model="demo", prompt=PROMPTS[0], max_tokens=1, extra_headers={"X-Request-Id": long_id}
    )
    assert named.id == f"cmpl-{long_id}"
    headed = client.completions.create(
        model="demo",
        prompt=PROMPTS[0],
        max_tokens=1,
        extra_body={"request_id": "job-7"},
        extra_headers={"X-Request-Id": "gw-1"},
    )
    assert headed.id == "cmpl-gw-1"
    unnamed = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=1, extra_body={"request_id": ""})
    assert unnamed.id.startswith("cmpl-") and len(unnamed.id) > len("cmpl-")
    with pytest.raises(openai.BadRequestError, match="cache_salt") as empty_salt:  # vLLM refuses it too
        client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=1, extra_body={"cache_salt": ""})
    assert empty_salt.value.body["param"] == "cache_salt"


def test_openai_and_vllm_fields_at_their_neutral_values_are_accepted(url, client, offline):
    """What OpenAI's client sends for arguments left unset, and vLLM clients' usual extras, asking nothing more."""
    expected = offline.generate([chat_ids(offline, USER)], greedy(8))[0].text
    vllm_extras = {
        "chat_template_kwargs": {"enable_thinking": False},  # Qwen3's idiom: a variable this template ignores
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "add_special_tokens": False,
        "echo": False,
        "prompt_logprobs": None,
        "return_tokens_as_token_ids": False,
        "priority": 0,
        "length_penalty": 1,
        "modalities": ["text"],
        "functions": [],
        "function_call": "none",
        "web_search_options": None,
        "prediction": None,
    }
    for stream in (False, True):
        answer = client.chat.completions.create(
            model="demo",
            messages=USER,
            max_tokens=8,
            temperature=0,
            reasoning_effort=None,
            verbosity=None,
            audio=None,
            safety_identifier="end-user-1",  # user's successors: no effect on the answer
            prompt_cache_key="conversation-7",
            stream=stream,
            stream_options={"include_usage": True, "include_obfuscation": False} if stream else None,
            extra_body=vllm_extras,
        )
        text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices) if stream else None
        assert (text if stream else answer.choices[0].message.content) == expected
    completion = client.completions.create(
        model="demo",
        prompt=PROMPTS[0],
        max_tokens=6,
        temperature=0,
        extra_body={"add_special_tokens": True, "skip_special_tokens": True, "include_stop_str_in_output": False},
    )
    assert completion.choices[0].text == offline.generate([PROMPTS[0]], greedy(6))[0].text


def test_chat_template_kwargs_are_the_templates_variables(tiny_opt, tmp_path):
    """vLLM's chat_template_kwargs reach the template (Qwen3's enable_thinking, say)."""
    import shutil

    model = shutil.copytree(tiny_opt, tmp_path / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages if m['role'] != 'system' %}{{ m['content'] }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    engine = AsyncLLM(str(model), load_installed_plugins=False)
    try:
        with running_server(build_app(engine, served_model_name="tiny")) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)

            messages = [{"role": "user", "content": "Hi"}]

            def prompt_tokens(**extra) -> int:
                given = {"messages": messages, **extra}
                return client.chat.completions.create(model="tiny", max_tokens=1, **given).usage.prompt_tokens

            def rendered_tokens(text: str) -> int:
                return len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])

            assert prompt_tokens() == rendered_tokens("Hi\n")
            assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == rendered_tokens(
                "Hi\n"
            )
            no_think = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            assert no_think == rendered_tokens("Hi\n/no_think") > rendered_tokens("Hi\n")
            # An answer's assistant message sent back as it came, with OpenAI's refusal part: its text.
            messages = [*messages, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No"}]}]
            assert prompt_tokens() == rendered_tokens("Hi\nNo\n")
            # Messages the template renders to nothing: said so (it was "the request is an empty list of token ids").
            with pytest.raises(openai.BadRequestError, match="the chat template renders these messages to an empty"):
                prompt_tokens(messages=[{"role": "system", "content": "Be brief."}])
    finally:
        engine.shutdown()


def test_error_objects_are_openais_and_answer_what_the_client_sent(url):
    """An unknown model: OpenAI's own error object; a wrong method: the methods allowed (RFC 9110); a lone
    surrogate the client sent (valid JSON) is quoted back, not a 500."""
    body = json.dumps({"model": "gpt-4o", "prompt": "x"})
    response = httpx.post(f"{url}/v1/completions", content=body, headers=JSON, timeout=TIMEOUT)
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "The model `gpt-4o` does not exist: this server serves `demo` (GET /v1/models).",
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }
    body = json.dumps({"model": "x\udce9", "prompt": "x"})  # the escape a client sends: valid JSON
    response = httpx.post(f"{url}/v1/completions", content=body, headers=JSON, timeout=TIMEOUT)
    assert response.status_code == 404 and response.json()["error"]["message"].startswith("The model `x\udce9`")
    body = json.dumps({"model": "demo", "prompt": "x", "\udce9": 1})
    response = httpx.post(f"{url}/v1/completions", content=body, headers=JSON, timeout=TIMEOUT)
    assert response.status_code == 400
    assert "a field's name in the body is not valid Unicode ('\\udce9'" in response.json()["error"]["message"]
    for method, path, allowed in [("GET", "/v1/completions", "POST"), ("POST", "/v1/models", "GET")]:
        response = httpx.request(method, f"{url}{path}", timeout=TIMEOUT)
        assert response.status_code == 405 and response.headers["allow"] == allowed
        assert response.json()["error"]["type"] == "invalid_request_error"
    response = httpx.get(f"{url}/v1/nothing-here", timeout=TIMEOUT)
    assert response.status_code == 404 and response.json()["error"]["type"] == "invalid_request_error"


def test_an_answer_sent_back_in_the_conversation_is_accepted(client, offline):
    """The cookbook pattern: the previous message appended as the client returned it (refusal, annotations...)."""
    first = client.chat.completions.create(model="demo", messages=USER, max_tokens=10, temperature=0)
    sent_back = first.choices[0].message.model_dump()
    assert "refusal" in sent_back and "tool_calls" in sent_back  # null fields the server must take
    messages = [*USER, sent_back, {"role": "user", "content": "And a hook?"}]
    answer = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=10, temperature=0, extra_body={"store": False, "metadata": {}}
    )
    plain = [*USER, {"role": "assistant", "content": sent_back["content"]}, messages[-1]]
    assert answer.choices[0].message.content == offline.generate([chat_ids(offline, plain)], greedy(10))[0].text


def test_developer_messages_are_system_messages(client):
    """OpenAI's newer name for the system role: the template sees a system message, not nothing."""

    def prompt_tokens(role: str) -> int:
        messages = [{"role": role, "content": "Answer in one word."}, *USER]
        answer = client.chat.completions.create(model="demo", messages=messages, max_tokens=2, temperature=0)
        return answer.usage.prompt_tokens

    alone = client.chat.completions.create(model="demo", messages=USER, max_tokens=2).usage.prompt_tokens
    assert prompt_tokens("developer") == prompt_tokens("system") > alone


def test_chat_logprob_bytes_rebuild_characters_split_across_tokens(client):
    """A token holding part of a character decodes to U+FFFD alone; its bytes are its own, not U+FFFD's."""
    messages = [{"role": "user", "content": "Écrivez → «plugin» — ≥ 2 € ✓"}]
    answer = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=40, temperature=3.0, seed=3, n=4, logprobs=True, top_logprobs=2
    )
    partial = 0
    for choice in answer.choices:
        tokens = choice.logprobs.content
        text_tokens = tokens[:-1] if choice.finish_reason == "stop" else tokens  # the end-of-text token is no text
        # Bytes that are no UTF-8 (a model may write any) are U+FFFD in the text, as a client decoding them gets.
        assert b"".join(bytes(t.bytes) for t in text_tokens).decode(errors="replace") == choice.message.content
        for t in tokens:
            for token in (t, *t.top_logprobs):
                if token.token == "\ufffd":  # a byte-level token of one byte here: that byte
                    partial += 1
                    assert len(token.bytes) == 1 and token.bytes[0] >= 0x80, token
    assert partial, "no token split a character: choose another seed to exercise the bytes"


def test_token_bytes_of_byte_level_and_sentencepiece_pieces(offline):
    from pluginhost.tokenizer import token_bytes

    byte_level = offline.get_tokenizer()  # the demo model's (GPT-2's byte alphabet)
    ids = byte_level("héllo → 世界", add_special_tokens=False)["input_ids"]
    assert b"".join(token_bytes(byte_level, i) for i in ids) == "héllo → 世界".encode()
    assert any(byte_level.decode([i]) == "\ufffd" for i in ids)  # some of them split a character

    sentencepiece = byte_fallback_tokenizer()  # Llama 2's way: <0xE2> for a byte, ▁ for a space
    ids = sentencepiece.convert_tokens_to_ids(["▁a", "▁snow", "▁", "<0xE2>", "<0x86>", "<0x92>"])
    assert sentencepiece.decode(ids) == "a snow →"
    assert [token_bytes(sentencepiece, i) for i in ids] == [b" a", b" snow", b" ", b"\xe2", b"\x86", b"\x92"]
    # Decoded alone, "▁snow" is "snow" (the decoder drops a text's first space): the pieces did not add up.
    assert [token_text(sentencepiece, i) for i in ids[:3]] == [" a", " snow", " "]
    space = sentencepiece.convert_tokens_to_ids("<0x20>")  # a space spelt as a byte: the decoder stripped it to ""
    assert (token_text(sentencepiece, space), token_bytes(sentencepiece, space)) == (" ", b" ")


@pytest.fixture(scope="module")
def sentencepiece_url(tmp_path_factory):
    """A server whose model writes " snow a snow a" after "a" through a SentencePiece tokenizer (Llama 2's)."""
    path = make_tiny_opt(tmp_path_factory.mktemp("sentencepiece"), tokenizer=False, vocab_size=262)
    tokenizer = byte_fallback_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.name %}{{ m.name }}: {% endif %}{{ m.content }}{% endfor %}"
    )
    tokenizer.save_pretrained(path)
    script = [1, *tokenizer.convert_tokens_to_ids(["▁a", "▁snow"] * 3)]
    model = RegistersModel("OPTForCausalLM", scripted_opt(script))
    engine = AsyncLLM(str(path), load_installed_plugins=False, plugins=[model])
    try:
        with running_server(build_app(engine, served_model_name="sp")) as base:
            yield base
    finally:
        engine.shutdown()


def test_sentencepiece_logprob_tokens_add_up_to_the_text(sentencepiece_url):
    # Each token decoded alone lost its space ("▁snow" is "snow" at the start of a text): the tokens of a
    # completion did not add up to its text, text_offset pointed at other characters, and chat's bytes had no spaces.
    body = {"model": "sp", "max_tokens": 4, "temperature": 0, "logprobs": 1, "prompt": "a"}
    answer = httpx.post(f"{sentencepiece_url}/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]
    logprobs = answer["logprobs"]
    assert answer["text"] == " snow a snow a" == "".join(logprobs["tokens"])
    assert logprobs["text_offset"] == [0, 5, 7, 12]
    assert [list(top) for top in logprobs["top_logprobs"]] == [[" snow"], [" a"], [" snow"], [" a"]]
    chat = {
        "model": "sp",
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "messages": [{"role": "user", "content": "a"}],
    }
    message = httpx.post(f"{sentencepiece_url}/v1/chat/completions", json=chat, timeout=TIMEOUT).json()["choices"][0]
    content = message["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == message["message"]["content"]
    assert b"".join(bytes(t["bytes"]) for t in content) == message["message"]["content"].encode()


def test_return_token_ids_gives_each_choices_ids_whole_and_streamed_as_vllm(url, offline):
    def sse(path: str, body: dict) -> list[dict]:
        text = httpx.post(f"{url}/v1/{path}", json={**body, "stream": True}, timeout=TIMEOUT).text
        return [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e.startswith("data: {")]

    expected = offline.generate([PROMPTS[0]], greedy(6))[0]
    body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (expected.prompt_token_ids, expected.token_ids)
    chunks = [c["choices"][0] for c in sse("completions", body)]
    assert [c.get("prompt_token_ids") for c in chunks] == [expected.prompt_token_ids] + [None] * (len(chunks) - 1)
    assert [t for c in chunks for t in c["token_ids"]] == expected.token_ids

    ids = chat_ids(offline, USER)
    expected = offline.generate([ids], greedy(6))[0]
    body = {"model": "demo", "messages": USER, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT).json()
    assert (answer["prompt_token_ids"], answer["choices"][0]["token_ids"]) == (ids, expected.token_ids)
    chunks = sse("chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected.token_ids
    plain = httpx.post(f"{url}/v1/chat/completions", json={**body, "return_token_ids": False}, timeout=TIMEOUT)
    assert "prompt_token_ids" not in plain.json() and "token_ids" not in plain.json()["choices"][0]


def test_a_model_without_a_tokenizer_answers_with_its_token_ids(tiny_opt_no_tokenizer):
    # Its text is empty: the answer was a 200 with "text": "" and no way to get the tokens (logprobs were refused).
    expected = LLM(str(tiny_opt_no_tokenizer), load_installed_plugins=False).generate(
        [[2, 5, 9]], greedy(4, logprobs=1)
    )
    engine = AsyncLLM(str(tiny_opt_no_tokenizer), load_installed_plugins=False)
    try:
        with running_server(build_app(engine, served_model_name="ids")) as base:
            body = {"model": "ids", "prompt": [2, 5, 9], "max_tokens": 4, "temperature": 0, "logprobs": 1}
            choice = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]
    finally:
        engine.shutdown()
    out = expected[0]
    assert (choice["text"], choice["prompt_token_ids"], choice["token_ids"]) == ("", [2, 5, 9], out.token_ids)
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in out.token_ids]  # vLLM's names by id
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        [s[t] for s, t in zip(out.logprobs, out.token_ids, strict=True)], abs=1e-4
    )


def test_a_chat_messages_name_reaches_the_chat_template(sentencepiece_url):
    # It was accepted and dropped: a template printing speakers' names rendered another prompt than vLLM's.
    def prompt_tokens(message: dict) -> int:
        chat = {"model": "sp", "max_tokens": 1, "messages": [message]}
        return httpx.post(f"{sentencepiece_url}/v1/chat/completions", json=chat, timeout=TIMEOUT).json()["usage"][
            "prompt_tokens"
        ]

    named = prompt_tokens({"role": "user", "name": "a", "content": "a"})  # the template renders "a: a"
    assert named == prompt_tokens({"role": "user", "content": "a: a"}) > prompt_tokens({"role": "user", "content": "a"})


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(
    ("content", "headers", "message"),
    [
        (
            b"{not json",
            JSON,
            "the body is not valid JSON: Expecting property name enclosed in double quotes at line 1, "
            "column 2 (character 1)",
        ),
        (
            b'{"model": "demo",\n "prompt": "x",,\n}',
            JSON,
            "the body is not valid JSON: Expecting property name enclosed in double quotes at line 2, column 16 "
            "(character 33)",
        ),
        (
            '{"prompt": "café"}'.encode("latin-1"),
            JSON,
            "the body is not valid UTF-8 JSON: byte 0xe9 at offset 15, invalid continuation byte",
        ),
        # curl -d without -H 'Content-Type: application/json' sends a form's content type.
        (
            b'{"prompt": "x"}',
            {"content-type": "application/x-www-form-urlencoded"},
            "the body must be JSON sent with Content-Type: application/json "
            "(this request has Content-Type application/x-www-form-urlencoded)",
        ),
        (
            b'{"prompt": "x"}',
            {},
            "the body must be JSON sent with Content-Type: application/json (this request has no Content-Type)",
        ),
        (b'["x"]', JSON, "the body must be a JSON object, not an array"),
        (b"", JSON, "the request has no body: send a JSON object, with Content-Type: application/json"),
    ],
)
def test_a_body_that_is_no_json_object_is_a_400_saying_what_is_wrong(url, client, content, headers, message):
    response = httpx.post(f"{url}/v1/completions", content=content, headers=headers, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]  # param null: a JSON error's location is a character offset, no field
    assert error == {
        "message": f"Invalid request: {message}",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert client.completions.create(model="demo", prompt="A plugin", max_tokens=2).choices[0].text is not None


def test_the_client_sees_openai_exceptions(client):
    with pytest.raises(openai.BadRequestError, match="top_p must be in"):
        client.completions.create(model="demo", prompt="x", top_p=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-served", prompt="x")


def test_an_engine_error_mid_stream_ends_it_with_an_error_chunk_then_done(url, client, engine, monkeypatch):
    """An error of the engine itself (neither the model's nor a plugin's) still ends the stream as the API says."""
    runner = engine.engine.runner
    real = runner.execute
    failed = []

    def broken_once(step):
        if not failed:
            failed.append(step)
            raise RuntimeError("an engine bug")
        return real(step)

    monkeypatch.setattr(runner, "execute", broken_once)
    body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 5, "stream": True}
    events = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert error["code"] == "internal_error" and "an engine bug" in error["message"]
    with pytest.raises(openai.APIError, match="an engine bug"):  # the client raises it, instead of an empty answer
        failed.clear()
        list(client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=5, stream=True))
    assert client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=2).choices[0].finish_reason


def test_tokens_the_model_gives_no_chance_have_logprob_minus_9999_in_strict_json(url, engine, monkeypatch):
    # A model masking part of its vocabulary (logits -inf): log-probabilities -inf, which JSON cannot hold. The
    # whole answer was a 500, and a stream carried the bare token -Infinity, which strict parsers refuse.
    runner, real = engine.engine.runner, engine.engine.runner.execute

    def masked(step):
        computed = real(step)
        logits = computed.logits.clone()  # the step's own is an inference tensor
        logits[:, :100] = logits[:, 103:] = float("-inf")  # only tokens 100-102 may come
        return dataclasses.replace(computed, logits=logits)

    monkeypatch.setattr(runner, "execute", masked)

    def strict(text: str) -> dict:
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"not JSON: {name}"))

    for path, asks in (
        ("completions", {"prompt": PROMPTS[0], "logprobs": 5}),
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 5}),
    ):
        body = {"model": "demo", "max_tokens": 3, "temperature": 0, **asks}
        whole = httpx.post(f"{url}/v1/{path}", json=body, timeout=TIMEOUT)
        assert whole.status_code == 200, whole.text
        logprobs = strict(whole.text)["choices"][0]["logprobs"]
        if path == "completions":
            tops = [sorted(top.values()) for top in logprobs["top_logprobs"]]
        else:
            tops = [sorted(t["logprob"] for t in entry["top_logprobs"]) for entry in logprobs["content"]]
        assert all(top[:2] == [-9999.0, -9999.0] and -9999.0 < top[2] <= 0 for top in tops), tops
        streamed = httpx.post(f"{url}/v1/{path}", json={**body, "stream": True}, timeout=TIMEOUT).text
        events = [strict(e.removeprefix("data: ")) for e in streamed.split("\n\n") if e.startswith("data: {")]
        assert events and all("error" not in e for e in events)


def test_a_long_streamed_answers_logprobs_are_the_whole_answers_for_no_more_decoding(url, engine, monkeypatch):
    """Each chunk decodes its own tokens only: the stream's text_offset goes on from the chunk before.

    Recomputing it from the first token for every chunk made a long answer's stream quadratic on the event loop.
    """
    tokenizer, real, decoded = engine.tokenizer, engine.tokenizer.decode, []

    def counted(*args, **kwargs):
        decoded.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", counted)
    body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{url}/v1/completions", json={**body, "logprobs": 1}, timeout=TIMEOUT).json()
    decoded_whole = len(decoded)
    decoded.clear()
    events = httpx.post(f"{url}/v1/completions", json={**body, "logprobs": 1, "stream": True}, timeout=TIMEOUT).text
    decoded_streamed = len(decoded)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events.split("\n\n")[:-2]]
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for key, values in chunk["choices"][0]["logprobs"].items():
            streamed[key] += values
    expected = whole["choices"][0]["logprobs"]
    assert len(chunks) > 20 and len(expected["tokens"]) == 200
    assert streamed["tokens"] == expected["tokens"] and streamed["text_offset"] == expected["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=1e-4)
    assert expected["text_offset"][-1] + len(expected["tokens"][-1]) == len(whole["choices"][0]["text"])
    assert decoded_streamed <= 1.5 * decoded_whole, (decoded_streamed, decoded_whole)


def test_continuous_usage_stats_without_include_usage_sends_no_usage(url):
    # As vLLM: continuous_usage_stats adds counts to the chunks of a stream that asked for usage at all.
    options = {"continuous_usage_stats": True}
    body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True}
    events = httpx.post(f"{url}/v1/completions", json={**body, "stream_options": options}, timeout=TIMEOUT).text
    chunks = [json.loads(e.removeprefix("data: ")) for e in events.split("\n\n")[:-2]]
    assert len(chunks) >= 2 and all(c.get("usage") is None for c in chunks)
    assert all(c["choices"] for c in chunks)  # no usage chunk at the end either


@pytest.mark.parametrize("continuous", [False, True])
def test_stream_usage_null_on_each_chunk_or_the_counts_so_far(url, continuous):
    options = {"include_usage": True, "continuous_usage_stats": continuous}
    body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "stream": True, "n": 2}
    events = httpx.post(f"{url}/v1/completions", json={**body, "stream_options": options}, timeout=TIMEOUT).text
    chunks = [json.loads(e.removeprefix("data: ")) for e in events.split("\n\n")[:-2]]
    *running, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    if not continuous:
        assert all(c["usage"] is None for c in running)
        return
    for index in (0, 1):  # as vLLM: each chunk counts its own choice's prompt and tokens so far
        counts = [c["usage"]["completion_tokens"] for c in running if c["choices"][0]["index"] == index]
        assert counts == sorted(counts) and counts[-1] == 6
    assert all(c["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"] for c in running)


# -- metrics, keys, a full queue ---------------------------------------------------------------------------


def test_metrics_count_what_was_served(url, client):
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    before = scrape()
    client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=7, temperature=0)
    after = scrape()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('pluginhost_generation_tokens_total{model_name="demo"}') >= 7
    assert delta('pluginhost_prompt_tokens_total{model_name="demo"}') >= 4
    assert delta('pluginhost_time_to_first_token_seconds_count{model_name="demo"}') == 1
    assert delta('pluginhost_request_time_per_output_token_seconds_count{model_name="demo"}') == 1
    # One inter-token latency per token after the first, as vLLM observes them (it was one mean per request).
    tokens = delta('pluginhost_generation_tokens_total{model_name="demo"}')
    assert delta('pluginhost_inter_token_latency_seconds_count{model_name="demo"}') == tokens - 1
    assert delta('pluginhost_request_success_total{finish_reason="length",model_name="demo"}') == 1
    assert 'pluginhost_num_requests_running{model_name="demo"}' in after
    assert delta('pluginhost_num_preemptions_total{model_name="demo"}') == 0
    assert 'pluginhost_num_preemptions_total{model_name="demo"}' in after


def test_metrics_count_as_waiting_the_requests_accepted_during_a_step(url, engine):
    # Accepted while a step runs, a request waits in the engine's inbox until the next: the gauge showed 0 waiting
    # during a long step, while the queue's bound (the 503) counted them.
    waiting = 'pluginhost_num_requests_waiting{model_name="demo"}'
    body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 2}
    senders = [
        threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",), kwargs={"json": body, "timeout": TIMEOUT})
        for _ in range(3)
    ]
    with engine.engine._step_lock:  # a step that lasts
        for sender in senders:
            sender.start()
        assert wait_until(lambda: engine.engine.queue_counts()[1] == 3, TIMEOUT)
        scraped = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
        assert f"{waiting} 3.0" in scraped.splitlines()
    for sender in senders:
        sender.join(TIMEOUT)
    assert wait_until(lambda: engine.engine.queue_counts() == (0, 0), TIMEOUT)


def test_metrics_count_each_sample_with_its_own_finish_reason(url):
    """One count per choice, labelled by its own reason, as vLLM counts (one per request, the first's reason)."""
    success = 'pluginhost_request_success_total{finish_reason="%s",model_name="demo"}'
    body = {"model": "demo", "prompt": "The", "max_tokens": 12, "n": 4, "stop": ["plugin"]}
    mixed = 0
    for seed in range(30):
        before = {reason: metric(url, success % reason) for reason in ("stop", "length")}
        answer = httpx.post(f"{url}/v1/completions", json={**body, "seed": seed}, timeout=TIMEOUT).json()
        reasons = Counter(choice["finish_reason"] for choice in answer["choices"])
        assert {r: metric(url, success % r) - before[r] for r in before} == {r: reasons[r] for r in before}
        mixed += len(reasons) > 1
        if mixed:
            break
    assert mixed, "no seed gave choices ending for different reasons: the test did not test it"


def test_each_prompt_of_a_request_is_timed_to_its_own_end(url, engine, monkeypatch):
    """A prompt that stopped after a few tokens was timed to the end of the whole request (its neighbour's 120
    tokens later), and its time per output token was that over its own few tokens: seconds a token."""
    from pluginhost.server.metrics import ServerMetrics

    body = {"model": "demo", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    prompts = ["A plugin is", "The engine"]
    texts = [
        httpx.post(f"{url}/v1/completions", json={**body, "prompt": p}, timeout=TIMEOUT).json()["choices"][0]["text"]
        for p in prompts
    ]
    stop = next(texts[0][i : i + 4] for i in range(3, 40) if texts[0][i : i + 4] not in texts[1])
    recorded: list[dict] = []
    record_request = ServerMetrics.record_request

    def recording(self, **figures):
        recorded.append(figures)
        record_request(self, **figures)

    monkeypatch.setattr(ServerMetrics, "record_request", recording)
    answer = httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompts, "stop": [stop]}, timeout=TIMEOUT)
    assert [c["finish_reason"] for c in answer.json()["choices"]] == ["stop", "length"]
    short, long = sorted(recorded, key=lambda figures: figures["tokens"])
    assert short["tokens"] < 20 and long["tokens"] == 120
    assert short["end"] < long["first_token"] + (long["end"] - long["first_token"]) / 2  # its own end, not the last's
    assert short["first_token"] <= short["last_token"] <= short["end"] and long["last_token"] <= long["end"]


def test_latencies_count_from_when_the_http_request_came_in(url, engine, monkeypatch):
    """Not from when its request was made, after waiting to be tokenized (a 7 s wait counted as 0.06 s)."""
    handed: list[float] = []
    made: list = []
    off_loop, submit = engine.off_loop, engine.engine.submit

    async def timed_off_loop(fn, *args):
        handed.append(time.monotonic())  # the request goes to the input thread now: it had arrived already
        return await off_loop(fn, *args)

    def recorded_submit(requests, **kwargs):
        requests = list(requests)
        made.extend(requests)
        return submit(requests, **kwargs)

    monkeypatch.setattr(engine, "off_loop", timed_off_loop)
    monkeypatch.setattr(engine.engine, "submit", recorded_submit)
    answer = httpx.post(
        f"{url}/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2}, timeout=TIMEOUT
    )
    assert answer.status_code == 200 and len(made) == 1
    assert made[0].arrival_time <= handed[-1] <= made[0].first_token_time


def test_a_big_answer_is_built_off_the_event_loop_decoding_each_token_once(url, engine, monkeypatch):
    """n=32 choices of 250 tokens with 20 logprobs held the loop (and every client) for up to 2 s."""
    from pluginhost.server import app as server_app

    built_in: list[str] = []
    decoded: list[int] = []
    whole, decode = server_app._Completions.whole, engine.tokenizer.decode

    def recorded_whole(self, *args):
        built_in.append(threading.current_thread().name)
        return whole(self, *args)

    def counted_decode(ids, *args, **kwargs):
        if threading.current_thread().name != "pluginhost-engine":  # the engine's own detokenizing aside
            decoded.extend(ids)
        return decode(ids, *args, **kwargs)

    monkeypatch.setattr(server_app._Completions, "whole", recorded_whole)
    monkeypatch.setattr(engine.tokenizer, "decode", counted_decode)
    body = {"model": "demo", "prompt": "A plugin", "max_tokens": 100, "n": 4, "logprobs": 5, "ignore_eos": True}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()
    assert len(built_in) == 1 and built_in[0] != "pluginhost-test-server"  # the server's event loop thread
    named = {t for choice in answer["choices"] for top in choice["logprobs"]["top_logprobs"] for t in top}
    assert len(decoded) == len(set(decoded)) >= len(named)  # each token decoded once, for all it is named
    small = httpx.post(f"{url}/v1/completions", json={**body, "n": 1, "logprobs": None}, timeout=TIMEOUT)
    assert small.status_code == 200 and built_in[1] == "pluginhost-test-server"  # a small one: no thread hop


def test_a_body_over_the_limit_is_a_413_error_object_and_is_not_read(engine):
    app = build_app(engine, served_model_name="small", max_body_bytes=1000)
    with running_server(app) as base:
        prompt = "word " * 300  # 1,500 bytes of prompt

        def chunked():  # no Content-Length: the limit is found as the body comes
            for _ in range(3):
                yield json.dumps({"prompt": prompt}).encode()[:600]

        declared = httpx.post(f"{base}/v1/completions", json={"prompt": prompt}, timeout=TIMEOUT)
        streamed = httpx.post(
            f"{base}/v1/completions", content=chunked(), headers={"content-type": "application/json"}, timeout=TIMEOUT
        )
        for refused in (declared, streamed):
            assert refused.status_code == 413, refused.text
            assert refused.headers["connection"] == "close"  # the rest of the body is not read either
            assert refused.json() == {
                "error": {
                    "message": "Invalid request: the body is larger than 1000 bytes (0.000953674 MiB), the most this "
                    "server reads: send shorter prompts, or fewer per request",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        fine = httpx.post(f"{base}/v1/completions", json={"prompt": "A plugin", "max_tokens": 2}, timeout=TIMEOUT)
        assert fine.status_code == 200
        assert (
            metric(base, 'pluginhost_http_requests_total{model_name="small",route="/v1/completions",status="413"}') == 2
        )


def test_a_request_cut_short_by_a_forced_exit_ends_with_an_error_not_an_asgi_traceback(engine, caplog):
    """A second Ctrl-C that cannot wait: each answer still ends as the API says, and nothing is logged as a crash.

    uvicorn cancels what still runs; it logged "Exception in ASGI application" for each, and answered plain-text 500s.
    """
    import uvicorn
    from fastapi.responses import StreamingResponse

    from pluginhost.server.run import bind

    app = build_app(engine, served_model_name="demo")
    reached = threading.Event()

    @app.get("/hang")
    async def hang() -> None:
        reached.set()
        await asyncio.Event().wait()

    @app.get("/hang-streaming")
    async def hang_streaming() -> StreamingResponse:
        async def events():
            yield 'data: {"choices": []}\n\n'
            reached.set()
            await asyncio.Event().wait()

        return StreamingResponse(events(), media_type="text/event-stream")

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    answers: dict[str, httpx.Response] = {}
    try:
        assert wait_until(lambda: server.started, TIMEOUT)
        for path in ("/hang", "/hang-streaming"):
            reached.clear()
            asking = threading.Thread(target=lambda p=path: answers.update({p: httpx.get(base + p, timeout=TIMEOUT)}))
            asking.start()
            assert reached.wait(TIMEOUT)
        with caplog.at_level(logging.ERROR):
            server.should_exit = server.force_exit = True  # as a second Ctrl-C leaves it, once its wait is over
            thread.join(TIMEOUT)
        assert wait_until(lambda: len(answers) == 2, TIMEOUT)
    finally:
        server.should_exit = server.force_exit = True
        thread.join(TIMEOUT)
        sock.close()
    assert not thread.is_alive()
    error = {"message": "the server was stopped before this request was answered", "type": "server_error"}
    assert answers["/hang"].status_code == 503
    assert answers["/hang"].json() == {"error": {**error, "param": None, "code": "shutting_down"}}
    events = answers["/hang-streaming"].text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert json.loads(events[-3].removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert "Exception in ASGI application" not in caplog.text


def test_a_client_that_stopped_reading_cannot_hold_a_quitting_server():
    """The last words of a cancelled answer wait for a client that reads nothing only so long.

    A stream whose client stopped reading (its buffers full) kept ``serve`` from exiting after SIGTERM, for
    ever: its task, cancelled once, waited to send them.
    """
    from pluginhost.server import guards

    async def stalled_send(message: dict) -> None:
        await asyncio.Event().wait()  # the transport never drains

    async def nothing() -> dict:
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "GET", "path": "/", "headers": []}
    for started, stream in ((True, True), (False, False)):
        ending = guards._answer_cancelled(scope, nothing, stalled_send, started=started, stream=stream)
        asyncio.run(asyncio.wait_for(ending, 10 * guards.LAST_WORDS_S))  # returns: no TimeoutError


def test_metrics_count_the_sequences_preempted_for_memory():
    from pluginhost.engine.core import EngineStats
    from pluginhost.server.metrics import ServerMetrics

    metrics = ServerMetrics("demo")
    for preempted in (2, 0, 1):
        metrics.record_step(EngineStats(4, 2, 4, 0, 0, 0.01, (8, 512), num_preempted=preempted))
    assert 'pluginhost_num_preemptions_total{model_name="demo"} 3.0' in metrics.render().decode()


def test_the_api_key_is_checked_on_every_route(engine):
    with running_server(build_app(engine, served_model_name="demo", api_key="s3cret")) as base:
        for method, path in [
            ("GET", "/health"),
            ("GET", "/metrics"),
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("GET", "/no/such/path/31871"),
        ]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                response = httpx.request(method, f"{base}{path}", headers=headers, json={}, timeout=TIMEOUT)
                assert response.status_code == 401, (path, headers)
                assert response.json()["error"]["code"] == "invalid_api_key"
                assert response.headers["connection"] == "close"  # its body is not read to the end for nothing
        for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme is case-insensitive
            headers = {"Authorization": f"{scheme} s3cret"}
            assert httpx.get(f"{base}/health", headers=headers, timeout=TIMEOUT).status_code == 200
        # Refused requests are counted by route: paths of a caller's choosing never become metric labels.
        metrics = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer s3cret"}, timeout=TIMEOUT).text
        assert "31871" not in metrics
        assert 'route="unmatched",status="401"' in metrics and 'route="/v1/completions",status="401"' in metrics
        keyed = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", timeout=TIMEOUT, max_retries=0)
        assert keyed.completions.create(model="demo", prompt="A plugin", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0).models.list()
    with running_server(build_app(engine, served_model_name="demo", api_key="clé")) as base:  # sent as UTF-8
        for key, status in [("clé", 200), ("cle", 401)]:
            headers = {"Authorization": f"Bearer {key}".encode()}
            assert httpx.get(f"{base}/health", headers=headers, timeout=TIMEOUT).status_code == status


def test_the_api_key_is_checked_on_a_plugins_websocket_route_too(tiny_opt):
    """An HTTP middleware never sees a WebSocket: a plugin's WebSocket route was served without the key. And served
    by uvicorn as `pluginhost serve` runs it (without a WebSocket package, uvicorn answered every handshake 404)."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    from pluginhost import hookimpl

    class Live:
        @hookimpl
        def register_routes(self, app):
            @app.websocket("/v1/live")
            async def live(websocket: WebSocket):
                await websocket.accept()
                await websocket.send_json({"served": True, "said": await websocket.receive_text()})
                await websocket.close()

    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[Live()])
    try:
        with running_server(build_app(engine, served_model_name="tiny", api_key="s3cret")) as base:
            url = base.replace("http://", "ws://") + "/v1/live"
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                # Closed (1008) before the route runs, which the client sees as the handshake refused.
                with (
                    pytest.raises(InvalidStatus) as refused,
                    connect(url, additional_headers=headers, open_timeout=TIMEOUT),
                ):
                    pass
                assert refused.value.response.status_code == 403
            with connect(url, additional_headers={"Authorization": "Bearer s3cret"}, open_timeout=TIMEOUT) as socket:
                socket.send("hello")
                assert json.loads(socket.recv(timeout=TIMEOUT)) == {"served": True, "said": "hello"}
    finally:
        engine.shutdown()


class NoLogprobsHere:
    """A site's policy and a redaction: plugins leaving a request asking for logprobs without them."""

    @hookimpl
    def on_request(self, request):
        if (request.params.extra_args or {}).get("drop") == "on_request":
            request.params.logprobs = None

    @hookimpl
    def on_output(self, request, output):
        if (request.params.extra_args or {}).get("drop") == "on_output":
            for sample in output.outputs:
                sample.logprobs = None


def test_completions_whose_logprobs_a_plugin_took_out_answer_them_null(tiny_opt):
    # The choices' logprobs are shown when the body asks for them (a choice waiting for its row has none yet): a
    # choice with tokens and no logprobs was a 500 ("zip() argument 2 is shorter"), whole and streamed.
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[NoLogprobsHere()])
    try:
        with running_server(build_app(engine, served_model_name="tiny")) as base:
            for drop in ("on_request", "on_output"):
                body = {"prompt": [2, 5, 9], "max_tokens": 3, "logprobs": 1, "extra_args": {"drop": drop}}
                whole = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
                assert whole.status_code == 200 and whole.json()["choices"][0]["logprobs"] is None
                streamed = httpx.post(f"{base}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT)
                events = [json.loads(e.removeprefix("data: ")) for e in streamed.text.split("\n\n")[:-2]]
                assert all("error" not in e for e in events) and events[-1]["choices"][0]["logprobs"] is None
    finally:
        engine.shutdown()


def test_logprobs_minus_one_lists_the_whole_vocabulary_when_the_server_allows_it():
    # vLLM's -1 (every token): chat's top_logprobs cut the list at [:-1], every token but the least likely.
    from fastapi.testclient import TestClient

    engine = AsyncLLM(str(ensure_demo_model()), load_installed_plugins=False, max_logprobs=-1)
    vocabulary = engine.vocab_size
    chat = {"messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": -1}
    try:
        with TestClient(build_app(engine, served_model_name="demo")) as client:
            for stream in (False, True):
                answer = client.post("/v1/chat/completions", json=chat | {"stream": stream})
                assert answer.status_code == 200, answer.text
                events = [json.loads(line[6:]) for line in answer.text.splitlines() if line[6:].startswith("{")]
                tokens = [
                    token
                    for body in (events if stream else [answer.json()])
                    for choice in body["choices"]
                    for token in (choice.get("logprobs") or {}).get("content") or []
                ]
                assert len(tokens) == 2 and all(len(t["top_logprobs"]) == vocabulary for t in tokens)
    finally:
        engine.shutdown()


def test_a_full_queue_answers_503_and_the_server_recovers(tmp_path):
    engine = AsyncLLM(str(ensure_demo_model()), load_installed_plugins=False, max_num_seqs=1, max_waiting_seqs=1)
    body = {"model": "busy", "prompt": PROMPTS[0], "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    try:
        with running_server(build_app(engine, served_model_name="busy")) as base:

            async def flood() -> list[httpx.Response]:
                async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                    return await asyncio.gather(*(http.post(f"{base}/v1/completions", json=body) for _ in range(6)))

            statuses = sorted(r.status_code for r in asyncio.run(asyncio.wait_for(flood(), TIMEOUT)))
            assert statuses[0] == 200 and statuses[-1] == 503
            busy = next(r for r in asyncio.run(asyncio.wait_for(flood(), TIMEOUT)) if r.status_code == 503)
            assert "queue is full" in busy.json()["error"]["message"]
            ok = httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 2}, timeout=TIMEOUT)
            assert ok.status_code == 200
    finally:
        engine.shutdown()


def test_an_idle_server_takes_a_burst_as_large_as_its_free_rows_and_its_queue():
    """The queue bound leaves out what starts at the next step (4 of an idle burst of 6 were refused with 503)."""
    engine = AsyncLLM(str(ensure_demo_model()), load_installed_plugins=False, max_num_seqs=8, max_waiting_seqs=2)
    body = {"model": "burst", "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    try:
        with running_server(build_app(engine, served_model_name="burst")) as base:

            async def burst(bodies: list[dict]) -> list[httpx.Response]:
                async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                    return await asyncio.gather(*(http.post(f"{base}/v1/completions", json=b) for b in bodies))

            # 8 rows + 2 waiting: 10 sequences are taken at once, whenever they come.
            answers = asyncio.run(asyncio.wait_for(burst([body] * 6 + [{**body, "n": 4}]), TIMEOUT))
            assert [a.status_code for a in answers] == [200] * 7, [a.text for a in answers if a.status_code != 200]
            assert [len(a.json()["choices"]) for a in answers] == [1] * 6 + [4]
            whole = httpx.post(f"{base}/v1/completions", json={**body, "n": 10, "max_tokens": 2}, timeout=TIMEOUT)
            assert whole.status_code == 200 and len(whole.json()["choices"]) == 10  # exactly what it takes in
            never = httpx.post(f"{base}/v1/completions", json={**body, "n": 11}, timeout=TIMEOUT)
            assert never.status_code == 400 and never.json()["error"]["param"] == "n"
            assert (
                "(10: 8 running, --max-num-seqs, + 2 waiting, --max-waiting-seqs)" in never.json()["error"]["message"]
            )
    finally:
        engine.shutdown()


def test_a_model_failure_is_a_500_or_an_error_event_and_later_requests_are_served(tiny_opt, flaky_opt):
    engine = AsyncLLM(str(tiny_opt), load_installed_plugins=False, plugins=[flaky_opt(failures=2)])
    body = {"model": "flaky", "prompt": [2, 5, 9], "max_tokens": 4}
    try:
        with running_server(build_app(engine, served_model_name="flaky")) as base:
            whole = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
            assert whole.status_code == 500
            assert "Flaky" in whole.json()["error"]["message"] and "kernel fault" in whole.json()["error"]["message"]
            streamed = httpx.post(f"{base}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT)
            events = streamed.text.split("\n\n")
            assert json.loads(events[0].removeprefix("data: "))["error"]["code"] == "model_error"
            assert events[-2] == "data: [DONE]"
            after = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
            assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] >= 1
    finally:
        engine.shutdown()


def test_the_models_generation_config_gives_the_defaults_a_request_leaves_out_as_vllm(tiny_opt, tmp_path):
    """vLLM's generation_config="auto": Llama 3 Instruct's temperature 0.6 and top_p 0.9 were temperature 1, top_p 1."""
    import shutil

    model = shutil.copytree(tiny_opt, tmp_path / "model")
    recommended = {"top_k": 1, "temperature": 0.7, "max_new_tokens": 6}  # top_k 1: what greedy gives
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **recommended}))
    offline = LLM(str(model), load_installed_plugins=False)
    assert offline.sampling_defaults == {"temperature": 0.7, "top_k": 1, "max_tokens": 6}
    expected = offline.generate(["Hi"], greedy(6, ignore_eos=True))[0].outputs[0].text

    class SetsItsOwnLimit:  # as request_guard does for a request setting none: it saw the model's 6 and refused
        @hookimpl
        def on_request(self, request):
            if request.params.max_tokens is None:
                request.params.max_tokens = 3

    engine = AsyncLLM(str(model), load_installed_plugins=False, plugins=[SetsItsOwnLimit()])
    try:
        with running_server(build_app(engine, served_model_name="tiny")) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
            extra = {"ignore_eos": True}
            unset = {"model": "tiny", "prompt": "Hi", "max_tokens": None, **extra}
            answer = httpx.post(f"{base}/v1/completions", json=unset, timeout=TIMEOUT).json()
            assert answer["usage"]["completion_tokens"] == 3  # the hook's: the model's applies after the hooks
            # Left out: the model's defaults; max_tokens caps what the request asks (16 by OpenAI's default).
            answer = client.completions.create(model="tiny", prompt="Hi", extra_body=extra)
            assert (answer.choices[0].text, answer.usage.completion_tokens) == (expected, 6)
            # Given: the request's own (sampled at temperature 1 over every token: not the greedy text, seeded).
            sampled = client.completions.create(model="tiny", prompt="Hi", seed=3, extra_body={**extra, "top_k": 0})
            assert sampled.choices[0].text != expected and sampled.usage.completion_tokens == 6
            # A max_tokens the client gave is its own: one the context cannot hold is a 400, however far above the
            # model's cap (asking for 100 was cut to fit, asking for 6 refused); min_tokens past the cap names it.
            long_prompt = [2, *range(10, 133)]  # 124 tokens of 128: room for 4
            for asked in (6, 100):
                with pytest.raises(openai.BadRequestError, match="more than max_model_len=128"):
                    client.completions.create(model="tiny", prompt=long_prompt, max_tokens=asked)
            with pytest.raises(openai.BadRequestError, match=r"min_tokens \(10\) is more than the 6 tokens this model"):
                client.completions.create(model="tiny", prompt="Hi", extra_body={"min_tokens": 10})
    finally:
        engine.shutdown()
    # Offline: a prompt given no SamplingParams takes them too; generation_config="vllm" leaves them out.
    assert offline.generate(["Hi"])[0].outputs[0].token_ids == offline.generate(["Hi"], greedy(6))[0].token_ids
    plain = LLM(str(model), load_installed_plugins=False, generation_config="vllm")
    assert plain.sampling_defaults == {} and plain.get_default_sampling_params().max_tokens == 16


def test_a_generation_config_recommending_what_sampling_refuses_is_one_clear_error(tiny_opt, tmp_path):
    import shutil

    from pluginhost.errors import ConfigError

    model = shutil.copytree(tiny_opt, tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps({"temperature": -1.0}))
    with pytest.raises(ConfigError, match=r"generation_config.json recommends sampling defaults SamplingParams refus"):
        LLM(str(model), load_installed_plugins=False)
    assert LLM(str(model), load_installed_plugins=False, generation_config="vllm").generate(["Hi"])
