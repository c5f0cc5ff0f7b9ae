"""Export: pack quantized models into deployable artifacts (ascendv1, lowbit, compressed-tensors).

``export_artifact(src, out, ExportOptions(format=...), draft=None)`` is the entry point; the
layouts are documented in ``ascend`` (msModelSlim ascendv1), ``lowbit_format`` (its 2/3-bit and
exponential extensions) and ``compressed_tensors`` (vLLM), the bookkeeping in ``manifest``.
"""

from pipeline.export.artifact import ExportOptions, export_artifact
from pipeline.export.ascend import ExportError
from pipeline.export.manifest import ArtifactError

__all__ = ["ArtifactError", "ExportError", "ExportOptions", "export_artifact"]
