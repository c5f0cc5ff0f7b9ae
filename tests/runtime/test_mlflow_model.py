"""The artifact as an MLflow pyfunc model: log, register, load, predict."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.export import export_artifact
from tests.export.models import export_options


@pytest.fixture(params=["sqlite", "server"])
def tracking(request, tmp_path, monkeypatch):
    """A local store, and the real `mlflow server` (REST: registry, aliases, artifacts)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    if request.param == "server":
        uri = request.getfixturevalue("mlflow_server")
    else:
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri)
    exp = client.create_experiment(
        f"t-{tmp_path.name}", artifact_location=(tmp_path / "arts").as_uri()
    )
    run = client.create_run(exp)
    yield uri, client, run.info.run_id
    mlflow.set_tracking_uri(None)


def test_log_register_load_predict(qmodels, tmp_path, tracking, caplog, recwarn):
    import importlib
    import logging

    import mlflow
    import pandas as pd

    from pipeline.runtime import load, mlflow_model

    # MLflow checks predict's type hints when the class is defined: define it again under
    # recwarn, whatever test imported the module first.
    log_model = importlib.reload(mlflow_model).log_model
    uri, client, run_id = tracking
    art = tmp_path / "artifact"
    export_artifact(qmodels.get("int4g128"), art, export_options(), draft=qmodels.fp)
    with caplog.at_level(logging.INFO, logger="pipeline.runtime.mlflow_model"):
        model_uri = log_model(uri, run_id, art, registered_name="tiny-lowbit")
    # MLflow warns when predict lacks type hints or cannot use them for the schema.
    hints = [str(w.message) for w in recwarn if "type hint" in str(w.message).lower()]
    assert not hints, hints
    assert "registered as models:/tiny-lowbit/1" in caplog.text  # the URI to load it by
    assert client.get_run(run_id).info.status == "RUNNING"  # the stage's run stays open
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model("models:/tiny-lowbit/1")
    got = model.predict(["the quick", "a dog"], params={"max_new_tokens": 5})
    expected = load(art, "torch").generate("the quick", 5).text
    assert len(got) == 2 and got[0] == expected
    same = mlflow.pyfunc.load_model(model_uri).predict(
        pd.DataFrame({"prompt": ["the quick"]}), params={"max_new_tokens": 5}
    )
    assert same == [expected]

    # transformers' generate options: top-k 1 sampling is greedy; a stop string cuts the text
    rt = load(art, "torch")
    greedy = rt.generate("the quick", 8).text
    sampled = model.predict(
        ["the quick"], params={"max_new_tokens": 8, "temperature": 1.0, "top_k": 1, "seed": 5}
    )
    assert sampled == [greedy]
    stop = greedy[3:5]
    stopped = model.predict(["the quick"], params={"max_new_tokens": 8, "stop": stop})
    assert stopped == [greedy[: greedy.index(stop) + 2]] and len(stopped[0]) < len(greedy)
    params = {p.name: p.default for p in mlflow.models.Model.load(model_uri).signature.params}
    assert params["top_p"] == 1.0 and params["top_k"] == 0 and params["chat"] is False

    # Logged from code with lowbit's package beside it: no pickle, no release to install.
    local = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(tmp_path / "dl")))
    assert (local / "code" / "pipeline" / "runtime" / "loader.py").is_file()
    assert not list(local.glob("*.pkl"))
    reqs = (local / "requirements.txt").read_text().split()
    assert not [r for r in reqs if r.startswith("lowbit")]
    assert {r.split("==")[0] for r in reqs} >= {"torch", "transformers", "mlflow"}
    assert all("==" in r and "+" not in r for r in reqs if not r.startswith("-"))
    flavor = mlflow.models.Model.load(local).flavors["python_function"]
    assert flavor.get("model_code_path", "").endswith("mlflow_entry.py")


@pytest.mark.slow  # logs, registers, loads and generates: as the test above
def test_a_large_artifact_is_stored_once_and_the_model_reads_the_run_copy(qmodels, tmp_path):
    """Above single_copy_bytes (tiny here) the logged model references the run's artifact/
    instead of copying it; logged inside a stage run that samples system metrics (the run is
    already active), which stays open for the workflow to end."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from pipeline.runtime import load
    from pipeline.runtime.mlflow_model import log_model
    from pipeline.tracking import StageRun

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "arts").as_uri())
    stage = StageRun(client, client.create_run(exp).info.run_id, uri)
    art = tmp_path / "artifact"
    export_artifact(qmodels.get("int4g128"), art, export_options())
    stage.monitor_system(60.0)
    try:
        stage.log_artifact(art)
        log_model(uri, stage.run_id, art, "big", logged_as="artifact", single_copy_bytes=1000)
        assert client.get_run(stage.run_id).info.status == "RUNNING"
    finally:
        stage.end()
    weights = "quant_model_weights*.safetensors"
    shards = sorted(p.name for p in art.glob(weights))
    assert shards and sorted(p.name for p in (tmp_path / "arts").rglob(weights)) == shards
    mlflow.set_tracking_uri(uri)
    try:
        got = mlflow.pyfunc.load_model("models:/big/1").predict(
            ["the quick"], params={"max_new_tokens": 5}
        )
    finally:
        mlflow.set_tracking_uri(None)
    assert got == [load(art, "torch").generate("the quick", 5).text]
    assert client.get_run(stage.run_id).info.status == "FINISHED"
