"""A training's progress off a terminal: step, loss, tokens/s, elapsed and ETA lines, the scores of
each validation, the expected duration; on a terminal only the expected duration and the time
taken (the bar shows the rest); nothing on ranks other than 0. A tiny real Lightning training,
its clocks at zero."""

from __future__ import annotations

import logging
import re

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from pipeline.lit.progress import TrainingProgress
from pipeline.lit.trainer import build_trainer

STEPS, VAL_EVERY, BATCH, SEQ = 6, 2, 4, 8
FAST = {"every_s": 0.0, "estimate_s": 0.0, "estimate_steps": 1}


class Toy(L.LightningModule):
    """Next-token prediction on random ids: a real loss, a real optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def _loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(ids[:, :-1]))  # (B, T-1, V)
        return nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:])

    def training_step(self, ids, _):
        return self._loss(ids)

    def validation_step(self, ids, _):
        self.log("val/nll", self._loss(ids))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    ids = torch.randint(0, 16, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return DataLoader(ids, batch_size=BATCH)


def fit(progress: TrainingProgress) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        val_check_interval=VAL_EVERY,
        callbacks=[progress],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Toy(), train_dataloaders=loader(), val_dataloaders=loader())


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pipeline.lit.progress"]


def test_off_a_terminal_it_logs_steps_validations_and_the_expected_duration(caplog):
    caplog.set_level(logging.INFO, logger="pipeline.lit.progress")
    fit(TrainingProgress("toy", **FAST))
    logged = lines(caplog)
    number = r"[0-9.]+(e[+-]\d+)?"
    step = re.compile(
        rf"toy: step (\d)/{STEPS} \(\d+%\), loss {number}, {number}k? tokens/s, "
        r"\d+s elapsed, ETA (\d+s|unknown)$"
    )
    steps = [int(m.group(1)) for m in map(step.match, logged) if m]
    assert steps == list(range(1, STEPS + 1))  # a line per step at every_s=0
    expected = [s for s in logged if "expected (" in s]
    assert len(expected) == 1, expected
    # Timed after step 1 (which pays the warm-up); 3 validations ahead, at steps 2, 4 and 6.
    assert re.fullmatch(
        rf"toy: {STEPS} steps, ~\d+s expected \({number} s/step over steps \d-\d; "
        rf"{STEPS // VAL_EVERY} validations of \d+s\)",
        expected[0],
    ), expected[0]
    batches = [s for s in logged if ", batch " in s]  # a validation's progress
    assert batches[0] == "toy: validation before training, batch 1/2 (50%), 0s elapsed, ETA 0s"
    assert len(batches) == 2 + 3 * len(loader())
    checks = [s for s in logged if re.match(r"toy: validation [a-z0-9/ ]+ in \d+s: ", s)]
    assert checks[0].startswith("toy: validation before training in ")  # the sanity check
    assert [re.search(r"at step (\d/\d) ", s).group(1) for s in checks[1:]] == ["2/6", "4/6", "6/6"]
    assert all(re.search(rf": val/nll {number}$", s) for s in checks)
    assert re.fullmatch(rf"toy: {STEPS} steps done in \d+s \(expected ~\d+s\)", logged[-1])


def test_on_a_terminal_only_the_expected_duration(caplog):
    caplog.set_level(logging.INFO, logger="pipeline.lit.progress")
    fit(TrainingProgress("toy", lines=False, **FAST))
    expected, done = lines(caplog)
    assert "expected" in expected and done.startswith(f"toy: {STEPS} steps done in ")


def test_ranks_other_than_0_say_nothing(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="pipeline.lit.progress")
    monkeypatch.setattr(L.Trainer, "is_global_zero", property(lambda self: False))
    fit(TrainingProgress("toy", **FAST))
    assert lines(caplog) == []


@pytest.mark.parametrize("tty", [True, False])
def test_build_trainer_logs_progress_where_the_bar_is_off(monkeypatch, tty):
    monkeypatch.setattr("sys.stderr.isatty", lambda: tty)
    trainer = build_trainer({"accelerator": "cpu", "devices": 1}, stage="distill", logger=False)
    (progress,) = [c for c in trainer.callbacks if isinstance(c, TrainingProgress)]
    assert progress.name == "distill" and progress.lines is not tty
    named = build_trainer({"enable_progress_bar": True}, stage="bootstrap", name="bootstrap draft")
    (progress,) = [c for c in named.callbacks if isinstance(c, TrainingProgress)]
    assert progress.name == "bootstrap draft" and not progress.lines
