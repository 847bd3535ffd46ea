"""The one markdown-table writer (planner reports, experiment reports, multirun summaries) and its number format."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def fmt(x: Any, digits: int = 3) -> str:
    """A table cell: None/NaN as '–', booleans as yes/no, integers as is (thousands separated), floats to ``digits``
    significant digits (thousands separated from 10**digits on); strings unchanged."""
    if x is None:
        return "–"
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return f"{int(x):,}"
    if isinstance(x, (float, np.floating)):
        if not math.isfinite(x):
            return "–"
        if x == 0:
            return "0"
        mag = math.floor(math.log10(abs(x)))
        if mag >= digits:
            return f"{x:,.0f}"
        return f"{x:.{max(digits - 1 - mag, 0)}f}"
    return str(x)


def table(rows: Sequence[Mapping[str, Any] | Sequence[Any]], columns: Sequence[str] | None = None) -> str:
    """A GitHub markdown table. ``rows`` are dicts (``columns`` picks and orders keys; default: the first row's) or
    sequences (``columns`` are then the headers). Cells that are not strings go through :func:`fmt`."""
    if not rows:
        return ""
    if isinstance(rows[0], Mapping):
        columns = list(columns or rows[0])
        cells = [[r.get(c) for c in columns] for r in rows]
    else:
        if columns is None:
            raise ValueError("rows given as sequences need columns (the headers)")
        cells = [list(r) for r in rows]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in r) + " |" for r in cells]
    return "\n".join(lines)
