"""The model file MLflow runs to rebuild the pyfunc model (MLflow's "models from code").

``pipeline.runtime.mlflow_model.log_model`` logs this file's path as ``python_model``; MLflow
copies it into the model and executes it at load, next to the copy of the ``pipeline``
package it also stores (``code_paths``). Nothing is pickled, so a model logged with one
Python or torch version loads under another. Not meant to be imported.
"""

import mlflow.models

from pipeline.runtime.mlflow_model import LowbitTextModel

mlflow.models.set_model(LowbitTextModel())
