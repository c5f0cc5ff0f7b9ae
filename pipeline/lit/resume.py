"""Exact resume of a training stage: a rerun from `last.ckpt` writes the bytes an uninterrupted
run writes. That needs the same batches (indexed by step, `pipeline.lit.lm`), the same state (the
checkpoint plus every rank's random streams) and checkpoints never before a step's validation,
since Lightning resumes a batch-end checkpoint past that validation. `last.ckpt` is renamed into
place and loads with `weights_only=True` (data, never code); DeepSpeed reads its own sharded
directories (trust them as the run's own only). A time-limit signal (`pipeline.preempt`) is
answered at the next step boundary, or after that step's validation: `last.ckpt`, then stop.
"""

from __future__ import annotations

import math
import os
import random
import shutil
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.pytorch.callbacks import Checkpoint

from pipeline import preempt
from pipeline.rundir import commit, set_aside

CKPT_DIR = "checkpoints"


def ckpt_interval(every: int | None, max_steps: int) -> int:
    """Steps between resume checkpoints: `every`, or a tenth of the run when None."""
    return every or max(1, math.ceil(max_steps / 10))


def resume_path(work_dir: Path) -> Path:
    """The checkpoint a rerun resumes from; the set-aside one if a kill hit a DeepSpeed swap."""
    last = Path(work_dir) / CKPT_DIR / "last.ckpt"
    old = set_aside(last)
    return old if old.exists() and not last.exists() else last


def resume_from(work_dir: Path, dist) -> str | None:
    """The checkpoint a rerun resumes from, or None; rank 0 decides for all: none resumes alone."""
    last = resume_path(work_dir)
    return dist.broadcast(str(last) if dist.is_main and last.exists() else None)


def load_checkpoint(path: Path | str) -> dict:
    """A Lightning checkpoint file, unpickled with weights_only (tensors and plain values)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def rng_states() -> dict:
    """The global random streams of this process, as tensors and plain values."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_states(state: dict) -> None:
    """Put back what `rng_states` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class ResumeCheckpoint(Checkpoint):
    """`last.ckpt` in `dirpath`, the checkpoint a rerun resumes from (see the module docstring)."""

    def __init__(
        self, dirpath: Path | str, every: int | None, val_every: int | None = None
    ) -> None:
        self.dirpath, self.every, self.val_every = Path(dirpath), every, val_every
        self.resumed_step = 0  # the step training (re)started at: > 0 when resumed
        self._rng: dict | None = None
        self._stopping = False  # early stopping decided at the checkpointed validation
        self._signalled = False  # a time-limit signal: stop after this step's validation

    @property
    def path(self) -> Path:
        return self.dirpath / "last.ckpt"

    def _validates(self, step: int, max_steps: int) -> bool:
        return self.val_every is not None and (step % self.val_every == 0 or step >= max_steps)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self.resumed_step = checkpoint["global_step"]

    def on_fit_start(self, trainer, pl_module) -> None:
        preempt.defer(True)

    def on_fit_end(self, trainer, pl_module) -> None:
        preempt.defer(False)
        if preempt.received():  # it came after the last step boundary: training is saved
            raise preempt.stopped(f"training finished and saved in {self.path}")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        preempt.defer(False)

    def on_train_start(self, trainer, pl_module) -> None:
        preempt.reinstall()  # after the Trainer registered its own SIGTERM handler
        # Lightning does not keep `should_stop`: a run killed after its early stop would train on.
        trainer.should_stop = trainer.should_stop or self._stopping
        # Loaders and sanity check ran before this hook; from here the streams are the run's.
        if self._rng is not None:
            set_rng_states(self._rng)
            self._rng = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # between micro-batches: not a step boundary
        step = trainer.global_step
        last = 0 < trainer.max_steps <= step
        due = (self.every is not None and step % self.every == 0) or last
        # Every rank takes part (ranks get the signal at different steps); one rank: no collective.
        signalled = preempt.installed() and trainer.strategy.reduce_boolean_decision(
            preempt.received() is not None, all=False
        )
        validates = self._validates(step, trainer.max_steps)
        if (due or signalled) and not validates:
            self.save(trainer)
        if signalled and not validates:
            raise preempt.stopped(f"training checkpointed at step {step} in {self.path}")
        self._signalled = signalled

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self._stopping = trainer.should_stop  # EarlyStopping ran before (not a Checkpoint)
            self.save(trainer)
            if self._signalled:
                step = trainer.global_step
                raise preempt.stopped(f"training checkpointed at step {step} in {self.path}")

    def save(self, trainer: L.Trainer) -> None:
        """Write `last.ckpt` through a temporary name (every rank takes part)."""
        tmp = self.path.with_name("last.tmp")
        if trainer.is_global_zero:
            _remove(tmp)  # a kill mid-write leaves one; DeepSpeed would write into it
        trainer.strategy.barrier("ResumeCheckpoint.clean")
        try:
            trainer.save_checkpoint(tmp, weights_only=False)  # the whole state: a resume needs it
        except BaseException:
            if trainer.is_global_zero:
                _remove(tmp)  # a full disk: give back the space a partial file holds
            raise
        if trainer.is_global_zero:
            commit(tmp, self.path)
        trainer.strategy.barrier("ResumeCheckpoint.saved")

    def state_dict(self) -> dict:
        # Every rank's streams (this runs on every rank while a checkpoint is dumped).
        mine = rng_states()
        _, world = _rank_and_world()
        every = [mine]
        if world > 1:
            every = [None] * world
            torch.distributed.all_gather_object(every, mine)
        return {"rng": every, "stopping": self._stopping}

    def load_state_dict(self, state_dict: dict) -> None:
        self._stopping = bool(state_dict.get("stopping", False))
        every = state_dict.get("rng") or []
        rank, world = _rank_and_world()
        # Another world size: streams and shards do not map; the run continues, not identically.
        self._rng = every[rank] if len(every) == world else None


class SiblingCheckpointIO(TorchCheckpointIO):
    """Checkpoint files written beside their final name, then renamed into place.

    Lightning's own writes through the system temp dir and moves the file: across file systems
    (a node-local /tmp, a run dir on another disk) the move copies into the final name, so a full
    disk leaves a partial `best.ckpt`, and a small /tmp refuses what the run dir has room for.
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial")
        try:
            with open(tmp, "wb") as f:  # not a path: only so a refused write keeps its errno
                torch.save(checkpoint, f)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk: give back the space the partial file holds
            raise
        os.replace(tmp, path)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def best_and_last(
    work_dir: Path,
    monitor: str,
    mode: str,
    patience: int | None,
    every: int | None = None,
    val_every: int | None = None,
) -> tuple[L.Callback, list[L.Callback]]:
    """`best.ckpt` by `monitor`, `last.ckpt` to resume from, early stopping after `patience`."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    dirpath = Path(work_dir) / CKPT_DIR
    best = ModelCheckpoint(
        dirpath=str(dirpath),
        filename="best",
        monitor=monitor,
        mode=mode,
        save_top_k=1,
        save_last=False,
        save_on_train_epoch_end=False,
        auto_insert_metric_name=False,
        enable_version_counter=False,
    )
    # After `best` (Lightning keeps their order): a validation step's last.ckpt records its best.
    last = ResumeCheckpoint(dirpath, every, val_every)
    if patience is None:
        return best, [best, last]
    stop = EarlyStopping(monitor, patience=patience, mode=mode, check_on_train_epoch_end=False)
    return best, [best, last, stop]
