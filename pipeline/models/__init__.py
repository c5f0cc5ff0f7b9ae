"""HF checkpoint loading: layer streaming from safetensors shards and architecture adapters."""

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
from pipeline.models.synthetic import ShardWriter, synthetic_config, write_synthetic_checkpoint

__all__ = [
    "ADAPTERS",
    "Adapter",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ShardWriter",
    "StreamingCheckpoint",
    "UnsupportedArchitectureError",
    "attention_kind",
    "convert_bin_to_safetensors",
    "fused_groups",
    "get_adapter",
    "linear_names",
    "read_safetensors_header",
    "supported",
    "synthetic_config",
    "write_synthetic_checkpoint",
]
