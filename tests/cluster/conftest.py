"""Fixtures for the cluster tests: a local Slurm cluster, the `lowbit` command, one smoke run.

The cluster is started once per session (about 2 s) and only when a test asks for it; without
the Debian packages (`.ci/slurm.sh install`) or root, those tests skip and say why, and fail
where LOWBIT_REQUIRE includes slurm (tests/_require.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._require import require

from .runs import (
    BIN,
    REPO,
    SMOKE_STAGES,
    SmokeRun,
    job_env,
    overrides,
    run_cmd,
    tail,
)
from .slurm import LocalSlurm, missing_requirements

SMOKE_TIMEOUT = 900  # seconds; the 2-rank smoke run takes a few minutes on 2 cores


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running one-node Slurm cluster (2 CPUs, partition `local`); stopped after the session."""
    reason = missing_requirements()
    if reason:
        require("slurm", reason)
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    cluster.env = job_env(cluster.env)
    with cluster:
        yield cluster


@pytest.fixture(scope="session")
def lowbit_cli() -> Path:
    """Path of the installed `lowbit` command (skips until the package is installed)."""
    exe = BIN / "lowbit"
    if not exe.exists():
        # the cluster suite's jobs run the command a user types; CI installs it with the extras
        require("slurm", f"{exe} not found; install the project here: pip install -e .")
    return exe


@pytest.fixture(scope="session")
def smoke_2rank_run(request, lowbit_cli, tmp_path_factory) -> SmokeRun:
    """The smoke workflow up to distill on 2 ranks of one node, run once per session.

    Under Slurm (jobs/smoke.sbatch, 2 srun tasks) when a local cluster can start;
    otherwise `lowbit ... trainer=ddp`, which starts its 2 ranks with torchrun itself.
    """
    root = tmp_path_factory.mktemp("smoke")
    run_dir, uri = root / "run", f"sqlite:///{root / 'mlflow.db'}"
    args = overrides(run_dir, SMOKE_STAGES, uri, "tracking.experiment=cluster-smoke")
    log = root / "job.log"
    if missing_requirements() is None:
        cluster: LocalSlurm = request.getfixturevalue("slurm_cluster")
        # sbatch + polling rather than `sbatch --wait`, whose back-off (2, 4, ... 32 s) adds up
        # to half a minute after the job ends; test_slurm_fixture.py covers --wait itself.
        options = (f"--output={log}", f"--chdir={root}")
        job_id = cluster.sbatch(REPO / "jobs" / "smoke.sbatch", *args, options=options)
        job = cluster.wait_job(job_id, timeout=SMOKE_TIMEOUT, poll=2.0)
        assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), tail(log)
        return SmokeRun(run_dir, uri, "cluster-smoke", "slurm", log.read_text(), job)
    argv = [lowbit_cli, "experiment=smoke", "trainer=ddp", *args]
    rc = run_cmd(argv, env=job_env(), cwd=root, timeout=SMOKE_TIMEOUT, log=log)
    assert rc == 0, tail(log)
    return SmokeRun(run_dir, uri, "cluster-smoke", "local", log.read_text())
