"""HF checkpoint loading: layer streaming from safetensors shards and architecture adapters.

Not imported here: ``synthetic`` (tests and benchmarks only) and ``hf_quantizer`` (pulls in
transformers; importing it lets plain ``from_pretrained`` read lowbit quantized directories).
"""

from pipeline.models.adapters import (
    ADAPTERS,
    Adapter,
    UnsupportedArchitectureError,
    attention_kind,
    fused_groups,
    get_adapter,
    linear_names,
    supported,
)
from pipeline.models.checkpoint import StreamingCheckpoint
from pipeline.models.shards import (
    CheckpointError,
    CheckpointNotFoundError,
    convert_bin_to_safetensors,
    read_safetensors_header,
)

__all__ = [
    "ADAPTERS",
    "Adapter",
    "CheckpointError",
    "CheckpointNotFoundError",
    "StreamingCheckpoint",
    "UnsupportedArchitectureError",
    "attention_kind",
    "convert_bin_to_safetensors",
    "fused_groups",
    "get_adapter",
    "linear_names",
    "read_safetensors_header",
    "supported",
]
