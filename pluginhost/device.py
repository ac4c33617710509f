"""Choosing the device and parameter dtype an engine builds its model for."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pluginhost.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["cpu_computes_bfloat16", "dtype_name", "resolve_device", "resolve_dtype"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    """The ``EngineConfig.dtype`` spelling of a parameter dtype (``torch.float32`` -> ``"float32"``)."""
    return next(name for name, value in _DTYPES.items() if value is dtype)


def resolve_device(device: str) -> torch.device:
    """``auto`` is the first CUDA device when one is available, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} was asked for, but CUDA is not available here; use 'cpu' or 'auto'.")
        index = resolved.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s) are visible."
            )
    return resolved


def checkpoint_dtype(hf_config: PretrainedConfig) -> torch.dtype | None:
    """The dtype config.json declares (``dtype``, or the older ``torch_dtype``), if any."""
    # transformers 4 keeps torch_dtype as an attribute; 5 reads it into dtype, and warns on reading torch_dtype.
    declared = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
    if isinstance(declared, str):
        declared = _DTYPES.get(declared.removeprefix("torch."))
    return declared if isinstance(declared, torch.dtype) else None


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AMX or AVX512-BF16), as vLLM's CPU backend asks."""
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # torch's own, private: absent on older ones
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def resolve_dtype(dtype: str, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """The parameter dtype: as asked, or for ``auto`` the checkpoint's where the device runs it well.

    Most CPUs convert half types to float32 inside every product, slowly, so ``auto`` gives float32 there
    for float16 and bfloat16 checkpoints; a CPU with bfloat16 arithmetic keeps a bfloat16 checkpoint in
    bfloat16 (half the memory; on an Intel Xeon with AMX a 512-token prefill took 0.15 s against 0.47 s
    in float32), as vLLM and transformers do. Ask for a dtype explicitly to override. CUDA devices without
    bfloat16 support get float16 instead.
    """
    if dtype != "auto":
        chosen = _DTYPES[dtype]
        if device.type == "cuda" and chosen is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"{device} does not support bfloat16; use float16 or float32.")
        return chosen
    declared = checkpoint_dtype(hf_config) or torch.float32
    if declared not in _DTYPES.values():
        return torch.float32
    if device.type == "cpu" and declared is not torch.float32:
        if declared is torch.bfloat16 and cpu_computes_bfloat16():
            return declared
        name = dtype_name(declared)
        logger.info("checkpoint is %s; using float32 on the CPU (--dtype %s, or dtype=%r, keeps it)", name, name, name)
        return torch.float32
    if device.type == "cuda" and declared is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return torch.float16
    return declared
