"""Several callers at once: threads on one LLM, a build beside other threads' work, a short stress run."""

from __future__ import annotations

import random
import threading

import torch

from pluginhost import LLM, SamplingParams

PROMPTS = [[2, 17, 200, 31, 99, 5, 64, 11], [2, 300], [2, 7, 7, 7, 150, 42], [2, 9, 9], [2, 44, 45, 46, 47]]


def requests(seed: int, n: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.choice(PROMPTS)
        if rng.random() < 0.5:
            params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0, ignore_eos=True, logprobs=1)
        else:  # seeded sampling: its own random stream, whatever else runs
            params = SamplingParams(
                max_tokens=rng.randint(1, 12), temperature=0.9, seed=rng.randint(0, 99), ignore_eos=True
            )
        out.append((prompt, params))
    return out


def test_threads_calling_generate_on_one_llm_get_what_they_would_get_alone(tiny_opt):
    llm = LLM(str(tiny_opt), load_installed_plugins=False)
    jobs = [requests(seed, 6) for seed in range(6)]
    expected = [[llm.generate([p], params)[0].token_ids for p, params in job] for job in jobs]
    results: list = [None] * len(jobs)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = [llm.generate([p], params)[0].token_ids for p, params in jobs[i]]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and results == expected


def test_building_an_engine_leaves_other_threads_torch_state_alone(tiny_opt):
    """The build runs under a bf16 default and skipped initialisations, in its own thread only."""
    stop = threading.Event()
    seen: list[tuple[torch.dtype, bool]] = []

    def meanwhile() -> None:
        while not stop.is_set():
            layer = torch.nn.Linear(16, 16)
            seen.append((layer.weight.dtype, bool(layer.weight.abs().sum() > 0)))

    thread = threading.Thread(target=meanwhile)
    thread.start()
    try:
        for _ in range(3):
            llm = LLM(str(tiny_opt), load_installed_plugins=False, dtype="bfloat16")
            assert next(llm.model.parameters()).dtype == torch.bfloat16
    finally:
        stop.set()
        thread.join(30)
    assert seen and set(seen) == {(torch.float32, True)}
    assert torch.get_default_dtype() == torch.float32
