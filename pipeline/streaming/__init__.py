"""Walking a checkpoint one segment of decoder blocks at a time (memory independent of depth)."""

from pipeline.streaming.actcache import ActivationCache
from pipeline.streaming.engine import (
    Batches,
    BlockSource,
    BlockStep,
    BlockWalk,
    StreamOptions,
    StreamResult,
)
from pipeline.streaming.quantize import quant_options, quantize_checkpoint
from pipeline.streaming.workdir import Scratch, WorkDir

__all__ = [
    "ActivationCache",
    "Batches",
    "BlockSource",
    "BlockStep",
    "BlockWalk",
    "Scratch",
    "StreamOptions",
    "StreamResult",
    "WorkDir",
    "quant_options",
    "quantize_checkpoint",
]
