"""Model + data analysis for quantization: curvature estimators, predicted loss increases,
activation outlier statistics and layer shapes. Pure tensor math lives in `pipeline.quant`."""

from pipeline.analysis.capture import Capture, InputStats, outlier_summary
from pipeline.analysis.estimators import (
    fisher_diagonal,
    forward_pass,
    hutchinson_trace,
    sequence_loss,
)
from pipeline.analysis.scores import (
    embedding_weigh,
    fisher_weigh,
    hessian_weigh,
    layer_dloss,
    quant_error,
    trace_weigh,
)
from pipeline.analysis.shapes import (
    LayerShapes,
    shapes_from_dir,
    shapes_from_hf_config,
    shapes_from_spec,
)

__all__ = [
    "Capture",
    "InputStats",
    "LayerShapes",
    "embedding_weigh",
    "fisher_diagonal",
    "fisher_weigh",
    "forward_pass",
    "hessian_weigh",
    "hutchinson_trace",
    "layer_dloss",
    "outlier_summary",
    "quant_error",
    "sequence_loss",
    "shapes_from_dir",
    "shapes_from_hf_config",
    "shapes_from_spec",
    "trace_weigh",
]
