"""Plain-text tables and loss plots for demo results.

    >>> print(summary_table([{"run": "sync", "loss": 1.23456, "steps": 1200}],
    ...                     ["run", "loss", "steps"]))
    run     loss  steps
    ----  ------  -----
    sync  1.2346  1,200
    >>> human_bytes(1_258_291)
    '1.2 MiB'
    >>> plot_loss({"sync": [(0, 5.5), (10, 3.1)]}, "/tmp/loss.png", "demo")  # doctest: +SKIP
    '/tmp/loss.png'
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import matplotlib

# Select the non-interactive backend before pyplot is imported so plotting
# works on headless machines (CI, containers, ssh sessions without $DISPLAY).
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (must follow matplotlib.use)

__all__ = ["human_bytes", "format_value", "summary_table", "plot_loss"]

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


def plot_loss(series: dict[str, list[tuple[int, float]]], path: str, title: str) -> str:
    """Write a PNG of loss against step, one labelled line per series.

        >>> plot_loss({"w0": [(0, 5.5), (1, 4.0)]}, "loss.png", "run")  # doctest: +SKIP
        'loss.png'
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for label, points in series.items():
            if not points:
                continue
            steps, losses = zip(*points)
            ax.plot(steps, losses, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if any(series.values()):
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:
        # Close explicitly: pyplot keeps figures alive otherwise, which leaks
        # memory when a long demo plots repeatedly.
        plt.close(fig)
    return path
