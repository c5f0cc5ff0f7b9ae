"""sensitivity: how much each layer's quantization to each candidate format costs in loss.

For every linear of the target (lm_head included) and the embedding table, ΔL_l(f) is
predicted for each format in ``quant.candidates`` from ``quant.calib.samples`` calibration
windows (see ``pipeline.analysis``): the diagonal empirical Fisher (default), Hutchinson's
Hessian-trace estimate (HAWQ-v2) or the gradient-free GPTQ proxy H = 2XXᵀ. The input of every
linear is also summarised (MAD outlier-channel share, kurtosis, max/median channel absmax).

Memory: loaded, Fisher and Hutchinson backpropagate through the whole model (one sequence per
backward), plus a float32 Fisher buffer the size of the scored weights. For a target bigger than
one host's memory (70B and up) set ``stream=true``: the checkpoint is read one segment of
``quant.segment_size`` decoder blocks at a time from the shards, the activations kept in memory
up to ``quant.activation_budget_gb`` and spilled to the stage's work dir beyond. ``fisher``
streams a forward walk that keeps the segment boundaries, then a reverse walk that recomputes
each segment and back-propagates through it (:mod:`pipeline.analysis.streamed_fisher`, the same
Fisher); ``gptq_proxy`` is forward-only (:mod:`pipeline.analysis.streamed`). Hutchinson's
double backward is not streamed.

Importance: ``importance=combined`` runs all three estimators and scores each layer with
w_f·ΔL_fisher + w_h·ΔL_hutchinson + w_g·ΔL_gptq_proxy, the weights fitted (non-negative, relative
residuals) to the KL measured with ``fit_layers`` layers quantized alone on the calibration
windows (:mod:`pipeline.analysis.importance`); sensitivity.json keeps every estimator's ΔL and the
weights.

Outliers: with ``quant.outliers=keep_fp16`` every scored linear also records its outlier input
columns (MAD rule, at most ``quant.outlier_cap`` of its inputs) and ``dloss_keep`` beside
``dloss``, the predicted loss increase with those columns kept exactly in fp16, on every path
but ``importance=combined`` (refused: its fitted weights see one ΔL per layer and format).

Ranks: every rank loads the model and takes ``dist.shard`` of the calibration sequences; sums
are all-reduced, so the result does not depend on the number of ranks.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Literal

import torch

from pipeline import plots
from pipeline.analysis.importance import analyze_combined
from pipeline.analysis.sensitivity import analyze
from pipeline.analysis.streamed import analyze_streamed
from pipeline.analysis.streamed_fisher import analyze_fisher_streamed
from pipeline.config import RunConfig, positive
from pipeline.data.text import Corpus
from pipeline.errors import ConfigError, LowbitError
from pipeline.models.checkpoint import StreamingCheckpoint
from pipeline.models.hf import load_causal_lm, load_tokenizer
from pipeline.quant.formats import parse_format
from pipeline.runmodels import fp_target
from pipeline.stages import StageIO
from pipeline.streaming import StreamOptions

NEEDS: tuple[str, ...] = ("bootstrap",)
USES: tuple[str, ...] = ()
# quant by field: a new budget or method reuses the analysis (it depends on none of them)
SECTIONS: tuple[str, ...] = (
    "model",
    "data",
    "quant.candidates",
    "quant.float_fallback",
    "quant.calib",
    "quant.activation_budget_gb",
    "quant.segment_size",  # the streamed Fisher's unit of recomputation
    "quant.outliers",  # keep_fp16: outlier columns and dloss_keep too
    "quant.outlier_cap",
)
DISTRIBUTED = True

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SensitivityConfig:
    """Per-layer predicted loss increase ΔL_l(f) for every format in quant.candidates, from
    quant.calib.samples calibration windows, plus input-activation outlier statistics."""

    method: Literal["fisher", "hutchinson", "gptq_proxy"] = "fisher"
    # gptq_proxy only: full (Σ_rows δᵀHδ) | diag (Σ H_jj δ², per weight)
    gptq_weighting: Literal["full", "diag"] = "full"
    # fisher only: data (empirical Fisher) | model (sampled next tokens: true Fisher)
    fisher_labels: Literal["data", "model"] = "data"
    hutchinson_probes: int = 4  # hutchinson only: Rademacher probes per calibration sequence
    # gptq_proxy and the streamed fisher's forward walk: sequences per forward (a backward
    # takes one sequence: the Fisher squares each sequence's gradient)
    batch_size: int = 8
    include_lm_head: bool = True  # score lm_head (allocate may keep it float)
    include_embeddings: bool = True  # score the embedding table (unless tied to lm_head)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto (cuda when present) | cpu | cuda
    # single: ΔL of ``method`` | combined: every estimator, weights fitted to the KL measured
    # with fit_layers layers quantized alone (pipeline.analysis.importance)
    importance: Literal["single", "combined"] = "single"
    fit_layers: int = 8  # combined only: layers measured for the fit, spread over the model
    # fisher and gptq_proxy: segments of decoder blocks from the shards (targets bigger than
    # memory)
    stream: bool = False

    def check(self, prefix: str) -> None:
        positive(prefix, hutchinson_probes=self.hutchinson_probes, batch_size=self.batch_size,
                 fit_layers=self.fit_layers)  # fmt: skip
        if self.stream and self.importance == "combined":
            raise ConfigError(
                f"{prefix}.importance",
                f"is combined with {prefix}.stream=true; the combination needs Hutchinson's "
                f"estimate and the measured KL of the loaded model: set {prefix}.importance="
                f"single or {prefix}.stream=false",
            )
        if self.stream and self.method == "hutchinson":
            raise ConfigError(
                f"{prefix}.stream",
                f"is true with {prefix}.method=hutchinson, whose double backward needs the "
                f"loaded model; set {prefix}.method=fisher or gptq_proxy, or "
                f"{prefix}.stream=false",
            )


CONFIG = SensitivityConfig


def check(cfg: SensitivityConfig, run: RunConfig) -> None:
    if run.quant.outliers != "none" and cfg.importance == "combined":
        raise ConfigError(
            "stage.sensitivity.importance",
            f"is combined with quant.outliers={run.quant.outliers}: the fitted combination "
            "scores no kept columns; set stage.sensitivity.importance=single or "
            "quant.outliers=none",
        )


def keep_cap(run: RunConfig) -> float | None:
    """The cap of kept columns to score, or None when no columns are kept."""
    return run.quant.outlier_cap if run.quant.outliers == "keep_fp16" else None


def skip_reason(cfg: SensitivityConfig, run: RunConfig) -> str | None:
    q = run.quant
    if len(q.candidates) == 1 and not q.float_fallback and q.outliers == "none":
        return f"quant.candidates has one format ({q.candidates[0]}): the plan is uniform"
    return None


def _device(p: SensitivityConfig, local_rank: int) -> torch.device:
    if p.device == "cuda" and not torch.cuda.is_available():
        raise LowbitError(
            "stage.sensitivity.device=cuda but no CUDA device is visible; use auto or cpu"
        )
    if p.device == "cuda" or (p.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run(cfg: SensitivityConfig, run: RunConfig, io: StageIO) -> dict:
    """Score every layer of the FP target into ``io.out_dir``; returns the stage metrics."""
    q = run.quant
    candidates = [parse_format(c).name for c in q.candidates]
    target = fp_target(run.model, io.inputs)
    windows = Corpus(run.data, load_tokenizer(target)).calibration(
        q.calib.samples, q.calib.seq_len, run.seed
    )  # (S, T), identical on every rank
    device = _device(cfg, io.dist.local_rank)
    scope = dict(include_lm_head=cfg.include_lm_head, include_embeddings=cfg.include_embeddings)
    cap = keep_cap(run)
    t0 = time.time()
    if cfg.stream:
        # fp32 like the loaded path and quantize: the stored dtype (often fp16) would score in
        # another precision, and fp16 matmuls run ~4x slower than fp32 on CPUs.
        ckpt = StreamingCheckpoint(target, run.model.allow_bin, dtype=torch.float32, device=device)
        if cfg.method == "fisher":
            # A segment is the unit of recomputation: its input is kept for the reverse walk.
            walk = StreamOptions(q.segment_size, cfg.batch_size, q.activation_budget_gb)
            report = analyze_fisher_streamed(
                ckpt, windows, candidates, walk, spill_dir=io.work_dir,
                labels=cfg.fisher_labels, seed=run.seed, dist=io.dist, keep_cap=cap, **scope,
            )  # fmt: skip
        else:
            # One block per spill file, as the loaded path scores one block at a time anyway.
            walk = StreamOptions(1, cfg.batch_size, q.activation_budget_gb)
            report = analyze_streamed(
                ckpt, windows, candidates, walk, spill_dir=io.work_dir,
                weighting=cfg.gptq_weighting, dist=io.dist, keep_cap=cap, **scope,
            )  # fmt: skip
    elif cfg.importance == "combined":
        model = load_causal_lm(
            target, allow_bin=run.model.allow_bin, device=device, device_map=run.model.device_map
        )
        report = analyze_combined(
            model, windows, candidates, io.dist, fit_layers=cfg.fit_layers,
            batch_size=cfg.batch_size, probes=cfg.hutchinson_probes,
            fisher_labels=cfg.fisher_labels, seed=run.seed, weighting=cfg.gptq_weighting,
            progress=True, **scope,
        )  # fmt: skip
        log.info("sensitivity: importance weights %s", report["importance"]["weights"])
    else:
        model = load_causal_lm(
            target, allow_bin=run.model.allow_bin, device=device, device_map=run.model.device_map
        )
        report = analyze(
            model, windows, candidates, cfg.method, io.dist, probes=cfg.hutchinson_probes,
            fisher_labels=cfg.fisher_labels, seed=run.seed, weighting=cfg.gptq_weighting,
            batch_size=cfg.batch_size, progress=True, keep_cap=cap, **scope,
        )  # fmt: skip
    seconds = time.time() - t0
    log.info(
        "sensitivity: %s on %d sequences x %d tokens, %d layers, %.1fs",
        report["method"],
        *windows.shape,
        len(report["layers"]),
        seconds,
    )
    if not io.dist.is_main:
        return {}
    if cap is not None:
        report = {**report, "outliers": q.outliers, "outlier_cap": q.outlier_cap}
    (io.out_dir / "sensitivity.json").write_text(json.dumps(report, indent=1))
    write_plots(report, io.out_dir)
    layers = report["layers"]
    metrics = {"layers": len(layers), "samples": int(windows.shape[0]), "seconds": seconds}
    for m, w in report.get("importance", {}).get("weights", {}).items():
        metrics[f"importance_{m}"] = w
    for f in candidates:
        metrics[f"dloss_sum_{f}"] = sum(layer["dloss"][f] for layer in layers)
    shares = [
        layer["outliers"]["share"] for layer in layers if layer["outliers"]["share"] is not None
    ]
    if shares:
        metrics["outlier_share_max"] = max(shares)
    if cap is not None:
        metrics["outlier_columns"] = sum(len(layer["outlier_columns"]) for layer in layers)
    return metrics


def write_plots(report: dict, out_dir) -> None:
    """Heat map of log10 ΔL (layer × format), ΔL bars at the cheapest format, outlier shares."""
    layers, cands = report["layers"], report["candidates"]
    names = [layer["name"] for layer in layers]
    plots.heatmap(
        [[layer["dloss"][f] for f in cands] for layer in layers],
        names,
        cands,
        out_dir / "sensitivity_heatmap.png",
        f"predicted loss increase ({report['method']})",
        "log10 ΔL",
    )

    # The most aggressive format of each layer is where layers differ most.
    def cheapest(layer: dict) -> str:
        return min(cands, key=lambda f: parse_format(f).bits_per_weight(layer["shape"][1]))

    plots.bars(
        [layer["dloss"][cheapest(layer)] for layer in layers],
        names,
        out_dir / "sensitivity_bars.png",
        "per-layer sensitivity: ΔL at each layer's cheapest candidate",
        "ΔL",
        log_y=True,
    )
    plots.bars(
        [layer["outliers"]["share"] for layer in layers],
        names,
        out_dir / "outliers.png",
        "share of outlier input channels (MAD rule)",
        "share",
    )
