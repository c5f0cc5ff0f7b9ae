"""distill: precision-aware distillation (QAT) of the quantized target against its FP self.

Student: the quantize stage's model, loaded with FakeQuantLinear layers that reproduce its codes,
scales and zeros exactly; teacher: the FP target, frozen. The training (`pipeline.lit.distill`)
runs on the configured Lightning strategy (cpu, ddp, DeepSpeed ZeRO-2/3, several nodes) with
gradient clipping, quant-aware gradient scaling, a NaN/Inf guard and checkpoints in the stage's
work dir, so a killed run resumes from its last checkpoint.

Selection: the student is validated on `val_windows` fixed windows of the validation split (never
the test split that evaluate reports) before the first step (the input), every `val_every` steps
and at the last step; the metric is its mean next-token NLL (perplexity), with KL(teacher ‖
student) logged beside it. After each validation `checkpoints/best.ckpt` in the work dir keeps
the best by that NLL, whose parameters (consolidated from the ZeRO shards when DeepSpeed trained
them, `pipeline.lit.fit`), not the last ones, are the result; `early_stop_patience` optionally
stops once validation stops improving. When no checkpoint beats the input, the quantize stage's
model is handed on unchanged (copied byte for byte), with a warning and `kept_input: true` in
`distill_report.json`. Either way the result is written in the quantize stage's representation
(`model/`), which is all evaluate and export need to know.

Resume: `checkpoints/last.ckpt` in the work dir is written every `ckpt_every` steps (null: a
tenth of max_steps, so a kill loses at most ~10% of the training) and after each validation. A
rerun resumes from it with the batches (indexed by step), random streams, validation history and
best checkpoint of the killed run, and writes the bytes an uninterrupted run writes
(`pipeline.lit.resume`); checkpoints load with weights_only. The report holds nothing that
differs between the two (whether and where the run resumed are stage metrics only).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from pipeline import runmodels
from pipeline.config import RunConfig, positive
from pipeline.data.heldout import Heldout, heldout
from pipeline.data.text import Corpus
from pipeline.errors import ConfigError, LowbitError
from pipeline.hardware import device_type, warn_if_emulated
from pipeline.lit.distill import DistillData, DistillHParams, DistillModule, load_pair, load_student
from pipeline.lit.fit import (
    Fit,
    Selection,
    best_weights,
    check_clip,
    check_fit_trainer,
    fit_validated,
)
from pipeline.lit.guards import NanGuard
from pipeline.lit.losses import layer_weights
from pipeline.lit.qat import train_sets_problem
from pipeline.models.hf import load_tokenizer
from pipeline.models.quantized import save_quantized_model
from pipeline.stages import StageIO

NEEDS: tuple[str, ...] = ("quantize",)
USES: tuple[str, ...] = ("bootstrap",)
SECTIONS: tuple[str, ...] = ("model", "data", "trainer")
DISTRIBUTED = True  # every rank trains under the Lightning strategy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillConfig:
    """Precision-aware distillation (QAT): FP teacher -> fake-quant student initialised from
    quantize."""

    max_steps: int = 300
    batch_size: int = 8
    seq_len: int | None = None  # null: data.seq_len
    lr: float = 2e-3  # scales / zeros (and norms)
    weight_lr: float = 1e-5  # latent weights, when `weights` is trained
    # The float-kept layers (embeddings, lm_head), when `float` is trained; for the
    # bootstrap-sized model: lower it for large vocabularies.
    float_lr: float = 2e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    # Scales plus any of weights, norms, float. On the default target (GPTQ int2g64, validation
    # split) scales alone recovered 25% of the gap, + norms 29%, + float 54%; `weights` (LSQ on
    # the latent weights) made it worse at every lr tried (docs/benchmarks.md).
    train: list[str] = field(default_factory=lambda: ["scales", "norms", "float"])
    alpha: float = 1.0  # weight of KL(p_teacher || p_student) at temperature tau
    beta: float = 0.1  # weight of the per-layer matching term (0 disables it)
    temperature: float = 1.0  # tau
    # Weight of the student's next-token cross-entropy on the training windows' own tokens
    # (KD + CE). Off by default: on the bootstrap target, whose FP perplexity further training
    # still lowers, ce=1 took the 2.5-bit student *below* FP (test 37.45 vs 38.52), which is
    # continued pre-training, not recovered quantization error (docs/benchmarks.md).
    ce: float = 0.0
    match: Literal["attention", "hidden", "both"] = "attention"
    # error (from quant_report.json rel_output_error) | uniform
    layer_weights: Literal["error", "uniform"] = "error"
    # Every N optimizer steps, set the layer weights from each layer's current distance to the
    # teacher on the step's batch (normalised like the static ones; pipeline.lit.distill);
    # null: the static weights above for the whole run.
    reweight_every: int | None = None
    teacher_dtype: Literal["float32", "bfloat16"] = "float32"
    clip_norm: float = 1.0  # gradient clipping, 1.0-3.0
    # Scale/zero gradient factor: bits (grad x 2^-bits) | lsq (1/sqrt(N*Q_P)) | none.
    grad_scale: Literal["bits", "lsq", "none"] = "bits"
    # Name patterns kept in fp32 under bf16 mixed precision.
    fp32_modules: list[str] = field(default_factory=lambda: ["lm_head", "norm"])
    nan_guard: bool = True  # skip a non-finite step, restore the last good state, halve the lr
    # Resume checkpoint (last.ckpt, in the stage's work dir) every N steps and after each
    # validation; null: a tenth of max_steps, so a kill loses at most ~10% of the training. A
    # rerun resumes from it and writes what an uninterrupted run writes, byte for byte.
    ckpt_every: int | None = None
    # Validation on the validation split (never test): the student's NLL/perplexity on fixed
    # windows of seq_len tokens, before training (the input) and every val_every steps; the best
    # checkpoint is the result, and the quantize stage's model is handed on unchanged when none
    # beats it.
    #
    # val_windows: x seq_len tokens, spread evenly over the split (its first windows would be a
    # few documents: 128 of them scored the FP target at ppl 76.7 against 42.1 for the whole
    # split). Checkpoints are compared on the same windows, so the noise
    # is that of a mean of per-window NLL differences: their sd was 0.02-0.045 nats (smoke
    # models): a standard error of ~0.004 at 128 windows, ~0.011 at 16, a quarter of the 0.05-nat
    # student-teacher gap measured with it (so the old 16 windows' -24% could be noise alone).
    val_windows: int = 128
    # Validate (and keep the best.ckpt) every N steps and at the last step: 300 steps -> 6 checks
    # + step 0, each 16 teacher+student forwards of batch_size windows (~8 steps' compute), ~20%
    # on top of training.
    val_every: int = 50
    # Stop after N checks without a better val NLL; null: train max_steps.
    early_stop_patience: int | None = None

    def check(self, prefix: str) -> None:
        positive(
            prefix,
            max_steps=self.max_steps,
            batch_size=self.batch_size,
            lr=self.lr,
            weight_lr=self.weight_lr,
            float_lr=self.float_lr,
            temperature=self.temperature,
            ckpt_every=self.ckpt_every,
            seq_len=self.seq_len,
            val_windows=self.val_windows,
            val_every=self.val_every,
            early_stop_patience=self.early_stop_patience,
            reweight_every=self.reweight_every,
        )
        if self.reweight_every is not None and self.beta == 0:
            raise ConfigError(
                f"{prefix}.reweight_every",
                f"={self.reweight_every} with beta=0",
                "beta > 0 (the weights scale the matching term), or reweight_every=null",
            )
        problem = train_sets_problem(list(self.train))
        if problem:
            raise ConfigError(f"{prefix}.train", f"is {list(self.train)}", problem)
        check_clip(prefix, "clip_norm", self.clip_norm)
        terms = {"alpha": self.alpha, "beta": self.beta, "ce": self.ce}
        negative = [k for k, v in terms.items() if v < 0]
        if negative or not any(terms.values()):
            key = (negative or ["alpha"])[0]  # the negative weight, else the KL's
            raise ConfigError(
                f"{prefix}.{key}",
                f"is {terms[key]} (alpha={self.alpha}, beta={self.beta}, ce={self.ce})",
                "all three >= 0 and not all 0",
            )
        for key, v in (("warmup_steps", self.warmup_steps), ("weight_decay", self.weight_decay)):
            if v < 0:
                raise ConfigError(f"{prefix}.{key}", f"must be >= 0, got {v}")


CONFIG = DistillConfig


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
    hp = DistillHParams.of(cfg)
    torch.manual_seed(run.seed)
    student, teacher, groups = load_pair(model_dir, target_dir, hp, run.model.allow_bin)
    weights = _layer_weights(cfg, quantized, student.config.num_hidden_layers)
    corpus = Corpus(run.data, load_tokenizer(target_dir))
    val = _validation(corpus, seq_len, cfg.val_windows)
    module = DistillModule(student, teacher, hp, weights, groups)
    data = DistillData(corpus.stream("train"), seq_len, cfg.batch_size, run.seed, val=val.windows)
    guard = NanGuard() if cfg.nan_guard else None
    fit = fit_validated(
        "distill",
        module,
        data,
        trainer_cfg=run.trainer,
        work_dir=io.work_dir,
        dist=io.dist,
        logger=io.log.lightning_logger() or False,
        select=Selection("val/nll", "nll", larger_is_better=False),
        max_steps=cfg.max_steps,
        val_every=cfg.val_every,
        ckpt_every=cfg.ckpt_every,
        patience=cfg.early_stop_patience,
        callbacks=[guard] if guard else [],
        clip=("clip_norm", cfg.clip_norm),
    )
    if not io.dist.is_main:
        return {}

    if fit.kept:
        log.warning(
            "distill: no checkpoint beat the input on the validation split (best val ppl %.4g "
            "at step %d vs %.4g before training): keeping the quantize stage's model unchanged",
            _ppl(fit.chosen["nll"]),
            fit.chosen["step"],
            _ppl(fit.before["nll"]),
        )
        shutil.copytree(model_dir, io.out_dir / "model")
    else:
        final = best_weights(fit, "student.", lambda: load_student(model_dir, hp)[0], student)
        save_quantized_model(final.eval(), io.out_dir / "model", model_dir, method="distill")
    metrics = _metrics(fit, val, guard)
    report = _report(cfg, fit, val, metrics, weights, io.dist.world_size)
    if cfg.reweight_every:
        report["layer_weights_history"] = [{"step": 0, "weights": weights.tolist()}]
        report["layer_weights_history"] += module.layer_w_history
        _plot_layer_weights(report["layer_weights_history"], io.out_dir / "layer_weights.png")
    (io.out_dir / "distill_report.json").write_text(json.dumps(report, indent=1))
    log.info("distill: %s", "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    return metrics | fit.resume_metrics()


def _layer_weights(cfg: DistillConfig, quantize_dir: Path, n_layers: int) -> torch.Tensor:
    """w_l of the layer-matching term: from the quantize stage's per-layer errors, or uniform."""
    if cfg.layer_weights != "error":
        return torch.full((n_layers,), 1.0 / n_layers)
    path = quantize_dir / "quant_report.json"
    try:
        layers = json.loads(path.read_text())["layers"]
        errors = {name: float(r["rel_output_error"]) for name, r in layers.items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LowbitError(
            f"{path} has no per-layer rel_output_error ({e!r}); re-run the quantize stage, or set "
            "stage.distill.layer_weights=uniform"
        ) from None
    return layer_weights(errors, n_layers)


def _plot_layer_weights(history: list[dict], path: Path) -> None:
    """Layers × reweighting steps: where the matching term's weight went during training
    (at most ~12 columns: evenly spaced reweightings and the last one)."""
    from pipeline import plots

    shown = history[:: math.ceil(len(history) / 12)]
    shown += history[-1:] if shown[-1] is not history[-1] else []
    plots.heatmap(
        [list(ws) for ws in zip(*(h["weights"] for h in shown))],
        [f"layer {i}" for i in range(len(history[0]["weights"]))],
        [f"step {h['step']}" for h in shown],
        path,
        "distill: layer weights of the matching term",
        "w_l",
        log10=False,
    )


def _validation(corpus: Corpus, seq_len: int, n_windows: int) -> Heldout:
    val = heldout(corpus.stream("validation"), "validation", seq_len, limit=n_windows)
    if val.windows.shape[0] < n_windows:
        log.warning(
            "distill: the validation split holds only %d windows of %d tokens (val_windows=%d)",
            val.windows.shape[0],
            seq_len,
            n_windows,
        )
    return val


def _ppl(nll: float) -> float:
    return math.exp(min(nll, 50.0))


def _metrics(fit: Fit, val: Heldout, guard: NanGuard | None) -> dict[str, float]:
    """Validation-split numbers of the input, the best checkpoint and what was written, then
    the last training losses and the guard's count."""
    before, best, kept = fit.before, fit.chosen, fit.kept
    out = before if kept else best
    metrics: dict[str, float] = {}
    if before is not None:
        metrics.update(
            val_ppl_fp=_ppl(before["nll_teacher"]), val_ppl_quantized=_ppl(before["nll"])
        )
    metrics.update(val_ppl_distilled=_ppl(out["nll"]), kept_input=float(kept))
    if before is not None and metrics["val_ppl_quantized"] > metrics["val_ppl_fp"]:
        gap = metrics["val_ppl_quantized"] - metrics["val_ppl_fp"]
        metrics["gap_recovered"] = (
            metrics["val_ppl_quantized"] - metrics["val_ppl_distilled"]
        ) / gap
    if before is not None:
        metrics["val_kl_quantized"] = before["kl"]
    metrics.update(
        val_kl_distilled=out["kl"],
        val_ppl_best=_ppl(best["nll"]),
        best_step=best["step"],
        val_window=val.window,
        val_windows=int(val.windows.shape[0]),
        val_tokens=val.tokens,
    )
    trainer = fit.trainer
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("loss/")}
    metrics.update(
        {f"final_{k.replace('/', '_')}": v for k, v in logged.items() if math.isfinite(v)}
    )
    metrics.update(
        steps=trainer.global_step,
        nan_skipped=float(guard.skipped if guard else 0),
        lr_scale=guard.lr_scale if guard else 1.0,
    )
    return metrics


def _report(cfg, fit: Fit, val: Heldout, metrics: dict, weights, world_size: int) -> dict:
    """distill_report.json: nothing in it differs between a resumed and an uninterrupted run."""
    return {
        "config": asdict(cfg),
        "metrics": metrics,
        "kept_input": fit.kept,
        "validation": {
            **val.describe(),
            "metric": "student mean next-token NLL (val/nll; ppl = exp), lower is better",
            "input": fit.before,
            "best": fit.chosen,
            "history": fit.history,
        },
        "layer_weights": weights.tolist(),
        "strategy": type(fit.trainer.strategy).__name__,
        "world_size": world_size,
    }
