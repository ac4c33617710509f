"""Where a batch-1 decode step's time goes: the products, the rest of the forward, the engine loop.

OPT-125m shape (``--model opt``) or the Llama of ``bench_generate.py``
(``--model llama``), fp32, CPU, batch 1, one sequence at position 63 of a
64-slot cache. Each figure is the best of many repetitions, and the figures
are taken in interleaved rounds, so a drifting machine moves them together:

* ``engine step``: one decode step of ``LLM.generate`` (scheduler, forward,
  logits, sampling, outputs), the fastest of a 64-token generation;
* ``model step``: the forward and logits alone (``ModelRunner.run``);
* ``compiled step``: the same with ``compile_decode=True`` (compiled before
  the rounds; its compile time is printed);
* ``engine kernels``: every linear layer's product, back to back, through
  ``builtin_models.linear`` (the kernels calibration chose): the floor;
* ``F.linear``: the same products through plain ``F.linear``, as transformers
  multiplies;
* ``rest, warm``: the model step with every product replaced by a stored
  result, so the rest of the forward runs with its data in cache.

    python benchmarks/bench_decode_step.py [--model opt|llama] [--rounds 7]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from common import MODELS, checkpoint_dir, machine, setup_threads

from builtin_models.linear import Linear, linear
from pluginhost import LLM, SamplingParams
from pluginhost.engine.runner import StepInputs


def best_of(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="opt")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    cores = setup_threads()
    settings = {"load_installed_plugins": False, "device": "cpu", "dtype": "float32"}
    llm = LLM(str(checkpoint_dir(args.model)), **settings)
    compiled = LLM(str(checkpoint_dir(args.model)), compile_decode=True, **settings).engine.runner
    print(f"machine: {machine()}; threads: {cores}; model: {args.model} ({type(llm.model).__name__})")

    runner = llm.engine.runner
    prompt = [2, *range(100, 131)]
    stats = []
    llm.engine.stats_listeners.append(stats.append)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)

    def engine_step() -> float:
        stats.clear()
        llm.generate([prompt], params)
        return min(s.step_time_s for s in stats if not s.num_prompt_tokens)

    step = StepInputs("decode", num_rows=1, slots_needed=64, tokens=[5], positions=[63])
    linears = [(m.weight, m.bias) for m in llm.model.modules() if isinstance(m, torch.nn.Linear)]
    x = {w.shape[1]: torch.randn(1, w.shape[1]) for w, _ in linears}

    def products(kernel: Callable[..., torch.Tensor]) -> Callable[[], None]:
        @torch.inference_mode()
        def run() -> None:
            for w, b in linears:
                kernel(x[w.shape[1]], w, b)

        return run

    stored: dict[tuple, torch.Tensor] = {}

    def stored_product(self: Linear, input: torch.Tensor) -> torch.Tensor:
        key = (tuple(input.shape), self.weight.shape[0])
        if key not in stored:
            stored[key] = torch.randn(*input.shape[:-1], self.weight.shape[0]) * 0.01
        return stored[key]

    def rest_warm() -> float:
        forward = Linear.forward
        Linear.forward = stored_product  # every builtin model's products go through Linear
        try:
            runner.run(step)
            return best_of(lambda: runner.run(step), 50)
        finally:
            Linear.forward = forward

    figures: dict[str, list[float]] = {
        name: [] for name in ("engine step", "model step", "compiled step", "engine kernels", "F.linear", "rest, warm")
    }
    engine_step(), runner.run(step), products(linear)(), products(torch.nn.functional.linear)()  # warm up
    compiled.run(step)
    if compiled.compiled.failure is not None:
        print(f"compiling failed, the compiled step is eager: {compiled.compiled.failure!r}")
    print(f"compiling the decoding step: {compiled.compiled.compile_seconds:.1f} s")
    for _ in range(args.rounds):
        figures["engine step"].append(engine_step())
        figures["model step"].append(best_of(lambda: runner.run(step), 20))
        figures["compiled step"].append(best_of(lambda: compiled.run(step), 20))
        figures["engine kernels"].append(best_of(products(linear), 20))
        figures["F.linear"].append(best_of(products(torch.nn.functional.linear), 20))
        figures["rest, warm"].append(rest_warm())
    best = {name: min(values) * 1e3 for name, values in figures.items()}
    for name, ms in best.items():
        spread = f"{min(figures[name]) * 1e3:.2f}-{max(figures[name]) * 1e3:.2f}"
        print(f"{name:<15} {ms:7.2f} ms  (best of each round: {spread} ms)")
    floor = best["engine kernels"]
    for name in ("engine step", "model step", "compiled step"):
        share = 100 * (best[name] - floor) / best[name]
        print(f"{name} beyond the engine's kernels: {best[name] - floor:.2f} ms, {share:.1f}% of it (target < 10%)")
    in_place = best["model step"] - floor - best["rest, warm"]
    print(
        f"of the model step beyond the kernels: {best['rest, warm']:.2f} ms the other operations with warm data, "
        f"{in_place:.2f} ms the same work in place (data the weights evicted, products interleaved)"
    )


if __name__ == "__main__":
    main()
