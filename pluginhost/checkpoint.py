"""Reading a model directory's weights: safetensors (preferred) or ``pytorch_model*.bin``.

Tensors are streamed one at a time, already converted to the target device and
dtype, so a model is never held twice in memory: safetensors files are read
with ``pread`` into memory the engine owns (memory-mapped with safetensors
older than 0.8), so a model never changes, nor crashes the process, if its
file is rewritten while it runs; a tensor that needs no conversion is handed
over as it is.
``.bin`` files are read with ``torch.load(weights_only=True)``, which refuses
pickled code. Files are only ever read.

Progress goes to a tqdm bar on stderr for checkpoints over 256 MiB; tqdm hides
it when stderr is not a terminal, and ``TQDM_DISABLE=1`` hides it always.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pluginhost.envflags import env_flag
from pluginhost.errors import CheckpointError

__all__ = ["Checkpoint", "find_checkpoint"]

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"
_PROGRESS_MIN_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Checkpoint:
    """The weight files of a model directory, in reading order."""

    format: str  # "safetensors" or "bin"
    files: tuple[Path, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def tensors(self, *, dtype: torch.dtype, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs; floating-point tensors converted to ``dtype``, all moved to ``device``."""
        from tqdm.auto import tqdm

        read = _read_safetensors if self.format == "safetensors" else _read_bin
        total = self.nbytes
        # TQDM_DISABLE is tqdm's own switch, but tqdm ignores it when disable= is passed, as here.
        quiet = total < _PROGRESS_MIN_BYTES or env_flag("TQDM_DISABLE")
        # disable=None: tqdm shows the bar only when stderr is a terminal.
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc="loading weights",
            disable=True if quiet else None,
            leave=False,
        ) as progress:
            for path in self.files:
                for name, tensor in read(path):
                    progress.update(tensor.numel() * tensor.element_size())  # bytes read, as in the total
                    if tensor.is_floating_point():
                        tensor = tensor.to(device=device, dtype=dtype)
                    else:
                        tensor = tensor.to(device=device)
                    yield name, tensor


def find_checkpoint(model_dir: Path) -> Checkpoint:
    """Locate the weights: a safetensors index or files, else a ``.bin`` index or files."""
    for index_name, fmt in ((_SAFETENSORS_INDEX, "safetensors"), (_BIN_INDEX, "bin")):
        index = model_dir / index_name
        if index.is_file():
            return Checkpoint(fmt, _files_from_index(index))
    safetensors = sorted(model_dir.glob("*.safetensors"))
    if safetensors:
        return Checkpoint("safetensors", tuple(safetensors))
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    if bins:
        return Checkpoint("bin", tuple(bins))
    raise CheckpointError(
        f"No weights in {model_dir}: expected *.safetensors (or {_SAFETENSORS_INDEX}) "
        f"or pytorch_model*.bin (or {_BIN_INDEX})."
    )


def _files_from_index(index: Path) -> tuple[Path, ...]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index} is not a valid checkpoint index (needs a 'weight_map' object): {exc}") from None
    files = tuple(index.parent / name for name in names)
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index} lists shard(s) that are missing: {', '.join(missing)}.")
    return files


def _read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError

    try:
        with _open_safetensors(path) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"Cannot read {path}: it is not a valid safetensors file ({exc}).") from None


def _open_safetensors(path: Path):  # noqa: ANN202 - safetensors' handle type is private
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu", backend="pread")
    except TypeError:  # safetensors < 0.8 has no backend choice: memory-mapped it is
        return safe_open(str(path), framework="pt", device="cpu")


def _read_bin(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):  # legacy (pre-zipfile) files cannot be memory-mapped
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"Refused to load {path}: it holds pickled objects other than tensors, which could run code. "
            f"Convert it to safetensors with a tool you trust. ({str(exc).splitlines()[0]})"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"Cannot read {path}: {exc}".rstrip(".") + ".") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a flat dictionary of tensors (a state dict).")
    yield from state.items()
