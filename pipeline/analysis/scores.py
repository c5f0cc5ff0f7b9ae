"""Predicted loss increase ΔL_l(f) of quantizing one layer to each candidate format.

For every candidate the layer's weight is round-to-nearest quantized (``quantize_rtn``, the
same grid search the quantize stage starts from) and the error δ = Q_f(W) − W is weighted by the
layer's curvature estimate (see ``estimators``):

* fisher:     ΔL = ½ Σ_i F_ii δ_i²
* hutchinson: ΔL = ½ · Tr(H_l)/n_l · ‖δ‖²   (HAWQ-v2's Ω with the Taylor ½, so it is in loss
  units like the others; a negative trace estimate, possible for a non-convex layer or from
  probe noise, is clamped to 0: the loss is predicted flat there)
* gptq_proxy, ``full``: ΔL = ½ Σ_rows δ_r H δ_rᵀ with H = 2/N Σ x xᵀ, i.e. the mean squared
  layer-output error ‖δ x‖² over calibration tokens (what GPTQ minimises);
  ``diag``: ½ Σ_{r,j} H_jj δ_rj² (per-weight H_ii weighting, ignores input correlations).
* embeddings under gptq_proxy: the input is one-hot, H = 2·diag(token frequency), so
  ΔL = Σ_v freq_v ‖δ_v‖² (rows of tokens never seen cost nothing).

GPTQ's error feedback makes its real error smaller than RTN's; the proxy ranks layers, the
quantize stage does the actual work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from pipeline.quant.rtn import quantize_rtn

Weigh = Callable[[Tensor], Tensor]  # δ (out, in) -> scalar ΔL


def quant_error(w: Tensor, fmt: str) -> Tensor:
    """δ = Q_f(W) − W in float32 for an (out, in) weight."""
    w = w.detach().float()
    return quantize_rtn(w, fmt).dequantize(torch.float32).to(w.device) - w


@torch.no_grad()
def layer_dloss(w: Tensor, formats: Sequence[str], weigh: Weigh) -> dict[str, float]:
    """{format: ΔL} for one weight (out, in) under the curvature weighting ``weigh``."""
    return {f: float(weigh(quant_error(w, f))) for f in formats}


def fisher_weigh(fisher: Tensor) -> Weigh:
    """½ Σ F δ² with the diagonal Fisher F (out, in)."""
    return lambda d: 0.5 * (fisher * d * d).sum()


def trace_weigh(trace: float, numel: int) -> Weigh:
    """½ · max(Tr, 0)/n · ‖δ‖² (HAWQ-v2)."""
    mean_eig = max(trace, 0.0) / numel
    return lambda d: 0.5 * mean_eig * (d * d).sum()


def hessian_weigh(H: Tensor, weighting: str = "full") -> Weigh:
    """GPTQ proxy with the input Hessian H (in, in): ``full`` or ``diag`` (see module doc)."""
    if weighting == "diag":
        diag = H.diagonal()  # (in,)
        return lambda d: 0.5 * (d * d * diag).sum()
    if weighting != "full":
        raise ValueError(f"weighting must be 'full' or 'diag', got {weighting!r}")
    return lambda d: 0.5 * ((d @ H) * d).sum()  # Σ_rows δ_r H δ_rᵀ


def embedding_weigh(counts: Tensor) -> Weigh:
    """Σ_v freq_v ‖δ_v‖² for an embedding table (vocab, hidden) and token counts (vocab,)."""
    freq = (counts / counts.sum().clamp_min(1)).float()[:, None]  # (vocab, 1)
    return lambda d: (freq * d * d).sum()
