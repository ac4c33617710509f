"""pluginhost-banned-words: words a request asks never to be generated.

A batch-level logits processor (vLLM v1's interface), added through the
``register_logits_processors`` hook. A request opts in with
``SamplingParams(extra_args={"banned_words": ["foo", "bar baz"]})`` (on the
server: ``"extra_args": {"banned_words": [...]}`` in the request body). Each
word is tokenized as written and with a leading space; its last token is
banned whenever the tokens generated so far end with the tokens before it,
so a one-token word is never generated at all. Requests without the option
cost nothing. A request may ban at most ``MAX_WORDS`` words of at most
``MAX_WORD_CHARS`` characters each.

Importing this module does not import torch: the processor lives in
``pluginhost_banned_words.processor``, imported inside the hook.
"""

from pluginhost import hookimpl

__all__ = ["MAX_WORDS", "MAX_WORD_CHARS", "OPTION", "register_logits_processors"]

#: The key in ``SamplingParams.extra_args``.
OPTION = "banned_words"

#: The most words one request may ban, and the most characters of one. The words are tokenized when the
#: request joins the batch, in the engine loop that serves every request, and each step looks at the
#: ones its last token may complete: 100,000 words (1.2 MB of JSON) made each step of the whole batch
#: 64 ms slower, and the other requests 4 to 10 times slower. (The engine caps stop strings at 64 for
#: the same reason.)
MAX_WORDS = 1024
MAX_WORD_CHARS = 64


@hookimpl
def register_logits_processors(registry):
    from pluginhost_banned_words.processor import BannedWordsLogitsProcessor

    registry.add(BannedWordsLogitsProcessor)
