"""Plain-text formatting for terminals: byte counts and aligned tables.

    >>> print(summary_table([{"run": "sync", "loss": 1.23456, "steps": 1200}],
    ...                     ["run", "loss", "steps"]))
    run     loss  steps
    ----  ------  -----
    sync  1.2346  1,200
    >>> human_bytes(1_258_291)
    '1.2 MiB'
"""

from __future__ import annotations

import math
from numbers import Integral, Real

__all__ = ["human_bytes", "format_value", "summary_table"]

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """Format a byte count with binary units.

        >>> human_bytes(512), human_bytes(1536), human_bytes(3 * 2**30)
        ('512 B', '1.5 KiB', '3.0 GiB')
    """
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    for unit in _BYTE_UNITS:
        if value < 1024 or unit == _BYTE_UNITS[-1]:
            break
        value /= 1024
    if unit == "B":
        return f"{sign}{int(value)} B"
    return f"{sign}{value:.1f} {unit}"


def format_value(value: object) -> str:
    """Render one table cell: ints with thousands separators, floats compactly.

        >>> format_value(1234567), format_value(0.5), format_value(1.5e-6), format_value(None)
        ('1,234,567', '0.5000', '1.500e-06', '')
    """
    if value is None:
        return ""
    # bool is an Integral; print it as True/False, not 1/0.
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, Integral):
        return f"{int(value):,}"
    if isinstance(value, Real):
        x = float(value)
        if math.isnan(x) or math.isinf(x):
            return str(x)
        # Fixed 4 decimals reads well for losses and seconds; switch to
        # scientific when that would hide the magnitude.
        if x != 0.0 and (abs(x) < 1e-3 or abs(x) >= 1e6):
            return f"{x:.3e}"
        return f"{x:,.4f}"
    return str(value)


def summary_table(rows: list[dict], columns: list[str]) -> str:
    """Render ``rows`` as an aligned plain-text table with the given columns.

        >>> print(summary_table([{"a": 1, "b": "x"}, {"a": 22000}], ["a", "b"]))
             a  b
        ------  -
             1  x
        22,000

    Numbers are right-aligned, everything else left-aligned; missing keys
    render as empty cells. Trailing spaces are stripped from each line.
    """
    cells = [[format_value(row.get(col)) for col in columns] for row in rows]
    widths = [
        max([len(col)] + [len(r[i]) for r in cells]) for i, col in enumerate(columns)
    ]
    # A column is numeric if every present value is a (non-bool) number.
    numeric = []
    for col in columns:
        present = [row[col] for row in rows if row.get(col) is not None]
        numeric.append(
            bool(present)
            and all(isinstance(v, Real) and not isinstance(v, bool) for v in present)
        )

    def line(values: list[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric)
        ]
        return "  ".join(parts).rstrip()

    out = [line(list(columns)), line(["-" * w for w in widths])]
    out.extend(line(r) for r in cells)
    return "\n".join(out)
