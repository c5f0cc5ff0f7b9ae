"""Load: runs started at the same time share only what they mean to share.

Two workflows started at once on two run dirs, both logging into one MLflow sqlite store that
neither has created yet (the default kind of store, where concurrent writers meet in one file),
finish with the bytes of the same workflow run alone: the session's `uninterrupted` run of
tests/test_resume.py. Four points of a sweep as Slurm jobs: tests/cluster/test_pipeline_jobs.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.cluster.runs import tail
from tests.conftest import WORKFLOW_TIMEOUT
from tests.test_resume import ENV, digests, done, lowbit

# Up to the first training stage after quantize: two trainings (bootstrap, distill) per run.
STAGES = ["bootstrap", "sensitivity", "allocate", "quantize", "distill"]

pytestmark = pytest.mark.slow  # ~3 min on 2 cores: two short workflows side by side


def run_at_once(commands: dict[str, list[str]], logs: Path) -> dict[str, int]:
    """Start every command before waiting for any; their exit codes by name."""
    procs = {}
    try:
        for name, cmd in commands.items():
            with open(logs / f"{name}.log", "w") as log:
                procs[name] = subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        return {name: proc.wait(timeout=WORKFLOW_TIMEOUT) for name, proc in procs.items()}
    finally:  # also when a wait times out: no run left behind
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)


def test_two_workflows_at_once_on_one_sqlite_store_write_the_bytes_of_one_run_alone(
    uninterrupted, tmp_path
):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = (f"tracking.uri={uri}", f"tracking.artifact_location={tmp_path / 'mlartifacts'}")
    runs = {name: tmp_path / name for name in ("a", "b")}
    commands = {name: lowbit(run, STAGES, tracking=tracking) for name, run in runs.items()}
    codes = run_at_once(commands, tmp_path)
    for name, rc in codes.items():
        assert rc == 0, tail(tmp_path / f"{name}.log")

    # They did run side by side: each one's bootstrap started before the other's ended.
    spans = [done(run, "bootstrap")["timings"] for run in runs.values()]
    assert max(t["start"] for t in spans) < min(t["end"] for t in spans), spans
    alone = digests(uninterrupted, STAGES)
    for name, run in runs.items():
        assert digests(run, STAGES) == alone, f"run {name} differs from the run made alone"

    # The store holds both, whole: a parent per run dir (the one it names), a finished child per
    # stage under each.
    client = MlflowClient(uri)
    logged = client.search_runs([client.get_experiment_by_name("lowbit").experiment_id])
    parents = {r.info.run_id for r in logged if "mlflow.parentRunId" not in r.data.tags}
    named = {json.loads((run / "_mlflow.json").read_text())["run_id"] for run in runs.values()}
    assert parents == named
    for parent in parents:
        children = [r for r in logged if r.data.tags.get("mlflow.parentRunId") == parent]
        assert sorted(r.info.run_name for r in children) == sorted(STAGES)
    assert {r.info.status for r in logged} == {"FINISHED"}
