"""Causal-LM pre-training (the bootstrap stage's models), step-indexed batches, lr schedules.

Batch k is a pure function of (seed, rank, k), so a run resumed at step k reads the batches k,
k+1, ... of the uninterrupted run: the loader starts at the restored step (`next_batch`), not at
a yielded count, which Lightning's one-batch-ahead fetcher would put one past the trained step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from pipeline.errors import LowbitError
from pipeline.lit.config import TrainConfig


def next_batch(trainer) -> int:
    """Index of the batch the trainer reads next: its restored step times the accumulation."""
    return trainer.global_step * trainer.accumulate_grad_batches


def batch_rows(batch: Callable[[int], torch.Tensor], start: int) -> Iterator[torch.Tensor]:
    """The rows of batch(start), batch(start + 1), ... in order."""
    return itertools.chain.from_iterable(map(batch, itertools.count(start)))


def step_loader(ds: IterableDataset, batch_size: int) -> DataLoader:
    """A loader that groups the rows of a step-indexed dataset back into its batches."""
    return DataLoader(ds, batch_size=batch_size, num_workers=0)


class RandomWindows(IterableDataset):
    """Endless batches of windows of `seq_len` tokens at random offsets of a token stream; batch
    k is a function of (seed, k), each rank taking its share of that global batch."""

    def __init__(
        self,
        stream: torch.Tensor,
        seq_len: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start: int = 0,
    ):
        if stream.numel() < seq_len:
            raise LowbitError(
                f"the train split has {stream.numel()} tokens, fewer than one window of "
                f"{seq_len}; lower data.seq_len or add text"
            )
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        self.seed, self.rank, self.world_size, self.start = seed, rank, world_size, start

    def batch(self, k: int) -> torch.Tensor:
        """Batch k of this rank, (B, T)."""
        b, high = self.batch_size, self.stream.numel() - self.seq_len + 1
        starts = np.random.default_rng([self.seed, k]).integers(0, high, b * self.world_size)
        mine = torch.from_numpy(starts[self.rank * b : (self.rank + 1) * b])  # (B,)
        return self.stream[mine[:, None] + torch.arange(self.seq_len)]  # (B, T)

    def __iter__(self):
        return batch_rows(self.batch, self.start)


class WindowData(L.LightningDataModule):
    """Random training windows of a token stream (`RandomWindows`), from the trainer's step."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> None:
        super().__init__()
        self.stream, self.seq_len, self.batch_size, self.seed = stream, seq_len, batch_size, seed

    def train_dataloader(self) -> DataLoader:
        t = self.trainer
        windows = RandomWindows(
            self.stream,
            self.seq_len,
            self.batch_size,
            self.seed,
            rank=t.global_rank,
            world_size=t.world_size,
            start=next_batch(t),
        )
        return step_loader(windows, self.batch_size)


def cosine_with_warmup(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """LR multiplier: linear warm-up, then cosine decay to `floor`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_factor(step: int, train: TrainConfig) -> float:
    """LR multiplier of `train.schedule` at `step`: linear warm-up, then cosine decay, flat, or
    `step_gamma` per `step_every` steps (counted from the first step, warm-up included)."""
    if train.schedule in ("constant", "step"):
        warm = min(1.0, (step + 1) / train.warmup) if train.warmup else 1.0
        decay = train.step_gamma ** (step // train.step_every) if train.schedule == "step" else 1.0
        return warm * decay
    return cosine_with_warmup(step, train.warmup, train.steps)


def scheduled(opt: torch.optim.Optimizer, train: TrainConfig) -> dict:
    """Lightning's optimizer config: `opt` with `train`'s learning-rate schedule, per step."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, train))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class CausalLM(L.LightningModule):
    def __init__(self, model, lr: float, warmup: int, max_steps: int):
        super().__init__()
        self.model = model
        self.lr, self.warmup, self.max_steps = lr, warmup, max_steps

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def training_step(self, batch, _):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, _):
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: cosine_with_warmup(s, self.warmup, self.max_steps)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
