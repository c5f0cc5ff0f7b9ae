"""The input faults of the README's reliability table, through the real `lowbit` command.

Each damaged input (data files, a draft of another vocabulary, a checkpoint with NaN weights, a
truncated shard, shards that disagree with their index) must end the run with one `[ERROR]`
line naming the file and the fix, exit code 2, no traceback, and no stage folder written. The
variants of each fault are unit-tested beside their checks (tests/test_inputs.py,
tests/data/test_text.py, tests/models/test_checkpoint_errors.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import CLI_TIMEOUT, lowbit_cmd

LINES = [f"line {i} of the faulty corpus, river stone cloud {i % 7}" for i in range(80)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A tiny HF llama with its tokenizer, and a folder of train/test text (both valid)."""
    from pipeline.models.hf import train_tokenizer
    from tests.models.conftest import save_hf_checkpoint

    root = tmp_path_factory.mktemp("inputs")
    tok = train_tokenizer(LINES, 300)
    ckpt = save_hf_checkpoint(root / "ckpt", "llama", vocab=len(tok))
    tok.save_pretrained(ckpt)
    data = root / "data"
    data.mkdir()
    (data / "train.txt").write_text("\n".join(LINES[:70]) + "\n")
    (data / "test.txt").write_text("\n".join(LINES[70:]) + "\n")
    return {"ckpt": ckpt, "data": data}


def lowbit(tmp_path: Path, ckpt: Path, data: Path, *args: str, at_start: bool = True) -> str:
    """Run sensitivity on `ckpt` and `data`; returns the one error line, checking the contract
    (and, `at_start`, that the stage never started)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        lowbit_cmd(
            "experiment=smoke", "model=hf", f"model.target.path={ckpt}", "data=local",
            f"data.path={data}", "stages=[sensitivity]", f"run_dir={run_dir}", "tracking=none",
            *args,
        ),
        cwd=tmp_path, capture_output=True, text=True, timeout=CLI_TIMEOUT,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if "[ERROR]" in line]
    assert proc.returncode == 2, output[-3000:]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert not (run_dir / "sensitivity").exists()
    assert ("running (fingerprint" in output) != at_start, output[-3000:]
    return errors[0]


def copy_of(inputs, tmp_path: Path, what: str) -> Path:
    return Path(shutil.copytree(inputs[what], tmp_path / what))


@pytest.mark.parametrize(
    "content, expect",
    [
        (b"", "test.txt is empty; add text or remove it"),
        (b"some text\n" * 30 + b"\x00\x01", "test.txt is not text (a NUL byte at byte 300"),
        ("café au lait\n".encode("latin-1"), "test.txt is not UTF-8 (byte 3 is b'\\xe9')"),
        (("one long line " * 200).encode(), "train.txt holds 1 document (one per line"),
    ],
    ids=["empty", "binary", "latin-1", "single-line"],
)
def test_a_damaged_data_file_is_one_line_at_start(inputs, tmp_path, content, expect):
    data = copy_of(inputs, tmp_path, "data")
    if expect.startswith("train.txt"):
        (data / "test.txt").unlink()  # train alone, so validation and test are carved from it
        (data / "train.txt").write_bytes(content)
    else:
        (data / "test.txt").write_bytes(content)
    error = lowbit(tmp_path, inputs["ckpt"], data)
    assert f"data.path={data}: " in error and expect in error


def test_a_draft_of_another_vocabulary_is_refused_at_start(inputs, tmp_path):
    from pipeline.models.hf import train_tokenizer

    draft = copy_of(inputs, tmp_path, "ckpt")
    train_tokenizer([f"another {i} vocabulary entirely" for i in range(40)], 260).save_pretrained(
        draft
    )
    error = lowbit(tmp_path, inputs["ckpt"], inputs["data"], f"model.draft.path={draft}")
    assert f"model.draft.path={draft}: its tokenizer is not the one of model.target.path" in error
    assert "tokens in the target" in error and "the first differing id is" in error
    assert "speculative decoding needs one vocabulary" in error


def test_a_truncated_shard_names_the_tensor_at_start(inputs, tmp_path):
    ckpt = copy_of(inputs, tmp_path, "ckpt")
    shard = sorted(ckpt.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-64])
    error = lowbit(tmp_path, ckpt, inputs["data"])
    assert f"model.target.path={ckpt}: corrupt safetensors file {shard}: truncated: " in error
    assert " ends at byte " in error and "re-download or re-save it" in error


def test_shards_that_disagree_with_the_index_are_one_line_at_start(inputs, tmp_path):
    ckpt = copy_of(inputs, tmp_path, "ckpt")
    index_file = ckpt / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = max(index["weight_map"])
    shard = index["weight_map"].pop(name)
    index_file.write_text(json.dumps(index))
    error = lowbit(tmp_path, ckpt, inputs["data"])
    assert f"{ckpt / shard} holds {name}, which {index_file} does not list" in error


def test_a_nan_weight_names_the_tensor_before_the_stage_computes(inputs, tmp_path):
    from tests.models.conftest import poison_tensor

    ckpt = copy_of(inputs, tmp_path, "ckpt")
    name = "model.layers.1.self_attn.o_proj.weight"
    shard = poison_tensor(ckpt, name, 3, float("nan"))
    # Found where the stage reads the weights, before their first forward.
    error = lowbit(tmp_path, ckpt, inputs["data"], at_start=False)
    assert f"tensor {name} in {shard} holds 1 NaN/Inf value (the first, nan, at [0, 3])" in error
