"""What runtime hooks cost when no request uses them: decode step time with an idle logits processor.

OPT-125m shape, random weights, fp32, CPU, greedy decoding of 128 tokens after a
32-token prompt at batch 1 and 8. Three engines, run alternately:

* ``none``: no plugin;
* ``idle processor``: one logits processor that no request asks for (vLLM v1's
  usual shape: ``apply`` returns at once when it holds no request);
* ``every hook``: that processor plus ``on_request``, ``on_output`` and
  ``record_stats`` implementations that do nothing.

Target: the idle processor's decode step within 2% of none's. Whole steps move
by several percent between runs on a shared machine, so the script also times
the engine's own work alone: the same steps with the model's forward replaced
by stored logits (scheduling, processors, sampling, outputs), where a hook's
cost is not lost in the noise of the matrix products.

    python benchmarks/bench_hooks.py [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import checkpoint_dir, machine, random_prompts, setup_threads

from pluginhost import LLM, SamplingParams, hookimpl
from pluginhost.engine.runner import StepOutput
from pluginhost.logits_processors import LogitsProcessor


class IdleProcessor(LogitsProcessor):
    """Forces a token for requests that ask (``extra_args["force"]``); here none does."""

    def __init__(self, config, device) -> None:
        self.forced: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        if not batch_update:
            return
        for index, params, _, _ in batch_update.added:
            if params.extra_args and "force" in params.extra_args:
                self.forced[index] = params.extra_args["force"]
        for index in batch_update.removed:
            self.forced.pop(index, None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.forced:
            return logits
        raise AssertionError("no request asks for it in this benchmark")


class OneProcessor:
    @hookimpl
    def register_logits_processors(self, registry):
        registry.add(IdleProcessor)


class EveryHook(OneProcessor):
    @hookimpl
    def on_request(self, request):
        pass

    @hookimpl
    def on_output(self, request, output):
        pass

    @hookimpl
    def record_stats(self, stats):
        pass


def step_ms(llm: LLM, prompts: list[list[int]], new: int) -> float:
    """Median decode step (ms) of one generate call, from the engine's own step timings."""
    steps = []
    llm.engine.stats_listeners[:] = [steps.append]
    llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    return statistics.median(s.step_time_s for s in steps if not s.num_prompt_tokens) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    cores = setup_threads()
    path = str(checkpoint_dir())
    engines = {
        "none": LLM(path, load_installed_plugins=False),
        "idle processor": LLM(path, load_installed_plugins=False, plugins=[OneProcessor()]),
        "every hook": LLM(path, load_installed_plugins=False, plugins=[EveryHook()]),
    }
    print(f"machine: {machine()}; threads: {cores}")
    generator = torch.Generator().manual_seed(0)
    for batch in (1, 8):
        prompts = random_prompts(generator, batch, 32, 50000)
        for llm in engines.values():
            step_ms(llm, prompts, 8)  # warm up (and calibrate kernels)
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.runs):
            for name, llm in engines.items():
                times[name].append(step_ms(llm, prompts, args.new_tokens))
                time.sleep(0.1)
        base = statistics.median(times["none"])
        for name, values in times.items():
            m = statistics.median(values)
            print(
                f"batch {batch}, {name:<15} decode step {m:6.2f} ms (runs {min(values):.2f}-{max(values):.2f}); "
                f"{(m / base - 1) * 100:+5.1f}% against none"
            )
        engine_only = {name: engine_step_us(llm, prompts, args.new_tokens, args.runs) for name, llm in engines.items()}
        for name, us in engine_only.items():
            print(
                f"batch {batch}, {name:<15} engine work beyond the model {us:6.1f} us a step; "
                f"{us - engine_only['none']:+6.1f} us against none = {(us - engine_only['none']) / base / 10:+.2f}% "
                "of the decode step"
            )
    print("target: idle processor within 2% of none")


def engine_step_us(llm: LLM, prompts: list[list[int]], new: int, runs: int) -> float:
    """Best over ``runs`` of the median decode step (us) with the forward replaced by stored logits."""
    runner = llm.engine.runner
    stored = torch.randn(len(prompts), llm.vocab_size, generator=torch.Generator().manual_seed(1))
    # A fresh tensor, as a forward gives.
    runner.execute = lambda plan: StepOutput(stored[: len(plan.active_rows)].clone())
    try:
        step_ms(llm, prompts, 8)  # warm up: the first steps allocate
        return min(step_ms(llm, prompts, new) for _ in range(runs)) * 1000
    finally:
        del runner.execute


if __name__ == "__main__":
    main()
