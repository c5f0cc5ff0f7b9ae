"""sensitivity: predicted loss increase ΔL of every layer in every candidate format.

Fisher, Hutchinson or the GPTQ proxy (``pipeline.analysis``), or their mix fitted to measured KL;
``stream=true`` reads targets bigger than memory one segment at a time. Ranks split the windows.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from pipeline import plots
from pipeline.analysis.estimate import Estimator, Target, estimate
from pipeline.analysis.report import LayerScore, SensitivityReport
from pipeline.config import REMOVED_DEVICE, RunConfig, by_size, positive
from pipeline.data.text import Corpus
from pipeline.errors import ConfigError
from pipeline.models.hf import load_tokenizer
from pipeline.quant.formats import Format
from pipeline.quant.sequential import QuantOptions
from pipeline.runmodels import fp_target
from pipeline.stages import Stage, StageIO

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SensitivityConfig:
    """ΔL_l(f) for every format in quant.candidates, plus input outlier statistics."""

    method: Literal["fisher", "hutchinson", "gptq_proxy", "gradient"] = "fisher"
    gptq_weighting: Literal["full", "diag"] = "full"  # gptq_proxy: Σ_rows δᵀHδ | Σ H_jj δ²
    fisher_labels: Literal["data", "model"] = "data"  # empirical | sampled (true) Fisher
    hutchinson_probes: int = 4  # Rademacher probes per sequence
    batch_size: int = 8  # sequences per forward (a Fisher backward takes one)
    include_lm_head: bool = True
    include_embeddings: bool = True  # unless tied to lm_head
    importance: Literal["single", "combined"] = "single"  # combined: mix fitted to the KL
    fit_layers: int = 8  # combined: layers measured for the fit
    # fisher, gptq_proxy: segments from the shards (bigger than memory); null: from 6 B
    # parameters on (pipeline.modelshape), where the loaded estimate outgrows a node
    stream: bool | None = None
    # ΔL of RTN's δ, or (gptq, loaded) scaled to the error GPTQ leaves; null: gptq where it can
    delta: Literal["rtn", "gptq"] | None = None

    REMOVED: ClassVar[dict[str, str]] = REMOVED_DEVICE

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
        if self.delta == "gptq" and (self.stream or self.importance == "combined"):
            raise ConfigError(
                f"{prefix}.delta",
                "is gptq, which the loaded single estimate computes (not stream=true, not "
                f"importance=combined, whose fit is to RTN's KL): set {prefix}.delta=rtn",
            )
        if self.stream and self.method in ("hutchinson", "gradient"):
            raise ConfigError(
                f"{prefix}.stream",
                f"is true with {prefix}.method={self.method}, which only the loaded model "
                f"computes; set {prefix}.method=fisher or gptq_proxy, or {prefix}.stream=false",
            )

    def scaled(self, run: RunConfig) -> SensitivityConfig:
        """A null `stream` by the target's size (loaded where only it works), then `delta`."""
        stream = self.stream
        if stream is None:
            loaded_only = self.method in ("hutchinson", "gradient") or self.importance == "combined"
            large = by_size(run.model, "stage.sensitivity.stream").stream_sensitivity
            stream = large and not loaded_only
        delta = self.delta
        if delta == "gptq" and run.quant.method != "gptq":  # checked here: the stage's view
            raise ConfigError(  # of quant leaves out the method
                "stage.sensitivity.delta",
                f"is gptq, but quant.method={run.quant.method} quantizes: set "
                "stage.sensitivity.delta=rtn or quant.method=gptq",
            )
        if delta is None:
            gptq = run.quant.method == "gptq" and not stream and self.importance == "single"
            delta = "gptq" if gptq else "rtn"
        return dataclasses.replace(self, stream=stream, delta=delta)


def check(cfg: SensitivityConfig, run: RunConfig) -> None:
    if run.quant.outliers != "none" and cfg.importance == "combined":
        raise ConfigError(
            "stage.sensitivity.importance",
            f"is combined with quant.outliers={run.quant.outliers}: the fitted combination "
            "scores no kept columns; set stage.sensitivity.importance=single or "
            "quant.outliers=none",
        )


def keep_cap(run: RunConfig) -> float | None:
    return run.quant.outlier_cap if run.quant.outliers == "keep_fp16" else None


def skip_reason(cfg: SensitivityConfig, run: RunConfig) -> str | None:
    q = run.quant
    if len(q.candidates) == 1 and not q.float_fallback and q.outliers == "none":
        return f"quant.candidates has one format ({q.candidates[0]}): the plan is uniform"
    return None


def run(cfg: SensitivityConfig, run: RunConfig, io: StageIO) -> dict:
    """Score every layer of the FP target into ``io.out_dir``; returns the stage metrics."""
    q = run.quant
    candidates = [f.name for f in q.formats]
    path = fp_target(run.model, io.inputs)
    windows = Corpus(run.data, load_tokenizer(path)).calibration(
        q.calib.samples, q.calib.seq_len, run.seed
    )  # (S, T), identical on every rank
    io.log.log_input(windows, "calibration", run.data, "train")
    target = Target(path, io.device, run.model.allow_bin,
                    run.model.device_map, q.segment_size, q.activation_budget_gb)  # fmt: skip
    estimator = Estimator(cfg.method, cfg.importance, cfg.stream, cfg.gptq_weighting,
                          cfg.fisher_labels, cfg.hutchinson_probes, cfg.batch_size,
                          cfg.fit_layers, cfg.include_lm_head, cfg.include_embeddings,
                          _gptq(run.quant) if cfg.delta == "gptq" else None)  # fmt: skip
    cap = keep_cap(run)
    t0 = time.time()
    report = estimate(target, windows, candidates, estimator, dist=io.dist, seed=run.seed,
                      spill_dir=io.work_dir, keep_cap=cap)  # fmt: skip
    seconds = time.time() - t0
    log.info("sensitivity: %s on %d sequences x %d tokens, %d layers, %.1fs",
             report.method, *windows.shape, len(report.layers), seconds)  # fmt: skip
    if report.importance_weights:
        log.info("sensitivity: importance weights %s", report.importance_weights)
    if not io.dist.is_main:
        return {}
    if cap is not None:
        report = report.replace(outliers=q.outliers, outlier_cap=q.outlier_cap)
    report.save(io.out_dir)
    write_plots(report, q.formats, io.out_dir)
    return _metrics(report, seconds)


def _gptq(q) -> QuantOptions:  # the method is outside this stage's view: gptq (`scaled`)
    return QuantOptions("gptq", q.block_size, q.damp, q.act_order)


def _metrics(report: SensitivityReport, seconds: float) -> dict:
    layers = report.layers
    metrics = {"layers": len(layers), "samples": report.samples, "seconds": seconds}
    for m, w in (report.importance_weights or {}).items():
        metrics[f"importance_{m}"] = w
    for f in report.candidates:
        metrics[f"dloss_sum_{f}"] = sum(layer.dloss[f] for layer in layers)
    shares = [layer.outlier_share for layer in layers if layer.outlier_share is not None]
    if shares:
        metrics["outlier_share_max"] = max(shares)
    if report.outliers is not None:
        metrics["outlier_columns"] = sum(len(la.outlier_columns or ()) for la in layers)
    return metrics


def write_plots(report: SensitivityReport, formats: tuple[Format, ...], out_dir: Path) -> None:
    """Heat map of log10 ΔL (layer × format), ΔL bars at the cheapest format, outlier shares."""
    layers, cands = report.layers, report.candidates
    names = [layer.name for layer in layers]
    plots.heatmap([[layer.dloss[f] for f in cands] for layer in layers], names, cands,
                  out_dir / "sensitivity_heatmap.png",
                  f"predicted loss increase ({report.method})", "log10 ΔL")  # fmt: skip

    def cheapest(layer: LayerScore) -> str:  # where layers differ most
        return min(formats, key=lambda f: f.bits_per_weight(layer.shape[1])).name

    plots.bars([layer.dloss[cheapest(layer)] for layer in layers], names,
               out_dir / "sensitivity_bars.png",
               "per-layer sensitivity: ΔL at each layer's cheapest candidate", "ΔL",
               log_y=True)  # fmt: skip
    plots.bars([layer.outlier_share for layer in layers], names, out_dir / "outliers.png",
               "share of outlier input channels (MAD rule)", "share")  # fmt: skip


STAGE = Stage(
    config=SensitivityConfig,
    run=run,
    needs=("bootstrap",),
    # quant by field: a new budget or method reuses the analysis
    sections=(
        "model",
        "data",
        "quant.candidates",
        "quant.float_fallback",
        "quant.calib",
        "quant.activation_budget_gb",
        "quant.segment_size",
        "quant.outliers",
        "quant.outlier_cap",
        # delta=gptq runs GPTQ as quantize will
        "quant.block_size",
        "quant.damp",
        "quant.act_order",
    ),
    distributed=True,
    check=check,
    skip_reason=skip_reason,
)
