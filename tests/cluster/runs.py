"""Helpers shared by the cluster tests: job environment, stage markers, model comparison."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The interpreter running the tests; its bin/ holds `lowbit`, `torchrun` and friends.
BIN = Path(sys.executable).parent


def job_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """Environment for jobs and launchers: this venv first on PATH, offline, one thread per rank."""
    env = dict(base if base is not None else os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def read_done(stage_dir: Path) -> dict:
    """A finished stage's `_done.json` (fails the test with the run_dir listing otherwise)."""
    done = stage_dir / "_done.json"
    if not done.is_file():
        parent = stage_dir.parent
        listing = sorted(p.name for p in parent.iterdir()) if parent.exists() else []
        pytest.fail(f"{done} missing; {parent} holds {listing}")
    return json.loads(done.read_text())
