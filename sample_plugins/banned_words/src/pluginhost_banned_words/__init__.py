"""pluginhost-banned-words: words a request asks never to be generated.

A batch-level logits processor (vLLM v1's interface), added through the
``register_logits_processors`` hook. A request opts in with
``SamplingParams(extra_args={"banned_words": ["foo", "bar baz"]})`` (on the
server: ``"extra_args": {"banned_words": [...]}`` in the request body). Each
word is tokenized as written and with a leading space; its last token is
banned whenever the tokens generated so far end with the tokens before it,
so a one-token word is never generated at all. Requests without the option
cost nothing.

Importing this module does not import torch: the processor lives in
``pluginhost_banned_words.processor``, imported inside the hook.
"""

from pluginhost import hookimpl

__all__ = ["OPTION", "register_logits_processors"]

#: The key in ``SamplingParams.extra_args``.
OPTION = "banned_words"


@hookimpl
def register_logits_processors(registry):
    from pluginhost_banned_words.processor import BannedWordsLogitsProcessor

    registry.add(BannedWordsLogitsProcessor)
