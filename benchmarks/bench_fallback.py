"""Decode speed of the transformers fallback (``TransformersForCausalLM``) against transformers' ``generate``.

The same weights on both sides: the OPT-125m-shaped checkpoint of the other
benchmarks, served through the fallback (``model_impl="transformers"``), and a
GPT-NeoX of the same size (Pythia-160m's shape: an architecture only the
fallback serves), random weights saved with ``save_pretrained``. fp32, CPU,
``torch.set_num_threads`` = cores, greedy, end-of-sequence ignored on both
sides, prompts of 32 tokens, medians of alternating runs. transformers runs as
its users run it: ``from_pretrained`` + ``generate``, default (``sdpa``)
attention. The fallback runs the same transformers modules, so the difference
is the engine around them (its static KV cache against transformers'
``DynamicCache``, one step loop against ``generate``'s). Target: not slower.

    python benchmarks/bench_fallback.py [--runs 3] [--new-tokens 128] [--models opt,gpt_neox] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch
from common import (
    checkpoint_dir,
    machine,
    median_alternating,
    pluginhost_tokens_per_second,
    random_prompts,
    report,
    setup_threads,
    transformers_tokens_per_second,
)

#: EleutherAI/pythia-160m's shape, with random weights.
PYTHIA_160M = {
    "vocab_size": 50304,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 2048,
    "rotary_pct": 0.25,
    "use_parallel_residual": True,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def gpt_neox_dir() -> Path:
    """A Pythia-160m-shaped GPT-NeoX, saved once beside the OPT checkpoint."""
    root = Path(os.environ.get("PLUGINHOST_BENCH_DIR", Path.home() / ".cache" / "pluginhost-bench"))
    path = root / "pythia-160m-random"
    if not (path / "model.safetensors").is_file():
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        torch.manual_seed(0)
        GPTNeoXForCausalLM(GPTNeoXConfig(**PYTHIA_160M)).save_pretrained(path)
    return path


def bench_model(model: str, runs: int, new: int, generator: torch.Generator) -> None:
    import transformers

    from pluginhost import LLM

    path, vocab = (checkpoint_dir(), 50272) if model == "opt" else (gpt_neox_dir(), 50304)
    llm = LLM(str(path), load_installed_plugins=False, device="cpu", dtype="float32", model_impl="transformers")
    assert type(llm.model).__name__ == "TransformersForCausalLM" and llm.model.cache_supported
    hf_class = getattr(transformers, type(llm.model.hf_model).__name__)
    hf = hf_class.from_pretrained(path, dtype=torch.float32).eval()
    # OPT has a native implementation too: how much the fallback gives up against it.
    native = LLM(str(path), load_installed_plugins=False, device="cpu", dtype="float32") if model == "opt" else None
    print(f"\n{model}: {type(llm.model.hf_model).__name__} from {path}")
    for batch in (1, 8):
        prompts = random_prompts(generator, batch, 32, vocab - 1)
        candidates = {
            "fallback": lambda p=prompts: pluginhost_tokens_per_second(llm, p, new),
            "transformers": lambda p=prompts: transformers_tokens_per_second(hf, p, new),
        }
        if native is not None:
            candidates["native"] = lambda p=prompts: pluginhost_tokens_per_second(native, p, new)
        for run in candidates.values():  # warm up
            run()
        results = median_alternating(runs, **candidates)
        title = f"{model} decode, batch {batch}, 32+{new} tokens"
        report(title, results["fallback"], results["transformers"], "tok/s", better="higher", target=">= 1.0x")
        if native is not None:
            ratio = statistics.median(results["fallback"]) / statistics.median(results["native"])
            print(
                f"{'':<44} native pluginhost OPT {statistics.median(results['native']):9.3f} tok/s: "
                f"fallback/native {ratio:5.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--models", default="opt,gpt_neox", help="comma-separated: opt, gpt_neox")
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: all cores; 1 is steadier on a shared machine)"
    )
    args = parser.parse_args()
    cores = setup_threads()
    if args.threads:
        torch.set_num_threads(cores := args.threads)
    print(f"machine: {machine()}; threads: {cores}")
    generator = torch.Generator().manual_seed(0)
    for model in args.models.split(","):
        bench_model(model, args.runs, args.new_tokens, generator)


if __name__ == "__main__":
    main()
