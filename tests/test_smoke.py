"""The whole `experiment=smoke` workflow through the CLI, and its rerun."""

from __future__ import annotations

import json
import subprocess

from mlflow.tracking import MlflowClient

from pipeline.evaluation.result import EvalResult
from tests.conftest import CLI_TIMEOUT, WORKFLOW_TIMEOUT, lowbit_cmd, make_cfg


def test_smoke_workflow_writes_every_stage(smoke_run):
    stages = list(make_cfg("experiment=smoke").stages)
    for stage in stages:
        done = json.loads((smoke_run["run_dir"] / stage / "_done.json").read_text())
        assert done["stage"] == stage and done["outputs"]
    ev = EvalResult.load(smoke_run["run_dir"] / "evaluate")
    # The bootstrap target is clearly better than the draft.
    assert ev.ppl["target_fp"] < ev.ppl["draft_fp"]
    # The standard protocol: the whole test split (smoke caps nothing), at the training length.
    proto = ev.ppl_protocol
    assert proto["split"] == "test" and proto["window"] == 64
    assert proto["windows"] > 100 and proto["tokens"] == proto["windows"] * 63
    assert 0 < ev.acceptance["draft_fp@target_fp"]["mix"] <= 1
    # Speed as the runtime decodes: the low-bit target on packed kernels, every pair vs theory.
    speed = ev.speed
    assert speed["plain"]["target_fp"]["kernels"] == "float (F.linear)"
    assert "pack" in speed["plain"]["target_distilled"]["kernels"]
    assert set(speed["speculative"]) == set(ev.acceptance)
    assert all(r["theoretical_speedup"] > 0 for r in speed["speculative"].values())
    assert "## Decode speed" in (smoke_run["run_dir"] / "report.md").read_text()


def test_smoke_mlflow_has_a_child_per_stage(smoke_run):
    client = MlflowClient(smoke_run["uri"])
    exp = client.get_experiment_by_name("lowbit")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    children = {r.info.run_name: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert set(children) == set(make_cfg("experiment=smoke").stages)
    assert children["evaluate"].data.metrics["ppl_target_fp"] > 1
    assert "eval.json" in {a.path for a in client.list_artifacts(children["evaluate"].info.run_id)}


def test_rerun_skips_everything_and_rewrites_nothing(smoke_run):
    # "Quickly" is a benchmark matter; here the proof is that no stage ran and no output moved.
    stages = list(make_cfg("experiment=smoke").stages)
    before = {s: (smoke_run["run_dir"] / s / "_done.json").stat().st_mtime_ns for s in stages}
    proc = subprocess.run(
        lowbit_cmd(*smoke_run["args"]), cwd=smoke_run["dir"], capture_output=True, text=True,
        timeout=CLI_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    for stage in stages:
        assert f"{stage}" in log and "skipped" in log
    assert "running" not in log
    after = {s: (smoke_run["run_dir"] / s / "_done.json").stat().st_mtime_ns for s in stages}
    assert after == before


def test_a_flipped_byte_in_quantized_weights_is_found_and_repaired(smoke_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(smoke_run["run_dir"], run_dir)  # copy2: sizes and mtimes kept
    shard = sorted((run_dir / "quantize" / "model").glob("*.safetensors"))[0]
    before = json.loads((run_dir / "quantize" / "_done.json").read_text())
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    args = ["experiment=smoke", f"run_dir={run_dir}", "tracking=none"]

    proc = subprocess.run(
        lowbit_cmd(*args, "--no-repair"), capture_output=True, text=True, timeout=CLI_TIMEOUT
    )
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "[ERROR]" in line]
    assert proc.returncode == 2 and len(errors) == 1 and shard.name in errors[0]

    # quantize reruns, and the check re-reads every later stage's outputs
    proc = subprocess.run(
        lowbit_cmd(*args), capture_output=True, text=True, timeout=WORKFLOW_TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert f"quantize     outputs damaged: {shard}" in log and "quantize     running" in log
    # quantize is deterministic: the same digest again, so no reader of it reran.
    after = json.loads((run_dir / "quantize" / "_done.json").read_text())
    assert after["outputs_digest"] == before["outputs_digest"]
    for stage in ("distill", "reinforce", "evaluate", "export"):
        assert f"{stage:<12} up to date" in log


def test_the_log_is_lowbits_lines_and_lightnings_once(smoke_run):
    lines = smoke_run["log"].splitlines()
    assert not [ln for ln in lines if ln.startswith("INFO: ")]  # Lightning's second handler
    assert "litlogger" not in smoke_run["log"] and "FLOPs" not in smoke_run["log"]
    # Progress bars are off without a terminal: no line of glued-together refreshes.
    assert max(len(ln) for ln in lines) < 1000
    assert "Downloading artifacts" not in smoke_run["log"]  # MLflow's bar while registering
    assert "Loading weights" not in smoke_run["log"]  # transformers' bar, read at its import
    assert not [ln for ln in lines if "site-packages/lightning" in ln]  # expected warnings
    # The run's where and what come first, before any stage.
    first = next(i for i, ln in enumerate(lines) if "running (fingerprint" in ln)
    head = "\n".join(lines[:first])
    assert "overrides: experiment=smoke" in head and str(smoke_run["run_dir"]) in head
    assert "MLflow run " in head
