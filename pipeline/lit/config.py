"""TrainConfig: the training schedule both training stages share (`stage.<name>.train`)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import positive
from pipeline.errors import ConfigError

CLIP_NORM = (1.0, 3.0)  # the method's range for gradient-norm clipping
SCHEDULES = ("cosine", "constant", "step")  # after a linear warm-up (`pipeline.lit.lm.lr_factor`)
QUANT_GRAD_SCALES = ("bits", "lsq", "none")  # `pipeline.quant.fakequant`


@dataclass(frozen=True)
class TrainConfig:
    """One stage's training schedule, handed to `pipeline.lit.fit.fit_validated` as is."""

    # Plain types only (str, not Literal): Hydra's ConfigStore takes it as a structured config.

    steps: int = 300
    batch: int = 8  # per rank
    lr: float = 1e-3
    schedule: str = "cosine"  # cosine (decay to a tenth) | constant | step
    # step: the method's step decay, lr x step_gamma every step_every steps (-15% every 10k)
    step_every: int = 10_000
    step_gamma: float = 0.85
    warmup: int = 10  # linear warm-up steps
    val_every: int = 50  # validate (and keep best.ckpt) every N steps, and at the last step
    checkpoint_every: int | None = None  # resume checkpoint; null: a tenth of `steps`
    patience: int | None = None  # stop after N checks without a better score; null: never
    grad_clip: float = 1.0
    nan_guard: bool = True  # skip a non-finite step, restore the last good state, halve the lr
    quant_grad_scale: str = "bits"  # scale/zero gradient factor: 2^-bits | LSQ's | none

    def check(self, prefix: str) -> None:
        positive(
            prefix,
            steps=self.steps,
            batch=self.batch,
            lr=self.lr,
            val_every=self.val_every,
            checkpoint_every=self.checkpoint_every,
            patience=self.patience,
            step_every=self.step_every,
        )
        if not 0 < self.step_gamma <= 1:
            raise ConfigError(
                f"{prefix}.step_gamma", f"is {self.step_gamma}", "0 < step_gamma <= 1 (0.85: -15%)"
            )
        if self.warmup < 0:
            raise ConfigError(f"{prefix}.warmup", f"must be >= 0, got {self.warmup}")
        lo, hi = CLIP_NORM
        if not lo <= self.grad_clip <= hi:
            raise ConfigError(
                f"{prefix}.grad_clip", f"is {self.grad_clip}", f"{lo} <= grad_clip <= {hi}"
            )
        for key, allowed in (("schedule", SCHEDULES), ("quant_grad_scale", QUANT_GRAD_SCALES)):
            if getattr(self, key) not in allowed:
                raise ConfigError(
                    f"{prefix}.{key}", f"is {getattr(self, key)!r}", " | ".join(allowed)
                )


# Old flat keys of the training stages, still accepted for one release (`pipeline.config.parse`).
RENAMED = {
    "max_steps": "train.steps",
    "batch_size": "train.batch",
    "lr": "train.lr",
    "warmup_steps": "train.warmup",
    "val_every": "train.val_every",
    "early_stop_patience": "train.patience",
    "nan_guard": "train.nan_guard",
}
