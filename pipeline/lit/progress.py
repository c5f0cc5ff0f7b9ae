"""A training's progress in the log, and its expected duration from its first steps.

Off a terminal Lightning's bar is off, so `TrainingProgress` logs on rank 0 a step line at most
every `every_s` seconds (mean loss since the last line, tokens/s over every rank, ETA), one line
per validation and a last line; on a terminal too, the expected duration once the first steps
are timed. The rate is that of the second half of the timed steps (the first ones pay for
warm-up); each validation ahead counts at the last one's time.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import lightning as L
import torch

from pipeline.progress import EVERY_S, clock, status

log = logging.getLogger(__name__)

ESTIMATE_S = 5.0  # seconds of timed steps before the expected duration is logged ...
ESTIMATE_STEPS = 4  # ... and at least this many steps (or `every_s` seconds, whichever first)


class TrainingProgress(L.Callback):
    """Log lines of a training's progress and its expected duration (module docstring)."""

    def __init__(
        self,
        name: str,
        *,
        lines: bool = True,
        every_s: float = EVERY_S,
        estimate_s: float = ESTIMATE_S,
        estimate_steps: int = ESTIMATE_STEPS,
    ) -> None:
        self.name, self.lines, self.every_s = name, lines, every_s
        self.estimate_s, self.estimate_steps = estimate_s, estimate_steps
        self.start: float | None = None  # when training started (after the sanity check)
        self.last = 0.0  # when the last line was logged
        self._val_start: float | None = None
        self._val_last_s: float | None = None  # the last validation's duration
        self._val_total_s = 0.0  # validation time since training started

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = self.last = time.monotonic()
        self.first_step = trainer.global_step  # > 0 when resumed
        self.total = _total_steps(trainer)
        self.timed: list[tuple[float, int, float]] = []  # (time, step, validation s) per step
        self.expected: float | None = None  # seconds, once estimated
        self.reported = False
        self._reset_interval(self.start)

    def _reset_interval(self, now: float) -> None:
        self.losses: list[float] = []
        self.tokens, self.interval_start, self.interval_val_s = 0, now, self._val_total_s

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, _: int
    ) -> None:
        if not trainer.is_global_zero:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.losses.append(float(loss.detach()))
        self.tokens += _tokens(batch) * trainer.world_size
        now, step = time.monotonic(), trainer.global_step
        # Each optimizer step from the end of the first one on (it pays for warm-up).
        timed_to = self.timed[-1][1] if self.timed else self.first_step
        if self.expected is None and step > timed_to:
            self.timed.append((now, step, self._val_total_s))
            self._estimate(trainer, now, step)
        if self.lines and now - self.last >= self.every_s:
            self._log_step(trainer, now)

    def _estimate(self, trainer: L.Trainer, now: float, step: int) -> None:
        t0 = self.timed[0][0]
        spent = now - t0
        # The second half's rate: slower first steps (allocations, kernel choices) fall before.
        t_mid, step_mid, val_mid = next(r for r in self.timed if r[0] >= t0 + spent / 2)
        steps = step - step_mid
        ready = spent >= self.estimate_s and steps >= self.estimate_steps
        if not (ready or (steps and spent >= self.every_s)) or self.total is None:
            return
        per_step = (now - t_mid - (self._val_total_s - val_mid)) / steps
        todo = self.total - self.first_step
        expected, why = todo * per_step, f"{per_step:.3g} s/step over steps {step_mid}-{step}"
        checks = _validations(trainer, self.first_step, self.total)
        if checks and self._val_last_s is not None:
            expected += checks * self._val_last_s
            why += f"; {checks} validations of {clock(self._val_last_s)}"
        steps_run = f"{todo} steps" + (f" (from step {self.first_step})" if self.first_step else "")
        log.info("%s: %s, ~%s expected (%s)", self.name, steps_run, clock(expected), why)
        self.expected, self.timed = expected, []

    def _log_step(self, trainer: L.Trainer, now: float) -> None:
        fields = []
        if self.losses:
            fields.append(f"loss {sum(self.losses) / len(self.losses):.4g}")
        train_s = now - self.interval_start - (self._val_total_s - self.interval_val_s)
        if self.tokens and train_s > 0:
            fields.append(f"{_count(self.tokens / train_s)} tokens/s")
        done = trainer.global_step
        line = status(done, self.total, self.first_step, now - self.start, fields)
        log.info("%s: step %s", self.name, line)
        self.last, self.reported = now, True
        self._reset_interval(now)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or not (self.reported or self.expected is not None):
            return  # the end of a training that said it was running
        took = clock(time.monotonic() - self.start)
        steps = trainer.global_step - self.first_step
        against = f" (expected ~{clock(self.expected)})" if self.expected is not None else ""
        log.info("%s: %d steps done in %s%s", self.name, steps, took, against)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._val_start = time.monotonic()
        self._val_batches = 0
        if self.start is None:  # the sanity check, before training starts
            self.last = self._val_start

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self._val_batches += 1
        now = time.monotonic()
        if trainer.is_global_zero and self.lines and now - self.last >= self.every_s:
            total = _val_batches(trainer)
            line = status(self._val_batches, total, 0, now - self._val_start)
            log.info("%s: %s, batch %s", self.name, _which(trainer), line)
            self.last = now

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._val_start is None:
            return
        now = time.monotonic()
        self._val_last_s = now - self._val_start
        if not trainer.sanity_checking and self.start is not None:
            self._val_total_s += self._val_last_s
        self._val_start = None
        if trainer.is_global_zero and self.lines:
            scores = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val")}
            shown = ", ".join(f"{k} {float(v):.4g}" for k, v in scores.items())
            took = f"{_which(trainer)} in {clock(self._val_last_s)}"
            log.info("%s: %s%s", self.name, took, f": {shown}" if shown else "")
            self.last = now


def _total_steps(trainer: L.Trainer) -> int | None:
    if trainer.max_steps and trainer.max_steps > 0:
        return int(trainer.max_steps)
    total = trainer.estimated_stepping_batches
    return int(total) if math.isfinite(total) else None


def _validations(trainer: L.Trainer, start: int, total: int) -> int:
    """Validations ahead: every `val_check_interval` steps and at the last one (the stages'
    fits validate their last step); 0 when the trainer does not validate by steps."""
    every = trainer.val_check_interval
    if not isinstance(every, int) or every <= 0 or trainer.limit_val_batches == 0:
        return 0
    return math.ceil((total - start) / every)


def _val_batches(trainer: L.Trainer) -> int | None:
    counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
    total = sum(counts) if counts else math.inf
    return int(total) if math.isfinite(total) else None


def _which(trainer: L.Trainer) -> str:
    if trainer.sanity_checking:
        return "validation before training"
    total = _total_steps(trainer)
    return f"validation at step {trainer.global_step}" + (f"/{total}" if total else "")


def _tokens(batch: Any) -> int:
    """Token ids in a batch: the elements of its integer tensors."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() if not batch.is_floating_point() else 0
    if isinstance(batch, list | tuple):
        return sum(_tokens(b) for b in batch)
    if isinstance(batch, dict):
        return sum(_tokens(b) for b in batch.values())
    return 0


def _count(x: float) -> str:
    """``950``, ``12.3k``, ``1.2M``."""
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"
