"""Error flow: where along the depth each low-bit target drifts from its FP model."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from torch import Tensor, nn

from pipeline.analysis.errorflow import error_flow, format_error_flow, plot_error_flow

log = logging.getLogger(__name__)


def error_flows(
    models: Mapping[str, nn.Module],
    fp: str,
    lowbit: Iterable[str],
    windows: Tensor,
    batch_size: int,
) -> dict[str, list[float]]:
    """``{name less "target_": relative hidden-state error after each decoder layer}`` of each
    of ``lowbit`` against ``models[fp]``, both looked up per curve (a ModelShelf holds the two).
    windows: (W, T)"""
    curves = {}
    for k in lowbit:
        curves[k.removeprefix("target_")] = error_flow(models[fp], models[k], windows, batch_size)
    if curves:
        last = "  ".join(f"{k} {v[-1]:.4f}" for k, v in curves.items())
        log.info("evaluate: error flow (last layer) %s", last)
    return curves


def write_error_flow(curves: Mapping[str, list[float]], out_dir: Path) -> None:
    """``error_flow.md`` (a table per layer) and ``error_flow.png`` into ``out_dir``."""
    import matplotlib.pyplot as plt

    (out_dir / "error_flow.md").write_text(format_error_flow(curves) + "\n")
    fig = plot_error_flow(curves)
    fig.savefig(out_dir / "error_flow.png", dpi=120)
    plt.close(fig)  # pyplot keeps every open figure alive
