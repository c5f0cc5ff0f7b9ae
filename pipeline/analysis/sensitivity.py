"""Per-layer sensitivity report of a whole model: ΔL for every candidate format + input outliers.

``analyze`` is what the sensitivity stage runs and what ``bench/sensitivity_check.py`` compares
against measured loss increases. It scores every linear (lm_head included) and the embedding
table (unless tied to lm_head, when lm_head stands for both), so the allocator can see which
ones are worth keeping in float.

Distributed: every rank holds the whole model and processes its share of the calibration
sequences; the curvature sums and activation statistics are all-reduced, then each rank
computes ΔL for its share of the layers and those are all-reduced too. Every rank returns the
same report.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from pipeline.analysis.capture import Capture
from pipeline.analysis.estimators import fisher_diagonal, forward_pass, hutchinson_trace
from pipeline.analysis.scores import (
    embedding_weigh,
    fisher_weigh,
    hessian_weigh,
    layer_dloss,
    trace_weigh,
)
from pipeline.dist import Dist
from pipeline.models.adapters import fused_groups, get_adapter, linear_names

METHODS = ("fisher", "hutchinson", "gptq_proxy")
NO_STATS = {"share": None, "kurtosis": None, "max_over_median": None}


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
) -> dict:
    """Sensitivity report (the sensitivity.json contract) of ``model`` on ``windows`` (S, T).

    Args:
        model: A HF causal LM with an adapter (Llama, Mistral, Qwen2).
        windows: Calibration token windows (S, T); all ranks pass the same tensor.
        candidates: Format names to score.
        method: ``fisher``, ``hutchinson`` or ``gptq_proxy``.
        dist: Ranks to split the sequences over (single process when None).
        weighting: gptq_proxy only: ``full`` or ``diag``.
        probes: hutchinson only: Rademacher probes per sequence.
        fisher_labels: fisher only: ``data`` (empirical Fisher) or ``model`` (sampled labels,
            the true Fisher).
        seed: hutchinson probe / fisher label seed.
        batch_size: gptq_proxy only: sequences per forward.
        include_lm_head: Score lm_head.
        include_embeddings: Score the (untied) embedding table.
        progress: Show a progress bar on rank 0.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    dist = dist or Dist()
    modules = scored_modules(model, include_lm_head, include_embeddings)
    linears = {n: m for n, m in modules.items() if isinstance(m, nn.Linear)}
    shared = {n: g[0] for g in fused_groups(model) for n in g[1:]}  # k, v -> q; up -> gate
    capture = Capture(linears, hessians=method == "gptq_proxy", shared=shared)
    params = {n: m.weight for n, m in modules.items()}
    was_training = model.training
    model.eval()
    try:
        if method == "fisher":
            fisher = fisher_diagonal(model, windows, params, dist, progress, fisher_labels, seed)
            weigh = {n: fisher_weigh(fisher[n]) for n in modules}
        elif method == "hutchinson":
            trace = hutchinson_trace(model, windows, params, dist, probes, seed, progress)
            weigh = {n: trace_weigh(trace[n], params[n].numel()) for n in modules}
        else:
            vocab = model.get_input_embeddings().num_embeddings
            counts = forward_pass(model, windows, dist, batch_size, vocab, progress)
    finally:
        capture.remove()
        model.train(was_training)
    capture.reduce_(dist)
    if method == "gptq_proxy":
        weigh = {
            n: hessian_weigh(capture.hessian(n), weighting)
            if n in linears
            else embedding_weigh(counts)
            for n in modules
        }

    names = list(modules)
    device = next(model.parameters()).device  # NCCL reduces device tensors only
    table = torch.zeros(len(names), len(candidates), dtype=torch.float64, device=device)
    for i in dist.shard(len(names)):
        dl = layer_dloss(params[names[i]], candidates, weigh[names[i]])
        table[i] = torch.tensor([dl[f] for f in candidates], dtype=torch.float64, device=device)
    dist.all_reduce_(table)
    layers = [
        layer_entry(
            name,
            params[name],
            dict(zip(candidates, table[i].tolist())),
            capture.stats[name].summary() if name in linears else dict(NO_STATS),
        )
        for i, name in enumerate(names)
    ]
    return report(
        model.config,
        layers,
        method=method,
        weighting=weighting if method == "gptq_proxy" else None,
        fisher_labels=fisher_labels if method == "fisher" else None,
        candidates=candidates,
        windows=windows,
    )


def layer_entry(name: str, weight: Tensor, dloss: dict[str, float], outliers: dict) -> dict:
    """One element of sensitivity.json's ``layers``."""
    return {
        "name": name,
        "shape": list(weight.shape),
        "params": weight.numel(),
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
    }
