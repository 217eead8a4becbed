"""Printing helpers for commands: aligned tables and JSON."""

from __future__ import annotations

import json
import math
import sys


def print_json(obj) -> None:
    from kvsim.io import finite_json
    text = json.dumps(finite_json(obj), indent=2, sort_keys=True, allow_nan=False)
    sys.stdout.write(text + "\n")


def fmt(x) -> str:
    if isinstance(x, float):
        if x == 0 or not math.isfinite(x):
            return f"{x:g}"
        if 1e4 <= abs(x) < 1e15:  # 39,440 rather than 3.944e+04
            return f"{x:,.0f}"
        return f"{x:.4g}"
    return str(x)


def table(rows: list[dict], columns: list[str] | None = None, file=None) -> None:
    """Rows as an aligned text table (numbers right-aligned)."""
    file = file or sys.stdout
    if not rows:
        print("(no rows)", file=file)
        return
    columns = columns or list(rows[0])
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) for r in rows) for c in columns]
    line = lambda vals: "  ".join(v.rjust(w) if n else v.ljust(w)  # noqa: E731
                                  for v, w, n in zip(vals, widths, numeric)).rstrip()
    print(line(columns), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print(line(row), file=file)
