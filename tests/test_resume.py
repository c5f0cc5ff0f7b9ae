"""Exact resume: a stage stopped part-way and rerun writes the same bytes as an uninterrupted run,
through the CLI: a training stage killed (SIGKILL) after a checkpoint (bootstrap, distill,
reinforce), any stage interrupted by SIGINT, quantize and distill stopped by a full disk (distill
also while it writes best.ckpt)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, WORKFLOW_TIMEOUT, lowbit_cmd

# The smoke workflow, smaller where it costs time and longer where a kill must land mid-way
# (a checkpoint every tenth of the steps). cost_ratio is fixed: measured, it is a timing, and
# two independent runs would differ by it.
ARGS = (
    "experiment=smoke",
    "trainer.enable_progress_bar=false",
    "data.builtin_max_chars=300000",
    "stage.bootstrap.max_steps=40",
    "stage.bootstrap.draft_max_steps=60",
    "stage.distill.train.steps=60",
    "stage.distill.train.checkpoint_every=null",
    "stage.distill.train.val_every=25",
    "stage.distill.val_windows=8",
    "stage.reinforce.train.steps=60",
    "stage.reinforce.train.checkpoint_every=null",
    "stage.reinforce.train.val_every=25",
    "stage.reinforce.val_prompts=4",
    "stage.reinforce.long_len=128",
    "stage.reinforce.cost_ratio=0.25",
)
STAGES = ["bootstrap", "sensitivity", "allocate", "quantize", "distill", "reinforce", "export"]
# The checkpoint whose appearance triggers the kill: for bootstrap the draft's, so the rerun
# also restores a finished target.
KILL_AT = {
    "bootstrap": "bootstrap-*/draft/checkpoints/last.ckpt",
    "distill": "distill-*/checkpoints/last.ckpt",
    "reinforce": "reinforce-*/checkpoints/last.ckpt",
}
STEPS = {"bootstrap": 60, "distill": 60, "reinforce": 60}  # of the killed model
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

pytestmark = pytest.mark.slow  # ~5 min on 2 cores: twenty-five CLI runs


def lowbit(run_dir: Path, stages: list[str], *extra: str, tracking=("tracking=none",)):
    return lowbit_cmd(
        f"run_dir={run_dir}", f"stages=[{','.join(stages)}]", *ARGS, *extra, *tracking
    )


def done(run_dir: Path, stage: str) -> dict:
    return json.loads((run_dir / stage / "_done.json").read_text())


def digests(run_dir: Path, stages: list[str]) -> dict[str, dict[str, str]]:
    """Per stage, its fingerprint and the sha256 of each output, as its `_done.json` has them."""
    out = {}
    for stage in stages:
        record = done(run_dir, stage)
        hashes = {f: o["sha256"] for f, o in record["outputs"].items()}
        out[stage] = {"fingerprint": record["fingerprint"], **hashes}
    return out


def without(uninterrupted: Path, tmp_path: Path, stage: str) -> Path:
    """A copy of the uninterrupted run without `stage` and the stages after it."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    for later in STAGES[STAGES.index(stage) :]:
        shutil.rmtree(run / later)
    return run


def assert_rerun_matches(run: Path, uninterrupted: Path, stage: str, *extra: str) -> dict:
    """Rerun `stage` to the end; its outputs are the bytes the uninterrupted run wrote."""
    rerun = subprocess.run(
        lowbit(run, [stage], *extra), env=ENV, capture_output=True, text=True,
        timeout=WORKFLOW_TIMEOUT,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-5000:]
    assert digests(run, [stage]) == digests(uninterrupted, [stage])
    return done(run, stage)


def one_line(proc: subprocess.CompletedProcess, code: int, run: Path, stage: str) -> str:
    """The failure contract: exit `code`, one [ERROR] line, no traceback, nothing half-written."""
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if "[ERROR]" in line]
    assert proc.returncode == code, out[-5000:]
    assert len(errors) == 1 and "Traceback" not in out, out[-5000:]
    assert not (run / stage).exists() and not (run / f".{stage}.tmp").exists()
    return errors[0]


@pytest.mark.parametrize("stage", ["bootstrap", "distill", "reinforce"])
def test_a_killed_stage_resumes_to_the_same_bytes(uninterrupted, tmp_path, stage):
    run = without(uninterrupted, tmp_path, stage)
    cmd = lowbit(run, [stage])

    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not list((run / ".work").glob(KILL_AT[stage])):
            assert proc.poll() is None, f"{stage} ended before its first checkpoint"
            assert time.time() < deadline, f"no {KILL_AT[stage]} after 120 s"
            time.sleep(0.02)
    finally:  # also when the wait above fails: no run left behind
        proc.kill()  # SIGKILL: no handler runs, as when a node is lost
        proc.wait(timeout=60)
    assert not (run / stage).exists()

    resumed = assert_rerun_matches(run, uninterrupted, stage)
    steps = STEPS[stage]
    key = "draft_resumed_step" if stage == "bootstrap" else "resumed_step"
    assert 0 < resumed["metrics"][key] < steps, "the kill did not land mid-training"
    if stage == "bootstrap":
        assert resumed["metrics"]["target_resumed_step"] == 40  # restored, not retrained


# The real CLI with the stage's run() followed by a SIGINT of its own: it lands when every output
# is in the stage's temp folder and none is committed, where a half-written stage would show.
SIGINT_AFTER_RUN = (
    "import dataclasses, importlib, os, signal, sys, time\n"
    "stage = importlib.import_module('pipeline.stages.' + sys.argv[1])\n"
    "real = stage.STAGE.run\n"
    "def run(*args):\n"
    "    metrics = real(*args)\n"
    "    os.kill(os.getpid(), signal.SIGINT)\n"
    "    time.sleep(60)\n"
    "stage.STAGE = dataclasses.replace(stage.STAGE, run=run)\n"
    "from pipeline.__main__ import main\n"
    "sys.argv = ['lowbit', *sys.argv[2:]]\n"
    "main()\n"
)


@pytest.mark.parametrize("stage", ["sensitivity", "allocate", "quantize", "distill", "reinforce",
                                   "export"])  # fmt: skip
def test_sigint_during_a_stage_is_one_line_and_the_rerun_resumes(uninterrupted, tmp_path, stage):
    """Training stages get SIGINT from outside at their first checkpoint, inside Lightning's fit
    (which turns it into an exit of its own); the others at the end of their run()."""
    run = without(uninterrupted, tmp_path, stage)
    cmd = lowbit(run, [stage])
    if stage not in KILL_AT:
        cmd = [sys.executable, "-c", SIGINT_AFTER_RUN, stage, *cmd[3:]]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if stage in KILL_AT:
            deadline = time.time() + 120
            while not list((run / ".work").glob(KILL_AT[stage])):
                assert proc.poll() is None, f"{stage} ended before its first checkpoint"
                assert time.time() < deadline, f"no {KILL_AT[stage]} after 120 s"
                time.sleep(0.02)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=WORKFLOW_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    line = one_line(subprocess.CompletedProcess(cmd, proc.returncode, out, err), 130, run, stage)
    assert f"interrupted (SIGINT) during stage {stage}" in line and "rerun" in line

    resumed = assert_rerun_matches(run, uninterrupted, stage)
    if stage in KILL_AT:
        assert 0 < resumed["metrics"]["resumed_step"] < STEPS[stage]


FILE_LIMIT = 100_000  # bytes: above any log or report, below any weights file of these models


def limit_file_size():
    """In the child: a write past FILE_LIMIT fails with EFBIG (SIGXFSZ ignored, so not a kill)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs at tmp_path/disk, and how to size it: `size(n)` remounts it with n bytes."""
    disk = tmp_path / "disk"
    disk.mkdir()

    def size(n: int) -> None:
        opts = f"remount,size={n}" if os.path.ismount(disk) else f"size={n}"
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(disk)],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        if mount.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({mount.stderr.strip()}); see the limit case")

    yield disk, size
    if os.path.ismount(disk):
        subprocess.run(["umount", str(disk)], check=True, timeout=60)


FREE = 600 * 1024  # bytes left on the small disk: its logs fit, weights and checkpoints do not


@pytest.mark.parametrize("full", ["file size limit", "small tmpfs"])
@pytest.mark.parametrize("stage", ["quantize", "distill"])
def test_a_full_disk_is_one_line_and_the_rerun_after_freeing_space_resumes(
    uninterrupted, tmp_path, small_disk, stage, full
):
    """The kernel refuses the stage's first large write (quantize's weights, distill's
    checkpoint), simulated two ways: a file size limit (RLIMIT_FSIZE: EFBIG, no privileges
    needed, lifted for the rerun) and the run dir on a tmpfs with FREE bytes left (ENOSPC as on
    a full disk; needs the right to mount, and is remounted larger for the rerun)."""
    run = without(uninterrupted, tmp_path, stage)
    limit = limit_file_size if full == "file size limit" else None
    if full == "small tmpfs":
        disk, size = small_disk
        used = sum(f.stat().st_blocks * 512 for f in run.rglob("*"))
        size(used + FREE)
        run = Path(shutil.copytree(run, disk / "run"))
    proc = subprocess.run(
        lowbit(run, [stage]), env=ENV, capture_output=True, text=True, timeout=WORKFLOW_TIMEOUT,
        preexec_fn=limit,
    )  # fmt: skip
    line = one_line(proc, 2, run, stage)
    if full == "file size limit":
        assert f"writing {run / stage} failed: a file may not exceed {FILE_LIMIT} bytes" in line
    else:
        assert f"writing {run}" in line and "No space left on device" in line, line
        assert re.search(r", \d+ bytes free on its file system", line), line
        assert not [p for p in run.rglob("*.tmp") if p.stat().st_size > 0]  # no partial file
        size(64 << 20)
    assert "rerun the same command" in line
    assert_rerun_matches(run, uninterrupted, stage)


# distill validating every 10 steps, checkpointing every 6 (a tenth): `last.ckpt` at step 6 is the
# stage's first checkpoint, `best.ckpt` at step 10 its second, with last.ckpt kept beside it.
VALIDATE_AT_10 = "stage.distill.train.val_every=10"


def run_seeing_checkpoint(cmd: list[str], run: Path) -> int:
    """Run a distill to the end; the size of its `last.ckpt`, seen while it ran (a finished
    stage removes its work folder)."""
    seen = 0
    log = run.with_name("seeing.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + WORKFLOW_TIMEOUT
        while proc.poll() is None:
            for ckpt in run.glob(".work/*/*/last.ckpt"):
                with contextlib.suppress(FileNotFoundError):  # the finished stage removed it
                    seen = max(seen, ckpt.stat().st_size)
            assert time.time() < deadline, f"distill still running after {WORKFLOW_TIMEOUT} s"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == 0 and seen, log.read_text()[-5000:]
    return seen


def test_a_full_disk_while_best_ckpt_is_written_leaves_none_of_it_and_the_rerun_resumes(
    uninterrupted, tmp_path, small_disk
):
    """Room for one checkpoint and a half: last.ckpt fits, best.ckpt beside it does not. The
    checkpoints folder keeps last.ckpt whole and no byte of best.ckpt (on another file system
    than /tmp, where a checkpoint staged there would be copied into place), and the rerun after
    freeing space resumes from last.ckpt to the bytes of a run that never met a full disk."""
    whole = without(uninterrupted, tmp_path / "whole", "distill")
    ckpt_bytes = run_seeing_checkpoint(lowbit(whole, ["distill"], VALIDATE_AT_10), whole)

    disk, size = small_disk
    run = without(uninterrupted, tmp_path, "distill")
    size(sum(f.stat().st_blocks * 512 for f in run.rglob("*")) + ckpt_bytes * 3 // 2)
    run = Path(shutil.copytree(run, disk / "run"))
    proc = subprocess.run(
        lowbit(run, ["distill"], VALIDATE_AT_10), env=ENV, capture_output=True, text=True,
        timeout=WORKFLOW_TIMEOUT,
    )  # fmt: skip
    line = one_line(proc, 2, run, "distill")
    assert f"writing {run}" in line and "No space left on device" in line, line
    assert "validation at step 10/60" in proc.stdout + proc.stderr  # then best.ckpt's write
    (checkpoints,) = (run / ".work").glob("distill-*/checkpoints")
    assert [p.name for p in checkpoints.iterdir()] == ["last.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 6

    size(64 << 20)
    resumed = assert_rerun_matches(run, whole, "distill", VALIDATE_AT_10)
    assert resumed["metrics"]["resumed_step"] == 6
