"""QTensor files: many quantized weights in one safetensors file, keys ``{name}.<field>``."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from pipeline.quant.qtensor import QTensor

# A quantized model directory's layout version (lowbit_quant.json, and config.json's
# quantization_config, whose quant_method makes transformers pick pipeline.models.hf_quantizer).
FORMAT_VERSION = 1
QUANT_METHOD = "lowbit"


def save_qtensors(path: str | Path, tensors: dict[str, QTensor]) -> None:
    """Write ``{name: QTensor}`` to one safetensors file (keys ``{name}.<field>``)."""
    flat: dict[str, Tensor] = {}
    for name, qt in tensors.items():
        flat.update({k: v.cpu() for k, v in qt.to_state_dict(name).items()})
    save_file(flat, str(path), metadata={"content": "lowbit.qtensor"})


def load_qtensors(path: str | Path) -> dict[str, QTensor]:
    """Read a file written by ``save_qtensors``."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"quantized weights file not found: {path}")
    flat = load_file(str(path))
    names = sorted(
        k[: -len(".format")] if k != "format" else ""
        for k in flat
        if k == "format" or k.endswith(".format")
    )
    return {name: QTensor.from_state_dict(flat, name) for name in names}
