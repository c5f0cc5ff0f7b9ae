"""A throw-away single-node Slurm cluster for the cluster tests.

Idea: everything Slurm needs (config, state, spool, logs, pid files and a private munge
socket) lives in one temp dir, and every daemon runs in the foreground as a child of this
process. Nothing under /etc or /run is touched, a system Slurm or munge on the same machine
is left alone, and teardown only signals the PIDs started here.

Trade-off: the daemons run as root with proctrack/linuxproc and no cgroups or accounting,
which is what a CI container allows; `sacct` is therefore unavailable and job states are
read from `scontrol show job`.

Run `python tests/cluster/slurm.py` to get a cluster for manual experiments (Ctrl-C stops it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

# munged and the Slurm daemons live in /usr/sbin on Debian; the clients in /usr/bin.
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "sinfo", "scontrol", "scancel")
MUNGE_KEY = Path("/etc/munge/munge.key")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def _which(cmd: str) -> str | None:
    return shutil.which(cmd) or shutil.which(cmd, path="/usr/sbin:/sbin")


def _not_running(cmds: tuple[str, ...]) -> list[str]:
    """Those of ``cmds`` that do not even print their version (a broken or half-removed install),
    each with how it failed."""
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        # Slurm's clients read a config before anything else, even for --version.
        conf = Path(tmp) / "slurm.conf"
        conf.write_text("ClusterName=check\nSlurmctldHost=localhost\n")
        env = {**os.environ, "SLURM_CONF": str(conf)}
        for cmd in cmds:
            argv = [_which(cmd), "-V" if cmd in ("slurmctld", "slurmd") else "--version"]
            try:
                proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as e:
                failed.append(f"{argv[0]}: {type(e).__name__}")
                continue
            if proc.returncode != 0:
                out = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
                failed.append(": ".join([" ".join(argv), f"exit {proc.returncode}", *out]))
    return failed


def missing_requirements() -> str | None:
    """Why a local cluster cannot start here, or None when it can."""
    missing = [c for c in DAEMONS + CLIENTS if _which(c) is None]
    if missing:
        return f"Slurm/munge not installed (missing {', '.join(missing)}); run .ci/slurm.sh install"
    broken = _not_running(DAEMONS + CLIENTS)
    if broken:
        reinstall = "apt-get install --reinstall slurmctld slurmd slurm-client munge"
        return f"Slurm/munge tools do not run ({'; '.join(broken)}); reinstall: {reinstall}"
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its daemons as root; run the cluster tests as root"
    if not MUNGE_KEY.is_file():
        return f"{MUNGE_KEY} missing; reinstall munge (it generates the key)"
    return None


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the process that started it dies.

    Linux's PR_SET_PDEATHSIG; it keeps a killed test session from leaving daemons behind.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def free_port() -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 trick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    """One slurmctld + one slurmd + a private munged, all rooted in ``root``.

    Args:
        root: Empty directory that will hold config, state and logs.
        cpus: CPUs the node advertises (jobs can use at most this many tasks).
        partition: Name of the single default partition.
    """

    def __init__(self, root: Path, cpus: int = 2, partition: str = "local") -> None:
        self.root = Path(root)
        self.cpus = cpus
        self.partition = partition
        self.hostname = socket.gethostname()
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.sock"
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self._logs: list = []
        # Clients (sbatch, srun, ...) and the jobs they start inherit this environment.
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ lifecycle
    def write_config(self) -> None:
        for sub in ("munge", "state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged insists that every directory on the socket path is traversable.
        self.root.chmod(0o755)
        key = self.root / "munge" / "munge.key"
        shutil.copyfile(MUNGE_KEY, key)
        key.chmod(0o600)
        r, h = self.root, self.hostname
        lines = [
            "ClusterName=lowbit-test",
            f"SlurmctldHost={h}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobRequeue=1",
            # Keep finished jobs visible to `scontrol show job` for the whole session.
            "MinJobAge=3600",
            "KillWait=5",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd.log",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd.pid",
            f"NodeName={h} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=20000 State=UNKNOWN",
            f"PartitionName={self.partition} Nodes={h} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")  # noqa: SIM115 (closed in stop)
        self._logs.append(log)
        proc = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        self._procs.append((name, proc))

    def start(self, timeout: float = 60.0) -> None:
        """Write the config, start the daemons and wait until the node is idle."""
        self.write_config()
        m = self.root / "munge"
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={m / 'munge.key'}",
                f"--pid-file={m / 'munged.pid'}",
                f"--seed-file={m / 'munged.seed'}",
            ],
        )
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged socket")
        # -D: stay in the foreground so the PID we hold is the daemon; -c: ignore old state.
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-c", "-f", str(self.conf)])
        self._spawn(
            "slurmd", [_which("slurmd"), "-D", "-c", "-f", str(self.conf), "-N", self.hostname]
        )
        self._wait(self._node_idle, timeout, "node idle in sinfo")

    def stop(self) -> None:
        """Cancel every job, then stop the daemons started here (children first)."""
        if any(p.poll() is None for n, p in self._procs if n == "slurmctld"):
            subprocess.run(
                ["scancel", "--full", f"--partition={self.partition}"],
                env=self.env,
                capture_output=True,
                timeout=30,
            )
            time.sleep(1)
        for _name, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> LocalSlurm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self._procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited during startup; {self.log_tail()}")
            if ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"local Slurm: no {what} after {timeout:.0f} s; {self.log_tail()}")

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout
        return out.strip() == "idle"

    def log_tail(self, lines: int = 20) -> str:
        """Last lines of every daemon log, for error messages."""
        parts = []
        # The *.log files carry timestamps; munged (and a daemon that dies early) only stderr.
        logs = sorted((self.root / "log").glob("*.log")) + [self.root / "log" / "munged.out"]
        for log in logs:
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(tail))
        return "logs:\n" + "\n".join(parts)

    # ------------------------------------------------------------------ clients
    def run(self, *argv: str, check: bool = True, timeout: float = 60.0, **kw):
        """Run a Slurm client (``sbatch``, ``srun``, ...) against this cluster."""
        return subprocess.run(
            list(argv),
            env=kw.pop("env", self.env),
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            **kw,
        )

    def sbatch(self, script: str | Path, *args: str, options: tuple[str, ...] = (), **kw) -> int:
        """Submit ``script`` (with ``options`` before it and ``args`` after); return the job id."""
        out = self.run("sbatch", "--parsable", *options, str(script), *args, **kw).stdout
        return int(out.strip().splitlines()[-1].split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        fields = {}
        for token in out.split():
            key, sep, value = token.partition("=")
            if sep:
                fields[key] = value
        return fields

    def requeue(self, job_id: int, timeout: float = 60.0) -> None:
        """Requeue a job and let it start again at once.

        Slurm holds a requeued job for about two minutes (BeginTime); real clusters want that
        back-off, a test does not, so the begin time is reset once the job is pending again.
        Not at once, though: slurmd refuses a launch whose credential dates from the same
        second as the revocation of the killed run's ("Job credential revoked").
        """
        self.run("scontrol", "requeue", str(job_id))
        self.release(job_id, timeout)

    def release(self, job_id: int, timeout: float = 60.0) -> None:
        """Start a job that was requeued (by `requeue` or by itself) at once (see `requeue`)."""
        deadline = time.monotonic() + timeout
        while (state := self.job(job_id).get("JobState")) != "PENDING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"requeued job {job_id} did not return to PENDING ({state})")
            time.sleep(0.2)
        time.sleep(1.5)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def wait_job(self, job_id: int, timeout: float = 600.0, poll: float = 1.0) -> dict[str, str]:
        """Block until the job reaches a final state; return its ``scontrol`` fields."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            time.sleep(poll)
        raise TimeoutError(
            f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout} s"
        )


def _exit_on_signal(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    reason = missing_requirements()
    if reason:
        raise SystemExit(reason)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    with LocalSlurm(Path(tempfile.mkdtemp(prefix="lowbit-slurm-"))) as cluster:
        print(f"export SLURM_CONF={cluster.conf}\n(Ctrl-C stops the cluster)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
