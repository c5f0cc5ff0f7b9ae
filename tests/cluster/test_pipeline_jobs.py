"""lowbit under Slurm: the 2-rank sbatch job, a submitit sweep, and resume after requeue.

Each job runs experiment=smoke on the local cluster (tests/cluster/slurm.py), so a test takes
one to a few minutes on 2 cores; all are marked slow. Their own waits (the session's smoke run,
a job's start and end) add up to more than the suite's 15 min per test, hence their limit.
"""

from __future__ import annotations

import csv
import json
import re
import time

import mlflow
import pytest

from tests._require import require
from tests.test_preempt import ARGS, outputs, wait_for_checkpoint

from .runs import REPO, SMOKE_STAGES, overrides, read_done, run_cmd, tail
from .slurm import missing_requirements

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_sbatch_two_rank_job_runs_every_stage(slurm_cluster, smoke_2rank_run):
    """jobs/smoke.sbatch: 2 srun tasks form one workflow; each stage done once, tracked once."""
    if smoke_2rank_run.launcher != "slurm":
        require("slurm", f"the smoke run did not go through Slurm: {missing_requirements()}")
    assert smoke_2rank_run.job["NumTasks"] == "2"
    for stage in SMOKE_STAGES:
        done = read_done(smoke_2rank_run.run_dir / stage)
        assert done["metrics"]["world_size"] == 2, (stage, done["metrics"])

    client = mlflow.MlflowClient(smoke_2rank_run.tracking_uri)
    exp = client.get_experiment_by_name(smoke_2rank_run.experiment)
    assert exp is not None, f"no MLflow experiment {smoke_2rank_run.experiment!r}"
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    # Only rank 0 talks to MLflow: one parent and exactly one child per stage.
    assert len(parents) == 1, [r.info.run_name for r in parents]
    assert sorted(r.info.run_name for r in children) == sorted(SMOKE_STAGES)
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    assert {r.info.status for r in runs} == {"FINISHED"}


def test_submitit_sweep_runs_one_job_per_budget(slurm_cluster, lowbit_cli, tmp_path, mlflow_server):
    """`lowbit -m cluster=slurm quant.budget_bits=3,4`: two Slurm jobs, each with its own run,
    both nested under the sweep's MLflow run and summed up in its table.

    bootstrap, sensitivity, allocate is the cheapest stage list in which the budget matters.
    """
    stages = ["bootstrap", "sensitivity", "allocate"]
    run_dir = tmp_path / "bits${quant.budget_bits}"
    argv = [lowbit_cli, "-m", "experiment=smoke", "cluster=slurm", "quant.budget_bits=3,4"]
    argv += overrides(run_dir, stages, mlflow_server, f"hydra.sweep.dir={tmp_path}/sweep")
    argv += [f"tracking.experiment=submitit-{tmp_path.name}"]
    argv += [f"cluster.partition={slurm_cluster.partition}", "cluster.cpus_per_task=1"]
    argv += ["cluster.mem_gb=4", "cluster.timeout_min=20"]
    log = tmp_path / "sweep.log"
    rc = run_cmd(argv, env=slurm_cluster.env, cwd=tmp_path, timeout=900, log=log)
    assert rc == 0, tail(log)

    runs = {bits: tmp_path / f"bits{bits}" for bits in (3, 4)}
    done = {bits: {s: read_done(d / s) for s in stages} for bits, d in runs.items()}
    # Same config up to the budget: bootstrap agrees, the allocation reflects each budget.
    assert done[3]["bootstrap"]["fingerprint"] == done[4]["bootstrap"]["fingerprint"]
    assert done[3]["allocate"]["fingerprint"] != done[4]["allocate"]["fingerprint"]
    plans = {bits: (d / "allocate" / "bitplan.json").read_text() for bits, d in runs.items()}
    assert plans[3] != plans[4]
    # Both ran as tasks of one Slurm array: submitit keeps a result per `<array id>_<task>`.
    results = sorted(p.parent.name for p in (tmp_path / "sweep").rglob("*_result.pkl"))
    assert len(results) == 2 and results[0][:-1] == results[1][:-1], results

    # The jobs found the sweep's run id in their own config, on another process than the sweep.
    with open(tmp_path / "sweep" / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    done = [(r["quant.budget_bits"], r["status"]) for r in rows]
    assert done == [("3", "finished"), ("4", "finished")]
    assert all(float(r["bits"]) <= budget for r, budget in zip(rows, (3, 4))), rows
    client = mlflow.MlflowClient(mlflow_server)
    parent = json.loads((tmp_path / "sweep" / "_mlflow.json").read_text())["run_id"]
    exp = client.get_run(parent).info.experiment_id
    nested = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent}'")
    points = {json.loads((d / "_mlflow.json").read_text())["run_id"] for d in runs.values()}
    assert {r.info.run_id for r in nested} == points


def test_requeued_job_resumes_without_recomputing_done_stages(slurm_cluster, lowbit_cli, tmp_path):
    """Requeue after bootstrap finished: the restarted job keeps bootstrap and completes."""
    stages = ["bootstrap", "sensitivity"]
    run_dir = tmp_path / "run"
    args = overrides(run_dir, stages, None, "trainer=cpu")
    log = tmp_path / "job.log"
    job_id = slurm_cluster.sbatch(
        REPO / "jobs" / "smoke.sbatch", *args,
        options=("--ntasks=1", "--ntasks-per-node=1", f"--output={log}", f"--chdir={tmp_path}"),
    )  # fmt: skip
    marker = run_dir / "bootstrap" / "_done.json"
    deadline = time.monotonic() + 600
    while not marker.exists():
        state = slurm_cluster.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING"), f"{state} before bootstrap finished; {tail(log)}"
        assert time.monotonic() < deadline, f"bootstrap not done after 600 s; {tail(log)}"
        time.sleep(0.5)
    before = (marker.read_bytes(), marker.stat().st_mtime_ns)
    slurm_cluster.requeue(job_id)

    job = slurm_cluster.wait_job(job_id, timeout=600)
    assert (job["JobState"], job["Restarts"]) == ("COMPLETED", "1"), tail(log)
    assert (marker.read_bytes(), marker.stat().st_mtime_ns) == before
    read_done(run_dir / "sensitivity")


@pytest.mark.parametrize("ranks", [1, 2])
def test_time_limit_signal_checkpoints_requeues_and_resumes_to_the_same_bytes(
    slurm_cluster, lowbit_cli, tmp_path, ranks
):
    """The warning `#SBATCH --signal=USR1@...` sends before the limit, sent now to the job's
    steps as Slurm does (`scancel --signal`): the training stage checkpoints (2 ranks: at the
    step both agree on), lowbit requeues the job, and the requeued job finishes with the bytes of
    an uninterrupted run on as many ranks."""
    trainer = "trainer=cpu" if ranks == 1 else "trainer=ddp"  # ddp: lowbit starts 2 ranks itself
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    log = tmp_path / "whole.log"
    rc = run_cmd([lowbit_cli, *ARGS, f"run_dir={whole}", trainer], env=slurm_cluster.env,
                 cwd=tmp_path, timeout=600, log=log)  # fmt: skip
    assert rc == 0, tail(log)

    log = tmp_path / "job.log"
    tasks = (f"--ntasks={ranks}", f"--ntasks-per-node={ranks}")
    job_id = slurm_cluster.sbatch(
        REPO / "jobs" / "smoke.sbatch", *ARGS, f"run_dir={cut}", trainer,
        options=(*tasks, f"--output={log}", f"--chdir={tmp_path}"),
    )  # fmt: skip

    def running() -> bool:
        return slurm_cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING")

    ckpt = wait_for_checkpoint(cut, running, timeout=600)
    slurm_cluster.run("scancel", "--signal=USR1", str(job_id))
    slurm_cluster.release(job_id)

    job = slurm_cluster.wait_job(job_id, timeout=600)
    assert (job["JobState"], job["Restarts"]) == ("COMPLETED", "1"), tail(log)
    said = re.search(
        rf"training checkpointed at step (\d+) in {re.escape(str(ckpt))}; Slurm job {job_id} "
        "requeued", log.read_text()
    )  # fmt: skip
    assert said, tail(log)
    step = int(said.group(1))
    resumed = outputs(cut)
    assert resumed.pop("target_resumed_step") == step
    assert resumed == {k: v for k, v in outputs(whole).items() if k != "target_resumed_step"}
