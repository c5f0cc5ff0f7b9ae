"""manifest.json: what an artifact holds, the sha256 of every file, and its verification.

Hashes are checked before any tensor is read; paths must stay inside the artifact directory.
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
    """Hash every file under the complete artifact ``root`` and write manifest.json + ``info``."""
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


def verify(root: Path, manifest: dict | None = None, links_within: Path | None = None) -> dict:
    """The manifest, once every listed file is inside ``root`` with its size and sha256; with
    ``links_within``, a file may be a link that resolves inside that folder (a hub snapshot's
    links to its repo's blobs)."""
    root = Path(root)
    manifest = manifest or read_manifest(root)
    inside = Path(links_within or root).resolve()
    for rel, entry in manifest["files"].items():
        path = safe_relpath(root, rel)
        linked = path.is_symlink() and links_within is None
        if linked or not path.resolve().is_relative_to(inside):
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
