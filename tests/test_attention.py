"""Decoding attention row by row: when the engine chooses it, and that it gives what padded attention gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from builtin_models.attention import cached_attention, row_ends

H, D = 12, 64  # OPT-125m's heads


def decoding_step(ends: list[int], kv_heads: int = H, window: int | None = None) -> tuple:
    """q (B, H, 1, D), the cache's k, v (B, kv_heads, S, D), an additive mask (B, 1, 1, S), positions (B, 1)."""
    torch.manual_seed(0)
    B, S = len(ends), max(ends)
    q = torch.randn(B, H, 1, D)
    k, v = torch.randn(B, kv_heads, S, D), torch.randn(B, kv_heads, S, D)
    positions = torch.tensor(ends)[:, None] - 1
    slots = torch.arange(S)[None, :]
    allowed = slots <= positions
    if window is not None:
        allowed &= slots > positions - window
    mask = torch.zeros(B, 1, 1, S).masked_fill_(~allowed[:, None, None, :], float("-inf"))
    return q, k, v, mask, positions


def test_rows_of_equal_length_attend_together():
    q, k, _, _, positions = decoding_step([400] * 32)
    assert row_ends(q, k, positions) is None


def test_rows_far_shorter_than_the_longest_attend_row_by_row():
    ends = [400] * 16 + [40] * 16  # 45% of the slots read would be padding: ~1 MiB a row on average
    q, k, _, _, positions = decoding_step(ends)
    assert row_ends(q, k, positions) == ends


def test_little_padding_is_not_worth_a_call_per_row():
    q, k, _, _, positions = decoding_step([400] + [395] * 31)  # 5 slots of padding a row: 30 KiB
    assert row_ends(q, k, positions) is None


def test_prefill_and_single_rows_attend_as_always():
    q, k, _, _, positions = decoding_step([400] * 16 + [40] * 16)
    assert row_ends(q.expand(-1, -1, 4, -1), k, positions.expand(-1, 4)) is None  # 4 new tokens a row
    assert row_ends(q[:1], k[:1], positions[:1]) is None


@pytest.mark.parametrize(
    ("kv_heads", "window"), [(H, None), (4, None), (H, 30)], ids=["heads", "grouped-query", "sliding window"]
)
def test_row_by_row_gives_what_padded_attention_gives(kv_heads, window):
    ends = [500, 12, 150, 499, 1, 64]
    q, k, v, mask, positions = decoding_step(ends, kv_heads, window)
    assert row_ends(q, k, positions) == ends
    gqa = kv_heads != H
    rows = cached_attention(q, k, v, mask, positions, scale=D**-0.5, enable_gqa=gqa)
    padded = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5, enable_gqa=gqa)
    assert rows.shape == padded.shape == (len(ends), H, 1, D)
    torch.testing.assert_close(rows, padded, rtol=1e-5, atol=1e-6)
