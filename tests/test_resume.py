"""Exact resume: a training stage killed (SIGKILL) after a checkpoint and rerun writes the same
bytes as an uninterrupted run, for bootstrap, distill and reinforce, through the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, WORKFLOW_TIMEOUT, lowbit_cmd

# The smoke workflow, smaller where it costs time and longer where a kill must land mid-way
# (a checkpoint every tenth of the steps). cost_ratio is fixed: measured, it is a timing, and
# two independent runs would differ by it.
ARGS = (
    "experiment=smoke",
    "tracking=none",
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
STAGES = ["bootstrap", "sensitivity", "allocate", "quantize", "distill", "reinforce"]
# The checkpoint whose appearance triggers the kill: for bootstrap the draft's, so the rerun
# also restores a finished target.
KILL_AT = {
    "bootstrap": "bootstrap-*/draft/checkpoints/last.ckpt",
    "distill": "distill-*/checkpoints/last.ckpt",
    "reinforce": "reinforce-*/checkpoints/last.ckpt",
}
STEPS = {"bootstrap": 60, "distill": 60, "reinforce": 60}  # of the killed model
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

pytestmark = pytest.mark.slow  # ~70 s on 2 cores: seven CLI runs


def lowbit(run_dir: Path, stages: list[str]) -> list[str]:
    return lowbit_cmd(f"run_dir={run_dir}", f"stages=[{','.join(stages)}]", *ARGS)


def done(run_dir: Path, stage: str) -> dict:
    return json.loads((run_dir / stage / "_done.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("resume") / "run"
    proc = subprocess.run(
        lowbit(run, STAGES), env=ENV, capture_output=True, text=True, timeout=WORKFLOW_TIMEOUT
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run


@pytest.mark.parametrize("stage", ["bootstrap", "distill", "reinforce"])
def test_a_killed_stage_resumes_to_the_same_bytes(uninterrupted, tmp_path, stage):
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    for later in STAGES[STAGES.index(stage) :]:
        shutil.rmtree(run / later)
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

    rerun = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=WORKFLOW_TIMEOUT)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-5000:]
    resumed, whole = done(run, stage), done(uninterrupted, stage)
    assert resumed["fingerprint"] == whole["fingerprint"]
    steps = STEPS[stage]
    key = "draft_resumed_step" if stage == "bootstrap" else "resumed_step"
    assert 0 < resumed["metrics"][key] < steps, "the kill did not land mid-training"
    if stage == "bootstrap":
        assert resumed["metrics"]["target_resumed_step"] == 40  # restored, not retrained
    hashes = {f: o["sha256"] for f, o in resumed["outputs"].items()}
    assert hashes == {f: o["sha256"] for f, o in whole["outputs"].items()}
