"""Load time and peak memory: checkpoint directory to ready-to-generate.

Each load runs in a fresh process, as a user's would: the main figures are
from interpreter start (imports included: each side imports what it needs)
to the end of the first forward pass, and the process's peak RSS
(``ru_maxrss``). Also shown: the load call alone, after each side's own
top-level imports (``from pluginhost import LLM`` plus transformers' ``OPTConfig``, which
both sides need / ``from transformers import OPTForCausalLM``), and the RSS it
added. OPT-125m shape, fp32, CPU; runs
alternate between pluginhost and transformers.

    python benchmarks/bench_load.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import checkpoint_dir, machine, report

CHILD = r"""
import time
process_start = time.perf_counter()
import json, os, resource, sys
import torch
torch.set_num_threads(os.cpu_count())
which, path = sys.argv[1], sys.argv[2]
if which == "ours":
    from pluginhost import LLM
    from transformers import OPTConfig  # what the other side's import brings too
    LLM, OPTConfig  # lazy attributes: import the modules now
else:
    from transformers import OPTForCausalLM
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
if which == "ours":
    model = LLM(path, load_installed_plugins=False, device="cpu", dtype="float32").model
else:
    model = OPTForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
with torch.inference_mode():  # ready means: one forward has run
    model(torch.tensor([[2, 5, 6]]), torch.arange(3)[None]) if which == "ours" else model(torch.tensor([[2, 5, 6]]))
end = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"process_seconds": end - process_start, "process_peak_mib": peak / 1024,
                  "load_seconds": end - start, "load_peak_mib": (peak - before) / 1024}))
"""


def load_once(which: str, path: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, which, str(path)],
        capture_output=True,
        text=True,
        check=True,
        env={"TQDM_DISABLE": "1", **__import__("os").environ},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    path = checkpoint_dir()
    print(
        f"machine: {machine()}; checkpoint: {sum(f.stat().st_size for f in path.glob('*.safetensors')) / 2**20:.0f} MiB"
    )
    samples: dict[str, list[dict[str, float]]] = {"ours": [], "theirs": []}
    for _ in range(args.runs):
        samples["ours"].append(load_once("ours", path))
        samples["theirs"].append(load_once("theirs", path))
    for key, title, unit in (
        ("process_seconds", "start to first forward, fresh process", "s"),
        ("process_peak_mib", "peak RSS of that process", "MiB"),
        ("load_seconds", "load call alone (after top-level imports)", "s"),
        ("load_peak_mib", "RSS added by the load call", "MiB"),
    ):
        report(
            title,
            [s[key] for s in samples["ours"]],
            [s[key] for s in samples["theirs"]],
            unit,
            better="lower",
            target="<= 1.0x",
        )


if __name__ == "__main__":
    main()
