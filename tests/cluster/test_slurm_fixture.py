"""The local Slurm cluster itself: scheduling, srun ranks, gloo across tasks, requeue, submitit.

These use trivial jobs, so they check the test cluster and `conf/cluster/slurm.yaml` without
the workflow; tests/cluster/test_pipeline_jobs.py runs lowbit itself on the same cluster.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from .runs import REPO, job_env
from .slurm import free_port

pytestmark = pytest.mark.cluster

ALL_REDUCE = """
import json, os, sys
import torch, torch.distributed as dist
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", rank=rank, world_size=world)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
json.dump({"rank": rank, "world": world, "sum": t.item()}, open(f"{sys.argv[1]}/r{rank}.json", "w"))
dist.destroy_process_group()
"""


def test_node_is_idle_with_all_cpus(slurm_cluster):
    out = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%T %c %P").stdout.split()
    assert out == ["idle", str(slurm_cluster.cpus), f"{slurm_cluster.partition}*"]


def test_srun_starts_one_process_per_task(slurm_cluster):
    out = slurm_cluster.run("srun", "-n2", "bash", "-c", "echo $SLURM_PROCID/$SLURM_NTASKS").stdout
    assert sorted(out.split()) == ["0/2", "1/2"]


def test_sbatch_wait_returns_the_job_exit_code(slurm_cluster, tmp_path):
    script = tmp_path / "fail.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --ntasks=2\nsrun hostname\nexit 3\n")
    res = slurm_cluster.run(
        "sbatch", "--wait", "--parsable", f"--output={tmp_path}/%j.out", str(script), check=False
    )
    job = slurm_cluster.job(int(res.stdout.strip()))
    assert res.returncode == 3
    assert (job["JobState"], job["ExitCode"], job["NumTasks"]) == ("FAILED", "3:0", "2")


def test_gloo_all_reduce_across_srun_tasks(slurm_cluster, tmp_path):
    """Two srun tasks form one torch.distributed group from the SLURM_* variables alone."""
    (tmp_path / "reduce.py").write_text(ALL_REDUCE)
    script = tmp_path / "reduce.sbatch"
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --ntasks=2
        export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
        export MASTER_PORT={free_port()}
        srun {sys.executable} {tmp_path}/reduce.py {tmp_path}
        """)
    )
    job_id = slurm_cluster.sbatch(script, options=(f"--output={tmp_path}/%j.out",))
    job = slurm_cluster.wait_job(job_id, timeout=120)
    log = (tmp_path / f"{job_id}.out").read_text()
    assert job["JobState"] == "COMPLETED", log
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world"], r["sum"]) for r in results] == [(0, 2, 3.0), (1, 2, 3.0)]


def test_requeue_restarts_the_batch_script(slurm_cluster, tmp_path):
    """A requeued job runs its script again with SLURM_RESTART_COUNT=1 (what resume relies on)."""
    script = tmp_path / "requeue.sbatch"
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --ntasks=1
        #SBATCH --requeue
        echo "start ${{SLURM_RESTART_COUNT:-0}}" >> {tmp_path}/trace
        if [ ! -e {tmp_path}/first ]; then touch {tmp_path}/first; sleep 300; fi
        echo end >> {tmp_path}/trace
        """)
    )
    job_id = slurm_cluster.sbatch(script, options=(f"--output={tmp_path}/%j.out",))
    deadline = time.monotonic() + 60
    while not (tmp_path / "first").exists():
        assert time.monotonic() < deadline, slurm_cluster.job(job_id)
        time.sleep(0.2)
    slurm_cluster.requeue(job_id)
    job = slurm_cluster.wait_job(job_id, timeout=60)
    assert (job["JobState"], job["Restarts"]) == ("COMPLETED", "1")
    assert (tmp_path / "trace").read_text().split("\n") == ["start 0", "start 1", "end", ""]


def test_submitit_sweep_with_cluster_slurm_config(slurm_cluster, tmp_path):
    """`-m cluster=slurm a=1,2` with the project's conf/cluster files: one Slurm job per point."""
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf" / "cluster", conf / "cluster")
    (conf / "config.yaml").write_text(
        "defaults:\n  - cluster: local\n  - _self_\nname: toy\nx: 0\nout: ???\n"
    )
    (tmp_path / "app.py").write_text(
        textwrap.dedent("""\
        import json, os
        import hydra

        @hydra.main(config_path="conf", config_name="config", version_base="1.3")
        def main(cfg):
            keys = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_JOB_PARTITION")
            info = {"x": cfg.x, **{k: os.environ.get(k) for k in keys}}
            with open(f"{cfg.out}/x{cfg.x}.json", "w") as f:
                json.dump(info, f)

        main()
        """)
    )
    argv = [
        sys.executable,
        "app.py",
        "-m",
        "cluster=slurm",
        "x=1,2",
        f"out={tmp_path}",
        f"cluster.partition={slurm_cluster.partition}",
        "cluster.cpus_per_task=1",
        "cluster.mem_gb=1",
        "cluster.timeout_min=5",
        f"hydra.sweep.dir={tmp_path}/sweep",
    ]
    res = subprocess.run(
        argv,
        cwd=tmp_path,
        env=job_env(slurm_cluster.env),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    jobs = [json.loads((tmp_path / f"x{x}.json").read_text()) for x in (1, 2)]
    assert [j["x"] for j in jobs] == [1, 2]
    assert all(j["SLURM_JOB_PARTITION"] == slurm_cluster.partition for j in jobs)
    # A sweep is submitted as one array: both jobs share the array's id.
    assert jobs[0]["SLURM_ARRAY_JOB_ID"] == jobs[1]["SLURM_ARRAY_JOB_ID"] is not None
