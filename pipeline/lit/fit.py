"""A training stage's validated fit (`TrainConfig`): checkpoints, resume, the result handed on.

The module validates before step 1 (the input's score), every `val_every` steps and at the last;
`best.ckpt` keeps the best check, `last.ckpt` what a rerun resumes from. The result is the best
check's tensors, or the input unchanged unless the best check's gain holds beyond the noise of
the validation windows (`pipeline.lit.keep`, `Fit.kept`, `Fit.margin`). Under DeepSpeed,
frozen parameters stay out of checkpoints exactly when the module loads non-strictly, the only
setting its strategy can load back; `best_weights` consolidates the ZeRO shards.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning as L
from torch import Tensor, nn

from pipeline.errors import LowbitError
from pipeline.lit.config import TrainConfig
from pipeline.lit.guards import NanGuard
from pipeline.lit.keep import KeepConfig, Margin, paired_bootstrap
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


@dataclass(frozen=True)
class Selection:
    """How a stage compares its validation checks, and the best one with its input."""

    monitor: str  # the logged metric best.ckpt follows, e.g. "val/nll"
    key: str  # the same number in the module's validation records, e.g. "nll"
    larger_is_better: bool
    keep: KeepConfig = KeepConfig()
    seed: int = 0  # of the bootstrap's resamples
    windows_key: str = "val_windows"  # the stage key that sets how many windows are scored


_PER_WINDOW = ("windows", "window_groups")  # record keys holding one value per window


@dataclass(frozen=True)
class Fit:
    """What a validated fit produced."""

    trainer: L.Trainer
    best_path: str  # best.ckpt: a file, or the directory DeepSpeed writes
    before: dict | None  # the input's validation record (step 0); None when unknown
    chosen: dict  # the best validation record
    kept: bool  # no check beat the input: the stage hands its input on unchanged
    history: list[dict]  # one record per validation during training
    resume: str | None  # the checkpoint this run resumed from
    resumed_step: int  # the step training (re)started at
    guard: NanGuard | None  # the NaN/Inf guard, when train.nan_guard
    margin: Margin | None = None  # the best check against the input; None: input unscored

    @property
    def deepspeed(self) -> bool:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return isinstance(self.trainer.strategy, DeepSpeedStrategy)

    @property
    def nan_skipped(self) -> int:
        return self.guard.skipped if self.guard else 0

    @property
    def guard_lr_scale(self) -> float:
        return self.guard.lr_scale if self.guard else 1.0

    def validation(self) -> dict:
        """The report's view of the checks: the input's and the best one's records (their
        per-window scores included), the keep decision, and every check's means."""
        means = [{k: v for k, v in r.items() if k not in _PER_WINDOW} for r in self.history]
        keep = self.margin.describe() if self.margin else None
        return {"input": self.before, "best": self.chosen, "keep": keep, "history": means}

    def resume_metrics(self) -> dict[str, float]:
        """Whether and where the run resumed: stage metrics only, never in a (hashed) report."""
        return {"resumed": float(self.resume is not None), "resumed_step": self.resumed_step}


def fit_owned(stage: str) -> dict[str, str]:
    """The Trainer arguments `fit_validated` sets for `stage`, and what a user sets instead."""
    train = f"stage.{stage}.train"
    val_every = f"set {train}.val_every instead"
    return training_owned(stage) | {
        "max_steps": f"set {train}.steps instead",
        "val_check_interval": val_every,
        "check_val_every_n_epoch": f"validation counts steps; {val_every}",
        "limit_val_batches": f"every check scores the whole validation set; see stage.{stage}",
        "num_sanity_val_steps": "it scores the input on the whole validation set before step 1",
        "gradient_clip_val": f"set {train}.grad_clip instead",
        "gradient_clip_algorithm": f"clipping is by norm; set {train}.grad_clip",
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
    train: TrainConfig,
    *,
    trainer_cfg: dict,
    work_dir: Path,
    dist,
    logger,
    select: Selection,
    callbacks: Sequence[L.Callback] = (),
    **overrides,
) -> Fit:
    """Train `module` on `data` on `train`'s schedule, resuming a killed run."""
    resume = resume_from(work_dir, dist)
    val_every = min(train.val_every, train.steps)
    best, ckpts = best_and_last(
        work_dir,
        select.monitor,
        "max" if select.larger_is_better else "min",
        train.patience,
        every=ckpt_interval(train.checkpoint_every, train.steps),
        val_every=val_every,
    )
    guard = NanGuard(lr_key=f"stage.{stage}.train.lr") if train.nan_guard else None
    schedule = {
        "max_steps": train.steps,
        "val_check_interval": val_every,
        "check_val_every_n_epoch": None,  # count steps across epochs, as max_steps does
        "limit_val_batches": None,  # Lightning's "all of it", without the info line 1.0 prints
        # The sanity check scores the input (step 0); a resumed run restores that score instead.
        "num_sanity_val_steps": 0 if resume else -1,
        "default_root_dir": str(work_dir),
        "logger": logger,
        "callbacks": [*([guard] if guard else []), *callbacks, *ckpts],
        "enable_checkpointing": True,
        "gradient_clip_val": train.grad_clip,
        "gradient_clip_algorithm": "norm",
    }
    instead = fit_owned(stage) | dict.fromkeys(overrides, f"see stage.{stage}")
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
    chosen, kept, margin = pick_best(stage, module.val_input, history, select, dist.is_main)
    if not best.best_model_path:
        raise LowbitError(
            f"{stage}: no checkpoint was written; check stage.{stage}.train.val_every"
        )
    resumed = next(c for c in ckpts if isinstance(c, ResumeCheckpoint))
    return Fit(
        trainer,
        best.best_model_path,
        module.val_input,
        chosen,
        kept,
        module.val_history,
        resume,
        resumed.resumed_step,
        guard,
        margin,
    )


def pick_best(
    stage: str, before: dict | None, history: list[dict], select: Selection, warn: bool = True
) -> tuple[dict, bool, Margin | None]:
    """The validation check the stage's ModelCheckpoint kept, whether the stage keeps its input
    instead (the check's gain does not hold beyond the noise), and that margin; `warn`: say so
    when the noise exceeds the gain (one rank of several)."""
    key = select.key
    # As ModelCheckpoint ranks them: a NaN last, and the earlier of equal checks first.
    finite = [r for r in history if math.isfinite(r[key])] or history
    if not finite:
        raise LowbitError(
            f"{stage}: training ended without a validation; check stage.{stage}.train.val_every "
            "and that the validation split is not empty"
        )
    sign = -1.0 if select.larger_is_better else 1.0
    chosen = min(finite, key=lambda r: sign * r[key])
    if before is None:
        log.warning("%s: the input's validation score is unknown; using the best checkpoint", stage)
        return chosen, False, None
    if "windows" not in before or "windows" not in chosen:
        raise LowbitError(
            f"{stage}: the resumed checkpoint's validation records lack per-window scores "
            f"(written by an earlier lowbit); remove <run_dir>/.work/{stage}-* to train afresh"
        )
    margin = paired_bootstrap(
        before["windows"],
        chosen["windows"],
        larger_is_better=select.larger_is_better,
        keep=select.keep,
        seed=select.seed,
        groups=chosen.get("window_groups"),
    )
    if warn and margin.unresolved:
        log.warning(
            "%s: the validation noise exceeds the difference it measured (%s); raise "
            "stage.%s.%s to resolve it",
            stage,
            margin.text(),
            stage,
            select.windows_key,
        )
    return chosen, not margin.trained, margin


def best_weights(
    fit: Fit, prefix: str, fresh: Callable[[], nn.Module], trained: nn.Module | None = None
) -> nn.Module:
    """The model to hand on, holding the best checkpoint's trained tensors."""
    model = fresh() if trained is None or fit.deepspeed else trained
    load_trained(model, fit.best_path, prefix)
    return model


def load_trained(model: nn.Module, path: Path | str, prefix: str) -> None:
    """Put the tensors under `prefix` of a Lightning checkpoint into `model` (in place)."""
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
    """Consolidated fp32 values of the trainable parameters under `prefix` of a ZeRO checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(
        str(ckpt_dir), tag="checkpoint", exclude_frozen_parameters=True, lazy_mode=True
    )
    # lazy_mode: one parameter at a time is materialised (`.contiguous()`), not the whole model.
    return {k[len(prefix) :]: v.contiguous() for k, v in state.items() if k.startswith(prefix)}
