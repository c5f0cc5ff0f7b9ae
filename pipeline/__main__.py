"""The `lowbit` command: compose the Hydra config and hand it to the workflow.

lowbit experiment=smoke run_dir=/tmp/r   # tiny, ~2 minutes
lowbit --force stages=[quantize]         # also --verify, --no-repair, --dry-run, --version
lowbit --plan model=hf model.target.path=DIR  # each stage's memory per rank, against this machine
lowbit -m quant.budget_bits=2.5,3,4      # a sweep: each point in its own run dir, then
                                         # sweep.md/.csv/.png over them (pipeline.sweep)
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import logging.config
import os
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipeline import __version__, conf_dir, preempt
from pipeline.errors import Interrupted, LowbitError, disk_full, record_failure
from pipeline.preempt import Preempted

# Not __name__: that is "__main__" under `python -m pipeline`, outside the package's logger tree.
log = logging.getLogger("pipeline.__main__")


def _under_launcher() -> bool:
    env = os.environ
    return "WORLD_SIZE" in env or int(env.get("SLURM_NTASKS", "1")) > 1


# Flags friendlier than their config keys; Hydra does not accept unknown flags.
FLAGS = {
    "--force": "force=true",
    "--verify": "verify=true",
    "--no-repair": "repair=false",
    "--dry-run": "dry_run=true",
    "--plan": "plan.show=true",
}
# A dry run (and --plan) writes nothing, Hydra's log file and output dir included.
DRY_RUN_HYDRA = [
    "hydra.run.dir=.",
    "~hydra.job_logging.handlers.file",
    "hydra.job_logging.root.handlers=[console]",
]
# Keys that say where or how a run happens, not what it computes: never in a point's run dir name.
NOT_IN_POINT_NAME = {"run_dir", "name", "cluster", "tracking", "hydra"} | {
    "force", "verify", "repair", "print_config", "dry_run", "plan"
}  # fmt: skip
WRITES_NOTHING = {"dry_run=true", "dry_run=True", "plan.show=true", "plan.show=True"}


def _writes_nothing(config: DictConfig) -> bool:
    return config.get("dry_run") is True or (config.get("plan") or {}).get("show") is True


def _with_flags(argv: list[str]) -> list[str]:
    argv = [FLAGS.get(a, a) for a in argv]
    if {"-m", "--multirun"} & set(argv):
        extra = _point_name_keys(argv)
    elif WRITES_NOTHING & set(argv):
        extra = DRY_RUN_HYDRA
    else:
        return argv
    # Beside the given overrides: Hydra reads them as one run of positional arguments.
    at = max((i + 1 for i, a in enumerate(argv) if _is_override(a)), default=len(argv))
    return argv[:at] + extra + argv[at:]


def _is_override(arg: str) -> bool:
    return "=" in arg and not arg.startswith("-")


def _point_name_keys(argv: list[str]) -> list[str]:
    """In a sweep, Hydra's `override_dirname` names each point's run dir: only by the keys the
    sweep varies (`quant.budget_bits=3`), not by every override on the command line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [a for a in argv if _is_override(a) and not a.startswith("hydra.")]
    try:
        parsed = OverridesParser.create().parse_overrides(given)
    except Exception:  # Hydra reports the bad override itself, with its own message
        return []
    fixed = {
        o.key_or_group
        for o in parsed
        if not o.is_sweep_override() or o.key_or_group.split(".")[0] in NOT_IN_POINT_NAME
    }
    quoted = ",".join(f"'{k}'" for k in sorted(fixed))
    return [f"hydra.job.config.override_dirname.exclude_keys=[{quoted}]"]


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def point_run_dir(run_dir: str, point: str) -> str:
    """A sweep point's run dir: the configured one plus its swept values (`/` becomes `_`), so
    the points of `lowbit -m` never share stage folders."""
    return f"{run_dir}/{point.replace('/', '_')}" if point else run_dir


def _snapshot(cfg: DictConfig, overrides: list[str], hydra_cfg) -> Path:
    """Keep what reproduces this invocation in `<run_dir>/.hydra/<time>/`, Hydra's three files:
    the resolved `config.yaml`, `hydra.yaml` (Hydra's own config: group choices, launcher, output
    dirs) and `overrides.yaml`. With a single run that is Hydra's output dir, beside its log."""
    run_dir = Path(cfg.run_dir).resolve()
    hydra_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    if hydra_dir.parent == run_dir / ".hydra":
        where = hydra_dir
    else:  # a sweep point (its log is in the sweep dir) or a custom hydra.run.dir
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
        if hydra_cfg.mode == RunMode.MULTIRUN:  # points sharing a run dir, in the same second
            stamp += f"_{hydra_cfg.job.num}"
        where = run_dir / ".hydra" / stamp
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    # As Hydra saves it (unresolved): its interpolations point into the job's config.
    OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), where / "hydra.yaml")
    (where / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    return where


def _relaunch(nproc: int) -> None:
    """Several local ranks without a launcher: become `torchrun --nproc-per-node N` of ourselves.

    `main` has already turned the flags into overrides, so the ranks parse what this one did."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--standalone",
        "-m",
        "pipeline",
        *sys.argv[1:],
    ]
    log.info("starting %d local ranks: %s", nproc, " ".join(cmd))
    sys.stdout.flush()
    os.execv(sys.executable, cmd)


def _console_logging(config: DictConfig) -> None:
    """Hydra configures logging in each job; the launching process logs to the console alone."""
    logging_cfg = OmegaConf.to_container(config.hydra.job_logging)
    logging_cfg["handlers"].pop("file", None)
    logging_cfg["root"]["handlers"] = ["console"]
    logging.config.dictConfig(logging_cfg)


class WritableRunDir(Callback):
    """Hydra makes its output dir under `run_dir` before `_main` runs: a run dir that cannot be
    written is one line here, before Hydra's traceback and before any compute."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config)

    @staticmethod
    def _check(config: DictConfig) -> None:
        if _writes_nothing(config):
            return
        from pipeline.rundir import check_writable

        try:
            check_writable(Path(config.run_dir).resolve())
        except LowbitError as e:
            _console_logging(config)  # Hydra configures logging later, in the job
            log.error("%s", e)
            sys.exit(e.exit_code)


# hydra.job.env_set keys that carry the sweep to each point, in whatever process or host it runs.
SWEEP_DIR, SWEEP_RUN = "LOWBIT_SWEEP_DIR", "LOWBIT_SWEEP_RUN_ID"


def _quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class SweepSummary(Callback):
    """A sweep (`lowbit -m`) opens a parent MLflow run that each point's run nests under and,
    after its last point, writes a table and a Pareto plot over the points (pipeline.sweep)."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if _writes_nothing(config):
            return
        from pipeline import sweep
        from pipeline.config import tracking_cfg

        where = Path(config.hydra.sweep.dir).resolve()
        try:
            run_id = sweep.start(
                where, tracking_cfg(config), str(config.name), list(config.hydra.overrides.task)
            )
        except Exception as e:
            _console_logging(config)
            sys.exit(_failure(e, where)[1])
        # The launcher composes each point from these overrides, here or in a Slurm job.
        carried = {SWEEP_DIR: str(where)} | ({SWEEP_RUN: run_id} if run_id else {})
        for key, value in carried.items():
            config.hydra.overrides.hydra.append(f"++hydra.job.env_set.{key}={_quoted(value)}")

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if _writes_nothing(config):
            return
        from pipeline import sweep

        _console_logging(config)
        where = Path(config.hydra.sweep.dir).resolve()
        try:
            found = sweep.finish(where)
        except Exception as e:
            sys.exit(_failure(e, where)[1])
        log.info("sweep of %d points: %s", len(found), where / sweep.OUTPUTS[0])
        failed = [r for r in found if r.point.status != sweep.FINISHED]
        if failed:
            shown = "; ".join(f"{r.label or f'#{r.point.num}'}: {r.status}" for r in failed)
            log.error("%d of %d sweep points did not finish (%s)", len(failed), len(found), shown)
            sys.exit(next((r.point.exit_code for r in failed if r.point.exit_code), 1))


def _sweep_point(cfg: DictConfig, hydra_cfg, given: list[str]):
    """This point's record (pipeline.sweep.SweepPoint) when a sweep runs it, its run nested
    under the sweep's; None otherwise (a dry run's sweep records nothing)."""
    carried = hydra_cfg.job.env_set
    if hydra_cfg.mode != RunMode.MULTIRUN or SWEEP_DIR not in carried:
        return None
    from pipeline.sweep import SweepPoint

    if carried.get(SWEEP_RUN):
        cfg.tracking.parent_run_id = str(carried[SWEEP_RUN])
    fixed = set(hydra_cfg.job.config.override_dirname.exclude_keys)
    swept = {_key(o): o.split("=", 1)[1] for o in given if _key(o) not in fixed}
    return SweepPoint(hydra_cfg.job.num, swept, str(Path(cfg.run_dir).resolve()))


# A sweep goes on past a failed point; Ctrl-C and a time limit stop it (the latter to requeue).
STOP_SWEEP = {Interrupted.exit_code, Preempted.exit_code}


def _failure(error: BaseException, run_dir: Path) -> tuple[str, int]:
    """Every failure the command reports: one line (logged) and an exit code, a traceback only
    in a log."""
    known = disk_full(error, getattr(error, "stage_dir", None) or run_dir)
    if known is None and isinstance(error, LowbitError):
        known = error
    elif known is None and isinstance(error, KeyboardInterrupt):
        known = Interrupted("interrupted (SIGINT); finished stages are kept, rerun to resume")
    if known is not None:
        line, code = str(known), known.exit_code
    else:  # outside any stage (tracking, report): the same one-line contract
        line = f"lowbit failed: {record_failure(error, run_dir / 'logs' / 'lowbit.log')}"
        code = 1
    log.error("%s", line)
    return line, code


def _main(cfg: DictConfig) -> None:
    from pipeline import workflow
    from pipeline.stageplan import describe

    hydra_cfg = HydraConfig.get()
    given = list(hydra_cfg.overrides.task)
    if hydra_cfg.mode == RunMode.MULTIRUN and "run_dir" not in {_key(o) for o in given}:
        cfg.run_dir = point_run_dir(cfg.run_dir, hydra_cfg.job.override_dirname)
    trainer = cfg.get("trainer") or {}
    devices = trainer.get("devices", 1)
    main_rank = os.environ.get("RANK", "0") == "0"
    point_log = None
    point = _sweep_point(cfg, hydra_cfg, given)
    sweep_dir = hydra_cfg.job.env_set.get(SWEEP_DIR)
    if point is not None and main_rank:
        point.save(sweep_dir)
    try:
        # Validate once, here, before starting ranks or touching any model.
        planned = workflow.plan(cfg, Path(cfg.run_dir).resolve())
        if _writes_nothing(cfg):
            if main_rank and cfg.dry_run:
                print(describe(Path(cfg.run_dir).resolve(), workflow.preview(cfg, planned)))
            if main_rank:
                memory, available = workflow.memory_plan(cfg, planned)
                print(memory.table(available))
            return
        # A list (`trainer.devices=[4,5]`) names which devices: one rank each.
        count = len(devices) if OmegaConf.is_list(devices) else devices
        local_ranks = isinstance(count, int) and count > 1 and trainer.get("num_nodes", 1) == 1
        if local_ranks and not _under_launcher():
            _relaunch(count)
        preempt.install()  # a time-limit signal checkpoints and stops (exit 75)
        if main_rank:
            point_log = _log_beside(_snapshot(cfg, given, hydra_cfg), hydra_cfg)
            log.info("lowbit %s; overrides: %s", __version__, " ".join(given) or "none")
            if cfg.print_config:
                print(OmegaConf.to_yaml(cfg), flush=True)
        workflow.run(cfg, planned)
        if point is not None and main_rank:
            point.ended("FINISHED").save(sweep_dir)
    except (Exception, KeyboardInterrupt) as e:
        line, code = _failure(e, Path(cfg.run_dir).resolve())
        stop = point is None or code in STOP_SWEEP
        if point is not None and main_rank:
            point.ended("KILLED" if stop else "FAILED", line, code).save(sweep_dir)
        if stop:
            sys.exit(code)
    finally:
        if point_log is not None:
            logging.getLogger().removeHandler(point_log)
            point_log.close()


def _log_beside(where: Path, hydra_cfg) -> logging.Handler | None:
    """A sweep point's log also in its own `.hydra/<time>/` (Hydra writes it into the sweep's
    folder), so a point's run dir holds all of its invocation; None for a single run."""
    if Path(hydra_cfg.runtime.output_dir).resolve() == where:
        return None
    handler = logging.FileHandler(where / f"{hydra_cfg.job.name}.log")
    hydra_file = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    handler.setFormatter(hydra_file[0].formatter if hydra_file else None)
    logging.getLogger().addHandler(handler)
    return handler


M_ARENA_MAX = -8  # glibc's malloc.h


def _one_heap() -> None:
    """One glibc malloc arena, before threads start: one per thread grows peaks (docs/memory.md)."""
    if "MALLOC_ARENA_MAX" not in os.environ:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 1)


def main() -> None:
    if "--version" in sys.argv[1:]:  # Hydra's own flag would print Hydra's version
        print(f"lowbit {__version__}")
        return
    faulthandler.enable()  # a crash in native code leaves every thread's Python stack in the log
    _one_heap()
    sys.argv = sys.argv[:1] + _with_flags(sys.argv[1:])
    if not sys.stderr.isatty():
        # Their bars grow one line forever in a log; set before transformers is imported.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # model logging
    from pipeline.dist import shutdown
    from pipeline.stages import register_configs

    register_configs()  # the defaults Hydra composes on, from the dataclasses
    try:
        hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_main)()
    finally:
        shutdown()  # gloo's threads outlive a group left alive and abort the exit (SIGABRT)


if __name__ == "__main__":
    main()
