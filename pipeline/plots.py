"""Small matplotlib helpers for stage reports, saved as PNG: object API on the Agg canvas (no
pyplot state, no display), so safe in workers and on headless nodes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _figure(n_rows: int, width: float = 8.0) -> Figure:
    height = min(max(3.0, 0.22 * n_rows + 1.5), 40.0)
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def short_name(name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``3.q_proj`` for axis labels."""
    parts = name.split(".")
    if len(parts) >= 4 and parts[1] == "layers":
        return f"{parts[2]}.{parts[-1]}"
    return parts[-1]


def heatmap(
    values: Sequence[Sequence[float | None]],
    rows: Sequence[str],
    cols: Sequence[str],
    path: Path,
    title: str,
    label: str,
    log10: bool = True,
) -> Path:
    """Heat map of values[row][col]; ``log10`` shows log10 of the values (≤ 0, None: blank)."""
    import numpy as np

    data = np.array([[np.nan if v is None else float(v) for v in r] for r in values], dtype=float)
    if log10:
        with np.errstate(divide="ignore", invalid="ignore"):
            data = np.where(data > 0, np.log10(np.where(data > 0, data, 1.0)), np.nan)
    fig = _figure(len(rows), width=2.5 + 1.2 * len(cols))
    ax = fig.add_subplot()
    img = ax.imshow(np.ma.masked_invalid(data), aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(cols)), list(cols), rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), [short_name(r) for r in rows], fontsize=7)
    ax.set_title(title)
    fig.colorbar(img, ax=ax, label=label)
    fig.savefig(path, dpi=110)
    return Path(path)


def bars(
    values: Sequence[float | None],
    labels: Sequence[str],
    path: Path,
    title: str,
    ylabel: str,
    log_y: bool = False,
    hline: float | None = None,
    hline_label: str | None = None,
    colors: Sequence[str] | None = None,
) -> Path:
    """Vertical bars, one per label; optional reference line (e.g. the budget) and colours."""
    vals = [math.nan if v is None else float(v) for v in values]
    fig = _figure(0, width=max(6.0, 0.25 * len(vals) + 2.0))
    ax = fig.add_subplot()
    ax.bar(range(len(vals)), vals, color=list(colors) if colors else "tab:blue")
    ax.set_xticks(range(len(vals)), [short_name(n) for n in labels], rotation=90, fontsize=7)
    if log_y and any(v > 0 for v in vals if not math.isnan(v)):
        ax.set_yscale("log")
    if hline is not None:
        ax.axhline(hline, color="tab:red", linestyle="--", label=hline_label)
        if hline_label:
            ax.legend()
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.savefig(path, dpi=110)
    return Path(path)


def before_after(
    before: Sequence[float | None],
    after: Sequence[float],
    labels: Sequence[str],
    path: Path,
    title: str,
    ylabel: str,
    hline: float | None = None,
) -> Path:
    """Two bars per label, ``before`` and ``after`` side by side (log scale), and a threshold."""
    fig = _figure(0, width=max(6.0, 0.3 * len(labels) + 2.0))
    ax = fig.add_subplot()
    x = range(len(labels))
    b = [math.nan if v is None else float(v) for v in before]
    ax.bar([i - 0.2 for i in x], b, width=0.4, color="tab:gray", label="before")
    ax.bar([i + 0.2 for i in x], [float(v) for v in after], width=0.4, label="after")
    ax.set_xticks(x, [short_name(n) for n in labels], rotation=90, fontsize=7)
    if any(v > 0 for v in after):
        ax.set_yscale("log")
    if hline is not None:
        ax.axhline(hline, color="tab:red", linestyle="--", label="threshold")
    ax.legend()
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.savefig(path, dpi=110)
    return Path(path)


def tradeoffs(
    x: Sequence[float | None],
    panels: Sequence[tuple[str, Sequence[float | None], Sequence[bool]]],
    labels: Sequence[str],
    path: Path,
    title: str,
    xlabel: str,
) -> Path:
    """One scatter panel per ``(ylabel, values, optimal)`` against the shared ``x``: every point
    labelled, the optimal ones starred and joined (a Pareto front). A point without a value is
    left out of that panel only."""
    fig = _figure(0, width=4.2 * len(panels))
    for ax, (ylabel, ys, optimal) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        shown = [
            (float(a), float(b), label, best)
            for a, b, label, best in zip(x, ys, labels, optimal)
            if a is not None and b is not None
        ]
        if not shown:
            ax.text(0.5, 0.5, "no values", ha="center", va="center", transform=ax.transAxes)
        else:
            ax.scatter([s[0] for s in shown], [s[1] for s in shown], color="tab:blue")
            front = sorted((s[0], s[1]) for s in shown if s[3])
            ax.plot(*zip(*front), "-*", color="tab:red", markersize=12, label="Pareto-optimal")
            for a, b, label, _ in shown:
                ax.annotate(label, (a, b), xytext=(4, 4), textcoords="offset points", fontsize=7)
            ax.legend(fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return Path(path)
