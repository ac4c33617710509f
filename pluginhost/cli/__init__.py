"""The ``pluginhost`` command line.

Exit status: 0 on success; 2 on bad input or a plugin or model error (one
message on stderr, the traceback only with ``--debug``); 1 on an internal
failure. ``plugins``, ``models`` and ``--help`` import neither torch nor
transformers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import IO, Any

from pluginhost.errors import PluginhostError

__all__ = ["main", "run"]

EXIT_OK, EXIT_INTERNAL, EXIT_USER = 0, 1, 2


class UsageError(PluginhostError):
    """A bad command-line value."""


class _Parser(argparse.ArgumentParser):
    """A parser whose ``--help`` and ``--version`` fail as a command's output does when stdout cannot be written.

    argparse ignores the error (``pluginhost --version > /dev/full`` exited 0, having written nothing); here it
    is an ``OutputError``, which ``main`` reports as it does any command's: one message, exit status 2.
    """

    def _print_message(self, message: str, file: IO[str] | None = None) -> None:
        if not message or file is not sys.stdout:  # usage errors, to stderr: as argparse writes them
            super()._print_message(message, file)
            return
        from pluginhost.cli.output import ResultStream

        try:
            fd = sys.stdout.fileno()
        except (AttributeError, OSError, ValueError):  # a test harness's capture; or None: stdout was closed
            out = ResultStream(stream=sys.stdout)
        else:  # below Python's buffer, which would fail again at exit
            out = ResultStream(fd=fd, encoding=sys.stdout.encoding or "utf-8")
        out.print(message.removesuffix("\n"))


class _CommandParser(_Parser):
    """A subcommand's parser: an argument it does not know is its own usage error.

    argparse hands such arguments back to the top-level parser, whose usage
    (``pluginhost [-h] [--version] COMMAND ...``) shows none of the subcommand's options;
    and nothing after the subcommand's name is for the top-level parser anyway.
    """

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _add_selection_options(parser: argparse.ArgumentParser) -> None:
    """Add the plugin selection and output options to a command's ``parser``.

    Added to each, not copied from a ``parents=`` parser: argparse (3.11's at least) copies a mutually exclusive
    group out of the argument group holding it, so ``--help`` listed ``--plugins`` and ``--no-plugins`` under
    "options:", apart from the rest of the plugin selection.
    """
    group = parser.add_argument_group("plugin selection (overrides PLUGINHOST_PLUGINS / PLUGINHOST_DISABLED_PLUGINS)")
    which = group.add_mutually_exclusive_group()  # "only these" and "none": one or the other
    which.add_argument(
        "--plugins", metavar="A,B", help="load only these installed plugins (entry-point or distribution names)"
    )
    which.add_argument("--no-plugins", action="store_true", help="load no installed plugin (builtins still load)")
    group.add_argument(
        "--disable-plugin", metavar="NAME", action="append", default=[], help="never load this plugin (repeatable)"
    )
    out = parser.add_argument_group("output")
    out.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    out.add_argument("-v", "--verbose", action="store_true", help="show informational logging")


def _engine_options(*, model_required: bool) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("engine configuration")
    group.add_argument(
        "--model",
        metavar="DIR",
        required=model_required,
        help="Hugging Face-format model directory" + ("" if model_required else " (default: the demo model)"),
    )
    group.add_argument(
        "--dtype",
        choices=["auto", "float32", "float16", "bfloat16", "half", "float"],
        help="parameter dtype (default auto: config.json's, but float32 on a CPU for a float16 checkpoint, and for a "
        "bfloat16 one where the CPU has no bfloat16 arithmetic: AMX or AVX512-BF16)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "bfloat16"],
        help="the KV cache's dtype (default auto: the model's); bfloat16 halves a float32 model's cache and what "
        "decoding reads of it, keys and values rounded to bfloat16",
    )
    group.add_argument("--device", metavar="D", help="auto, cpu, cuda or cuda:N")
    group.add_argument("--max-model-len", type=int, metavar="N")
    group.add_argument("--max-num-seqs", type=int, metavar="N", help="most sequences running together (default 32)")
    group.add_argument(
        "--max-waiting-seqs",
        type=int,
        metavar="N",
        help="most sequences a server queues beyond the batch's free rows; beyond, 503 (default 1024)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="split the model over N processes on this machine (under torchrun: its world size)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        help="prompt tokens a step prefills; a longer prompt is prefilled in pieces of N (default 2048)",
    )
    group.add_argument(
        "--max-logprobs",
        type=int,
        metavar="N",
        help="most log-probabilities a request may ask for (default 20; -1: the whole vocabulary, a request's -1)",
    )
    group.add_argument("--seed", type=int, metavar="S")
    group.add_argument(
        "--compile-decode",
        action="store_true",
        default=None,
        help="compile the decoding step (torch.compile; CUDA graphs on a GPU): each new batch-size bucket "
        "and KV-cache length compiles at its first step",
    )
    group.add_argument("--model-architecture-override", metavar="ARCH", help="build this registered architecture")
    group.add_argument(
        "--model-impl",
        choices=["auto", "native", "transformers"],
        help="auto (default): the registered model, else the transformers fallback; native; transformers",
    )
    group.add_argument(
        "--hf-overrides", metavar="JSON", help="JSON object set on the HF config, e.g. '{\"dropout\": 0}'"
    )
    group.add_argument(
        "--allow-external-weights",
        action="store_true",
        default=None,
        help="read weight files an index or a link places outside the model directory (if you trust where they are)",
    )
    group.add_argument(
        "--generation-config",
        choices=["auto", "vllm"],
        help="default sampling parameters: auto (default, but for generate), those the model's "
        "generation_config.json recommends, as vLLM; vllm, SamplingParams' own (generate: its flags' defaults)",
    )
    group.add_argument(
        "--refuse-nonfinite-weights",
        action="store_true",
        default=None,
        help="refuse a checkpoint holding inf or nan weights (by default: a warning naming them)",
    )
    return parent


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pluginhost",
        description="An LLM inference engine extended by installed plugins (pluggy hooks).",
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)

    gen = commands.add_parser(
        "generate",
        parents=[_engine_options(model_required=False)],
        help="generate text (on the demo model unless --model is given)",
        description=(
            "Generate text. Without --model, runs on the small demo model shipped with pluginhost, "
            "which knows only pluginhost's own docs."
        ),
    )
    _add_selection_options(gen)
    gen.add_argument("--prompt", action="append", required=True, metavar="TEXT", help="a prompt (repeatable)")
    # None: not given (--generation-config auto fills it from the model's recommendations, else GENERATE_DEFAULTS).
    gen.add_argument(
        "--max-tokens", type=int, metavar="N", help="16 unless given (--generation-config auto: max_new_tokens if set)"
    )
    gen.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (the default)")
    gen.add_argument("--top-p", type=float, metavar="P", help="1.0 unless given")
    gen.add_argument("--top-k", type=int, metavar="K", help="0 = off (the default)")
    gen.add_argument("--ignore-eos", action="store_true", default=None)
    gen.add_argument("--json", action="store_true", help="print a JSON list, one object per prompt")

    serve = commands.add_parser(
        "serve",
        parents=[_engine_options(model_required=False)],
        help="serve the OpenAI-compatible HTTP API (on the demo model unless --model is given)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
        "Stops cleanly on Ctrl-C or SIGTERM.",
    )
    serve.add_argument(
        "model_dir",
        nargs="?",
        metavar="MODEL",
        help="the model directory, as `vllm serve MODEL` takes it (the same as --model DIR)",
    )
    _add_selection_options(serve)
    net = serve.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    net.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    net.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="on a loopback address, also answer requests naming NAME in their Host header (a proxy on this "
        "machine passing its own name); repeatable. Others are refused: a web page rebound to 127.0.0.1 names its own",
    )
    net.add_argument(
        "--served-model-name", metavar="NAME", help="the model's name in the API (default: the model directory's name)"
    )
    net.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route (default: $PLUGINHOST_API_KEY, else none)",
    )
    net.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="on Ctrl-C or SIGTERM, seconds requests in flight get to end before they are aborted (default 10)",
    )

    plugins = commands.add_parser("plugins", help="list plugins and their status")
    _add_selection_options(plugins)
    plugins.add_argument("--json", action="store_true")
    models = commands.add_parser("models", help="list architectures and who registered them")
    _add_selection_options(models)
    models.add_argument("--json", action="store_true")
    models.add_argument(
        "--fallback",
        action="store_true",
        help="list the architectures the transformers fallback (TransformersForCausalLM) would serve: those "
        "transformers can build that no registered model covers (imports transformers and torch)",
    )
    config = commands.add_parser(
        "config",
        parents=[_engine_options(model_required=False)],
        help="show the final engine configuration and who set each field (of the demo model unless --model is given)",
    )
    _add_selection_options(config)
    config.add_argument("--json", action="store_true")
    return parser


def _version() -> str:
    from pluginhost import __version__

    return f"pluginhost {__version__}"


def _configure_logging(args: argparse.Namespace) -> None:
    level = logging.DEBUG if args.debug else logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="pluginhost: %(levelname)s: %(message)s", stream=sys.stderr)


#: The ``EngineConfig`` fields a flag sets, each by its name's flag (``max_model_len``: ``--max-model-len``).
_ENGINE_FIELDS = (
    "model",
    "dtype",
    "kv_cache_dtype",
    "device",
    "max_model_len",
    "max_num_seqs",
    "max_waiting_seqs",
    "max_num_batched_tokens",
    "max_logprobs",
    "tensor_parallel_size",
    "seed",
    "compile_decode",
    "model_architecture_override",
    "model_impl",
    "allow_external_weights",
    "refuse_nonfinite_weights",
    "generation_config",
)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields given on the command line (only those, for provenance)."""
    settings: dict[str, Any] = {}
    for field in _ENGINE_FIELDS:
        value = getattr(args, field, None)
        if value is not None:
            settings[field] = value
    if getattr(args, "hf_overrides", None) is not None:
        try:
            overrides = json.loads(args.hf_overrides)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--hf-overrides is not valid JSON: {exc.msg} (got {args.hf_overrides!r}).") from None
        if not isinstance(overrides, dict):
            raise UsageError(
                f"--hf-overrides must be a JSON object such as '{{\"dropout\": 0}}', got {args.hf_overrides!r}."
            )
        settings["hf_overrides"] = overrides
    return settings


def _as_typed(message: str, args: argparse.Namespace) -> str:
    """An error in the words the user typed: ``max_model_len=8`` is ``--max-model-len 8`` when that flag said 8.

    The engine names its fields; only a value the user gave is theirs to change with its flag (one a plugin
    set, or the model's default, is left as the engine says it).
    """
    for field in _ENGINE_FIELDS:
        value = getattr(args, field, None)
        if value is None or isinstance(value, bool):
            continue
        engine = rf"(?<![\w-]){field}={re.escape(str(value))}(?!\w|\.\d| \(set by )"  # not 80, 8.5, a plugin's 8
        flag = f"--{field.replace('_', '-')} {value}"
        message = re.sub(engine, flag.replace("\\", "\\\\"), message)  # the flag as is, backslashes too
    return message


def make_host(args: argparse.Namespace):  # -> PluginHost
    from pluginhost.host import PluginHost
    from pluginhost.selection import PluginSelection, parse_name_list

    if args.plugins is not None and not parse_name_list(args.plugins):
        raise UsageError(
            f"--plugins {args.plugins!r} names no plugin (an unset shell variable?): name the plugins to load, or "
            "use --no-plugins to load none"
        )
    for value in args.disable_plugin:
        if not parse_name_list(value):  # a plugin meant to be blocked would load
            raise UsageError(
                f"--disable-plugin {value!r} names no plugin (an unset shell variable?): name the plugin to disable"
            )
    selection = PluginSelection.from_env().with_cli(
        plugins=args.plugins, no_plugins=args.no_plugins, disable=args.disable_plugin
    )
    return PluginHost(selection=selection)


def main(argv: Sequence[str] | None = None) -> int:
    from pluginhost.cli.output import OutputError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except OutputError as exc:  # --help or --version, to a stdout that cannot be written
        _report(f"error: {exc}", debug=False)
        return EXIT_USER
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USER
    if getattr(args, "model_dir", None) is not None:  # serve MODEL, as vLLM's
        if args.model is not None and args.model != args.model_dir:
            parser.error(f"serve got two models, {args.model_dir!r} and --model {args.model!r}: give one")
        args.model = args.model_dir
    _configure_logging(args)
    from pluginhost.cli import commands

    handler = {
        "plugins": commands.list_plugins,
        "models": commands.list_models,
        "config": commands.show_config,
        "generate": commands.generate,
        "serve": commands.serve,
    }[args.command]
    from pluginhost.cli.output import reserved_stdout

    try:
        with reserved_stdout() as out:
            return handler(args, out)
    except (PluginhostError, ValueError) as exc:
        _report(f"error: {_as_typed(str(exc), args)}", debug=args.debug)
        return EXIT_USER
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the last line of defence
        hint = "(please report it)" if args.debug else "(rerun with --debug for the traceback, and please report it)"
        _report(f"internal error: {type(exc).__name__}: {exc}\n{hint}", debug=args.debug)
        return EXIT_INTERNAL


def _report(message: str, *, debug: bool) -> None:
    """Print the error being handled on stderr: ``message``, after its traceback with ``--debug``.

    ``--debug`` adds the traceback and changes nothing else: the exit status stays the
    one the error maps to, and ``run`` still ends the process (re-raising skipped both).
    """
    if debug:
        traceback.print_exc(file=sys.stderr)
    print(message, file=sys.stderr)


def run() -> None:
    """The ``pluginhost`` console script: ``main`` and exit, whatever threads plugins left running.

    A plugin may start a non-daemon thread (at import, in a hook); the interpreter would
    wait for it forever after the command is done. Such threads are named on stderr and
    not waited for. Worker threads of thread pools (``concurrent.futures``, such as
    ``torch.compile``'s compile workers) are not waited for either, and not named: pools
    are mostly libraries', idle once the command is done. Nor is a model build ``serve`` gave up
    on when stopped while loading.
    """
    code = main()
    # The command is done and its status decided: a signal now (a second Ctrl-C while the interpreter
    # finalises) must not turn it into -2 or -15.
    for handled in (signal.SIGINT, signal.SIGTERM):
        signal.signal(handled, signal.SIG_IGN)
    lingering = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    # AsyncLLM's thread still building a model that Ctrl-C or SIGTERM made ``serve`` give up on: the interpreter's
    # exit would stop it inside torch's C++ code, which aborts the process ("terminate called without an active
    # exception", status -6) instead of exiting with ``code``.
    building = any(t.name == "pluginhost-engine" and t.is_alive() for t in threading.enumerate())
    if lingering or building:
        from concurrent.futures.thread import _worker as pool_worker

        started = [t for t in lingering if getattr(t, "_target", None) is not pool_worker]
        if started:
            logging.getLogger("pluginhost").warning(
                "exiting without waiting for %d thread(s) a plugin left running: %s",
                len(started),
                ", ".join(t.name for t in started),
            )
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    raise SystemExit(code)
