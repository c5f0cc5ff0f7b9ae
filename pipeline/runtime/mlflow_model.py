"""The exported artifact as an MLflow pyfunc model: ``predict`` generates text.

``mlflow.pyfunc.load_model(uri).predict(["prompt", ...], params={"max_new_tokens": 32})``
returns one continuation per prompt from lowbit's runtime; ``PARAMS`` are
``Runtime.generate``'s. Logged from code (``mlflow_entry.py``) with a copy of ``pipeline`` and
pinned requirements, so serving needs no lowbit release on an index. The weights are the model's
own artifact, or, for a large one, a reference to the run's logged artifact (``runs:/...``), read
when the model loads, so the store holds them once.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
from pathlib import Path
from typing import Any

import mlflow.pyfunc

import pipeline

log = logging.getLogger(__name__)
ARTIFACT_KEY = "artifact"
REFERENCE_KEY = "artifact_uri"  # model_config key: the run artifact a single-copy model reads
# MLflow infers the parameter schema from these defaults, so each "off" value has its type.
PARAMS = {
    "max_new_tokens": 64,
    "temperature": 0.0,
    "seed": 0,
    "speculative": True,
    "top_p": 1.0,
    "top_k": 0,
    "stop": "",
    "chat": False,
}
MODEL_FILE = Path(__file__).with_name("mlflow_entry.py")
# What the runtime imports (numpy for MLflow's conversion), pinned as logged.
RUNTIME_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "mlflow")


class LowbitTextModel(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: a list of prompts in, one generated continuation per prompt out."""

    def load_context(self, context) -> None:
        import mlflow.artifacts

        from pipeline.runtime.loader import load

        uri = (context.model_config or {}).get(REFERENCE_KEY)
        if uri is None:
            path = context.artifacts[ARTIFACT_KEY]
        else:  # a local store hands back its own directory; a remote one downloads
            path = mlflow.artifacts.download_artifacts(artifact_uri=uri)
        self.runtime = load(path, backend="auto")

    def predict(
        self, context, model_input: list[str], params: dict[str, Any] | None = None
    ) -> list[str]:
        p = {**PARAMS, **(params or {})}
        prompts = _prompts(model_input)
        return [
            self.runtime.generate(
                text,
                int(p["max_new_tokens"]),
                float(p["temperature"]),
                speculative=bool(p["speculative"]),
                seed=int(p["seed"]),
                top_p=float(p["top_p"]) if float(p["top_p"]) < 1 else None,
                top_k=int(p["top_k"]) or None,
                stop=[str(p["stop"])] if p["stop"] else [],
                chat=bool(p["chat"]),
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


def requirements() -> list[str]:
    """``name==version`` of each runtime package, local build tag dropped (no index serves it)."""
    return [
        f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in RUNTIME_PACKAGES
    ]


def log_model(
    tracking_uri: str,
    run_id: str,
    artifact_dir: Path,
    registered_name: str | None,
    name: str = "lowbit_model",
    logged_as: str | None = None,
    single_copy_bytes: int | None = None,
) -> str:
    """Log ``artifact_dir`` as a pyfunc model in run ``run_id`` (the export stage's child run),
    registered as ``registered_name`` unless None; returns the model URI. ``logged_as``: where
    the run already holds ``artifact_dir``; when it is larger than ``single_copy_bytes`` the model
    references that copy instead of holding its own.
    """
    from mlflow.environment_variables import MLFLOW_TRACKING_URI

    size = sum(p.stat().st_size for p in Path(artifact_dir).rglob("*") if p.is_file())
    if logged_as is not None and single_copy_bytes is not None and size > single_copy_bytes:
        weights = {"model_config": {REFERENCE_KEY: f"runs:/{run_id}/{logged_as}"}}
    else:
        weights = {"artifacts": {ARTIFACT_KEY: str(artifact_dir)}}

    # set_tracking_uri exports MLFLOW_TRACKING_URI: put back what was there (None: unset)
    previous = os.environ.get(MLFLOW_TRACKING_URI.name)
    mlflow.set_tracking_uri(tracking_uri)
    try:
        with _active(run_id, tracking_uri):
            info = mlflow.pyfunc.log_model(
                name=name,
                python_model=str(MODEL_FILE),
                **weights,
                code_paths=[str(Path(pipeline.__file__).parent)],
                # The input and parameter schemas; MLflow runs the model on it once.
                input_example=(["The quick brown fox"], dict(PARAMS)),
                pip_requirements=requirements(),
                registered_model_name=registered_name,
                await_registration_for=0,
            )
    finally:
        mlflow.set_tracking_uri(previous)
    registered = ""
    if registered_name:  # the URI a user loads: name and version, not the logged model's id
        registered = f"; registered as models:/{registered_name}/{info.registered_model_version}"
    log.info("export: logged the artifact as MLflow model %s%s", info.model_uri, registered)
    return info.model_uri


@contextlib.contextmanager
def _active(run_id: str, tracking_uri: str):
    """``run_id`` as the active fluent run while the model is logged; left open for the
    workflow to end (it may already be active: a stage run sampling system metrics)."""
    active = mlflow.active_run()
    if active is not None and active.info.run_id == run_id:
        yield
        return
    from mlflow.tracking import MlflowClient

    with mlflow.start_run(run_id=run_id, nested=active is not None, log_system_metrics=False):
        yield
    # Leaving the fluent run marks it finished; the workflow ends the stage run itself.
    MlflowClient(tracking_uri).update_run(run_id, status="RUNNING")
