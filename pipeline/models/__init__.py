"""HF checkpoint loading: layer streaming from safetensors shards and architecture adapters.

Random-weight checkpoints for tests and benchmarks are in ``pipeline.models.synthetic``, which
this package does not import (production code never needs it). Neither does it import
``pipeline.models.hf_quantizer`` (it pulls in transformers, seconds of import): lowbit's loaders
register it when they load, and ``import pipeline.models.hf_quantizer`` lets plain
``AutoModelForCausalLM.from_pretrained`` read lowbit quantized directories.
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
