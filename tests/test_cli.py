"""The CLI's contract: one line on stderr and an exit code when things go wrong, nothing lost; a dry
run that writes nothing; a run dir per sweep point; a config snapshot per invocation; `--help`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import yaml

from pipeline import conf_dir
from pipeline.rundir import HeldFile, RunLock
from tests.conftest import CLI_TIMEOUT, lowbit_cmd


def lowbit(tmp_path, *args):
    proc = subprocess.run(
        lowbit_cmd(*args, "tracking=none"), cwd=tmp_path, capture_output=True, text=True,
        timeout=CLI_TIMEOUT,
    )  # fmt: skip
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


# The real CLI on a file system without flock (as some NFS mounts): flock fails with ENOLCK.
WITHOUT_FLOCK = (
    "import errno, fcntl, sys\n"
    "def refuse(*args): raise OSError(errno.ENOLCK, 'No locks available')\n"
    "fcntl.flock = refuse\n"
    "from pipeline.__main__ import main\n"
    "sys.argv = ['lowbit', *sys.argv[1:]]\n"
    "main()\n"
)
TINY_BOOTSTRAP = ("experiment=smoke", "stages=[bootstrap]", "stage.bootstrap.max_steps=2",
                  "stage.bootstrap.draft_max_steps=2", "tracking=none")  # fmt: skip


def lowbit_without_flock(tmp_path, run_dir):
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_FLOCK, *TINY_BOOTSTRAP, f"run_dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=CLI_TIMEOUT,
    )  # fmt: skip
    return proc, proc.stdout + proc.stderr


def test_without_flock_a_second_lowbit_exits_at_once_naming_the_heartbeat_holder(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    holder = HeldFile(run_dir / ".lock.held")  # a live lowbit on a file system without flock
    holder.acquire()
    try:
        proc, out = lowbit_without_flock(tmp_path, run_dir)
    finally:
        holder.release()
    errors = [line for line in out.splitlines() if "[ERROR]" in line]
    assert proc.returncode == 2, out[-3000:]
    me = f"is in use by pid {os.getpid()} on {socket.gethostname()}"
    assert len(errors) == 1 and me in errors[0]
    assert not (run_dir / "bootstrap").exists() and not (run_dir / ".lock.held").exists()


def _gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=CLI_TIMEOUT)
    return child.pid


@pytest.mark.parametrize("holder", ["process gone", "heartbeat old"])
def test_without_flock_a_stale_lock_is_taken_over_with_a_warning(tmp_path, holder):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    if holder == "process gone":  # on this host, its pid no longer runs
        stale = {"pid": _gone_pid(), "host": socket.gethostname(), "heartbeat": time.time()}
        why = "its process is gone"
    else:  # on another host (its pid cannot be checked), silent for an hour
        stale = {"pid": 1, "host": "elsewhere", "heartbeat": time.time() - 3600}
        why = "its heartbeat is 36"  # 3600 s and the seconds lowbit took to start
    (run_dir / ".lock.held").write_text(json.dumps(stale | {"since": "then"}))
    proc, out = lowbit_without_flock(tmp_path, run_dir)
    assert proc.returncode == 0, out[-3000:]
    warned = [line for line in out.splitlines() if "taking over the stale lock" in line]
    assert len(warned) == 1 and why in warned[0] and f"pid {stale['pid']} on " in warned[0]
    assert (run_dir / "bootstrap" / "_done.json").exists()
    assert not (run_dir / ".lock.held").exists()  # released at the end


def test_the_fallback_lock_heartbeat_is_refreshed_while_held(tmp_path, monkeypatch):
    from pipeline import rundir

    monkeypatch.setattr(rundir, "HEARTBEAT_S", 0.05)
    held = HeldFile(tmp_path / ".lock.held")
    held.acquire()
    try:
        first = json.loads(held.path.read_text())["heartbeat"]
        time.sleep(0.5)
        assert json.loads(held.path.read_text())["heartbeat"] > first
    finally:
        held.release()


@pytest.fixture
def read_only_run_dir(tmp_path):
    """An existing run dir that cannot be written: its own read-only mount when this runs as
    root (root writes through a mode of 0o555), else a mode of 0o555."""
    run_dir = tmp_path / "ro"
    run_dir.mkdir()
    if os.geteuid() != 0:
        run_dir.chmod(0o555)
        yield run_dir
        run_dir.chmod(0o755)
        return
    mount = ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(run_dir)]
    if subprocess.run(mount, capture_output=True, timeout=60).returncode != 0:
        pytest.skip("running as root without the right to mount a read-only file system")
    try:
        yield run_dir
    finally:
        subprocess.run(["umount", str(run_dir)], check=True, timeout=60)


@pytest.mark.parametrize("where", ["run dir", "below it"])
def test_a_read_only_run_dir_is_one_line_at_start(tmp_path, read_only_run_dir, where):
    run_dir = read_only_run_dir if where == "run dir" else read_only_run_dir / "new"
    proc, errors = lowbit(tmp_path, "experiment=smoke", f"run_dir={run_dir}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert len(errors) == 1, out[-3000:]
    assert f"run_dir {run_dir} cannot be written" in errors[0] and "writable" in errors[0]
    assert "Traceback" not in out and "running" not in out and "workflow" not in out


def test_a_crashing_stage_is_one_line_exit_1_with_the_traceback_in_its_log(tmp_path):
    # The real CLI with evaluate's run() replaced by one that fails the way a bug would.
    run_dir = tmp_path / "r"
    (run_dir / "bootstrap").mkdir(parents=True)
    (run_dir / "bootstrap" / "_done.json").write_text(json.dumps({"fingerprint": "x"}))
    code = (
        "import dataclasses, sys, pipeline.stages.evaluate as ev\n"
        "def boom(cfg, run, io): raise ValueError('shapes differ\\nsecond line')\n"
        "ev.STAGE = dataclasses.replace(ev.STAGE, run=boom)\n"
        "from pipeline.__main__ import main\n"
        f"sys.argv = ['lowbit', 'experiment=smoke', 'run_dir={run_dir}', 'stages=[evaluate]',"
        " 'tracking=none']\n"
        "main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
        timeout=CLI_TIMEOUT,
    )  # fmt: skip
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


def test_version_and_help(tmp_path):
    version = subprocess.run(
        lowbit_cmd("--version"), capture_output=True, text=True, timeout=CLI_TIMEOUT
    )
    assert version.returncode == 0 and version.stdout.strip().startswith("lowbit ")
    helped = subprocess.run(
        lowbit_cmd("--help"), capture_output=True, text=True, cwd=tmp_path, timeout=CLI_TIMEOUT
    )
    assert helped.returncode == 0 and helped.stdout.startswith("lowbit: compress an LLM")
    # Every config group with every option, the common overrides, the config printer.
    for group in ("model", "data", "quant", "trainer", "cluster", "tracking", "experiment"):
        options = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
        assert f"{group}: {', '.join(options)}" in helped.stdout
    for shown in ("dry_run=true", "stages=[", "quant.budget_bits=", "--cfg job --resolve", "-m "):
        assert shown in helped.stdout
    assert list(tmp_path.iterdir()) == []


def _snapshots(run_dir):
    """{overrides: resolved config} of each invocation's snapshot, oldest first."""
    found = []
    for folder in sorted((run_dir / ".hydra").iterdir()):
        overrides = yaml.safe_load((folder / "overrides.yaml").read_text())
        found.append((tuple(overrides), yaml.safe_load((folder / "config.yaml").read_text())))
    return found


def test_each_invocation_logs_and_snapshots_its_resolved_config(tmp_path):
    run_dir = tmp_path / "r"
    args = ["experiment=smoke", "stages=[bootstrap]", f"run_dir={run_dir}",
            "stage.bootstrap.max_steps=2", "stage.bootstrap.draft_max_steps=2"]  # fmt: skip
    proc, errors = lowbit(tmp_path, *args, "print_config=true")
    assert proc.returncode == 0 and not errors
    out = proc.stdout + proc.stderr
    assert -1 < out.index("print_config: true") < out.index("bootstrap    running")
    assert [p.name for p in (run_dir / ".hydra").glob("*/*.log")] == ["lowbit.log"]
    proc, errors = lowbit(tmp_path, *args, "verify=true")  # up to date: nothing reruns
    assert proc.returncode == 0 and not errors and "bootstrap    up to date" in proc.stdout
    (first, config), (second, again) = _snapshots(run_dir)
    assert first == (*args, "print_config=true", "tracking=none")
    assert second == (*args, "verify=true", "tracking=none")
    # Resolved: the interpolations are values (hydra.run.dir holds ${run_dir}, run_dir itself
    # is given; name comes from the experiment), and the log sits beside the snapshot.
    assert config["run_dir"] == str(run_dir) and config["name"] == "smoke"
    assert config["stage"]["bootstrap"]["max_steps"] == 2 and again["verify"] is True
    for folder in (run_dir / ".hydra").iterdir():
        assert "${" not in (folder / "config.yaml").read_text()
        # Hydra's own record beside it: the group choices and overrides it composed from.
        hydra = yaml.safe_load((folder / "hydra.yaml").read_text())["hydra"]
        assert hydra["runtime"]["choices"]["experiment"] == "smoke"
        assert hydra["runtime"]["output_dir"] == str(folder)
        assert tuple(hydra["overrides"]["task"]) in (first, second)


def test_a_dry_run_of_a_finished_run_lists_every_stage_up_to_date(smoke_run):
    run_dir = smoke_run["run_dir"]
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}

    def dry(*extra):
        proc = subprocess.run(
            lowbit_cmd(*smoke_run["args"], "--dry-run", *extra),
            cwd=smoke_run["dir"], capture_output=True, text=True, timeout=CLI_TIMEOUT,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.startswith("  ")]
        return {ln.split()[0]: ln.split(None, 1)[1] for ln in lines}

    verdicts = dry()
    assert list(verdicts) == list(smoke_run_stages(smoke_run))
    assert all(v.startswith("up to date (fingerprint ") for v in verdicts.values()), verdicts
    # The budget is read by allocate and quantize: they and what reads them will run, what comes
    # before will not.
    verdicts = dry("quant.budget_bits=2.5")
    assert verdicts["bootstrap"].startswith("up to date")
    assert verdicts["sensitivity"].startswith("up to date")
    changed = "will run: config changed: quant.budget_bits 3.0 -> 2.5"
    assert verdicts["allocate"] == verdicts["quantize"] == changed
    assert verdicts["distill"] == "will run (after quantize reruns)"
    assert verdicts["evaluate"] == "will run (after quantize, distill, reinforce rerun)"
    # Nothing was written: no stage folder, no lock, no log folder, no snapshot.
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


def smoke_run_stages(smoke_run):
    """The stages the smoke run ran, in order (each has its folder)."""
    from pipeline import stages

    return [s for s in stages.ORDER if (smoke_run["run_dir"] / s / "_done.json").exists()]


def test_each_point_of_a_sweep_gets_its_own_run_dir(tmp_path):
    proc, errors = lowbit(
        tmp_path, "-m", "experiment=smoke", "stages=[bootstrap]", "dry_run=true",
        "quant.budget_bits=2.5,3",
    )  # fmt: skip
    assert proc.returncode == 0 and not errors, proc.stderr[-3000:]
    dirs = [ln.split()[3] for ln in proc.stdout.splitlines() if ln.startswith("dry run of ")]
    base = tmp_path / "outputs" / "smoke"
    # Named by what the sweep varies only, not by every override on the command line.
    assert dirs == [str(base / "quant.budget_bits=2.5"), str(base / "quant.budget_bits=3")]


def test_each_sweep_point_keeps_its_log_and_hydra_files_in_its_own_run_dir(tmp_path):
    proc, errors = lowbit(
        tmp_path, "-m", "experiment=smoke", "stages=[bootstrap]", "stage.bootstrap.max_steps=2",
        "stage.bootstrap.draft_max_steps=2", "quant.budget_bits=2.5,3",
    )  # fmt: skip
    assert proc.returncode == 0 and not errors, proc.stderr[-3000:]
    for bits in ("2.5", "3"):
        point = tmp_path / "outputs" / "smoke" / f"quant.budget_bits={bits}"
        (snapshot,) = (point / ".hydra").iterdir()
        names = sorted(p.name for p in snapshot.iterdir())
        assert names == ["config.yaml", "hydra.yaml", "lowbit.log", "overrides.yaml"]
        hydra = yaml.safe_load((snapshot / "hydra.yaml").read_text())["hydra"]
        assert hydra["job"]["override_dirname"] == f"quant.budget_bits={bits}"
        config = yaml.safe_load((snapshot / "config.yaml").read_text())
        assert tmp_path / config["run_dir"] == point  # relative to where lowbit ran
        assert f"workflow smoke in {point};" in (snapshot / "lowbit.log").read_text()


def test_a_single_run_keeps_its_run_dir(tmp_path):
    proc, _ = lowbit(tmp_path, "experiment=smoke", "stages=[bootstrap]", "quant.budget_bits=3",
                     "--dry-run")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"dry run of {tmp_path / 'outputs' / 'smoke'} " in proc.stdout
    assert list(tmp_path.iterdir()) == []  # a dry run writes no Hydra log either
    # The documented way to see the config a run gets, interpolations resolved.
    shown = subprocess.run(
        lowbit_cmd("--cfg", "job", "--resolve", "experiment=smoke"),
        cwd=tmp_path, capture_output=True, text=True, timeout=CLI_TIMEOUT,
    )  # fmt: skip
    assert shown.returncode == 0 and "\nrun_dir: outputs/smoke\n" in shown.stdout
