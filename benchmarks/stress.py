"""Stress: several threads and processes against one engine, every answer checked.

One ``pluginhost serve`` (one engine, continuous batching) on 127.0.0.1. First each
case below is sent alone, one after another: its answer is the single-caller
reference. Then for ``--seconds``, ``--threads`` threads here and ``--processes``
worker processes (this script again, ``--worker``) send random cases as fast as
they are answered: completions and chat, streamed and not, greedy and seeded
sampling, stop strings, ``n=2``, logprobs. Every answer must equal its reference
(texts, finish reasons, token counts; logprobs to 1e-4), every request must be
answered, and the server's own ``/metrics`` must count exactly the requests sent.

    python benchmarks/stress.py [--seconds 60] [--threads 4] [--processes 3] [--model DIR]

Exit status 0 when nothing was lost and nothing differed, else 1 (the first
differences are printed).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from pluginhost.testing.server import served_url

REQUEST_TIMEOUT = 60.0
START_TIMEOUT = 120.0
LOGPROB_TOLERANCE = 1e-4

PROMPTS = [
    "A plugin is",
    "The engine",
    "pluginhost serve",
    "Hooks let a plugin change",
    "The scheduler",
    "To write a plugin,",
]


def cases() -> list[dict[str, Any]]:
    """The requests: (route, body) pairs covering what a server is asked."""
    out: list[dict[str, Any]] = []
    for i, prompt in enumerate(PROMPTS):
        max_tokens = 6 + 7 * i
        out.append({"route": "/v1/completions", "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}})
        out.append(
            {
                "route": "/v1/completions",
                "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.9, "seed": 100 + i, "n": 2},
            }
        )
        out.append(
            {
                "route": "/v1/completions",
                "body": {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": ["."], "logprobs": 2},
            }
        )
        out.append(
            {
                "route": "/v1/completions",
                "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "stream": True},
            }
        )
        out.append(
            {
                "route": "/v1/chat/completions",
                "body": {
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": i % 2 == 0,
                },
            }
        )
    return out


def answer(http: httpx.Client, url: str, case: dict[str, Any]) -> dict[str, Any]:
    """What a client sees of one request: per choice, its text, finish reason and logprobs."""
    body = case["body"]
    chat = case["route"] == "/v1/chat/completions"
    if not body.get("stream"):
        response = http.post(url + case["route"], json=body, timeout=REQUEST_TIMEOUT)
        response.raise_for_status()
        data = response.json()
        choices = {
            c["index"]: {
                "text": c["message"]["content"] if chat else c["text"],
                "finish_reason": c["finish_reason"],
                "logprobs": None if chat or not c.get("logprobs") else c["logprobs"]["token_logprobs"],
            }
            for c in data["choices"]
        }
        return {"choices": choices, "completion_tokens": data["usage"]["completion_tokens"]}
    choices: dict[int, dict[str, Any]] = {}
    with http.stream("POST", url + case["route"], json=body, timeout=REQUEST_TIMEOUT) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            for c in event["choices"]:
                choice = choices.setdefault(c["index"], {"text": "", "finish_reason": None, "logprobs": None})
                choice["text"] += (c["delta"].get("content") or "") if chat else c["text"]
                choice["finish_reason"] = c["finish_reason"] or choice["finish_reason"]
    return {"choices": choices, "completion_tokens": None}


def differences(got: dict[str, Any], want: dict[str, Any]) -> str | None:
    if got["completion_tokens"] != want["completion_tokens"]:
        return f"completion_tokens {got['completion_tokens']} != {want['completion_tokens']}"
    if sorted(got["choices"]) != sorted(want["choices"]):
        return f"choices {sorted(got['choices'])} != {sorted(want['choices'])}"
    for index, choice in want["choices"].items():
        other = got["choices"][index]
        for key in ("text", "finish_reason"):
            if other[key] != choice[key]:
                return f"choice {index} {key}: {other[key]!r} != {choice[key]!r}"
        if choice["logprobs"] is not None:
            gaps = [abs(a - b) for a, b in zip(other["logprobs"], choice["logprobs"], strict=True)]
            if max(gaps, default=0.0) > LOGPROB_TOLERANCE:
                return f"choice {index} logprobs differ by {max(gaps):.2e}"
    return None


def hammer(
    url: str, all_cases: list[dict[str, Any]], references: list[dict[str, Any]], seconds: float, seed: int
) -> dict[str, Any]:
    """Send random cases for ``seconds``, one after another; tally what came back."""
    rng = random.Random(seed)
    tally: dict[str, Any] = {"sent": 0, "answered": 0, "choices": 0, "wrong": [], "errors": []}
    deadline = time.monotonic() + seconds
    with httpx.Client() as http:
        while time.monotonic() < deadline:
            k = rng.randrange(len(all_cases))
            tally["sent"] += 1
            try:
                got = answer(http, url, all_cases[k])
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                tally["errors"].append(f"case {k}: {type(exc).__name__}: {exc}")
                continue
            tally["answered"] += 1
            tally["choices"] += len(got["choices"])
            problem = differences(got, references[k])
            if problem:
                tally["wrong"].append(
                    f"case {k} ({all_cases[k]['route']} {json.dumps(all_cases[k]['body'])}): {problem}"
                )
    return tally


@contextmanager
def server(model: str | None) -> Iterator[str]:
    """``pluginhost serve --port 0`` until its URL is printed; always stopped afterwards."""
    args = [sys.executable, "-m", "pluginhost", "serve", "--port", "0", "--no-plugins", "--max-num-seqs", "16"]
    if model:
        args += ["--model", model]
    process = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        url, lines = served_url(process, START_TIMEOUT)
        if not url:
            raise SystemExit("the server did not start:\n" + "".join(lines))
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def requests_counted(http: httpx.Client, url: str) -> dict[str, int]:
    """Samples (choices) the server counted as finished, by reason (``pluginhost_request_success``)."""
    counts: dict[str, int] = {}
    for line in http.get(url + "/metrics", timeout=REQUEST_TIMEOUT).text.splitlines():
        found = re.match(r'pluginhost_request_success_total\{.*finish_reason="(\w+)".*\} (\S+)', line)
        if found:
            counts[found.group(1)] = counts.get(found.group(1), 0) + int(float(found.group(2)))
    return counts


def run_worker(args: argparse.Namespace) -> None:
    with open(args.worker_cases) as f:
        shared = json.load(f)
    references = [{**r, "choices": {int(k): v for k, v in r["choices"].items()}} for r in shared["references"]]
    print(json.dumps(hammer(args.worker, shared["cases"], references, args.seconds, args.seed)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--model", help="model directory (default: the demo model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-cases", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return 0

    all_cases = cases()
    results: dict[str, dict[str, Any]] = {}
    join_timeout = args.seconds + 2 * REQUEST_TIMEOUT
    with server(args.model) as url, httpx.Client() as http, tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        references = [answer(http, url, case) for case in all_cases]
        print(f"{len(all_cases)} single-caller references in {time.monotonic() - started:.1f} s")
        before = requests_counted(http, url)
        shared = Path(tmp) / "cases.json"
        shared.write_text(json.dumps({"cases": all_cases, "references": references}))
        worker_args = ["--worker", url, "--worker-cases", str(shared), "--seconds", str(args.seconds)]
        workers = [
            subprocess.Popen(
                [sys.executable, __file__, *worker_args, "--seed", str(1000 + p)], stdout=subprocess.PIPE, text=True
            )
            for p in range(args.processes)
        ]

        def thread_main(t: int) -> None:
            results[f"thread {t}"] = hammer(url, all_cases, references, args.seconds, args.seed + t)

        threads = [threading.Thread(target=thread_main, args=(t,), daemon=True) for t in range(args.threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(join_timeout)
        for p, worker in enumerate(workers):
            try:
                stdout, _ = worker.communicate(timeout=join_timeout)
                results[f"process {p}"] = json.loads(stdout)
            except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
                worker.kill()
                worker.wait()
                results[f"process {p}"] = {
                    "sent": 0,
                    "answered": 0,
                    "choices": 0,
                    "wrong": [],
                    "errors": [f"worker: {exc}"],
                }
        after = requests_counted(http, url)
        elapsed = time.monotonic() - started

    counted = {reason: after.get(reason, 0) - before.get(reason, 0) for reason in after}
    sent = sum(r["sent"] for r in results.values())
    answered = sum(r["answered"] for r in results.values())
    choices = sum(r["choices"] for r in results.values())
    wrong = [w for r in results.values() for w in r["wrong"]]
    errors = [e for r in results.values() for e in r["errors"]]
    for name, r in sorted(results.items()):
        differed, failed = len(r["wrong"]), len(r["errors"])
        print(f"  {name}: {r['sent']} sent, {r['answered']} answered, {differed} differed, {failed} failed")
    print(
        f"{args.threads} threads + {args.processes} processes, {args.seconds:.0f} s: {sent} requests "
        f"({sent / args.seconds:.1f}/s), {answered} answered, {len(wrong)} differed from their single-caller "
        f"reference, {len(errors)} failed; the server counted {sum(counted.values())} finished {counted}"
    )
    problems = wrong[:5] + errors[:5]
    if len(results) != args.threads + args.processes:
        problems.append(f"{args.threads + args.processes - len(results)} caller(s) never finished")
    if sent != answered:
        problems.append(f"{sent - answered} request(s) lost")
    unexpected = {reason: n for reason, n in counted.items() if reason not in ("stop", "length") and n}
    if counted.get("stop", 0) + counted.get("length", 0) != choices or unexpected:
        problems.append(f"the server's count {counted} does not match the {choices} choices answered")
    for problem in problems:
        print("  PROBLEM:", problem)
    print(f"stress: {'FAILED' if problems else 'OK'} ({elapsed:.0f} s in all)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
