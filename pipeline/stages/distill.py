"""distill: precision-aware distillation (QAT) of the quantized target against its FP self.

Student: the quantize stage's model, loaded with FakeQuantLinear layers that reproduce its codes,
scales and zeros exactly; teacher: the FP target, frozen. The training (pipeline/lit/distill.py)
runs on the configured Lightning strategy (cpu, ddp, DeepSpeed ZeRO-2/3, several nodes) with
gradient clipping, quant-aware gradient scaling, a NaN/Inf guard and checkpoints in the stage's
work dir, so a killed run resumes from its last checkpoint.

Selection: the student is validated on `val_windows` fixed windows of the validation split (never
the test split that evaluate reports) before the first step (the input), every `val_every` steps
and at the last step; the metric is its mean next-token NLL (perplexity), with KL(teacher ‖
student) logged beside it. After each validation `checkpoints/best.ckpt` in the work dir keeps
the best by that NLL, whose parameters (consolidated from the ZeRO shards when DeepSpeed trained
them), not the last ones, are the result; `early_stop_patience` optionally stops once validation
stops improving. When no checkpoint beats the input, the quantize stage's model is handed on
unchanged (copied byte for byte), with a warning and `kept_input: true` in `distill_report.json`.
Either way the result is written in the quantize stage's representation (`model/`), which is all
evaluate and export need to know.

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
from typing import Literal

import torch

from pipeline.config import data_cfg, model_cfg, parse, positive
from pipeline.data.heldout import heldout
from pipeline.data.text import Corpus
from pipeline.errors import ConfigError, LowbitError
from pipeline.lit.distill import train_sets_problem
from pipeline.lit.trainer import build_trainer, trainer_kwargs

NEEDS: tuple[str, ...] = ("quantize",)
USES: tuple[str, ...] = ("bootstrap",)
KEYS = ("model", "data", "trainer")
DISTRIBUTED = True  # every rank trains under the Lightning strategy

log = logging.getLogger("lowbit")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DistillConfig:
    max_steps: int = 300
    batch_size: int = 8
    seq_len: int | None = None
    lr: float = 2e-3
    weight_lr: float = 1e-5
    float_lr: float = 2e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    train: list[str] = field(default_factory=lambda: ["scales", "norms", "float"])
    alpha: float = 1.0
    beta: float = 0.1
    temperature: float = 1.0
    match: Literal["attention", "hidden", "both"] = "attention"
    layer_weights: Literal["error", "uniform"] = "error"
    teacher_dtype: Literal["float32", "bfloat16"] = "float32"
    clip_norm: float = 1.0
    grad_scale: Literal["bits", "lsq", "none"] = "bits"
    fp32_modules: list[str] = field(default_factory=lambda: ["lm_head", "norm"])
    nan_guard: bool = True
    ckpt_every: int | None = None
    val_windows: int = 128
    val_every: int = 50
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
        )
        problem = train_sets_problem(list(self.train))
        if problem:
            raise ConfigError(f"{prefix}.train", f"is {list(self.train)}", problem)
        if not 1.0 <= self.clip_norm <= 3.0:
            raise ConfigError(
                f"{prefix}.clip_norm", f"is {self.clip_norm}", "1.0 <= clip_norm <= 3.0"
            )
        if self.alpha < 0 or self.beta < 0 or self.alpha + self.beta == 0:
            raise ConfigError(
                f"{prefix}.alpha", f"={self.alpha} and beta={self.beta}", "both >= 0 and not both 0"
            )
        for key, v in (("warmup_steps", self.warmup_steps), ("weight_decay", self.weight_decay)):
            if v < 0:
                raise ConfigError(f"{prefix}.{key}", f"must be >= 0, got {v}")


def validate(cfg) -> None:
    parse(cfg.stage.distill, DistillConfig, "stage.distill")
    model_cfg(cfg)
    data_cfg(cfg)
    trainer_kwargs(cfg.trainer)


def _layer_errors(quantize_dir) -> dict[str, float]:
    path = quantize_dir / "quant_report.json"
    try:
        layers = json.loads(path.read_text())["layers"]
        return {name: float(r["rel_output_error"]) for name, r in layers.items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LowbitError(
            f"{path} has no per-layer rel_output_error ({e!r}); re-run the quantize stage, or set "
            "stage.distill.layer_weights=uniform"
        ) from None


def build_student(model_dir, p: DistillConfig):
    """The fake-quant student: exact quantize-stage weights, trainable sets, gradient scales."""
    from pipeline.lit.distill import apply_grad_scale, keep_full_precision, set_trainable
    from pipeline.models.quantized import load_quantized, quantized_modules

    student = load_quantized(model_dir, learn_weights="weights" in p.train)
    if not quantized_modules(student):
        raise LowbitError(f"{model_dir} has no quantized linear: nothing to distill")
    set_trainable(student, p.train)
    apply_grad_scale(student, p.grad_scale)
    keep_full_precision(student, p.fp32_modules)
    if p.beta > 0 and p.match != "hidden":
        student.set_attn_implementation("eager")  # attention probabilities need eager attention
    return student


def _is_deepspeed(trainer) -> bool:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return isinstance(trainer.strategy, DeepSpeedStrategy)


def _ppl(nll: float) -> float:
    return math.exp(min(nll, 50.0))


def run(ctx) -> dict:
    from pipeline.lit.distill import (
        DistillData,
        DistillHParams,
        DistillModule,
        keep_full_precision,
    )
    from pipeline.lit.guards import NanGuard, load_trained, pick_best
    from pipeline.lit.resume import ResumeCheckpoint, best_and_last, ckpt_interval, resume_from
    from pipeline.models.hf import load_causal_lm, load_tokenizer
    from pipeline.quant.losses import layer_weights

    p = parse(ctx.params, DistillConfig, "stage.distill")
    data = data_cfg(ctx.cfg)
    seq_len = p.seq_len or data.seq_len
    model_dir = ctx.inputs["quantize"] / "model"
    target_dir = ctx.target_dir()
    torch.manual_seed(ctx.cfg.seed)

    student = build_student(model_dir, p)
    teacher = load_causal_lm(
        target_dir, dtype=_DTYPES[p.teacher_dtype], allow_bin=ctx.cfg.model.allow_bin
    )
    if teacher.config.vocab_size != student.config.vocab_size:
        raise LowbitError(
            f"the teacher {target_dir} and the quantized {model_dir} differ in "
            "vocabulary: re-run quantize on this target"
        )
    keep_full_precision(teacher, p.fp32_modules)
    if p.beta > 0 and p.match != "hidden":
        teacher.set_attn_implementation("eager")
    n_layers = student.config.num_hidden_layers
    if p.layer_weights == "error":
        weights = layer_weights(_layer_errors(ctx.inputs["quantize"]), n_layers)
    else:
        weights = torch.full((n_layers,), 1.0 / n_layers)

    corpus = Corpus(data, load_tokenizer(target_dir))
    val = heldout(corpus.stream("validation"), "validation", seq_len, limit=p.val_windows)
    if val.windows.shape[0] < p.val_windows:
        log.warning(
            "distill: the validation split holds only %d windows of %d tokens (val_windows=%d)",
            val.windows.shape[0],
            seq_len,
            p.val_windows,
        )

    hp = DistillHParams(
        max_steps=p.max_steps,
        lr=p.lr,
        weight_lr=p.weight_lr,
        float_lr=p.float_lr,
        warmup_steps=p.warmup_steps,
        weight_decay=p.weight_decay,
        alpha=p.alpha,
        beta=p.beta,
        temperature=p.temperature,
        match=p.match,
    )
    module = DistillModule(student, teacher, hp, weights, p.train)
    datamodule = DistillData(
        corpus.stream("train"), seq_len, p.batch_size, ctx.cfg.seed, val=val.windows
    )
    resume = resume_from(ctx.work_dir, ctx.dist)
    guard = NanGuard() if p.nan_guard else None
    val_every = min(p.val_every, p.max_steps)
    best, callbacks = best_and_last(
        ctx.work_dir,
        "val/nll",
        "min",
        p.early_stop_patience,
        every=ckpt_interval(p.ckpt_every, p.max_steps),
        val_every=val_every,
    )
    callbacks = [guard, *callbacks] if guard else callbacks
    trainer = build_trainer(
        ctx.cfg.trainer,
        max_steps=p.max_steps,
        gradient_clip_val=p.clip_norm,
        gradient_clip_algorithm="norm",
        logger=ctx.log.lightning_logger() or False,
        callbacks=callbacks,
        default_root_dir=str(ctx.work_dir),
        val_check_interval=val_every,
        check_val_every_n_epoch=None,  # count steps across epochs, as max_steps does
        limit_val_batches=1.0,
        # The sanity check scores the input model on every window (step 0); a resumed run
        # restores that score from its checkpoint instead.
        num_sanity_val_steps=0 if resume else -1,
    )
    if _is_deepspeed(trainer):
        # The teacher and the frozen codes are reloaded from disk on resume: keep them out of
        # every ZeRO checkpoint (the module loads non-strictly, see DistillModule).
        trainer.strategy.exclude_frozen_parameters = True
    if resume:
        log.info("distill: resuming from %s", resume)
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume, weights_only=True)

    before = module.val_input
    chosen, kept = pick_best("distill", before, module.val_history, "nll", larger_is_better=False)
    if not best.best_model_path:
        raise LowbitError("distill: no checkpoint was written; check stage.distill.val_every")
    if not ctx.dist.is_main:
        return {}
    from pipeline.models.quantized import save_quantized_model

    if kept:
        log.warning(
            "distill: no checkpoint beat the input on the validation split (best val ppl %.4g "
            "at step %d vs %.4g before training): keeping the quantize stage's model unchanged",
            _ppl(chosen["nll"]),
            chosen["step"],
            _ppl(before["nll"]),
        )
        shutil.copytree(model_dir, ctx.out_dir / "model")
    else:
        # DDP trained the in-memory student in place; DeepSpeed's copy may be sharded.
        final = build_student(model_dir, p) if _is_deepspeed(trainer) else student
        load_trained(final, best.best_model_path, "student.")
        save_quantized_model(
            final.eval(), ctx.out_dir / "model", src_dir=model_dir, method="distill"
        )
    metrics = _metrics(before, chosen, kept, val)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("loss/")}
    metrics.update(
        {f"final_{k.replace('/', '_')}": v for k, v in logged.items() if math.isfinite(v)}
    )
    metrics.update(
        steps=trainer.global_step,
        nan_skipped=float(guard.skipped if guard else 0),
        lr_scale=guard.lr_scale if guard else 1.0,
    )
    report = {
        "config": asdict(p),
        "metrics": metrics,
        "kept_input": kept,
        "validation": {
            **val.describe(),
            "metric": "student mean next-token NLL (val/nll; ppl = exp), lower is better",
            "input": before,
            "best": chosen,
            "history": module.val_history,
        },
        "layer_weights": weights.tolist(),
        "strategy": type(trainer.strategy).__name__,
        "world_size": ctx.dist.world_size,
    }
    (ctx.out_dir / "distill_report.json").write_text(json.dumps(report, indent=1))
    log.info("distill: %s", "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    # How this run got there differs between a resumed and an uninterrupted run, so it is kept
    # out of the report file (hashed) and only goes to the stage metrics.
    resumed_step = next(c for c in callbacks if isinstance(c, ResumeCheckpoint)).resumed_step
    return metrics | {"resumed": float(resume is not None), "resumed_step": resumed_step}


def _metrics(before: dict | None, best: dict, kept: bool, val) -> dict[str, float]:
    """Validation-split numbers of the input, the best checkpoint and what was written."""
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
    return metrics
