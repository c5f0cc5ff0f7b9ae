"""Export: pack quantized models into deployable artifacts (ascendv1, lowbit, compressed-tensors);
the layouts and manifest.json are ``pipeline.artifact``, which the runtime reads too."""

from pipeline.artifact.ascend import ExportError
from pipeline.artifact.manifest import ArtifactError
from pipeline.export.artifact import export_artifact
from pipeline.export.options import ExportOptions

__all__ = ["ArtifactError", "ExportError", "ExportOptions", "export_artifact"]
