"""Walking a checkpoint one segment of decoder blocks at a time (memory independent of depth).

:mod:`~pipeline.streaming.engine` walks embed -> segments -> head and calls a per-block step;
:mod:`~pipeline.streaming.actcache` holds the activations between segments (in memory or
spilled to disk); :mod:`~pipeline.streaming.workdir` commits finished segments for resume;
:mod:`~pipeline.streaming.quantize` is the quantize stage's step (the streamed sensitivity's is
:mod:`pipeline.analysis.streamed`).
"""

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
