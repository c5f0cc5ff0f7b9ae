"""Error flow: how a quantized model's hidden states drift from the FP model's, layer by layer.

After every decoder layer l, e_l = ‖h_q^l − h_fp^l‖_F / ‖h_fp^l‖_F over all tokens of all
windows (not a mean of per-window ratios, so low-norm windows do not dominate). A jump points at
one layer's format, a steady rise at accumulated error. Both models are held in memory.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from pipeline.models.hf import input_device


@torch.no_grad()
def error_flow(
    fp_model: nn.Module, q_model: nn.Module, windows: Tensor, batch_size: int = 8
) -> list[float]:
    """``[e_0, ..., e_{L-1}]`` of ``q_model`` vs ``fp_model`` (same depth) on ``windows`` (W, T)."""
    if windows.ndim != 2 or windows.shape[0] == 0:
        raise ValueError(f"windows must be a non-empty (W, T) tensor of ids, got {windows.shape}")
    fp_model.eval()
    q_model.eval()
    diff = ref = None  # (L,) sums of squares over all tokens
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i : i + batch_size]
        h_fp = fp_model(input_ids=x.to(input_device(fp_model)), output_hidden_states=True)
        h_fp = h_fp.hidden_states[1:]
        h_q = q_model(input_ids=x.to(input_device(q_model)), output_hidden_states=True)
        h_q = [h.to(h_fp[0].device) for h in h_q.hidden_states[1:]]
        if len(h_fp) != len(h_q):
            raise ValueError(
                f"the models differ in depth ({len(h_fp)} vs {len(h_q)} decoder layers); "
                "compare a quantized model with the FP model it was made from"
            )
        # Each (B, T, C); stacked to (L, B, T, C) only one batch at a time.
        fp = torch.stack([h.float() for h in h_fp])
        d = torch.stack([h.float() for h in h_q]) - fp
        batch_diff = d.square().flatten(1).sum(1).double()  # (L,)
        batch_ref = fp.square().flatten(1).sum(1).double()  # (L,)
        diff = batch_diff if diff is None else diff + batch_diff
        ref = batch_ref if ref is None else ref + batch_ref
    return (diff / ref.clamp_min(1e-30)).sqrt().tolist()


def format_error_flow(curves: Mapping[str, list[float]]) -> str:
    """A markdown table: one row per decoder layer, one column per labelled curve."""
    labels = list(curves)
    depth = max((len(v) for v in curves.values()), default=0)
    lines = [
        "| layer | " + " | ".join(labels) + " |",
        "|---:|" + "---:|" * len(labels),
    ]
    for layer in range(depth):
        cells = [f"{curves[k][layer]:.4f}" if layer < len(curves[k]) else "" for k in labels]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_error_flow(curves: Mapping[str, list[float]], title: str = "hidden-state error flow"):
    """A matplotlib Figure: one line per ``{label: error_flow(...)}`` curve, log scale."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, errors in curves.items():
        ax.plot(range(len(errors)), errors, marker="o", label=label)
    if any(e > 0 for errors in curves.values() for e in errors):
        ax.set_yscale("log")  # errors span decades between 4- and 2-bit layers
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("||h_q - h_fp|| / ||h_fp||")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if curves:
        ax.legend()
    fig.tight_layout()
    return fig
