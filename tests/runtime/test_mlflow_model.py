"""The artifact as an MLflow pyfunc model: log, register, load, predict."""

from __future__ import annotations

import pytest

from pipeline.export import export_artifact
from tests.export.models import export_options


@pytest.fixture
def tracking(tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "arts").as_uri())
    run = client.create_run(exp)
    yield uri, client, run.info.run_id
    mlflow.set_tracking_uri(None)


def test_log_register_load_predict(qmodels, tmp_path, tracking, caplog):
    import logging

    import mlflow
    import pandas as pd

    from pipeline.runtime import load
    from pipeline.runtime.mlflow_model import log_model

    uri, client, run_id = tracking
    art = tmp_path / "artifact"
    export_artifact(qmodels.get("int4g128"), art, export_options(), draft=qmodels.fp)
    with caplog.at_level(logging.INFO, logger="pipeline.runtime.mlflow_model"):
        model_uri = log_model(uri, run_id, art, registered_name="tiny-lowbit")
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
