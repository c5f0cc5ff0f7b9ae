"""lowbit's runtime: load exported artifacts and generate (torch reference or torch_npu)."""

from pipeline.runtime.loader import Generation, Runtime, load

__all__ = ["Generation", "Runtime", "load"]
