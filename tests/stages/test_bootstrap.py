"""bootstrap's trainer: both models log into the stage's run under their own prefix (learning
rate included), beside the user's `trainer.loggers` and `trainer.callbacks`; the Trainer arguments
the stage sets are refused under trainer.*, and stage.bootstrap.precision replaces
trainer.precision only when set."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback

from pipeline import hardware, workflow
from pipeline.config import to_plain
from pipeline.errors import ConfigError
from pipeline.lit.resume import CKPT_DIR
from pipeline.stages import StageIO, bootstrap
from tests.conftest import make_cfg, smoke_cfg
from tests.lit.test_fit import stage_run  # noqa: F401  (fixture)
from tests.lit.test_resume import STREAM, tiny_lm
from tests.stages.conftest import boot_cfg

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


class CountSteps(Callback):
    """A user's callback, named by `_target_` in `trainer.callbacks`."""

    steps: list[int] = []

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def on_train_batch_end(self, trainer, *args) -> None:
        CountSteps.steps.append(trainer.global_step)


def test_loggers_and_callbacks_from_target_entries_join_the_stage_own(tmp_path, stage_run):  # noqa: F811
    """`trainer.loggers` / `trainer.callbacks` overrides: a CSVLogger writes its metrics.csv
    beside the MLflow logger, a user callback runs beside the stage's checkpoints."""
    csv = tmp_path / "csv"
    cfg = make_cfg(
        f"trainer.loggers=[{{_target_:lightning.pytorch.loggers.CSVLogger,save_dir:'{csv}'}}]",
        "trainer.callbacks=[{_target_:tests.stages.test_bootstrap.CountSteps,tag:x}]",
    )
    extras = {k: to_plain(cfg.trainer[k]) for k in ("loggers", "callbacks")}
    bootstrap.check(config(), SimpleNamespace(trainer=CPU | extras))
    io = StageIO("bootstrap", tmp_path / "out", tmp_path / "work", tmp_path, log=stage_run)
    run = SimpleNamespace(seed=0, trainer=CPU | extras)
    corpus = SimpleNamespace(stream=lambda split: STREAM, data=SimpleNamespace(seq_len=8))
    CountSteps.steps.clear()
    bootstrap._train(io, run, tiny_lm(), corpus, 3, config(), "target")
    assert CountSteps.steps == [1, 2, 3]
    (metrics,) = csv.glob("lightning_logs/version_*/metrics.csv")
    header = metrics.read_text().splitlines()[0].split(",")
    assert "train_loss" in header and len(metrics.read_text().splitlines()) >= 4  # 3 steps
    logged = set(stage_run.client.get_run(stage_run.run_id).data.metrics)
    assert "target-train_loss" in logged  # the stage's MLflow logger still logs
    assert (tmp_path / "work" / "target" / CKPT_DIR / "last.ckpt").is_file()  # its checkpoints


@pytest.mark.parametrize(
    ("key", "entries", "says"),
    [
        ("loggers", [{"_target_": "lightning.pytorch.loggers.NoSuchLogger"}], "does not import"),
        ("loggers", "csv", "a list of entries"),
        ("callbacks", [{"save_dir": "x"}], "`_target_`"),
    ],
)
def test_a_bad_extra_entry_is_one_line_naming_its_key(key, entries, says):
    with pytest.raises(ConfigError) as err:
        bootstrap.check(config(), SimpleNamespace(trainer=CPU | {key: entries}))
    assert err.value.key.startswith(f"trainer.{key}") and says in str(err.value)
    assert "\n" not in str(err.value)


def test_an_entry_of_the_wrong_kind_is_refused_when_built(tmp_path):
    from pipeline.lit.trainer import build_trainer

    callback = {"_target_": "tests.stages.test_bootstrap.CountSteps", "tag": "x"}
    with pytest.raises(ConfigError, match="a subclass of Logger") as err:
        build_trainer(CPU | {"loggers": [callback]}, default_root_dir=str(tmp_path))
    assert err.value.key == "trainer.loggers[0]"


@pytest.mark.parametrize("key", ["max_steps", "default_root_dir", "logger"])
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


def test_a_resumed_runs_memory_plan_leaves_out_the_stages_up_to_date(boot, tmp_path):
    """Bootstrap done: neither it nor its tokenizer training is in the plan."""
    fresh = smoke_cfg(tmp_path / "fresh", "tracking=none")
    plan, _ = workflow.memory_plan(fresh, workflow.plan(fresh, tmp_path / "fresh" / "run"))
    assert plan.stages[0].stage == "bootstrap" and "tokenizer training" in plan.stages[0].terms
    cfg = boot_cfg(boot, tmp_path)
    resumed, _ = workflow.memory_plan(cfg, workflow.plan(cfg, tmp_path / "run"))
    assert [s.stage for s in resumed.stages] == [s.stage for s in plan.stages[1:]]
    assert all("tokenizer training" not in s.terms for s in resumed.stages)
    # --verify would hash every output to decide, as the run does after: all stages planned
    verify = boot_cfg(boot, tmp_path, "verify=true")
    planned, _ = workflow.memory_plan(verify, workflow.plan(verify, tmp_path / "run"))
    assert [s.stage for s in planned.stages] == [s.stage for s in plan.stages]
