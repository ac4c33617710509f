"""builtin_models.activations: config names to functions, in place where asked."""

from __future__ import annotations

import pytest
import torch

from builtin_models.activations import ACTIVATIONS, IN_PLACE, activation


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_in_place_versions_compute_the_same_values(name):
    x = torch.randn(4, 8)
    expected = ACTIVATIONS[name](x.clone())
    buffer = x.clone()
    result = activation(name, field="hidden_act", in_place=True)(buffer)
    torch.testing.assert_close(result, expected)
    if name in IN_PLACE:
        assert result.data_ptr() == buffer.data_ptr()  # no second buffer
    else:
        torch.testing.assert_close(buffer, x)  # no in-place kernel: the input is left alone


def test_out_of_place_by_default():
    x = torch.randn(3)
    before = x.clone()
    activation("relu", field="hidden_act")(x)
    assert torch.equal(x, before)


def test_unknown_activation_names_its_config_field_and_lists_the_known_ones():
    with pytest.raises(
        ValueError, match="hidden_act 'swiglu' is not supported by the builtin models; use one of gelu, "
    ):
        activation("swiglu", field="hidden_act")
