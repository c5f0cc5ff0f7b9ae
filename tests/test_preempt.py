"""A time-limit signal: a training stage checkpoints at its next step boundary and stops (exit
75), and the rerun resumes to the bytes an uninterrupted run writes (pipeline.preempt). The same
under Slurm, requeue included: tests/cluster/test_pipeline_jobs.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from pipeline import preempt
from tests.conftest import REPO, WORKFLOW_TIMEOUT, lowbit_cmd

# bootstrap alone, short, with a resume checkpoint every 4 steps: the signal lands after the first.
ARGS = (
    "experiment=smoke",
    "tracking=none",
    "stages=[bootstrap]",
    "trainer.enable_progress_bar=false",
    "data.builtin_max_chars=300000",
    "stage.bootstrap.max_steps=40",
    "stage.bootstrap.draft_max_steps=20",
    "stage.bootstrap.checkpoint_every=4",
)
FIRST_CKPT = "bootstrap-*/target/checkpoints/last.ckpt"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def wait_for_checkpoint(run_dir: Path, alive, timeout: float = 240) -> Path:
    """The target's first resume checkpoint, once it exists; `alive()` says the run still runs."""
    deadline = time.monotonic() + timeout
    while not (found := list((run_dir / ".work").glob(FIRST_CKPT))):
        assert alive(), "the run ended before its first checkpoint"
        assert time.monotonic() < deadline, f"no {FIRST_CKPT} after {timeout} s"
        time.sleep(0.02)
    return found[0]


def checkpoint_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def outputs(run_dir: Path) -> dict[str, str]:
    done = json.loads((run_dir / "bootstrap" / "_done.json").read_text())
    return {f: o["sha256"] for f, o in done["outputs"].items()} | {
        "target_resumed_step": done["metrics"]["target_resumed_step"]
    }


@pytest.fixture
def handlers():
    """pipeline.preempt's handlers in this process, the previous ones put back afterwards."""
    before = {s: signal.getsignal(s) for s in preempt.SIGNALS}
    preempt.install()
    yield
    for s, h in before.items():
        signal.signal(s, h)
    preempt._state.update(installed=False, signal=None, deferred=False)


def test_a_signal_outside_training_steps_stops_at_once(handlers):
    with pytest.raises(preempt.Preempted, match="received SIGTERM.*rerun the same command"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler runs at the next bytecode; never gets here
    assert preempt.Preempted.exit_code == 75


def test_a_signal_during_training_steps_waits_for_the_step_boundary(handlers, monkeypatch):
    preempt.defer(True)
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.05)  # would have raised here without defer
    assert preempt.received() == signal.SIGUSR1
    os.kill(os.getpid(), signal.SIGTERM)  # a second signal (requeue's SIGTERM) changes nothing
    assert preempt.received() == signal.SIGUSR1
    # Outside Slurm nothing is requeued: the message says how to resume.
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    message = str(preempt.stopped("checkpointed at step 3"))
    assert message == "received SIGUSR1: checkpointed at step 3; rerun the same command to resume"


@pytest.mark.slow  # ~60 s on 2 cores: three short bootstrap runs
def test_sigusr1_checkpoints_a_training_stage_and_the_rerun_resumes_to_the_same_bytes(tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    done = subprocess.run(
        lowbit_cmd(f"run_dir={whole}", *ARGS), env=ENV, capture_output=True, text=True,
        timeout=WORKFLOW_TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    cmd = lowbit_cmd(f"run_dir={cut}", *ARGS)
    log = tmp_path / "cut.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=ENV, stdout=out, stderr=subprocess.STDOUT)
        try:
            ckpt = wait_for_checkpoint(cut, lambda: proc.poll() is None)
            proc.send_signal(signal.SIGUSR1)
            rc = proc.wait(timeout=120)
        finally:
            proc.kill()
    lines = log.read_text().splitlines()
    assert rc == 75, lines[-20:]
    # One line says where it stopped; the checkpoint there is the one it names.
    step = checkpoint_step(ckpt)
    assert f"received SIGUSR1: training checkpointed at step {step} in {ckpt}" in lines[-1]
    assert 4 <= step < 40
    assert not (cut / "bootstrap").exists() and not (cut / ".bootstrap.tmp").exists()

    rerun = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=WORKFLOW_TIMEOUT)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    resumed = outputs(cut)
    assert resumed.pop("target_resumed_step") == step
    assert resumed == {k: v for k, v in outputs(whole).items() if k != "target_resumed_step"}


@pytest.mark.parametrize("job", sorted((REPO / "jobs").glob("*.sbatch")), ids=lambda p: p.name)
def test_every_slurm_job_asks_for_the_time_limit_signal_and_requeue(job):
    text = job.read_text()
    assert "#SBATCH --requeue\n" in text
    assert re.search(r"^#SBATCH --signal=USR1@\d+$", text, re.M), "no --signal=USR1@<seconds>"
