"""Artifact bookkeeping: sharded safetensors writing, manifest.json, and its verification.

Every artifact directory carries `manifest.json`: what lowbit wrote (tensors with dtype, shape,
file, type, format, bits), the sha256 and size of every file, and the lowbit version. Loading
recomputes the hashes first, so a truncated download, a flipped byte or a swapped file is
refused with the file's name, before any tensor is read. Paths in the manifest are relative
POSIX paths inside the artifact; anything else (`..`, absolute paths) is refused, so a crafted
manifest cannot make the loader read or trust files outside the directory.

Weights are written in shards as HF does (`<stem>-0000i-of-0000N.safetensors` plus
`<index_name>` = {"metadata": {"total_size"}, "weight_map"}); tensors are streamed into the
current shard and flushed when it is full, so peak memory is about one shard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath

import torch
from safetensors.torch import save_file

from pipeline import __version__
from pipeline.errors import LowbitError
from pipeline.rundir import sha256

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


class ArtifactError(LowbitError):
    """An artifact that is incomplete, tampered with, or not a lowbit artifact."""


class ShardWriter:
    """Streams named tensors into safetensors shards of at most ``shard_bytes`` each.

    Args:
        out_dir: The artifact directory.
        stem: File stem, e.g. ``"quant_model_weights"`` or ``"model"``.
        shard_bytes: Start a new shard when the current one would grow past this size
            (a single tensor larger than it gets a shard of its own).
    """

    def __init__(self, out_dir: Path, stem: str, shard_bytes: int):
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be > 0, got {shard_bytes}")
        self.out_dir, self.stem, self.shard_bytes = Path(out_dir), stem, shard_bytes
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._parts: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0
        self.tensors: dict[str, dict] = {}  # name -> {"dtype", "shape", "file"}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.tensors:
            raise ValueError(f"tensor {name!r} written twice")
        t = tensor.detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
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
                else (f"{self.stem}-{i + 1:05d}-of-{n:05d}.safetensors")
            )
            os.replace(tmp, self.out_dir / name)
            weight_map.update(dict.fromkeys(names, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.out_dir / f"{self.stem}.safetensors.index.json").write_text(
                json.dumps(index, indent=1)
            )
        return weight_map


def safe_relpath(root: Path, rel: str) -> Path:
    """``root / rel`` for a relative POSIX path that stays inside ``root``; else ArtifactError."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel or rel.startswith("~"):
        raise ArtifactError(
            f"manifest entry {rel!r} points outside the artifact {root}; refusing to load it. "
            "Re-export the model with `lowbit stages=[export]`."
        )
    return root / Path(*p.parts)


def write_manifest(root: Path, info: dict) -> dict:
    """Hash every file under ``root`` (except the manifest) and write manifest.json.

    Args:
        root: The artifact directory, complete except for the manifest.
        info: What the artifact holds: format, tensors, layers, source, draft, ...

    Returns:
        The manifest written.
    """
    files = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel != MANIFEST:
            files[rel] = {"bytes": p.stat().st_size, "sha256": sha256(p)}
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "lowbit_version": __version__,
        **info,
        "files": files,
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def read_manifest(root: Path) -> dict:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise ArtifactError(
            f"{root} is not a lowbit artifact: {MANIFEST} is missing. Export one with "
            "`lowbit stages=[...,export]` (it lands in <run_dir>/export/artifact)."
        )
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); re-export the artifact") from None
    if not isinstance(manifest.get("files"), dict):
        raise ArtifactError(f"{path} has no `files` table; re-export the artifact")
    return manifest


def verify(root: Path, manifest: dict | None = None) -> dict:
    """Check every file listed in the manifest: inside ``root``, present, same size and sha256.

    Returns:
        The manifest.

    Raises:
        ArtifactError: naming the first file that is missing, outside, or differs.
    """
    root = Path(root)
    manifest = manifest or read_manifest(root)
    for rel, entry in manifest["files"].items():
        path = safe_relpath(root, rel)
        if path.is_symlink() or not path.resolve().is_relative_to(root.resolve()):
            raise ArtifactError(
                f"artifact file {rel} is a link or resolves outside {root}; refusing to load it"
            )
        if not path.is_file():
            raise ArtifactError(
                f"artifact file {rel} is missing from {root}; copy the whole "
                "artifact directory again"
            )
        if path.stat().st_size != entry.get("bytes") or sha256(path) != entry.get("sha256"):
            raise ArtifactError(
                f"artifact file {rel} in {root} does not match its sha256 in {MANIFEST} "
                "(corrupt or modified); copy or export the artifact again"
            )
    return manifest
