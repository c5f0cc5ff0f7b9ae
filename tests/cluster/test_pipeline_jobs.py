"""lowbit under Slurm: the 2-rank sbatch job, a submitit sweep of four points, and resume after
requeue.

Each job runs experiment=smoke on the local cluster (tests/cluster/slurm.py), so a test takes
one to a few minutes on 2 cores; all are marked slow. Their own waits (the session's smoke run,
a job's start and end) add up to more than the suite's 15 min per test, hence their limit.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import time
from pathlib import Path

import mlflow
import pytest

from tests._require import require
from tests.test_preempt import ARGS, outputs, wait_for_checkpoint
from tests.test_resume import ARGS as WORKFLOW_ARGS
from tests.test_resume import digests

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


def test_a_sweep_of_four_points_finishes_with_the_bytes_of_each_point_run_alone(
    slurm_cluster, lowbit_cli, uninterrupted, tmp_path
):
    """`lowbit -m cluster=slurm quant.budget_bits=2.5,3,3.5,4`: one job array of four tasks, two
    at a time on the cluster's 2 CPUs, all logging into one sqlite store; each point writes the
    bytes it writes alone. Alone: the session's uninterrupted run for bootstrap and sensitivity
    (the budget reaches neither), then each point's allocate and quantize in a local sweep."""
    stages = ["bootstrap", "sensitivity", "allocate", "quantize"]
    budgets = ("2.5", "3", "3.5", "4")
    sweep = [lowbit_cli, "-m", *WORKFLOW_ARGS, f"stages=[{','.join(stages)}]"]
    sweep.append(f"quant.budget_bits={','.join(budgets)}")
    points = [Path("outputs", "smoke", f"quant.budget_bits={b}") for b in budgets]

    alone = tmp_path / "alone"
    for point in points:
        for stage in stages[:2]:
            shutil.copytree(uninterrupted / stage, alone / point / stage)
    log = tmp_path / "alone.log"
    rc = run_cmd([*sweep, "tracking=none"], env=slurm_cluster.env, cwd=alone, timeout=600, log=log)
    assert rc == 0, tail(log)

    jobs = tmp_path / "jobs"
    jobs.mkdir()
    uri = f"sqlite:///{jobs / 'mlflow.db'}"
    argv = [*sweep, "cluster=slurm", f"cluster.partition={slurm_cluster.partition}"]
    argv += ["cluster.cpus_per_task=1", "cluster.mem_gb=4", "cluster.timeout_min=20"]
    argv += [f"tracking.uri={uri}", f"tracking.artifact_location={jobs / 'mlartifacts'}"]
    argv += [f"hydra.sweep.dir={jobs / 'sweep'}"]
    log = tmp_path / "sweep.log"
    rc = run_cmd(argv, env=slurm_cluster.env, cwd=jobs, timeout=1200, log=log)
    assert rc == 0, tail(log)

    for budget, point in zip(budgets, points):
        assert digests(jobs / point, stages) == digests(alone / point, stages), budget
    plans = [(jobs / p / "allocate" / "bitplan.json").read_bytes() for p in points]
    assert plans[0] != plans[-1]  # the budget does reach the plan
    # One array, its tasks two at a time: some two points trained side by side.
    results = sorted(p.parent.name for p in (jobs / "sweep").rglob("*_result.pkl"))
    assert len(results) == 4 and len({r.rsplit("_", 1)[0] for r in results}) == 1, results
    timings = [read_done(jobs / p / "bootstrap")["timings"] for p in points]
    spans = sorted((t["start"], t["end"]) for t in timings)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])), spans

    client = mlflow.MlflowClient(uri)
    logged = client.search_runs([client.get_experiment_by_name("lowbit").experiment_id])
    assert {r.info.status for r in logged} == {"FINISHED"}
    # One sweep run, the four points' runs nested under it (each with its stages' runs): the
    # jobs found the sweep's run id in their own config, on other processes than the sweep's.
    (sweep_run,) = [r for r in logged if "mlflow.parentRunId" not in r.data.tags]
    assert len(logged) == 1 + 4 * (1 + len(stages))
    point_runs = {json.loads((jobs / p / "_mlflow.json").read_text())["run_id"] for p in points}
    nested = {r.info.run_id for r in logged
              if r.data.tags.get("mlflow.parentRunId") == sweep_run.info.run_id}  # fmt: skip
    assert nested == point_runs
    with open(jobs / "sweep" / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["quant.budget_bits"], r["status"]) for r in rows] == [
        (b, "finished") for b in budgets
    ]
    assert all(float(r["bits"]) <= float(b) for r, b in zip(rows, budgets)), rows


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
