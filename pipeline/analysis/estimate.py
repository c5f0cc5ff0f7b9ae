"""Which estimator scores a target: loaded or streamed, one estimator or the fitted combination."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from pipeline.analysis.importance import analyze_combined
from pipeline.analysis.report import SensitivityReport
from pipeline.analysis.sensitivity import analyze
from pipeline.analysis.streamed import analyze_streamed
from pipeline.analysis.streamed_fisher import analyze_fisher_streamed
from pipeline.dist import Dist
from pipeline.models.checkpoint import StreamingCheckpoint
from pipeline.models.hf import load_causal_lm
from pipeline.quant.sequential import QuantOptions
from pipeline.streaming import StreamOptions


@dataclass(frozen=True)
class Estimator:
    """The sensitivity stage's choices (see ``pipeline.stages.sensitivity``)."""

    method: str = "fisher"  # fisher | hutchinson | gptq_proxy
    importance: str = "single"  # single | combined
    stream: bool = False
    weighting: str = "full"
    fisher_labels: str = "data"
    probes: int = 4
    batch_size: int = 8
    fit_layers: int = 8
    include_lm_head: bool = True
    include_embeddings: bool = True
    gptq: QuantOptions | None = None  # scale ΔL to the output error GPTQ leaves (loaded only)


@dataclass(frozen=True)
class Target:
    """Where the FP target is and how to open it."""

    path: Path
    device: torch.device
    allow_bin: bool = False
    device_map: str | None = None
    segment_size: int = 1  # streamed: decoder blocks per segment
    activation_budget_gb: float = 2.0


def estimate(
    target: Target,
    windows: Tensor,
    candidates: list[str],
    e: Estimator,
    *,
    dist: Dist,
    seed: int,
    spill_dir: Path,
    keep_cap: float | None = None,
) -> SensitivityReport:
    """The sensitivity report of ``target`` on ``windows`` (S, T), the same on every rank."""
    scope = dict(include_lm_head=e.include_lm_head, include_embeddings=e.include_embeddings)
    if e.stream:
        report = _streamed(target, windows, candidates, e, dist, seed, spill_dir, keep_cap)
    else:
        model = load_causal_lm(
            target.path,
            allow_bin=target.allow_bin,
            device=target.device,
            device_map=target.device_map,
        )
        common = dict(
            probes=e.probes,
            fisher_labels=e.fisher_labels,
            seed=seed,
            weighting=e.weighting,
            batch_size=e.batch_size,
            progress=True,
            gptq=e.gptq,
            **scope,
        )
        if e.importance == "combined":
            report = analyze_combined(
                model, windows, candidates, dist, fit_layers=e.fit_layers, **common
            )
        else:
            report = analyze(
                model, windows, candidates, e.method, dist, keep_cap=keep_cap, **common
            )
    return SensitivityReport.from_dict(report)


def _streamed(target, windows, candidates, e, dist, seed, spill_dir, keep_cap) -> dict:
    # fp32 like the loaded path and quantize: the stored dtype (often fp16) would score in
    # another precision, and fp16 matmuls are slow on CPUs.
    ckpt = StreamingCheckpoint(
        target.path, target.allow_bin, dtype=torch.float32, device=target.device
    )
    scope = dict(
        include_lm_head=e.include_lm_head,
        include_embeddings=e.include_embeddings,
        dist=dist,
        keep_cap=keep_cap,
        spill_dir=spill_dir,
    )
    if e.method == "fisher":
        # A segment is the unit of recomputation: its input is kept for the reverse walk.
        walk = StreamOptions(target.segment_size, e.batch_size, target.activation_budget_gb)
        return analyze_fisher_streamed(
            ckpt, windows, candidates, walk, labels=e.fisher_labels, seed=seed, **scope
        )
    # One block per spill file: the loaded path scores one block at a time too.
    walk = StreamOptions(1, e.batch_size, target.activation_budget_gb)
    return analyze_streamed(ckpt, windows, candidates, walk, weighting=e.weighting, **scope)
