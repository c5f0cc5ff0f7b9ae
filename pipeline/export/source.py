"""Lazy reading of what export packs: a quantized model directory or an FP HF checkpoint.

Tensors stream from the memory-mapped safetensors one by one (quantized linears as QTensors)
into the writers' shards, so peak memory is one linear plus one shard, whatever the model size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from pipeline.errors import LowbitError
from pipeline.quant.formats import Format
from pipeline.quant.qtensor import STATE_FIELDS, QTensor

INDEX = "model.safetensors.index.json"


@dataclass
class Linear:
    """A quantized linear ``name`` with its QTensor and optional float bias."""

    name: str
    qt: QTensor
    bias: torch.Tensor | None = None


@dataclass
class Source:
    """A model directory to export: ``layers`` maps quantized linears to format names (empty
    and ``method`` "fp" for an FP checkpoint), ``weight_map`` tensors to files."""

    path: Path
    layers: dict[str, str] = field(default_factory=dict)
    method: str = "fp"
    weight_map: dict[str, str] = field(default_factory=dict)
    formats: dict[str, Format] = field(default_factory=dict)  # ``layers`` parsed
    # Where tensors are read to and packed: the stage's device (the writer copies them back).
    device: torch.device | str = "cpu"

    @classmethod
    def open(cls, path: Path | str, device: torch.device | str = "cpu") -> Source:
        """Read the metadata of a quantized model dir (lowbit_quant.json) or an FP checkpoint."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise LowbitError(f"{path} is not a model directory: config.json is missing")
        layers, method, formats = {}, "fp", {}
        if (path / "lowbit_quant.json").is_file():
            from pipeline.models.hf_quantizer import LowbitConfig
            from pipeline.models.quantized import read_quant_meta

            meta = read_quant_meta(path)
            layers, method = dict(meta["layers"]), meta.get("method", "unknown")
            formats = LowbitConfig(**meta).formats
        return cls(path, layers, method, _weight_map(path), formats, device)

    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of a stored tensor, from the safetensors header (no data read)."""
        with safe_open(str(self.path / self.weight_map[key]), framework="pt") as h:
            return tuple(h.get_slice(key).get_shape())

    def items(self) -> Iterator[Linear | tuple[str, torch.Tensor]]:
        """Every quantized linear (``Linear``) and other tensor (``(name, tensor)``), in file
        order so reads stay sequential."""
        handles: dict[str, object] = {}

        def get(key: str) -> torch.Tensor:
            file = self.weight_map[key]
            if file not in handles:
                handles[file] = safe_open(str(self.path / file), framework="pt")
            return handles[file].get_tensor(key).to(self.device)

        owner = {}
        for name in self.layers:
            for f in STATE_FIELDS:
                owner[f"{name}.{f}"] = name
            owner[f"{name}.bias"] = name
        missing = [n for n in self.layers if f"{n}.codes" not in self.weight_map]
        if missing:
            raise LowbitError(
                f"{self.path}: lowbit_quant.json lists {missing[:3]} but the "
                "weights lack their codes; re-run the quantize stage"
            )
        done = set()
        for key in self.weight_map:
            name = owner.get(key)
            if name is None:
                yield key, get(key)
                continue
            if name in done:
                continue
            done.add(name)
            sd = {
                f"{name}.{f}": get(f"{name}.{f}")
                for f in STATE_FIELDS
                if f"{name}.{f}" in self.weight_map
            }
            qt = QTensor.from_state_dict(sd, name)
            if qt.fmt.name != self.layers[name]:
                raise LowbitError(
                    f"{self.path}: {name} is stored as {qt.fmt.name} but "
                    f"lowbit_quant.json lists {self.layers[name]}"
                )
            bias_key = f"{name}.bias"
            yield Linear(name, qt, get(bias_key) if bias_key in self.weight_map else None)


def _weight_map(path: Path) -> dict[str, str]:
    if (path / INDEX).is_file():
        wm = json.loads((path / INDEX).read_text())["weight_map"]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise LowbitError(f"{path} has no *.safetensors weights")
        wm = {}
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                wm.update(dict.fromkeys(h.keys(), f.name))
    # File order, then the order inside each file, keeps reads sequential.
    files = list(dict.fromkeys(wm.values()))
    return dict(sorted(wm.items(), key=lambda kv: (files.index(kv[1]), kv[0])))
