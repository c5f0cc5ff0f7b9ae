"""Causal-LM pre-training (the bootstrap stage's target and draft).

Windows of the corpus are sampled at random offsets each step (an infinite, seeded stream), so
`max_steps` alone sets the training length whatever the corpus size.
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


class RandomWindows(Dataset):
    """`length` windows of seq_len+1 tokens at seeded random offsets of a token stream."""

    def __init__(self, stream: torch.Tensor, seq_len: int, length: int, seed: int):
        self.stream, self.seq_len = stream, seq_len
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, stream.numel() - seq_len - 1, (length,), generator=g)

    def __len__(self) -> int:
        return self.starts.numel()

    def __getitem__(self, i: int) -> torch.Tensor:
        s = int(self.starts[i])
        return self.stream[s : s + self.seq_len]


def cosine_with_warmup(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """LR multiplier: linear warm-up, then cosine decay to `floor`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


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


def loader(ds: Dataset, batch_size: int, shuffle: bool) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, num_workers=0)
