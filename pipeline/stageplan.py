"""Which of the selected stages a run reruns, and why.

A stage is up to date when its `_done.json` holds the fingerprint it has now (a hash of its
parsed config, the fingerprints and output digests of the stages it reads, and the package
version) and its recorded outputs are intact. A dry run cannot know the outputs of a stage that
will rerun, so its readers "will run" when its fingerprint moves, and "may run" otherwise.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline import __version__, stages
from pipeline.config import RunConfig
from pipeline.dist import Dist
from pipeline.errors import LowbitError
from pipeline.rundir import find_damage, read_done

log = logging.getLogger(__name__)

# The outputs digest of a stage a dry run would rerun: unknown until it has run.
PENDING = "<pending>"


@dataclass(frozen=True)
class Stage:
    """A stage as the workflow runs it: its declaration and the parsed configs `run` receives."""

    name: str
    decl: Any  # its pipeline.stages.Stage
    cfg: Any  # the parsed stage.<name> (an instance of decl.config)
    run: RunConfig  # only the sections decl.sections lists are set

    def skip_reason(self) -> str | None:
        skip = self.decl.skip_reason
        return skip(self.cfg, self.run) if skip else None

    def check(self) -> None:
        if self.decl.check:
            self.decl.check(self.cfg, self.run)

    def reads(self) -> set[str]:
        return set(self.decl.needs) | set(self.decl.uses)

    def config_record(self) -> dict[str, Any]:
        """The config the fingerprint hashes, as plain JSON values (kept in `_done.json`)."""
        record = {"stage": asdict(self.cfg), "run": self.run.asdict()}
        return json.loads(json.dumps(record, default=str))


def fingerprint(stage: Stage, inputs: dict[str, dict]) -> str:
    """Hash of what determines the stage's result (see the module docstring)."""
    payload = {
        "version": __version__,
        "config": stage.config_record(),
        "inputs": {
            k: [v["fingerprint"], v.get("outputs_digest")] for k, v in sorted(inputs.items())
        },
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


class Damage:
    """Which finished stage folders no longer hold what their `_done.json` recorded (rank 0
    reads, every rank gets the verdict); `report=False` neither logs nor stops."""

    def __init__(self, run_dir: Path, dist: Dist, *, verify: bool, repair: bool, report=True):
        self.verify, self.repair, self.report = verify, repair, report
        self.run_dir, self.dist = run_dir, dist
        self.found: dict[str, str | None] = {}

    def of(self, name: str) -> str | None:
        if name not in self.found:
            problem = None
            if self.dist.is_main:
                done = read_done(self.run_dir / name)
                if done is not None:
                    problem = find_damage(self.run_dir / name, done, full=self.verify)
            self.found[name] = self.dist.broadcast(problem)
            if self.found[name] is not None and self.report:
                self._report(name, self.found[name])
        return self.found[name]

    def _report(self, name: str, problem: str) -> None:
        if not self.repair:
            raise LowbitError(
                f"stage {name}'s outputs are damaged: {problem}; rerun without --no-repair "
                "(repair=true) to recompute them"
            )
        log.warning("%-12s outputs damaged: %s; rerunning the stage", name, problem)

    def add_repairs(self, chosen: list[Stage], make: Callable[[str], Stage]) -> list[Stage]:
        """`chosen` plus every unselected stage they read whose folder is damaged, in order;
        `make(name)` builds an added one."""
        by_name = {s.name: s for s in chosen}
        grew = True
        while grew:
            grew = False
            wanted = set().union(*(s.reads() for s in by_name.values())) - set(by_name)
            for dep in sorted(wanted):
                if read_done(self.run_dir / dep) is not None and self.of(dep) is not None:
                    by_name[dep] = make(dep)
                    grew = True
        return [by_name[n] for n in stages.ORDER if n in by_name]


@dataclass(frozen=True)
class Step:
    """One stage's verdict: `action` is "up to date", "will run", "may run" or "not needed"."""

    stage: Stage
    action: str
    why: str
    fingerprint: str | None = None
    inputs: dict[str, Path] | None = None
    input_done: dict[str, dict] | None = None
    done: dict | None = None  # the finished folder's record, when up to date

    @property
    def runs(self) -> bool:
        return self.action in ("will run", "may run")

    def line(self) -> str:
        if self.action == "up to date":
            return f"{self.stage.name:<12} up to date (fingerprint {self.fingerprint[:12]})"
        return f"{self.stage.name:<12} {self.action}{'' if self.why[0] == '(' else ':'} {self.why}"


def steps(
    todo: list[Stage], run_dir: Path, damage: Damage, force: bool, known: dict[str, dict]
) -> Iterator[Step]:
    """Decide each stage of `todo` in order; `known` collects each decided stage's `_done.json`
    (the caller records the ones it runs), which later stages read rather than stale folders."""
    in_todo = {stage.name for stage in todo}
    for stage in todo:
        reason = stage.skip_reason()
        if reason:
            yield Step(stage, "not needed", reason)
            continue
        inputs, input_done = {}, {}
        for dep in sorted(stage.reads()):
            got = known.get(dep) if dep in in_todo else read_done(run_dir / dep)
            if got is not None:
                inputs[dep], input_done[dep] = run_dir / dep, got
        fp = fingerprint(stage, input_done)
        done = read_done(run_dir / stage.name)
        action, why = _verdict(stage, fp, done, input_done, force, damage)
        if action == "up to date":
            known[stage.name] = done
        yield Step(stage, action, why, fp, inputs, input_done, done)


def _verdict(stage, fp, done, input_done, force, damage) -> tuple[str, str]:
    if done is None:
        return "will run", "no finished outputs"
    if force:
        return "will run", "forced (force=true)"
    if done.get("fingerprint") != fp:
        return _changed(stage, done, input_done)
    problem = damage.of(stage.name)
    if problem is not None:
        stops = "" if damage.repair else " (repair=false: the run stops here)"
        return "will run", f"outputs damaged: {problem}{stops}"
    return "up to date", ""


def _changed(stage: Stage, done: dict, input_done: dict[str, dict]) -> tuple[str, str]:
    """Why the fingerprint moved: the config keys, the version, or the inputs."""
    if "config" in done:
        old, new = _keys(done["config"], stage.name), _keys(stage.config_record(), stage.name)
        keys = sorted(k for k in old.keys() | new.keys() if old.get(k, "-") != new.get(k, "-"))
        if keys:
            shown = [f"{k} {old.get(k, '-')!r} -> {new.get(k, '-')!r}" for k in keys[:3]]
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            return "will run", f"config changed: {', '.join(shown)}{more}"
    if done.get("version") != __version__:
        return "will run", f"lowbit {done.get('version')} -> {__version__}"
    recorded = done.get("inputs", {})
    # In workflow order: the stage that reruns first, first.
    pending = [d for d in stages.ORDER if input_done.get(d, {}).get("outputs_digest") == PENDING]
    moved = [d for d in pending if recorded.get(d) != input_done[d]["fingerprint"]]
    if moved:
        return "will run", f"(after {', '.join(moved)} rerun{'s' if len(moved) == 1 else ''})"
    changed = {d for d in recorded if d in input_done and recorded[d] != _fp(input_done[d])}
    changed |= input_done.keys() ^ recorded.keys()  # an input appeared or went away
    if changed:
        return "will run", f"input {', '.join(sorted(changed))} changed"
    if pending:
        verb = "reruns" if len(pending) == 1 else "rerun"
        return "may run", f"if {' or '.join(pending)} {verb} with different outputs"
    if "config" not in done:  # written before configs were recorded
        return "will run", "its config or inputs changed"
    return "will run", "an input's outputs changed"


def _fp(done: dict) -> str:
    return done["fingerprint"]


def _keys(record: dict, name: str) -> dict[str, Any]:
    """{key as written on the command line: value} of a config record."""
    return _flat(record.get("stage", {}), f"stage.{name}.") | _flat(record.get("run", {}), "")


def _flat(tree: Any, prefix: str) -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): tree}


def describe(run_dir: Path, planned: list[Step]) -> str:
    """The dry run's report: one line per stage, then what a run would do."""
    lines = [f"dry run of {run_dir} (nothing is run or written):"]
    lines += ["  " + step.line() for step in planned]
    running = [s.stage.name for s in planned if s.runs]
    lines.append(f"would run: {', '.join(running)}" if running else "nothing to run")
    return "\n".join(lines)
