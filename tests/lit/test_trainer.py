"""Who sets a Trainer argument: the user's `trainer.*` keys win over a stage's defaults, a key the
stage sets itself is refused by name; and the learning-rate monitor of a trainer that logs."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger

from pipeline.errors import ConfigError
from pipeline.lit.trainer import Owned, build_trainer, refuse_owned

CPU = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False}


def build(user: dict, **kw):
    return build_trainer(CPU | user, enable_model_summary=False, **kw)


def test_a_user_key_wins_over_the_stage_default():
    assert build({"limit_val_batches": 0.25}, limit_val_batches=0).limit_val_batches == 0.25
    assert build({}, limit_val_batches=0).limit_val_batches == 0
    # null in the trainer group means "not given": the stage's default applies.
    assert build({"limit_val_batches": None}, limit_val_batches=0).limit_val_batches == 0


def test_a_key_the_stage_owns_is_refused_with_the_key_to_use():
    owned = {"max_steps": Owned(7, "set stage.distill.train.steps instead")}
    with pytest.raises(ConfigError) as err:
        build({"max_steps": 100}, stage="distill", owned=owned)
    assert err.value.key == "trainer.max_steps"
    assert "distill stage" in str(err.value) and "stage.distill.train.steps" in str(err.value)
    assert build({}, stage="distill", owned=owned, max_steps=3).max_steps == 7  # owned, not 3


def test_refuse_owned_ignores_keys_the_stage_does_not_own():
    refuse_owned({"max_steps": 5, "precision": "bf16-mixed"}, "s", {"val_check_interval": "x"})
    refuse_owned({"max_steps": None}, "s", {"max_steps": "x"})  # null: not given
    with pytest.raises(ConfigError, match="trainer.val_check_interval"):
        refuse_owned({"val_check_interval": 5}, "s", {"val_check_interval": "x"})


def test_a_logging_trainer_monitors_the_learning_rate(tmp_path):
    def monitors(trainer) -> list:
        return [c for c in trainer.callbacks if isinstance(c, LearningRateMonitor)]

    logged = build({}, logger=CSVLogger(tmp_path), default_root_dir=str(tmp_path))
    assert len(monitors(logged)) == 1
    assert monitors(logged)[0].logging_interval == "step"
    assert not monitors(build({}, logger=False))  # nothing to log to: Lightning would refuse it


def test_deepspeed_without_the_extra_is_one_line_naming_it(monkeypatch):
    import importlib.util

    from pipeline.lit.trainer import check_trainer

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "deepspeed" else real(name, *a),
    )
    with pytest.raises(ConfigError, match=r"lowbit\[deepspeed\]"):
        check_trainer({"accelerator": "cpu", "strategy": "deepspeed", "devices": 1})
    check_trainer({"accelerator": "cpu", "strategy": "ddp", "devices": 1})  # others unaffected
