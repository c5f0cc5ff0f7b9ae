"""A fitted importance score: ΔL = w_f·ΔL_fisher + w_h·ΔL_hutchinson + w_g·ΔL_gptq_proxy.

The estimators see different parts of the damage, and which mix predicts it depends on the
model, so it is measured: a few layers are RTN-quantized alone and the mean token KL(p_FP ‖ p_Q)
on the calibration windows is the target. The fit is non-negative least squares on relative
residuals, min_w Σ_r ((Σ_m w_m x_rm − y_r) / y_r)² s.t. w ≥ 0, over rows r = (layer, format):
linear so the allocator's sum stays additive; relative because ΔL and KL span decades (≈ a
log-space fit); w ≥ 0 because every estimator's cost grows with the error. With three unknowns
the optimum is exact by trying every support. ``rank_agreement`` (Spearman ρ) judges it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.analysis.sensitivity import METHODS, analyze
from pipeline.dist import Dist
from pipeline.quant.rtn import quantize_rtn

Scores = Mapping[str, Mapping[str, float]]  # {layer: {format: value}}


def fit_layer_names(names: Sequence[str], k: int) -> list[str]:
    """``k`` layers spread evenly over ``names`` (model order), first and last included."""
    if k >= len(names):
        return list(names)
    idx = np.unique(np.round(np.linspace(0, len(names) - 1, k)).astype(int))
    return [names[i] for i in idx]


def _log_probs(model: nn.Module, x: Tensor) -> Tensor:
    return model(input_ids=x).logits[:, :-1].float().log_softmax(-1)  # (B, T-1, V)


@torch.no_grad()
def measure_kl(
    model: nn.Module,
    windows: Tensor,
    names: Sequence[str],
    formats: Sequence[str],
    dist: Dist | None = None,
    batch_size: int = 8,
) -> dict[str, dict[str, float]]:
    """{name: {format: KL}}: mean token KL(p_FP ‖ p_Q) with each layer RTN-quantized alone."""
    dist = dist or Dist()
    device = next(model.parameters()).device
    mine = list(dist.shard(len(windows)))
    kl = torch.zeros(len(names), len(formats), dtype=torch.float64, device=device)
    for i, name in enumerate(names):
        w = model.get_submodule(name).weight
        orig = w.detach().clone()
        quantized = [quantize_rtn(orig, f).dequantize(w.dtype).to(device) for f in formats]
        try:
            for b in range(0, len(mine), batch_size):
                x = windows[mine[b : b + batch_size]].to(device)  # (B, T)
                base = _log_probs(model, x)
                for j, q in enumerate(quantized):
                    w.copy_(q)
                    logq = _log_probs(model, x)
                    kl[i, j] += F.kl_div(logq, base, log_target=True, reduction="sum").double()
                w.copy_(orig)
        finally:
            w.copy_(orig)
    dist.all_reduce_(kl).div_(len(windows) * (windows.shape[1] - 1))
    return {n: dict(zip(formats, row)) for n, row in zip(names, kl.tolist())}


def nnls(A: Tensor, b: Tensor) -> Tensor:
    """argmin_{w ≥ 0} ‖A w − b‖² for a few columns (A (R, M), b (R,)), by trying every support."""
    A, b = A.double(), b.double()
    scale = A.norm(dim=0).clamp_min(1e-300)  # columns of very different units
    An = A / scale
    best, best_res = torch.zeros(A.shape[1], dtype=torch.float64), float(b.square().sum())
    for k in range(1, A.shape[1] + 1):
        for support in itertools.combinations(range(A.shape[1]), k):
            cols = list(support)
            sol = torch.linalg.lstsq(An[:, cols], b[:, None]).solution[:, 0]
            if (sol < 0).any():
                continue
            res = float((An[:, cols] @ sol - b).square().sum())
            if res < best_res - 1e-12 * max(best_res, 1.0):
                best_res = res
                best = torch.zeros(A.shape[1], dtype=torch.float64)
                best[cols] = sol
    return best / scale


def _rows(predicted: Mapping[str, Scores], measured: Scores, names: Sequence[str]):
    methods = list(predicted)
    rows = [
        ([predicted[m][n][f] for m in methods], y)
        for n in names
        for f, y in measured[n].items()
        if y > 0  # a KL that rounds to zero carries no relative information
    ]
    if not rows:
        raise ValueError("no measured KL above zero to fit the importance weights to")
    return methods, rows


def fit_importance(
    predicted: Mapping[str, Scores], measured: Scores, names: Sequence[str] | None = None
) -> dict[str, float]:
    """{estimator: w ≥ 0} with Σ_m w_m ΔL_m ≈ the measured KL, in relative residuals."""
    methods, rows = _rows(predicted, measured, list(names or measured))
    x = torch.tensor([r[0] for r in rows], dtype=torch.float64)  # (R, M)
    y = torch.tensor([r[1] for r in rows], dtype=torch.float64)  # (R,)
    w = nnls(x / y[:, None], torch.ones_like(y))
    return dict(zip(methods, w.tolist()))


def combine(predicted: Mapping[str, Scores], weights: Mapping[str, float]) -> dict:
    """{layer: {format: Σ_m w_m ΔL_m}} over the layers and formats of the estimators."""
    first = next(iter(predicted.values()))
    return {
        n: {f: sum(w * predicted[m][n][f] for m, w in weights.items()) for f in first[n]}
        for n in first
    }


def _ranks(v: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (as Spearman's ρ defines them)."""
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(len(v), dtype=float)
    for value in np.unique(v):
        tie = v == value
        ranks[tie] = ranks[tie].mean()
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equal-length sequences."""
    ra, rb = _ranks(np.asarray(a, float)), _ranks(np.asarray(b, float))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def rank_agreement(score: Scores, measured: Scores, names: Sequence[str]) -> dict[str, float]:
    """Spearman ρ across ``names`` between ``score`` and ``measured``, per measured format."""
    formats = next(iter(measured[n] for n in names))
    return {f: spearman([score[n][f] for n in names], [measured[n][f] for n in names])
            for f in formats}  # fmt: skip


def analyze_combined(
    model: nn.Module,
    windows: Tensor,
    candidates: Sequence[str],
    dist: Dist | None = None,
    *,
    fit_layers: int,
    batch_size: int = 8,
    **estimator_kw,
) -> dict:
    """Report whose ``dloss`` is the fitted mix; every estimator's ΔL under ``estimators``."""
    dist = dist or Dist()
    reports = {
        m: analyze(model, windows, candidates, m, dist, batch_size=batch_size, **estimator_kw)
        for m in METHODS
    }
    predicted = {m: {la["name"]: la["dloss"] for la in r["layers"]} for m, r in reports.items()}
    names = [la["name"] for la in reports["fisher"]["layers"]]
    fit = fit_layer_names(names, fit_layers)
    measured = measure_kl(model, windows, fit, candidates, dist, batch_size)
    weights = fit_importance(predicted, measured)
    combined = combine(predicted, weights)
    rho = {m: rank_agreement(predicted[m], measured, fit) for m in METHODS}
    rho["combined"] = rank_agreement(combined, measured, fit)
    layers = [
        {**la, "dloss": combined[la["name"]],
         "estimators": {m: predicted[m][la["name"]] for m in METHODS}}
        for la in reports["fisher"]["layers"]
    ]  # fmt: skip
    return {
        **reports["fisher"],
        "method": "combined",
        "weighting": reports["gptq_proxy"]["weighting"],
        "layers": layers,
        "importance": {
            "weights": weights,
            "target": "KL(p_FP || p_Q) per token, calibration windows, RTN, one layer at a time",
            "fit_layers": fit,
            "measured_kl": measured,
            "rho_fit": rho,
        },
    }
