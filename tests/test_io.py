"""pipeline.io: sha256, atomic JSON and the one safetensors shard writer."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from pipeline.io import ShardWriter, sha256, write_json


def test_sha256_is_the_file_digest(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x" * (5 << 20))  # more than one read chunk
    assert sha256(p) == hashlib.sha256(p.read_bytes()).hexdigest()


def test_write_json_replaces_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "a.json"
    p.write_text("old")
    write_json(p, {"b": [1, 2]}, indent=1)
    assert p.read_text() == json.dumps({"b": [1, 2]}, indent=1)  # exactly json.dumps' bytes
    assert [q.name for q in tmp_path.iterdir()] == ["a.json"]


def test_shard_writer_single_file_has_no_index(tmp_path):
    w = ShardWriter(tmp_path, "m", 1 << 20)
    w.add("a", torch.zeros(3))
    assert w.close() == {"a": "m.safetensors"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers expects
    with pytest.raises(ValueError, match="twice"):
        w2 = ShardWriter(tmp_path / "x", "m", 10)
        w2.add("a", torch.zeros(1))
        w2.add("a", torch.zeros(1))


def test_shard_writer_shards_and_index(tmp_path):
    base = torch.arange(40, dtype=torch.float32)
    tensors = {"a": base[:10], "b": base[10:20].view(2, 5), "c": torch.ones(30)}  # views too
    w = ShardWriter(tmp_path / "out", "model", 80)  # 40 + 40 bytes fit, 120 bytes alone
    for name, t in tensors.items():
        w.add(name, t)
    files = w.close()
    assert files == {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
    }
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": 200}, "weight_map": files}
    got = {}
    for f in set(files.values()):
        got |= load_file(tmp_path / "out" / f)
    assert all(torch.equal(got[n], t) for n, t in tensors.items())
    assert w.tensors["b"] == {"dtype": "float32", "shape": [2, 5]}
    assert not list((tmp_path / "out").glob(".*"))  # no part file left behind
