"""The pluginhost hook contract.

Every hook a plugin may implement is specified here, and each spec's docstring
is its contract: when the host calls it, what an implementation may change and
what it must not do. Argument names are part of the contract: an implementation
may accept any subset of a spec's arguments, by the same names, and none of
them may have a default value (pluggy would silently never pass it).

Build hooks run once per engine build, in this order::

    register_models(registry)            # collect architectures
    register_logits_processors(registry) # collect logits processors (with the registrations)
    modify_config(config)                # adjust the EngineConfig
    pre_load(config, model_class)        # inspect or refuse the resolved class
    post_load(config, model)             # wrap, patch or check the loaded model

Runtime hooks run while the engine serves::

    on_request(request)                  # each request, before it is scheduled
    on_output(request, output)           # each request, when it finishes
    record_stats(stats)                  # each engine step
    register_routes(app, engine)         # once, when `pluginhost serve` starts

Build hooks run in the thread that builds the engine; ``on_request`` in the
thread that prepares the request (the caller of ``LLM.generate``; for
``AsyncLLM.generate`` and the server, the engine's input thread beside the
event loop, one request at a time), so it should be quick; ``on_output`` and
``record_stats`` in the thread that steps the engine; logits processors
inside the engine step.

With tensor parallelism (``tensor_parallel_size`` N > 1) the engine is N
processes, and each loads its plugins itself. Every build hook runs on every
rank, each on its own rank's engine: ``post_load`` sees that rank's shard of
the model (``pluginhost.distributed.get_rank()`` says which). The runtime hooks
and logits processors run on rank 0 only, the process that schedules and
samples: requests, outputs and statistics exist there alone, and every rank
runs the same tokens, the ones rank 0 chose.

Within one hook, implementations run builtin first, then installed plugins in
alphabetical order of entry-point name, then in-process plugins in the order
given; a later implementation sees, and may override, what an earlier one did.
``tryfirst``/``trylast`` move an implementation to the front or the back, and
``wrapper=True`` generators wrap the others, as in pluggy.

This module must stay importable without torch or transformers: the listing
commands import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import torch
    from fastapi import FastAPI

    from pluginhost.config import EngineConfig
    from pluginhost.engine.async_llm import AsyncLLM
    from pluginhost.engine.core import EngineStats
    from pluginhost.engine.request import EngineRequest
    from pluginhost.logits_processors import LogitsProcessorRegistry
    from pluginhost.outputs import RequestOutput
    from pluginhost.registry import ArchitectureRegistry

__all__ = [
    "BUILD_HOOKS",
    "ENTRY_POINT_GROUP",
    "PROJECT_NAME",
    "hookimpl",
    "hookspec",
    "modify_config",
    "on_output",
    "on_request",
    "post_load",
    "pre_load",
    "record_stats",
    "register_logits_processors",
    "register_models",
    "register_routes",
]

#: The pluggy project name: markers of other projects are ignored.
PROJECT_NAME = "pluginhost"

#: Installed plugins are found through this entry-point group.
ENTRY_POINT_GROUP = "pluginhost.plugins"

#: The build hooks, in the order an engine build calls them (each once).
BUILD_HOOKS = ("register_models", "register_logits_processors", "modify_config", "pre_load", "post_load")

#: Marks a hook specification (used by this module only).
hookspec = pluggy.HookspecMarker(PROJECT_NAME)

#: Marks a hook implementation in a plugin: ``@hookimpl def register_models(registry): ...``
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_models(registry: ArchitectureRegistry) -> None:
    """Register model architectures.

    Called once per engine build, before the architecture is resolved, and by
    ``pluginhost models``. The builtin architectures are registered first, so
    registering an existing architecture name replaces it (the replacement is
    logged with both sources and shown by ``pluginhost models``).

    May: call ``registry.register_model(architecture, model)`` any number of
    times, where ``model`` is a class or a lazy ``"package.module:ClassName"``
    string that is imported only when that architecture is used.

    Must not: import torch or build anything (listing models must stay cheap;
    prefer the lazy string form), or keep the registry for later use.

    Example::

        @hookimpl
        def register_models(registry):
            registry.register_model("MyOPT", "my_plugin.model:MyOPT")
    """


@hookspec
def modify_config(config: EngineConfig) -> None:
    """Adjust the engine configuration.

    Called once per engine build, after the user's settings are applied and
    before the model directory is read or anything is resolved.

    May: assign fields of ``config`` (an ``EngineConfig``) in place. Every
    assignment is validated at once, and ``pluginhost config`` reports the
    field as set by ``plugin:NAME``. Assign whole values (``config.hf_overrides
    = {...}``) rather than mutating them, so provenance stays correct.

    Must not: replace the object, or raise unless the configuration must be
    refused (the build then stops with an error naming this plugin).

    Example::

        @hookimpl
        def modify_config(config):
            if config.max_model_len is None or config.max_model_len > 1024:
                config.max_model_len = 1024
    """


@hookspec
def pre_load(config: EngineConfig, model_class: type[torch.nn.Module]) -> None:
    """Inspect the resolved model class before any parameter is allocated.

    Called once per engine build, after ``config.json`` is read, overrides are
    applied and the architecture is resolved to ``model_class``, and before
    the model is constructed.

    May: inspect ``config`` and ``model_class``; adjust the settings the
    engine acts on later (``max_num_seqs``, ``max_model_len`` within the
    model's positions, ``seed``...: checked again afterwards); raise an
    exception to refuse the build (its message reaches the user, naming this
    plugin; a ``PermissionError`` reads as a refusal by policy, anything else
    as the plugin's failure).

    Must not: construct the model or allocate device memory; change a setting
    the engine has already acted on (``model``, ``model_architecture_override``,
    ``model_impl``, ``hf_overrides``, ``dtype``, ``device``,
    ``tensor_parallel_size``, ``allow_external_weights``): the build is refused,
    naming the plugin, since the engine would be built as before. Those are set
    in ``modify_config``.

    Example::

        @hookimpl
        def pre_load(config, model_class):
            if model_class.__name__ in {"UntrustedForCausalLM"}:
                raise RuntimeError(f"{model_class.__name__} is not allowed on this site")
    """


@hookspec
def post_load(config: EngineConfig, model: torch.nn.Module) -> None:
    """Wrap, patch or check the model after its weights are loaded.

    Called once per engine build, after every weight is loaded and the model
    is in eval mode on its device, before the first forward pass.

    May: patch ``model`` in place (register forward hooks, replace
    submodules, check parameters); raise to refuse the model. Settings are
    as in ``pre_load``: those the build has acted on (there, and now
    ``refuse_nonfinite_weights``) are refused if changed.

    Must not: replace the object (the engine keeps the one it built), move it
    to another device, or change the dtype it computes in (the last two are
    refused, naming the plugin, as a ``ConfigError``; storing weights
    differently, as a quantizer does, is fine: activations, outputs and the KV
    cache stay in the engine's dtype). With tensor parallelism it runs on every
    rank with that rank's shard, and a change must give every rank the same
    outputs as the others expect (patch every rank alike).

    Example::

        @hookimpl
        def post_load(config, model):
            n = sum(p.numel() for p in model.parameters())
            print(f"{type(model).__name__}: {n / 1e6:.1f}M parameters")
    """


@hookspec
def register_logits_processors(registry: LogitsProcessorRegistry) -> None:
    """Add batch-level logits processors (vLLM v1's interface).

    Called once per engine build, right after ``register_models``. Each
    class added is instantiated once per engine, ``cls(config, device)`` (a
    third ``is_pin_memory`` parameter, as vLLM's take, gets ``False``), after
    the model is loaded. Every engine step it then sees how the batch changed
    (``update_state``) and may change the step's (batch, vocab) logits
    (``apply``), before penalties and sampling; processors whose
    ``is_argmax_invariant()`` is true are skipped when every request in the
    batch decodes greedily. ``validate_params(params)`` is called for each new
    request and may refuse it with ``ValueError``. Per-request options come in
    ``SamplingParams.extra_args`` (the server's ``extra_args`` field).

    May: call ``registry.add(cls)`` with subclasses of
    ``pluginhost.logits_processors.LogitsProcessor``.

    Must not: import torch here when it can be avoided (prefer importing the
    class inside the hook), or keep per-request state outside the processor.
    A ``ValueError`` from ``update_state`` for a request joining the batch
    refuses that request, as from ``validate_params`` (what only the
    processor's state can judge: a word its tokenizer cannot spell). Any
    other exception ends the requests it was processing (all those of
    the step, for ``apply``), with an error naming the plugin; it is then
    rebuilt for the requests still running. One that leaves a request's row
    no token to choose (every logit -inf, or a NaN) ends that request alone,
    with an error naming the plugin; the others of the step go on: the step
    runs again without it, so their ``apply`` (and an adapter's per-request
    functions) is called a second time for the same token, which vLLM, which
    has no such recovery, never does.

    Example::

        @hookimpl
        def register_logits_processors(registry):
            from my_plugin.processors import BannedWords

            registry.add(BannedWords)
    """


# -- runtime hooks ----------------------------------------------------------------------------


@hookspec
def on_request(request: EngineRequest) -> None:
    """See, change or refuse a request before it is scheduled.

    Called for each request (each prompt of ``LLM.generate``, each prompt of
    an HTTP request), in the thread that prepares it (see above), after its
    prompt is tokenized and before its parameters are checked and it is queued.
    ``request`` has ``request_id``, ``prompt``, ``prompt_token_ids`` and
    ``params`` (its own ``SamplingParams``). ``prompt`` is the text of the ids
    that run: the text given, or, for a prompt dict giving ids and text (the
    server's chat prompts), the text given if the ids are its tokens, else
    what they decode to; ``None`` for token ids alone.

    May: change ``request.params``, ``request.prompt_token_ids`` or
    ``request.prompt`` in place (once every ``on_request`` hook has run, a
    changed ``prompt`` is tokenized again, and ids changed with it must be
    its tokens, else the request fails naming the plugin; ids changed alone
    take the text they decode to); raise ``ValueError`` to refuse the
    request, or ``PermissionError`` to refuse it by policy (either way the
    caller gets a ``RequestRefusedError``, a ``ValueError``, and the server a
    400, naming this plugin; the engine and the server go on).

    Must not: block for long (requests are prepared one at a time, so the
    server's next request waits for it), or keep the request. Any other
    exception also refuses the request, as this plugin's failure.

    Example::

        @hookimpl
        def on_request(request):
            if len(request.prompt_token_ids) > 2000:
                raise ValueError("prompts are limited to 2000 tokens on this site")
    """


@hookspec
def on_output(request: EngineRequest, output: RequestOutput) -> None:
    """Change a request's final output before it is returned.

    Called for each request when all its samples have finished (not for
    aborted or failed ones), in the thread that steps the engine, before the
    output reaches the caller (``LLM.generate``'s result, the last streamed
    output, the server's answer).

    May: change ``output`` in place (``output.outputs[i].text``, for example;
    its lists are its own, but each token's ``logprobs`` dict is read-only:
    put a new dict in its place).

    Must not: block for long (the engine waits), replace the object, or
    change a sample's ``token_ids`` without its ``logprobs`` (one per token;
    an uneven pair ends the request with an error naming the plugin). When
    the request was streamed, the text already sent cannot be taken back:
    the change shows in the final output, and the server's stream sends
    what follows the text it sent, as the changed text has it; while an
    ``on_output`` implementation is loaded, no sample of a streamed request
    shows a ``finish_reason`` before the whole request has ended (its stream
    ends each choice once this hook has run). An exception
    ends this request with an error naming the plugin; other requests are
    not affected. A ``PermissionError`` withholds the output by policy (a
    content filter): the request is refused, a ``RequestRefusedError`` (the
    server's 400), not a fault of the plugin's.

    Example::

        @hookimpl
        def on_output(request, output):
            for sample in output.outputs:
                if sample.text is not None:
                    sample.text = sample.text.replace("secret", "******")
    """


@hookspec
def record_stats(stats: EngineStats) -> None:
    """Read the figures of one engine step.

    Called once per engine step, in the thread that steps the engine, with
    ``num_running``, ``num_waiting``, ``num_generated_tokens``,
    ``num_prompt_tokens``, ``num_finished``, ``step_time_s``,
    ``cache_shape``, ``num_preempted`` (sequences preempted for memory
    since the last call) and ``token_gaps_s`` (for each sequence given a
    token after its first, the seconds since its previous one: vLLM's
    inter-token latencies).

    May: read ``stats`` and record it (a log line, a metric).

    Must not: block (every step waits for it) or change anything. An
    exception is logged once, naming the plugin, and this plugin's
    ``record_stats`` is not called again by that engine; the others still
    see that step. A step that fails (the
    model raised, a processor failed) has no statistics and no call.

    Example::

        @hookimpl
        def record_stats(stats):
            if stats.num_waiting > 100:
                print(f"queue building up: {stats.num_waiting} waiting")
    """


@hookspec
def register_routes(app: FastAPI, engine: AsyncLLM) -> None:
    """Add HTTP routes to the server.

    Called once, when ``pluginhost serve`` starts, after the builtin routes
    exist and before the server listens. ``app`` is the FastAPI application;
    ``engine`` the ``AsyncLLM`` it serves (``engine.generate``,
    ``engine.get_tokenizer()``, ``engine.config``). Routes added here are
    behind the same API key as the builtin ones.

    May: add routes (``@app.get(...)``, ``app.add_api_route``, routers).

    Must not: take a builtin path (``/health``, ``/v1/models``,
    ``/v1/models/{model}``, ``/v1/completions``, ``/v1/chat/completions``,
    ``/metrics``), also through a path parameter or a mount that would
    answer it, or another plugin's path: ``serve`` then stops at start with
    an error naming the plugin. Routes below a model's path
    (``/v1/models/{name}/info``) are the plugin's to add. Each
    implementation is called on its own, so its routes are known to be its
    own: ``wrapper=True`` implementations of this hook are not called (a
    warning says so).

    Example::

        @hookimpl
        def register_routes(app, engine):
            @app.get("/v1/plugin/hello")
            async def hello():
                return {"model": engine.config.model}
    """
