"""The training stages' validated fit on a tiny fake-quant distillation: the learning rate of
every parameter group in MLflow, the Trainer arguments the stage owns refused by name, and
DeepSpeed's frozen-parameter exclusion decided when the strategy is built."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from mlflow.tracking import MlflowClient

from pipeline.dist import Dist
from pipeline.errors import ConfigError
from pipeline.lit.distill import DistillData
from pipeline.lit.fit import Selection, check_fit_trainer, fit_validated
from pipeline.lit.lm import cosine_with_warmup
from pipeline.tracking import StageRun
from tests._require import needs
from tests.lit.test_distill_module import SEQ, VOCAB, make_module

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = {
    "accelerator": "cpu",
    "devices": 1,
    "log_every_n_steps": 1,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
STREAM = torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(1))
VAL = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(2))


def fit(tmp_path, module, data=None, trainer_cfg=CPU, logger=False, **kw):
    return fit_validated(
        "distill",
        module,
        data or DistillData(STREAM, SEQ, batch_size=2, seed=0, val=VAL),
        replace(module.hp.train, steps=4, val_every=2, nan_guard=False),
        trainer_cfg=trainer_cfg,
        work_dir=tmp_path / "work",
        dist=Dist(),
        logger=logger,
        select=Selection("val/nll", "nll", larger_is_better=False),
        **kw,
    )


@pytest.fixture
def stage_run(tmp_path, monkeypatch) -> StageRun:
    """A stage's MLflow run in a file store (an SQLite store takes ~10 s to create)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    client = MlflowClient(uri)
    return StageRun(client, client.create_run(client.create_experiment("x")).info.run_id, uri)


def test_every_param_group_learning_rate_reaches_mlflow(tmp_path, stage_run):
    client, run_id = stage_run.client, stage_run.run_id
    logger = stage_run.lightning_logger()
    # Two groups with their own rates (hparams: lr 1e-3, float_lr 5e-4), named by the module.
    module = make_module(train=("scales", "float"), max_steps=4)
    fit(tmp_path, module, logger=logger)
    base = {"scales": 1e-3, "float": 5e-4}
    for group, lr in base.items():
        history = client.get_metric_history(run_id, f"lr-AdamW/{group}")
        got = {m.step: m.value for m in history}
        want = {s: lr * cosine_with_warmup(s, 0, 4) for s in range(4)}
        assert got.keys() == want.keys()
        assert got == pytest.approx(want)


@pytest.mark.parametrize(
    "key, fix",
    [
        ("max_steps", "stage.distill.train.steps"),
        ("val_check_interval", "stage.distill.train.val_every"),
        ("gradient_clip_val", "stage.distill.train.grad_clip"),
    ],
)
def test_a_trainer_key_the_stage_sets_fails_naming_the_stage_key(tmp_path, key, fix):
    with pytest.raises(ConfigError) as err:
        fit(
            tmp_path,
            make_module(),
            trainer_cfg=CPU | {key: 3},
        )
    assert err.value.key == f"trainer.{key}" and fix in str(err.value)
    assert not (tmp_path / "work").exists()  # refused before anything ran


def test_the_stage_check_refuses_schedule_keys_before_any_compute():
    with pytest.raises(ConfigError, match="stage.reinforce.train.steps"):
        check_fit_trainer("reinforce", CPU | {"max_steps": 10})
    assert check_fit_trainer("reinforce", CPU | {"precision": "bf16-mixed"})["precision"]


class Built(Exception):
    """Raised once the trainer is built, before anything of DeepSpeed starts."""


class StopBeforeSetup(DistillData):
    def prepare_data(self) -> None:  # Lightning's first call into the data, before the strategy
        raise Built(self.trainer.strategy)


@needs("deepspeed")
@pytest.mark.parametrize("strict", [False, True])
def test_deepspeed_leaves_frozen_parameters_out_when_the_module_reloads_them(tmp_path, strict):
    """A module that loads non-strictly (distill: the teacher and codes come from disk) gets a
    strategy built with exclude_frozen_parameters; a strict one would fail to load them back."""
    module = make_module()
    module.strict_loading = strict
    cfg = CPU | {"strategy": "deepspeed", "deepspeed_config": "zero2.json"}
    with pytest.raises(Built) as built:
        fit(tmp_path, module, StopBeforeSetup(STREAM, SEQ, 2, 0, VAL), trainer_cfg=cfg)
    assert built.value.args[0].exclude_frozen_parameters is not strict
