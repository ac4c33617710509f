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


@pytest.mark.parametrize("boolean_mask", [False, True], ids=["additive mask", "boolean mask"])
@pytest.mark.parametrize(
    ("kv_heads", "window"), [(H, None), (4, None), (H, 30)], ids=["heads", "grouped-query", "sliding window"]
)
def test_row_by_row_gives_what_padded_attention_gives(kv_heads, window, boolean_mask):
    ends = [500, 12, 150, 499, 1, 64]
    q, k, v, mask, positions = decoding_step(ends, kv_heads, window)
    if boolean_mask:
        mask = mask == 0  # True: attend
    assert row_ends(q, k, positions) == ends
    gqa = kv_heads != H
    rows = cached_attention(q, k, v, mask, positions, scale=D**-0.5, enable_gqa=gqa)
    padded = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5, enable_gqa=gqa)
    assert rows.shape == padded.shape == (len(ends), H, 1, D)
    torch.testing.assert_close(rows, padded, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["holes", "bias"])
def test_row_by_row_keeps_a_mask_that_is_more_than_causal(kind):
    # Rows whose mask allows every slot up to their end attend without it; a slot masked in the middle (a padded
    # prompt) or an additive bias that is not 0 must still apply.
    ends = [500, 12, 150, 499, 1, 64]
    q, k, v, mask, positions = decoding_step(ends)
    if kind == "holes":
        mask[0, ..., 100:120] = float("-inf")
        mask[3, ..., 0] = float("-inf")
        mask[1, ..., ends[1] - 1] = float("-inf")  # the row's own slot, its last
    else:
        mask[2] += torch.linspace(-3.0, 0.0, mask.shape[-1])  # ALiBi-like: a penalty growing with distance
    rows = cached_attention(q, k, v, mask, positions, scale=D**-0.5)
    padded = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5)
    torch.testing.assert_close(rows, padded, rtol=1e-5, atol=1e-6)
    if kind == "holes":  # as a boolean mask too
        boolean = cached_attention(q, k, v, mask == 0, positions, scale=D**-0.5)
        torch.testing.assert_close(boolean, padded, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 30], ids=["causal", "sliding window"])
@pytest.mark.parametrize("ends", [[300] * 8, [300], [500, 12, 150, 499]], ids=["padded", "one row", "row by row"])
def test_grouped_queries_of_one_token_attend_as_sdpa_repeating_the_heads(ends, window):
    # One new token a row: the query heads sharing a key/value head attend as tokens of that head. Queries as Llama
    # makes them, a view into the stacked product (not contiguous), and one mask for every row as well as one each.
    q, k, v, mask, positions = decoding_step(ends, kv_heads=4, window=window)
    stacked = torch.cat([q, torch.randn(len(ends), 8, 1, D)], dim=1)  # (B, H + 2 Hkv, 1, D)
    q = stacked[:, :H]
    for m in (mask, mask[:1]) if len(set(ends)) == 1 else (mask,):
        got = cached_attention(q, k, v, m, positions, scale=D**-0.5, enable_gqa=True)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=D**-0.5, enable_gqa=True)
        assert got.shape == (len(ends), H, 1, D)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("boolean_mask", [False, True], ids=["additive mask", "boolean mask"])
def test_attention_in_float32_over_a_half_precision_cache(boolean_mask):
    """GPT-2's upcast attention: a bfloat16 cache attended in float32, row by row as padded; bfloat16 out."""
    ends = [500, 12, 150, 499, 1, 64]
    q, k, v, mask, positions = (t.to(torch.bfloat16) for t in decoding_step(ends))
    if boolean_mask:
        mask = mask == 0
    assert row_ends(q, k, positions) is not None
    rows = cached_attention(q, k, v, mask, positions, scale=D**-0.5, compute_dtype=torch.float32)
    fp32_mask = mask if boolean_mask else mask.float()
    padded = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=fp32_mask, scale=D**-0.5)
    assert rows.dtype == torch.bfloat16
    torch.testing.assert_close(rows.float(), padded, rtol=4e-3, atol=1e-5)  # float32's, rounded once to bfloat16
    # Padded too (rows of one length: one call), as a prefill or equal rows meet it: bfloat16 out (it came out in
    # float32 for a while, and GPT-2's next product failed on the mixed dtypes).
    equal = cached_attention(q, k, v, mask, torch.full_like(positions, 499), scale=D**-0.5, compute_dtype=torch.float32)
    assert equal.dtype == torch.bfloat16


@pytest.mark.parametrize("ends", [[300] * 4, [500, 12, 150, 499]], ids=["padded", "row by row"])
def test_a_bfloat16_cache_is_attended_in_bfloat16_and_answers_in_the_queries_dtype(ends, monkeypatch):
    # kv_cache_dtype="bfloat16" halves what decoding reads only if attention takes the cache as it is held:
    # converting it back to float32 first read it, wrote a float32 copy and read that (slower than float32 alone).
    q, k, v, mask, positions = decoding_step(ends, kv_heads=4)
    k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
    attended = []
    sdpa = F.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        attended.append((query.dtype, key.dtype, value.dtype))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    got = cached_attention(q, k16, v16, mask, positions, scale=D**-0.5, enable_gqa=True)
    assert set(attended) == {(torch.bfloat16,) * 3} and got.dtype == torch.float32
    monkeypatch.undo()
    rounded = F.scaled_dot_product_attention(
        q, k16.float(), v16.float(), attn_mask=mask, scale=D**-0.5, enable_gqa=True
    )
    torch.testing.assert_close(got, rounded, rtol=0, atol=2e-2)  # the queries and the softmax rounded to bfloat16
