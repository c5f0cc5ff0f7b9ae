"""Per-layer sensitivity report of a whole model: ΔL for every candidate format + input outliers.

Every linear (lm_head included) and the embedding table (unless tied) are scored, so allocate
can see which are worth keeping float. With ``keep_cap`` every linear also gets its outlier
input columns and ``dloss_keep``: the estimate with δ[:, cols] replaced by their fp16 rounding
(what ``quantize_rtn(w, f, keep=cols)`` stores); exact for the Fisher and GPTQ proxy, while
Hutchinson's isotropic Tr/n under-predicts the gain. Ranks split the sequences, then the layers;
both sums are all-reduced, so every rank returns the same report.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from pipeline.analysis.capture import Capture, outlier_columns
from pipeline.analysis.estimators import (
    fisher_diagonal,
    forward_pass,
    hutchinson_trace,
    mean_gradient,
)
from pipeline.analysis.scores import (
    Weigh,
    embedding_weigh,
    fisher_weigh,
    gptq_share,
    gradient_weigh,
    hessian_weigh,
    layer_dloss,
    quant_error,
    trace_weigh,
)
from pipeline.dist import Dist
from pipeline.models.adapters import fused_groups, get_adapter, linear_names
from pipeline.quant.sequential import QuantOptions

METHODS = ("fisher", "hutchinson", "gptq_proxy", "gradient")
NO_STATS = {
    "share": None,
    "kurtosis": None,
    "max_over_median": None,
    "act8_error": None,
    "columns": [],
}


def scored_modules(
    model: nn.Module, include_lm_head: bool = True, include_embeddings: bool = True
) -> dict[str, nn.Module]:
    """{name: module} of what is scored, in model order: embeddings, block linears, lm_head."""
    adapter = get_adapter(model)
    out: dict[str, nn.Module] = {}
    tied = getattr(model.config, "tie_word_embeddings", False)
    if include_embeddings and not tied:
        out[adapter.embed] = model.get_submodule(adapter.embed)
    for name in linear_names(model, include_lm_head=include_lm_head):
        out[name] = model.get_submodule(name)
    return out


def analyze(
    model: nn.Module,
    windows: Tensor,
    candidates: Sequence[str],
    method: str,
    dist: Dist | None = None,
    *,
    weighting: str = "full",
    probes: int = 4,
    fisher_labels: str = "data",
    seed: int = 0,
    batch_size: int = 8,
    include_lm_head: bool = True,
    include_embeddings: bool = True,
    progress: bool = False,
    keep_cap: float | None = None,
    gptq: QuantOptions | None = None,
) -> dict:
    """Sensitivity report (``SensitivityReport``'s fields) of ``model`` on ``windows`` (S, T),
    the same tensor on every rank; the options are ``Estimator``'s (pipeline.analysis.estimate),
    ``keep_cap`` also scores kept outlier columns (at most that share of the inputs) and with
    ``gptq`` each linear's ΔL is scaled by the share of RTN's output error GPTQ leaves."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    dist = dist or Dist()
    modules = scored_modules(model, include_lm_head, include_embeddings)
    linears = {n: m for n, m in modules.items() if isinstance(m, nn.Linear)}
    shared = {n: g[0] for g in fused_groups(model) for n in g[1:]}  # k, v -> q; up -> gate
    hessians = method == "gptq_proxy" or gptq is not None
    capture = Capture(linears, hessians=hessians, shared=shared)
    estimate = dict(probes=probes, fisher_labels=fisher_labels, seed=seed, batch_size=batch_size)
    weigh = _weighs(model, windows, modules, capture, method, weighting, dist, progress, estimate)
    cols = {}
    if keep_cap is not None:  # every rank sees the same reduced absmax, so the same columns
        cols = {n: outlier_columns(capture.stats[n].absmax, keep_cap) for n in linears}
    params = {n: m.weight for n, m in modules.items()}
    device = next(model.parameters()).device  # NCCL reduces device tensors only
    share = None
    if gptq is not None:
        share = {n: functools.partial(gptq_share, H=capture.hessian(n), opts=gptq) for n in linears}
    table = _dloss_table(params, candidates, weigh, cols, dist, device, share)
    layers, k = [], len(candidates)
    for i, name in enumerate(params):
        stats = capture.stats[name].summary() if name in linears else dict(NO_STATS)
        entry = layer_entry(name, params[name], dict(zip(candidates, table[i, :k].tolist())), stats)
        if keep_cap is not None:
            keep = dict(zip(candidates, table[i, k:].tolist())) if cols.get(name) else None
            entry = with_columns(entry, cols.get(name, []), keep)
        layers.append(entry)
    return report(
        model.config,
        layers,
        method=method,
        weighting=weighting if method == "gptq_proxy" else None,
        fisher_labels=fisher_labels if method == "fisher" else None,
        candidates=candidates,
        windows=windows,
        delta="rtn" if gptq is None else "gptq",
    )


def _weighs(model, windows, modules, capture, method, weighting, dist, progress, kw) -> dict:
    """{name: Weigh} of every scored tensor under ``method``; ``capture`` is reduced after."""
    params = {n: m.weight for n, m in modules.items()}
    was_training = model.training
    model.eval()
    try:
        if method == "fisher":
            fisher = fisher_diagonal(
                model, windows, params, dist, progress, kw["fisher_labels"], kw["seed"]
            )
            weigh = {n: fisher_weigh(fisher[n]) for n in modules}
        elif method == "hutchinson":
            trace = hutchinson_trace(
                model, windows, params, dist, kw["probes"], kw["seed"], progress
            )
            weigh = {n: trace_weigh(trace[n], params[n].numel()) for n in modules}
        elif method == "gradient":
            grad = mean_gradient(model, windows, params, dist, progress)
            weigh = {n: gradient_weigh(grad[n]) for n in modules}
        else:
            vocab = model.get_input_embeddings().num_embeddings
            counts = forward_pass(model, windows, dist, kw["batch_size"], vocab, progress)
    finally:
        capture.remove()
        model.train(was_training)
    capture.reduce_(dist)
    if method == "gptq_proxy":
        weigh = {
            n: hessian_weigh(capture.hessian(n), weighting)
            if isinstance(m, nn.Linear)
            else embedding_weigh(counts)
            for n, m in modules.items()
        }
    return weigh


def _dloss_table(params, candidates, weigh, cols, dist: Dist, device, share) -> Tensor:
    """(layers, 2k) float64 ΔL, then with kept columns, times ``share``; sharded, all-reduced."""
    names, k = list(params), len(candidates)
    table = torch.zeros(len(names), 2 * k, dtype=torch.float64, device=device)
    for i in dist.shard(len(names)):
        n = names[i]
        dl, dk = layer_dloss_keep(params[n], candidates, weigh[n], cols.get(n))
        s = share[n](params[n], formats=candidates) if share and n in share else {}
        row = [dl[f] * s.get(f, 1.0) for f in candidates]
        row += [dk.get(f, 0.0) * s.get(f, 1.0) for f in candidates]
        table[i] = torch.tensor(row, dtype=torch.float64, device=device)
    dist.all_reduce_(table)
    return table


@torch.no_grad()
def layer_dloss_keep(
    w: Tensor, formats: Sequence[str], weigh: Weigh, columns: Sequence[int] | None
) -> tuple[dict[str, float], dict[str, float]]:
    """``({format: ΔL}, {format: ΔL with columns kept exactly})``, the second empty without."""
    if not columns:
        return layer_dloss(w, formats, weigh), {}
    idx = torch.as_tensor(list(columns), dtype=torch.int64, device=w.device)
    kept = w.detach().float()[:, idx]
    rounding = kept.half().float() - kept  # (out, k): what storing them in fp16 costs
    dloss, dkeep = {}, {}
    for f in formats:
        d = quant_error(w, f)
        dloss[f] = float(weigh(d))
        d[:, idx] = rounding
        dkeep[f] = float(weigh(d))
    return dloss, dkeep


def with_columns(entry: dict, columns: list[int], dloss_keep: dict[str, float] | None) -> dict:
    """A ``layer_entry`` with its outlier columns and, when it has some, ``dloss_keep``."""
    out = {**entry, "outlier_columns": list(columns)}
    if dloss_keep is not None:
        out["dloss_keep"] = dloss_keep
    return out


def kurtosis(t: Tensor) -> float:
    """Pearson kurtosis of all entries (3 for a Gaussian; heavy tails: more)."""
    x = t.detach().double().flatten()
    x = x - x.mean()
    var = (x * x).mean()
    return float((x**4).mean() / var**2) if var > 0 else float("nan")


def layer_entry(name: str, weight: Tensor, dloss: dict[str, float], outliers: dict) -> dict:
    """One element of the report's ``layers`` (``LayerScore``'s fields)."""
    return {
        "name": name,
        "shape": list(weight.shape),
        "params": weight.numel(),
        "weight_kurtosis": round(kurtosis(weight), 3),
        "dloss": dloss,
        "outliers": outliers,
    }


def report(
    config,
    layers: list[dict],
    *,
    method: str,
    weighting: str | None,
    fisher_labels: str | None,
    candidates: Sequence[str],
    windows: Tensor,
    delta: str = "rtn",
) -> dict:
    """The sensitivity.json contract around the scored ``layers`` of a model with ``config``."""
    names = {layer["name"] for layer in layers}
    return {
        "method": method,
        "weighting": weighting,
        "fisher_labels": fisher_labels,
        "candidates": list(candidates),
        "samples": int(windows.shape[0]),
        "seq_len": int(windows.shape[1]),
        "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "fused_groups": [g for g in fused_groups(config) if all(n in names for n in g)],
        "layers": layers,
        "delta": delta,
    }
