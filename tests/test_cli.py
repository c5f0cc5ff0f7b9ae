"""The CLI's contract for things going wrong: one line on stderr, an exit code, nothing lost."""

from __future__ import annotations

import json
import subprocess
import sys

from pipeline.rundir import RunLock
from tests.conftest import lowbit_cmd


def lowbit(tmp_path, *args):
    proc = subprocess.run(
        lowbit_cmd(*args, "tracking=none"), cwd=tmp_path, capture_output=True, text=True
    )
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "[ERROR]" in line]
    return proc, errors


def test_an_empty_checkpoint_dir_is_one_line_before_any_stage(tmp_path):
    (tmp_path / "empty").mkdir()
    proc, errors = lowbit(
        tmp_path, "model=hf", f"model.target.path={tmp_path / 'empty'}", f"run_dir={tmp_path / 'r'}"
    )
    assert proc.returncode == 2
    assert len(errors) == 1 and "model.target.path=" in errors[0] and "config.json" in errors[0]
    assert "Traceback" not in proc.stderr and "running" not in proc.stderr


def test_a_second_lowbit_on_a_run_dir_in_use_exits_at_once(tmp_path):
    run_dir = tmp_path / "r"
    holder = RunLock(run_dir)
    holder.acquire()
    try:
        proc, errors = lowbit(tmp_path, "experiment=smoke", f"run_dir={run_dir}")
    finally:
        holder.release()
    assert proc.returncode == 2
    assert len(errors) == 1 and "is in use by pid" in errors[0]
    assert not (run_dir / "bootstrap").exists()


def test_a_crashing_stage_is_one_line_exit_1_with_the_traceback_in_its_log(tmp_path):
    # The real CLI with evaluate's run() replaced by one that fails the way a bug would.
    run_dir = tmp_path / "r"
    (run_dir / "bootstrap").mkdir(parents=True)
    (run_dir / "bootstrap" / "_done.json").write_text(json.dumps({"fingerprint": "x"}))
    code = (
        "import sys, pipeline.stages.evaluate as ev\n"
        "def boom(cfg, run, io): raise ValueError('shapes differ\\nsecond line')\n"
        "ev.run = boom\n"
        "from pipeline.__main__ import main\n"
        f"sys.argv = ['lowbit', 'experiment=smoke', 'run_dir={run_dir}', 'stages=[evaluate]',"
        " 'tracking=none']\n"
        "main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True
    )
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "[ERROR]" in line]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len(errors) == 1
    assert "stage evaluate failed: ValueError: shapes differ (traceback in" in errors[0]
    log = run_dir / "logs" / "evaluate.log"
    assert str(log) in errors[0] and "second line" in log.read_text()
    assert "Traceback" not in proc.stdout + proc.stderr


def test_an_npu_trainer_without_an_npu_is_one_line_before_any_rank(tmp_path):
    proc, errors = lowbit(tmp_path, "experiment=smoke", "trainer=npu", f"run_dir={tmp_path / 'r'}")
    assert proc.returncode == 2
    assert len(errors) == 1 and "trainer.accelerator" in errors[0] and "trainer=cpu" in errors[0]
    assert "starting" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


def test_version_help_and_log_file_say_lowbit(tmp_path):
    version = subprocess.run(lowbit_cmd("--version"), capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.strip().startswith("lowbit ")
    helped = subprocess.run(lowbit_cmd("--help"), capture_output=True, text=True)
    assert helped.stdout.startswith("lowbit is powered by Hydra")
    run_dir = tmp_path / "r"
    proc, errors = lowbit(
        tmp_path, "experiment=smoke", "stages=[bootstrap]", f"run_dir={run_dir}",
        "stage.bootstrap.max_steps=2", "stage.bootstrap.draft_max_steps=2", "print_config=true",
    )  # fmt: skip
    assert proc.returncode == 0 and not errors
    out = proc.stdout + proc.stderr
    assert -1 < out.index("print_config: true") < out.index("bootstrap    running")
    assert [p.name for p in (run_dir / ".hydra").glob("*/*.log")] == ["lowbit.log"]
