"""NaN/Inf guard for long low-bit trainings: roll back a non-finite step and halve the lr.

The check runs after the optimizer step, which works alike for plain optimizers, DDP and ZeRO
(whose engine cannot be told to skip): the restored copy covers the trainable tensors, the
optimizer's own parameters (ZeRO's flat fp32 partitions) and its moments; the decision is
reduced over ranks so every rank rolls back together.
"""

from __future__ import annotations

import logging

import lightning as L
import torch
from torch import Tensor

log = logging.getLogger(__name__)


def _local(p: Tensor) -> Tensor:
    """The tensor that holds this rank's values (ZeRO-3 keeps them in `ds_tensor`)."""
    return getattr(p, "ds_tensor", p)


def _base_optimizer(opt) -> torch.optim.Optimizer:
    """The torch optimizer under a DeepSpeed ZeRO wrapper (or `opt` itself)."""
    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else opt


def _clone(x):
    return x.detach().clone() if isinstance(x, Tensor) else x


def scale_lr(trainer, factor: float) -> None:
    """Multiply the learning rate of every optimizer by ``factor``, now and for the rest of the
    run: the step scheduler recomputes lr = base_lr * lambda(step) every step, so its base
    learning rates are scaled too."""
    for opt in trainer.optimizers:
        for group in opt.param_groups:
            group["lr"] *= factor
    for cfg in trainer.lr_scheduler_configs:
        sched = cfg.scheduler
        if hasattr(sched, "base_lrs"):
            sched.base_lrs = [lr * factor for lr in sched.base_lrs]


class NanGuard(L.Callback):
    """Skip a non-finite step: restore the last good state and halve the learning rate."""

    def __init__(
        self, factor: float = 0.5, max_skips: int = 20, lr_key: str = "stage.distill.train.lr"
    ) -> None:
        self.factor, self.max_skips, self.lr_key = factor, max_skips, lr_key
        self.skipped = 0
        self.lr_scale = 1.0
        self._snapshot: dict | None = None

    def _tensors(self, trainer, module) -> tuple[list[Tensor], list[torch.optim.Optimizer]]:
        params = [_local(p) for p in module.parameters() if p.requires_grad]
        opts = [_base_optimizer(o) for o in trainer.optimizers]
        for opt in opts:
            params += [p for g in opt.param_groups for p in g["params"]]
        # Plain optimizers hold the module's own parameters: keep each tensor once.
        unique = {id(p): p for p in params}
        return list(unique.values()), opts

    def _save(self, trainer, module) -> None:
        params, opts = self._tensors(trainer, module)
        self._snapshot = {
            "params": [p.detach().clone() for p in params],
            "state": [
                {p: {k: _clone(v) for k, v in st.items()} for p, st in opt.state.items()}
                for opt in opts
            ],
        }

    @torch.no_grad()
    def _restore(self, trainer, module) -> None:
        params, opts = self._tensors(trainer, module)
        for p, saved in zip(params, self._snapshot["params"]):
            p.copy_(saved)
        for opt, state in zip(opts, self._snapshot["state"]):
            opt.state.clear()
            for p, st in state.items():
                opt.state[p] = {k: _clone(v) for k, v in st.items()}
            opt.zero_grad(set_to_none=True)

    def _halve_lr(self, trainer) -> None:
        self.lr_scale *= self.factor
        scale_lr(trainer, self.factor)

    def on_train_start(self, trainer, pl_module) -> None:
        self._save(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        bad = loss is not None and not bool(torch.isfinite(loss.detach()).all())
        if not bad:
            params = self._tensors(trainer, pl_module)[0]
            bad = any(not bool(torch.isfinite(p).all()) for p in params)
        bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if bad:
            self.skipped += 1
            if self.skipped > self.max_skips:
                raise FloatingPointError(
                    f"{self.skipped} non-finite steps: training diverges even at "
                    f"{self.lr_scale:.3g}x the learning rate; lower {self.lr_key} or check "
                    "the quantized model's scales"
                )
            self._restore(trainer, pl_module)
            self._halve_lr(trainer)
            log.warning(
                "non-finite step %d skipped: state restored, learning rate now %.3gx",
                trainer.global_step,
                self.lr_scale,
            )
        else:
            self._save(trainer, pl_module)
        pl_module.log_dict(
            {"guard/skipped": float(self.skipped), "guard/lr_scale": self.lr_scale},
            on_step=True,
            on_epoch=False,
        )

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "lr_scale": self.lr_scale}

    def load_state_dict(self, state_dict: dict) -> None:
        self.skipped = state_dict["skipped"]
        self.lr_scale = state_dict["lr_scale"]
