"""bootstrap's trainer: both models log into the stage's run under their own prefix (learning
rate included), the Trainer arguments the stage sets are refused under trainer.*, and
stage.bootstrap.precision replaces trainer.precision only when set."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline import hardware
from pipeline.errors import ConfigError
from pipeline.stages import StageIO, bootstrap
from tests.lit.test_fit import stage_run  # noqa: F401  (fixture)
from tests.lit.test_resume import STREAM, tiny_lm

CPU = {
    "accelerator": "cpu",
    "devices": 1,
    "precision": "32-true",
    "log_every_n_steps": 1,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def config(**changes) -> bootstrap.BootstrapConfig:
    base = dict(max_steps=3, batch_size=2, lr=1e-2, warmup_steps=1, precision=None)
    return bootstrap.BootstrapConfig(**(base | changes))


def test_each_model_logs_under_its_prefix_with_its_learning_rate(tmp_path, stage_run):  # noqa: F811
    io = StageIO("bootstrap", tmp_path / "out", tmp_path / "work", tmp_path, log=stage_run)
    run = SimpleNamespace(seed=0, trainer=CPU)
    corpus = SimpleNamespace(stream=lambda split: STREAM, data=SimpleNamespace(seq_len=8))
    torch.manual_seed(0)
    bootstrap._train(io, run, tiny_lm(), corpus, 3, config(), "target")
    logged = set(stage_run.client.get_run(stage_run.run_id).data.metrics)
    assert {"target-train_loss", "target-lr-AdamW"} <= logged
    assert not {"train_loss", "lr-AdamW"} & logged  # nothing without the model's prefix
    history = stage_run.client.get_metric_history(stage_run.run_id, "target-lr-AdamW")
    assert len(history) == 3  # every step (log_every_n_steps=1)


@pytest.mark.parametrize("key", ["max_steps", "default_root_dir", "callbacks"])
def test_check_refuses_the_trainer_arguments_bootstrap_sets(key):
    run = SimpleNamespace(trainer=CPU | {key: 5})
    with pytest.raises(ConfigError) as err:
        bootstrap.check(config(), run)
    assert err.value.key == f"trainer.{key}" and "bootstrap stage" in str(err.value)
    if key == "max_steps":
        assert "stage.bootstrap.max_steps" in str(err.value)
    bootstrap.check(config(), SimpleNamespace(trainer=CPU | {"gradient_clip_val": 1.0}))


def test_stage_precision_replaces_the_trainer_precision_only_when_set():
    run = SimpleNamespace(trainer=CPU)
    assert bootstrap._trainer_cfg(config(), run, "target")["precision"] == "32-true"
    bf16 = bootstrap._trainer_cfg(config(precision="bf16-mixed"), run, "target")
    assert bf16["precision"] == "bf16-mixed" and CPU["precision"] == "32-true"  # a copy


def test_the_default_precision_follows_what_the_cpu_computes_natively():
    assert bootstrap.BootstrapConfig().precision == "auto"
    run = SimpleNamespace(trainer=CPU)
    got = bootstrap._trainer_cfg(config(precision="auto"), run, "target")["precision"]
    native = hardware.native(torch.bfloat16, "cpu")[0]
    assert got == ("bf16-mixed" if native else "32-true")
