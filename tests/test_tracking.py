"""MLflow contents against a real SQLite store and a real `mlflow server`."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import pytest
from mlflow.tracking import MlflowClient

from pipeline import workflow
from pipeline.config import TrackingConfig
from pipeline.errors import ConfigError, LowbitError
from pipeline.tracking import Tracker
from tests.conftest import make_cfg
from tests.test_workflow import toy_stages  # noqa: F401  (fixture)


def _cfg(tmp_path, uri, *over):
    return make_cfg(
        "stages=[bootstrap,sensitivity,evaluate]",
        f"run_dir={tmp_path / 'run'}",
        f"tracking.uri={uri}",
        f"tracking.artifact_location={tmp_path / 'art'}",
        "name=trk",
        *over,
    )


def _check_store(uri: str, n_children: int, experiment: str = "lowbit"):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    parent = parents[0]
    assert parent.info.run_name == "trk" and parent.info.status == "FINISHED"
    assert parent.data.params["quant.method"] == "gptq"  # flattened config
    assert len(children) == n_children
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert len(child.data.tags["fingerprint"]) == 64
        tags = child.data.tags
        assert {"mlflow.user", "mlflow.source.type", "lowbit.host", "world_size"} <= set(tags)
        assert tags["mlflow.source.name"] == "lowbit"
        assert len(tags["mlflow.source.git.commit"]) == 40  # the checkout's commit
        assert "value" in child.data.metrics and "stage_seconds" in child.data.metrics
        assert child.info.status == "FINISHED"
        names = {a.path for a in client.list_artifacts(child.info.run_id)}
        assert "_done.json" in names
    return client, parent, children


def test_sqlite_store_holds_parent_and_children(toy_stages, tmp_path):  # noqa: F811
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    workflow.run(_cfg(tmp_path, uri))
    _, parent, children = _check_store(uri, 3)
    assert {c.info.run_name for c in children} == {"bootstrap", "sensitivity", "evaluate"}
    sens = next(c for c in children if c.info.run_name == "sensitivity")
    assert sens.data.params["quant.budget_bits"] == "3.0"
    # Resuming the run dir reuses the parent and adds a child for the stage that reran.
    workflow.run(_cfg(tmp_path, uri, "data.eval_windows=3"))
    _, parent2, children2 = _check_store(uri, 4)
    assert parent2.info.run_id == parent.info.run_id
    marker = json.loads((tmp_path / "run" / "_mlflow.json").read_text())
    assert marker["run_id"] == parent.info.run_id


def test_server_store_holds_parent_and_children(toy_stages, tmp_path, mlflow_server):  # noqa: F811
    workflow.run(_cfg(tmp_path, mlflow_server, "tracking.artifact_location=null"))
    _check_store(mlflow_server, 3)


def test_mlflow_environment_variables_choose_the_store_when_the_command_line_does_not(
    toy_stages,  # noqa: F811
    tmp_path,
    mlflow_server,
    monkeypatch,
):
    """As for any MLflow script: MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME replace the
    default local store and experiment (a separate experiment keeps the shared server's others)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "lowbit-from-env")
    monkeypatch.chdir(tmp_path)  # where the default store would be written
    stages = "stages=[bootstrap,sensitivity,evaluate]"
    workflow.run(make_cfg(stages, f"run_dir={tmp_path / 'run'}", "name=trk"))
    _check_store(mlflow_server, 3, experiment="lowbit-from-env")
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlartifacts").exists()


def test_tracking_uri_on_the_command_line_wins_over_mlflow_tracking_uri(
    toy_stages,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    from_env = tmp_path / "env.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{from_env}")
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    workflow.run(_cfg(tmp_path, uri))
    _check_store(uri, 3)
    assert not from_env.exists()


def test_unreachable_server_fails_at_start(toy_stages, tmp_path):  # noqa: F811
    from tests.conftest import free_port

    t0 = time.time()
    with pytest.raises(LowbitError, match="not reachable"):
        workflow.run(_cfg(tmp_path, f"http://127.0.0.1:{free_port()}"))
    assert time.time() - t0 < 30
    assert not (tmp_path / "run" / "bootstrap").exists()


def test_a_stage_run_samples_system_metrics_until_it_ends(tmp_path):
    """Through MLflow's public API (`start_run(log_system_metrics=True)` and its sampling
    interval); the stage's run is the thread's active run only until it ends."""
    import mlflow

    from pipeline.tracking import StageRun

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("x")).info.run_id
    stage = StageRun(client, run_id, uri)
    before = os.environ.get("MLFLOW_TRACKING_URI")
    stage.monitor_system(0.2)
    assert mlflow.active_run().info.run_id == run_id
    time.sleep(1.0)
    stage.end("KILLED")
    assert mlflow.active_run() is None
    assert os.environ.get("MLFLOW_TRACKING_URI") == before  # the next run's default store
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert "system/cpu_utilization_percentage" in run.data.metrics
    assert "system/system_memory_usage_megabytes" in run.data.metrics
    samples = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert len(samples) >= 2  # every 0.2 s, not MLflow's default of 10 s
    off = StageRun(client, client.create_run(client.create_experiment("y")).info.run_id, uri)
    off.monitor_system(0)  # tracking.system_metrics_s=0: no monitor, no active run
    assert not off.sampling and mlflow.active_run() is None
    off.end()
    assert not client.get_run(off.run_id).data.metrics


def test_the_data_a_stage_read_is_a_dataset_input_of_its_run(tmp_path):
    """Source (a path, or the built-in corpus's recipe), a digest of every token, the shape, and
    the context it was used in, as MLflow's dataset inputs."""
    import hashlib

    import torch

    from pipeline.config import DataConfig
    from pipeline.tracking import StageRun

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("x")).info.run_id
    stage = StageRun(client, run_id, uri)
    calib = torch.arange(24).reshape(4, 6)  # (N, T) windows
    stream = torch.arange(100)
    (tmp_path / "corpus").mkdir()
    stage.log_input(calib, "calibration", DataConfig(), "train")
    stage.log_input(stream, "training", DataConfig(path=str(tmp_path / "corpus")), "train")
    StageRun().log_input(calib, "calibration", DataConfig(), "train")  # tracking off: nothing
    inputs = client.get_run(run_id).inputs.dataset_inputs
    assert len(inputs) == 2
    by_context = {
        next(t.value for t in i.tags if t.key == "mlflow.data.context"): i.dataset for i in inputs
    }
    builtin, user = by_context["calibration"], by_context["training"]
    assert builtin.name == "builtin:train" and builtin.source_type == "code"
    assert json.loads(builtin.source)["tags"]["lowbit.corpus"] == "builtin"
    assert builtin.digest == hashlib.sha256(calib.numpy().tobytes()).hexdigest()[:12]
    assert json.loads(builtin.profile)["features_shape"] == [4, 6]  # windows x tokens
    assert user.name == "corpus:train" and user.source_type == "local"
    assert json.loads(user.source)["uri"] == str(tmp_path / "corpus")
    assert user.digest != builtin.digest


@pytest.mark.parametrize(
    "uri",
    [
        "sqlite:///runs/mlflow.db",
        "postgresql://mlflow:secret@db.example:5432/mlflow",
        "postgresql+psycopg2://db.example/mlflow",
        "mysql+pymysql://mlflow@db.example/mlflow",
        "mssql+pyodbc://db.example/mlflow",
        "http://127.0.0.1:5000",
        "https://mlflow.example",
        "databricks",
        "databricks://profile",
    ],
)
def test_every_tracking_store_mlflow_accepts_passes_the_check_without_connecting(uri):
    # No database server exists here: the check parses the URI as MLflow does, it never connects.
    TrackingConfig(uri=uri).check("tracking")


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        ("mongodb://db.example/mlflow", "MLflow has no tracking store for it; use one of"),
        ("postgres://db.example/mlflow", "postgresql://"),  # SQLAlchemy's spelling, not libpq's
        ("mysql+a+b://db.example/mlflow", "Invalid database URI"),
        ("mlruns", "MLFLOW_ALLOW_FILE_STORE=true"),
    ],
)
def test_a_tracking_uri_mlflow_would_refuse_is_one_line_naming_the_fix(uri, says, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match="`tracking.uri`") as e:
        TrackingConfig(uri=uri).check("tracking")
    assert says in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's own opt-in
    if uri == "mlruns":
        TrackingConfig(uri=uri).check("tracking")


def test_the_browse_command_of_a_database_store_hides_its_password(tmp_path):
    uri = "postgresql://mlflow:secret@db.example:5432/mlflow"
    tracker = Tracker(TrackingConfig(uri=uri, artifact_location=None), tmp_path, active=False)
    assert tracker.ui_command() == (
        "mlflow ui --backend-store-uri postgresql://mlflow:***@db.example:5432/mlflow"
    )


def test_a_run_nests_under_tracking_parent_run_id_and_a_resumed_one_moves(tmp_path, caplog):
    """A sweep's point nests its workflow run under the sweep's run; rerun in a new sweep, the
    resumed run moves under that one; a parent the store lacks is a warning, never a crash."""
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    (tmp_path / "run").mkdir()

    def start(parent):
        cfg = TrackingConfig(uri=uri, artifact_location=str(tmp_path / "art"), parent_run_id=parent)
        tracker = Tracker(cfg, tmp_path / "run", active=True)
        tracker.connect()
        return tracker.start_parent("point", {}).run_id

    run_id = start("0" * 32)
    assert "MLflow run 00000000" in caplog.text and "not nested" in caplog.text
    client = MlflowClient(uri)
    assert "mlflow.parentRunId" not in client.get_run(run_id).data.tags
    exp = client.get_experiment_by_name("lowbit").experiment_id
    for sweep in ("sweep-a", "sweep-b"):
        parent = client.create_run(exp, run_name=sweep).info.run_id
        assert start(parent) == run_id
        assert client.get_run(run_id).data.tags["mlflow.parentRunId"] == parent


def _connect_when_all_ready(cfg: TrackingConfig, run_dir, start, failed) -> None:
    start.wait()
    try:
        Tracker(cfg, run_dir, active=True).connect()
    except Exception as e:  # whatever a run would have died of
        failed.put(f"{type(e).__name__}: {e}")


def test_runs_starting_together_on_one_new_store_share_it(tmp_path):
    """A sweep's points, or two workflows, start together on a sqlite store none has created:
    one creates its tables, each finds the experiment or creates it, none fails because another
    did it first. Processes, as runs are (forked: MLflow is imported once)."""
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    cfg = TrackingConfig(uri=uri, artifact_location=str(tmp_path / "art"), experiment="together")
    fork = multiprocessing.get_context("fork")
    start, failed = fork.Barrier(4), fork.Queue()
    runs = [
        fork.Process(target=_connect_when_all_ready, args=(cfg, tmp_path / f"r{i}", start, failed))
        for i in range(4)
    ]
    for run in runs:
        run.start()
    for run in runs:
        run.join(timeout=240)
    assert [run.exitcode for run in runs] == [0] * 4
    assert failed.empty(), failed.get()
    names = [e.name for e in MlflowClient(uri).search_experiments()]
    assert names.count("together") == 1
