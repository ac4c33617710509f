"""Tensor parallelism on this machine: one process against the model split over two.

OPT-125m shape (or ``--model llama``), random weights, fp32, CPU, gloo. The
alternative a user has is not splitting: ``tensor_parallel_size=1`` with all
the cores, against ``2``, each rank with half of them. Reported per batch size
(greedy, 32-token prompts, ``--new`` tokens, end-of-sequence ignored): decode
tokens per second and the time of one decode step, medians of alternating
runs, and for one decode step on rank 0: the collectives (count and bytes),
the time spent inside them, and the time sending the step's inputs to the
other rank.

On a machine whose cores are few and shared, splitting a model this small is
expected to cost time, not save it: each step pays two all-reduces per layer
and an all-gather of the logits, and the halves of a product are too small to
use a core well. What the figures show is that cost.

    python benchmarks/bench_tp.py [--runs 3] [--batch 1 8] [--new 64] [--model opt|llama]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

from common import checkpoint_dir, machine, median_alternating, setup_threads, timed

PROMPT_LEN = 32
T = TypeVar("T")


def prompts(batch: int) -> list[list[int]]:
    return [[2, *range(100 + 7 * i, 100 + 7 * i + PROMPT_LEN - 1)] for i in range(batch)]


class Threads:
    """Runs with torch's thread count of this process set to ``count``, and the counts seen while they ran.

    One process holds both engines, and torch's thread count is process-wide: building the TP=2 engine
    lowers it to rank 0's share (until ``close``), so each engine's runs set their own count first.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.seen: set[int] = set()

    def __call__(self, fn: Callable[[], T]) -> T:
        import torch

        torch.set_num_threads(self.count)
        return fn()

    def note(self) -> None:
        """Record the count in effect now (called inside the timed region)."""
        import torch

        self.seen.add(torch.get_num_threads())

    def shown(self) -> str:
        return "/".join(str(n) for n in sorted(self.seen)) or "?"


def decode_step_seconds(llm: Any, batch: int, new: int, threads: Threads) -> float:
    """One decode step: the time of ``new`` tokens less that of the prefill and first token, over the rest."""
    from pluginhost import SamplingParams

    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    many = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)

    def generate(params: SamplingParams) -> None:
        llm.generate(prompts(batch), params)
        threads.note()

    return threads(lambda: (timed(lambda: generate(many)) - timed(lambda: generate(first))) / (new - 1))


def communication(llm: Any, batch: int) -> dict[str, float]:
    """The collectives of one decode step on rank 0: count, bytes, seconds inside them; seconds sending the step."""
    import torch.distributed as dist

    from pluginhost import SamplingParams

    counts = {"all_reduce": 0, "all_gather": 0, "bytes": 0, "collective_s": 0.0, "send_s": 0.0}
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast_object_list")}

    def wrap(name: str):  # noqa: ANN202
        original = originals[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = original(*args, **kwargs)
            elapsed = time.perf_counter() - start
            if name == "broadcast_object_list":
                counts["send_s"] += elapsed
            else:
                counts[name] += 1
                tensor = args[1] if name == "all_gather" else args[0]
                per_rank = tensor.numel() * tensor.element_size()
                counts["bytes"] += per_rank * (dist.get_world_size() if name == "all_gather" else 1)
                counts["collective_s"] += elapsed
            return result

        return counted

    # The second step (a decode) alone: the difference of two generations.
    runs = []
    for tokens in (1, 2):
        for key in counts:
            counts[key] = 0
        for name in originals:
            setattr(dist, name, wrap(name))
        try:
            llm.generate(prompts(batch), SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)
        runs.append(dict(counts))
    return {key: runs[1][key] - runs[0][key] for key in counts}


def _gloo_latency(rank: int, port: int, numel: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.zeros(numel)
    for _ in range(50):
        dist.all_reduce(x)
    start, n = time.perf_counter(), 300
    for _ in range(n):
        dist.all_reduce(x)
    if rank == 0:
        queue.put((time.perf_counter() - start) / n)
    dist.destroy_process_group()


def gloo_floor(numel: int) -> float:
    """Seconds of one gloo all-reduce of ``numel`` floats between two idle processes here: the floor."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    mp.start_processes(_gloo_latency, args=(port, numel, queue), nprocs=2, start_method="spawn")
    return queue.get(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--model", choices=["opt", "llama"], default="opt")
    args = parser.parse_args()
    cores = setup_threads()
    from pluginhost import LLM

    path = str(checkpoint_dir(args.model))
    print(f"machine: {machine()}; model: {args.model} ({path}), fp32, {args.runs} alternating runs")
    one = LLM(path, load_installed_plugins=False, dtype="float32")
    two = LLM(path, load_installed_plugins=False, dtype="float32", tensor_parallel_size=2)
    import torch

    # Building ``two`` set this process's thread count to rank 0's share; TP=1 runs with all the cores.
    tp1_threads, tp2_threads = Threads(cores), Threads(torch.get_num_threads())
    try:
        for batch in args.batch:
            for llm, threads in ((one, tp1_threads), (two, tp2_threads)):  # warm: kernel choices measured, caches grown
                decode_step_seconds(llm, batch, 4, threads)
            if batch == args.batch[0]:
                print(
                    f"threads: TP=1 {tp1_threads.shown()}; TP=2 {tp2_threads.shown()} per rank (rank 0 shown), "
                    "as in effect during the runs"
                )
            steps = median_alternating(
                args.runs,
                tp1=lambda b=batch: decode_step_seconds(one, b, args.new, tp1_threads),
                tp2=lambda b=batch: decode_step_seconds(two, b, args.new, tp2_threads),
            )
            t1, t2 = statistics.median(steps["tp1"]), statistics.median(steps["tp2"])
            print(
                f"batch {batch}: decode step TP=1 {t1 * 1000:.2f} ms ({batch / t1:.1f} tok/s; runs "
                f"{', '.join(f'{s * 1000:.1f}' for s in steps['tp1'])}), TP=2 {t2 * 1000:.2f} ms "
                f"({batch / t2:.1f} tok/s; runs {', '.join(f'{s * 1000:.1f}' for s in steps['tp2'])}): "
                f"TP=2 / TP=1 time {t2 / t1:.2f}x"
            )
            comm = tp2_threads(lambda b=batch: communication(two, b))
            print(
                f"  one decode step on rank 0: {comm['all_reduce']} all-reduces + {comm['all_gather']} all-gather, "
                f"{comm['bytes'] / 1024:.1f} KiB; {comm['collective_s'] * 1000:.2f} ms inside them "
                f"({comm['collective_s'] / t2:.0%} of the step), {comm['send_s'] * 1000:.2f} ms sending the step"
            )
    finally:
        two.close()  # gives back the thread count it found
    if len(tp1_threads.seen) > 1 or len(tp2_threads.seen) > 1:
        print(f"threads varied during the runs: TP=1 {tp1_threads.shown()}; TP=2 {tp2_threads.shown()}")
    hidden = 768
    floor = gloo_floor(hidden)
    print(
        f"gloo alone, two idle processes: one all-reduce of {hidden} floats (a batch-1 layer output) takes "
        f"{floor * 1e6:.0f} us here; a step's 25 collectives cost at least {25 * floor * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
