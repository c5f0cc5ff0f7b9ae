"""Export: pack quantized models into deployable artifacts (ascendv1, lowbit, compressed-tensors).

``export_artifact(src, out, ExportOptions(...), draft=None)`` is the entry point; the writers
are ``ascendv1`` (the ascend and lowbit layouts) and ``compressed_tensors`` (vLLM). The layouts
themselves, and manifest.json, are the artifact format in ``pipeline.artifact``, which the
runtime reads too.
"""

from pipeline.artifact.ascend import ExportError
from pipeline.artifact.manifest import ArtifactError
from pipeline.export.artifact import export_artifact
from pipeline.export.options import ExportOptions

__all__ = ["ArtifactError", "ExportError", "ExportOptions", "export_artifact"]
