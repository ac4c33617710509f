"""Drawing the next tokens: pluginhost's sampler against transformers' and a per-row ``torch.multinomial``.

One step's logits over OPT-125m's vocabulary (50,272), float32, CPU, for a batch of
1, 8 or 32 sequences, each with its own seeded random stream (as a server's requests
have). Two kinds of logits: ``zipf``, a model-like distribution (token probabilities
falling as 1 / rank^1.1, scattered over the vocabulary), and ``flat`` (standard
normal logits, as a random model gives: top-p must then keep most of the
vocabulary). Three parameter sets: temperature 1 alone, temperature 0.7 with
top-p 0.9, temperature 0.7 with top-k 50.

Systems, alternating, best time of ``--rounds`` each:

* ``pluginhost``: ``pluginhost.engine.sampler.sample``, as the engine calls it;
* ``multinomial``: what pluginhost did before: per row, a full sort for top-p and
  ``torch.multinomial`` (an exponential number for each of the V tokens);
* ``transformers``: transformers' own warpers (``TemperatureLogitsWarper``,
  ``TopKLogitsWarper``, ``TopPLogitsWarper``) on the batch, then
  ``torch.multinomial``, as ``generate`` samples; transformers has one random
  stream for the whole batch, so it needs one call per sequence to give each its
  own: both figures are printed.

glibc keeps the memory a step frees for every system, as in ``pluginhost generate`` and ``serve``.

    python benchmarks/bench_sampling.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from common import OPT_125M, machine, setup_threads

from pluginhost.engine.memory import keep_freed_memory
from pluginhost.engine.sampler import SamplingState, sample
from pluginhost.sampling import SamplingParams

V = OPT_125M["vocab_size"]
PARAMS = {
    "temperature 1": SamplingParams(temperature=1.0),
    "t 0.7, top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "t 0.7, top-k 50": SamplingParams(temperature=0.7, top_k=50),
}


def logits_of(kind: str, batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if kind == "flat":
        return torch.randn(batch, V, generator=generator)  # (B, V)
    ranks = torch.stack([torch.randperm(V, generator=generator) for _ in range(batch)]) + 1  # (B, V)
    return -1.1 * ranks.double().log().float()  # log of 1 / rank^1.1, up to a constant


def pluginhost_sampler(logits: torch.Tensor, params: SamplingParams) -> Callable[[], object]:
    cpu = torch.device("cpu")
    generators = [torch.Generator().manual_seed(i) for i in range(len(logits))]
    states = [SamplingState(params, g, [0], frozenset(), V, cpu) for g in generators]
    return lambda: sample(logits, states)


def multinomial_sampler(logits: torch.Tensor, params: SamplingParams) -> Callable[[], object]:
    generators = [torch.Generator().manual_seed(i) for i in range(len(logits))]

    def run() -> list[int]:
        tokens = []
        for row, generator in zip(logits, generators, strict=True):
            row = row / params.temperature
            if 0 < params.top_k < V:
                row = row.masked_fill(row < torch.topk(row, params.top_k).values[-1], float("-inf"))
            if params.top_p < 1.0:
                sorted_logits, order = torch.sort(row, descending=True)  # (V,), (V,)
                probs = sorted_logits.softmax(dim=-1)
                drop = probs.cumsum(dim=-1) - probs >= params.top_p
                drop[0] = False
                row = row.masked_fill(drop.scatter(0, order, drop), float("-inf"))
            tokens.append(int(torch.multinomial(row.softmax(dim=-1), 1, generator=generator)))
        return tokens

    return run


def transformers_sampler(logits: torch.Tensor, params: SamplingParams, *, per_row: bool) -> Callable[[], object]:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if not per_row:
        return lambda: torch.multinomial(warpers(None, logits).softmax(dim=-1), 1)
    generators = [torch.Generator().manual_seed(i) for i in range(len(logits))]
    return lambda: [
        torch.multinomial(warpers(None, row[None]).softmax(dim=-1), 1, generator=g)
        for row, g in zip(logits, generators, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    setup_threads()
    keep_freed_memory()  # as pluginhost generate and serve do, for every system alike
    print(f"machine: {machine()}")
    print(f"vocabulary {V}, float32; best of {args.rounds} rounds, systems alternating; ms per step")
    systems = {
        "pluginhost": pluginhost_sampler,
        "multinomial": multinomial_sampler,
        "transformers": lambda x, p: transformers_sampler(x, p, per_row=False),
        "transformers, per row": lambda x, p: transformers_sampler(x, p, per_row=True),
    }
    print(f"{'logits':<6} {'batch':>5}  {'parameters':<18}" + "".join(f"{name:>23}" for name in systems))
    for kind in ("zipf", "flat"):
        for batch in args.batches:
            logits = logits_of(kind, batch)
            for label, params in PARAMS.items():
                runs = {name: make(logits, params) for name, make in systems.items()}
                best = dict.fromkeys(runs, float("inf"))
                for run in runs.values():
                    run()  # first-call costs stay out
                for _ in range(args.rounds):
                    for name, run in runs.items():
                        start = time.perf_counter()
                        run()
                        best[name] = min(best[name], time.perf_counter() - start)
                ours = best["pluginhost"]
                cells = [f"{best[n] * 1e3:9.2f} ({best[n] / ours:5.1f}x)" for n in runs]
                print(f"{kind:<6} {batch:>5}  {label:<18}" + "".join(f"{c:>23}" for c in cells), flush=True)
    print("\n(x): the system's time over pluginhost's; above 1x, pluginhost is faster")


if __name__ == "__main__":
    main()
