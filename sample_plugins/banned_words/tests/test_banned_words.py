"""The banned-words processor, tested with pluginhost's pytest fixtures on the shipped demo model.

The demo model writes words from pluginhost's docs, greedily the same every
time: what it would write freely is generated first, then a word of that
text is banned and must not come out, while the other requests of the same
batch come out exactly as they would alone.
"""

from types import SimpleNamespace

import httpx
import pluginhost_banned_words
import pytest
import torch
from pluginhost_banned_words import MAX_WORD_CHARS, MAX_WORDS
from pluginhost_banned_words.processor import BannedWordsLogitsProcessor

from pluginhost import AsyncLLM, SamplingParams
from pluginhost.demo import ensure_demo_model
from pluginhost.errors import RequestRefusedError
from pluginhost.logits_processors import BatchUpdate, MoveDirectionality
from pluginhost.server.app import build_app
from pluginhost.testing.models import make_tiny_opt
from pluginhost.testing.server import running_server

PROMPT = "A plugin is"
PLUGIN = "pluginhost_banned_words"
TIMEOUT = 60


def greedy(max_tokens=16, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)


def banning(*words, **kwargs):
    return greedy(extra_args={"banned_words": list(words)}, **kwargs)


@pytest.fixture
def llm(make_engine):
    return make_engine(pluginhost_banned_words, model=str(ensure_demo_model()))


# -- in the engine -----------------------------------------------------------------------------


def test_a_word_the_model_writes_is_not_written_once_banned_and_the_batch_is_unaffected(llm):
    tokenizer = llm.get_tokenizer()
    free, other = (o.outputs[0] for o in llm.generate([PROMPT, "The engine"], greedy()))
    assert " module " in free.text and " makes " in free.text  # what the model writes freely

    outs = llm.generate(
        [PROMPT, PROMPT, PROMPT, "The engine"],
        [banning("module"), greedy(), banning("makes"), greedy()],
    )
    no_module, unbanned, no_makes, unbanned_other = (o.outputs[0] for o in outs)
    # Requests without the option, in the same batch, are exactly what they are alone.
    assert (unbanned.token_ids, unbanned_other.token_ids) == (free.token_ids, other.token_ids)

    # A one-token word: never generated; everything before it is unchanged.
    assert "module" not in no_module.text
    before = free.text[: free.text.index(" module")]
    assert no_module.text.startswith(before) and no_module.text != free.text

    # A two-token word (" ma" "kes"): " ma" is still written, "kes" never right after it.
    ma, kes = tokenizer.encode(" makes", add_special_tokens=False)
    at = free.token_ids.index(ma)
    assert free.token_ids[at + 1] == kes
    assert no_makes.token_ids[: at + 1] == free.token_ids[: at + 1]
    assert no_makes.token_ids[at + 1] != kes and "makes" not in no_makes.text


def test_sampled_requests_are_processed_too(llm):
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    free = llm.generate(PROMPT, sampled)[0].outputs[0]
    words = [w for w in free.text.split() if w.isalpha() and len(w) > 2]
    assert words, free.text
    banned = llm.generate(PROMPT, sampled.clone(extra_args={"banned_words": words}))[0].outputs[0]
    assert not set(words) & set(banned.text.split()), (words, banned.text)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("module", r"extra_args\['banned_words'\] must be a list of words, got str 'module'; write \['module'\]"),
        ({"module": True}, r"must be a list of words, got dict"),
        (["module", 7], r"extra_args\['banned_words'\]\[1\] must be a string, got int 7"),
        (["module", "  "], r"extra_args\['banned_words'\]\[1\] is empty"),
        (
            [f"zq{i}x" for i in range(MAX_WORDS + 1)],
            rf"extra_args\['banned_words'\] may hold at most {MAX_WORDS} words .*, got {MAX_WORDS + 1}",
        ),
        (
            ["module", "x" * (MAX_WORD_CHARS + 1)],
            rf"\[1\] has {MAX_WORD_CHARS + 1} characters .* at most {MAX_WORD_CHARS}",
        ),
    ],
)
def test_a_malformed_option_refuses_the_request_naming_the_plugin(llm, option, message):
    with pytest.raises(ValueError, match=message) as info:
        llm.generate(PROMPT, greedy(extra_args={"banned_words": option}))
    assert isinstance(info.value, RequestRefusedError)
    assert (info.value.plugin, info.value.hook) == (PLUGIN, "register_logits_processors")
    assert f"logits processor BannedWordsLogitsProcessor (plugin '{PLUGIN}') refused the request" in str(info.value)
    assert llm.generate(PROMPT, greedy(4))[0].outputs[0].token_ids  # the engine goes on


def test_through_the_server_extra_args_ban_and_bad_options_are_400s():
    engine = AsyncLLM(str(ensure_demo_model()), plugins=[pluginhost_banned_words], load_installed_plugins=False)
    try:
        with running_server(build_app(engine, served_model_name="demo")) as url:
            body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
            free = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()
            assert " module" in free["choices"][0]["text"]
            body["extra_args"] = {"banned_words": ["module"]}
            banned = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()
            assert "module" not in banned["choices"][0]["text"]
            body["extra_args"] = {"banned_words": "module"}
            refused = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
            assert refused.status_code == 400
            assert f"(plugin '{PLUGIN}') refused the request" in refused.json()["error"]["message"]
            body["extra_args"] = {"banned_words": [f"zq{i}x" for i in range(100_000)]}  # 1.2 MB of JSON
            refused = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
            assert refused.status_code == 400
            assert (
                f"(plugin '{PLUGIN}') refused the request: extra_args['banned_words'] may hold at most"
                in (refused.json()["error"]["message"])
            )
    finally:
        engine.shutdown()


# -- models whose tokenizer cannot spell the words ----------------------------------------------


def test_on_a_model_without_a_tokenizer_banning_words_is_refused_naming_the_plugin_and_bans_nothing_silently(
    make_engine, tmp_path
):
    llm = make_engine(pluginhost_banned_words, model=str(make_tiny_opt(tmp_path, tokenizer=False)))
    assert llm.get_tokenizer() is None  # the engine serves token-id prompts on it
    # A refusal (a server's 400): it was the plugin's failure, a 500.
    with pytest.raises(RequestRefusedError, match=r"needs the model's tokenizer .* has none \(none of tokeni") as info:
        llm.generate([[2, 10, 20]], banning("foo", max_tokens=3))
    assert (info.value.plugin, info.value.hook) == (PLUGIN, "register_logits_processors")
    assert llm.generate([[2, 10, 20]], greedy(3))[0].outputs[0].token_ids  # requests without the option are served


def test_a_word_the_tokenizer_spells_with_no_token_is_refused_naming_the_word(make_engine, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # A vocabulary of letters, with no unknown token: the tokenizer drops any other character (an emoji).
    letters = ["<s>", "<pad>", "</s>", *"abcdefghijklmnopqrstuvwxyz"]
    tokenizer = Tokenizer(models.BPE({piece: i for i, piece in enumerate(letters)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model = make_tiny_opt(tmp_path, tokenizer=False)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="</s>", eos_token="</s>").save_pretrained(model)
    llm = make_engine(pluginhost_banned_words, model=str(model))
    assert llm.get_tokenizer().encode("\U0001f642", add_special_tokens=False) == []
    with pytest.raises(RequestRefusedError, match=r"\[1\] '\U0001f642' encodes to no token of its own") as info:
        llm.generate("abc", banning("cab", "\U0001f642", max_tokens=3))
    assert (info.value.plugin, info.value.hook) == (PLUGIN, "register_logits_processors")
    assert llm.generate("abc", banning("cab", max_tokens=3))[0].outputs[0].token_ids  # the others are banned


# -- the processor alone: following the batch ---------------------------------------------------


@pytest.fixture(scope="module")
def ids():
    tokenizer = BannedWordsLogitsProcessor(SimpleNamespace(model=str(ensure_demo_model())), "cpu")._load_tokenizer()
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def new_processor():
    return BannedWordsLogitsProcessor(SimpleNamespace(model=str(ensure_demo_model())), torch.device("cpu"))


def banned_rows(processor, batch_size):
    """{row: the banned token ids} after apply on zeros."""
    logits = processor.apply(torch.zeros(batch_size, 2048))
    return {row: set(torch.nonzero(logits[row] == float("-inf")).flatten().tolist()) for row in range(batch_size)}


def added(row, output, *words):
    params = SamplingParams(extra_args={"banned_words": list(words)} if words else None)
    return (row, params, [2], output)


def test_one_token_words_are_always_banned_longer_ones_after_their_prefix(ids):
    processor = new_processor()
    output = []
    processor.update_state(BatchUpdate(2, added=[added(0, output, "module", "makes"), added(1, [])]))
    (module,), (space_module,) = ids("module"), ids(" module")
    ma, kes = ids(" makes")
    assert banned_rows(processor, 2) == {0: {module, space_module}, 1: set()}
    output.append(ma)  # the live list: the engine appends each generated token
    assert banned_rows(processor, 2) == {0: {module, space_module, kes}, 1: set()}
    output.append(kes + 1)
    assert banned_rows(processor, 2)[0] == {module, space_module}


def test_state_follows_rows_through_removed_moved_and_swapped(ids):
    processor = new_processor()
    (a,), (b,), (c,) = ids(" module"), ids(" plugin"), ids(" engine")
    processor.update_state(
        BatchUpdate(3, added=[added(0, [], " module"), added(1, [], " plugin"), added(2, [], " engine")])
    )
    assert banned_rows(processor, 3) == {0: {a}, 1: {b}, 2: {c}}
    processor.update_state(BatchUpdate(3, moved=[(0, 2, MoveDirectionality.SWAP)]))
    assert banned_rows(processor, 3) == {0: {c}, 1: {b}, 2: {a}}
    processor.update_state(BatchUpdate(2, removed=[1], moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    assert banned_rows(processor, 2) == {0: {c}, 1: {a}}
    # A request without the option takes row 0 (added before removed): nothing banned there any more.
    processor.update_state(BatchUpdate(2, added=[added(0, [])]))
    assert banned_rows(processor, 2) == {0: set(), 1: {a}}
    processor.update_state(BatchUpdate(1, removed=[1]))
    logits = torch.zeros(1, 2048)
    assert processor.apply(logits) is logits and not processor._rows  # nothing to do: untouched


class CountedReads(list):
    """A row's generated tokens that count how often a step reads them."""

    reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


def test_a_step_looks_only_at_the_words_the_last_token_may_complete_however_many_are_banned(ids):
    processor = new_processor()
    words = [f"zq{i}x" for i in range(MAX_WORDS - 1)] + ["makes"]  # the most a request may ban
    assert all(len(ids(" " + w)) > 1 for w in words)  # none of one token: each is looked for after its prefix
    ma, kes = ids(" makes")
    output = CountedReads(ids(" A plugin is a module"))
    processor.update_state(BatchUpdate(2, added=[added(0, output, *words), added(1, [])]))
    assert banned_rows(processor, 2) == {0: set(), 1: set()}  # " module" ends the prefix of no word
    assert output.reads <= 1  # the last token, once (it was once per word's prefix: 2000 reads, every step)

    output.append(ma)
    output.reads = 0
    assert banned_rows(processor, 2) == {0: {kes}, 1: set()}
    assert output.reads <= 3
    *prefix, last = ids(" zq517x")
    output.extend(prefix)
    assert banned_rows(processor, 2)[0] == {last}
