"""A training stage's validated fit: checkpoints, resume, and the result it hands on.

Both training stages (distill, reinforce) train the same way. The module validates on fixed
held-out data before the first step (Lightning's sanity check: the input's score, `val_input`),
every `val_every` steps and at the last step (`val_history`). `checkpoints/best.ckpt` in the
stage's work dir keeps the best check by the monitored metric; `checkpoints/last.ckpt` is
written every `ckpt_every` steps (None: a tenth of the run) and after each validation, and a
rerun resumes from it (`pipeline.lit.resume`); early stopping optionally ends the run after
`patience` checks without progress. The result is the best check's tensors, not the last ones,
unless no check beat the input, in which case the stage hands its input on unchanged
(`Fit.kept`).

The trainer: the schedule above is the stage's to set, so a `trainer.<key>` for a Trainer argument
`fit_validated` derives from it (`max_steps`, `val_check_interval`, ...) is refused with the stage
key to set instead (`fit_owned`), as is one for an argument the stage passes itself (gradient
clipping, ...); every other `trainer.*` key reaches the Trainer as given.

DeepSpeed: frozen parameters are left out of the checkpoints exactly when the module loads its
checkpoints non-strictly (`strict_loading = False`: it reloads them itself, as distill does with its
teacher), the only setting under which Lightning's DeepSpeed strategy can load them back. The
best checkpoint is then a directory of ZeRO shards, and the trained module may
be partitioned (ZeRO-3); `best_weights` consolidates the trained tensors from the shards of every
rank into a freshly loaded model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning as L
from torch import Tensor, nn

from pipeline.errors import ConfigError, LowbitError
from pipeline.lit.resume import (
    ResumeCheckpoint,
    best_and_last,
    ckpt_interval,
    load_checkpoint,
    resume_from,
)
from pipeline.lit.trainer import (
    Owned,
    build_trainer,
    refuse_owned,
    trainer_kwargs,
    training_owned,
)

log = logging.getLogger(__name__)

CLIP_NORM = (1.0, 3.0)  # the method's range for the training stages' gradient-norm clipping


def check_clip(prefix: str, key: str, value: float) -> None:
    """Refuse a clipping norm `prefix.key` outside CLIP_NORM, in one line."""
    lo, hi = CLIP_NORM
    if not lo <= value <= hi:
        raise ConfigError(f"{prefix}.{key}", f"is {value}", f"{lo} <= {key} <= {hi}")


@dataclass(frozen=True)
class Selection:
    """How a stage compares its validation checks."""

    monitor: str  # the logged metric best.ckpt follows, e.g. "val/nll"
    key: str  # the same number in the module's validation records, e.g. "nll"
    larger_is_better: bool


@dataclass(frozen=True)
class Fit:
    """What a validated fit produced (see the module docstring)."""

    trainer: L.Trainer
    best_path: str  # best.ckpt: a file, or the directory DeepSpeed writes
    before: dict | None  # the input's validation record (step 0); None when unknown
    chosen: dict  # the best validation record
    kept: bool  # no check beat the input: the stage hands its input on unchanged
    history: list[dict]  # one record per validation during training
    resume: str | None  # the checkpoint this run resumed from
    resumed_step: int  # the step training (re)started at

    @property
    def deepspeed(self) -> bool:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return isinstance(self.trainer.strategy, DeepSpeedStrategy)

    def resume_metrics(self) -> dict[str, float]:
        """Whether and where the run resumed: these differ between a resumed and an
        uninterrupted run, so they are stage metrics only, never in a (hashed) report."""
        return {"resumed": float(self.resume is not None), "resumed_step": self.resumed_step}


def fit_owned(stage: str) -> dict[str, str]:
    """The Trainer arguments `fit_validated` sets for `stage`, and what a user sets instead."""
    section = f"stage.{stage}"
    val_every = f"set {section}.val_every instead"
    return training_owned(stage) | {
        "max_steps": f"set {section}.max_steps instead",
        "val_check_interval": val_every,
        "check_val_every_n_epoch": f"validation counts steps; {val_every}",
        "limit_val_batches": f"every check scores the whole validation set, sized under {section}",
        "num_sanity_val_steps": "it scores the input on the whole validation set before step 1",
    }


def check_fit_trainer(stage: str, trainer_cfg) -> dict:
    """The stage's trainer group, checked before any compute: Trainer arguments only
    (`trainer_kwargs`), none of those `fit_validated` sets (`fit_owned`)."""
    refuse_owned(trainer_cfg, stage, fit_owned(stage))
    return trainer_kwargs(trainer_cfg)


def fit_validated(
    stage: str,
    module: L.LightningModule,
    data: L.LightningDataModule,
    *,
    trainer_cfg: dict,
    work_dir: Path,
    dist,
    logger,
    select: Selection,
    max_steps: int,
    val_every: int,
    ckpt_every: int | None,
    patience: int | None,
    callbacks: Sequence[L.Callback] = (),
    clip: tuple[str, float] | None = None,
    **overrides,
) -> Fit:
    """Train `module` on `data` with the stage's checkpoints, resuming a killed run.

    Args:
        stage: the stage's name (messages, and its config keys in them).
        module: a LightningModule that records `val_input` and `val_history` (dicts with
            "step" and `select.key`).
        trainer_cfg: the `trainer` section (`pipeline.lit.trainer.build_trainer`).
        work_dir, dist: the stage's work dir and the workflow's `pipeline.dist.Dist`.
        logger: a Lightning logger, or False.
        max_steps, val_every, ckpt_every, patience: the schedule (module docstring).
        callbacks: the stage's own callbacks, run before the checkpoints.
        clip: (the stage's key, its value): gradient-norm clipping at that value; a
            `trainer.gradient_clip_val` is refused naming `stage.<stage>.<key>`.
        **overrides: further Trainer arguments the stage sets.
    """
    resume = resume_from(work_dir, dist)
    val_every = min(val_every, max_steps)
    best, ckpts = best_and_last(
        work_dir,
        select.monitor,
        "max" if select.larger_is_better else "min",
        patience,
        every=ckpt_interval(ckpt_every, max_steps),
        val_every=val_every,
    )
    schedule = {
        "max_steps": max_steps,
        "val_check_interval": val_every,
        "check_val_every_n_epoch": None,  # count steps across epochs, as max_steps does
        # None is Lightning's "all of it" without the info line an explicit 1.0 prints.
        "limit_val_batches": None,
        # The sanity check scores the input on all of the validation data (step 0); a resumed
        # run restores that score from its checkpoint instead.
        "num_sanity_val_steps": 0 if resume else -1,
        "default_root_dir": str(work_dir),
        "logger": logger,
        "callbacks": [*callbacks, *ckpts],
        "enable_checkpointing": True,
    }
    if clip:
        overrides = {"gradient_clip_val": clip[1], "gradient_clip_algorithm": "norm", **overrides}
    instead = fit_owned(stage) | dict.fromkeys(overrides, f"see stage.{stage}")
    if clip:
        instead["gradient_clip_val"] = f"set stage.{stage}.{clip[0]} instead"
    trainer = build_trainer(
        trainer_cfg,
        stage=stage,
        owned={k: Owned(v, instead[k]) for k, v in (schedule | overrides).items()},
        exclude_frozen_parameters=not module.strict_loading,
    )
    if resume:
        log.info("%s: resuming from %s", stage, resume)
    trainer.fit(module, datamodule=data, ckpt_path=resume, weights_only=True)

    history = module.val_history
    chosen, kept = pick_best(stage, module.val_input, history, select)
    if not best.best_model_path:
        raise LowbitError(f"{stage}: no checkpoint was written; check stage.{stage}.val_every")
    resumed = next(c for c in ckpts if isinstance(c, ResumeCheckpoint))
    return Fit(
        trainer,
        best.best_model_path,
        module.val_input,
        chosen,
        kept,
        history,
        resume,
        resumed.resumed_step,
    )


def pick_best(
    stage: str, before: dict | None, history: list[dict], select: Selection
) -> tuple[dict, bool]:
    """The validation check the stage's ModelCheckpoint kept, and whether the input was as good.

    Args:
        stage: the stage's name, for the messages.
        before: the input's validation record (None when unknown), e.g. {"step": 0, key: v}.
        history: one record per validation during training.
        select: the metric in each record and its direction.

    Returns:
        (the chosen record, True when no check beat the input: the stage hands on its input).
    """
    key = select.key
    # As ModelCheckpoint ranks them: a NaN last, and the earlier of equal checks first.
    finite = [r for r in history if math.isfinite(r[key])] or history
    if not finite:
        raise LowbitError(
            f"{stage}: training ended without a validation; check stage.{stage}.val_every and "
            "that the validation split is not empty"
        )
    sign = -1.0 if select.larger_is_better else 1.0
    chosen = min(finite, key=lambda r: sign * r[key])
    if before is None:
        log.warning("%s: the input's validation score is unknown; using the best checkpoint", stage)
        return chosen, False
    return chosen, not sign * chosen[key] < sign * before[key]


def best_weights(
    fit: Fit, prefix: str, fresh: Callable[[], nn.Module], trained: nn.Module | None = None
) -> nn.Module:
    """The model to hand on, holding the best checkpoint's trained tensors.

    Args:
        fit: the finished fit.
        prefix: the model's attribute in the LightningModule plus a dot ("student.").
        fresh: loads the model as it was before training, with the same parameters trainable.
        trained: the module that trained, which then takes the tensors in place, except under
            DeepSpeed, whose copy may be partitioned: a `fresh()` model takes them instead.
    """
    model = fresh() if trained is None or fit.deepspeed else trained
    load_trained(model, fit.best_path, prefix)
    return model


def load_trained(model: nn.Module, path: Path | str, prefix: str) -> None:
    """Put the tensors under `prefix` of a Lightning checkpoint into `model` (in place).

    `path` is a checkpoint file, or the directory DeepSpeed writes (consolidated from its ZeRO
    shards: only the trained tensors are in it, the rest comes from `model` as loaded). Every
    parameter of `model` that requires grad must be in the checkpoint.
    """
    if Path(path).is_dir():
        state = zero_trainable_state(path, prefix=prefix)
    else:
        saved = load_checkpoint(path)["state_dict"]
        state = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
    wanted = {n for n, t in model.named_parameters() if t.requires_grad}
    if wanted - set(state):
        raise LowbitError(f"{path} lacks trained tensors {sorted(wanted - set(state))[:5]}")
    model.load_state_dict(state, strict=False)


def zero_trainable_state(ckpt_dir: Path | str, prefix: str) -> dict[str, Tensor]:
    """Consolidated fp32 values of the trainable parameters under `prefix` of a ZeRO checkpoint.

    Reads the fp32 master partitions of every rank from a checkpoint directory Lightning's
    DeepSpeed strategy wrote (tag "checkpoint") and joins them (`zero_to_fp32`); frozen tensors
    (the teacher, the codes) are not read. Works for ZeRO-1/2/3 and bf16 training alike.

    Returns:
        {name without `prefix`: float32 tensor}.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(
        str(ckpt_dir), tag="checkpoint", exclude_frozen_parameters=True, lazy_mode=True
    )
    # lazy_mode: one parameter at a time is materialised (`.contiguous()`), not the whole model.
    return {k[len(prefix) :]: v.contiguous() for k, v in state.items() if k.startswith(prefix)}
