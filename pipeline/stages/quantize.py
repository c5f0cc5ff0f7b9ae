"""quantize: segment-wise streaming quantization (GPTQ or RTN) with the bit plan's formats,
or ``quant.candidates[0]`` everywhere without allocate (``streaming.quantize_checkpoint``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from pipeline import plots
from pipeline.config import REMOVED_DEVICE, QuantConfig, RunConfig, positive
from pipeline.errors import LowbitError
from pipeline.hardware import warn_if_emulated
from pipeline.models.adapters import linear_names
from pipeline.models.checkpoint import StreamingCheckpoint
from pipeline.quant.allocate import keep_float
from pipeline.quant.feedback import Feedback
from pipeline.quant.formats import Format
from pipeline.quant.plan import BitPlan
from pipeline.runmodels import fp_target
from pipeline.stages import Stage, StageIO
from pipeline.streaming import StreamOptions, quant_options, quantize_checkpoint
from pipeline.streaming.quant_report import QuantReport

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class QuantizeConfig:
    """Streaming quantization; the recipe is the shared `quant` section."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # of the calibration passes
    batch_size: int = 8  # calibration windows per forward pass through a block

    REMOVED: ClassVar[dict[str, str]] = REMOVED_DEVICE

    def check(self, prefix: str) -> None:
        positive(prefix, batch_size=self.batch_size)


def load_plan(inputs: dict[str, Path], config: Any, q: QuantConfig) -> dict[str, Format]:
    """``{linear: format}`` of the quantized linears: the bit plan's, else candidates[0] on
    every linear not in ``quant.keep_float``."""
    if "allocate" in inputs:
        return BitPlan.load(inputs["allocate"]).quantized()
    if len(q.candidates) > 1:
        log.warning(
            "quantize: no allocate stage in this run; every linear gets %s (quant.candidates[0])",
            q.candidates[0],
        )
    fmt = q.formats[0]
    if fmt.kind == "float":
        return {}
    return {n: fmt for n in linear_names(config) if not keep_float(n, q.keep_float)}


def load_kept(inputs: dict[str, Path], outliers: str) -> dict[str, list[int]]:
    """``{linear: kept input columns}`` of the bit plan (empty with ``quant.outliers=none``)."""
    if outliers == "none":
        return {}
    if "allocate" not in inputs:
        raise LowbitError(
            f"quant.outliers={outliers} keeps the columns the allocate stage chose, but this run "
            "has no allocate stage: add sensitivity and allocate to stages, or set "
            "quant.outliers=none"
        )
    plan = BitPlan.load(inputs["allocate"])
    if plan.outlier_columns is None:
        raise LowbitError(
            f"{inputs['allocate']} holds a bit plan without outlier columns: rerun allocate "
            f"with quant.outliers={outliers}"
        )
    return plan.kept()


def load_feedback(inputs: dict[str, Path], q: QuantConfig) -> Feedback | None:
    """Error feedback's settings with the bits the bit plan left for it; None when off."""
    if q.feedback.slack_bits == 0:
        return None
    if "allocate" not in inputs:
        log.warning("quantize: no allocate stage in this run, so no slack: no error feedback")
        return None
    plan = BitPlan.load(inputs["allocate"])
    if plan.feedback_bits is None:
        raise LowbitError(
            f"{inputs['allocate']} holds a bit plan made without feedback slack: rerun allocate "
            f"with quant.feedback.slack_bits={q.feedback.slack_bits}"
        )
    fb = q.feedback
    return Feedback(fb.threshold, plan.candidates, plan.feedback_bits, fb.pace)


def run(cfg: QuantizeConfig, run: RunConfig, io: StageIO) -> dict:
    """Quantize the FP target into ``io.out_dir/model``; returns the stage metrics."""
    from transformers import AutoConfig

    from pipeline.data.text import Corpus
    from pipeline.models.hf import load_tokenizer

    q = run.quant
    target = fp_target(run.model, io.inputs)
    corpus = Corpus(run.data, load_tokenizer(target))
    calib = corpus.calibration(q.calib.samples, q.calib.seq_len, run.seed)  # (N, T)
    io.log.log_input(calib, "calibration", run.data, "train")
    plan = load_plan(io.inputs, AutoConfig.from_pretrained(target, local_files_only=True), q)
    warn_if_emulated(_DTYPES[cfg.dtype], io.device.type, "stage.quantize.dtype")
    ckpt = StreamingCheckpoint(target, dtype=_DTYPES[cfg.dtype], device=io.device)
    walk = StreamOptions(q.segment_size, cfg.batch_size, q.activation_budget_gb)
    summary = quantize_checkpoint(
        ckpt,
        io.out_dir / "model",
        plan,
        calib,
        quant_options(q),
        walk,
        work_dir=io.work_dir,
        dist=io.dist,
        keep=load_kept(io.inputs, q.outliers),
        feedback=load_feedback(io.inputs, q),
    )
    if io.dist.is_main:
        report = QuantReport.from_dict(summary)
        report.save(io.out_dir)  # times go to metrics and MLflow
        if report.feedback_bits is not None:
            _plot_feedback(report, q.feedback.threshold, io.out_dir / "feedback_error.png")
        seconds = {n: r["seconds"] for n, r in summary["layers"].items()}
        io.log.log_dict(seconds, "layer_seconds.json")
    return {k: v for k, v in summary.items() if isinstance(v, int | float)}


def _plot_feedback(report: QuantReport, threshold: float, path: Path) -> None:
    names = list(report.layers)
    plots.before_after(
        [report.layers[n].rel_output_error_before for n in names],
        [report.layers[n].rel_output_error for n in names],
        names,
        path,
        f"error feedback: {len(report.moved)} layers moved, {report.feedback_bits} bits spent",
        "relative output error",
        hline=threshold,
    )


STAGE = Stage(
    config=QuantizeConfig,
    run=run,
    needs=("bootstrap",),  # the FP target (skipped when model.target.path is set)
    uses=("allocate",),  # the bit plan when allocate ran, else the uniform recipe
    sections=("model", "data", "quant"),
    distributed=True,  # calibration windows split over ranks, Hessians all-reduced
)
