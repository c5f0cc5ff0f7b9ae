"""manifest.json: contents, and refusal of corrupt, tampered or escaping artifacts."""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.artifact.manifest import verify
from pipeline.export import ArtifactError, export_artifact
from pipeline.runtime import load
from tests.export.models import export_options


@pytest.fixture(scope="module")
def artifact(qmodels, tmp_path_factory):
    art = tmp_path_factory.mktemp("man") / "artifact"
    export_artifact(
        qmodels.get("int4g128"), art, export_options(shard_bytes=300_000), draft=qmodels.fp
    )
    return art


@pytest.fixture
def copy(artifact, tmp_path):
    dst = tmp_path / "artifact"
    shutil.copytree(artifact, dst)
    return dst


def test_manifest_contents(artifact):
    m = json.loads((artifact / "manifest.json").read_text())
    on_disk = {p.relative_to(artifact).as_posix() for p in artifact.rglob("*") if p.is_file()}
    assert set(m["files"]) == on_disk - {"manifest.json"}
    assert any(f.startswith("draft/") for f in m["files"]) and m["draft"]["path"] == "draft"
    assert m["lowbit_version"] and m["format"] == "lowbit"
    for info in m["files"].values():
        assert len(info["sha256"]) == 64 and info["bytes"] > 0
    t = m["tensors"]["model.layers.0.mlp.down_proj.weight"]
    assert t["dtype"] == "int8" and t["type"] == "W4A16" and t["file"] in m["files"]
    layer = m["layers"]["model.layers.0.mlp.down_proj"]
    assert layer["format"] == "int4g128" and layer["bits"] == 4 and layer["group_size"] == 128
    assert len([f for f in m["files"] if f.startswith("quant_model_weights-")]) > 1


def test_flipped_byte_in_a_shard_is_refused(copy):
    shard = sorted(copy.glob("quant_model_weights-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=shard.name):
        load(copy, "torch")


def test_tampered_draft_is_refused(copy):
    cfg = copy / "draft" / "config.json"
    cfg.write_text(cfg.read_text().replace("silu", "gelu"))
    with pytest.raises(ArtifactError, match="draft/config.json"):
        verify(copy)


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "a/../../x"])
def test_paths_outside_the_artifact_are_refused(copy, bad):
    m = json.loads((copy / "manifest.json").read_text())
    m["files"][bad] = {"bytes": 1, "sha256": "0" * 64}
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="outside the artifact"):
        load(copy, "torch", verify_hashes=False)


def test_symlink_is_refused(copy, tmp_path):
    target = copy / "tokenizer.json"
    outside = tmp_path / "outside.json"
    shutil.move(target, outside)
    target.symlink_to(outside)
    with pytest.raises(ArtifactError, match="link"):
        verify(copy)


def test_missing_file_and_missing_manifest(copy):
    (copy / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="tokenizer.json is missing"):
        verify(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        load(copy, "torch")
