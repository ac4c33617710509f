"""Kernel choice by measurement: the fastest correct kernel, remembered per machine, safely."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import builtin_models.kernel_choice as kernel_choice
import builtin_models.linear as linear_module
from builtin_models.kernel_choice import (
    CALIBRATION_ENV,
    F_LINEAR,
    KERNEL_ENV,
    KERNELS,
    ONEDNN,
    ONEDNN_PACKED,
    ONEDNN_SWAPPED,
    PACKED_WEIGHTS_ENV,
    PLAIN_LINEAR_ENV,
    KernelTable,
    machine_key,
)
from builtin_models.linear import linear, make_kernel_table, use_kernel_table

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch has no oneDNN")


@pytest.fixture(autouse=True)
def restore_table():
    yield
    use_kernel_table(None)


#: The kernels the table's logic is tested over (with the timings below); the packed kernel has its own tests.
THREE_KERNELS = (F_LINEAR, ONEDNN, ONEDNN_SWAPPED)


@pytest.fixture(autouse=True)
def three_kernels(monkeypatch):
    monkeypatch.setenv(PACKED_WEIGHTS_ENV, "0")


@pytest.fixture(autouse=True)
def no_time_budget(monkeypatch):
    """A busy machine must not turn a test's measurement into fixed thresholds (budget tests pass their own)."""
    monkeypatch.setattr(kernel_choice, "_BUDGET_S", float("inf"))
    monkeypatch.setattr(kernel_choice, "_MEASUREMENT_CAP_S", float("inf"))


class FakeTimer:
    """Times a kernel by its name, from a table (a kernel it leaves out: the slowest), and counts the calls."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds, self.calls = seconds, []

    @staticmethod
    def kernel_name(fn) -> str:
        """The kernel a timed function runs (the kernel itself, or its ``run_prepared``)."""
        timed = fn.__defaults__[0]
        return next(n for n, run in TABLE_RUNNERS.items() if timed is run or timed == getattr(run, "run_prepared", 0))

    def __call__(self, fn) -> float:
        name = self.kernel_name(fn)
        self.calls.append(name)
        return self.seconds.get(name, 99.0)


TABLE_RUNNERS = make_kernel_table().runners


def choose(table: KernelTable, rows: int, out: int = 64, inp: int = 32, bias: bool = True) -> str:
    weight = torch.randn(out, inp)
    return table.kernel(weight, torch.randn(out) if bias else None, rows)


@needs_onednn
@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        ({F_LINEAR: 3.0, ONEDNN: 1.0, ONEDNN_SWAPPED: 2.0}, ONEDNN),
        ({F_LINEAR: 3.0, ONEDNN: 2.0, ONEDNN_SWAPPED: 1.0}, ONEDNN_SWAPPED),
        ({F_LINEAR: 1.0, ONEDNN: 2.0, ONEDNN_SWAPPED: 3.0}, F_LINEAR),
        ({F_LINEAR: 1.0, ONEDNN: 0.99, ONEDNN_SWAPPED: 3.0}, F_LINEAR),  # within noise: never slower than F.linear
    ],
)
def test_the_measured_fastest_kernel_is_chosen_once(tmp_path, seconds, expected):
    timer = FakeTimer(seconds)
    table = make_kernel_table(cache_file=tmp_path / "k.json", timer=timer)
    assert choose(table, 4) == expected
    assert timer.calls == 2 * list(THREE_KERNELS)  # two interleaved rounds
    timed = len(timer.calls)
    assert choose(table, 5) == expected and len(timer.calls) == timed  # same rows bucket (4-7): not timed again
    assert choose(table, 8) == expected and len(timer.calls) == 2 * timed  # the next bucket is measured on its own


@needs_onednn
@pytest.mark.skipif(linear_module._pack is None, reason="this PyTorch's oneDNN cannot pack weights")
def test_the_packed_kernel_is_measured_beside_the_others(tmp_path, monkeypatch):
    monkeypatch.delenv(PACKED_WEIGHTS_ENV)
    timer = FakeTimer({F_LINEAR: 3.0, ONEDNN: 2.0, ONEDNN_SWAPPED: 2.0, ONEDNN_PACKED: 1.0})
    table = make_kernel_table(cache_file=tmp_path / "k.json", timer=timer)
    assert choose(table, 8) == ONEDNN_PACKED
    assert timer.calls == 2 * list(KERNELS)


@needs_onednn
def test_a_kernel_giving_a_wrong_result_is_never_chosen(tmp_path):
    runners = dict(TABLE_RUNNERS)
    runners[ONEDNN] = lambda x, w, b: F.linear(x, w, b) + 1.0  # fast and wrong
    table = KernelTable(
        runners, cache_file=tmp_path / "k.json", timer=lambda fn: 0.0 if fn.__defaults__[0] is runners[ONEDNN] else 1.0
    )
    assert choose(table, 3) in (F_LINEAR, ONEDNN_SWAPPED)


@needs_onednn
def test_choices_are_remembered_per_machine_and_reused(tmp_path):
    cache = tmp_path / "kernels.json"
    first = make_kernel_table(cache_file=cache, timer=FakeTimer({F_LINEAR: 3.0, ONEDNN: 1.0, ONEDNN_SWAPPED: 2.0}))
    assert choose(first, 16) == ONEDNN
    data = json.loads(cache.read_text())
    assert data["machine"] == machine_key() and data["choices"] == {"64x32+bias/5": ONEDNN}
    timer = FakeTimer({F_LINEAR: 1.0, ONEDNN: 9.0, ONEDNN_SWAPPED: 9.0})
    second = make_kernel_table(cache_file=cache, timer=timer)
    assert choose(second, 20) == ONEDNN and timer.calls == []  # read back, not measured again
    assert second.choices() == {"64x32+bias rows 16-31": ONEDNN}


@needs_onednn
@pytest.mark.parametrize(
    "content", ["{not json", '{"version": 1, "choices": [1, 2]}', '{"version": 1, "choices": {"junk": "nope"}}', ""]
)
def test_a_corrupt_cache_is_ignored_and_replaced(tmp_path, content):
    cache = tmp_path / "kernels.json"
    cache.write_text(content)
    table = make_kernel_table(cache_file=cache, timer=FakeTimer({F_LINEAR: 3.0, ONEDNN: 1.0, ONEDNN_SWAPPED: 2.0}))
    assert choose(table, 2) == ONEDNN
    assert json.loads(cache.read_text())["choices"]["64x32+bias/2"] == ONEDNN


@needs_onednn
def test_an_unwritable_cache_only_costs_the_remembering(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    table = make_kernel_table(
        cache_file=blocker / "sub" / "k.json", timer=FakeTimer({F_LINEAR: 3.0, ONEDNN: 1.0, ONEDNN_SWAPPED: 2.0})
    )
    assert choose(table, 2) == ONEDNN  # no exception: the choice is kept in memory


def _write_choices(args) -> None:
    path, n = args
    unlimited = float("inf")  # a spawned process: the no_time_budget fixture does not reach it
    table = make_kernel_table(cache_file=path, timer=lambda fn: 1.0, budget_s=unlimited, measurement_cap_s=unlimited)
    for rows in range(1, 40):
        table.kernel(torch.randn(8 + n, 8), None, rows)


def test_few_rows_are_timed_with_the_weight_coming_from_memory(tmp_path):
    """Decoding streams every layer's weights: a kernel is timed on weights overflowing the cache, not on a hot one."""
    seen: dict[int, set[int]] = {}

    def recording(x, weight, bias):
        seen.setdefault(x.shape[0], set()).add(id(weight))
        return F.linear(x, weight, bias)

    table = KernelTable({F_LINEAR: recording}, timer=lambda fn: (fn(), 1.0)[1])
    weight = torch.randn(512, 256)  # 512 KiB
    table.kernel(weight, None, 1), table.kernel(weight, None, 512)
    read_per_pass = len(seen[1]) * weight.numel() * weight.element_size()
    assert read_per_pass >= min(2 * kernel_choice._last_level_cache_bytes(), 64 * 512 * 1024)
    assert seen[512] == {id(weight)}  # many rows are bound by arithmetic: the weight itself suffices


def test_a_cache_reported_as_hundreds_of_mib_is_overflowed_within_a_bounded_read(monkeypatch):
    """A 2-vCPU Xeon VM reports its host's 480 MiB last-level cache: timing each shape over twice that took every
    measurement past its cap, which counted as a busy machine, so no process there ever calibrated (and the
    fixed thresholds, measured on another CPU, made batch-1 decoding slower than transformers)."""
    monkeypatch.setattr(kernel_choice, "_last_level_cache_bytes", lambda: 480 << 20)
    weight = torch.randn(768, 768)  # 2.25 MiB
    read = len(kernel_choice._cold_copies(weight)) * weight.numel() * weight.element_size()
    assert 2 * kernel_choice._LARGEST_CPU_CACHE <= read < 2 * kernel_choice._LARGEST_CPU_CACHE + (3 << 20)


@needs_onednn
def test_concurrent_writers_never_leave_a_broken_file(tmp_path):
    path = tmp_path / "kernels.json"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_write_choices, [(path, n) for n in range(8)], chunksize=1)
    data = json.loads(path.read_text())
    assert data["version"] == kernel_choice._CACHE_VERSION and all(k in KERNELS for k in data["choices"].values())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".linear-kernels-")]  # no temporary left


def test_the_machine_key_names_what_a_measurement_depends_on():
    threads = torch.get_num_threads()
    key = machine_key()
    assert f"torch {torch.__version__}" in key and f"{threads} threads" in key
    # "AMD EPYC" alone named AVX2 and AVX-512 machines alike, whose kernels rank differently.
    assert f"| {torch.backends.cpu.get_cpu_capability()}" in key
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert machine_key() != key
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("env", "mode"),
    [
        ({PLAIN_LINEAR_ENV: "1"}, F_LINEAR),
        ({KERNEL_ENV: ONEDNN_SWAPPED}, ONEDNN_SWAPPED),
        ({CALIBRATION_ENV: "0"}, "fallback"),
        ({}, "measure"),
    ],
)
def test_the_switches(env, mode):
    code = "import builtin_models.linear as m; t = m.kernel_table(); print(t.mode, t.budget_s, t.measurement_cap_s)"
    clean = {k: v for k, v in os.environ.items() if k not in (PLAIN_LINEAR_ENV, KERNEL_ENV, CALIBRATION_ENV)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**clean, **env}
    )
    assert result.stdout.split() == [mode, "1.5", "0.5"]  # the engine's table: a time budget for calibration


@needs_onednn
def test_the_fallback_is_the_fixed_thresholds():
    table = make_kernel_table(mode="fallback")
    big = torch.randn(512, 512)
    assert table.kernel(big, None, 1) == ONEDNN_SWAPPED
    assert table.kernel(big, torch.randn(512), 1) == ONEDNN  # one row with a bias: the bias is fused
    assert table.kernel(big, None, 100) == ONEDNN
    assert table.kernel(big, None, 300) == F_LINEAR
    assert table.kernel(torch.randn(64, 64), None, 1) == F_LINEAR  # small weights: oneDNN's fixed cost


def test_engine_kernels_run_through_the_real_measurement(tmp_path):
    """No fake timer: the real kernels are timed and one of them is chosen for each bucket met."""
    use_kernel_table(make_kernel_table(cache_file=tmp_path / "k.json"))
    weight, bias = torch.randn(256, 512), torch.randn(256)
    with torch.inference_mode():
        for rows in (1, 6, 40):
            x = torch.randn(rows, 512)
            torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    chosen = linear_module.kernel_choices()
    assert set(chosen) == {"256x512+bias rows 1", "256x512+bias rows 4-7", "256x512+bias rows 32-63"}
    assert set(chosen.values()) <= set(KERNELS)


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path):
    """The XDG spec: a relative XDG_CACHE_HOME is invalid; the cache never lands under the working directory."""
    from pluginhost.paths import CACHE_DIR_ENV, user_cache_dir

    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", "relcache")
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "pluginhost"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg" / "pluginhost"


@needs_onednn
@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_save_leaves_no_temporary_behind(tmp_path, monkeypatch, failure):
    """A full disk (or Ctrl-C while writing) must not leave a .linear-kernels-* file per run, for ever."""

    def failing_dump(*args, **kwargs):
        raise failure

    monkeypatch.setattr(kernel_choice.json, "dump", failing_dump)
    table = make_kernel_table(
        cache_file=tmp_path / "k.json", timer=FakeTimer({F_LINEAR: 3.0, ONEDNN: 1.0, ONEDNN_SWAPPED: 2.0})
    )
    if isinstance(failure, OSError):
        assert choose(table, 2) == ONEDNN  # kept in memory
        assert choose(table, 4) == ONEDNN
    else:
        with pytest.raises(KeyboardInterrupt):
            choose(table, 2)
    assert list(tmp_path.iterdir()) == []


@needs_onednn
@pytest.mark.parametrize(
    "content",
    [
        "[" * 100_000 + "]" * 100_000,  # json's parser runs out of stack (RecursionError)
        '{"version": 3, "choices": {"64x32/0": "onednn"}}',  # row bucket 0: kernel_choices() raised
        '{"version": 3, "choices": {"64x32/-3": "onednn"}}',
        '{"version": 3, "choices": {"64x32/99": "onednn"}}',  # no row count falls in bucket 99
        '{"version": 3, "choices": {"0x32/2": "onednn"}}',
        '{"version": 3, "choices": {"64x32/2": "mkl"}}',  # not a kernel
        '{"version": 3, "choices": {" 64x32/2": "onednn"}}',
        '{"version": "2", "choices": {}}',
        " " * (2 << 20),
    ],
    ids=["deep", "bucket0", "bucket-3", "bucket99", "size0", "kernel", "space", "strversion", "huge"],
)
def test_a_hostile_cache_is_ignored_and_replaced_with_one_warning(tmp_path, caplog, content):
    cache = tmp_path / "kernels.json"
    cache.write_text(content)
    timer = FakeTimer({F_LINEAR: 3.0, ONEDNN: 1.0, ONEDNN_SWAPPED: 2.0})
    table = make_kernel_table(cache_file=cache, timer=timer)
    with caplog.at_level("WARNING", logger="builtin_models.kernel_choice"):
        assert choose(table, 2) == ONEDNN and timer.calls  # measured: nothing was taken from the file
    assert json.loads(cache.read_text())["choices"] == {"64x32+bias/2": ONEDNN}  # replaced by a valid file
    assert len([r for r in caplog.records if "cannot be read" in r.getMessage()]) == 1
    assert table.choices() == {"64x32+bias rows 2-3": ONEDNN}  # raised "negative shift count" for bucket 0
    assert make_kernel_table(cache_file=cache, timer=FakeTimer({})).kernel(torch.randn(64, 32), torch.randn(64), 3)


@needs_onednn
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_in_place_of_the_cache_does_not_hang(tmp_path, caplog):
    cache = tmp_path / "kernels.json"
    os.mkfifo(cache)  # opening it for reading blocked until a writer came: for ever
    table = make_kernel_table(cache_file=cache, timer=FakeTimer({F_LINEAR: 3.0, ONEDNN: 1.0, ONEDNN_SWAPPED: 2.0}))
    with caplog.at_level("WARNING", logger="builtin_models.kernel_choice"):
        assert choose(table, 2) == ONEDNN
    assert "not a regular file" in caplog.text
    assert json.loads(cache.read_text())["choices"] == {"64x32+bias/2": ONEDNN}


@needs_onednn
@pytest.mark.parametrize("first_rows", [64, 65, 127])
def test_a_bucket_choice_never_depends_on_the_row_count_that_met_it_first(first_rows):
    """The swapped kernel is only tried up to 63 rows: it was chosen (and saved) for 64-127 rows when 64 came first."""
    timer = FakeTimer({F_LINEAR: 3.0, ONEDNN: 2.0, ONEDNN_SWAPPED: 1.0})  # swapped would win wherever tried
    table = make_kernel_table(timer=timer)
    assert choose(table, first_rows, bias=False) == ONEDNN
    assert ONEDNN_SWAPPED not in timer.calls
    assert choose(table, 63, bias=False) == ONEDNN_SWAPPED  # the bucket 32-63 may have it


@pytest.mark.parametrize(
    ("env", "mode", "warning"),
    [
        ({PLAIN_LINEAR_ENV: "y"}, "measure", "PLUGINHOST_PLAIN_LINEAR='y' is neither on (1, true, yes, on) nor off"),
        ({PLAIN_LINEAR_ENV: "maybe", CALIBRATION_ENV: "0"}, "fallback", "PLUGINHOST_PLAIN_LINEAR='maybe'"),
        ({CALIBRATION_ENV: "disabled"}, "measure", "PLUGINHOST_KERNEL_CALIBRATION='disabled' is neither on"),
        ({KERNEL_ENV: "ONEDNN"}, "measure", "is not one of f_linear, onednn, onednn_swapped"),
        ({PLAIN_LINEAR_ENV: "1", KERNEL_ENV: ONEDNN}, F_LINEAR, "PLUGINHOST_LINEAR_KERNEL='onednn' is overridden"),
        ({PLAIN_LINEAR_ENV: "Off", CALIBRATION_ENV: "FALSE"}, "fallback", None),
        ({PLAIN_LINEAR_ENV: "", CALIBRATION_ENV: "yes"}, "measure", None),
        ({KERNEL_ENV: ONEDNN, CALIBRATION_ENV: "0"}, ONEDNN, None),  # a forced kernel: nothing is measured anyway
    ],
)
def test_a_misspelt_switch_is_named_in_a_warning(monkeypatch, caplog, env, mode, warning):
    for name in (PLAIN_LINEAR_ENV, KERNEL_ENV, CALIBRATION_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level("WARNING", logger="builtin_models.kernel_choice"):
        table = KernelTable.from_environment(dict(TABLE_RUNNERS))
    assert table.mode == mode
    if warning is None:
        assert not caplog.records
    else:
        assert [r.levelname for r in caplog.records] == ["WARNING"] and warning in caplog.text


class Clock:
    """A fake clock that the fake timers below advance by the time they report."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RoundsTimer(FakeTimer):
    """Times a kernel from one table per round (the last one repeating), and advances ``clock``."""

    def __init__(self, *rounds: dict[str, float], clock: Clock | None = None) -> None:
        super().__init__({})
        self.rounds, self.clock = rounds, clock

    def __call__(self, fn) -> float:
        name = self.kernel_name(fn)
        seconds = self.rounds[min(self.calls.count(name), len(self.rounds) - 1)][name]
        self.calls.append(name)
        if self.clock is not None:
            self.clock.now += seconds
        return seconds


@needs_onednn
def test_calibration_stops_at_its_time_budget_and_the_fixed_thresholds_take_over(tmp_path, caplog):
    """Under load, calibration took 19.5 s of a 20 s first generation: now it has a budget per process."""
    clock, cache = Clock(), tmp_path / "k.json"
    timer = RoundsTimer({F_LINEAR: 0.1, ONEDNN: 0.05, ONEDNN_SWAPPED: 0.2}, clock=clock)  # 0.7 s a measurement
    table = make_kernel_table(cache_file=cache, timer=timer, clock=clock, budget_s=1.0, measurement_cap_s=5.0)
    weight = torch.randn(512, 512)
    assert table.kernel(weight, None, 1) == ONEDNN  # measured: 0.7 s spent
    # 0.3 s left: cut short after one round, the fixed thresholds decide; 1.05 s spent, over the budget.
    assert table.kernel(weight, None, 2) == ONEDNN_SWAPPED
    assert timer.calls == 3 * list(THREE_KERNELS)
    calls = len(timer.calls)
    with caplog.at_level("INFO", logger="builtin_models.kernel_choice"):
        # Every later shape: the fixed thresholds, per row count (20 and 30 rows share a bucket, not a kernel).
        assert table.kernel(weight, None, 20) == ONEDNN_SWAPPED and table.kernel(weight, None, 30) == ONEDNN
        assert table.kernel(torch.randn(64, 64), None, 1) == F_LINEAR
    assert len(timer.calls) == calls and "has spent its 1.0 s" in caplog.text
    assert json.loads(cache.read_text())["choices"] == {"512x512/1": ONEDNN}  # the fixed thresholds are not saved
    assert table.choices()["512x512 rows 16-31"] == "fixed thresholds"


@needs_onednn
def test_a_measurement_past_its_cap_is_abandoned_for_the_fixed_thresholds(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_choice, "_last_level_cache_bytes", lambda: 2**20)  # 512x512 fp32 fills it
    clock, cache = Clock(), tmp_path / "k.json"
    timer = RoundsTimer({F_LINEAR: 0.1, ONEDNN: 0.05, ONEDNN_SWAPPED: 0.2}, clock=clock)
    table = make_kernel_table(cache_file=cache, timer=timer, clock=clock, budget_s=100.0, measurement_cap_s=0.3)
    weight = torch.randn(512, 512)
    assert table.kernel(weight, None, 1) == ONEDNN_SWAPPED  # the fixed thresholds' choice, not the measured one
    assert timer.calls == list(THREE_KERNELS)  # 0.35 s after one round: the second one is not started
    # Saved as such: a later process does not spend its budget on it again (every process did, measuring nothing).
    assert json.loads(cache.read_text())["choices"] == {"512x512/1": "fixed thresholds"}
    timer = RoundsTimer({F_LINEAR: 0.1, ONEDNN: 0.05, ONEDNN_SWAPPED: 0.2}, clock=clock)
    later = make_kernel_table(cache_file=cache, timer=timer, clock=clock, budget_s=100.0, measurement_cap_s=0.3)
    assert later.kernel(weight, None, 1) == ONEDNN_SWAPPED and timer.calls == []
    assert later.choices()["512x512 rows 1"] == "fixed thresholds"


@needs_onednn
def test_a_measurement_past_its_cap_on_a_weight_the_cache_holds_serves_this_process_only(tmp_path, monkeypatch):
    # Such a weight is timed quickly unless the machine is busy (two engines starting at once): saved, every
    # shape measured then was left to the fixed thresholds for good.
    monkeypatch.setattr(kernel_choice, "_last_level_cache_bytes", lambda: 2**21)  # twice the 512x512 weight
    clock, cache = Clock(), tmp_path / "k.json"
    busy = {F_LINEAR: 0.1, ONEDNN: 0.05, ONEDNN_SWAPPED: 0.2}
    table = make_kernel_table(
        cache_file=cache, timer=RoundsTimer(busy, clock=clock), clock=clock, measurement_cap_s=0.3
    )
    weight = torch.randn(512, 512)
    assert table.kernel(weight, None, 1) == ONEDNN_SWAPPED  # the fixed thresholds', for now
    assert not cache.exists()
    quiet = RoundsTimer({F_LINEAR: 0.01, ONEDNN: 0.005, ONEDNN_SWAPPED: 0.02}, clock=clock)
    later = make_kernel_table(cache_file=cache, timer=quiet, clock=clock, measurement_cap_s=0.3)
    assert later.kernel(weight, None, 1) == ONEDNN and quiet.calls  # measured again, and chosen by measuring


@needs_onednn
def test_a_save_leaves_out_the_choices_meant_for_this_process_only(tmp_path, caplog):
    """A disturbed choice (or one the budget left to the fixed thresholds) went into the file with the next
    steady one: the file then named "fixed thresholds", which the next process refused, replacing the file."""
    clock, cache = Clock(), tmp_path / "k.json"
    steady = {F_LINEAR: 1.0, ONEDNN: 0.5, ONEDNN_SWAPPED: 2.0}
    busy = {F_LINEAR: 2.0, ONEDNN: 0.5, ONEDNN_SWAPPED: 2.0}
    timer = RoundsTimer(steady, busy, steady, steady, clock=clock)  # rounds of the first measurement, then the second
    table = make_kernel_table(cache_file=cache, timer=timer, clock=clock, budget_s=100.0, measurement_cap_s=50.0)
    weight = torch.randn(512, 512)
    assert table.kernel(weight, None, 1) == ONEDNN  # disturbed: this process only
    assert table.kernel(weight, None, 2) == ONEDNN  # steady: saved
    assert json.loads(cache.read_text())["choices"] == {"512x512/2": ONEDNN}
    timer = RoundsTimer(steady, clock=clock)
    later = make_kernel_table(cache_file=cache, timer=timer, clock=clock, budget_s=100.0, measurement_cap_s=50.0)
    with caplog.at_level("WARNING", logger="builtin_models.kernel_choice"):
        assert later.kernel(weight, None, 2) == ONEDNN and timer.calls == []  # read from the file
    assert "ignoring the kernel cache" not in caplog.text


@needs_onednn
@pytest.mark.parametrize(
    ("rounds", "expected"),
    [
        # The winner changes between rounds: the better of the two, for this process only.
        (
            ({F_LINEAR: 3.0, ONEDNN: 1.0, ONEDNN_SWAPPED: 2.0}, {F_LINEAR: 3.0, ONEDNN: 2.5, ONEDNN_SWAPPED: 2.0}),
            ONEDNN,
        ),
        # Same winner, but F.linear's two rounds differ 2x: the machine was busy.
        (
            ({F_LINEAR: 1.0, ONEDNN: 0.5, ONEDNN_SWAPPED: 2.0}, {F_LINEAR: 2.0, ONEDNN: 0.5, ONEDNN_SWAPPED: 2.0}),
            ONEDNN,
        ),
        # oneDNN beat F.linear in one round only: never slower than F.linear, so F.linear.
        (
            ({F_LINEAR: 1.0, ONEDNN: 0.5, ONEDNN_SWAPPED: 2.0}, {F_LINEAR: 1.0, ONEDNN: 1.2, ONEDNN_SWAPPED: 2.0}),
            F_LINEAR,
        ),
    ],
    ids=["winner-changes", "spread", "one-round-only"],
)
def test_disturbed_timings_decide_for_this_process_only(tmp_path, rounds, expected):
    """Choices measured in noise were saved for good: now only steady timings are remembered."""
    cache = tmp_path / "k.json"
    table = make_kernel_table(cache_file=cache, timer=RoundsTimer(*rounds))
    assert choose(table, 2, bias=False) == expected
    assert not cache.exists()
    steady = RoundsTimer(
        {F_LINEAR: 3.0, ONEDNN: 1.0, ONEDNN_SWAPPED: 2.0}, {F_LINEAR: 3.1, ONEDNN: 1.1, ONEDNN_SWAPPED: 2.2}
    )
    assert choose(make_kernel_table(cache_file=cache, timer=steady), 2, bias=False) == ONEDNN
    assert json.loads(cache.read_text())["choices"] == {"64x32/2": ONEDNN}  # steady rounds: saved


@needs_onednn
def test_a_cache_measured_on_another_machine_is_ignored(tmp_path, caplog):
    """A shared (NFS) home or a copied cache: choices measured on another CPU are not taken."""
    cache = tmp_path / "kernels.json"
    other = machine_key().replace("threads", "threads (another machine)")
    cache.write_text(json.dumps({"version": 3, "machine": other, "choices": {"64x32+bias/2": F_LINEAR}}))
    table = make_kernel_table(cache_file=cache, timer=FakeTimer({F_LINEAR: 3.0, ONEDNN: 1.0, ONEDNN_SWAPPED: 2.0}))
    with caplog.at_level("WARNING", logger="builtin_models.kernel_choice"):
        assert choose(table, 2) == ONEDNN  # measured here, not read
    assert "measured on another machine" in caplog.text
    assert json.loads(cache.read_text())["machine"] == machine_key()


@needs_onednn
def test_known_says_only_what_was_decided(tmp_path):
    """linear()'s shortcut to F.linear asks known(): a choice made, never one it would have to make."""
    table = make_kernel_table(cache_file=tmp_path / "k.json", timer=FakeTimer({F_LINEAR: 1.0, ONEDNN: 2.0}))
    weight = torch.randn(64, 32)
    assert table.known(64, 32, False, 3) is None
    assert table.kernel(weight, None, 3) == F_LINEAR
    assert table.known(64, 32, False, 2) == F_LINEAR and table.known(64, 32, False, 4) is None  # its bucket only
    fallback = make_kernel_table(mode="fallback")
    fallback.kernel(weight, None, 3)
    assert fallback.known(64, 32, False, 3) is None  # the thresholds decide per row count, not per bucket


def test_no_home_directory_only_costs_the_remembering(monkeypatch, tmp_path):
    """A container's arbitrary user (or env -i) has no home: generation failed with "Could not determine home"."""

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    for name in ("PLUGINHOST_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("pathlib.Path.home", no_home)
    table = KernelTable.from_environment(linear_module._runners())
    assert table.cache_file is None
    weight, x = torch.randn(64, 32), torch.randn(3, 32)
    use_kernel_table(table)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
