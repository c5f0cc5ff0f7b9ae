"""What every export writer shares: the options, float casting, and the copied model files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.io import write_json

FORMATS = ("ascend", "lowbit", "compressed-tensors")
FLOAT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Weights are rewritten by the exporter, and these describe the source's quantization.
_SKIP = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
_SKIP_NAMES = {"lowbit_quant.json", "quant_model_description.json", "manifest.json"}


@dataclass(frozen=True)
class ExportOptions:
    """How to pack: ``stage.export.*`` minus the draft and MLflow (defaults live there)."""

    format: str
    widen: bool
    shard_bytes: int
    float_dtype: str
    w8a8_dynamic: bool
    # {layer: LayerInfo activation fields}: the float channels (or float input) of each layer
    # for runtimes with int8 activations (SensitivityReport.activation_plan); None: none.
    act: Mapping[str, Mapping[str, Any]] | None = None


def cast_float(t: torch.Tensor, float_dtype: str) -> torch.Tensor:
    if float_dtype == "keep" or not t.is_floating_point():
        return t
    return t.to(FLOAT_DTYPES[float_dtype])


def copy_model_files(src: Path, dst: Path, float_dtype: str) -> dict:
    """Copy config, tokenizer and template files (not weights); returns the written config."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.iterdir()):
        if p.is_file() and not p.name.endswith(_SKIP) and p.name not in _SKIP_NAMES:
            shutil.copy2(p, dst / p.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if float_dtype != "keep":
        key = "torch_dtype" if "torch_dtype" in config else "dtype"
        config[key] = float_dtype
    write_json(dst / "config.json", config, indent=2)
    return config
