"""Tensor parallelism on CPU (gloo): the same tokens as one process, plugins on every rank, faults named.

Every engine here is split over two processes on this machine; each test checks
that no process of it is left afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pluginhost import LLM, SamplingParams, hookimpl
from pluginhost.errors import ConfigError, PluginhostError, TensorParallelError
from pluginhost.testing import make_tiny_model

PROMPTS = [[2, 17, 200, 31, 99, 5, 64, 11], [2, 300], [2, 7, 7, 7, 150, 42], [2, 9, 9]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)


def children() -> set[int]:
    """The live child processes of this one (from /proc: no dependency needed)."""
    me, found = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                # multiprocessing's resource tracker lives as long as this process, by design
                if b"resource_tracker" not in (entry / "cmdline").read_bytes():
                    found.add(int(entry.name))
    return found


@pytest.fixture(autouse=True)
def no_rank_survives():
    before = children()
    yield
    deadline = time.monotonic() + 20
    while children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not children() - before, "a rank outlived its engine"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, tiny_opt):
    root = tmp_path_factory.mktemp("tp-models")
    return {
        "opt": tiny_opt,
        "llama (grouped-query)": make_tiny_model(root / "llama", "llama"),
        "qwen2 (tied, q/k/v biases)": make_tiny_model(root / "qwen2", "qwen2"),
        "gpt2 (vocabulary of 383: padded)": make_tiny_model(root / "gpt2", "gpt2", vocab_size=383),
    }


def assert_same(one, two):
    for a, b in zip(one, two, strict=True):
        assert a.token_ids == b.token_ids
        if a.logprobs is not None:
            for step_a, step_b in zip(a.logprobs, b.logprobs, strict=True):
                assert step_a.keys() == step_b.keys()
                assert max(abs(step_a[t] - step_b[t]) for t in step_a) < 1e-4


@pytest.mark.parametrize(
    "model", ["opt", "llama (grouped-query)", "qwen2 (tied, q/k/v biases)", "gpt2 (vocabulary of 383: padded)"]
)
def test_two_ranks_generate_what_one_process_does(tiny_models, model):
    path = str(tiny_models[model])
    one = LLM(path, load_installed_plugins=False, dtype="float32")
    expected = [one.generate(PROMPTS, GREEDY), one.generate(PROMPTS, SEEDED)]
    two = LLM(path, load_installed_plugins=False, dtype="float32", tensor_parallel_size=2)
    try:
        assert two.rank == 0 and two.config.tensor_parallel_size == 2
        # Each rank holds half of a split layer: rank 0's share is visible here.
        assert_same(expected[0], two.generate(PROMPTS, GREEDY))
        assert_same(expected[1], two.generate(PROMPTS, SEEDED))
        # Requests joining a running batch (continuous batching) too.
        staggered = two.generate(PROMPTS + [[2, 40, 41]], [GREEDY] * 4 + [SamplingParams(max_tokens=3, temperature=0)])
        assert_same(expected[0], staggered[:4])
    finally:
        two.close()
    with pytest.raises(TensorParallelError, match="closed|stopped"):
        two.generate(PROMPTS, GREEDY)
