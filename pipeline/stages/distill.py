"""distill: precision-aware distillation (QAT) of the quantized target against its FP self.

Student: the quantize stage's model with FakeQuantLinear layers reproducing its codes, scales and
zeros exactly; teacher: the FP target, frozen (`pipeline.lit.distill`). `fit_validated` trains it
on `train` (any Lightning strategy; resumable) and selects the checkpoint with the lowest NLL on
the validation split (never test); unless its gain holds beyond the noise of the windows
(`pipeline.lit.keep`), the quantize stage's model is handed on byte for byte, with `kept_input:
true` in distill_report.json. Either way the result is `model/` in the quantize stage's
representation.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from pipeline import runmodels
from pipeline.config import RunConfig, positive
from pipeline.data.text import Corpus
from pipeline.errors import LowbitError
from pipeline.hardware import device_type, warn_if_emulated
from pipeline.lit import distill_report
from pipeline.lit.config import RENAMED
from pipeline.lit.distill import DistillData, DistillHParams, DistillModule, load_pair, load_student
from pipeline.lit.fit import Selection, best_weights, check_fit_trainer, fit_validated
from pipeline.lit.losses import layer_weights
from pipeline.models.hf import load_tokenizer
from pipeline.models.quantized import save_quantized_model
from pipeline.stages import Stage, StageIO
from pipeline.streaming.quant_report import QuantReport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillConfig(DistillHParams):
    """`stage.distill`: the training's settings (DistillHParams) and the stage's own."""

    seq_len: int | None = None  # null: data.seq_len
    # w_l of the matching term: error (the quantize stage's per-layer errors) | uniform
    layer_weights: Literal["error", "uniform"] = "error"
    # Same windows for every check, paired by the keep decision (too few: its interval warns).
    val_windows: int = 128

    RENAMED = RENAMED | {
        "ckpt_every": "train.checkpoint_every",
        "clip_norm": "train.grad_clip",
        "grad_scale": "train.quant_grad_scale",
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        positive(prefix, seq_len=self.seq_len, val_windows=self.val_windows)


def check(cfg: DistillConfig, run: RunConfig) -> None:
    check_fit_trainer("distill", run.trainer)  # Lightning's arguments, none the stage sets
    if cfg.teacher_dtype == "bfloat16":  # the teacher's every forward, emulated on most CPUs
        accelerator = device_type((run.trainer or {}).get("accelerator"))
        warn_if_emulated(torch.bfloat16, accelerator, "stage.distill.teacher_dtype")


def run(cfg: DistillConfig, run: RunConfig, io: StageIO) -> dict:
    """Distill into `io.out_dir` (`io`: the workflow's StageIO); returns the stage metrics."""
    quantized = io.inputs["quantize"]
    model_dir, target_dir = quantized / "model", runmodels.fp_target(run.model, io.inputs)
    seq_len = cfg.seq_len or run.data.seq_len
    torch.manual_seed(run.seed)
    student, teacher, groups = load_pair(model_dir, target_dir, cfg, run.model.allow_bin)
    weights = _layer_weights(cfg, quantized, student.config.num_hidden_layers)
    corpus = Corpus(run.data, load_tokenizer(target_dir))
    val = distill_report.validation_windows(corpus, seq_len, cfg.val_windows)
    module = DistillModule(student, teacher, cfg, weights, groups)
    data = DistillData(corpus.stream("train"), seq_len, cfg.train.batch, run.seed, val=val.windows)
    io.log.log_input(corpus.stream("train"), "training", run.data, "train")
    io.log.log_input(val.windows, "validation", run.data, "validation")
    fit = fit_validated(
        "distill",
        module,
        data,
        cfg.train,
        trainer_cfg=run.trainer,
        work_dir=io.work_dir,
        dist=io.dist,
        logger=io.log.lightning_logger() or False,
        select=Selection("val/nll", "nll", larger_is_better=False, keep=cfg.keep, seed=run.seed),
    )
    if not io.dist.is_main:
        return {}

    if fit.kept:
        log.warning(
            "distill: no checkpoint beat the input beyond the validation noise (best val ppl "
            "%.4g at step %d vs %.4g before training; NLL %s): keeping the quantize stage's "
            "model unchanged",
            distill_report.ppl(fit.chosen["nll"]),
            fit.chosen["step"],
            distill_report.ppl(fit.before["nll"]),
            fit.margin.text(),
        )
        shutil.copytree(model_dir, io.out_dir / "model")
    else:
        final = best_weights(fit, "student.", lambda: load_student(model_dir, cfg)[0], student)
        save_quantized_model(final.eval(), io.out_dir / "model", model_dir, method="distill")
    metrics = distill_report.metrics(fit, val)
    report = distill_report.report(cfg, fit, val, metrics, weights, io.dist.world_size)
    if cfg.reweight_every:
        history = [{"step": 0, "weights": weights.tolist()}, *module.layer_w_history]
        report["layer_weights_history"] = history
        distill_report.plot_layer_weights(history, io.out_dir / "layer_weights.png")
    (io.out_dir / "distill_report.json").write_text(json.dumps(report, indent=1))
    log.info("distill: %s", "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    return metrics | fit.resume_metrics()


def _layer_weights(cfg: DistillConfig, quantize_dir: Path, n_layers: int) -> torch.Tensor:
    """w_l of the layer-matching term: from the quantize stage's per-layer errors, or uniform."""
    if cfg.layer_weights != "error":
        return torch.full((n_layers,), 1.0 / n_layers)
    return layer_weights(_layer_errors(quantize_dir), n_layers)


def _layer_errors(quantize_dir: Path) -> dict[str, float]:
    try:
        return QuantReport.load(quantize_dir).rel_output_error
    except LowbitError as e:
        raise LowbitError(f"{e}; or set stage.distill.layer_weights=uniform") from None


STAGE = Stage(
    config=DistillConfig,
    run=run,
    needs=("quantize",),
    uses=("bootstrap",),
    sections=("model", "data", "trainer"),
    distributed=True,  # every rank trains under the Lightning strategy
    check=check,
)
