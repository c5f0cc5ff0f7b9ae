"""Runs the configured stages in order, each exactly once per fingerprint.

The config is parsed once (`plan`); each stage's `run(cfg, run, io)` gets its parsed
`stage.<name>`, a RunConfig of the sections it lists, and a StageIO, and
`pipeline.stageplan` decides from their fingerprint which stages run. A stage writes into
`<run_dir>/.<stage>.tmp/`, renamed into place with its `_done.json`, so a crash never leaves a
half-written stage folder; crash-surviving work goes to `<run_dir>/.work/<stage>-<fingerprint>/`.
Every rank runs this loop; rank 0 writes, the others wait at barriers.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from pipeline import __version__, stages
from pipeline.config import (
    RunConfig,
    TrackingConfig,
    parse,
    plan_cfg,
    run_config,
    to_plain,
    tracking_cfg,
)
from pipeline.dist import Dist, init_from_env
from pipeline.errors import ConfigError, Interrupted, LowbitError, StageFailed, record_failure
from pipeline.hardware import describe, where
from pipeline.inputs import check_inputs
from pipeline.lit.devices import stage_device
from pipeline.lit.trainer import check_trainer
from pipeline.memplan import Capacity, MemoryPlan, capacity, plan_run
from pipeline.peakmem import StagePeak, device_line
from pipeline.preempt import Preempted
from pipeline.report import write_report
from pipeline.rundir import DONE, RunLock, commit, outputs_digest, read_done, record_outputs
from pipeline.stageplan import PENDING, Damage, Stage, Step, fingerprint, steps
from pipeline.stages import StageIO
from pipeline.tracking import StageRun, Tracker

if TYPE_CHECKING:
    import torch

__all__ = [
    "Plan",
    "Stage",
    "StageIO",
    "check_stage",
    "fingerprint",
    "plan",
    "preview",
    "run",
    "stage_config",
]

log = logging.getLogger(__name__)


def make_stage(cfg: DictConfig, name: str, run: RunConfig) -> Stage:
    """Parse `stage.<name>` and cut the stage's view of `run` (every section parsed)."""
    decl = stages.load(name)
    parsed = parse(cfg.get("stage", {}).get(name), decl.config, f"stage.{name}")
    if hasattr(parsed, "scaled"):  # nulls chosen by the model's size, before any fingerprint
        parsed = parsed.scaled(run)
    return Stage(name, decl, parsed, run.view(tuple(decl.sections)))


def stage_config(cfg: DictConfig, name: str) -> tuple[Any, RunConfig]:
    """(parsed stage.<name>, its RunConfig): what the stage's `run` and `check` receive."""
    stage = make_stage(cfg, name, run_config(cfg))
    return stage.cfg, stage.run


def check_stage(cfg: DictConfig, name: str) -> None:
    """Parse and check one stage's config as `plan` does; raises ConfigError naming the key."""
    make_stage(cfg, name, run_config(cfg)).check()


@dataclass(frozen=True)
class Plan:
    """The validated run: every section parsed once, the selected stages in order."""

    run: RunConfig  # every run-wide section
    tracking: TrackingConfig
    stages: list[Stage]


# The top-level switches of one invocation (conf/config.yaml); none is part of a fingerprint.
FLAGS = ("force", "verify", "repair", "print_config", "dry_run")


def plan(cfg: DictConfig, run_dir: Path) -> Plan:
    """Parse every section and check the selected stages, before any compute."""
    selected = list(cfg.stages)
    if not selected:
        raise ConfigError("stages", "is empty", ", ".join(stages.ORDER))
    for name in selected:
        stages.load(name)  # an unknown name fails here, naming the known ones
    order = [n for n in stages.ORDER if n in selected]
    if order != selected:
        raise ConfigError("stages", f"is out of order {selected}", f"this order: {order}")
    for flag in FLAGS:
        value = cfg.get(flag, False)
        if not isinstance(value, bool):  # `dry_run=no` would be the string "no": true
            raise ConfigError(flag, f"must be a boolean, got {value!r}", "true, false")
    # The shared sections are checked whatever the stages, so a typo never waits for its stage.
    run = run_config(cfg)
    tracking = tracking_cfg(cfg)
    memory = plan_cfg(cfg)
    if not memory.show:  # `--plan` needs only config.json: before a download, on a login node
        check_inputs(run.model, run.data)
        check_trainer(run.trainer)  # before any rank starts: `lowbit` relaunches after plan()
        stage_device(run.trainer)  # every stage's device: an accelerator none can use fails here
    _check_recipe(run, selected, run_dir)
    chosen = [make_stage(cfg, name, run) for name in selected]
    for stage in chosen:
        stage.check()
        for need in stage.decl.needs:
            if need in selected or read_done(run_dir / need) is not None:
                continue
            if not make_stage(cfg, need, run).skip_reason():
                raise ConfigError(
                    "stages",
                    f"runs {stage.name!r}, which needs the outputs of {need!r}, but "
                    f"{run_dir / need} has none",
                    f"add {need!r} to stages",
                )
    planned = Plan(run, tracking, chosen)
    # A dry run and `--plan` show the plan, problems included, rather than refuse it.
    if memory.check and not memory.show and not cfg.get("dry_run"):
        check_memory(cfg, planned)
    return planned


def memory_plan(cfg: DictConfig, planned: Plan) -> tuple[MemoryPlan, Capacity]:
    """The memory plan of the stages that will not be skipped (pipeline.memplan), and what
    this machine (or the allocation) has."""
    running = {s.name: s.cfg for s in planned.stages if not s.skip_reason()}
    if not cfg.verify and any(read_done(Path(cfg.run_dir).resolve() / name) for name in running):
        # A resumed run: stages already up to date are skipped, so neither their own peaks nor
        # what the process keeps after them (Lightning, the corpus) are part of this run's.
        # Under --verify that needs every output hashed, which the run does again: plan them all.
        ahead = {step.stage.name for step in preview(cfg, planned) if step.runs}
        running = {name: c for name, c in running.items() if name in ahead}
    memory = plan_run(planned.run, running)
    return memory, capacity(plan_cfg(cfg), memory.device, cfg.get("cluster"))


def check_memory(cfg: DictConfig, planned: Plan) -> None:
    """Refuse, before any compute, a run whose plan does not fit, in one line with the fix."""
    memory, available = memory_plan(cfg, planned)
    problems = memory.fits(available)
    if problems:
        raise LowbitError(f"the run will not fit: {problems[0]}")


def _check_recipe(run: RunConfig, selected: list[str], run_dir: Path) -> None:
    """A mixed recipe is only ever quantized by its bit plan, never by a silent fallback."""
    q = run.quant
    mixed = len(q.candidates) > 1 or q.float_fallback > 0
    if "quantize" not in selected or not mixed or "allocate" in selected:
        return
    if read_done(run_dir / "allocate") is None:
        raise ConfigError(
            "stages",
            f"quantizes with a mixed recipe (quant.candidates={list(q.candidates)}, "
            f"budget_bits={q.budget_bits}) but no bit plan exists in {run_dir / 'allocate'}",
            "add sensitivity and allocate before quantize, or choose a uniform recipe "
            "(e.g. quant=w3g128)",
        )


def _log_outputs(run: StageRun, stage_dir: Path) -> None:
    """Small human-readable outputs (JSON, plots, reports) go to MLflow; weights do not."""
    for p in sorted(stage_dir.glob("*")):
        if p.is_file() and p.suffix in {".json", ".png", ".md", ".csv"} and p.stat().st_size < 5e6:
            run.log_artifact(p)


def summary_line(name: str, seconds: float, metrics: dict[str, Any]) -> str:
    """The stage's time, its first four numbers, and its peak memory (pipeline.peakmem)."""
    peaks = {k: v for k, v in metrics.items() if "peak" in k and k.endswith("_mib")}
    numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float) and k not in peaks}
    shown = [f"{k}={v:.4g}" for k, v in list(numbers.items())[:4]]
    peak = "  ".join(f"{k.removesuffix('_mib')} {v / 1024:.2f} GiB" for k, v in peaks.items())
    return (
        f"{name:<12} done in {seconds:7.1f}s  " + "  ".join(shown) + (f"  | {peak}" if peak else "")
    )


def run(cfg: DictConfig, planned: Plan | None = None) -> dict[str, dict]:
    """Run the workflow; returns {stage: its _done.json}. `planned`: `plan(cfg, run_dir)`."""
    dist = init_from_env((cfg.get("trainer") or {}).get("dist_backend"))
    run_dir = Path(cfg.run_dir).resolve()
    if planned is None:
        planned = plan(cfg, run_dir)
    lock = RunLock(run_dir)
    refused = None
    if dist.is_main:
        try:
            lock.acquire()
        except LowbitError as e:
            refused = str(e)
    refused = dist.broadcast(refused)
    if refused:
        raise LowbitError(refused)
    try:
        with _sigint_noted():
            return _run_locked(cfg, planned, run_dir, dist)
    finally:
        lock.release()


_SIGINTS: list[float] = []  # when SIGINT arrived during this process's workflow


@contextmanager
def _sigint_noted():
    """Ctrl-C raises KeyboardInterrupt as usual, and is noted: Lightning turns it inside `fit`
    into its own `sys.exit(1)`, which must still read as an interruption, not a crash."""

    def note(signum, frame):
        _SIGINTS.append(time.time())
        raise KeyboardInterrupt

    _SIGINTS.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted(error: BaseException | None) -> bool:
    return isinstance(error, KeyboardInterrupt | Interrupted) or (
        isinstance(error, SystemExit) and bool(_SIGINTS)
    )


def _run_locked(cfg: DictConfig, planned: Plan, run_dir: Path, dist: Dist) -> dict[str, dict]:
    tracker = Tracker(planned.tracking, run_dir, active=dist.is_main)
    name = planned.run.name
    if dist.is_main:
        tracker.connect()
        tracker.start_parent(name, to_plain(cfg))
        # What a user looks for first, before hours of stages scroll by.
        chosen = ", ".join(s.name for s in planned.stages)
        log.info("workflow %s in %s; stages %s", name, run_dir, chosen)
        log.info("machine: %s", describe(where()))  # what every timing of this run is from
        if tracker.active:
            log.info("MLflow run %s: %s", tracker.parent.run_id, tracker.ui_command())
    device = stage_device(planned.run.trainer, dist.local_rank)
    accelerator = (planned.run.trainer or {}).get("accelerator", "auto")
    log.info("stages compute on %s (trainer.accelerator=%s)", device, accelerator)
    dist.barrier()

    results: dict[str, dict] = {}
    t_start = time.time()
    status = "FAILED"
    try:
        damage = _damage(cfg, run_dir, dist)
        todo = damage.add_repairs(planned.stages, lambda n: make_stage(cfg, n, planned.run))
        known: dict[str, dict] = {}  # stage -> its _done.json, for fingerprints of readers
        for step in steps(todo, run_dir, damage, bool(cfg.force), known):
            name = step.stage.name
            if step.action == "not needed":
                log.info("%-12s not needed: %s", name, step.why)
            elif not step.runs:
                log.info("%-12s up to date (fingerprint %s), skipped", name, step.fingerprint[:12])
                results[name] = step.done
            else:
                known[name] = results[name] = _run_stage(step, run_dir, dist, tracker, device)
        status = "FINISHED"
    except (KeyboardInterrupt, Interrupted, Preempted):
        status = "KILLED"
        raise
    finally:
        if dist.is_main:
            tracker.parent.end(status)
    if dist.is_main:
        report = write_report(run_dir)
        tracker.parent.log_artifact(report)
        for plot in sorted(run_dir.glob("*/*.png")):
            tracker.parent.log_artifact(plot, "plots")
        log.info("workflow %s finished in %.1fs; report %s", name, time.time() - t_start, report)
        if tracker.active:
            log.info("MLflow: %s", tracker.ui_command())
    # Ranks leave together: a rank that exits while rank 0 still writes the report tears the
    # process group down under a live peer (suspected in a gloo rank 0's rare abort at exit).
    dist.barrier()
    return results


def _damage(cfg: DictConfig, run_dir: Path, dist: Dist, report: bool = True) -> Damage:
    return Damage(run_dir, dist, verify=cfg.verify, repair=cfg.repair, report=report)


def preview(cfg: DictConfig, planned: Plan) -> list[Step]:
    """What `run` would do, stage by stage, without running or writing anything (a dry run)."""
    run_dir = Path(cfg.run_dir).resolve()
    damage = _damage(cfg, run_dir, Dist(), report=False)
    todo = damage.add_repairs(planned.stages, lambda n: make_stage(cfg, n, planned.run))
    known: dict[str, dict] = {}
    decided = []
    for step in steps(todo, run_dir, damage, bool(cfg.force), known):
        if step.runs:  # its outputs are unknown until it has run
            known[step.stage.name] = {"fingerprint": step.fingerprint, "outputs_digest": PENDING}
        decided.append(step)
    return decided


def stage_log_path(run_dir: Path, name: str, rank: int = 0) -> Path:
    return run_dir / "logs" / (f"{name}.log" if rank == 0 else f"{name}.rank{rank}.log")


@contextmanager
def _stage_log(path: Path):
    """Every log record of the stage (lowbit's at INFO unless its level was set) also goes to
    `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    package = logging.getLogger("pipeline")
    unset = package.level == logging.NOTSET
    if unset:
        package.setLevel(logging.INFO)
    try:
        yield
    finally:
        if unset:
            package.setLevel(logging.NOTSET)
        root.removeHandler(handler)
        handler.close()


def _failure(name: str, error: BaseException, log_path: Path, stage_dir: Path) -> LowbitError:
    """A LowbitError passes as it is; anything else becomes one line, its traceback in the log
    (and kept as the cause, for the CLI to recognise a full disk)."""
    if isinstance(error, LowbitError):
        return error
    if _interrupted(error):
        return Interrupted(
            f"interrupted (SIGINT) during stage {name}: its partial output was removed, finished "
            "stages are kept; rerun the same command to resume"
        )
    line = record_failure(error, log_path)
    failed = StageFailed(f"stage {name} failed: {line}", stage_dir)
    failed.__cause__ = error
    return failed


def _params(stage: Stage) -> dict[str, Any]:
    """The stage's MLflow params: what its fingerprint hashes."""
    sections = {k: v for k, v in stage.run.asdict().items() if v is not None}
    return {"stage": asdict(stage.cfg), **sections}


def _run_stage(
    step: Step, run_dir: Path, dist: Dist, tracker: Tracker, device: torch.device
) -> dict:
    stage, fp, inputs, input_done = step.stage, step.fingerprint, step.inputs, step.input_done
    name = stage.name
    work = run_dir / ".work" / f"{name}-{fp[:12]}"
    tmp = run_dir / f".{name}.tmp"
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        work.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    out_dir = tmp if dist.is_main else Path(tempfile.mkdtemp(prefix=f"lowbit-{name}-"))
    child = StageRun()
    if dist.is_main:
        child = tracker.start_stage(name, _params(stage), {"fingerprint": fp})
    io = StageIO(name, out_dir, work, run_dir, inputs, dist, child, device)
    log_path = stage_log_path(run_dir, name, dist.rank)
    t0 = time.time()
    error = None
    peak = StagePeak()
    peak.start()
    with _stage_log(log_path):
        log.info("%-12s running (fingerprint %s) on %s: %s", name, fp[:12], device_line(), step.why)
        try:
            runs_here = stage.decl.distributed or dist.is_main
            metrics = stage.decl.run(stage.cfg, stage.run, io) if runs_here else {}
        except BaseException as e:  # KeyboardInterrupt too: the run is marked, the tmp dir dropped
            error = e
            metrics = {}
    # Rank 0's outcome decides for everyone, so no rank waits forever on a failed peer.
    failed = dist.broadcast(error is not None and dist.is_main)
    if error is not None or failed:
        if error is not None:
            error = _failure(name, error, log_path, run_dir / name)
        if dist.is_main:
            child.log_artifact(log_path)
            child.end("KILLED" if isinstance(error, Interrupted | Preempted) else "FAILED")
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise StageFailed(f"stage {name} failed on rank 0 (see {stage_log_path(run_dir, name)})")
    seconds = time.time() - t0
    metrics = {k: v for k, v in (metrics or {}).items()}
    metrics["world_size"] = dist.world_size
    metrics.update(peak.metrics())
    done: dict[str, Any] = {}
    if dist.is_main:
        outputs = record_outputs(tmp)
        done = {
            "stage": name,
            "fingerprint": fp,
            "config": stage.config_record(),  # what the fingerprint hashed: reruns name the change
            "outputs_digest": outputs_digest(outputs),
            "inputs": {k: v["fingerprint"] for k, v in input_done.items()},
            "metrics": metrics,
            "outputs": outputs,
            "timings": {"start": t0, "end": time.time(), "seconds": seconds, "machine": where()},
            "version": __version__,
        }
        (tmp / DONE).write_text(json.dumps(done, indent=1))
        commit(tmp, run_dir / name)
        child.log_metrics({k: v for k, v in metrics.items()} | {"stage_seconds": seconds})
        _log_outputs(child, run_dir / name)
        child.log_artifact(log_path)
        child.end("FINISHED")
        shutil.rmtree(work, ignore_errors=True)
        log.info("%s", summary_line(name, seconds, metrics))
    else:
        shutil.rmtree(out_dir, ignore_errors=True)
    return dist.broadcast(done)
