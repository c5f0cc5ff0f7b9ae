"""The one line for a write the disk refused, whichever writer saw it (Python's file objects carry
the errno and the file; safetensors' Rust writer carries the errno in its message only)."""

from __future__ import annotations

import errno
import re
import resource
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipeline.errors import StageFailed, disk_full


def test_no_space_names_the_file_and_the_bytes_free(tmp_path):
    target = tmp_path / "model" / "part.safetensors"  # not there yet: its nearest folder counts
    cause = OSError(errno.ENOSPC, "No space left on device", str(target))
    failed = StageFailed("stage quantize failed: OSError")
    failed.__cause__ = cause
    line = str(disk_full(failed, tmp_path))
    assert line.startswith(f"writing {target} failed: No space left on device, ")
    free = int(re.search(r"(\d+) bytes free", line).group(1))
    assert abs(free - shutil.disk_usage(tmp_path).free) < 2**30  # others write here too
    assert "rerun the same command" in line


def test_a_file_size_limit_in_a_rust_writer_names_the_limit_and_the_run_dir(tmp_path):
    error = RuntimeError("Error while serializing: I/O error: File too large (os error 27)")
    line = str(disk_full(error, tmp_path))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    assert line.startswith(f"writing {tmp_path} failed: a file may not exceed {limit} bytes")


@pytest.mark.parametrize(
    "error",
    [ValueError("shapes differ"), OSError(errno.ENOENT, "No such file"), RuntimeError("os error")],
)
def test_other_failures_are_not_a_full_disk(tmp_path, error):
    assert disk_full(error, tmp_path) is None


def test_the_errno_of_a_real_safetensors_write_is_read_from_its_message(tmp_path):
    """safetensors reports a refused write without an errno attribute: the message is all there is
    (a missing folder stands in for a full disk, which this process cannot cause safely)."""
    with pytest.raises(Exception) as raised:
        save_file({"w": torch.zeros(4)}, str(tmp_path / "missing" / "w.safetensors"))
    assert f"(os error {errno.ENOENT})" in str(raised.value)


def test_a_scratch_file_on_another_file_system_is_not_named(tmp_path):
    """fsspec stages a checkpoint in the system temp dir and moves it: the refused write is where
    the run writes, whichever file the error carries."""
    scratch = Path("/dev/shm")
    if not scratch.is_dir() or scratch.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second file system beside tmp_path")
    error = OSError(errno.ENOSPC, "No space left on device", str(scratch / "tmpabc"))
    stage_dir = tmp_path / "distill"
    assert str(disk_full(error, stage_dir)).startswith(f"writing {stage_dir} failed: ")
