"""Attention over the KV cache, row by row in a decoding step where padding would cost more than the calls.

A decoding step attends every row over the first S slots of the cache, S the
longest row's length, the shorter rows masked. Rows of a continuous batch
differ in length (a 20-token prompt beside a 400-token conversation), and on a
CPU, where attention reads keys and values at memory speed, a masked slot costs
as much as a real one: at 32 rows of the OPT-125m shape, lengths 16-500,
attention read twice the bytes it needed, ~18 of an ~83 ms step. There,
attending each row over its own slots (one call per row) is cheaper, once the
bytes saved outweigh the calls' overhead.

Slot p of a row holds position p (``builtin_models.kv_cache``), and a token
never attends a later position (the engine's masks are causal; the models'
``mask`` argument says so): cutting row b's slots at its position + 1 drops
nothing the mask allows, and the rest of the mask (padding, sliding windows)
still applies. A row's result is then what attending it alone gives.

Shapes: B batch, Hq query heads, Hkv key/value heads, T new tokens, S slots, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["cached_attention", "row_ends"]

#: Row by row when padding to the longest row would read at least this many more bytes of keys and
#: values per row than the rows' own slots: on a 2-core EPYC (AVX-512), where one more attention
#: call costs ~9-16 us, row by row began to win at 250-500 KiB of padding a row (OPT-125m and
#: grouped-query Llama shapes, 8 and 32 rows).
ROW_BY_ROW_BYTES = 384 * 1024


def row_ends(q: Tensor, k: Tensor, positions: Tensor) -> list[int] | None:
    """Each row's slots to attend (its position + 1), when a decoding step should attend row by row; else None.

    Only on a CPU (on a GPU the loop would cost a host synchronisation and a launch per row and layer;
    not measured there), never while compiling, and only for one new token a row.
    """
    B, T = positions.shape  # not q's: grouped queries attend as several tokens of one head (``cached_attention``)
    if T != 1 or B == 1 or q.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    S = k.shape[2]
    ends = [min(int(p) + 1, S) for p in positions[:, -1].tolist()]
    slot_bytes = 2 * k.shape[1] * k.shape[3] * k.element_size()  # keys and values of one slot, every head
    if (B * S - sum(ends)) * slot_bytes < B * ROW_BY_ROW_BYTES:
        return None
    return ends


def cached_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    positions: Tensor,
    *,
    scale: float,
    enable_gqa: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """Attention of q (B, Hq, T, D) over the cache's k, v (B, Hkv, S, D) under ``mask`` (B or 1, 1, T, S).

    ``positions`` (B, T) are the new tokens' positions. The result is (B, Hq, T, D) in q's dtype, the
    same as ``F.scaled_dot_product_attention`` over the padded slots gives, row by row where that is
    cheaper. It attends in the cache's dtype (a bfloat16 cache of a float32 model, ``kv_cache_dtype``:
    the queries are rounded to it, which keeps the keys and values at half the bytes; converting
    them to float32 instead took 76 against 26 ms for 32 rows of 16-500 slots and 12 layers on a
    2-core Xeon with AVX512-BF16, 41 in float32), or in ``compute_dtype`` where given (GPT-2's upcast
    attention), each row cast after its slots are cut, so the padding is never converted.

    Grouped-query attention of one new token a row, on a CPU, attends the G = Hq / Hkv query heads that
    share a key/value head as G tokens of that head (they have the same mask row): each key and value is
    read once, where sdpa's ``enable_gqa`` costs a third more (2-core Xeon, 12/4 heads, 8 rows of 300
    slots: 197 against 146 us a layer).
    """
    if enable_gqa and q.shape[2] == 1 and q.is_cpu:
        B, Hq, _, D = q.shape
        grouped = q.reshape(B, k.shape[1], Hq // k.shape[1], D)  # (B, Hkv, G, D)
        y = cached_attention(grouped, k, v, mask, positions, scale=scale, compute_dtype=compute_dtype)
        return y.reshape(B, Hq, 1, D)  # (B, Hkv, G, D) -> (B, Hq, 1, D)
    gqa = {"enable_gqa": True} if enable_gqa else {}  # a keyword torch < 2.5 does not know
    dtype = compute_dtype or k.dtype
    out_dtype = q.dtype
    if mask.dtype != torch.bool and mask.dtype != dtype:  # additive: in the dtype attended in (boolean stays)
        mask = mask.to(dtype)
    ends = row_ends(q, k, positions)
    if ends is None:
        if not q.dtype == k.dtype == v.dtype == dtype:  # else no casts: a no-op .to() is a dispatch all the same
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **gqa)
        return y if y.dtype == out_dtype else y.to(out_dtype)
    if q.dtype != dtype:
        q = q.to(dtype)  # once for every row
    cast = not k.dtype == v.dtype == dtype  # else no casts: 2 dispatches a row and layer saved
    # A row whose mask allows every slot up to its end (the engine's causal mask, cut at the row's position) attends
    # without it: the same result, and sdpa neither slices nor adds a mask (~7 us a row and layer).
    allowed = mask[:, 0, 0] if mask.dtype == torch.bool else mask[:, 0, 0] == 0  # (B or 1, S); a bias is not 0
    leading = allowed.int().cumprod(dim=-1).sum(dim=-1).tolist()  # slots allowed before the first one masked
    rows = []
    for b, end in enumerate(ends):
        # (1, H, T, D), then (1, Hkv, end, D) twice
        q_row, k_row, v_row = q[b : b + 1], k[b : b + 1, :, :end], v[b : b + 1, :, :end]
        if cast:
            k_row, v_row = k_row.to(dtype), v_row.to(dtype)
        m = b if len(leading) > 1 else 0
        row_mask = None if leading[m] >= end else mask[m : m + 1, ..., :end]  # (1, 1, 1, end)
        rows.append(F.scaled_dot_product_attention(q_row, k_row, v_row, attn_mask=row_mask, scale=scale, **gqa))
    y = torch.cat(rows)  # (B, H, T, D): for grouped queries, Hkv heads of G tokens
    return y if y.dtype == out_dtype else y.to(out_dtype)
