"""TrainConfig: one schema for both training stages, usable by Hydra as a structured config, and
the old flat key names still applied (with a one-line notice naming the new key)."""

from __future__ import annotations

import logging
import subprocess
from dataclasses import replace

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from pipeline import workflow
from pipeline.config import parse
from pipeline.errors import ConfigError
from pipeline.lit.config import TrainConfig
from tests.conftest import CLI_TIMEOUT, lowbit_cmd, make_cfg

OLD_EXPERIMENT = """# @package _global_
defaults:
  - smoke
stage:
  distill: {ckpt_every: 3, clip_norm: 2.0, max_steps: 7}
  reinforce: {checkpoint_every: 4, grad_clip: 1.5, early_stop_patience: 2}
  bootstrap: {ckpt_every: 5}
"""


@pytest.fixture
def old_experiment(tmp_path):
    """A search path holding experiment=old_keys, written with the old key names."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "old_keys.yaml").write_text(OLD_EXPERIMENT)
    return f"hydra.searchpath=[file://{tmp_path / 'conf'}]"


def test_train_config_is_a_hydra_structured_config():
    ConfigStore.instance().store(group="lowbit_test", name="train", node=TrainConfig)
    schema = OmegaConf.structured(TrainConfig(lr=2e-3))
    cfg = OmegaConf.merge(schema, OmegaConf.from_dotlist(["steps=12", "checkpoint_every=3"]))
    assert OmegaConf.to_object(cfg) == TrainConfig(steps=12, lr=2e-3, checkpoint_every=3)
    with pytest.raises(ValidationError):  # typed: a string is no step count
        OmegaConf.merge(schema, OmegaConf.from_dotlist(["steps=many"]))


def test_both_stages_nest_the_same_train_config():
    cfg = make_cfg(
        "experiment=smoke", "stage.distill.train.lr=0.01", "stage.reinforce.train.batch=3"
    )
    distill, _ = workflow.stage_config(cfg, "distill")
    reinforce, _ = workflow.stage_config(cfg, "reinforce")
    assert type(distill.train) is type(reinforce.train) is TrainConfig
    assert (distill.train.lr, distill.train.steps, distill.train.checkpoint_every) == (0.01, 20, 10)
    assert (reinforce.train.batch, reinforce.train.steps) == (3, 10)


def test_old_names_on_the_command_line_apply_with_a_notice(caplog):
    cfg = make_cfg("experiment=smoke", "stage.distill.clip_norm=2", "stage.distill.grad_scale=lsq")
    with caplog.at_level(logging.WARNING, logger="pipeline.config"):
        distill, _ = workflow.stage_config(cfg, "distill")
    assert (distill.train.grad_clip, distill.train.quant_grad_scale) == (2.0, "lsq")
    assert "stage.distill.clip_norm is deprecated: use stage.distill.train.grad_clip" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline.config"):
        workflow.stage_config(make_cfg("experiment=smoke"), "distill")
    assert "deprecated" not in caplog.text  # the defaults' markers say nothing


def test_old_names_in_an_experiment_file_apply_with_a_notice(old_experiment, caplog):
    cfg = make_cfg(old_experiment, "experiment=old_keys")
    with caplog.at_level(logging.WARNING, logger="pipeline.config"):
        distill, _ = workflow.stage_config(cfg, "distill")
        reinforce, _ = workflow.stage_config(cfg, "reinforce")
        bootstrap, _ = workflow.stage_config(cfg, "bootstrap")
    assert (distill.train.steps, distill.train.checkpoint_every, distill.train.grad_clip) == (
        7,
        3,
        2,
    )
    assert (reinforce.train.checkpoint_every, reinforce.train.grad_clip) == (4, 1.5)
    assert reinforce.train.patience == 2 and bootstrap.checkpoint_every == 5
    for old, new in [
        ("distill.ckpt_every", "distill.train.checkpoint_every"),
        ("reinforce.early_stop_patience", "reinforce.train.patience"),
        ("bootstrap.ckpt_every", "bootstrap.checkpoint_every"),
    ]:
        assert f"stage.{old} is deprecated: use stage.{new}\n" in caplog.text + "\n"


def test_an_old_name_goes_through_the_train_checks():
    with pytest.raises(ConfigError, match=r"stage\.reinforce\.train\.grad_clip"):
        workflow.check_stage(
            make_cfg("experiment=smoke", "stage.reinforce.grad_clip=5"), "reinforce"
        )


def test_the_cli_accepts_old_names_and_names_the_new_key(tmp_path, old_experiment):
    proc = subprocess.run(
        lowbit_cmd(old_experiment, "experiment=old_keys", "stage.reinforce.quant_grad_scale=lsq",
                   "tracking=none", "--dry-run"),
        cwd=tmp_path, capture_output=True, text=True, timeout=CLI_TIMEOUT,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "stage.distill.clip_norm is deprecated: use stage.distill.train.grad_clip" in out
    assert "use stage.reinforce.train.quant_grad_scale" in out


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"steps": 0}, "steps"),
        ({"warmup": -1}, "warmup"),
        ({"grad_clip": 0.5}, "grad_clip"),
        ({"schedule": "linear"}, "schedule"),
        ({"quant_grad_scale": "sqrt"}, "quant_grad_scale"),
        ({"checkpoint_every": 0}, "checkpoint_every"),
        ({"schedule": "step", "step_every": 0}, "step_every"),
        ({"schedule": "step", "step_gamma": 0.0}, "step_gamma"),
        ({"step_gamma": 1.5}, "step_gamma"),
    ],
)
def test_a_bad_value_names_its_key(changes, key):
    with pytest.raises(ConfigError, match=rf"stage\.x\.train\.{key}"):
        parse(changes, TrainConfig, "stage.x.train")


def test_a_partial_train_section_keeps_the_stage_defaults():
    from pipeline.stages.distill import DistillConfig

    parsed = parse({"train": {"steps": 5}, "clip_norm": 2.0}, DistillConfig, "stage.distill")
    assert parsed.train == replace(DistillConfig().train, steps=5, grad_clip=2.0)


def test_the_step_schedule_drops_the_lr_by_step_gamma_every_step_every_steps():
    from pipeline.lit.lm import lr_factor

    train = TrainConfig(schedule="step", warmup=4, step_every=10, step_gamma=0.85)
    got = {s: lr_factor(s, train) for s in (0, 3, 9, 10, 19, 20, 35)}
    want = {0: 0.25, 3: 1.0, 9: 1.0, 10: 0.85, 19: 0.85, 20: 0.85**2, 35: 0.85**3}
    assert got == pytest.approx(want)
    # the method's setting: -15% every 10k steps, at any step count
    method = TrainConfig(schedule="step", warmup=0, steps=50_000)
    assert lr_factor(29_999, method) == pytest.approx(0.85**2)
    assert lr_factor(30_000, method) == pytest.approx(0.85**3)


def test_the_step_schedule_is_a_stage_override():
    cfg = make_cfg(
        "experiment=smoke",
        "stage.distill.train.schedule=step",
        "stage.reinforce.train.schedule=step",
        "stage.reinforce.train.step_every=3",
        "stage.reinforce.train.step_gamma=0.5",
    )
    distill, _ = workflow.stage_config(cfg, "distill")
    reinforce, _ = workflow.stage_config(cfg, "reinforce")
    assert (distill.train.schedule, distill.train.step_every, distill.train.step_gamma) == (
        "step",
        10_000,
        0.85,
    )
    assert (reinforce.train.step_every, reinforce.train.step_gamma) == (3, 0.5)
    with pytest.raises(ConfigError, match=r"stage\.reinforce\.train\.schedule.*step"):
        workflow.check_stage(
            make_cfg("experiment=smoke", "stage.reinforce.train.schedule=exp"), "reinforce"
        )
