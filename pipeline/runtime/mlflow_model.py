"""The exported artifact as an MLflow pyfunc model: ``predict`` generates text.

``mlflow.pyfunc.load_model(uri).predict(["prompt", ...], params={"max_new_tokens": 32})``
returns one continuation per prompt, produced by lowbit's runtime (``pipeline.runtime.load``)
on the artifact that MLflow stores next to the model (hashes are verified at load, as for
``lowbit-run``). Serving needs lowbit installed in the environment (``pip install lowbit``):
the model references the runtime's code rather than copying it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlflow.pyfunc

from pipeline import __version__

log = logging.getLogger(__name__)
ARTIFACT_KEY = "artifact"
PARAMS = {"max_new_tokens": 64, "temperature": 0.0, "seed": 0, "speculative": True}


class LowbitTextModel(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: input a list of prompts (or a DataFrame with a ``prompt`` column)."""

    def load_context(self, context) -> None:
        from pipeline.runtime.loader import load

        self.runtime = load(context.artifacts[ARTIFACT_KEY], backend="auto")

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> list[str]:
        p = {**PARAMS, **(params or {})}
        prompts = _prompts(model_input)
        return [
            self.runtime.generate(
                text,
                int(p["max_new_tokens"]),
                float(p["temperature"]),
                speculative=bool(p["speculative"]),
                seed=int(p["seed"]),
            ).text
            for text in prompts
        ]


def _prompts(model_input) -> list[str]:
    if isinstance(model_input, str):
        return [model_input]
    if hasattr(model_input, "columns"):  # pandas DataFrame
        col = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        return [str(v) for v in model_input[col].tolist()]
    if isinstance(model_input, dict):
        value = model_input.get("prompt", next(iter(model_input.values())))
        return [value] if isinstance(value, str) else [str(v) for v in value]
    return [str(v) for v in model_input]


def signature():
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    params = ParamSchema(
        [
            ParamSpec("max_new_tokens", "long", PARAMS["max_new_tokens"]),
            ParamSpec("temperature", "double", PARAMS["temperature"]),
            ParamSpec("seed", "long", PARAMS["seed"]),
            ParamSpec("speculative", "boolean", PARAMS["speculative"]),
        ]
    )
    return ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec("string")]),
        params=params,
    )


def log_model(
    tracking_uri: str,
    run_id: str,
    artifact_dir: Path,
    registered_name: str | None,
    name: str = "lowbit_model",
) -> str:
    """Log ``artifact_dir`` as a pyfunc model in run ``run_id``; returns the model URI.

    Args:
        tracking_uri: MLflow tracking URI (the stage run's).
        run_id: The run to log into (the export stage's child run).
        artifact_dir: The exported artifact.
        registered_name: Register it under this name in the model registry (None: don't).
        name: The model's name inside the run.
    """
    import torch
    from mlflow.tracking import MlflowClient

    reqs = [
        f"lowbit=={_version()}",
        f"torch>={torch.__version__.split('+')[0]}",
        "transformers",
        "safetensors",
        "tokenizers",
        f"mlflow=={mlflow.__version__}",
    ]
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracking_uri)
    try:
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pyfunc.log_model(
                name=name,
                python_model=LowbitTextModel(),
                artifacts={ARTIFACT_KEY: str(artifact_dir)},
                signature=signature(),
                pip_requirements=reqs,
                registered_model_name=registered_name,
                await_registration_for=0,
            )
        # Leaving the fluent run marks it finished; the workflow ends the stage run itself.
        MlflowClient(tracking_uri).update_run(run_id, status="RUNNING")
    finally:
        mlflow.set_tracking_uri(previous)
    registered = ""
    if registered_name:  # the URI a user loads: name and version, not the logged model's id
        registered = f"; registered as models:/{registered_name}/{info.registered_model_version}"
    log.info("export: logged the artifact as MLflow model %s%s", info.model_uri, registered)
    return info.model_uri


def _version() -> str:
    return __version__
