"""pluginhost-tokenize-endpoint: vLLM's ``POST /tokenize`` and ``POST /detokenize``, through ``register_routes``.

* ``/tokenize``: ``{"prompt": "text"}``, or ``{"messages": [...]}`` rendered
  by the model's chat template (as ``/v1/chat/completions`` does), gives
  ``{"tokens": [...], "count": n, "max_model_len": m}``: exactly the prompt
  tokens a completion (or chat completion) of the same input would use.
* ``/detokenize``: ``{"tokens": [...]}`` gives ``{"prompt": "text"}``.

Bad input is a 400 with OpenAI's error object, like every server route, and
both routes are behind the server's API key. Importing this module imports
neither FastAPI nor the tokenizer: the routes are built inside the hook.
"""

from pluginhost import hookimpl

__all__ = ["PATHS", "register_routes"]

#: The paths this plugin adds.
PATHS = ("/tokenize", "/detokenize")


@hookimpl
def register_routes(app, engine):
    from pluginhost_tokenize_endpoint.routes import add_routes

    add_routes(app, engine)
