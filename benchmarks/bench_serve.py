"""The server under load: pluginhost's continuous batching against static batching and ``transformers serve``.

OPT-125m shape, random weights, fp32, CPU. Every system is an OpenAI-compatible
HTTP server on 127.0.0.1 answering ``/v1/completions``; N clients (1, 8, 32)
each stream one request after another for ``--duration`` seconds, with mixed
prompt lengths (16-256 tokens) and output lengths (16-256 tokens) drawn from
one seed, so every system gets the same work. Reported: output tokens per
second over the run (every request started within ``--duration``, until the
last has ended: the target's figure), time to first token (TTFT) and
inter-token latency (ITL, a request's decode time over its tokens after the
first), p50 and p99; and, for pluginhost's servers, the tokens generated
within ``--duration`` alone (from ``/metrics``): the run's figure counts the
tail in which the last requests end one by one, a continuous batch emptying
while a static one runs full.

Systems:

* ``pluginhost``: ``pluginhost serve`` (continuous batching);
* ``static``: pluginhost's previous static batching, rebuilt on today's engine
  and server with the old loop's costs: a new batch is admitted only once the
  running one has finished (requests arriving meanwhile wait), its prompts are
  prefilled in one pass padded to the longest, and every row of
  the batch keeps computing until its longest request ends, finished or not,
  attending over the longest sequence, as ``generate_batch`` did (its loop ran
  all B rows each step, prompts left-padded);
* ``static-freed``: the same, except that finished rows stop computing (they
  leave the batch, as in continuous batching) and rows attend as the engine's
  do (row by row where that is cheaper): a static batching better than
  pluginhost ever had, reported to show what continuous admission alone buys;
* ``transformers``: ``transformers serve`` on the same directory (needs
  ``accelerate``), and ``transformers-cb``: the same with
  ``--continuous-batching``. Either one is reported as failed, with why,
  when it does not run here.

    python benchmarks/bench_serve.py [--clients 1 8 32] [--duration 60] [--systems pluginhost,static,transformers]
                                     [--temperature 0.8 --top-p 0.95]   # a sampled load instead of greedy
                                     [--kv-cache-dtype bfloat16]        # pluginhost's engines only
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from common import OPT_125M, checkpoint_dir, machine

from pluginhost.engine.parallel import free_port

MAX_MODEL_LEN = 512
START_TIMEOUT = 300


def bench_model() -> Path:
    """The benchmark checkpoint, with a word-level tokenizer over its whole vocabulary ("<0>" .. "<50271>").

    Prompts are then exactly as many tokens as words, and any generated id decodes. (The brackets
    keep the special tokens "<1>" and "<2>" from matching inside "<123>".)
    """
    path = checkpoint_dir()
    if not (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {f"<{i}>": i for i in range(OPT_125M["vocab_size"])}
        tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<3>"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<2>", pad_token="<1>").save_pretrained(path)
    return path


# -- the systems --------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    command: list[str]
    model_name: str
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    url: str = ""
    log: list[str] = field(default_factory=list)

    def start(self) -> str | None:
        """Start it and wait for /health; ``None``, or why it did not come up."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [part.replace("{port}", str(port)) for part in self.command]
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        threading.Thread(target=lambda: self.log.extend(self.process.stdout), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return f"exited with {self.process.returncode}: {''.join(self.log)[-600:]}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return "did not answer /health in time"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)


def systems(path: Path, max_num_seqs: int, kv_cache_dtype: str = "auto") -> dict[str, Server]:
    ours = [
        sys.executable, "-m", "pluginhost", "serve", "--model", str(path), "--port", "{port}", "--no-plugins",
        "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "bench",
        "--kv-cache-dtype", kv_cache_dtype,
    ]  # fmt: skip
    static = [sys.executable, str(Path(__file__).resolve()), "--serve-static", str(path), "--port", "{port}"]
    static += ["--max-num-seqs", str(max_num_seqs), "--kv-cache-dtype", kv_cache_dtype]
    theirs = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(path), "--port", "{port}"]
    theirs += ["--device", "cpu", "--dtype", "float32"]
    return {
        "pluginhost": Server("pluginhost", ours, "bench"),
        "static": Server("static", static, "bench"),
        "static-freed": Server("static-freed", static + ["--free-finished"], "bench"),
        "transformers": Server("transformers", theirs, str(path)),
        "transformers-cb": Server("transformers-cb", theirs + ["--continuous-batching"], str(path)),
    }


def serve_static(path: str, port: int, max_num_seqs: int, *, free_finished: bool, kv_cache_dtype: str) -> None:
    """The ``static`` systems: pluginhost's engine and server, admitting whole batches only.

    Unless ``free_finished``, a decoding step also computes a row for every request of the batch
    that has finished (the old loop ran all of its rows until the longest ended): the step is
    padded back to the batch's size with rows at the batch's last position, whose logits are
    dropped, and every row attends over the batch's longest sequence (the old loop left-padded its
    prompts, so all rows shared their positions): never row by row. ``static-freed`` keeps the
    engine's attention, row by row where that is cheaper.
    """
    import dataclasses

    import pluginhost.engine.runner
    from pluginhost import AsyncLLM
    from pluginhost.engine.memory import keep_freed_memory
    from pluginhost.engine.scheduler import Scheduler
    from pluginhost.server.app import build_app
    from pluginhost.server.run import bind, run_server

    keep_freed_memory()  # as pluginhost serve does, before the model is built

    class StaticScheduler(Scheduler):
        batch_size = 0  # rows the running batch was admitted with

        def _admit(self) -> None:
            if self.num_running == 0:
                super()._admit()
                self.batch_size = self.num_running

    # The old loop left-padded a batch's prompts to the longest: one prefill pass.
    pluginhost.engine.runner._similar_lengths = lambda rows, lengths, **_: [sorted(rows)]

    engine = AsyncLLM(
        path,
        load_installed_plugins=False,
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_dtype=kv_cache_dtype,
    )
    core = engine.engine
    scheduler = core.scheduler = StaticScheduler(
        max_num_seqs=core.scheduler.max_num_seqs, max_num_batched_tokens=10**9, max_waiting=core.scheduler.max_waiting
    )
    if not free_finished:
        import builtin_models.attention

        builtin_models.attention.ROW_BY_ROW_BYTES = float("inf")
        run = core.runner.run

        def run_every_row(inputs):  # (B, V) for the B running rows, computed with the finished ones
            finished = scheduler.batch_size - inputs.num_rows
            if inputs.kind != "decode" or finished <= 0:
                return run(inputs)
            last = max(inputs.positions)
            padded = dataclasses.replace(
                inputs,
                num_rows=scheduler.batch_size,
                tokens=inputs.tokens + [0] * finished,
                positions=inputs.positions + [last] * finished,
            )
            computed = run(padded)
            return dataclasses.replace(computed, logits=computed.logits[: inputs.num_rows])

        core.runner.run = run_every_row
    run_server(build_app(engine, served_model_name="bench"), engine, bind("127.0.0.1", port), served_model_name="bench")


# -- the load ---------------------------------------------------------------------------------


@dataclass
class Result:
    tokens: int
    ttft: float
    itl: float | None


def workload(seed: int, n: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [
        (" ".join(f"<{rng.randrange(3, 50000)}>" for _ in range(rng.randint(16, 256))), rng.randint(16, 256))
        for _ in range(n)
    ]


async def one_request(
    http: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int, sampling: dict[str, object]
) -> Result:
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": max_tokens, "stream": True, **sampling}
    start = time.perf_counter()
    first = last = None
    async with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            # Arrival times are all that is measured: no JSON decoding, so the client takes little CPU
            # from the server on the same cores.
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if line.startswith('data: {"error"'):
                raise RuntimeError(f"{server.name}: {line}")
            now = time.perf_counter()
            first = first or now
            last = now
    if first is None:
        raise RuntimeError(f"{server.name}: no token came back")
    # The model is random: it writes max_tokens tokens (checked once per system in warm_up).
    itl = (last - first) / (max_tokens - 1) if max_tokens > 1 else None
    return Result(max_tokens, first - start, itl)


async def generated_tokens(http: httpx.AsyncClient, server: Server) -> float | None:
    """The server's count of tokens generated so far (pluginhost's /metrics; ``None`` for a server without it)."""
    try:
        response = await http.get(f"{server.url}/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    lines = [line for line in response.text.splitlines() if line.startswith("pluginhost_generation_tokens_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines) if response.status_code == 200 and lines else None


async def load(
    server: Server, clients: int, duration: float, seed: int, sampling: dict[str, object]
) -> tuple[list[Result], float, float | None]:
    """The results of every request started within ``duration``, the seconds until the last ended, and the tokens a
    second the server generated within ``duration`` itself (``None`` where it does not count them)."""
    work = workload(seed, 10_000)
    cursor = iter(range(len(work)))
    results: list[Result] = []
    start = time.perf_counter()
    deadline = start + duration

    async def client(http: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            prompt, max_tokens = work[next(cursor)]
            results.append(await one_request(http, server, prompt, max_tokens, sampling))

    async def in_window(http: httpx.AsyncClient) -> float | None:
        before = await generated_tokens(http, server)
        await asyncio.sleep(deadline - time.perf_counter())
        after = await generated_tokens(http, server)
        return None if before is None or after is None else (after - before) / duration

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=limits) as http:
        window, *_ = await asyncio.gather(in_window(http), *(client(http) for _ in range(clients)))
    return results, time.perf_counter() - start, window


def warm_up(server: Server) -> None:
    """One short request (first-call costs stay out of the figures), checking it writes every token asked for."""
    body = {"model": server.model_name, "prompt": "<5> <6> <7> <8>", "max_tokens": 12, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600)
    answer = response.json()
    if response.status_code != 200 or "choices" not in answer:
        raise RuntimeError(f"HTTP {response.status_code}: {str(answer)[:400]}")
    words = answer["choices"][0]["text"].split()
    if answer["choices"][0]["finish_reason"] != "length" or len(words) != 12:
        raise RuntimeError(f"{server.name} did not write 12 tokens: {answer}")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per system and client count")
    parser.add_argument("--systems", default="pluginhost,static,static-freed,transformers,transformers-cb")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default load)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="the KV cache's dtype for pluginhost and the static baselines alike"
    )
    parser.add_argument("--serve-static", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--free-finished", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_static:
        serve_static(
            args.serve_static,
            args.port,
            args.max_num_seqs,
            free_finished=args.free_finished,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        return

    path = bench_model()
    sampling: dict[str, object] = {"temperature": args.temperature}
    if args.temperature > 0:  # the model is random: a sampled end-of-sequence would cut a request short
        sampling |= {"top_p": args.top_p, "ignore_eos": True}
    print(f"machine: {machine()}")
    print(f"sampling: {sampling}")
    print(
        f"model: OPT-125m shape, random weights, fp32, KV cache {args.kv_cache_dtype}, max_model_len {MAX_MODEL_LEN}; "
        f"{args.duration:.0f} s per run"
    )
    table: dict[tuple[str, int], dict[str, float]] = {}
    for name in args.systems.split(","):
        server = systems(path, args.max_num_seqs, args.kv_cache_dtype)[name]
        problem = server.start()
        try:
            if problem is None:
                try:
                    warm_up(server)
                except Exception as exc:  # noqa: BLE001 - reported as the system's failure
                    problem = f"{type(exc).__name__}: {exc}"
            if problem is not None:
                print(f"{name}: did not run here: {problem}")
                continue
            for clients in args.clients:
                try:
                    results, seconds, window = asyncio.run(load(server, clients, args.duration, args.seed, sampling))
                except Exception as exc:  # noqa: BLE001 - reported as the system's failure
                    print(f"{name} {clients:>2} clients: failed: {type(exc).__name__}: {exc}")
                    continue
                row = {
                    "tok/s": sum(r.tokens for r in results) / seconds,
                    "requests": len(results),
                    "ttft p50": percentile([r.ttft for r in results], 0.5),
                    "ttft p99": percentile([r.ttft for r in results], 0.99),
                    "itl p50": percentile([r.itl for r in results if r.itl], 0.5),
                    "itl p99": percentile([r.itl for r in results if r.itl], 0.99),
                    "in window": window,
                }
                table[(name, clients)] = row
                print(
                    f"{name:<16} {clients:>2} clients: {row['tok/s']:7.1f} tok/s over {row['requests']:>3} requests; "
                    f"TTFT p50 {row['ttft p50'] * 1000:7.0f} ms p99 {row['ttft p99'] * 1000:7.0f} ms; "
                    f"ITL p50 {row['itl p50'] * 1000:6.1f} ms p99 {row['itl p99'] * 1000:6.1f} ms"
                    + (f"; within the {args.duration:.0f} s: {window:7.1f} tok/s" if window is not None else ""),
                    flush=True,
                )
        finally:
            server.stop()

    print()
    top = max(args.clients)
    ours = table.get(("pluginhost", top))
    if ours:
        targets = (("static", ">= 2x"), ("static-freed", "none"), ("transformers", "> 1x"), ("transformers-cb", "> 1x"))
        for other, target in targets:
            if (other, top) in table:
                ratio = ours["tok/s"] / table[(other, top)]["tok/s"]
                print(f"throughput at {top} clients, pluginhost / {other}: {ratio:.2f}x (target {target})")
                theirs = table[(other, top)]["in window"]
                if ours["in window"] is not None and theirs is not None:
                    window_ratio = ours["in window"] / theirs
                    print(f"  tokens generated within the {args.duration:.0f} s alone: {window_ratio:.2f}x")
    if ("pluginhost", 1) in table and ("pluginhost", 8) in table:
        ratio = table[("pluginhost", 8)]["ttft p50"] / table[("pluginhost", 1)]["ttft p50"]
        print(f"TTFT p50, 8 clients / 1 client: {ratio:.2f}x (target <= 2x)")


if __name__ == "__main__":
    sys.exit(main())
