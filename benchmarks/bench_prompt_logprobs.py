"""Scoring prompts (``prompt_logprobs``, lm-eval's loglikelihood requests): pluginhost against transformers.

Each system gets a batch of prompts of one length (random token ids) on the
OPT-125m-shaped checkpoint, fp32, and returns, for every prompt token after the
first, its log-probability given the tokens before it and the most likely token's:

* ``pluginhost``: ``LLM.generate`` with ``SamplingParams(max_tokens=1, prompt_logprobs=1)``
  (its one generated token included), the outputs' ``prompt_logprobs`` as Python dicts;
* ``transformers``: one forward over the batch, ``log_softmax``, the prompt tokens' entries
  gathered and ``topk(1)``, as an evaluation harness over transformers computes them,
  left as tensors (no Python lists: the cheaper end of what a user reads).

A third figure, pluginhost's prefill of the same prompts without ``prompt_logprobs``,
shows what the scoring adds. Medians of ``--runs`` alternating runs.

    python benchmarks/bench_prompt_logprobs.py [--runs 5] [--batch 8] [--length 256]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import OPT_125M, checkpoint_dir, machine, median_alternating, random_prompts, report, setup_threads, timed
from transformers import AutoModelForCausalLM

from pluginhost import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    args = parser.parse_args()
    cores = setup_threads()
    path = checkpoint_dir("opt")
    print(f"{machine()}; {cores} threads; OPT-125m shape, fp32; {args.batch} prompts of {args.length} tokens")
    llm = LLM(str(path), load_installed_plugins=False, dtype="float32", device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(torch.Generator().manual_seed(0), args.batch, args.length, OPT_125M["vocab_size"])
    ids = torch.tensor(prompts)  # (B, T)
    scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    plain = SamplingParams(max_tokens=1, temperature=0)

    def transformers_scores() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            logprobs = reference(ids).logits[:, :-1].float().log_softmax(-1)  # (B, T - 1, V)
            return logprobs.gather(-1, ids[:, 1:, None])[..., 0], logprobs.topk(1, dim=-1).indices  # (B, T - 1)

    ours = llm.generate(prompts, scoring)  # warm up, and compare
    theirs, _ = transformers_scores()
    ours_chosen = torch.tensor(
        [
            [step[t] for step, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)]
            for o, p in zip(ours, prompts, strict=True)
        ]
    )
    print(f"largest difference of a prompt token's log-probability: {(ours_chosen - theirs).abs().max().item():.2e}")
    llm.generate(prompts, plain)
    figures = median_alternating(
        args.runs,
        pluginhost=lambda: timed(lambda: llm.generate(prompts, scoring)),
        transformers=lambda: timed(transformers_scores),
        prefill=lambda: timed(lambda: llm.generate(prompts, plain)),
    )
    for name, seconds in figures.items():
        print(f"  {name:<13} {', '.join(f'{s:.3f}' for s in seconds)} s")
    report(
        f"scoring {args.batch} x {args.length} tokens (time)",
        figures["pluginhost"],
        figures["transformers"],
        "s",
        better="lower",
        target="<= 1.0x",
    )
    prefill = statistics.median(figures["prefill"])
    added = statistics.median(figures["pluginhost"]) - prefill
    print(f"scoring added to pluginhost's own prefill: {added:.3f} s ({added / prefill:.0%})")


if __name__ == "__main__":
    main()
