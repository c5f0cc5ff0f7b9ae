"""The memory plan of a run: each stage's peak per rank, on the device and on the host.

Pure arithmetic on the model's shape and the run's settings, against what the machine or the
allocation has; a run that will not fit is refused before any compute, naming the setting that
makes it fit (`plan.check=false` proceeds). How close it comes: docs/memory.md.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import memstages, memtrain
from pipeline import stages as registry
from pipeline.config import PlanConfig, RunConfig
from pipeline.hardware import meminfo
from pipeline.memfacts import RunFacts, facts_of
from pipeline.modelshape import ModelShape, model_shapes

__all__ = [
    "Capacity",
    "MemoryPlan",
    "StageMemory",
    "capacity",
    "gib",
    "plan_run",
]

log = logging.getLogger(__name__)
GIB = 2**30


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class StageMemory:
    """One stage's peak per rank: on its accelerator and on the host, with the terms summed
    (host-side terms of a stage that runs on an accelerator are named `host ...`)."""

    stage: str
    device_bytes: int
    host_bytes: int
    terms: dict[str, int] = field(default_factory=dict)

    def largest(self, n: int = 3) -> str:
        ranked = sorted(self.terms.items(), key=lambda kv: -kv[1])[:n]
        return ", ".join(f"{k} {gib(v)}" for k, v in ranked)


@dataclass(frozen=True)
class Capacity:
    """What one node's host and one accelerator hold, and where each figure comes from."""

    host_bytes: int | None
    device_bytes: int | None
    host_source: str = "unknown"
    device_source: str = "unknown"


Fix = tuple[str, Callable[[], StageMemory]]  # (the setting, the stage's plan with it)


@dataclass
class MemoryPlan:
    """The plan of every stage that will run (`stages`), per rank."""

    stages: list[StageMemory]
    ranks: int = 1
    ranks_per_node: int = 1
    device: str = "cpu"  # where the accelerated stages run: cpu, cuda, npu
    model: str = ""  # the target's size, as the table's title says it
    notes: list[str] = field(default_factory=list)
    fixes: dict[str, list[Fix]] = field(default_factory=dict, repr=False)

    def stage(self, name: str) -> StageMemory:
        return next(s for s in self.stages if s.stage == name)

    def _over(self, s: StageMemory, cap: Capacity) -> str | None:
        """Why `s` does not fit `cap` (None: it fits)."""
        host = s.host_bytes * self._host_ranks(s)
        if cap.device_bytes is not None and s.device_bytes > cap.device_bytes:
            return (
                f"needs {gib(s.device_bytes)} per {self.device} device, {cap.device_source} "
                f"has {gib(cap.device_bytes)}"
            )
        if cap.host_bytes is not None and host > cap.host_bytes:
            per = (
                f" ({self._host_ranks(s)} ranks x {gib(s.host_bytes)})"
                if host != s.host_bytes
                else ""
            )
            return (
                f"needs {gib(host)} of host memory per node{per}, {cap.host_source} has "
                f"{gib(cap.host_bytes)}"
            )
        return None

    def _host_ranks(self, s: StageMemory) -> int:
        return self.ranks_per_node if s.stage in DISTRIBUTED else 1

    def fits(self, capacity: Capacity) -> list[str]:
        """One line per stage that will not fit: the stage, needed vs available, and the first
        setting (of those the stage has) with which the plan fits; empty when all fit."""
        problems = []
        for s in self.stages:
            why = self._over(s, capacity)
            if why is None:
                continue
            fix = next(
                (f for f, plan in self.fixes.get(s.stage, []) if not self._over(plan(), capacity)),
                None,
            )
            hint = f"set {fix}" if fix else f"none of {self._tried(s.stage)} is enough"
            problems.append(
                f"stage {s.stage} {why} (largest: {s.largest(2)}); {hint}, or plan.check=false "
                "to start anyway"
            )
        return problems

    def _tried(self, name: str) -> str:
        tried = [f for f, _ in self.fixes.get(name, [])]
        return ", ".join(tried) if tried else "the stage's settings"

    def table(self, capacity: Capacity | None = None) -> str:
        """The plan as text: a row per stage (device, host per rank, largest terms)."""
        head = (
            f"memory plan: {self.model}; {self.ranks} rank(s), {self.ranks_per_node} "
            f"per node, on {self.device}"
        )
        rows = [head, f"{'stage':<12} {'device':>10} {'host/rank':>10}  largest terms"]
        if not self.stages:
            rows.append("(no stage to run: every selected one is up to date; force=true reruns)")
        for s in self.stages:
            dev = gib(s.device_bytes) if self.device != "cpu" else "-"
            rows.append(f"{s.stage:<12} {dev:>10} {gib(s.host_bytes):>10}  {s.largest()}")
        if capacity is not None:
            rows.append(
                f"available: host {gib(capacity.host_bytes)} per node ({capacity.host_source})"
                + (
                    f", device {gib(capacity.device_bytes)} ({capacity.device_source})"
                    if self.device != "cpu"
                    else ""
                )
            )
            bad = self.fits(capacity)
            rows += [f"DOES NOT FIT: {b}" for b in bad] or ["fits"]
        rows += [f"note: {n}" for n in self.notes]
        return "\n".join(rows)


ESTIMATES = memstages.ESTIMATES | memtrain.ESTIMATES
# Stages every rank runs (the others run on rank 0 while the rest wait).
DISTRIBUTED = {"bootstrap", "sensitivity", "quantize", "distill", "reinforce"}


def plan_run(
    cfg: RunConfig,
    stages: Mapping[str, Any] | None = None,
    *,
    shapes: Mapping[str, ModelShape | None] | None = None,
) -> MemoryPlan:
    """The memory plan of `cfg` (a full RunConfig: pipeline.config.run_config).

    `stages`: {stage name: its parsed `stage.<name>` config, or None for the schema's
    defaults}, in the workflow's order; None: every stage of the workflow that would not be
    skipped, with default settings. `shapes`: {"target", "draft": ModelShape} to plan other
    models than `cfg.model` names (e.g. a config.json never downloaded).
    """
    if stages is None:
        stages = {n: None for n in registry.ORDER}
    parsed = {}
    for name, stage_cfg in stages.items():
        decl = importlib.import_module(f"pipeline.stages.{name}").STAGE  # not a test's stand-in
        if not isinstance(stage_cfg, decl.config):  # the defaults, nulls chosen as the workflow's
            stage_cfg = decl.config()
            stage_cfg = stage_cfg.scaled(cfg) if hasattr(stage_cfg, "scaled") else stage_cfg
            if stages[name] is None and decl.skip_reason and decl.skip_reason(stage_cfg, cfg):
                continue
        parsed[name] = stage_cfg
    facts = facts_of(cfg, dict(shapes) if shapes is not None else model_shapes(cfg.model), parsed)
    plan = MemoryPlan(
        [], facts.ranks, facts.ranks_per_node, facts.device, facts.title, list(facts.notes)
    )
    for name, stage_cfg in parsed.items():
        estimate = ESTIMATES.get(name)
        if estimate is None:  # allocate: a few tables
            plan.stages.append(_build(name, facts, stage_cfg, lambda f, c: ({}, {})))
            continue
        plan.stages.append(_build(name, facts, stage_cfg, estimate.plan))
        plan.fixes[name] = [
            (what, _later(name, alt_facts, alt_cfg, estimate.plan))
            for what, alt_facts, alt_cfg in estimate.fixes(facts, stage_cfg)
        ]
    return plan


def measured(run_dir: str | Path) -> dict[str, int]:
    """{stage: its peak RSS in bytes} as a finished run recorded it (pipeline.peakmem), for
    comparing a plan with what ran; stages without the record are left out."""
    from pipeline.rundir import read_done

    out = {}
    for name in registry.ORDER:
        done = read_done(Path(run_dir) / name) or {}
        peak = done.get("metrics", {}).get("peak_rss_mib")
        if peak is not None:
            out[name] = int(peak * 2**20)
    return out


def _later(name: str, facts: RunFacts, cfg: Any, plan: Callable) -> Callable[[], StageMemory]:
    return lambda: _build(name, facts, cfg, plan)


def _build(name: str, facts: RunFacts, cfg: Any, plan: Callable) -> StageMemory:
    device, host = plan(facts, cfg)
    host = {"runtime": facts.runtime_bytes(name)} | facts.corpus(name) | host
    terms = dict(host)
    if facts.device == "cpu":  # one memory: the device terms are the host's too
        terms |= device
        return StageMemory(name, 0, sum(terms.values()), terms)
    terms = {f"host {k}": v for k, v in host.items()} | device
    return StageMemory(name, sum(device.values()), sum(host.values()), terms)


def capacity(
    plan_cfg: PlanConfig, device: str, cluster: Mapping[str, Any] | None = None
) -> Capacity:
    """What this node (or the Slurm allocation) and one accelerator of `device` hold."""
    host, host_source = _host_capacity(plan_cfg, cluster or {})
    if plan_cfg.device_mem_gib is not None:
        return Capacity(
            host, int(plan_cfg.device_mem_gib * GIB), host_source, "plan.device_mem_gib"
        )
    if device == "cpu":
        return Capacity(host, None, host_source, "no accelerator")
    free = _device_free(device)
    if free is None:
        return Capacity(host, None, host_source, f"no {device} device here to ask")
    return Capacity(host, free, host_source, f"{device} free memory")


def _host_capacity(plan_cfg: PlanConfig, cluster: Mapping[str, Any]) -> tuple[int | None, str]:
    if plan_cfg.host_mem_gib is not None:
        return int(plan_cfg.host_mem_gib * GIB), "plan.host_mem_gib"
    slurm = os.environ.get("SLURM_MEM_PER_NODE")
    if slurm and slurm.isdigit():
        return int(slurm) * 2**20, "the Slurm allocation (SLURM_MEM_PER_NODE)"
    if cluster.get("mem_gb"):
        return int(float(cluster["mem_gb"]) * 2**30), "cluster.mem_gb"
    available = meminfo("MemAvailable")
    return available, "MemAvailable (/proc/meminfo)"


def _device_free(device: str) -> int | None:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0])
    npu = getattr(torch, "npu", None)
    if device == "npu" and npu is not None and npu.is_available():
        return int(npu.mem_get_info()[0])
    return None
