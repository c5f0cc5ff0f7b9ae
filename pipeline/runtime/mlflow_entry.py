"""The model file MLflow runs to rebuild the pyfunc model ("models from code"; nothing pickled)."""

import mlflow.models

from pipeline.runtime.mlflow_model import LowbitTextModel

mlflow.models.set_model(LowbitTextModel())
