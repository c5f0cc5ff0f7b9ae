"""Predicted loss increase ΔL_l(f) of quantizing one layer to each candidate format.

δ = Q_f(W) − W (RTN, the quantize stage's starting grid) weighted by the layer's curvature:

* fisher:     ½ Σ_i F_ii δ_i²
* gradient:   |Σ_i ḡ_i δ_i|, the first-order term (ḡ: mean gradient on the data's labels)
* hutchinson: ½ · max(Tr(H_l), 0)/n_l · ‖δ‖²   (HAWQ-v2 with the Taylor ½: loss units)
* gptq_proxy: ``full`` ½ Σ_rows δ_r H δ_rᵀ, H = 2/N Σ xxᵀ (GPTQ's output error); ``diag``
  ½ Σ_{r,j} H_jj δ_rj²; an embedding's one-hot input gives Σ_v freq_v ‖δ_v‖².
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from pipeline.quant.gptq import gptq_quantize
from pipeline.quant.rtn import quantize_rtn
from pipeline.quant.sequential import QuantOptions

Weigh = Callable[[Tensor], Tensor]  # δ (out, in) -> scalar ΔL


def quant_error(w: Tensor, fmt: str) -> Tensor:
    """δ = Q_f(W) − W in float32 for an (out, in) weight."""
    w = w.detach().float()
    return quantize_rtn(w, fmt).dequantize(torch.float32).to(w.device) - w


@torch.no_grad()
def layer_dloss(w: Tensor, formats: Sequence[str], weigh: Weigh) -> dict[str, float]:
    """{format: ΔL} for one weight (out, in) under the curvature weighting ``weigh``."""
    return {f: float(weigh(quant_error(w, f))) for f in formats}


@torch.no_grad()
def gptq_share(
    w: Tensor, H: Tensor, formats: Sequence[str], opts: QuantOptions
) -> dict[str, float]:
    """{format: Σ_rows δ_G H δ_Gᵀ / δ_R H δ_Rᵀ}: the share of RTN's output error GPTQ leaves. It
    moves error to input directions the layer rarely sees, unseen by a per-weight estimate."""
    w = w.detach().float()
    H = H.to(device=w.device, dtype=torch.float32)
    output_error = hessian_weigh(H)
    out = {}
    for f in formats:
        ref = float(output_error(quant_error(w, f)))
        qt, _ = gptq_quantize(w, H, f, opts.block_size, opts.damp, opts.act_order)
        gptq = qt.dequantize(torch.float32).to(w.device) - w
        out[f] = float(output_error(gptq)) / ref if ref > 0 else 1.0
    return out


def fisher_weigh(fisher: Tensor) -> Weigh:
    """½ Σ F δ² with the diagonal Fisher F (out, in)."""
    return lambda d: 0.5 * (fisher * d * d).sum()


def gradient_weigh(grad: Tensor) -> Weigh:
    """|Σ ḡ δ| with the mean gradient ḡ (out, in)."""
    return lambda d: (grad * d).sum().abs()


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
