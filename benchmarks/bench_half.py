"""bf16 and fp16 decoding speed on CPU: pluginhost against Hugging Face transformers.

Same checkpoint and setup as bench_generate.py, batch 1, a 32-token prompt,
greedy. CPUs without native half-precision arithmetic (no AVX512-BF16 or
AMX) convert to fp32 inside the kernels, which costs time, while half the
bytes per weight saves memory traffic: which wins depends on the machine.
This reports it; it sets no target.

    python benchmarks/bench_half.py [--runs 3] [--new-tokens 32]
"""

from __future__ import annotations

import argparse

import torch
from common import (
    checkpoint_dir,
    machine,
    median_alternating,
    pluginhost_tokens_per_second,
    report,
    setup_threads,
    transformers_tokens_per_second,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    cores = setup_threads()
    path = checkpoint_dir()

    from transformers import OPTForCausalLM

    from pluginhost import LLM

    print(f"machine: {machine()}; threads: {cores}")
    prompt = [[2, *range(100, 131)]]
    for dtype in ("float32", "bfloat16", "float16"):
        llm = LLM(str(path), load_installed_plugins=False, device="cpu", dtype=dtype)
        hf = OPTForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

        def ours(llm: LLM = llm) -> float:
            return pluginhost_tokens_per_second(llm, prompt, args.new_tokens)

        def theirs(hf: OPTForCausalLM = hf) -> float:
            return transformers_tokens_per_second(hf, prompt, args.new_tokens)

        ours(), theirs()  # warm up
        results = median_alternating(args.runs, ours=ours, theirs=theirs)
        report(
            f"decode, batch 1, {dtype}",
            results["ours"],
            results["theirs"],
            "tok/s",
            better="higher",
            target="none: reported",
        )
        del llm, hf


if __name__ == "__main__":
    main()
