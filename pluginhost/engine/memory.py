"""How much memory a device has left, for the KV cache to grow into.

The KV cache is one block of rows x slots (``builtin_models.kv_cache``): a
single long sequence makes every row that long. Before the engine grows it,
the runner asks here whether the new block fits, so that a request the
machine cannot hold ends with an error saying so, instead of the allocator
failing mid-step or, on a CPU, the kernel's out-of-memory killer ending the
whole process (Linux hands out memory it does not have until it is touched).

On a CPU: ``MemAvailable`` of ``/proc/meminfo``, and under a cgroup limit (a
container) what that limit leaves, whichever is smaller. On CUDA: the device's
free memory plus what torch's caching allocator holds unused. Elsewhere (or
when nothing can be read): unknown, and the cache grows unchecked, as before.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["CACHE_SHARE", "available_bytes"]

#: The share of the available memory the KV cache may take when it grows: the rest is left for
#: activations, the logits and everything else the process and the machine need.
CACHE_SHARE = 0.9

_CGROUP_V2 = Path("/sys/fs/cgroup")
_CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def available_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can take now; ``None`` when that cannot be known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    known = [b for b in (_mem_available(), _cgroup_headroom()) if b is not None]
    return min(known) if known else None


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom() -> int | None:
    """What the process's memory cgroup still allows (v2, else v1); ``None`` without a limit."""
    for limit_file, usage_file in (
        (_CGROUP_V2 / "memory.max", _CGROUP_V2 / "memory.current"),
        (_CGROUP_V1 / "memory.limit_in_bytes", _CGROUP_V1 / "memory.usage_in_bytes"),
    ):
        try:
            limit_text = limit_file.read_text().strip()
            if limit_text == "max":
                return None
            limit, usage = int(limit_text), int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:  # cgroup v1's "no limit" is a huge number
            return None
        return max(limit - usage, 0)
    return None
