"""Weight-only int8 linear layers, and replacing a model's linear layers with them.

``Int8Linear`` keeps each output channel's weights as int8 with one scale per
channel (symmetric: ``w ~= q * scale``, ``q`` in [-127, 127], ``scale =
max|w| / 127`` rounded to bfloat16), and the bias as it was. Its forward
computes ``x @ (q * scale).T + bias`` by one of three kernels:

* ``int8pack``: ``torch.ops.aten._weight_int8pack_mm`` (PyTorch's weight-only
  int8 kernel, the one gpt-fast and torchao use), which reads the int8 weight
  as it lies. On CPU it is only vectorized for bfloat16 activations (fp32 and
  fp16 run 10-100x slower), so activations go in as bfloat16 and the result
  comes back in the model's dtype. Its cost grows with the rows: it wins
  decoding (a few rows), loses prefill.
* ``dequant_bf16``: the weight dequantized to bfloat16 for this call, then a
  bfloat16 matrix product (fast where the CPU has AVX512_BF16 or AMX): wins
  prefill.
* ``dequant``: the weight dequantized to the model's dtype for this call, then
  ``F.linear``: the fallback that always runs.

Which one runs is measured on first use for each (weight shape, bias, dtype,
device, row count rounded to a power of two), among the kernels that give the
right result here (below 8 rows, memory-bound, ``int8pack`` is taken untimed),
and kept for the process; ``PLUGINHOST_INT8_KERNEL=int8pack|dequant_bf16|dequant``
forces one. On CPU, ``int8pack`` is no candidate at all (never run, not even to
test it) for a weight whose ``in_features`` is not a multiple of its vector step
(8 elements; 16 where torch dispatches to AVX-512): that kernel reads each row in
whole steps with aligned loads and no remainder, so it returns garbage for one
row and mostly segfaults from two (torch 2.13), which no try/except can catch.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "DEQUANT",
    "DEQUANT_BF16",
    "INT8PACK",
    "KERNELS",
    "KERNEL_ENV",
    "Int8Linear",
    "QuantizationReport",
    "configure_kernels",
    "forced_kernel",
    "kernel_choices",
    "quantize_model",
    "quantize_weight",
    "reset_kernel_choice",
]

logger = logging.getLogger(__name__)

INT8PACK, DEQUANT_BF16, DEQUANT = "int8pack", "dequant_bf16", "dequant"
KERNELS = (INT8PACK, DEQUANT_BF16, DEQUANT)
KERNEL_ENV = "PLUGINHOST_INT8_KERNEL"

#: Quantized in blocks of about this many weights: the fp32 temporaries stay at ~16 MiB whatever the layer.
_CHUNK_ELEMENTS = 1 << 22
#: Row counts above this are timed at this many rows.
_MAX_TIMED_ROWS = 2048
#: Output channels checked against the exact result when measuring (a slice: no full-size fp32 copy).
_CHECKED_CHANNELS = 256
#: Up to this many rows, ``int8pack`` is taken untimed when it runs correctly (see ``_decide``).
_UNTIMED_ROWS = 7
#: Another kernel must beat ``int8pack`` by this much to be chosen instead.
_MARGIN = 0.9
#: Inputs go to ``_weight_int8pack_mm`` contiguous and aligned to this many bytes (its CPU kernel's aligned loads).
_INT8PACK_ALIGNMENT = 64
_SUPPORTED_DEVICES = ("cpu", "cuda")
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# -- quantizing ----------------------------------------------------------------------------------


def quantize_weight(weight: Tensor, *, name: str = "weight") -> tuple[Tensor, Tensor]:
    """``(q, scales)``: int8 ``(out, in)`` and bfloat16 ``(out,)``, with ``weight ~= q * scales[:, None]``.

    Symmetric, per output channel; a channel of zeros gets scale 1. Works block
    by block of rows on the weight's device, so the temporaries stay small.
    Raises ``ValueError`` for NaN or infinite weights, which have no int8 value.
    """
    w = weight.detach()
    out_features, in_features = w.shape
    q = torch.empty((out_features, in_features), dtype=torch.int8, device=w.device)
    scales = torch.empty(out_features, dtype=torch.bfloat16, device=w.device)
    step = max(1, _CHUNK_ELEMENTS // max(in_features, 1))
    for start in range(0, out_features, step):
        block = w[start : start + step].float()  # a view when already fp32: never written to
        amax = block.abs().amax(dim=1)
        if not bool(torch.isfinite(amax).all()):
            raise ValueError(
                f"{name} has NaN or infinite values, which int8 cannot represent. "
                "Set PLUGINHOST_INT8=0 to run this model unquantized."
            )
        # Rounded to bfloat16 once, here: every kernel then multiplies by exactly the same scales.
        s = (amax / 127).to(torch.bfloat16)
        s = torch.where(s > 0, s, torch.ones_like(s))  # a channel of zeros (or below bf16's range): any scale
        q[start : start + step] = torch.div(block, s.float()[:, None]).round_().clamp_(-127, 127)
        scales[start : start + step] = s
    return q, scales


class Int8Linear(nn.Module):
    """A linear layer with int8 weights and per-output-channel scales (inference only).

    Buffers ``qweight`` (out, in) int8 and ``scales`` (out,) bfloat16; ``bias``
    is the original layer's parameter (model dtype) or ``None``. There is no
    ``weight`` attribute: code that needs the float matrix calls
    :meth:`dequantized_weight`.
    """

    def __init__(self, qweight: Tensor, scales: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"qweight must be a 2-d int8 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
        if scales.shape != qweight.shape[:1]:
            raise ValueError(f"scales must have shape ({qweight.shape[0]},), got {tuple(scales.shape)}")
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        if bias is None or isinstance(bias, nn.Parameter):
            self.bias = bias
        else:
            self.bias = nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, name: str = "linear") -> Int8Linear:
        q, scales = quantize_weight(linear.weight, name=f"{name}.weight")
        return cls(q, scales, linear.bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight these int8 values stand for, ``q * scale``, as a new ``(out, in)`` tensor."""
        return (self.qweight.float() * self.scales.float()[:, None]).to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return int8_linear(x, self.qweight, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# -- the kernels ---------------------------------------------------------------------------------

_int8pack_op = getattr(torch.ops.aten, "_weight_int8pack_mm", None)


def _finish(y: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Add the bias (a bf16 result plus an fp32 bias promotes to fp32 in one pass) and return in ``dtype``."""
    if bias is not None:
        y = torch.add(y, bias)
    return y.to(dtype)


@functools.cache
def _int8pack_cpu_step() -> int:
    """The input size's step in ``_weight_int8pack_mm``'s CPU kernel: 16 bfloat16 with AVX-512, else 8.

    The kernel (aten/src/ATen/native/cpu/int8mm_kernel.cpp) walks each row of the input and of the weight in
    whole vector steps, with aligned loads and no remainder loop. An input size that is not a multiple of the
    step reads past the rows (and misaligns every row after the first): torch 2.13 on AVX2 gives garbage (NaN,
    inf, 1e30) for one row and, from two rows, a segfault (now and then garbage instead), whatever the output
    size. AVX2 and NEON step 8 elements, AVX-512 16 (read from the source: not run here); the scalar fallback
    takes any size, and 8 is asked of it too.
    """
    return 16 if "AVX512" in torch.backends.cpu.get_cpu_capability().upper() else 8


def _int8pack_takes(q: Tensor) -> bool:
    """Whether ``int8pack`` can run on weight ``q`` safely: it exists, and on CPU, ``in_features`` is whole steps.

    Checked before the kernel is ever run (even to test it), since what it does otherwise is a segfault, which
    kills the process. CUDA's kernel is a plain loop over the input size: any size.
    """
    if _int8pack_op is None:
        return False
    return q.device.type != "cpu" or q.shape[1] % _int8pack_cpu_step() == 0


def _run_int8pack(x2d: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    xb = x2d.to(torch.bfloat16)
    if not xb.is_contiguous() or xb.data_ptr() % _INT8PACK_ALIGNMENT:
        # A view (of a bfloat16 input, which .to returns as it is) may start anywhere: the CPU kernel's aligned
        # loads segfault on a start off 16 (AVX2) or 32 (AVX-512) bytes. A fresh tensor starts 64-byte aligned.
        xb = xb.clone(memory_format=torch.contiguous_format)
    return _finish(_int8pack_op(xb, q, scales), bias, x2d.dtype)  # (rows, out)


def _run_dequant_bf16(x2d: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    w = q.to(torch.bfloat16).mul_(scales[:, None])
    return _finish(F.linear(x2d.to(torch.bfloat16), w), bias, x2d.dtype)


def _run_dequant(x2d: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    if x2d.dtype == torch.float16:  # scales may lie below float16's normal range: scale in fp32
        w = (q.float() * scales.float()[:, None]).to(torch.float16)
    else:
        w = q.to(x2d.dtype).mul_(scales.to(x2d.dtype)[:, None])
    return F.linear(x2d, w, bias)


_RUNNERS: dict[str, Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]] = {
    INT8PACK: _run_int8pack,
    DEQUANT_BF16: _run_dequant_bf16,
    DEQUANT: _run_dequant,
}


def int8_linear(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ (q * scales[:, None]).T + bias`` by the kernel chosen for this shape and row count."""
    if torch.compiler.is_compiling():  # one opaque operation: the kernel is chosen when the step runs
        return _int8_linear_op(x, q, scales, bias)
    out_features, in_features = q.shape
    rows = x.numel() // in_features if in_features else 0
    if rows == 0 or x.shape[-1] != in_features:
        return _run_dequant(x.reshape(-1, x.shape[-1]), q, scales, bias).view(*x.shape[:-1], out_features)
    table = _table if _table is not None else _kernel_table()
    kernel = table.kernel(q, scales, bias, x, rows)
    y = _RUNNERS[kernel](x.reshape(rows, in_features), q, scales, bias)
    return y.view(*x.shape[:-1], out_features)


@torch.library.custom_op("pluginhost_int8::linear", mutates_args=())
def _int8_linear_op(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`int8_linear` as a PyTorch operator, for compiled code (``torch.compile`` cannot follow the kernel
    table: a decoding step compiled in six pieces and ran slower than eager)."""
    return int8_linear(x, q, scales, bias)


@_int8_linear_op.register_fake
def _(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[:-1] + (q.shape[0],))


Key = tuple[int, int, bool, torch.dtype, str, int]  # out, in, bias, activation dtype, device type, row bucket


class _KernelTable:
    """The kernel for each key: forced, or the fastest correct one, measured once per process."""

    def __init__(self, forced: str | None) -> None:
        self.forced = forced
        self._choices: dict[Key, str] = {}
        self._lock = threading.Lock()

    def kernel(self, q: Tensor, scales: Tensor, bias: Tensor | None, x: Tensor, rows: int) -> str:
        key = (
            q.shape[0],
            q.shape[1],
            bias is not None,
            x.dtype,
            x.device.type,
            min(rows, _MAX_TIMED_ROWS).bit_length(),
        )
        choice = self._choices.get(key)
        if choice is None:
            with self._lock:
                choice = self._choices.get(key) or self._decide(q, scales, bias, x, min(rows, _MAX_TIMED_ROWS))
                self._choices[key] = choice
        return choice

    def choices(self) -> dict[str, str]:
        return {_describe(key): kernel for key, kernel in sorted(self._choices.items(), key=lambda kv: str(kv[0]))}

    def _decide(self, q: Tensor, scales: Tensor, bias: Tensor | None, x: Tensor, rows: int) -> str:
        candidates = [k for k in KERNELS if k != INT8PACK or _int8pack_takes(q)]
        if self.forced is not None:
            if self.forced in candidates and self._correct(self.forced, q, scales, bias, x, rows):
                return self.forced
            logger.warning("%s=%s cannot run a %s weight here; measuring instead", KERNEL_ENV, self.forced, _shape(q))
        generator = torch.Generator().manual_seed(rows)
        sample = torch.randn(rows, q.shape[1], generator=generator).to(device=x.device, dtype=x.dtype)
        if rows <= _UNTIMED_ROWS and INT8PACK in candidates:
            # A few rows are bound by memory traffic, and the dequantizing kernels move several times the
            # int8 weight's bytes: no need to time them (timing on a busy machine can only mislead here).
            if self._correct(INT8PACK, q, scales, bias, x, rows, sample=sample):
                return INT8PACK
        with torch.inference_mode():
            runnable = [name for name in candidates if self._correct(name, q, scales, bias, x, rows, sample=sample)]
            times = _time_alternating(
                {name: (lambda name=name: _RUNNERS[name](sample, q, scales, bias)) for name in runnable}, x.device
            )
        best = min(times, key=times.__getitem__) if times else DEQUANT
        if INT8PACK in times and times[best] > _MARGIN * times[INT8PACK]:
            best = INT8PACK  # on a near tie: fewer switches between kernels (and their roundings) with the rows
        logger.debug(
            "int8 linear %s, %d rows of %s: %s (%s)",
            _shape(q),
            rows,
            x.dtype,
            best,
            ", ".join(f"{n} {t * 1e6:.0f} us" for n, t in times.items()),
        )
        return best

    @staticmethod
    def _correct(
        name: str, q: Tensor, scales: Tensor, bias: Tensor | None, x: Tensor, rows: int, sample: Tensor | None = None
    ) -> bool:
        """Whether kernel ``name`` runs here and matches the exact product on the first output channels."""
        if sample is None:
            generator = torch.Generator().manual_seed(rows)
            sample = torch.randn(rows, q.shape[1], generator=generator).to(device=x.device, dtype=x.dtype)
        try:
            with torch.inference_mode():
                y = _RUNNERS[name](sample, q, scales, bias)
                n = min(_CHECKED_CHANNELS, q.shape[0])
                w = q[:n].float() * scales[:n].float()[:, None]
                expected = F.linear(sample.float(), w, None if bias is None else bias[:n].float())
                # bf16 activations or results: 8 bits of mantissa, so errors of 2^-8 of the magnitudes summed.
                tolerance = 2**-6 * (F.linear(sample.float().abs(), w.abs()).max().item() + 1)
                ok = y.shape == (rows, q.shape[0]) and (y[:, :n].float() - expected).abs().max().item() <= tolerance
        except RuntimeError as exc:
            logger.debug("int8 kernel %s cannot run a %s weight: %s", name, _shape(q), exc)
            return False
        if not ok:
            logger.warning("int8 kernel %s gave a wrong result for a %s weight; not used", name, _shape(q))
        return ok


def _time_alternating(candidates: dict[str, Callable[[], object]], device: torch.device) -> dict[str, float]:
    """Each candidate's best time, over rounds that run every candidate once (at least 3 rounds, ~5 ms each).

    Alternating, a burst of other load on the machine slows every candidate, not just the one it lands on.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = dict.fromkeys(candidates, float("inf"))
    for fn in candidates.values():  # warm-up
        fn()
    sync()
    spent, rounds = 0.0, 0
    while rounds < 3 or (spent < 0.005 * len(candidates) and rounds < 50):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            sync()
            elapsed = time.perf_counter() - start
            best[name], spent = min(best[name], elapsed), spent + elapsed
        rounds += 1
    return best


def _shape(q: Tensor) -> str:
    return f"{q.shape[0]}x{q.shape[1]}"


def _describe(key: Key) -> str:
    out, inp, has_bias, dtype, device, b = key
    low, high = 1 << (b - 1), (1 << b) - 1
    rows = f"rows {low}" if low == high else f"rows {low}-{high}"
    return f"{out}x{inp}{'+bias' if has_bias else ''} {str(dtype).removeprefix('torch.')} {device} {rows}"


_table: _KernelTable | None = None


def forced_kernel() -> str | None:
    """The kernel ``PLUGINHOST_INT8_KERNEL`` forces, or ``None`` (measure); ``ValueError`` if it is unknown."""
    forced = os.environ.get(KERNEL_ENV, "").strip() or None
    if forced is not None and forced not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}={forced!r} must be one of {', '.join(KERNELS)}")
    return forced


def _kernel_table() -> _KernelTable:
    """The process's kernel table, made on first use (``PLUGINHOST_INT8_KERNEL`` is read then, once)."""
    global _table
    if _table is None:
        _table = _KernelTable(forced_kernel())
    return _table


def configure_kernels() -> None:
    """Read ``PLUGINHOST_INT8_KERNEL`` now (``ValueError`` if unknown) and make the table the products use from it
    (a changed value starts a new one): a value set only while the engine is built holds for its products."""
    global _table
    forced = forced_kernel()
    if _table is None or _table.forced != forced:
        _table = _KernelTable(forced)


def reset_kernel_choice() -> None:
    """Forget every choice and read ``PLUGINHOST_INT8_KERNEL`` again on next use (tests, benchmarks)."""
    global _table
    _table = None


def kernel_choices() -> dict[str, str]:
    """The kernel chosen for each (shape, bias, dtype, device, rows) met so far."""
    return _kernel_table().choices()


# -- replacing a model's linear layers -------------------------------------------------------------


@dataclass
class QuantizationReport:
    """What :func:`quantize_model` did; kept on the model as ``model.int8_report``."""

    quantized: list[str] = field(default_factory=list)
    #: Linear layers left in float, with the reason.
    skipped: dict[str, str] = field(default_factory=dict)
    #: Quantized layers whose float weight stays in memory because another module shares it (tied embeddings).
    tied: dict[str, str] = field(default_factory=dict)
    #: Bytes of the quantized layers' float weights before, and of their int8 weights and scales after.
    float_bytes: int = 0
    int8_bytes: int = 0
    #: Float bytes still held by the tied weights.
    tied_bytes: int = 0

    def summary(self) -> str:
        text = f"quantized {len(self.quantized)} linear layer(s) to int8: weights {_mib(self.float_bytes)}"
        text += f" -> {_mib(self.int8_bytes)}"
        if self.tied:
            text += "; still in float for the modules that share them: " + ", ".join(
                f"{name} (tied to {owner})" for name, owner in self.tied.items()
            )
            text += f" ({_mib(self.tied_bytes)})"
        if self.skipped:
            text += "; left in float: " + ", ".join(f"{name} ({why})" for name, why in self.skipped.items())
        return text


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _plain_linear_forwards() -> set:
    forwards = {nn.Linear.forward}
    try:
        from builtin_models.linear import Linear

        forwards.add(Linear.forward)
    except ImportError:  # pragma: no cover - pluginhost always ships builtin_models
        pass
    return forwards


def quantize_model(model: nn.Module, skip: Iterable[str] = ()) -> QuantizationReport:
    """Replace every linear layer of ``model`` with an :class:`Int8Linear`, one layer at a time, in place.

    ``skip``: ``fnmatch`` patterns of module names (``"lm_head"``,
    ``"decoder.layers.0.*"``) to leave in float. Layers whose class changes
    what ``forward`` computes (a subclass of ``nn.Linear`` with its own
    forward other than pluginhost's ``builtin_models.linear.Linear``) are left
    in float too, and reported. Each layer's float weight is released as soon
    as its replacement is in place (unless another module shares it), so
    memory never holds much more than the model plus one layer's temporaries.

    Raises ``ValueError`` for a model on a device other than CPU or CUDA, or
    with weights that are not float32, bfloat16 or float16.
    """
    skip = tuple(skip)
    plain = _plain_linear_forwards()
    conv1d = _conv1d_class()
    report = QuantizationReport()

    def linear(m: nn.Module) -> bool:
        return isinstance(m, nn.Linear) or (conv1d is not None and type(m) is conv1d)

    # Names only: holding the modules would keep every float weight alive until the end.
    names = [name for name, m in model.named_modules(remove_duplicate=False) if linear(m)]
    _check_supported(model, names)
    owners = _parameter_owners(model)
    done: dict[int, Int8Linear] = {}  # id of a replaced layer -> its replacement (a layer used in two places)
    shared: dict[int, tuple[Tensor, Tensor]] = {}  # id of a float weight -> its int8 values and scales
    kept: list[str] = []  # layers left in float: what is inside them stays as they use it (LoRA's lora_a, lora_b)
    for name in names:
        module = model.get_submodule(name)
        if not linear(module):  # replaced already, through another name
            continue
        if id(module) in done:
            _set_submodule(model, name, done[id(module)])
            continue
        outer = next((k for k in kept if name.startswith(k + ".")), None)
        reason = f"inside {outer}, left in float" if outer else _skip_reason(name, module, skip, plain, conv1d)
        if reason is not None:
            report.skipped[name] = reason
            kept.append(name)
            continue
        weight = module.weight
        if id(weight) not in shared:
            # transformers' Conv1D (GPT-2 through the fallback) holds the weight transposed: (in, out).
            values = weight.t() if type(module) is conv1d else weight
            shared[id(weight)] = quantize_weight(values, name=f"{name}.weight")
            report.float_bytes += weight.numel() * weight.element_size()
            q, scales = shared[id(weight)]
            report.int8_bytes += q.numel() * q.element_size() + scales.numel() * scales.element_size()
            others = [owner for owner in owners.get(id(weight), ()) if not linear(model.get_submodule(owner))]
            if others:
                report.tied[name] = others[0]
                report.tied_bytes += weight.numel() * weight.element_size()
        q, scales = shared[id(weight)]
        replacement = Int8Linear(q, scales, module.bias)
        done[id(module)] = replacement
        _set_submodule(model, name, replacement)
        report.quantized.append(name)
        del module, weight  # the float weight goes now, not at the end of the loop
    for pattern in skip:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):  # a typo, or another model's names
            logger.warning(
                "int8_quant: PLUGINHOST_INT8_SKIP pattern %r matches no linear layer of %s, so it keeps nothing in "
                "float (its linear layers are named like %s)",
                pattern,
                type(model).__name__,
                ", ".join(names[-3:]),
            )
    return report


def _conv1d_class() -> type | None:
    """transformers' ``Conv1D``, a linear layer with its weight transposed (GPT-2 under the fallback)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - pluginhost depends on transformers
        return None
    return Conv1D


def _skip_reason(name: str, module: nn.Module, skip: tuple[str, ...], plain: set, conv1d: type | None) -> str | None:
    for pattern in skip:
        if fnmatch.fnmatchcase(name, pattern):
            return f"PLUGINHOST_INT8_SKIP matches {pattern!r}"
    if type(module) is conv1d:
        return None if module.weight.dim() == 2 else f"weight of shape {tuple(module.weight.shape)}"
    if type(module).forward not in plain:
        return f"{type(module).__name__} has its own forward"
    if module.weight.dim() != 2:
        return f"weight of shape {tuple(module.weight.shape)}"
    return None


def _check_supported(model: nn.Module, names: list[str]) -> None:
    for name in names:
        weight = model.get_submodule(name).weight
        if weight.device.type not in _SUPPORTED_DEVICES:
            raise ValueError(
                f"int8 quantization runs on CPU and CUDA models; {name}.weight is on {weight.device}. "
                "Set PLUGINHOST_INT8=0 to run this model unquantized."
            )
        if weight.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(
                f"int8 quantization takes float32, bfloat16 or float16 weights; {name}.weight is {weight.dtype}. "
                "Set PLUGINHOST_INT8=0 to run this model unquantized."
            )


def _parameter_owners(model: nn.Module) -> dict[int, list[str]]:
    """Every parameter's id -> the names of the modules that hold it directly."""
    owners: dict[int, list[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(module_name)
    return owners


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)
