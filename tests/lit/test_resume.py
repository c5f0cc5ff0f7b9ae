"""Resume checkpoints on a tiny Llama: where they are written, what they hold (plain values,
loadable with weights_only), and a run resumed mid-way ending bit for bit where an uninterrupted
one ends, random streams (dropout) and step-indexed batches included."""

from __future__ import annotations

import os
import random
import signal

import lightning as L
import numpy as np
import pytest
import torch

from pipeline import preempt
from pipeline.lit.distill import DistillData
from pipeline.lit.lm import CausalLM, RandomWindows, WindowData, step_loader
from pipeline.lit.resume import (
    ResumeCheckpoint,
    ckpt_interval,
    load_checkpoint,
    resume_path,
    rng_states,
    set_rng_states,
)
from tests.test_preempt import handlers  # noqa: F401  (fixture)

VOCAB, SEQ = 64, 8

pytestmark = pytest.mark.usefixtures("one_thread")


class StopsAtMaxSteps(CausalLM):
    """As the stage modules do: stopping through `should_stop` validates the last step too."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.global_step >= self.trainer.max_steps:
            self.trainer.should_stop = True


class Crash(L.Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.at:
            raise RuntimeError("killed")


class Steps(L.Callback):
    def __init__(self) -> None:
        self.trained: list[int] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.trained.append(trainer.global_step)


def tiny_lm(dropout: float = 0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        attention_dropout=dropout,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


STREAM = torch.randint(0, VOCAB, (500,), generator=torch.Generator().manual_seed(1))


def fit(tmp_path, max_steps, callbacks, data, ckpt=None, dropout=0.0, val_every=None):
    module = StopsAtMaxSteps(tiny_lm(dropout), lr=1e-2, warmup=1, max_steps=max_steps)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
        val_check_interval=val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        limit_val_batches=1.0 if val_every else 0,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt, weights_only=True)
    return module


def test_interval_is_a_tenth_unless_given():
    assert ckpt_interval(None, 300) == 30 and ckpt_interval(None, 7) == 1
    assert ckpt_interval(25, 300) == 25


def test_batches_are_a_function_of_seed_and_step():
    a = RandomWindows(STREAM, SEQ, batch_size=4, seed=3)
    assert torch.equal(a.batch(5), RandomWindows(STREAM, SEQ, 4, seed=3).batch(5))
    assert not torch.equal(a.batch(5), a.batch(6))
    # A loader started at batch 5 yields batch 5 first, whole.
    resumed = next(iter(step_loader(RandomWindows(STREAM, SEQ, 4, seed=3, start=5), 4)))
    assert torch.equal(resumed, a.batch(5))
    # Two ranks split one global batch: the rows of rank 0 and 1 are those of a world of one
    # with twice the batch size.
    halves = [RandomWindows(STREAM, SEQ, 2, seed=3, rank=r, world_size=2).batch(5) for r in (0, 1)]
    assert torch.equal(torch.cat(halves), a.batch(5))


def test_rng_states_are_plain_values_that_restore_the_streams(tmp_path):
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    torch.save(rng_states(), tmp_path / "rng.pt")
    draws = torch.rand(3), random.random(), np.random.rand()
    set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(3), draws[0])
    assert random.random() == draws[1] and np.random.rand() == draws[2]


def test_checkpoints_every_n_steps_and_after_validations_never_before(tmp_path, monkeypatch):
    """every=2, validation every 3 steps and at the last (7): a step that validates is saved
    after its validation, the others at the end of their batch."""
    saved = []
    original = ResumeCheckpoint.save

    def save(self, trainer):
        stage = "val" if trainer.validating else "train"
        saved.append((trainer.global_step, stage))
        original(self, trainer)

    monkeypatch.setattr(ResumeCheckpoint, "save", save)
    val = STREAM[:32].view(4, SEQ)
    ckpt = ResumeCheckpoint(tmp_path / "checkpoints", every=2, val_every=3)
    fit(tmp_path, 7, [ckpt], DistillData(STREAM, SEQ, 2, seed=0, val=val), val_every=3)
    assert saved == [(2, "train"), (3, "val"), (4, "train"), (6, "val"), (7, "val")]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["last.ckpt"]  # no tmp
    assert load_checkpoint(resume_path(tmp_path))["global_step"] == 7


def test_a_resumed_run_ends_bit_for_bit_where_an_uninterrupted_one_ends(tmp_path):
    """Dropout draws from the global RNG and batches come from the step: both must continue
    exactly, and only the steps after the checkpoint are trained again."""
    data = WindowData(STREAM, SEQ, 2, seed=0)
    whole = fit(tmp_path / "a", 6, [ResumeCheckpoint(tmp_path / "a", every=2)], data, dropout=0.3)

    with pytest.raises(RuntimeError, match="killed"):
        fit(tmp_path / "b", 6, [ResumeCheckpoint(tmp_path / "b", 2), Crash(5)], data, dropout=0.3)
    assert load_checkpoint(tmp_path / "b" / "last.ckpt")["global_step"] == 4
    torch.manual_seed(123)  # another process, other streams: the checkpoint must set them
    steps = Steps()
    ckpt = ResumeCheckpoint(tmp_path / "b", 2)
    resumed = fit(
        tmp_path / "b", 6, [ckpt, steps], data, ckpt=str(tmp_path / "b" / "last.ckpt"), dropout=0.3
    )
    assert steps.trained == [4, 5] and ckpt.resumed_step == 4
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


class Signal(L.Callback):
    """The time-limit warning arriving while step `at + 1` trains."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGUSR1)


@pytest.mark.usefixtures("handlers")
@pytest.mark.parametrize(("at", "saved"), [(1, (2, "train")), (2, (3, "val"))])
def test_a_time_limit_signal_saves_at_the_step_boundary_or_after_its_validation(
    tmp_path, monkeypatch, at, saved
):
    """Step 2 does not validate: saved at its end. Step 3 validates (every 3): saved after that
    validation, never before it; then the run stops, and its resume ends bit for bit."""
    writes = []
    original = ResumeCheckpoint.save

    def save(self, trainer):
        writes.append((trainer.global_step, "val" if trainer.validating else "train"))
        original(self, trainer)

    monkeypatch.setattr(ResumeCheckpoint, "save", save)
    data = DistillData(STREAM, SEQ, 2, seed=0, val=STREAM[:32].view(4, SEQ))
    whole = fit(tmp_path / "a", 7, [ResumeCheckpoint(tmp_path / "a", None, 3)], data, val_every=3)
    writes.clear()

    cut = tmp_path / "b"
    with pytest.raises(preempt.Preempted, match=f"checkpointed at step {saved[0]} in "):
        fit(cut, 7, [ResumeCheckpoint(cut, None, 3), Signal(at)], data, val_every=3)
    assert writes == [saved]
    preempt._state["signal"] = None  # the rerun is another process
    torch.manual_seed(123)
    resumed = fit(
        cut, 7, [ResumeCheckpoint(cut, None, 3)], data, ckpt=str(cut / "last.ckpt"), val_every=3
    )
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
