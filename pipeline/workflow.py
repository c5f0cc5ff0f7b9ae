"""Runs the configured stages in order, each exactly once per fingerprint.

A stage's fingerprint hashes its resolved config sections, the fingerprints and output digests of
the stages it reads, and the package version. A stage folder is written atomically: the stage
writes into `<run_dir>/.<stage>.tmp/`, the workflow adds `_done.json` and renames it into place,
so a crash or Ctrl-C never leaves a half-written stage folder. Work that must survive a crash
inside a stage (Lightning checkpoints, finished quantization segments) goes to
`<run_dir>/.work/<stage>-<fingerprint>/`, which the same fingerprint finds again on resume.

Before a stage's folder is trusted (skipped as up to date, or read by a later stage) its files are
checked against `_done.json` (`pipeline.rundir`); a damaged folder is named and its stage rerun
(`repair=false` stops instead). A stage that raises anything but a LowbitError fails the run with
one line; the traceback goes to `<run_dir>/logs/<stage>.log`, which holds the stage's whole log.

Every rank runs this loop (torchrun/srun); rank 0 writes, the others wait at barriers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline import __version__, stages
from pipeline.config import data_cfg, model_cfg, quant_cfg, to_plain, tracking_cfg
from pipeline.dist import Dist, init_from_env
from pipeline.errors import ConfigError, LowbitError, StageFailed, record_failure
from pipeline.inputs import check_inputs
from pipeline.lit.trainer import check_trainer
from pipeline.report import write_report
from pipeline.rundir import (
    DONE,
    RunLock,
    commit,
    find_damage,
    outputs_digest,
    read_done,
    record_outputs,
)
from pipeline.tracking import StageRun, Tracker

log = logging.getLogger("lowbit")


@dataclass
class StageContext:
    """What a stage's run() gets: its config, where to write, what earlier stages produced."""

    name: str
    cfg: DictConfig
    out_dir: Path
    work_dir: Path
    run_dir: Path
    inputs: dict[str, Path] = field(default_factory=dict)
    dist: Dist = field(default_factory=Dist)
    log: StageRun = field(default_factory=StageRun)

    @property
    def params(self) -> DictConfig:
        return self.cfg.stage[self.name]

    def describe(self, path: Path | str) -> str:
        """`path` as stage outputs record it: relative to the run dir when inside it, so an
        output never depends on where the run dir lives (a copied run keeps its digests)."""
        path = Path(path).resolve()
        try:
            return str(path.relative_to(self.run_dir.resolve()))
        except ValueError:
            return str(path)

    def target_dir(self) -> Path:
        """The FP target checkpoint: the user's, or the one bootstrap trained."""
        if self.cfg.model.target.path:
            return Path(self.cfg.model.target.path)
        if "bootstrap" not in self.inputs:
            raise LowbitError("no target model: set model.target.path or run the bootstrap stage")
        return self.inputs["bootstrap"] / "target"

    def draft_dir(self) -> Path | None:
        """The FP draft checkpoint, or None (then the target drafts for itself)."""
        if self.cfg.model.draft.path:
            return Path(self.cfg.model.draft.path)
        if not self.cfg.model.target.path and "bootstrap" in self.inputs:
            return self.inputs["bootstrap"] / "draft"
        return None


def fingerprint(cfg: DictConfig, name: str, mod: ModuleType, inputs: dict[str, dict]) -> str:
    """Hash of what determines the stage's result (see the module docstring)."""
    sections = {"stage": to_plain(cfg.stage.get(name)), "seed": cfg.seed}
    for key in mod.KEYS:
        sections[key] = to_plain(OmegaConf.select(cfg, key))
    payload = {
        "version": __version__,
        "config": sections,
        "inputs": {
            k: [v["fingerprint"], v.get("outputs_digest")] for k, v in sorted(inputs.items())
        },
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def plan(cfg: DictConfig, run_dir: Path) -> list[tuple[str, ModuleType]]:
    """Validate the stage list and every selected stage's config, before any compute."""
    selected = list(cfg.stages)
    if not selected:
        raise ConfigError("stages", "is empty", ", ".join(stages.ORDER))
    mods = [(n, stages.load(n)) for n in selected]
    order = [n for n in stages.ORDER if n in selected]
    if order != selected:
        raise ConfigError("stages", f"is out of order {selected}", f"this order: {order}")
    # The shared sections are checked whatever the stages, so a typo never waits for its stage.
    for check in (model_cfg, data_cfg, quant_cfg, tracking_cfg, check_inputs):
        check(cfg)
    check_trainer(cfg.get("trainer"))  # before any rank starts: `lowbit` relaunches after plan()
    _check_recipe(cfg, selected, run_dir)
    for name, mod in mods:
        mod.validate(cfg)
        for need in mod.NEEDS:
            upstream = stages.load(need)
            skipped = getattr(upstream, "skip_reason", lambda c: None)(cfg)
            if need not in selected and not skipped and read_done(run_dir / need) is None:
                raise ConfigError(
                    "stages",
                    f"runs {name!r}, which needs the outputs of {need!r}, but {run_dir / need} "
                    "has none",
                    f"add {need!r} to stages",
                )
    return mods


def _check_recipe(cfg: DictConfig, selected: list[str], run_dir: Path) -> None:
    """A mixed recipe is only ever quantized by its bit plan, never by a silent fallback."""
    q = quant_cfg(cfg)
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
    shown = [f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, int | float)][:4]
    return f"{name:<12} done in {seconds:7.1f}s  " + "  ".join(shown)


def run(cfg: DictConfig, mods: list[tuple[str, ModuleType]] | None = None) -> dict[str, dict]:
    """Run the workflow; returns {stage: its _done.json} for the stages of this run.

    `mods` is `plan(cfg, run_dir)` when the caller already made it (the CLI validates before it
    starts ranks; the start checks load tokenizers and import torch_npu, not worth twice).
    """
    dist = init_from_env((cfg.get("trainer") or {}).get("dist_backend"))
    run_dir = Path(cfg.run_dir).resolve()
    if mods is None:
        mods = plan(cfg, run_dir)
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
        return _run_locked(cfg, mods, run_dir, dist)
    finally:
        lock.release()


def _run_locked(cfg: DictConfig, mods, run_dir: Path, dist: Dist) -> dict[str, dict]:
    tracker = Tracker(tracking_cfg(cfg), run_dir, active=dist.is_main)
    if dist.is_main:
        tracker.connect()
        tracker.start_parent(cfg.name, to_plain(cfg))
        # What a user looks for first, before hours of stages scroll by.
        log.info("workflow %s in %s; stages %s", cfg.name, run_dir, ", ".join(n for n, _ in mods))
        if tracker.active:
            log.info("MLflow run %s: %s", tracker.parent.run_id, tracker.ui_command())
    dist.barrier()

    results: dict[str, dict] = {}
    known: dict[str, dict] = {}  # stage -> its _done.json, for fingerprints of readers
    t_start = time.time()
    status = "FAILED"
    try:
        damage = Damage(cfg, run_dir, dist)
        mods = damage.add_repairs(mods)
        running = {name for name, _ in mods}
        for name, mod in mods:
            reason = getattr(mod, "skip_reason", lambda c: None)(cfg)
            if reason:
                log.info("%-12s not needed: %s", name, reason)
                continue
            inputs, input_done = {}, {}
            for dep in sorted(_reads(mod)):
                done = known.get(dep) if dep in running else read_done(run_dir / dep)
                if done is not None:
                    inputs[dep], input_done[dep] = run_dir / dep, done
            fp = fingerprint(cfg, name, mod, input_done)
            done = read_done(run_dir / name)
            fresh = done and done.get("fingerprint") == fp and not cfg.force
            if fresh and damage.of(name) is None:
                log.info("%-12s up to date (fingerprint %s), skipped", name, fp[:12])
                known[name] = results[name] = done
                continue
            known[name] = results[name] = _run_stage(
                cfg, name, mod, fp, inputs, input_done, run_dir, dist, tracker
            )
        status = "FINISHED"
    except KeyboardInterrupt:
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
        log.info(
            "workflow %s finished in %.1fs; report %s", cfg.name, time.time() - t_start, report
        )
        if tracker.active:
            log.info("MLflow: %s", tracker.ui_command())
    return results


def _reads(mod: ModuleType) -> set[str]:
    return set(mod.NEEDS) | set(getattr(mod, "USES", ()))


class Damage:
    """Which finished stage folders no longer hold what their `_done.json` recorded.

    Rank 0 reads the files; every rank gets its verdict. Each folder is checked once per run.
    """

    def __init__(self, cfg: DictConfig, run_dir: Path, dist: Dist):
        self.cfg, self.run_dir, self.dist = cfg, run_dir, dist
        self.found: dict[str, str | None] = {}

    def of(self, name: str) -> str | None:
        if name not in self.found:
            problem = None
            if self.dist.is_main:
                done = read_done(self.run_dir / name)
                if done is not None:
                    problem = find_damage(self.run_dir / name, done, full=self.cfg.verify)
            self.found[name] = self.dist.broadcast(problem)
            if self.found[name] is not None:
                self._report(name, self.found[name])
        return self.found[name]

    def _report(self, name: str, problem: str) -> None:
        if not self.cfg.repair:
            raise LowbitError(
                f"stage {name}'s outputs are damaged: {problem}; rerun without --no-repair "
                "(repair=true) to recompute them"
            )
        log.warning("%-12s outputs damaged: %s; rerunning the stage", name, problem)

    def add_repairs(self, mods: list[tuple[str, ModuleType]]) -> list[tuple[str, ModuleType]]:
        """`mods` plus every unselected stage they read whose folder is damaged, in order."""
        chosen = dict(mods)
        grew = True
        while grew:
            grew = False
            wanted = set().union(*(_reads(m) for m in chosen.values())) - set(chosen)
            for dep in sorted(wanted):
                if read_done(self.run_dir / dep) is not None and self.of(dep) is not None:
                    chosen[dep] = stages.load(dep)
                    grew = True
        return [(n, chosen[n]) for n in stages.ORDER if n in chosen]


def stage_log_path(run_dir: Path, name: str, rank: int = 0) -> Path:
    return run_dir / "logs" / (f"{name}.log" if rank == 0 else f"{name}.rank{rank}.log")


@contextmanager
def _stage_log(path: Path):
    """Every log record of the stage (lowbit's, Lightning's, ...) also goes to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


def _failure(name: str, error: BaseException, log_path: Path) -> LowbitError:
    """A LowbitError passes as it is; anything else becomes one line, its traceback in the log."""
    if isinstance(error, LowbitError):
        return error
    return StageFailed(f"stage {name} failed: {record_failure(error, log_path)}")


def _run_stage(cfg, name, mod, fp, inputs, input_done, run_dir, dist, tracker) -> dict:
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
        params = {"stage": to_plain(cfg.stage.get(name)), "seed": cfg.seed}
        params.update({k: to_plain(OmegaConf.select(cfg, k)) for k in mod.KEYS})
        child = tracker.start_stage(name, params, {"fingerprint": fp})
    ctx = StageContext(name, cfg, out_dir, work, run_dir, inputs, dist, child)
    log_path = stage_log_path(run_dir, name, dist.rank)
    t0 = time.time()
    error = None
    with _stage_log(log_path):
        log.info("%-12s running (fingerprint %s)", name, fp[:12])
        try:
            metrics = mod.run(ctx) if (mod.DISTRIBUTED or dist.is_main) else {}
        except BaseException as e:  # KeyboardInterrupt too: the run is marked, the tmp dir dropped
            error = e
            metrics = {}
    # Rank 0's outcome decides for everyone, so no rank waits forever on a failed peer.
    failed = dist.broadcast(error is not None and dist.is_main)
    if error is not None or failed:
        if error is not None and not isinstance(error, KeyboardInterrupt):
            error = _failure(name, error, log_path)
        if dist.is_main:
            child.log_artifact(log_path)
            child.end("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise StageFailed(f"stage {name} failed on rank 0 (see {stage_log_path(run_dir, name)})")
    seconds = time.time() - t0
    metrics = {k: v for k, v in (metrics or {}).items()}
    metrics["world_size"] = dist.world_size
    done: dict[str, Any] = {}
    if dist.is_main:
        outputs = record_outputs(tmp)
        done = {
            "stage": name,
            "fingerprint": fp,
            "outputs_digest": outputs_digest(outputs),
            "inputs": {k: v["fingerprint"] for k, v in input_done.items()},
            "metrics": metrics,
            "outputs": outputs,
            "timings": {"start": t0, "end": time.time(), "seconds": seconds},
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
