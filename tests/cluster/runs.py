"""Helpers shared by the cluster tests: job environment, lowbit runs, stage markers, tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The interpreter running the tests; its bin/ holds `lowbit`, `torchrun` and friends.
BIN = Path(sys.executable).parent
# The stages the 2-rank smoke job runs: everything up to the first training stage.
SMOKE_STAGES = ["bootstrap", "sensitivity", "allocate", "quantize", "distill"]


def job_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """Environment for jobs and launchers: this venv first on PATH, offline, one thread per rank."""
    env = dict(base if base is not None else os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def overrides(run_dir: Path, stages: list[str], tracking_uri: str | None, *extra: str) -> list[str]:
    """lowbit overrides for a test run: its own run_dir and MLflow store (or none)."""
    args = [f"stages=[{','.join(stages)}]", f"run_dir={run_dir}"]
    if tracking_uri is None:
        args.append("tracking=none")
    else:
        artifacts = run_dir.parent / f"{run_dir.name}-mlartifacts"
        args += [f"tracking.uri={tracking_uri}", f"tracking.artifact_location={artifacts}"]
    return args + list(extra)


@dataclass
class SmokeRun:
    """A finished 2-rank smoke run (see the `smoke_run` fixture)."""

    run_dir: Path
    tracking_uri: str
    experiment: str
    launcher: str  # "slurm" (jobs/smoke.sbatch) or "local" (lowbit's own torchrun)
    log: str
    job: dict[str, str] | None = None


def run_cmd(argv: list, *, env: dict, cwd: Path, timeout: float, log: Path) -> int:
    """Run a command with its output in ``log``; fail the test with the log's tail on timeout."""
    with open(log, "w") as f:
        try:
            return subprocess.run(
                [str(a) for a in argv], env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                timeout=timeout,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail(f"{argv[0]} ran past {timeout} s; {tail(log)}")


def tail(path: Path, lines: int = 60) -> str:
    """The end of a log file, for assertion messages."""
    if not path.exists():
        return f"(no log at {path})"
    return f"last lines of {path}:\n" + "\n".join(
        path.read_text(errors="replace").splitlines()[-lines:]
    )


def read_done(stage_dir: Path) -> dict:
    """A finished stage's `_done.json` (fails the test with the run_dir listing otherwise)."""
    done = stage_dir / "_done.json"
    if not done.is_file():
        parent = stage_dir.parent
        listing = sorted(p.name for p in parent.iterdir()) if parent.exists() else []
        pytest.fail(f"{done} missing; {parent} holds {listing}")
    return json.loads(done.read_text())


def load_tensors(folder: Path) -> dict[str, object]:
    """Every tensor of every ``*.safetensors`` file below ``folder``, keyed ``file:name``."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(folder.rglob("*.safetensors")):
        rel = path.relative_to(folder)
        tensors.update({f"{rel}:{k}": v for k, v in load_file(path).items()})
    return tensors
