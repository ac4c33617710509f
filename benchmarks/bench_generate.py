"""Generation speed: pluginhost against Hugging Face transformers on the same weights.

OPT-125m shape (``--model opt``) or a Llama of about the same size (``--model
llama``: 12 layers, hidden 768, grouped-query attention 12/4), random weights
saved with ``save_pretrained``, fp32, CPU, ``torch.set_num_threads`` = cores,
greedy, end-of-sequence ignored on both sides, medians of alternating runs.
transformers runs with its defaults (``sdpa`` attention, ``generate``), as its
users would. ``--model-impl transformers`` runs pluginhost's transformers
fallback instead of the builtin model.

    python benchmarks/bench_generate.py [--model opt|llama] [--runs 3] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from common import (
    MODELS,
    checkpoint_dir,
    machine,
    median_alternating,
    pluginhost_tokens_per_second,
    random_prompts,
    report,
    setup_threads,
    transformers_tokens_per_second,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--model", choices=sorted(MODELS), default="opt")
    parser.add_argument("--model-impl", choices=["auto", "transformers"], default="auto")
    args = parser.parse_args()
    cores = setup_threads()
    path = checkpoint_dir(args.model)

    from transformers import AutoModelForCausalLM

    from builtin_models.linear import kernel_choices, linear
    from pluginhost import LLM

    llm = LLM(str(path), load_installed_plugins=False, device="cpu", dtype="float32", model_impl=args.model_impl)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    print(f"machine: {machine()}; threads: {cores}; model: {args.model} ({type(llm.model).__name__})")

    generator = torch.Generator().manual_seed(0)
    vocab = llm.vocab_size

    def prompts(batch: int, length: int) -> list[list[int]]:
        return random_prompts(generator, batch, length, vocab - 1)

    def ours_decode(batch_prompts: list[list[int]], new: int) -> float:
        return pluginhost_tokens_per_second(llm, batch_prompts, new)

    def hf_decode(batch_prompts: list[list[int]], new: int) -> float:
        return transformers_tokens_per_second(hf, batch_prompts, new)

    ratios = {}
    for batch, target in ((1, ">= 1.25x"), (8, ">= 1.5x")):
        batch_prompts = prompts(batch, 32)
        ours_decode(batch_prompts, 8), hf_decode(batch_prompts, 8)  # warm up
        results = median_alternating(
            args.runs,
            ours=lambda p=batch_prompts: ours_decode(p, args.new_tokens),
            theirs=lambda p=batch_prompts: hf_decode(p, args.new_tokens),
        )
        ratios[f"decode b{batch}"] = report(
            f"decode, batch {batch}, 32+{args.new_tokens} tokens",
            results["ours"],
            results["theirs"],
            "tok/s",
            better="higher",
            target=target,
        )

    long_prompt = prompts(1, 512)
    ours_decode(long_prompt, 1), hf_decode(long_prompt, 1)
    results = median_alternating(
        args.runs,
        ours=lambda: 1 / ours_decode(long_prompt, 1),
        theirs=lambda: 1 / hf_decode(long_prompt, 1),
    )
    ratios["prefill"] = report(
        "prefill, 512 tokens, to the first token",
        results["ours"],
        results["theirs"],
        "s",
        better="lower",
        target="<= 1.0x",
    )

    # Weight bandwidth in decode, beside two plain passes over the same layers (weights and biases):
    # F.linear, as transformers multiplies, and the engine's own kernel choice (builtin_models.linear),
    # the floor the engine's overhead is judged against.
    linears = [(m.weight, m.bias) for m in llm.model.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(w.numel() * w.element_size() for w in {id(w): w for w, _ in linears}.values())
    x = {w.shape[1]: torch.randn(1, w.shape[1]) for w, _ in linears}

    def linear_pass(kernel) -> Callable[[], float]:
        @torch.inference_mode()
        def run() -> float:
            start = time.perf_counter()
            for _ in range(20):
                for w, b in linears:
                    kernel(x[w.shape[1]], w, b)
            return (time.perf_counter() - start) / 20

        return run

    step_prompt = prompts(1, 32)

    def decode_step() -> float:
        # A decode step alone: the time for N more tokens less the time for the prompt and the first.
        first = 1 / ours_decode(step_prompt, 1)
        return (args.new_tokens / ours_decode(step_prompt, args.new_tokens) - first) / (args.new_tokens - 1)

    steps = median_alternating(
        max(args.runs, 7),  # a difference of two noisy times: more runs than the ratios need
        step=decode_step,
        f_linear=linear_pass(torch.nn.functional.linear),
        engine_linear=linear_pass(linear),
    )
    step = statistics.median(steps["step"])
    print(
        f"decode step, batch 1: {step * 1e3:.2f} ms, reading {weight_bytes / 2**20:.0f} MiB of weights: "
        f"{weight_bytes / step / 1e9:.1f} GB/s"
    )
    for name, label in (("f_linear", "plain F.linear"), ("engine_linear", "the engine's linear kernels")):
        floor = statistics.median(steps[name])
        print(
            f"  {label} over the same weights: {floor * 1e3:.2f} ms ({weight_bytes / floor / 1e9:.1f} GB/s); "
            f"the step's time beyond it: {100 * (step - floor) / step:.1f}%"
        )
    print("  engine overhead (beyond its own kernels) target: < 10% of the step")
    shapes = {f"{w.shape[0]}x{w.shape[1]}" for w, _ in linears}
    print("kernels chosen on this machine for this model's layers:")
    for key, kernel in kernel_choices().items():
        if key.split("+")[0].split(" ")[0] in shapes:
            print(f"  {key}: {kernel}")


if __name__ == "__main__":
    main()
