"""Shared setup for the benchmarks: the OPT-125m-shaped checkpoint, timing and reporting."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "LLAMA_12L",
    "MODELS",
    "OPT_125M",
    "checkpoint_dir",
    "machine",
    "median_alternating",
    "pluginhost_tokens_per_second",
    "random_prompts",
    "report",
    "setup_threads",
    "timed",
    "transformers_tokens_per_second",
]

#: facebook/opt-125m's shape, with random weights (nothing can be downloaded).
OPT_125M = {
    "vocab_size": 50272,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "ffn_dim": 3072,
    "num_attention_heads": 12,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 2,
}


#: A Llama of about the same size: 12 layers, hidden 768, grouped-query attention 12/4.
LLAMA_12L = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

#: Benchmark models by name: (directory name, model type, config).
MODELS = {"opt": ("opt-125m-random", "opt", OPT_125M), "llama": ("llama-12x768-gqa-random", "llama", LLAMA_12L)}


def checkpoint_dir(model: str = "opt") -> Path:
    """A benchmark checkpoint (``MODELS``), random weights saved once with ``save_pretrained`` (fp32)."""
    name, model_type, config = MODELS[model]
    root = Path(os.environ.get("PLUGINHOST_BENCH_DIR", Path.home() / ".cache" / "pluginhost-bench"))
    path = root / name
    if not any(path.glob("*.safetensors")):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config)).save_pretrained(path)
    return path


def setup_threads() -> int:
    import torch

    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    return cores


def median_alternating(runs: int, **candidates: Callable[[], float]) -> dict[str, list[float]]:
    """Run each candidate ``runs`` times, alternating between them; each returns its figure."""
    results: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(runs):
        for name, run in candidates.items():
            results[name].append(run())
    return results


def timed(fn: Callable[[], object], device: Any = "cpu") -> float:
    """Seconds ``fn`` takes, its work on ``device`` included (CUDA runs asynchronously)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def random_prompts(generator: Any, batch: int, length: int, high: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` tokens: 2 (beginning of sequence), then ids drawn from [3, ``high``)."""
    import torch

    return [[2, *torch.randint(3, high, (length - 1,), generator=generator).tolist()] for _ in range(batch)]


def pluginhost_tokens_per_second(llm: Any, prompts: list[list[int]], new: int) -> float:
    """Greedy ``generate`` of ``new`` tokens per prompt, end-of-sequence ignored: generated tokens/s."""
    from pluginhost import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    return len(prompts) * new / timed(lambda: llm.generate(prompts, params), llm.config.device)


def transformers_tokens_per_second(model: Any, prompts: list[list[int]], new: int) -> float:
    """The same through transformers' ``generate``, as its users call it (prompts of equal length)."""
    import torch

    ids = torch.tensor(prompts, device=model.device)
    with torch.inference_mode():
        seconds = timed(
            lambda: model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=1,
            ),
            model.device,
        )
    return len(prompts) * new / seconds


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def report(title: str, ours: list[float], theirs: list[float], unit: str, *, better: str, target: str) -> float:
    """Print one figure as medians and the ratio pluginhost / transformers.

    ``better="higher"`` (throughput: the ratio should be large) or ``"lower"``
    (time or memory: the ratio should be small).
    """
    m_ours, m_theirs = statistics.median(ours), statistics.median(theirs)
    ratio = m_ours / m_theirs
    print(
        f"{title:<44} pluginhost {m_ours:9.3f} {unit:<6} transformers {m_theirs:9.3f} {unit:<6} "
        f"pluginhost/transformers {ratio:5.2f}x ({better} is better; target {target})"
    )
    return ratio
