"""Which CPU kernel computes each linear layer: measured on this machine, once, and remembered.

PyTorch ships two fp32 matrix-product libraries on CPU, MKL (behind
``F.linear``) and oneDNN, and oneDNN can be asked for ``weight @ x.T`` instead
of ``x @ weight.T`` (the weight then streams as the large operand, which
suits decoding's few rows), or be given the weight packed ahead in its own
layout (``builtin_models.packed_weights``: faster at a few rows, at the cost of
a second copy of the weight). Which is fastest depends on the CPU (AVX2 or
AVX-512, cores, caches), the weight's shape and the number of rows: on one
AMD EPYC with AVX2, oneDNN's swapped product won decoding and MKL prefill; on
an AVX-512 EPYC, oneDNN is twice as fast as MKL at every row count. So the
engine measures instead of guessing.

For each (weight shape, bias or not, row count rounded to a power of two) a
layer meets, the first call times every kernel that computes the right result
on the real weight, in two interleaved rounds, keeps the fastest, and never
looks again. A kernel other than ``F.linear`` must beat it by 3% in every
round. Calibration has a time budget: 1.5 s per process in all and 0.5 s per
measurement. Past the process's budget, the fixed row-count thresholds decide,
for this process only, and a later process measures what is left; a
measurement past its own cap on a weight larger than the last-level cache (too
large to time quickly here) is left to the fixed thresholds for good, saved as
such, or every later process would spend its budget on it again; on a smaller
weight it means a busy machine, and serves this process only. A choice is saved
only if its timings were steady: both rounds pick the same kernel, and no
kernel's two rounds differ by more than 25%. Otherwise the machine was busy,
and the choice serves this process only.

Few rows are timed as decoding meets them, with the weight coming from
memory rather than from the cache: a step streams every layer's weights, far
more than the last-level cache holds, so kernels are timed over enough copies
of the weight to overflow it (timed hot, a 768 x 768 product looked the same
through MKL and oneDNN on an AVX-512 EPYC; cold, as in decoding, oneDNN took
80 us and MKL 140); a cache reported larger than 64 MiB (a VM's host's) is
taken as 64 MiB, or the copies would take each measurement past its cap (on a
CPU whose cache really is that large, few-row timings then run partly hot).
Choices are saved per machine (CPU model and vector extensions, threads, torch
version) in the user cache (``$PLUGINHOST_CACHE_DIR``, else ``~/.cache/pluginhost``), written
atomically so concurrent processes never leave a broken file; a file that
cannot be read is ignored and replaced. Switches:

* ``PLUGINHOST_PLAIN_LINEAR=1``: ``F.linear`` for every product;
* ``PLUGINHOST_LINEAR_KERNEL=f_linear|onednn|onednn_swapped|onednn_packed``: that kernel for every product it can do;
* ``PLUGINHOST_PACKED_WEIGHTS=0``: no packed copies of the weights (``builtin_models.packed_weights``), so
  the packed kernel is not a candidate;
* ``PLUGINHOST_KERNEL_CALIBRATION=0``: no measuring; fixed row-count thresholds (the fallback).

The first that applies wins, in that order: ``PLUGINHOST_PLAIN_LINEAR=1`` overrides
``PLUGINHOST_LINEAR_KERNEL`` (with a warning if that names another kernel), and a forced kernel makes
``PLUGINHOST_KERNEL_CALIBRATION`` moot; a forced packed kernel with ``PLUGINHOST_PACKED_WEIGHTS=0`` is oneDNN
on the plain weight (with a warning). The three on/off switches take 1, true, yes, on or 0, false, no, off
(any case; unset or empty is the default: plain linear off, packed weights on, calibration on). A value that is none of
these, or an unknown kernel name, is ignored with a warning naming the variable and the accepted values
(they are read at the first product, which a typo must not fail).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from pluginhost.envflags import env_flag

__all__ = [
    "CALIBRATION_ENV",
    "FIXED_THRESHOLDS",
    "F_LINEAR",
    "KERNELS",
    "KERNEL_ENV",
    "ONEDNN",
    "ONEDNN_PACKED",
    "ONEDNN_SWAPPED",
    "PACKED_WEIGHTS_ENV",
    "PLAIN_LINEAR_ENV",
    "KernelTable",
    "machine_key",
    "onednn_op",
    "packing_allowed",
]

logger = logging.getLogger(__name__)

F_LINEAR, ONEDNN, ONEDNN_SWAPPED, ONEDNN_PACKED = "f_linear", "onednn", "onednn_swapped", "onednn_packed"
KERNELS = (F_LINEAR, ONEDNN, ONEDNN_SWAPPED, ONEDNN_PACKED)

PLAIN_LINEAR_ENV = "PLUGINHOST_PLAIN_LINEAR"
PACKED_WEIGHTS_ENV = "PLUGINHOST_PACKED_WEIGHTS"
KERNEL_ENV = "PLUGINHOST_LINEAR_KERNEL"
CALIBRATION_ENV = "PLUGINHOST_KERNEL_CALIBRATION"

#: The fallback when nothing is measured: thresholds measured on one AVX2 EPYC.
FALLBACK_SWAPPED_MAX_ROWS = 24
FALLBACK_ONEDNN_MAX_ROWS = 128
FALLBACK_ONEDNN_MIN_WEIGHT_ELEMENTS = 2**17

#: Row counts above this are timed at this many rows (the ranking no longer changes; the timing would).
_MAX_TIMED_ROWS = 2048
#: The swapped product is only tried up to this many rows: beyond, transposing its output costs too much.
#: (Like the next limit, the top of a row bucket: a choice serves every row count of its bucket.)
_SWAPPED_MAX_ROWS = 63
#: Up to this many rows a product is bound by reading its weight, and is timed with the weight cold.
_COLD_MAX_ROWS = 63
#: The cache a cold timing overflows is taken as at most this large: a 2-vCPU Xeon VM reports its host's 480 MiB,
#: and reading twice that took every measurement past its cap, so no process there ever calibrated. The trade: on
#: a CPU whose last-level cache really is larger (Emerald or Granite Rapids, 320-504 MiB shared by a socket), few-row
#: products are timed partly hot; reading more would cost each measurement its cap and up to a GiB of copies.
_LARGEST_CPU_CACHE = 64 << 20
#: A kernel must beat F.linear by this much (in every round) to be chosen: noise never picks a slower one.
_MARGIN = 0.97
#: Seconds of calibration a table (the process's) may spend in all; then the fixed thresholds decide.
_BUDGET_S = 1.5
#: Seconds one measurement (one shape and row bucket) may take; past it, the fixed thresholds decide it.
_MEASUREMENT_CAP_S = 0.5
#: Each kernel is timed in this many rounds, interleaved; a choice is saved only if the rounds agree.
_ROUNDS = 2
#: ... and no kernel's rounds differ by more than this factor (more: the machine was busy, timings disturbed).
_MAX_SPREAD = 1.25
#: What ``choices()`` says where the fixed thresholds decide (calibration off, or past its time).
FIXED_THRESHOLDS = "fixed thresholds"
#: 2: few rows timed with cold weights (version 1 timed them hot, and chose badly for decoding); 3: the packed
#: kernel is a candidate (a version 2 file never measured it).
_CACHE_VERSION = 3
#: A larger file is not a kernel cache (each choice takes about 30 bytes).
_MAX_CACHE_BYTES = 1 << 20
#: A choice as the cache names it: ``<out>x<in>[+bias]/<row bucket>``.
_ENTRY = re.compile(r"([1-9][0-9]{0,8})x([1-9][0-9]{0,8})(\+bias)?/([1-9][0-9]?)")

Key = tuple[int, int, bool, int]  # out features, in features, bias, row bucket


def onednn_op() -> Callable[..., Tensor] | None:
    """oneDNN's fp32 linear kernel, if this PyTorch has it and it computes correctly here."""
    if not torch.backends.mkldnn.is_available():
        logger.debug("this PyTorch has no oneDNN: F.linear for every product")
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise.default
        # Explicit device and dtype: the first import may run under a meta device or a half default dtype.
        x, w, b = (torch.ones(shape, dtype=torch.float32, device="cpu") for shape in ((2, 3), (4, 3), (4,)))
        if torch.equal(op(x, w, b, "none", [], ""), F.linear(x, w, b)):
            return op
        logger.warning("oneDNN's linear kernel gave a wrong result on a self-check; using F.linear throughout")
    except (AttributeError, RuntimeError) as exc:
        logger.debug("oneDNN's linear kernel is missing (%s): F.linear for every product", exc)
    return None


#: The CPU flags a kernel's speed depends on: vector and matrix extensions (x86's avx*, amx*, fma; Arm's sve, ...).
_ISA_FLAG = re.compile(r"(avx|amx|fma|f16c|sse4|asimd|sve|sme(?!p)|i8mm|bf16)")  # not smep: a protection


def machine_key() -> str:
    """What a measurement depends on: CPU model and vector extensions, threads, torch version, architecture.

    The model name alone does not tell an AVX2 EPYC from an AVX-512 one, whose kernels rank differently.
    """
    cpu, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name == "model name" and cpu is None:
                cpu = value.strip()
            elif name in ("flags", "Features") and not flags:  # x86, Arm
                flags = {flag for flag in value.split() if _ISA_FLAG.match(flag)}
    except OSError:
        pass
    if cpu is None:  # not Linux: platform.processor() may run `uname -p`, so only when needed
        cpu = platform.processor() or platform.machine()
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")()  # what torch's kernels use
    isa = " ".join([capability, *sorted(flags)])
    return f"{cpu} | {isa} | {torch.get_num_threads()} threads | torch {torch.__version__} | {platform.machine()}"


def _bucket(rows: int) -> int:
    """Row counts that share a kernel choice: 1, 2-3, 4-7, 8-15, ..."""
    return min(rows, _MAX_TIMED_ROWS).bit_length()


def _bucket_top(bucket: int) -> float:
    """The most rows bucket ``bucket`` holds (the last one holds any number)."""
    return (1 << bucket) - 1 if bucket < _bucket(_MAX_TIMED_ROWS) else float("inf")


assert all(_bucket(n) < _bucket(n + 1) for n in (_SWAPPED_MAX_ROWS, _COLD_MAX_ROWS)), "limits must be bucket tops"


Runner = Callable[[Tensor, Tensor, Tensor | None], Tensor]
"""``(x2d, weight, bias) -> y2d``. A runner may also have ``prepare(weight)`` and ``run_prepared(x2d, prepared,
bias)``: calibration then times it on weights prepared ahead (the packed kernel's copies), as the engine meets them."""


class KernelTable:
    """The kernel for each (weight shape, bias, row bucket): forced, measured, or the fixed fallback.

    ``runners`` maps kernel names to ``(x2d, weight, bias) -> y2d``; ``timer``
    times a zero-argument function (seconds), ``clock`` tells the time (for the
    budget: ``budget_s`` in all, ``measurement_cap_s`` per measurement), and
    ``cache_file`` (or ``None``) keeps the measurements, made on ``machine``
    (default: :func:`machine_key` now).
    """

    def __init__(
        self,
        runners: dict[str, Runner],
        *,
        mode: str = "measure",
        cache_file: Path | None = None,
        timer: Callable[[Callable[[], object]], float] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        budget_s: float | None = None,
        measurement_cap_s: float | None = None,
        machine: str | None = None,
    ) -> None:
        if mode not in ("measure", "fallback", *KERNELS):
            raise ValueError(f"unknown kernel mode {mode!r}")
        self.runners = runners
        self.mode = mode
        self.cache_file = cache_file
        #: The machine the cache file's choices were measured on (a file naming another is ignored).
        self.machine = machine if machine is not None or cache_file is None else machine_key()
        self._timer = timer or _time
        self._clock = clock
        self.budget_s = _BUDGET_S if budget_s is None else budget_s
        self.measurement_cap_s = _MEASUREMENT_CAP_S if measurement_cap_s is None else measurement_cap_s
        self._spent = 0.0  # seconds of calibration so far
        self._choices: dict[Key, str] = {}
        self._unsaved: set[Key] = set()  # choices for this process only: fixed thresholds, disturbed timings
        self._budget_logged = self._disturbed_logged = False
        self._lock = threading.Lock()
        self._cache_loaded = False
        self._cache_warned = False
        self._cache_unreadable_logged = False

    @classmethod
    def from_environment(cls, runners: dict[str, Runner]) -> KernelTable:
        """The table the engine uses: the switches above, the cache file of this machine."""
        forced = os.environ.get(KERNEL_ENV, "").strip()
        if _switch(PLAIN_LINEAR_ENV, default=False, otherwise="F.linear is not forced"):
            if forced and forced != F_LINEAR:
                logger.warning(
                    "%s=%r is overridden by %s: F.linear for every product", KERNEL_ENV, forced, PLAIN_LINEAR_ENV
                )
            return cls(runners, mode=F_LINEAR)
        if forced:
            if forced not in KERNELS:
                logger.warning("%s=%r is not one of %s; measuring instead", KERNEL_ENV, forced, ", ".join(KERNELS))
            elif forced == ONEDNN_PACKED and forced not in runners and ONEDNN in runners:
                logger.warning(
                    "%s=%s, but weights are not packed here (%s, or this PyTorch cannot): oneDNN on the plain weights",
                    KERNEL_ENV,
                    forced,
                    f"{PACKED_WEIGHTS_ENV}=0" if not packing_allowed() else "its self-check failed",
                )
                return cls(runners, mode=ONEDNN)
            else:
                return cls(runners, mode=forced)
        if not _switch(CALIBRATION_ENV, default=True, otherwise="measuring"):
            return cls(runners, mode="fallback")
        from pluginhost.paths import user_cache_dir

        # The candidates too: choices made without one (PLUGINHOST_PACKED_WEIGHTS=0) must not stand in for it later.
        machine = f"{machine_key()} | kernels {' '.join(runners)}"
        digest = hashlib.sha256(machine.encode()).hexdigest()[:16]
        try:
            cache_dir = user_cache_dir()
        except (RuntimeError, KeyError, OSError) as exc:  # no home directory (a container's arbitrary user, env -i)
            logger.info("kernel choices are not remembered: no cache directory (%s); set PLUGINHOST_CACHE_DIR", exc)
            return cls(runners, machine=machine)
        return cls(runners, cache_file=cache_dir / f"linear-kernels-{digest}.json", machine=machine)

    def kernel(self, weight: Tensor, bias: Tensor | None, rows: int) -> str:
        """The kernel for ``rows`` rows through ``weight``: looked up, or decided now (once)."""
        key = (weight.shape[0], weight.shape[1], bias is not None, _bucket(rows))
        choice = self._choices.get(key)
        if choice is None:
            with self._lock:
                choice = self._choices.get(key) or self._decide(key, weight, bias, rows)
                self._choices[key] = choice
        if choice == FIXED_THRESHOLDS:  # per row count: a threshold may fall inside a bucket
            return _fallback(weight, bias, rows) if ONEDNN in self.runners else F_LINEAR
        return choice

    def known(self, out_features: int, in_features: int, has_bias: bool, rows: int) -> str | None:
        """The kernel already chosen for this shape and ``rows`` (``None``: not decided yet, or by thresholds)."""
        choice = self._choices.get((out_features, in_features, has_bias, _bucket(rows)))
        return None if choice == FIXED_THRESHOLDS else choice

    def choices(self) -> dict[str, str]:
        """Every choice made so far, as ``"2304x768+bias rows 8-15": "onednn"`` (or ``"fixed thresholds"``)."""
        return {_describe(key): kernel for key, kernel in sorted(self._choices.items())}

    # -- deciding -----------------------------------------------------------------------

    def _decide(self, key: Key, weight: Tensor, bias: Tensor | None, rows: int) -> str:
        if self.mode in KERNELS:
            return self.mode if self.mode in self.runners else F_LINEAR
        if self.mode == "fallback":
            return FIXED_THRESHOLDS
        if not self._cache_loaded:
            self._load_cache()
            if key in self._choices:
                return self._choices[key]
        if self._spent >= self.budget_s:
            if not self._budget_logged:
                self._budget_logged = True
                logger.info(
                    "kernel calibration has spent its %.1f s: fixed thresholds for the shapes left, which a later "
                    "process measures",
                    self.budget_s,
                )
            self._unsaved.add(key)
            return FIXED_THRESHOLDS
        start = self._clock()
        capped = self.measurement_cap_s <= self.budget_s - self._spent  # else what is left of the budget cuts it
        deadline = start + min(self.measurement_cap_s, self.budget_s - self._spent)
        try:
            measured = self._measure(weight, bias, min(rows, _MAX_TIMED_ROWS), _bucket_top(key[3]), deadline)
        finally:
            self._spent += self._clock() - start
        if measured is None:
            if not capped:  # the budget ran out: a later process measures it
                self._unsaved.add(key)
                return FIXED_THRESHOLDS
            if weight.numel() * weight.element_size() < _cache_bytes():
                # A weight the cache holds is timed quickly on a machine that is not busy: this one was (two
                # engines starting at once). This process only; saved, it was left to the thresholds for good.
                self._unsaved.add(key)
                if not self._disturbed_logged:
                    self._disturbed_logged = True
                    logger.info("kernel timings were disturbed (a busy machine?): choices kept for this process only")
                return FIXED_THRESHOLDS
            # Past its own cap, a weight larger than the cache: too large to time quickly here. Saved as such, or
            # every later process would spend its budget on it again, and measure nothing else.
            logger.info(
                "linear %s: measuring took over %.2f s; the fixed thresholds decide it from now on (delete %s to "
                "measure again)",
                _shape(weight),
                self.measurement_cap_s,
                self.cache_file,
            )
            self._choices[key] = FIXED_THRESHOLDS
            self._save_cache()
            return FIXED_THRESHOLDS
        choice, steady = measured
        self._choices[key] = choice
        if steady:
            self._save_cache()
        else:
            self._unsaved.add(key)
            if not self._disturbed_logged:
                self._disturbed_logged = True
                logger.info("kernel timings were disturbed (a busy machine?): choices kept for this process only")
        return choice

    def _measure(
        self, weight: Tensor, bias: Tensor | None, rows: int, most_rows: float, deadline: float
    ) -> tuple[str, bool] | None:
        """Time every kernel that gets the right answer on ``weight``: the fastest (F.linear on a near tie).

        The choice serves up to ``most_rows`` (its bucket's top): a kernel is a candidate, and the weight
        is cold, only if that holds for every row count of the bucket, whichever one met it first. Returns
        the choice and whether the timings were steady (worth saving), or ``None`` past ``deadline``.
        """
        generator = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, weight.shape[1], generator=generator)
        with torch.inference_mode():
            weights = _cold_copies(weight) if most_rows <= _COLD_MAX_ROWS else [weight]
            expected = F.linear(x, weight, bias)
            if self._clock() > deadline:  # one product took all the time there was: no use timing several
                return None
            tolerance = 1e-5 * (F.linear(x.abs(), weight.abs()).max().item() + 1)
            candidates: dict[str, tuple[Runner, list]] = {}  # each kernel, with the weights it is timed on
            for name, run in self.runners.items():
                if name == ONEDNN_SWAPPED and most_rows > _SWAPPED_MAX_ROWS:
                    continue
                if self._clock() > deadline:
                    return None
                try:
                    operands = weights
                    if hasattr(run, "prepare"):  # prepared ahead, as the engine keeps them; dropped after timing
                        operands = [run.prepare(w) for w in weights]
                        run = run.run_prepared
                    y = run(x, operands[0], bias)  # also the warm-up: oneDNN builds its primitive for this shape
                    if y.shape != expected.shape or (y - expected).abs().max().item() > tolerance:
                        logger.warning("kernel %s gave a wrong result for a %s weight; not used", name, _shape(weight))
                        continue
                except RuntimeError as exc:
                    logger.debug("kernel %s cannot run a %s weight: %s", name, _shape(weight), exc)
                    continue
                candidates[name] = run, operands
            timer = self._timer
            if timer is _time and self._clock is time.perf_counter:  # the default: it stops at the deadline too
                timer = functools.partial(_time, deadline=deadline)
            rounds: list[dict[str, float]] = []
            for _ in range(_ROUNDS):  # interleaved: a burst of load hits one kernel's round, not all of its time
                rounds.append({})
                for name, (run, operands) in candidates.items():
                    if self._clock() > deadline:
                        return None
                    rounds[-1][name] = timer(lambda run=run, ws=operands: [run(x, w, bias) for w in ws]) / len(weights)
        if self._clock() > deadline:  # the last timing was cut short
            return None
        if not candidates:
            return F_LINEAR, True
        times = {name: min(r[name] for r in rounds) for name in candidates}
        # Never slower than F.linear: another kernel must beat it by the margin in every round.
        eligible = [
            name
            for name in times
            if name == F_LINEAR or F_LINEAR not in times or all(r[name] <= _MARGIN * r[F_LINEAR] for r in rounds)
        ]
        best = min(eligible, key=times.__getitem__)
        steady = len({_fastest(r) for r in rounds}) == 1 and all(
            max(r[name] for r in rounds) <= _MAX_SPREAD * times[name] for name in times
        )
        logger.debug(
            "linear %s, %d rows: %s%s (%s)",
            _shape(weight),
            rows,
            best,
            "" if steady else ", disturbed: not saved",
            "; ".join(", ".join(f"{n} {t * 1e6:.0f} us" for n, t in r.items()) for r in rounds),
        )
        return best, steady

    # -- the cache ------------------------------------------------------------------------

    def _load_cache(self) -> None:
        self._cache_loaded = True
        for key, kernel in self._read_cache().items():
            if kernel in self.runners or kernel == FIXED_THRESHOLDS:
                self._choices.setdefault(key, kernel)

    def _read_cache(self) -> dict[Key, str]:
        """The choices in the cache file; none if there is none, or (logged once) if it cannot be read."""
        if self.cache_file is None:
            return {}
        try:
            return _read_choices(self.cache_file, self.machine)
        except (OSError, ValueError) as exc:
            if not self._cache_unreadable_logged:
                self._cache_unreadable_logged = True
                logger.warning(
                    "ignoring the kernel cache %s, which cannot be read (%s); measuring again and replacing it",
                    self.cache_file,
                    exc,
                )
            return {}

    def _save_cache(self) -> None:
        """Merge this table's choices into the file, atomically (a rename), so readers never see half a file."""
        if self.cache_file is None:
            return
        existing = self._read_cache()  # what other processes saved meanwhile; an unreadable file is replaced
        mine = {key: kernel for key, kernel in self._choices.items() if key not in self._unsaved}
        choices = {_encode(key): kernel for key, kernel in {**existing, **mine}.items()}
        data = {"version": _CACHE_VERSION, "machine": self.machine, "choices": choices}
        temporary = None
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(prefix=".linear-kernels-", dir=self.cache_file.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(temporary, self.cache_file)
            temporary = None
        except OSError as exc:
            if not self._cache_warned:
                self._cache_warned = True
                logger.info(
                    "cannot save kernel choices to %s (%s); they are kept for this process", self.cache_file, exc
                )
        finally:  # a failed write or rename (a full disk, Ctrl-C) leaves no temporary behind
            if temporary is not None:
                try:
                    os.unlink(temporary)
                except OSError:
                    pass


def packing_allowed() -> bool:
    """Whether ``PLUGINHOST_PACKED_WEIGHTS`` lets products keep packed copies of the weights (the default)."""
    return _switch(PACKED_WEIGHTS_ENV, default=True, otherwise="weights are packed where that is faster")


def _switch(name: str, *, default: bool, otherwise: str) -> bool:
    """On/off switch ``name`` (unset or empty: ``default``); a value that is neither is ``default``, with a warning."""
    if not os.environ.get(name, "").strip():
        return default
    try:
        return env_flag(name)
    except ValueError as exc:  # read at the first product: a typo must not fail a request
        logger.warning("%s; ignored: %s", exc, otherwise)
        return default


def _fallback(weight: Tensor, bias: Tensor | None, rows: int) -> str:
    """The fixed thresholds (measured on one AVX2 EPYC), for when nothing is measured."""
    if weight.numel() < FALLBACK_ONEDNN_MIN_WEIGHT_ELEMENTS or rows > FALLBACK_ONEDNN_MAX_ROWS:
        return F_LINEAR
    if rows <= FALLBACK_SWAPPED_MAX_ROWS and not (rows == 1 and bias is not None):
        return ONEDNN_SWAPPED
    return ONEDNN


def _cold_copies(weight: Tensor) -> list[Tensor]:
    """``weight`` and enough copies of it to overflow the last-level cache: each product reads it from memory."""
    size = weight.numel() * weight.element_size()
    return [weight] + [weight.clone() for _ in range(min(64, -(-2 * _cache_bytes() // size)) - 1)]


def _cache_bytes() -> int:
    """The last-level cache a cold timing must overflow: as reported, up to ``_LARGEST_CPU_CACHE``."""
    return min(_last_level_cache_bytes(), _LARGEST_CPU_CACHE)


@functools.cache
def _last_level_cache_bytes() -> int:
    """The largest CPU cache this process sees (Linux's sysfs), else 32 MiB."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 << 20)


def _fastest(times: dict[str, float]) -> str:
    """The fastest kernel of one round of timings (F.linear unless beaten by the margin)."""
    best = min(times, key=times.__getitem__)
    return F_LINEAR if F_LINEAR in times and times[best] > _MARGIN * times[F_LINEAR] else best


def _time(fn: Callable[[], object], deadline: float = float("inf")) -> float:
    """The best of a few runs (the kernel ran once already) adding up to about 1 ms; one round of two.

    Past ``deadline`` (``time.perf_counter``), it stops after the run under way.
    """
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 1 or (spent < 0.001 and runs < 50 and time.perf_counter() <= deadline):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return best


def _shape(weight: Tensor) -> str:
    return f"{weight.shape[0]}x{weight.shape[1]}"


def _encode(key: Key) -> str:
    out, inp, has_bias, b = key
    return f"{out}x{inp}{'+bias' if has_bias else ''}/{b}"


def _read_choices(path: Path, machine: str | None) -> dict[Key, str]:
    """The choices saved in ``path`` ({} if there is no file, or it is another version's): validated, every one.

    Only a regular file is read, opened without blocking (a FIFO there would hang the first product), and
    any content that is not exactly a cache of this version raises ``ValueError`` saying what is wrong.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return {}
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError("it is not a regular file")
        raw = f.read(_MAX_CACHE_BYTES + 1)
    if len(raw) > _MAX_CACHE_BYTES:
        raise ValueError(f"it is larger than {_MAX_CACHE_BYTES} bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:  # deeply nested arrays: json's parser runs out of stack
        raise ValueError("it nests too deeply") from None
    if not isinstance(data, dict):
        raise ValueError("it is not a JSON object")
    version = data.get("version")
    if type(version) is int and version != _CACHE_VERSION:
        return {}  # another version's file (an older engine's measurements): replaced on the next save
    if version != _CACHE_VERSION or not isinstance(data.get("choices"), dict):
        raise ValueError(f"it is not a version {_CACHE_VERSION} kernel cache")
    if data.get("machine") != machine:  # copied from another machine, or a shared home: measured elsewhere
        raise ValueError(f"it was measured on another machine ({str(data.get('machine'))[:200]})")
    choices = {}
    for text, kernel in data["choices"].items():
        key = _parse(text)
        if key is None or (kernel not in KERNELS and kernel != FIXED_THRESHOLDS):
            raise ValueError(f"bad entry {text!r}: {kernel!r}"[:200])
        choices[key] = FIXED_THRESHOLDS if kernel == FIXED_THRESHOLDS else kernel
    return choices


def _parse(text: str) -> Key | None:
    """The key ``text`` names, if it is a valid one: sizes from 1, a row bucket that :func:`_bucket` can give."""
    match = _ENTRY.fullmatch(text)
    if match is None or int(match[4]) > _bucket(_MAX_TIMED_ROWS):
        return None
    return int(match[1]), int(match[2]), match[3] is not None, int(match[4])


def _describe(key: Key) -> str:
    out, inp, has_bias, b = key
    low, high = 1 << (b - 1), (1 << b) - 1
    rows = (
        f"rows {low}"
        if low == high
        else f"rows {low}-{high}"
        if b <= _MAX_TIMED_ROWS.bit_length() - 1
        else f"rows {low}+"
    )
    return f"{out}x{inp}{'+bias' if has_bias else ''} {rows}"
