"""Reading a model directory's weights: safetensors (preferred) or ``pytorch_model*.bin``.

Which files, as transformers' ``from_pretrained`` picks them: ``model.safetensors``,
else the files ``model.safetensors.index.json`` names, else ``pytorch_model.bin``,
else the files ``pytorch_model.bin.index.json`` names; only without any of
these every ``*.safetensors`` (else every ``pytorch_model*.bin``). Files beside
the chosen ones (Mistral's ``consolidated.safetensors``, a LoRA
``adapter_model.safetensors``) are not read.

Tensors are streamed one at a time, already converted to the target device and
dtype, so a model is never held twice in memory. Every tensor handed over is in
memory the engine owns, so a model never changes, nor crashes the process, if
its file is rewritten or truncated while it runs. safetensors checks each
file; the data is then read straight into such memory, so a tensor that needs
no conversion is handed over as it is. ``.bin`` files are read with
``torch.load(weights_only=True, mmap=True)``, which refuses pickled code and
maps the file rather than reading it whole; each tensor is then copied out of
the mapping (by its conversion, or on its own when it needs none). A legacy
(pre-zipfile) ``.bin`` cannot be mapped: it is read whole, one file at a time.
Files are only ever read.

Before anything is read, every tensor is placed: it must come from exactly one
file (the one the index names, when there is an index), no large tensor may
be larger than the whole model, and the weights must fit where they go: in host
memory on the CPU; on a GPU in its free memory, host memory then holding only
the tensor in passing (a tensor-parallel rank keeps its share of the weights,
and the ranks on one machine share its host memory); a legacy ``.bin``'s
tensors are known only once it is read whole, so they are placed then and not
counted. Weight files must lie inside the model directory, or be a file in a
Hugging Face cache's ``models--<org>--<name>/blobs`` folder (where a cache
snapshot's links point, and those of a ``--local-dir`` download by
huggingface_hub < 0.23); ``allow_external`` lets an index or a link point
elsewhere. Weights that are not finite are reported by name (or refused),
once the model has taken what it keeps: a stale buffer it skips does not count.

Progress goes to a tqdm bar on stderr for checkpoints over 256 MiB; tqdm hides
it when stderr is not a terminal, and ``TQDM_DISABLE=1`` hides it always.
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch
from torch import nn

from pluginhost.envflags import env_flag
from pluginhost.errors import CheckpointError, ConfigError
from pluginhost.model_dir import read_json

__all__ = ["Checkpoint", "find_checkpoint", "report_nonfinite"]

logger = logging.getLogger(__name__)

_SAFETENSORS = "model.safetensors"
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN = "pytorch_model.bin"
_BIN_INDEX = "pytorch_model.bin.index.json"
_PROGRESS_MIN_BYTES = 256 * 2**20
#: Names of non-finite tensors listed in a warning.
_NONFINITE_SHOWN = 10


@dataclass(frozen=True)
class Checkpoint:
    """The weight files of a model directory, in reading order."""

    format: str  # "safetensors" or "bin"
    files: tuple[Path, ...]
    #: With an index: tensor name -> the file the index names for it.
    index: Mapping[str, Path] | None = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def tensors(
        self,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_numel: int | None = None,
        share: float = 1.0,
        sharers: int = 1,
        nonfinite: list[str] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs; floating-point tensors converted to ``dtype``, all moved to ``device``.

        ``max_numel``: the whole model's size in elements (parameters and buffers); a larger
        tensor cannot be this model's and, when large too (over ``_LEFT_TO_THE_MODEL``
        elements), is refused before anything is read. A smaller one is left to the model,
        which skips it or refuses it as not fitting: old checkpoints carry stale buffers the
        models skip, causal masks of (n_positions, n_positions) that may be larger than a
        whole small model (GPT-2's ``attn.bias``).

        ``share``: the part of the weights kept on ``device`` (a tensor-parallel rank's share of the model);
        ``sharers``: the processes on this machine loading at once (its tensor-parallel ranks), which share its
        host memory. Both only size the memory check.

        ``nonfinite``: where to list the floating-point tensors that are not finite (inf or nan) in ``dtype``, for
        the caller to judge once the model has taken what it keeps (:func:`report_nonfinite`); without it, they
        are warned about here, once all are read.
        """
        from tqdm.auto import tqdm

        if self.format == "safetensors":
            plan = self._place_safetensors(max_numel, dtype, device, share, sharers)
            reads = (pair for path in self.files for pair in _read_safetensors(path, plan[path]))
        else:
            reads = self._read_bins(max_numel, dtype, device, share, sharers)
        # A .bin's tensors live in its memory-mapped file: each is copied out, by its conversion or on its own.
        copy = self.format == "bin"
        total = self.nbytes
        # TQDM_DISABLE is tqdm's own switch, but tqdm ignores it when disable= is passed, as here.
        quiet = total < _PROGRESS_MIN_BYTES or env_flag("TQDM_DISABLE", strict=False)
        found: list[str] = [] if nonfinite is None else nonfinite
        # disable=None: tqdm shows the bar only when stderr is a terminal.
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc="loading weights",
            disable=True if quiet else None,
            leave=False,
        ) as progress:
            for name, tensor in reads:
                progress.update(tensor.numel() * tensor.element_size())  # bytes read, as in the total
                if tensor.is_floating_point():
                    tensor = _convert(name, tensor, device, dtype, copy=copy)
                    # Checked in the engine's dtype: a value too large for it (fp32 -> fp16) counts too.
                    if not bool(torch.isfinite(tensor).all()):
                        found.append(name)
                else:
                    tensor = _convert(name, tensor, device, None, copy=copy)
                yield name, tensor
        if found and nonfinite is None:
            logger.warning("%s", _nonfinite(found, dtype, "of the checkpoint"))

    def _place_safetensors(
        self, max_numel: int | None, dtype: torch.dtype, device: torch.device, share: float, sharers: int
    ) -> dict[Path, list[str]]:
        """Which tensors to read from which file, every tensor from exactly one place; checked before reading."""
        from safetensors import SafetensorError, safe_open

        where: dict[str, Path] = {}
        plan: dict[Path, list[str]] = {}
        tally = _Tally()
        for path in self.files:
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f, path.open("rb", buffering=0) as raw:
                    names = list(f.keys())  # noqa: SIM118 - safe_open is not a mapping
                    entries, _ = _safetensors_entries(raw)
            except MemoryError as exc:
                raise CheckpointError(_too_big(path, exc)) from None
            except (SafetensorError, OSError, ValueError, KeyError) as exc:
                raise CheckpointError(f"Cannot read {path}: it is not a valid safetensors file ({exc}).") from None
            kept = []
            for name in names:
                numel = math.prod(entries[name]["shape"])
                self._place(name, numel, path, where, max_numel)
                kept.append(name)
                kind = entries[name]["dtype"]
                stored = _STORED_BYTES.get(kind, 8)
                tally.add(numel, stored, dtype.itemsize if kind.startswith(("F", "BF")) else stored)
            plan[path] = kept
        self._check_all_held(where)
        tally.check(share, device, sharers, dtype)
        return plan

    def _check_all_held(self, held: Mapping[str, Path]) -> None:
        """Refuse an index naming tensors no file holds (its shards are not the ones it was written for)."""
        if self.index is None:
            return
        absent = sorted(set(self.index) - set(held))
        if absent:
            raise CheckpointError(
                f"The index names {len(absent)} tensor(s) its shards do not hold: {', '.join(absent[:5])}"
                + (" ..." if len(absent) > 5 else "")
            )

    def _read_bins(
        self, max_numel: int | None, dtype: torch.dtype, device: torch.device, share: float, sharers: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each file's tensors, placed and checked as the safetensors ones before any is read.

        Every file is memory-mapped first, which reads only its pickle (names, shapes, dtypes), not its data: the
        mappings are file pages the system can drop, not memory taken. A legacy (pre-zipfile) file cannot be mapped:
        knowing its tensors means reading it whole, the memory the check is there to spare, so it is read in its turn,
        as before, its tensors placed then and left out of the memory check.
        """
        held: dict[str, Path] = {}
        states = {path: _map_bin(path) for path in self.files}
        tally = _Tally()
        for path, state in states.items():
            for name, tensor in (state or {}).items():
                self._place(name, tensor.numel(), path, held, max_numel)
                stored = tensor.element_size()
                tally.add(tensor.numel(), stored, dtype.itemsize if tensor.is_floating_point() else stored)
        if all(state is not None for state in states.values()):
            self._check_all_held(held)  # before reading, as for safetensors (a legacy file's names are known later)
        tally.check(share, device, sharers, dtype)
        for path in self.files:
            state = states.pop(path)  # dropped once handed over: its mapping (or a legacy file's memory) goes with it
            if state is None:
                state = _read_bin_whole(path)
                for name, tensor in state.items():
                    self._place(name, tensor.numel(), path, held, max_numel)
            for name in list(state):  # popped as handed over: a legacy file's tensors (read whole) go as copied
                yield name, state.pop(name)
        self._check_all_held(held)

    def _place(self, name: str, numel: int, path: Path, held: dict[str, Path], max_numel: int | None) -> None:
        """Record in ``held`` that ``path`` holds tensor ``name``, of ``numel`` elements; refused when the index places
        it elsewhere, when another file holds it too, or when it is larger than the whole model."""
        if self.index is not None and self.index.get(name) != path:
            listed = self.index.get(name)
            raise CheckpointError(
                f"Tensor {name} is in {path.name}, but the index places it in "
                f"{listed.name if listed else 'no file'}: a tensor must come from one place. "
                "Fix the index, or remove the stray copy."
            )
        if name in held:
            raise CheckpointError(
                f"Tensor {name} is in both {held[name].name} and {path.name}: a tensor must come from one "
                "place. Remove the stray file (or add an index naming the right one)."
            )
        if _not_this_models(numel, max_numel):
            raise CheckpointError(
                f"Tensor {name} in {path.name} has {numel:,} elements, more than the whole model "
                f"({max_numel:,}): it is not this model's. Is it the right checkpoint?"
            )
        held[name] = path


@dataclass
class _Tally:
    """What the weights take in memory, counted before reading: all of them as converted, and the largest tensor as
    read or as converted (it is held in both forms for a moment)."""

    total: int = 0
    largest: int = 0

    def add(self, numel: int, stored: int, converted: int) -> None:
        """A tensor of ``numel`` elements, ``stored`` bytes each in the file, ``converted`` bytes each in memory."""
        self.total += numel * converted
        self.largest = max(self.largest, numel * max(stored, converted))

    def check(self, share: float, device: torch.device, sharers: int, dtype: torch.dtype) -> None:
        """``_check_memory`` for ``share`` of the total (a rank's part of a split model)."""
        _check_memory(math.ceil(self.total * share), self.largest, device, sharers, dtype)


#: Elements up to which a tensor larger than the whole model is left to the model (64 MiB in float32): a
#: stale causal mask it skips, (n_positions, n_positions) of up to 4096 positions, can be larger than a small
#: model; another model's weights, the fault the size check is for, hold larger tensors.
_LEFT_TO_THE_MODEL = 2**24


def _not_this_models(numel: int, max_numel: int | None) -> bool:
    """Whether a tensor of ``numel`` elements is refused before reading, for a model of ``max_numel``."""
    return max_numel is not None and numel > max(max_numel, _LEFT_TO_THE_MODEL)


#: Bytes per element of safetensors' dtypes as stored (floating ones are then converted to the engine's dtype).
_STORED_BYTES = {
    **{"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1},
    **{"I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1},
}


def report_nonfinite(model: nn.Module, read: Sequence[str], *, dtype: torch.dtype, refuse: bool) -> None:
    """Warn about the tensors of ``model`` that hold values not finite, or refuse them, once it has loaded.

    ``read``: the checkpoint's tensors that were not finite as read (``Checkpoint.tensors``' ``nonfinite``); the
    model is looked at only when there are some. Only what it keeps counts (its parameters and persistent
    buffers): old checkpoints carry stale buffers the models skip, such as GPT-NeoX's ``attention.masked_bias``
    (-1e9: -inf in float16).
    """
    if not read:
        return
    kept: list[str] = []
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.is_floating_point() and not tensor.is_meta and id(tensor) not in seen:
            seen.add(id(tensor))  # a tied tensor once
            if not bool(torch.isfinite(tensor).all()):
                kept.append(name)
    if not kept:
        logger.info(
            "Not finite in %s, but the model does not keep them (stale buffers it skips, or another rank's share): %s",
            dtype,
            ", ".join(read),
        )
        return
    if refuse:
        raise CheckpointError(_nonfinite(kept, dtype, "the model loaded", refused=True))
    logger.warning("%s", _nonfinite(kept, dtype, "the model loaded"))


def _nonfinite(names: Sequence[str], dtype: torch.dtype, whose: str, *, refused: bool = False) -> str:
    """The warning (or refusal) naming tensors that are not finite."""
    shown = ", ".join(names[:_NONFINITE_SHOWN]) + (" ..." if len(names) > _NONFINITE_SHOWN else "")
    found = f"{len(names)} tensor(s) {whose} hold values that are not finite (inf or nan) in {dtype}: {shown}"
    # Checked in the engine's dtype: a value beyond float16's range was finite as saved.
    hint = " Or values beyond float16's range (65504): use dtype bfloat16 or float32." if dtype == torch.float16 else ""
    if refused:
        return f"{found}: refused (refuse_nonfinite_weights is on). Is the checkpoint corrupt?{hint}"
    return (
        f"{found}. Generation from them is garbage: is the checkpoint corrupt?{hint} "
        "(refuse_nonfinite_weights=True refuses such a checkpoint)"
    )


def _check_memory(
    kept: int, largest: int, device: torch.device, sharers: int = 1, dtype: torch.dtype = torch.float32
) -> None:
    """Refuse weights that cannot fit where they go, before reading them.

    ``kept``: the bytes of the weights kept on ``device``; ``largest``: the largest tensor's, in passing (read,
    converted, cut into a rank's share) on top of them. On a GPU the weights need its free memory, and host
    memory holds only the tensor in passing; elsewhere they need host memory. ``sharers`` processes on this
    machine (tensor-parallel ranks) need the host's at once. ``dtype``, the weights' in memory: a 16-bit one is
    suggested only when it is smaller.
    """
    smaller = "use a 16-bit dtype (--dtype bfloat16), " if dtype.itemsize > 2 else ""
    if device.type == "cuda":
        free = _free_device_memory(device)
        if free is not None and kept + largest > free:
            raise CheckpointError(
                f"The weights need {_size(kept + largest)} on {device} and only {_size(free)} of its memory is free. "
                f"Free it (other processes on the GPU), {smaller}split the model over more GPUs "
                "(--tensor-parallel-size) or use a smaller model."
            )
        needed = largest * sharers
        what = f"On their way to {device}, the weights pass through host memory one tensor at a time: that needs"
    else:
        needed = (kept + largest) * sharers
        what = "The weights need"
    available = _available_memory()
    if available is not None and needed > available:
        ranks = f" ({sharers} tensor-parallel ranks on this machine)" if sharers > 1 else ""
        raise CheckpointError(
            f"{what} {_size(needed)}{ranks} in memory and only {_size(available)} is available. Free memory, "
            f"{smaller}or use a smaller model."
        )


def _size(size: int) -> str:
    """``12.3 GiB``, ``412 MiB`` or ``37 KiB``: never "0" for what is not nothing (a small model said 0.0 GiB)."""
    if size >= 1000 * 2**20:
        return f"{size / 2**30:.1f} GiB"
    if size >= 1000 * 2**10:
        return f"{size / 2**20:.0f} MiB"
    return f"{-(-size // 2**10)} KiB"  # rounded up


def _free_device_memory(device: torch.device) -> int | None:
    """The free memory of a CUDA ``device``, in bytes (``None`` when it cannot be asked)."""
    try:
        return int(torch.cuda.mem_get_info(device)[0])
    except (RuntimeError, AssertionError, ValueError):  # no driver, or torch built without CUDA
        return None


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _convert(
    name: str, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None, *, copy: bool
) -> torch.Tensor:
    """``tensor`` on ``device`` in ``dtype`` (``None``: its own); ``copy``: a new tensor even when nothing changes."""
    try:
        return tensor.to(device=device, dtype=dtype or tensor.dtype, copy=copy)
    except (RuntimeError, MemoryError) as exc:
        if isinstance(exc, MemoryError) or "alloc" in str(exc).lower() or "out of memory" in str(exc).lower():
            raise CheckpointError(f"Out of memory while loading tensor {name} onto {device}: {exc}") from None
        raise


def find_checkpoint(model_dir: Path, *, allow_external: bool = False) -> Checkpoint:
    """Locate the weights as transformers does (see the module's docstring); every file checked."""
    for fmt, single, index_name in (("safetensors", _SAFETENSORS, _SAFETENSORS_INDEX), ("bin", _BIN, _BIN_INDEX)):
        # The single file first, as from_pretrained: a leftover index beside it is not read.
        if (model_dir / single).is_symlink() or (model_dir / single).exists():  # a broken link: _checked says so
            return Checkpoint(fmt, (_checked(model_dir, model_dir / single, allow_external),))
        index = model_dir / index_name
        if index.is_file():
            files, placement = _files_from_index(index, allow_external)
            return Checkpoint(fmt, files, placement)
    # Neither a file nor an index transformers would read: every weight file, which must not overlap.
    safetensors = sorted(model_dir.glob("*.safetensors"))
    if safetensors:
        return Checkpoint("safetensors", tuple(_checked(model_dir, f, allow_external) for f in safetensors))
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    if bins:
        return Checkpoint("bin", tuple(_checked(model_dir, f, allow_external) for f in bins))
    raise CheckpointError(
        f"No weights in {model_dir}: expected *.safetensors (or {_SAFETENSORS_INDEX}) "
        f"or pytorch_model*.bin (or {_BIN_INDEX})."
    )


def _files_from_index(index: Path, allow_external: bool) -> tuple[tuple[Path, ...], dict[str, Path]]:
    try:
        weight_map = read_json(index)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a valid checkpoint index (needs a 'weight_map' object): {exc}") from None
    names = sorted(set(weight_map.values()))
    missing = [name for name in names if not (index.parent / name).exists()]
    if missing:
        raise CheckpointError(f"{index} lists shard(s) that are missing: {', '.join(missing)}.")
    files = {name: _checked(index.parent, index.parent / name, allow_external) for name in names}
    return tuple(files.values()), {tensor: files[name] for tensor, name in weight_map.items()}


def _checked(model_dir: Path, path: Path, allow_external: bool) -> Path:
    """``path`` if it is a regular file inside the model directory, or a blob of a Hugging Face cache.

    A cache snapshot's files link into its repository's ``blobs``; so do the large files of a ``--local-dir``
    download by huggingface_hub < 0.23 (``local_dir_use_symlinks="auto"``), from a directory anywhere.
    """
    if not path.is_file():
        if not path.exists():
            raise CheckpointError(f"The weight file {path} is missing (or a link to nothing).")
        raise CheckpointError(f"{path} is not a regular file: refusing to read it.")
    if allow_external:
        return path
    real = path.resolve()
    roots = [model_dir.resolve()]
    if model_dir.resolve().parent.name == "snapshots":  # the Hugging Face cache: snapshots link to ../../blobs
        roots.append(model_dir.resolve().parent.parent / "blobs")
    if not any(real.is_relative_to(root) for root in roots) and not _hugging_face_blob(real):
        raise CheckpointError(
            f"The weight file {path} is {real}, outside the model directory {model_dir}: refused. Copy the "
            "weights into the directory, or pass allow_external_weights=True (--allow-external-weights) if you "
            "trust where they are."
        )
    return path


def _hugging_face_blob(real: Path) -> bool:
    """Whether the resolved file ``real`` lies directly in a Hugging Face cache's ``models--<org>--<name>/blobs``."""
    return real.parent.name == "blobs" and real.parent.parent.name.startswith("models--")


def _read_safetensors(path: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        # safetensors validates the file (header, offsets, size); the data is then read straight
        # into tensors the engine owns, which is several times faster than safe_open's own readers
        # and never leaves a tensor backed by the file (rewriting or truncating it later is harmless).
        with safe_open(str(path), framework="pt", device="cpu") as f, path.open("rb", buffering=0) as raw:
            entries, data_start = _safetensors_entries(raw)
            for name in names:
                entry = entries[name]
                dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
                if dtype is None or sys.byteorder != "little":  # what the direct read does not cover
                    yield name, f.get_tensor(name).clone()
                    continue
                offset = data_start + entry["data_offsets"][0]
                try:
                    empty = torch.empty(entry["shape"], dtype=dtype)
                except RuntimeError as exc:  # more than the machine can allocate
                    raise CheckpointError(f"Out of memory reading tensor {name} of {path}: {exc}") from None
                yield name, _read_into(raw, offset, empty, path)
    except MemoryError as exc:
        raise CheckpointError(_too_big(path, exc)) from None
    except (SafetensorError, OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"Cannot read {path}: it is not a valid safetensors file ({exc}).") from None


def _too_big(path: Path, exc: BaseException) -> str:
    size = path.stat().st_size / 2**30
    return f"Cannot read {path} ({size:.1f} GiB): not enough memory ({exc}). Free memory, or use a smaller model."


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


def _map_bin(path: Path) -> dict[str, torch.Tensor] | None:
    """The state dict of a ``torch.save``d file, memory-mapped (copy a tensor before keeping it); ``None`` for a
    legacy (pre-zipfile) file, which cannot be mapped."""
    return _load_bin(path, mmap=True)


def _read_bin_whole(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of a ``torch.save``d file, read whole into memory (a legacy file, which cannot be mapped)."""
    state = _load_bin(path, mmap=False)
    assert state is not None  # only a mapping is declined
    return state


def _load_bin(path: Path, *, mmap: bool) -> dict[str, torch.Tensor] | None:
    """A ``torch.save``d state dict, refused as a CheckpointError unless it is one; ``None``: it cannot be mapped."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError as exc:
            if mmap and "mmap" in str(exc):  # legacy (pre-zipfile) files cannot be memory-mapped
                return None
            raise
    except pickle.UnpicklingError as exc:
        raise CheckpointError(_unpickling_refused(path, str(exc))) from None
    except MemoryError as exc:
        raise CheckpointError(_too_big(path, exc)) from None
    except OSError as exc:
        raise CheckpointError(f"Cannot read {path}: {_plain(exc)}.") from None
    except Exception as exc:  # noqa: BLE001 - cut short or garbled: torch.load's unpickler raises anything
        if "alloc" in str(exc).lower():
            raise CheckpointError(_too_big(path, exc)) from None
        detail = _plain(exc) or type(exc).__name__
        raise CheckpointError(f"Cannot read {path}: it is not a valid PyTorch checkpoint ({detail}).") from None
    # weights_only also allows other keys than names (an int, a tuple): no state dict either.
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(
            f"{path} does not hold a flat dictionary of tensors (a state dict, tensor names to tensors): is it a "
            "model's weights? Save them with torch.save(model.state_dict(), ...), or as safetensors."
        )
    return state


#: What torch's weights-only unpickler says when it refuses an object it does not allow (a class or function
#: the pickle would call: code), as opposed to bytes that are no pickle it can read.
_DISALLOWED = re.compile(
    r"GLOBAL (\S+) was not an allowed global|GLOBAL (\S+) whose module \S+ is blocked"
    r"|call reduce for unrecognized function (.+)|Can only (?:create new object|build) .* but got (.+)"
)


def _unpickling_refused(path: Path, message: str) -> str:
    """Why torch's weights-only unpickler refused ``path``: code it will not run, or no checkpoint at all.

    torch's own message is not passed on: it advises loading with ``weights_only=False``, which runs whatever
    the file holds, and it carries terminal colour codes.
    """
    found = _DISALLOWED.search(message)
    if found:
        what = next(group for group in found.groups() if group).rstrip(". ")
        if _names_nothing(what):
            return f"Cannot read {path}: it is not a valid PyTorch checkpoint (it names {what}, which does not exist)."
        return (
            f"Refused to load {path}: it holds pickled objects other than tensors ({what}), which could run code. "
            "Convert it to safetensors with a tool you trust."
        )
    detail = _plain(message.rpartition("WeightsUnpickler error:")[2].split("Check the documentation")[0])
    return f"Cannot read {path}: it is not a valid PyTorch checkpoint ({detail or 'not a pickle torch can read'})."


def _names_nothing(global_name: str) -> bool:
    """Whether a refused global's module is loaded and lacks it: a name cut short, as in a truncated legacy file.

    Only modules already imported are looked at: importing one a file names could run code.
    """
    module, _, attr = global_name.rpartition(".")
    return module in sys.modules and not hasattr(sys.modules[module], attr)


def _plain(message: object) -> str:
    """The first sentence of ``message``, on one line, without terminal escape codes (torch's are long)."""
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(message)).split())
    return text.split(". ")[0].rstrip(".")
