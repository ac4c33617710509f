"""builtin_models.linear: the CPU kernel choice never changes what a linear layer computes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import builtin_models.linear as linear_module
from builtin_models.linear import Linear, linear

#: Every test, through every kernel (a calibration may choose any of them).
pytestmark = pytest.mark.usefixtures("forced_kernel")


ROWS = [1, 2, 24, 25, 128, 129, 300]


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


def assert_close_to_reference(y: torch.Tensor, x, weight, bias) -> None:
    expected = reference(x, weight, bias)
    assert y.shape == expected.shape and y.dtype == x.dtype
    assert y.is_contiguous()
    # fp32 sums of in_features products: a few ulps of the largest partial sum.
    scale = F.linear(x.double().abs(), weight.double().abs()).max().item() + 1
    assert (y.double() - expected).abs().max().item() <= 1e-6 * scale


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_float64(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(200, 96, generator=generator)
    bias = torch.randn(200, generator=generator) if with_bias else None
    with torch.inference_mode():
        y = linear(x, weight, bias)
    assert_close_to_reference(y, x, weight, bias)
    # and as close to F.linear as two fp32 kernels can be
    torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 4, 40])
def test_strided_and_batched_inputs(rows):
    """The last position of a (B, T, E) batch is strided; leading dimensions are kept."""
    hidden = torch.randn(rows, 5, 64)
    weight, bias = torch.randn(32, 64), torch.randn(32)
    last = hidden[:, -1]
    assert last.stride() == (5 * 64, 1)
    with torch.inference_mode():
        assert_close_to_reference(linear(last, weight, bias), last, weight, bias)
        y = linear(hidden, weight, bias)
    assert y.shape == (rows, 5, 32)
    assert_close_to_reference(y, hidden, weight, bias)


@pytest.mark.parametrize("rows", [1, 32, 300])
@pytest.mark.parametrize("kind", ["strided", "expanded", "one value"])
def test_a_bias_that_is_a_view_or_broadcast_is_added_as_f_linear_adds_it(rows, kind):
    # A plugin may replace a bias by any tensor F.linear takes. oneDNN read a strided or expanded one as if its
    # values lay side by side (errors of 4.5, or 1e36), and crashed on a (1,) bias.
    x, weight = torch.randn(rows, 64), torch.randn(48, 64)
    bias = {
        "strided": torch.randn(48, 2)[:, 0],
        "expanded": torch.randn(1).expand(48),
        "one value": torch.randn(1),
    }[kind]
    with torch.inference_mode():
        y = linear(x, weight, bias)
    assert_close_to_reference(y, x, weight, bias)


def test_inputs_are_never_written():
    x, weight, bias = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    before = [t.clone() for t in (x, weight, bias)]
    with torch.inference_mode():
        linear(x, weight, bias)
        linear(x[:1], weight, bias)
    for original, after in zip(before, (x, weight, bias), strict=True):
        assert torch.equal(original, after)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_go_to_f_linear(dtype):
    x, weight, bias = torch.randn(2, 16, dtype=dtype), torch.randn(8, 16, dtype=dtype), torch.randn(8, dtype=dtype)
    with torch.inference_mode():
        assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))


def test_mismatched_shapes_raise_what_f_linear_raises():
    x, weight = torch.randn(2, 15), torch.randn(8, 16)
    with pytest.raises(RuntimeError) as ours, torch.inference_mode():
        linear(x, weight)
    with pytest.raises(RuntimeError) as theirs:
        F.linear(x, weight)
    assert str(ours.value) == str(theirs.value)


def test_transposed_weight_goes_to_f_linear():
    weight = torch.randn(16, 8).t()  # (8, 16), not contiguous: a plugin may hand one over
    x = torch.randn(1, 16)
    with torch.inference_mode():
        assert torch.equal(linear(x, weight), F.linear(x, weight))


def test_gradients_flow_when_autograd_is_on():
    layer = Linear(16, 8)
    x = torch.randn(2, 16, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(2, 16).detach())


def test_linear_module_keeps_nn_linear_parameters():
    layer = Linear(16, 8)
    assert isinstance(layer, torch.nn.Linear)
    assert [name for name, _ in layer.named_parameters()] == ["weight", "bias"]
    x = torch.randn(1, 16)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 160),
    in_features=st.integers(1, 70),
    out_features=st.integers(1, 70),
    with_bias=st.booleans(),
)
def test_any_shape_matches_float64(rows, in_features, out_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 10_000 + in_features * 100 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    with torch.inference_mode():
        assert_close_to_reference(linear(x, weight, bias), x, weight, bias)


def test_plain_linear_switch_turns_onednn_off():
    def onednn_usable(switch: str) -> str:
        code = "import builtin_models.linear as m; print(m.onednn_in_use())"
        env = {**os.environ, linear_module.PLAIN_LINEAR_ENV: switch}
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout

    assert onednn_usable("1").strip() == "False"
    assert onednn_usable("").strip() == str(torch.backends.mkldnn.is_available())


def test_first_import_under_a_meta_device_and_half_default_dtype_still_finds_onednn():
    """A plugin's model constructor (run on meta, under the engine's dtype) may be the first importer."""
    code = (
        "import torch\n"
        "torch.set_default_dtype(torch.bfloat16)\n"
        "with torch.device('meta'):\n"
        "    import builtin_models.linear as m\n"
        "torch.set_default_dtype(torch.float32)\n"
        "m.use_kernel_table(m.make_kernel_table(mode='onednn_swapped'))\n"
        "x, w = torch.randn(3, 64), torch.randn(96, 64)\n"
        "with torch.inference_mode():\n"
        "    ok = torch.allclose(m.linear(x, w), torch.nn.functional.linear(x, w), atol=1e-5)\n"
        "print(m.onednn_in_use(), ok)"
    )
    env = {k: v for k, v in os.environ.items() if k != linear_module.PLAIN_LINEAR_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == [str(torch.backends.mkldnn.is_available()), "True"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tracers_follow_linear_as_they_follow_nn_linear(dtype):
    """fx's proxies and jit's traced sizes never reach the shortcut to a known kernel (they failed in it)."""
    layer = Linear(4, 8).to(dtype)
    x = torch.randn(3, 4, dtype=dtype)
    with torch.inference_mode():
        linear(torch.randn(3, 4), torch.randn(8, 4))  # a table with choices, as in a running engine
    expected = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(torch.fx.symbolic_trace(layer)(x), expected)
    if dtype is torch.bfloat16:  # jit.trace of the fp32 path fails on oneDNN's operator, as it always has
        torch.testing.assert_close(torch.jit.trace(layer, x)(x), expected)


def test_products_that_only_f_linear_takes_build_no_kernel_table(monkeypatch):
    """Half precision (or a GPU) never builds the table, whose cache directory may not exist (no home)."""
    linear_module.use_kernel_table(None)
    with torch.inference_mode():
        linear(torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(8, 4, dtype=torch.bfloat16))
    assert linear_module._table is None
