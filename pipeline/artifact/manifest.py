"""manifest.json: what an artifact holds, the sha256 of every file, and its verification.

Every artifact directory carries `manifest.json`: what lowbit wrote (tensors with dtype, shape,
file, type, format, bits), the sha256 and size of every file, and the lowbit version. Loading
recomputes the hashes first, so a truncated download, a flipped byte or a swapped file is
refused with the file's name, before any tensor is read. Paths in the manifest are relative
POSIX paths inside the artifact; anything else (`..`, absolute paths) is refused, so a crafted
manifest cannot make the loader read or trust files outside the directory.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from pipeline import __version__
from pipeline.errors import LowbitError
from pipeline.io import sha256, write_json

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


class ArtifactError(LowbitError):
    """An artifact that is incomplete, tampered with, or not a lowbit artifact."""


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
    write_json(root / MANIFEST, manifest, indent=1)
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
