"""The compiled decoding step (``compile_decode=True``) against the eager engine and transformers.

OPT-125m shape (``--model opt``) or the Llama of ``bench_generate.py``, random
weights, fp32, greedy, end-of-sequence ignored, 32-token prompts. Reported:
the start-up cost of compiling (the first decoding step at each batch size,
compiling included, summed by the engine), then decode tokens/s at batch 1 and
8, medians of alternating runs of the compiled engine, the eager engine and
transformers' ``generate``. On CUDA (``--device cuda``) the compiled step is
replayed as a CUDA graph.

    python benchmarks/bench_compiled.py [--model opt|llama] [--runs 3] [--device cpu|cuda] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import (
    MODELS,
    checkpoint_dir,
    machine,
    median_alternating,
    pluginhost_tokens_per_second,
    random_prompts,
    setup_threads,
    transformers_tokens_per_second,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="opt")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    cores = setup_threads()
    path = checkpoint_dir(args.model)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    from transformers import AutoModelForCausalLM

    from pluginhost import LLM

    settings = {"load_installed_plugins": False, "device": args.device, "dtype": args.dtype}
    eager = LLM(str(path), **settings)
    start = time.perf_counter()
    compiled = LLM(str(path), compile_decode=True, **settings)
    build = time.perf_counter() - start
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    print(f"machine: {machine()}; threads: {cores}; device: {args.device}; dtype: {args.dtype}; model: {args.model}")

    generator = torch.Generator().manual_seed(0)
    runner = compiled.engine.runner
    print(f"engine build: {build:.1f} s (compiling happens at the first decoding steps, below)")
    for batch in (1, 8):
        batch_prompts = random_prompts(generator, batch, 32, eager.vocab_size - 1)
        before = runner.compiled.compile_seconds
        pluginhost_tokens_per_second(compiled, batch_prompts, 8)  # compiles for this batch (and the cache's slots)
        compile_s = runner.compiled.compile_seconds - before
        pluginhost_tokens_per_second(eager, batch_prompts, 8), transformers_tokens_per_second(hf, batch_prompts, 8)
        results = median_alternating(
            args.runs,
            compiled=lambda p=batch_prompts: pluginhost_tokens_per_second(compiled, p, args.new_tokens),
            eager=lambda p=batch_prompts: pluginhost_tokens_per_second(eager, p, args.new_tokens),
            transformers=lambda p=batch_prompts: transformers_tokens_per_second(hf, p, args.new_tokens),
        )
        m = {name: statistics.median(values) for name, values in results.items()}
        spread = {name: f"{min(v):.1f}-{max(v):.1f}" for name, v in results.items()}
        print(
            f"decode, batch {batch}, 32+{args.new_tokens} tokens: compiled {m['compiled']:.1f} tok/s "
            f"({spread['compiled']}), eager {m['eager']:.1f} ({spread['eager']}), transformers "
            f"{m['transformers']:.1f} ({spread['transformers']}); compiled/eager {m['compiled'] / m['eager']:.2f}x, "
            f"compiled/transformers {m['compiled'] / m['transformers']:.2f}x; "
            f"compiling for this batch: {compile_s:.1f} s"
        )
    if runner.compiled.failure is not None:
        print(f"compiling failed, the 'compiled' figures are eager: {runner.compiled.failure!r}")
    print(f"compiling in all: {runner.compiled.compile_seconds:.1f} s")


if __name__ == "__main__":
    main()
