"""Broken, unsafe or unsupported checkpoints fail with one message naming the file and fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.errors import LowbitError
from pipeline.models import (
    CheckpointError,
    StreamingCheckpoint,
    UnsupportedArchitectureError,
    convert_bin_to_safetensors,
)


@pytest.fixture
def copy(llama_dir, tmp_path) -> Path:
    """A private copy of the session checkpoint that a test may damage."""
    return Path(shutil.copytree(llama_dir, tmp_path / "ck"))


def a_shard(path: Path) -> Path:
    return sorted(path.glob("model-*.safetensors"))[1]


def test_truncated_shard_names_the_file(copy):
    shard = a_shard(copy)
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])  # an interrupted download
    # A LowbitError: the CLI prints the message alone, without a traceback.
    with pytest.raises(LowbitError, match=f"{shard.name}.*truncated"):
        StreamingCheckpoint(copy)


def test_truncation_after_open_is_caught_by_verify(copy):
    ck = StreamingCheckpoint(copy)
    shard = a_shard(copy)
    shard.write_bytes(shard.read_bytes() + b"\0" * 8)  # size no longer matches the header
    with pytest.raises(ValueError, match=shard.name):
        ck.verify()


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[:8] + b"{not json" + b[17:],  # garbled header text
        lambda b: (10**12).to_bytes(8, "little") + b[8:],  # header length beyond the file
        lambda b: b[:5],  # shorter than the length prefix
    ],
    ids=["bad-json", "bad-length", "stub"],
)
def test_corrupt_header_names_the_file(copy, damage):
    shard = a_shard(copy)
    shard.write_bytes(damage(shard.read_bytes()))
    with pytest.raises(CheckpointError, match=f"corrupt safetensors file .*{shard.name}"):
        StreamingCheckpoint(copy)


def test_missing_shard_and_config(copy):
    shard = a_shard(copy)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        StreamingCheckpoint(copy)
    (copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        StreamingCheckpoint(copy)


def test_index_pointing_at_wrong_shard(copy):
    index_file = copy / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"{name} is in {shards[1]}"):
        StreamingCheckpoint(copy)


def test_unsupported_architecture_lists_supported(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(
        UnsupportedArchitectureError,
        match="'gpt2'; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2",
    ):
        StreamingCheckpoint(tmp_path)


@pytest.fixture
def bin_dir(llama_dir, tmp_path) -> Path:
    """The llama checkpoint re-saved as a single pickled pytorch_model.bin."""
    ck = StreamingCheckpoint(llama_dir)
    out = tmp_path / "bin"
    out.mkdir()
    shutil.copy(llama_dir / "config.json", out)
    torch.save({n: ck.tensor(n) for n in ck.names()}, out / "pytorch_model.bin")
    return out


def test_bin_refused_unless_opted_in(bin_dir, llama_dir, tmp_path):
    with pytest.raises(ValueError, match="pytorch_model.bin.*allow_bin=True.*convert"):
        StreamingCheckpoint(bin_dir)
    ck, ref = StreamingCheckpoint(bin_dir, allow_bin=True), StreamingCheckpoint(llama_dir)
    assert ck.is_bin
    torch.testing.assert_close(ck.load_block(2).state_dict(), ref.load_block(2).state_dict())

    converted = StreamingCheckpoint(convert_bin_to_safetensors(bin_dir, tmp_path / "st", 30_000))
    assert not converted.is_bin and converted.verify()["files"] > 1
    torch.testing.assert_close(converted.load_block(0).state_dict(), ref.load_block(0).state_dict())
