"""Error flow: how a quantized model's hidden states drift from the FP model's, layer by layer.

The idea (used in the GPTQ/OmniQuant/QuIP line of work to diagnose where quantization hurts):
run the FP model and the quantized model on the same token windows with
``output_hidden_states=True`` and measure, after every decoder layer l,

    e_l = ||h_q^l - h_fp^l||_F / ||h_fp^l||_F

with the norms taken over every token of every window (one number per layer, not a mean of
per-window ratios, so short or low-norm windows do not dominate). A curve that jumps at one
layer points at that layer's format; a steadily growing curve is accumulated error that
sequential GPTQ or distillation should flatten. Comparing the curve before and after
distillation shows where QAT recovered the error.

Trade-off: both models are held in memory and run side by side, so this is for models that fit
(the evaluate stage's models); the hidden states of one batch at a time are kept, not all.
Entry ``l`` of the result is HF's ``hidden_states[l + 1]``, the output of decoder layer ``l``;
in HF's Llama-family models the last entry is taken after the final norm.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn


@torch.no_grad()
def error_flow(
    fp_model: nn.Module, q_model: nn.Module, windows: Tensor, batch_size: int = 8
) -> list[float]:
    """Relative hidden-state error of ``q_model`` vs ``fp_model`` after every decoder layer.

    Args:
        fp_model: The reference causal LM (HF ``PreTrainedModel``).
        q_model: The model under test, same architecture and depth (e.g. ``load_quantized``).
        windows: Token ids. # (W, T)
        batch_size: Windows per forward pass.

    Returns:
        ``[e_0, ..., e_{L-1}]``, one relative error per decoder layer.

    Raises:
        ValueError: If ``windows`` is empty or the two models differ in depth.
    """
    if windows.ndim != 2 or windows.shape[0] == 0:
        raise ValueError(f"windows must be a non-empty (W, T) tensor of ids, got {windows.shape}")
    fp_model.eval()
    q_model.eval()
    diff = ref = None  # (L,) sums of squares over all tokens
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i : i + batch_size]
        h_fp = fp_model(input_ids=x, output_hidden_states=True).hidden_states[1:]
        h_q = q_model(input_ids=x, output_hidden_states=True).hidden_states[1:]
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
    """One line per labelled curve: relative error (log scale) vs decoder layer.

    Args:
        curves: ``{label: error_flow(...)}``, e.g. ``{"quantized": ..., "distilled": ...}``.
        title: Axes title.

    Returns:
        A matplotlib ``Figure`` (the caller saves or logs it, then closes it).
    """
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
