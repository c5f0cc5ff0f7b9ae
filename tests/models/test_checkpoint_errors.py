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
    read_safetensors_header,
)
from pipeline.models.hf import load_causal_lm
from pipeline.models.shards import check_finite
from tests.models.conftest import poison_tensor


@pytest.fixture
def copy(llama_dir, tmp_path) -> Path:
    """A private copy of the session checkpoint that a test may damage."""
    return Path(shutil.copytree(llama_dir, tmp_path / "ck"))


def a_shard(path: Path) -> Path:
    return sorted(path.glob("model-*.safetensors"))[1]


def test_truncated_shard_names_the_file_and_the_tensor_cut_off(copy):
    shard = a_shard(copy)
    data = shard.read_bytes()
    last, (*_, end) = max(read_safetensors_header(shard).items(), key=lambda e: e[1][3])
    shard.write_bytes(data[:-100])  # an interrupted download
    # A LowbitError: the CLI prints the message alone, without a traceback.
    with pytest.raises(LowbitError) as info:
        StreamingCheckpoint(copy)
    assert str(info.value).startswith(
        f"corrupt safetensors file {shard}: truncated: tensor {last} ends at byte {end} but the "
        f"file holds {len(data) - 100}; re-download or re-save it"
    )


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


def test_a_tensor_the_index_does_not_list(copy):
    index_file = copy / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    shard = index["weight_map"].pop(name)
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{copy / shard} holds {name}, which .* not list"):
        StreamingCheckpoint(copy)


def test_nan_and_inf_weights_name_the_tensor_before_its_block_computes(copy):
    name = "model.layers.1.mlp.down_proj.weight"  # (32, 48)
    poison_tensor(copy, name, 53, float("inf"))
    shard = poison_tensor(copy, name, 5, float("nan"))
    expect = (
        f"tensor {name} in {shard} holds 2 NaN/Inf values (the first, nan, at [0, 5]); the "
        "checkpoint is damaged: re-download it, or re-save it from a model without them"
    )
    ck = StreamingCheckpoint(copy)  # headers only: opening a checkpoint stays cheap
    ck.load_block(0)
    with pytest.raises(CheckpointError) as info:
        ck.load_block(1)
    assert str(info.value) == expect
    with pytest.raises(CheckpointError) as info:  # whole-model loads check before any forward
        load_causal_lm(copy)
    assert str(info.value) == expect


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_check_finite_counts_and_locates(dtype):
    t = torch.randn(4, 30).to(dtype)
    for chunk in (7, 1 << 24):  # a value found in any chunk, not only the first
        check_finite(t, "w", "f.safetensors", chunk)
        check_finite(torch.empty(0, 3, dtype=dtype), "empty", "f", chunk)
    check_finite(torch.full((3,), 7, dtype=torch.int64), "ints", "f")  # not floating: skipped
    check_finite(torch.empty(3, dtype=dtype, device="meta"), "offloaded", "f")  # no values here
    t[3, 5] = float("-inf")
    t[3, 9] = float("nan")
    for chunk in (7, 1 << 24):
        with pytest.raises(CheckpointError, match=r"tensor w in f.safetensors holds 2 NaN/Inf "
                           r"values \(the first, -inf, at \[3, 5\]\)"):  # fmt: skip
            check_finite(t, "w", "f.safetensors", chunk)


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
