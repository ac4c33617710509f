"""Weight-only int8 (the ``int8_quant`` sample plugin) against the fp32 engine, on the same weights.

OPT-125m shape, random weights saved with ``save_pretrained`` (fp32), CPU,
``torch.set_num_threads`` = cores, greedy, end-of-sequence ignored, alternating
runs. Three engines: pluginhost in fp32; with the plugin as shipped (every
linear layer in int8, the LM head included); with the LM head kept in fp32
(``PLUGINHOST_INT8_SKIP=lm_head``). The plugin runs in-process
(``LLM(path, plugins=[pluginhost_int8_quant])``): nothing to install.

Printed: decode tokens/s at batch 1 and 8 and the time to prefill a
512-token prompt (medians, and the range over the runs), the int8 engines'
quality against fp32 (max abs log-probability difference over a fixed
prompt, and how many of 32 greedy tokens agree), the weights' memory, the
load's peak RSS, and the kernels the plugin chose.

    cd benchmarks
    python bench_int8.py [--runs 3] [--new-tokens 128]

``PLUGINHOST_INT8_KERNEL=int8pack|dequant_bf16|dequant`` forces the plugin's
kernel (default: measured per shape and row count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import (
    checkpoint_dir,
    machine,
    median_alternating,
    pluginhost_tokens_per_second,
    random_prompts,
    setup_threads,
)

from builtin_models.kv_cache import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sample_plugins" / "int8_quant" / "src"))

import pluginhost_int8_quant  # noqa: E402
from pluginhost_int8_quant.int8_linear import kernel_choices  # noqa: E402

PROMPT_LENGTH = 32
QUALITY_PROMPT = 128
QUALITY_TOKENS = 32


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


#: The engines compared: name -> (with the plugin, environment while it loads).
ENGINES = {
    "fp32": (False, {}),
    "int8": (True, {"PLUGINHOST_INT8_SKIP": ""}),
    "int8, fp32 head": (True, {"PLUGINHOST_INT8_SKIP": "lm_head"}),
}


def load(path: Path, name: str):
    """Build engine ``name`` (its environment set only while it loads)."""
    from pluginhost import LLM

    with_plugin, env = ENGINES[name]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        plugins = [pluginhost_int8_quant] if with_plugin else []
        return LLM(str(path), load_installed_plugins=False, device="cpu", dtype="float32", plugins=plugins)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_memory(name: str) -> None:
    """In a fresh process: the RSS the load adds, and its peak while loading (MiB), as JSON on stdout."""
    import pluginhost.engine  # noqa: F401 - imports (torch, transformers) before the first reading

    path = checkpoint_dir()
    before = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the current RSS
    llm = load(path, name)
    added, peak = rss_kib("VmRSS") - before, rss_kib("VmHWM") - before
    del llm
    print(json.dumps({"added": added / 1024, "peak": peak / 1024}))


def measure_load_memory(name: str) -> dict[str, float]:
    run = subprocess.run(
        [sys.executable, __file__, "--load-memory", name], capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters and buffers, the part read by a decode step: everything but the embedding tables).

    The KV cache's buffers are not weights: left out (they grow with the longest sequence the engine has run,
    so counting them made the figures depend on what ran before, 144 MiB after the quality step).
    """
    cache_buffers = {id(b) for m in model.modules() if isinstance(m, KVCache) for b in m.buffers()}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in cache_buffers}
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    streamed = sum(t.numel() * t.element_size() for i, t in tensors.items() if i not in embedded)
    head = model.lm_head
    if not hasattr(head, "qweight") and id(head.weight) in embedded:  # a tied fp32 head streams the embeddings
        streamed += head.weight.numel() * head.weight.element_size()
    return total, streamed


@torch.inference_mode()
def logprobs(llm, ids: list[int]) -> torch.Tensor:
    hidden = llm.model(torch.tensor([ids]), torch.arange(len(ids))[None])
    return llm.model.compute_logits(hidden)[0].float().log_softmax(-1)  # (T, V)


class CpuShare:
    """How much of its threads' wall time this process got on the CPUs in each run (about 0.9-1 alone;
    well below, other load on the machine slowed that run)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.shares: dict[str, list[float]] = {}

    def __call__(self, name: str, fn: Callable[[], float]) -> Callable[[], float]:
        def run() -> float:
            before, start = os.times(), time.perf_counter()
            figure = fn()
            after, wall = os.times(), time.perf_counter() - start
            cpu = (after.user - before.user) + (after.system - before.system)
            self.shares.setdefault(name, []).append(cpu / (wall * self.threads))
            return figure

        return run

    def take(self, name: str) -> str:
        return " ".join(f"{x:.2f}" for x in self.shares.pop(name, []))


def print_section(title: str, runs: dict[str, list[float]], fmt: str, share: CpuShare) -> None:
    best = max if "tok/s" in title else min
    print(f"{title}:")
    for name, values in runs.items():
        ratio = statistics.median(values) / statistics.median(runs["fp32"])
        best_ratio = best(values) / best(runs["fp32"])
        print(
            f"  {name:<16} {spread(values, fmt):<26} {ratio:5.2f}x fp32 (medians), {best_ratio:5.2f}x (bests); "
            f"CPU share per run {share.take(name)}"
        )


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--load-memory", choices=list(ENGINES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_memory:
        load_memory(args.load_memory)
        return
    cores = setup_threads()
    path = checkpoint_dir()
    print(f"machine: {machine()}; threads: {cores}")

    engines = {name: load(path, name) for name in ENGINES}
    generator = torch.Generator().manual_seed(0)

    def prompts(batch: int, length: int) -> list[list[int]]:
        return random_prompts(generator, batch, length, 50000)

    # Quality: log-probabilities of a fixed prompt, and greedy continuations, against fp32.
    from pluginhost import SamplingParams

    prompt = prompts(1, QUALITY_PROMPT)[0]
    reference = logprobs(engines["fp32"], prompt)
    greedy = SamplingParams(max_tokens=QUALITY_TOKENS, temperature=0, ignore_eos=True)
    reference_tokens = engines["fp32"].generate([prompt], greedy)[0].token_ids
    print(f"\nquality against fp32 ({QUALITY_PROMPT}-token prompt; greedy continuation of {QUALITY_TOKENS} tokens):")
    for name in ("int8", "int8, fp32 head"):
        diff = (logprobs(engines[name], prompt) - reference).abs()
        tokens = engines[name].generate([prompt], greedy)[0].token_ids
        same = next((i for i, (a, b) in enumerate(zip(tokens, reference_tokens, strict=True)) if a != b), len(tokens))
        print(
            f"  {name:<16} max |logprob diff| {diff.max().item():.4f} (mean over positions of the per-position max "
            f"{diff.max(-1).values.mean().item():.4f}); greedy tokens equal for the first {same} of {len(tokens)}"
        )

    print(
        "\nmemory: weights (parameters and buffers, the KV cache left out) / read by a decode step / "
        "loading in a fresh process:"
    )
    streamed_bytes = {}
    for name, llm in engines.items():
        total, streamed = weight_bytes(llm.model)
        streamed_bytes[name] = streamed
        rss = measure_load_memory(name)
        print(
            f"  {name:<16} {total / 2**20:6.1f} MiB / {streamed / 2**20:6.1f} MiB / "
            f"RSS {rss['added']:4.0f} MiB after, {rss['peak']:4.0f} MiB at the peak"
        )

    print(
        f"\nspeed: median (range) over {args.runs} alternating runs; ratios to fp32 of the medians and of the bests; "
        "CPU share: of its threads' wall time, what this process got on the CPUs (about 0.9-1 alone)"
    )
    share = CpuShare(cores)
    results = {}
    for batch in (1, 8):
        batch_prompts = prompts(batch, PROMPT_LENGTH)
        for llm in engines.values():
            pluginhost_tokens_per_second(llm, batch_prompts, 8)  # warm up (and let the plugin measure its kernels)
        runs = median_alternating(
            args.runs,
            **{
                name: share(
                    name, lambda llm=llm, p=batch_prompts: pluginhost_tokens_per_second(llm, p, args.new_tokens)
                )
                for name, llm in engines.items()
            },
        )
        results[f"decode b{batch}"] = runs
        print_section(
            f"decode, batch {batch}, {PROMPT_LENGTH}+{args.new_tokens} tokens (tok/s, higher is better)",
            runs,
            ".1f",
            share,
        )

    long_prompt = prompts(1, 512)
    for llm in engines.values():
        pluginhost_tokens_per_second(llm, long_prompt, 1)
    runs = median_alternating(
        args.runs,
        **{
            name: share(name, lambda llm=llm: 1 / pluginhost_tokens_per_second(llm, long_prompt, 1))
            for name, llm in engines.items()
        },
    )
    print_section("prefill, 512 tokens, to the first token (s, lower is better)", runs, ".3f", share)

    print("\ndecode batch 1: weight bytes read per token at the median speed:")
    for name, values in results["decode b1"].items():
        rate = statistics.median(values)
        gbps = streamed_bytes[name] * rate / 1e9
        print(f"  {name:<16} {streamed_bytes[name] / 2**20:6.1f} MiB x {rate:5.1f} tok/s = {gbps:5.1f} GB/s")

    print("\nkernels the plugin chose (shape, dtype, rows):")
    for key, kernel in kernel_choices().items():
        print(f"  {key}: {kernel}")


if __name__ == "__main__":
    main()
