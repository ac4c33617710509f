"""Plain-text tables for the listing commands."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces; the last column is not padded."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [c.ljust(w) for c, w in zip(cells[:-1], widths[:-1], strict=True)] + [cells[-1]]
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])
