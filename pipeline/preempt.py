"""A job's time limit: checkpoint at the next step boundary, stop, and have Slurm requeue the job.

Slurm sends SIGUSR1 a while before a job's time limit when asked (`#SBATCH --signal=USR1@90`, as
the files in jobs/ do), and SIGTERM at preemption or `scancel`. `install` (the CLI calls it)
handles both. While a training stage runs its steps (`defer`), the handler only records the
signal: the stage's `ResumeCheckpoint` saves `last.ckpt` at the next step boundary, every rank
agreeing, and raises `stopped(...)`. Anywhere else the handler raises at once, as Ctrl-C does:
stage folders are committed atomically and quantize resumes per segment, so nothing is lost but
the unfinished segment. On SIGUSR1 under Slurm, rank 0 then runs `scontrol requeue $SLURM_JOB_ID`
(a SIGTERM may be the user's `scancel`, so it only stops), and the requeued job resumes to the
bytes an uninterrupted run writes. Exit status 75 (EX_TEMPFAIL): rerun the same command.

Lightning's own SLURM auto-requeue is switched off (`pipeline.lit.trainer.build_trainer`): it
saves from inside the signal handler, possibly mid-step or mid-validation, which cannot resume
exactly, and it covers the training stages only.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

from pipeline.errors import LowbitError

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
REQUEUE_ON = signal.SIGUSR1  # the time-limit warning; SIGTERM may be a deliberate scancel


class Preempted(LowbitError):
    """Stopped by a signal with the run resumable; the same command continues it."""

    exit_code = 75  # os.EX_TEMPFAIL: a temporary failure, retry


_state: dict = {"installed": False, "signal": None, "deferred": False}


def install() -> None:
    """Handle SIGUSR1 and SIGTERM in this process (main thread only, as `signal` requires)."""
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)
    _state.update(installed=True, signal=None, deferred=False)


def installed() -> bool:
    return _state["installed"]


def received() -> signal.Signals | None:
    """The signal this process got, or None."""
    return _state["signal"]


def _name(sig: int) -> str:
    return signal.Signals(sig).name


def _on_signal(signum: int, frame) -> None:
    if _state["signal"] is not None:
        return  # the SIGTERM of our own requeue, or a repeat: already stopping
    _state["signal"] = signal.Signals(signum)
    log.warning("received %s: stopping at the next safe point", _name(signum))
    if not _state["deferred"]:
        raise stopped("the run stopped before its next stage finished")


def reinstall() -> None:
    """Take SIGTERM back from a Lightning Trainer, which registers its own at fit start: that
    one exits without a checkpoint and broadcasts from inside the handler."""
    if _state["installed"]:
        for sig in SIGNALS:
            signal.signal(sig, _on_signal)


def defer(on: bool) -> None:
    """While training steps run (on), a signal waits for the step boundary instead of raising."""
    _state["deferred"] = on and _state["installed"]


def stopped(what: str) -> Preempted:
    """The error to raise once the run is resumable; on rank 0 of a Slurm job stopped by the
    time-limit warning, the job is requeued first."""
    sig = _state["signal"]
    how = _requeue() if sig == REQUEUE_ON and _main_rank() else "rerun the same command to resume"
    return Preempted(f"received {_name(sig) if sig else 'a signal'}: {what}; {how}")


def _main_rank() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def _requeue() -> str:
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return "rerun the same command to resume"
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    try:
        proc = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        problem = str(e)
    else:
        if proc.returncode == 0:
            return f"Slurm job {job} requeued; it resumes from here"
        problem = (proc.stderr or proc.stdout).strip() or f"exit {proc.returncode}"
    return f"requeueing Slurm job {job} failed ({problem}); resubmit the job to resume"
