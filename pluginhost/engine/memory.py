"""How much memory a device has left, for the KV cache to grow into.

The KV cache is one block of rows x slots (``builtin_models.kv_cache``): a
single long sequence makes every row that long. Before the engine grows it,
the runner asks here whether the new block fits, so that a request the
machine cannot hold ends with an error saying so, instead of the allocator
failing mid-step or, on a CPU, the kernel's out-of-memory killer ending the
whole process (Linux hands out memory it does not have until it is touched).

On a CPU: ``MemAvailable`` of ``/proc/meminfo``; under cgroup limits (a
container, a systemd slice) what the tightest of the process's cgroup and its
parents leaves, reclaimable page cache not counted as used; under an
address-space limit (``ulimit -v``) what it leaves of the process's size; under
strict overcommit (``vm.overcommit_memory=2``) what may still be committed;
whichever is smallest. On CUDA: the device's free memory plus what torch's caching allocator
holds unused. Elsewhere (or when nothing can be read): unknown, and the cache
grows unchecked, as before.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from pathlib import Path

import torch

try:
    import resource
except ImportError:  # Windows: no address-space limit to read
    resource = None  # type: ignore[assignment]

__all__ = ["CACHE_SHARE", "available_bytes", "keep_freed_memory"]

#: The share of the available memory the KV cache may take when it grows: the rest is left for
#: activations, the logits and everything else the process and the machine need.
CACHE_SHARE = 0.9

_PROC_CGROUP = "/proc/self/cgroup"
_CGROUP_V2 = Path("/sys/fs/cgroup")
_CGROUP_V1 = Path("/sys/fs/cgroup/memory")


#: glibc's ``mallopt`` parameters (malloc.h) and the values ``keep_freed_memory`` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEPT_BELOW = 32 << 20  # glibc's largest mmap threshold on 64-bit: larger blocks (weights, the KV cache) go back
_TRIMMED_ABOVE = 1 << 30


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory a step frees for the next step; whether it could.

    Every step allocates temporaries of a few MiB (the logits of 32 rows, their softmax, the
    sampler's cumulative distributions). glibc hands such blocks back to the kernel when they are
    freed (mmapped blocks, and the heap's top past 128 KiB), and the next step faults them in again,
    page by page: on this project's 2-core VM, drawing 32 tokens from 50k-token logits took 8.4 ms
    that way, 1.3 ms with the memory kept. vLLM's CPU backend preloads tcmalloc for the same reason.
    Blocks of 32 MiB and more (weights, the KV cache) still go back when freed; the cost is a heap
    that keeps its largest size. Only for processes pluginhost owns (``generate``, ``serve``, the
    ranks it spawns): a process-wide setting is not a library's to change under an embedder. A
    ``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_MMAP_THRESHOLD_`` in the environment is the user's choice,
    and left alone; so is any C library other than glibc.
    """
    if {"MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"} & os.environ.keys():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEPT_BELOW)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIMMED_ABOVE))


def available_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can take now; ``None`` when that cannot be known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    meminfo = _kib("/proc/meminfo")
    limits = (meminfo.get("MemAvailable"), _cgroup_headroom(), _address_space_headroom(), _commit_headroom(meminfo))
    known = [b for b in limits if b is not None]
    return min(known) if known else None


def _kib(path: str) -> dict[str, int]:
    """Bytes of each ``name: <n> kB`` line of a ``/proc`` file (meminfo, self/status); ``{}`` if it cannot be read."""
    fields = {}
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(":")
            if value.rstrip().endswith(" kB"):
                fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return fields


def _address_space_headroom() -> int | None:
    """What the address-space limit (``ulimit -v``, ``RLIMIT_AS``) leaves of the process's size; ``None`` without one.

    MemAvailable does not see it: a cache growth the machine had room for failed in the allocator.
    """
    if resource is None:
        return None
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    size = _kib("/proc/self/status").get("VmSize") if limit != resource.RLIM_INFINITY else None
    if size is None:
        return None
    return max(0, limit - size)


def _commit_headroom(meminfo: Mapping[str, int]) -> int | None:
    """Under strict overcommit (``vm.overcommit_memory=2``) what may still be committed; ``None`` otherwise."""
    try:
        strict = Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "2"
    except OSError:
        return None
    limit, committed = meminfo.get("CommitLimit"), meminfo.get("Committed_AS")
    if not strict or limit is None or committed is None:
        return None
    return max(0, limit - committed)


def _cgroup_headroom() -> int | None:
    """What the process's memory cgroups still allow, the tightest of it and its parents; ``None`` without a limit.

    Page cache the kernel can reclaim (``inactive_file``: the checkpoint just read, say) does not count as used.
    """
    headrooms = [h for h in (_headroom(d, v2) for d, v2 in _cgroup_dirs()) if h is not None]
    return min(headrooms) if headrooms else None


def _cgroup_dirs() -> list[tuple[Path, bool]]:
    """The process's memory cgroup directories, innermost first, with whether each is cgroup v2."""
    try:
        lines = Path(_PROC_CGROUP).read_text().splitlines()
    except OSError:
        return []
    found: dict[bool, str] = {}  # v2 or not -> the process's path in that hierarchy
    for line in lines:
        if line.count(":") < 2:  # not a cgroup line: nothing to learn from it
            continue
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":  # v2: one unified hierarchy
            found[True] = path
        elif "memory" in controllers.split(","):  # v1's memory controller (preferred on a hybrid system)
            found[False] = path
    v2 = False not in found
    if v2 not in found:
        return []
    root = _CGROUP_V2 if v2 else _CGROUP_V1
    directory = root / found[v2].lstrip("/")
    return [(d, v2) for d in (directory, *directory.parents) if d == root or root in d.parents]


def _headroom(directory: Path, v2: bool) -> int | None:
    names = (
        ("memory.max", "memory.current", "inactive_file")
        if v2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    )
    try:
        limit_text = (directory / names[0]).read_text().strip()
        if limit_text == "max":
            return None
        limit, usage = int(limit_text), int((directory / names[1]).read_text().strip())
    except (OSError, ValueError):
        return None
    if limit >= 1 << 60:  # cgroup v1's "no limit" is a huge number
        return None
    reclaimable = 0
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == names[2]:
                reclaimable = int(value)
    except (OSError, ValueError):
        pass
    return max(limit - usage + reclaimable, 0)
