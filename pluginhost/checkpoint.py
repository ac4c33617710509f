"""Reading a model directory's weights: safetensors (preferred) or ``pytorch_model*.bin``.

Tensors are streamed one at a time, already converted to the target device and
dtype, so a model is never held twice in memory. safetensors checks each
file; the data is then read straight into memory the engine owns, so a model
never changes, nor crashes the process, if its file is rewritten while it
runs; a tensor that needs no conversion is handed over as it is.
``.bin`` files are read with ``torch.load(weights_only=True)``, which refuses
pickled code. Files are only ever read.

Progress goes to a tqdm bar on stderr for checkpoints over 256 MiB; tqdm hides
it when stderr is not a terminal, and ``TQDM_DISABLE=1`` hides it always.
"""

from __future__ import annotations

import json
import pickle
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

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
    from safetensors import SafetensorError, safe_open

    try:
        # safetensors validates the file (header, offsets, size); the data is then read straight
        # into tensors the engine owns, which is several times faster than safe_open's own readers
        # and never leaves a tensor backed by the file (rewriting or truncating it later is harmless).
        with safe_open(str(path), framework="pt", device="cpu") as f, path.open("rb", buffering=0) as raw:
            entries, data_start = _safetensors_entries(raw)
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                entry = entries[name]
                dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
                if dtype is None or sys.byteorder != "little":  # what the direct read does not cover
                    yield name, f.get_tensor(name).clone()
                    continue
                offset = data_start + entry["data_offsets"][0]
                yield name, _read_into(raw, offset, torch.empty(entry["shape"], dtype=dtype), path)
    except (SafetensorError, OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"Cannot read {path}: it is not a valid safetensors file ({exc}).") from None


#: safetensors' dtype names that map one to one onto torch dtypes (little-endian, as the format is).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _safetensors_entries(raw: BinaryIO) -> tuple[dict[str, dict], int]:
    """The header (name -> dtype, shape, data_offsets) and where the data begins."""
    raw.seek(0)
    header_size = int.from_bytes(raw.read(8), "little")
    entries = json.loads(raw.read(header_size))
    entries.pop("__metadata__", None)
    return entries, 8 + header_size


def _read_into(raw: BinaryIO, offset: int, tensor: torch.Tensor, path: Path) -> torch.Tensor:
    """Fill ``tensor`` with the bytes at ``offset``: one read straight into its memory."""
    if tensor.numel() == 0:
        return tensor
    buffer = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    raw.seek(offset)
    done = 0
    while done < len(buffer):
        count = raw.readinto(buffer[done:])
        if not count:
            raise CheckpointError(f"Cannot read {path}: the file ends inside a tensor (is it still being written?).")
        done += count
    return tensor


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
