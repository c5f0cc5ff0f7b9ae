"""Two simulated nodes: `torchrun --nnodes=2` started twice gives the same model as one node.

Both node processes run on this machine and meet through torchrun's c10d rendezvous, exactly as
two hosts would (Lightning sees TorchElasticEnvironment with node ranks 0 and 1). The stages
before distill are copied from the session's 2-rank smoke run (the workflow reuses them when
their fingerprints match, and recomputes them deterministically when they do not), and the
distill result must match the single-node run's tensor for tensor. The session's smoke run and
the two nodes' own limit add up to more than the suite's 15 min per test, hence its limit.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from .runs import SMOKE_STAGES, job_env, load_tensors, overrides, read_done, tail
from .slurm import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_two_node_torchrun_distill_matches_single_node(smoke_2rank_run, tmp_path):
    run_dir = tmp_path / "run"
    # Everything the earlier stages produced; distill and its scratch space are left behind.
    shutil.copytree(
        smoke_2rank_run.run_dir,
        run_dir,
        ignore=lambda d, names: [
            n for n in names if n.startswith(("distill", ".distill", "_mlflow"))
        ],
    )
    port = free_port()
    env = job_env()
    procs, logs = [], []
    for node in (0, 1):
        log = tmp_path / f"node{node}.log"
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--node-rank={node}",
                "-m", "pipeline", "experiment=smoke", "trainer=ddp", "trainer.devices=1",
                "trainer.num_nodes=2", *overrides(run_dir, SMOKE_STAGES, None)]  # fmt: skip
        logs.append(log)
        with open(log, "w") as f:
            procs.append(subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=f, stderr=f))
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
    assert codes == [0, 0], "\n".join(tail(log) for log in logs)

    done = read_done(run_dir / "distill")
    assert done["metrics"]["world_size"] == 2, done["metrics"]

    two_nodes = load_tensors(run_dir / "distill")
    one_node = load_tensors(smoke_2rank_run.run_dir / "distill")
    assert two_nodes, f"no safetensors under {run_dir / 'distill'}"
    assert two_nodes.keys() == one_node.keys()
    for key, tensor in one_node.items():
        assert torch.allclose(two_nodes[key], tensor, rtol=1e-4, atol=1e-6), key
