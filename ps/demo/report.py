"""Loss plots for demo results (tables: ``ps.tools.format``).

    >>> plot_loss({"sync": [(0, 5.5), (10, 3.1)]}, "/tmp/loss.png", "demo")  # doctest: +SKIP
    '/tmp/loss.png'
"""

from __future__ import annotations

import matplotlib

# Select the non-interactive backend before pyplot is imported so plotting
# works on headless machines (CI, containers, ssh sessions without $DISPLAY).
matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ps.tools.format import format_value, human_bytes, summary_table

__all__ = ["human_bytes", "format_value", "summary_table", "plot_loss"]


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
