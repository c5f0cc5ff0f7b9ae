"""Files written once and trusted later: sha256 digests, atomic JSON, sharded safetensors.

The lowest layer next to ``errors`` (imports nothing from ``pipeline``). Shards follow HF:
``<stem>-0000i-of-0000N.safetensors`` plus ``<stem>.safetensors.index.json`` = {"metadata":
{"total_size"}, "weight_map"}, or one ``<stem>.safetensors``; peak memory is about one shard.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def sha256(path: Path) -> str:
    """Hex sha256 of a file's contents, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: Path, obj: Any, *, indent: int | None = None) -> None:
    """Write ``obj`` as JSON to ``path`` via a per-pid temporary name: readers see the old file
    or the new one, never half of one, and ranks writing the same file do not collide."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=indent))
    os.replace(tmp, path)


class ShardWriter:
    """Streams named tensors into safetensors shards of at most ``shard_bytes`` each (a larger
    tensor gets a shard of its own), named after ``stem``."""

    def __init__(self, out_dir: str | Path, stem: str, shard_bytes: int):
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be > 0, got {shard_bytes}")
        self.out_dir, self.stem, self.shard_bytes = Path(out_dir), stem, shard_bytes
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._parts: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0
        self.tensors: dict[str, dict] = {}  # name -> {"dtype", "shape"}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.tensors:
            raise ValueError(f"tensor {name!r} written twice")
        t = tensor.detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        # A view (or a tied weight) shares storage, which safetensors refuses.
        if t.untyped_storage().nbytes() != nbytes:
            t = t.clone()
        if self._buf and self._buf_bytes + nbytes > self.shard_bytes:
            self._flush()
        self._buf[name] = t
        self.tensors[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        self._buf_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        path = self.out_dir / f".{self.stem}.part{len(self._parts):05d}.safetensors"
        # One metadata key only: safetensors writes a larger map in random order, and the same
        # tensors must give the same bytes (stage digests, artifact hashes).
        save_file(self._buf, str(path), metadata={"format": "pt"})
        self._parts.append((path, list(self._buf)))
        self._buf, self._buf_bytes = {}, 0

    def close(self) -> dict[str, str]:
        """Write the last shard, name the shards, write the index; returns {tensor: file}."""
        if self._buf or not self._parts:
            self._flush()
        n = len(self._parts)
        weight_map: dict[str, str] = {}
        for i, (tmp, names) in enumerate(self._parts):
            name = (
                f"{self.stem}.safetensors"
                if n == 1
                else f"{self.stem}-{i + 1:05d}-of-{n:05d}.safetensors"
            )
            os.replace(tmp, self.out_dir / name)
            weight_map.update(dict.fromkeys(names, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            write_json(self.out_dir / f"{self.stem}.safetensors.index.json", index, indent=1)
        return weight_map
