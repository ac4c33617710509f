"""builtin_models.packed_weights: a packed copy always computes what its weight computes, within its memory budget."""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F

import builtin_models.linear as linear_module
from builtin_models.kernel_choice import (
    KERNEL_ENV,
    ONEDNN,
    ONEDNN_PACKED,
    PACKED_WEIGHTS_ENV,
    KernelTable,
)
from builtin_models.linear import linear, make_kernel_table, use_kernel_table
from builtin_models.packed_weights import PackedWeights, pack_op

pytestmark = pytest.mark.skipif(pack_op() is None, reason="this PyTorch's oneDNN cannot pack weights")

WEIGHT_BYTES = 300 * 96 * 4


@pytest.fixture
def packed(monkeypatch):
    """Every product through the packed kernel, with a registry of copies of its own (no memory limit)."""
    registry = PackedWeights(pack_op(), available=lambda: None)
    monkeypatch.setattr(linear_module, "_packed_weights", registry)
    use_kernel_table(make_kernel_table(mode=ONEDNN_PACKED))
    yield registry
    use_kernel_table(None)


def product(weight: torch.Tensor, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's product and F.linear's, on the same input."""
    x, bias = torch.randn(rows, weight.shape[1]), torch.ones(weight.shape[0])
    with torch.inference_mode():
        return linear(x, weight, bias), F.linear(x, weight, bias)


def test_a_packed_copy_is_made_once_and_computes_what_the_weight_does(packed):
    weight = torch.randn(300, 96)
    for rows in (1, 8, 40):
        got, expected = product(weight, rows)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert packed.nbytes == WEIGHT_BYTES  # one copy, for every row count


@pytest.mark.parametrize("change", ["in place", "in place under inference_mode", "new data", "copy_"])
def test_a_copy_follows_its_weight_when_a_plugin_changes_it(packed, change):
    weight = torch.nn.Parameter(torch.randn(300, 96), requires_grad=False)
    product(weight)
    before = next(iter(packed._entries.values())).packed
    if change == "in place":
        with torch.no_grad():
            weight.mul_(-2.0)
    elif change == "in place under inference_mode":
        with torch.inference_mode():
            weight.add_(1.0)
    elif change == "new data":
        weight.data = torch.randn(300, 96)
    else:
        with torch.no_grad():
            weight.copy_(torch.randn(300, 96))
    got, expected = product(weight)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    stale = weakref.ref(before)
    del before
    gc.collect()
    assert stale() is None  # the old copy was let go: changing a weight again and again holds one copy
    assert packed.nbytes == WEIGHT_BYTES


def test_a_copy_goes_with_its_weight(packed):
    weight = torch.randn(300, 96)
    product(weight)
    assert packed.nbytes == WEIGHT_BYTES
    del weight
    gc.collect()
    assert packed.nbytes == 0 and not packed._entries


def test_an_inference_tensor_weight_is_never_packed(packed):
    """It has no version counter: a change in place could not be seen, so its products use the plain weight."""
    with torch.inference_mode():
        weight = torch.randn(300, 96)
    got, expected = product(weight)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert packed.nbytes == 0


def test_copies_stop_at_their_budget_and_the_rest_use_the_plain_weight(monkeypatch, caplog):
    """A quarter of the memory available at the first packing: here, room for one weight of three."""
    registry = PackedWeights(pack_op(), available=lambda: 4 * WEIGHT_BYTES + 100)
    monkeypatch.setattr(linear_module, "_packed_weights", registry)
    use_kernel_table(make_kernel_table(mode=ONEDNN_PACKED))
    try:
        weights = [torch.randn(300, 96) for _ in range(3)]
        with caplog.at_level(logging.INFO, logger="builtin_models.packed_weights"):
            for _ in range(2):
                for weight in weights:
                    got, expected = product(weight)
                    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    finally:
        use_kernel_table(None)
    assert registry.nbytes == WEIGHT_BYTES and len(registry._entries) == 1
    assert caplog.text.count("reached their budget") == 1
    assert caplog.text.count("packing weights for oneDNN") == 1 and "held twice, up to 0.11 MiB" in caplog.text


def test_calibration_keeps_no_copy_of_a_weight_it_measured(monkeypatch, tmp_path):
    """The packed kernel is timed on copies made for the timing; the engine's copy comes with its first product."""
    registry = PackedWeights(pack_op(), available=lambda: None)
    monkeypatch.setattr(linear_module, "_packed_weights", registry)
    table = make_kernel_table(cache_file=tmp_path / "k.json")
    assert ONEDNN_PACKED in table.runners
    weight, bias = torch.randn(300, 96), torch.randn(300)
    table.kernel(weight, bias, 8)
    gc.collect()
    assert registry.nbytes == 0


def test_the_switch_takes_the_packed_kernel_away(monkeypatch, caplog):
    monkeypatch.setenv(PACKED_WEIGHTS_ENV, "0")
    assert ONEDNN_PACKED not in make_kernel_table().runners
    monkeypatch.setenv(KERNEL_ENV, ONEDNN_PACKED)  # forced, but not allowed: oneDNN on the plain weights, said
    with caplog.at_level(logging.WARNING, logger="builtin_models.kernel_choice"):
        table = KernelTable.from_environment(linear_module._runners())
    assert table.mode == ONEDNN and f"{PACKED_WEIGHTS_ENV}=0" in caplog.text


def test_choices_made_without_the_packed_kernel_are_kept_apart(monkeypatch, tmp_path):
    """Measured with PLUGINHOST_PACKED_WEIGHTS=0, they must not stand in for the packed kernel once it is back."""
    monkeypatch.setenv("PLUGINHOST_CACHE_DIR", str(tmp_path))
    without = KernelTable.from_environment(linear_module._runners())
    monkeypatch.setenv(PACKED_WEIGHTS_ENV, "0")
    with_packing_off = KernelTable.from_environment(linear_module._runners())
    assert without.cache_file != with_packing_off.cache_file


def test_clear_makes_writes_through_data_seen(packed):
    """``weight.data`` and NumPy writes bypass the version counter (documented): clear() packs afresh."""
    weight = torch.randn(300, 96)
    product(weight)
    weight.data.mul_(-2.0)
    packed.clear()
    got, expected = product(weight)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert packed.nbytes == WEIGHT_BYTES


def test_tensor_parallel_ranks_on_one_machine_share_the_budget():
    registry = PackedWeights(pack_op(), available=lambda: 8 * WEIGHT_BYTES + 100)
    registry.sharers = 2  # a quarter of the memory, halved: room for one weight
    weights = [torch.randn(300, 96) for _ in range(3)]
    assert [registry.get(w) is not None for w in weights] == [True, False, False]


def test_a_weight_collected_while_another_is_packed_does_not_deadlock():
    """Packing allocates; an allocation may run the garbage collector, which may free a weight that has a copy:
    its finalizer then drops the copy under the lock the packing holds, in the same thread (it hung for ever)."""

    def packer_that_collects(weight: torch.Tensor, rows: int) -> torch.Tensor:
        gc.collect()  # what an automatic collection does at an unlucky allocation
        return pack_op()(weight, rows)

    registry = PackedWeights(packer_that_collects, available=lambda: None)
    holder = torch.nn.Linear(96, 300)
    holder.__dict__["cycle"] = holder  # only the cyclic collector frees it
    assert registry.get(holder.weight) is not None
    del holder
    done = threading.Event()

    def pack_another() -> None:
        registry.get(torch.randn(300, 96))
        done.set()

    threading.Thread(target=pack_another, daemon=True).start()
    assert done.wait(timeout=30), "packing hung: the collected weight's finalizer waited for the packing's lock"
    assert registry.nbytes == 0 and not registry._entries  # both weights gone, and their copies with them
