"""The subcommands: ``plugins``, ``models``, ``config``, ``generate`` and ``serve``.

Each takes the parsed arguments and returns an exit status; errors are raised
and turned into exit statuses by ``pluginhost.cli.main``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pluginhost.cli import EXIT_OK, UsageError, engine_settings, make_host
from pluginhost.cli.output import ResultStream
from pluginhost.cli.tables import format_table
from pluginhost.distributed import launched_world_size, torchrun_rank
from pluginhost.errors import InvalidParameterError, PluginhostError

if TYPE_CHECKING:
    import socket

    from pluginhost.config import EngineConfig

__all__ = ["generate", "list_models", "list_plugins", "serve", "show_config"]


def _print_json(out: ResultStream, data: Any) -> None:
    out.print(json.dumps(data, indent=2, default=str))


def list_plugins(args: argparse.Namespace, out: ResultStream) -> int:
    host = make_host(args)
    host.load(strict=False)
    host.collect_models(strict=False)  # a plugin whose register_models raises shows as failed
    records = host.records
    if args.json:
        _print_json(out, [r.as_dict() for r in records])
        return EXIT_OK
    rows = [
        [
            r.name,
            r.status,
            r.distribution or "-",
            r.version or "-",
            ",".join(r.hooks) or "-",
            f"{r.import_seconds * 1000:.0f} ms" if r.import_seconds is not None else "-",
            r.reason or "",
        ]
        for r in records
    ]
    out.print(format_table(["NAME", "STATUS", "DISTRIBUTION", "VERSION", "HOOKS", "IMPORT", "REASON"], rows))
    return EXIT_OK


#: What the fallback's row says it serves, when ``--fallback`` does not list the architectures.
FALLBACK_SERVES = (
    "every causal-LM architecture transformers can build that no registered model covers (model_impl 'auto', "
    "the default), and any architecture with model_impl 'transformers'; `pluginhost models --fallback` lists them"
)


def list_models(args: argparse.Namespace, out: ResultStream) -> int:
    from pluginhost.registry import TRANSFORMERS_FALLBACK

    host = make_host(args)
    host.load(strict=False)
    registry = host.collect_models(strict=False)
    entries = sorted(registry.entries(), key=lambda e: e.architecture)
    serves: str | list[str] = FALLBACK_SERVES
    if args.fallback:
        from pluginhost.build import transformers_causal_lms  # imports transformers and torch: only when asked

        serves = sorted(transformers_causal_lms() - {e.architecture for e in entries})
    if args.json:
        rows = []
        for e in entries:
            row = {
                "architecture": e.architecture,
                "implementation": e.implementation,
                "registered_by": e.registered_by.name,
                "distribution": e.registered_by.distribution,
                "version": e.registered_by.version,
                "overrides": [
                    {"implementation": o.implementation, "registered_by": o.registered_by.name} for o in e.overrides
                ],
            }
            if e.architecture == TRANSFORMERS_FALLBACK:
                row["serves"] = serves
            rows.append(row)
        _print_json(out, rows)
    else:
        rows = [
            [
                e.architecture,
                e.implementation,
                e.registered_by.name,
                ", ".join(f"{o.implementation} ({o.registered_by.name})" for o in e.overrides) or "-",
            ]
            for e in entries
        ]
        out.print(format_table(["ARCHITECTURE", "IMPLEMENTATION", "REGISTERED BY", "OVERRIDES"], rows))
        if any(e.architecture == TRANSFORMERS_FALLBACK for e in entries):
            if isinstance(serves, str):
                out.print(f"\n{TRANSFORMERS_FALLBACK} serves {serves}.")
            else:
                out.print(f"\n{TRANSFORMERS_FALLBACK} serves these {len(serves)} architectures transformers can build:")
                out.print("\n".join(f"  {name}" for name in serves))
    failed = [r for r in host.records if r.status == "failed"]
    if failed:  # on stderr, so --json stays valid JSON and a script still learns of it
        print(f"\n{len(failed)} plugin(s) failed to load; see `pluginhost plugins`.", file=sys.stderr)
    return EXIT_OK


def _settings_or_demo(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """The engine settings given on the command line, with the demo model's path when ``--model`` is not.

    The flag says whether the demo model was filled in: ``config`` then reports the model as set by
    ``default`` (no one chose it), and ``serve`` serves it as ``demo``.
    """
    settings = engine_settings(args)
    if "model" in settings:
        return settings, False
    from pluginhost.demo import ensure_demo_model

    return {**settings, "model": str(ensure_demo_model())}, True


def _engine_config(settings: dict[str, Any]) -> EngineConfig:
    """The ``EngineConfig`` of ``settings``, or one ``UsageError`` naming the flags at fault.

    ``Invalid engine settings: --max-num-seqs: Input should be greater than 0 (got 0)``: the engine's
    words with the flags for its field names, not pydantic's report. Commands call it before anything
    takes the values as valid: to ``pathlib``, an empty model path is the current directory.
    """
    from pydantic import ValidationError

    from pluginhost.config import EngineConfig, describe_validation_error

    try:
        return EngineConfig(**settings)
    except ValidationError as exc:
        problems = describe_validation_error(exc)  # "field: message; field.key: message"
        flags = re.sub(r"(^|; )(\w+)(?=[.:])", lambda m: m[1] + _flag(m[2]) if m[2] in settings else m[0], problems)
        raise UsageError(f"Invalid engine settings: {flags}") from None


def _flag(field: str) -> str:
    """The command-line flag that sets an ``EngineConfig`` field (or a ``SamplingParams`` one)."""
    return "--" + field.replace("_", "-")


#: ``generate``'s sampling where neither its flags nor (``--generation-config auto``) the model's
#: ``generation_config.json`` say otherwise: greedy, 16 tokens.
GENERATE_DEFAULTS: dict[str, Any] = {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0}


def _sampling_params(fields: dict[str, Any]):  # -> SamplingParams
    """``SamplingParams(**fields)``, refused in the flags' words: "--top-p must be in (0, 1]"."""
    from pluginhost.sampling import SamplingParams

    try:
        return SamplingParams(**fields)
    except InvalidParameterError as exc:
        flag = _flag(exc.param)
        message = str(exc).removeprefix("SamplingParams: ").replace(" (or None)", "")  # a flag cannot be None
        raise UsageError(re.sub(rf"\b{exc.param}\b", flag, message)) from None


def show_config(args: argparse.Namespace, out: ResultStream) -> int:
    from pluginhost.build import plan_build

    settings, demo = _settings_or_demo(args)
    config = _engine_config(settings)
    host = make_host(args)
    plan = plan_build(config, host)
    from pluginhost.engine.loader import settle_for_pre_load

    settle_for_pre_load(plan, host)  # device, dtype, and what pre_load hooks change: the settings the engine runs
    provenance = plan.config.provenance
    if demo and provenance["model"] == "user":  # the CLI passed the demo model's path; nobody chose it
        provenance["model"] = "default"
    data = {
        "config": plan.config.model_dump(mode="json"),
        "provenance": provenance,
        **plan.describe(),
    }
    if args.json:
        _print_json(out, data)
        return EXIT_OK
    rows = [[name, json.dumps(value), data["provenance"][name]] for name, value in data["config"].items()]
    out.print(format_table(["FIELD", "VALUE", "SET BY"], rows))
    out.print(
        f"\narchitecture: {data['architecture']} -> {data['implementation']} (registered by {data['registered_by']})"
    )
    return EXIT_OK


def generate(args: argparse.Namespace, out: ResultStream) -> int:
    for number, prompt in enumerate(args.prompt, 1):
        _check_utf8(prompt, f"--prompt {number}")
    settings, _ = _settings_or_demo(args)
    # Its flags are the sampling parameters (greedy unless they say otherwise): the model's recommended ones
    # (generation_config.json) are not read unless asked for, and then fill what the flags leave out.
    settings.setdefault("generation_config", "vllm")
    _engine_config(settings)  # first: the checks below take the values as valid
    _check_tokenizer(settings["model"])
    names = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    params = _sampling_params(GENERATE_DEFAULTS | given)  # the flags' mistakes before the model loads
    host = make_host(args)
    _import_torch()
    from pluginhost.engine import LLM
    from pluginhost.engine.memory import keep_freed_memory

    keep_freed_memory()  # this process is the engine's

    _check_launcher(settings)
    llm = LLM._from_host(host, **settings)
    if llm.rank != 0:  # a torchrun rank: it served rank 0's steps until rank 0 was done
        return EXIT_OK
    recommended = llm.sampling_defaults  # SamplingParams fields, as vLLM's get_default_sampling_params takes them
    if recommended:  # generation_config "auto": the file's recommendations, the flags typed over them
        params = _sampling_params(GENERATE_DEFAULTS | recommended | given)
    try:
        outputs = llm.generate(list(args.prompt), params, use_tqdm=False)
    except (PluginhostError, ValueError) as exc:
        message = _counted_from_1(str(exc))
        if message == str(exc):
            raise
        raise UsageError(message) from exc
    finally:
        llm.close()  # the other ranks of a tensor-parallel engine end with it
    if args.json:
        _print_json(
            out,
            [
                {
                    "prompt": prompt,
                    "text": result.text,
                    "token_ids": result.token_ids,
                    "prompt_token_ids": result.prompt_token_ids,
                    "finish_reason": result.finish_reason,
                }
                for prompt, result in zip(args.prompt, outputs, strict=True)
            ],
        )
        return EXIT_OK
    for prompt, result in zip(args.prompt, outputs, strict=True):
        out.print(f"prompt: {prompt!r}")
        out.print(f"output: {result.text!r}")
        out.print(f"tokens: {result.token_ids} ({result.finish_reason})\n")
    return EXIT_OK


def _counted_from_1(message: str) -> str:
    """An engine message in the CLI's words: the engine counts prompts from 0, ``--prompt`` from 1.

    The engine starts a message about one prompt with ``prompt N``, also when it wraps
    another such message (``prompt 0 became invalid in the on_request hook of ...: prompt 0 has ...``).
    """
    # The engine's own wording only ("prompt 3 has ..."): a plugin's refusal may say "prompt 4096 tokens".
    engine = r"(^|: )prompt (\d+) (?=is |has |became |asks |encodes |must )"
    return re.sub(engine, lambda m: f"{m[1]}--prompt {int(m[2]) + 1} ", message)


def _check_launcher(settings: dict[str, Any]) -> None:
    # Under torchrun every process runs this command: without tensor parallelism each would
    # build a whole engine, print the same output (or take the same port).
    launched = launched_world_size()
    if launched is not None and launched > 1 and settings.get("tensor_parallel_size", 1) != launched:
        raise UsageError(
            f"torchrun started {launched} processes, but --tensor-parallel-size is "
            f"{settings.get('tensor_parallel_size', 1)}: pass --tensor-parallel-size {launched}"
        )


def _check_utf8(text: str, what: str) -> None:
    # Python decodes undecodable argv bytes to lone surrogates; they would fail deep in the tokenizer.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        byte = ord(text[exc.start]) - 0xDC00  # surrogateescape keeps the byte in U+DC80..U+DCFF
        raise UsageError(
            f"{what} is not valid UTF-8 (byte 0x{byte:02x} at character {exc.start}); "
            "pass the prompt as UTF-8 text, or check the terminal's or script's encoding"
        ) from None


def _check_tokenizer(model: str) -> None:
    """Before anything loads: ``--prompt`` is text, so the model directory needs a tokenizer.

    A directory that is no model directory at all (no config.json) is told so first, as the engine would. A
    ``model`` that is no directory is left to the engine: a plugin's ``modify_config`` may name the directory.
    """
    from pathlib import Path

    from pluginhost.model_dir import model_directory, read_config_json
    from pluginhost.tokenizer import TOKENIZER_FILES, has_tokenizer_files

    if not Path(model).is_dir():
        return
    model_dir = model_directory(model)
    read_config_json(model_dir)
    if not has_tokenizer_files(model_dir):
        files = f"{', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]}"
        raise UsageError(
            f"{model} has no tokenizer files ({files}), and --prompt is text: copy the tokenizer's files into it, "
            "or generate from token ids with the Python API (LLM.generate)"
        )


def _import_torch() -> None:
    """Import torch with SIGINT and SIGTERM held back until it is imported, then acted on as they would have been.

    torch imports numpy from C (``from torch._C import *``): an exception a signal's handler raises in there
    (Ctrl-C's ``KeyboardInterrupt``, ``serve``'s ``_StoppedBeforeServing``) is swallowed, so the signal is lost
    and the command goes on (a server serving), or it leaves numpy half-imported, so a later step fails with an
    error blaming the model or an internal one. ``generate`` and ``serve`` call this before anything imports torch.
    """
    with _signals_held():
        import torch  # noqa: F401


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Meanwhile SIGINT and SIGTERM are only noted; the first one is raised again once their handlers are back.

    An ignored signal stays ignored; off the main thread (where no handler can be set) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def note(signum: int, frame: object) -> None:
        received.append(signum)

    with contextlib.ExitStack() as handlers:  # every handler is put back, even if a signal interrupts that
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) not in (signal.SIG_IGN, None):  # None: a handler not set from Python
                handlers.callback(signal.signal, signum, signal.signal(signum, note))
        yield
    if received:
        signal.raise_signal(received[0])  # its own handler's doing now: an exception, or the default (an exit)


class _StoppedBeforeServing(KeyboardInterrupt):
    """SIGTERM while the server is starting: raised in the main thread, and handled as Ctrl-C is there.

    A ``KeyboardInterrupt``, so that every step of the start (plugins' imports, a build the main thread waits
    for) lets it through and leaves nothing behind, as it does Ctrl-C.
    """


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise _StoppedBeforeServing


def _own_names(sock: socket.socket, host: str, allowed: list[str]) -> set[str] | None:
    """The names a server on ``sock`` (bound to ``host``, as typed) answers to: on a loopback address, its own
    and ``allowed`` (``--allowed-host``; a DNS-rebinding page names another), else any (``None``: reached from
    other machines, by names only the operator knows). The address bound decides, not the name typed
    (``--host 127.1``, or this machine's name resolving to 127.0.0.1, is loopback too)."""
    from pluginhost.server.run import is_loopback

    address = sock.getsockname()[0]
    return {"localhost", "127.0.0.1", "::1", host, address, *allowed} if is_loopback(address) else None


def _api_key(flag: str | None) -> str | None:
    """The key ``serve`` requires: ``--api-key``, else ``$PLUGINHOST_API_KEY``, else none.

    The key is stripped: a secret file's trailing newline would make it a key no client can send (HTTP strips
    the spaces around a header's value). A blank one, from an unset shell variable or a secret not filled in,
    is refused: it would serve without a key, and say nothing.
    """
    source, key = (
        ("--api-key", flag) if flag is not None else ("$PLUGINHOST_API_KEY", os.environ.get("PLUGINHOST_API_KEY"))
    )
    if key is None:
        return None
    if not key.strip():
        raise UsageError(
            f"{source} is empty (an unset shell variable?), which would serve without a key: give the key, or "
            f"leave {source} out to serve without one"
        )
    return key.strip()


def serve(args: argparse.Namespace, out: ResultStream) -> int:
    """``pluginhost serve``: load the model, then serve it until SIGINT or SIGTERM, and exit 0 either way.

    A signal while the model still loads ends the command too, as documented, with exit status 0 and one
    line saying the server stopped before it served (SIGTERM killed it silently, status -15).
    """
    import signal

    if torchrun_rank() not in (None, 0):  # it serves rank 0's steps, not HTTP: signals as for any command
        _start_serving(args)
        return EXIT_OK
    # Until the server takes the signals over, once it listens (and after it has given them back).
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    started = None
    try:
        started = _start_serving(args)
        assert started is not None  # only a torchrun rank other than 0 serves no HTTP
        from pluginhost.server.run import run_server

        app, engine, sock, keywords = started
        run_server(app, engine, sock, **keywords)
    except KeyboardInterrupt as stop:
        name = "SIGTERM" if isinstance(stop, _StoppedBeforeServing) else "SIGINT"
        when = "before serving (the model was still loading)" if started is None else "as the server started or ended"
        print(f"pluginhost: stopped by {name} {when}", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return EXIT_OK


def _start_serving(args: argparse.Namespace) -> tuple[Any, Any, Any, dict[str, Any]] | None:
    """All ``serve`` does before serving: ``run_server``'s arguments (app, engine, socket, keywords).

    ``None`` on a torchrun rank other than 0, which has served rank 0's steps by then.
    """
    from pathlib import Path

    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            f"pluginhost serve needs FastAPI, uvicorn and prometheus_client ({exc.name} is missing): "
            "pip install 'pluginhost[serve]'"
        ) from None
    _import_torch()
    from pluginhost.server.run import bind

    settings, demo = _settings_or_demo(args)
    _engine_config(settings)  # before the port is taken and the served name read from the path
    served = args.served_model_name or ("demo" if demo else Path(settings["model"]).resolve().name)
    api_key = _api_key(args.api_key)
    if not 0 <= args.shutdown_timeout < float("inf"):  # NaN fails too
        raise UsageError(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}")
    _check_launcher(settings)
    from pluginhost.engine.memory import keep_freed_memory

    keep_freed_memory()  # this process is the engine's
    if torchrun_rank() not in (None, 0):  # a torchrun rank other than 0 runs steps; rank 0 serves
        from pluginhost.engine.async_llm import AsyncLLM

        AsyncLLM._from_host(make_host(args), **settings)  # returns when rank 0's engine closes
        return None
    sock = bind(args.host, args.port)  # a busy port fails before the model loads
    engine = None
    try:
        from pluginhost.engine.async_llm import AsyncLLM
        from pluginhost.server.app import build_app

        engine = AsyncLLM._from_host(make_host(args), **settings)
        allowed = _own_names(sock, args.host, args.allowed_host)
        app = build_app(engine, served_model_name=served, api_key=api_key, allowed_hosts=allowed)
    except BaseException:
        sock.close()
        # Built, but not to be served (a plugin's route refused): stop it before the command's exit, which does
        # not wait for its threads, cuts a tensor-parallel engine's ranks off mid-conversation (their tracebacks,
        # leaked semaphores).
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - the refusal is what the user must see, not this
                logging.getLogger("pluginhost").debug("shutting the refused engine down failed", exc_info=True)
        raise
    keywords = {"served_model_name": served, "shutdown_timeout": args.shutdown_timeout}
    return app, engine, sock, {**keywords, "requires_key": api_key is not None}
