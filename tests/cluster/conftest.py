"""Fixtures for the cluster tests: a local Slurm cluster and the `lowbit` command.

The cluster is started once per session (about 2 s) and only when a test asks for it; without
the Debian packages (`.ci/slurm.sh install`) or root, those tests skip and say why.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .runs import BIN, job_env
from .slurm import LocalSlurm, missing_requirements


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running one-node Slurm cluster (2 CPUs, partition `local`); stopped after the session."""
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    cluster.env = job_env(cluster.env)
    with cluster:
        yield cluster


@pytest.fixture(scope="session")
def lowbit_cli() -> Path:
    """Path of the installed `lowbit` command (skips until the package is installed)."""
    exe = BIN / "lowbit"
    if not exe.exists():
        pytest.skip(f"{exe} not found; install the project into this environment: pip install -e .")
    return exe
