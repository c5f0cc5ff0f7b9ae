"""The whole workflow at real widths and vocabularies but few layers: each stage's peak memory
beside the memory planner's prediction, then the planner's projection for the full models.

Shapes (random weights, bf16 safetensors written shard by shard, a small draft with tied
embeddings, and a byte-level BPE built offline whose ids fill the vocabulary as Llama 3's do):

* ``default``: the embedded default workflow (bootstrap models), or a finished run's records
  (``--default-run DIR``);
* ``8b``: Llama-3-8B widths (hidden 4096, intermediate 14336, vocab 128256, 32 heads / 8 kv
  heads), 2 layers, every stage;
* ``70b`` and ``70b-2``: Llama-3-70B widths (hidden 8192, intermediate 28672, 64 / 8 heads), 1
  and 2 layers: sensitivity (streamed), allocate and quantize;
* ``small``: hidden 1024, vocab 32000, 2 layers, every stage (a quick check of the bench).

A shape's stages run as one ``lowbit`` child process, as a user runs them (``--per-stage``: a
child each), with a few training steps, a small calibration set and streamed sensitivity; each
stage's peak resident set is what it records in ``_done.json`` (``pipeline/peakmem.py``). A
watcher stops a child whose processes hold more than ``--limit-gib`` (the machine is shared): the
stage it was in then says so, with the most it was seen to hold, and the later ones do not run.
lowbit's own start check refuses a run its memory plan says will not fit the memory available
(the row carries its line); ``--set plan.check=false`` starts it anyway, the watcher still on.

Goals: the planner within ±20% of the measured peak of every stage on the default, 8B-shaped and
70B-shaped runs; the 8B-shaped run completes every stage inside 24 GiB; the 70B-shaped
sensitivity and quantize peak at most 0.25x the checkpoint at 70B's depth (``depth_goal``: at 1
layer the embedding and head alone are 73% of the checkpoint). Exits 1 when one is missed or
cannot be checked.

    python -m bench.rehearsal --shapes default,8b,70b,70b-2 --default-run outputs/default
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._common import (
    REPO,
    add_goal_args,
    compose,
    goal,
    markdown_table,
    report_goals,
    result_table,
    unmeasured,
    write_result,
)

GIB = 2**30
FIT_LO, FIT_HI = 0.8, 1.2  # planner / measured, every stage
MACHINE_GIB = 24.0  # the 8B-shaped run completes every stage inside this machine's memory
STREAM_SHARE = 0.25  # the 70B-shaped sensitivity and quantize peak / checkpoint size
USER_STAGES = ("sensitivity", "allocate", "quantize", "distill", "reinforce", "evaluate", "export")
# A small draft of the target's vocabulary, its embedding tied to its head (as Llama 3.2 1B's).
DRAFT = dict(hidden=256, layers=1, intermediate=1024, heads=4, kv_heads=2)


@dataclass(frozen=True)
class Shape:
    """A target's widths and depth (and the stages it rehearses); None widths: the bootstrap's."""

    name: str
    stages: tuple[str, ...]
    hidden: int | None = None
    intermediate: int | None = None
    layers: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    vocab: int | None = None
    overrides: tuple[str, ...] = field(default=())

    @property
    def synthetic(self) -> bool:
        return self.hidden is not None

    def sizes(self) -> dict[str, int]:
        return dict(
            hidden=self.hidden,
            layers=self.layers,
            vocab=self.vocab,
            intermediate=self.intermediate,
            heads=self.heads,
            kv_heads=self.kv_heads,
        )


ORDER_ALL = ("bootstrap", *USER_STAGES)
STREAMED = ("sensitivity", "allocate", "quantize")
FULL_70B_LAYERS = 80  # Llama-3-70B's depth (tests/assets/llama3_70b)
SHAPES = {
    "default": Shape("default", ORDER_ALL),
    "8b": Shape("8b", USER_STAGES, 4096, 14336, 2, 32, 8, 128256),
    "70b": Shape("70b", STREAMED, 8192, 28672, 1, 64, 8, 128256),
    "70b-2": Shape("70b-2", STREAMED, 8192, 28672, 2, 64, 8, 128256),
    "small": Shape("small", USER_STAGES, 1024, 2816, 2, 16, 4, 32000),
}

# Every user-model stage, small: a few training steps, a small calibration set, the Fisher
# streamed one segment at a time, a few held-out windows and prompts; the float-kept embeddings
# and head frozen, as a user whose target barely fits would set them. Compute, not memory, limits
# a rehearsal on a shared 2-core machine: RTN (GPTQ's Hessians are planned, not rehearsed here),
# three formats, no score for the layers quant.keep_float keeps float, no timed decoding.
RUN = (
    "tracking=none",
    "data.builtin_packages=[]",
    "quant.calib.samples=2",
    "quant.calib.seq_len=64",
    "data.seq_len=64",
    "stage.sensitivity.stream=true",
    "quant.method=rtn",
    "quant.candidates=[int2g64,int3g128,int4g128]",
    "stage.sensitivity.include_lm_head=false",
    "stage.sensitivity.include_embeddings=false",
    "stage.distill.train.steps=2",
    "stage.distill.train.batch=2",
    "stage.distill.train.val_every=2",
    "stage.distill.train.warmup=0",
    "stage.distill.val_windows=4",
    "stage.distill.trainable=[scales,norms]",
    "stage.reinforce.train.steps=2",
    "stage.reinforce.train.batch=2",
    "stage.reinforce.train.val_every=2",
    "stage.reinforce.train.warmup=0",
    "stage.reinforce.train_prompts=2",
    "stage.reinforce.val_prompts=2",
    "stage.reinforce.eval_prompts=1",
    "stage.reinforce.eval_new_tokens=4",
    "stage.evaluate.scenario_prompts=1",
    "stage.evaluate.spec_prompts=1",
    "stage.evaluate.spec_new_tokens=4",
    "stage.evaluate.batch_size=2",
    "stage.evaluate.error_flow_windows=2",
    "stage.evaluate.timing=false",
    "stage.evaluate.scenarios=[mix]",
    "stage.evaluate.adaptive=false",
    "data.eval_windows=2",
    "data.eval_seq_len=128",
)


def build(shape: Shape, root: Path) -> tuple[Path, Path, dict[str, Any]]:
    """The shape's target and draft checkpoints under ``root`` (reused when complete), and
    what was built: parameters, checkpoint bytes, tokenizer size, seconds."""
    import torch

    from pipeline.config import DataConfig
    from pipeline.data.text import load_splits
    from pipeline.models.synthetic import synthetic_tokenizer, write_synthetic_checkpoint

    target, draft = root / "target", root / "draft"
    t0 = time.time()
    if not (target / "config.json").is_file() or not (draft / "config.json").is_file():
        docs = load_splits(DataConfig(builtin_packages=[]))["train"]
        tok = synthetic_tokenizer(docs, shape.vocab)
        ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                   max_position_embeddings=8192)  # fmt: skip
        for path, sizes, tied in ((target, shape.sizes(), False), (draft, DRAFT, True)):
            shutil.rmtree(path, ignore_errors=True)
            tok.save_pretrained(path)  # config.json last: it marks the checkpoint complete
            write_synthetic_checkpoint(
                path, **(sizes | {"vocab": shape.vocab}), dtype=torch.bfloat16, shard_bytes=GIB,
                tie_word_embeddings=tied, **ids,
            )  # fmt: skip
    nbytes = sum(f.stat().st_size for f in target.glob("*.safetensors"))
    config = json.loads((target / "config.json").read_text())
    built = {"shape": shape.name, "checkpoint GiB": nbytes / GIB, "params (B)": nbytes / 2e9,
             "layers": config["num_hidden_layers"], "build seconds": time.time() - t0}  # fmt: skip
    return target, draft, built


def overrides(shape: Shape, run_dir: Path, target: Path | None, draft: Path | None) -> list[str]:
    """The ``lowbit`` overrides of the shape's run (without ``stages``): the embedded default
    as it is, a synthetic target with ``RUN``'s small settings."""
    if target is None:
        return ["tracking=none", *shape.overrides, f"run_dir={run_dir}"]
    models = ["model=hf", f"model.target.path={target}", f"model.draft.path={draft}"]
    return [*models, *RUN, *shape.overrides, f"run_dir={run_dir}"]


def _tree_rss_kib(pid: int) -> int:
    """Resident KiB of ``pid`` and its descendants (a stage may start workers). A child that has
    not yet exec'd (its command line is its parent's) shares its parent's pages: the git calls a
    stage makes on ending counted the stage twice."""
    total, todo = 0, [(pid, b"")]
    while todo:
        p, parent_cmd = todo.pop()
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
            status = Path(f"/proc/{p}/status").read_text()
            if cmd != parent_cmd:
                total += next(
                    int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:")
                )
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [(int(c), cmd) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue  # gone meanwhile
    return total


def run_child(args: Sequence[str], log: Path, limit_gib: float, threads: int) -> tuple[str, float]:
    """``lowbit <args>`` in a child, stopped when its processes hold over ``limit_gib``.

    Returns:
        (status: done | failed (exit N) | stopped at X GiB, the most RSS seen in GiB).
    """
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads),
                        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "pipeline", *args]
    seen, stopped = 0, None
    with log.open("w") as out:
        out.write(" ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
        while proc.poll() is None:
            seen = max(seen, _tree_rss_kib(proc.pid))
            if seen > limit_gib * 2**20 and stopped is None:
                stopped = f"stopped at {seen / 2**20:.1f} GiB (over --limit-gib {limit_gib})"
                os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.2)
    if stopped:
        return stopped, seen / 2**20
    if proc.returncode == 0:
        return "done", seen / 2**20
    # lowbit's one line (a refusal by the memory plan, a failed stage) says why
    errors = [x for x in log.read_text().splitlines() if "[ERROR]" in x]
    why = errors[-1].split("] - ", 1)[-1][:300] if errors else "see " + str(log)
    return f"failed (exit {proc.returncode}): {why}", seen / 2**20


def stage_record(stage_dir: Path) -> tuple[float | None, float | None]:
    """(its own peak RSS in GiB, seconds) as the stage's ``_done.json`` records them (pipeline/
    peakmem.py); (None, None) when it did not finish."""
    from pipeline.rundir import read_done

    done = read_done(stage_dir)
    if done is None:
        return None, None
    metrics = done.get("metrics", {})
    mib = metrics.get("peak_rss_mib", metrics.get("process_peak_rss_mib"))
    return (None if mib is None else mib / 1024), done.get("timings", {}).get("seconds")


def planned_gib(args: Sequence[str], stages: Sequence[str]) -> dict[str, float] | str:
    """The memory planner's peak per stage of ``lowbit <args>`` on this machine, in GiB, or why
    there is none (the comparison's only contact with the planner)."""
    try:
        plan = _plan(args, stages)
    except Exception as err:  # the bench still reports what it measured
        return f"the planner failed: {type(err).__name__}: {err}"
    # On a CPU, device and host are one memory (the planner puts every term on the host).
    return {s.stage: (s.host_bytes + s.device_bytes) / GIB for s in plan.stages}


def _plan(args: Sequence[str], stages: Sequence[str] | None = None):
    """``pipeline.memplan.plan_run`` of the run ``lowbit <args>`` makes, for ``stages`` (None:
    the config's), each with the settings the workflow hands it."""
    from pipeline.config import run_config
    from pipeline.memplan import plan_run
    from pipeline.workflow import stage_config

    cfg = compose(args)
    chosen = list(cfg.stages if stages is None else stages)
    return plan_run(run_config(cfg), {n: stage_config(cfg, n)[0] for n in chosen})


def rehearse(
    shape: Shape, root: Path, limit_gib: float, threads: int, per_stage: bool
) -> tuple[list, dict]:
    """Run the shape's stages, in one child or one each: a row per stage, and what ``build``
    built. One child is how a user runs them (each stage's peak counts what the earlier ones
    left in the process, as the planner's does); one each isolates them."""
    run_dir = root / "run"
    target = draft = None
    built: dict[str, Any] = {}
    if shape.synthetic:
        target, draft, built = build(shape, root)
    args = overrides(shape, run_dir, target, draft)
    planned = planned_gib(args, shape.stages)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    unfinished = None  # the first stage without a record: those after it did not run
    for group in [[s] for s in shape.stages] if per_stage else [list(shape.stages)]:
        if unfinished is None:
            log = root / "logs" / f"{group[0] if per_stage else 'run'}.out"
            outcome, seen = run_child([*args, f"stages=[{','.join(group)}]"], log, limit_gib,
                                      threads)  # fmt: skip
        for stage in group:
            gib, seconds = stage_record(run_dir / stage)
            row = {"shape": shape.name, "stage": stage, "seconds": seconds}
            if unfinished is not None:
                row["status"] = f"not run ({unfinished} did not finish)"
            elif gib is None:
                unfinished, row["status"] = stage, outcome
            else:
                row["status"] = "done"
            row["watched GiB"] = seen if unfinished in (None, stage) else None
            rows.append(row | compare(gib, planned, stage))
            print(markdown_table([rows[-1]], COLUMNS).splitlines()[-1], flush=True)
    return rows, built


def from_bootstrap(
    run_dir: Path, root: Path, limit_gib: float, threads: int, per_stage: bool
) -> list[dict[str, Any]]:
    """The default shape on a finished run's bootstrap models (minutes of training saved): its
    recorded bootstrap row, then every user stage rerun in a child on a copy of them."""
    rows = [r for r in recorded(run_dir) if r["stage"] == "bootstrap"]
    if not (root / "run" / "bootstrap").is_dir():
        shutil.copytree(run_dir / "bootstrap", root / "run" / "bootstrap")
    shape = dataclasses.replace(SHAPES["default"], stages=USER_STAGES)
    return rows + rehearse(shape, root, limit_gib, threads, per_stage)[0]


def recorded(run_dir: Path) -> list[dict[str, Any]]:
    """Rows of a finished default run: its stages' recorded peaks beside the planner's, for the
    overrides the run was started with (its newest ``.hydra/*/overrides.yaml``)."""
    import yaml

    found = sorted(run_dir.glob(".hydra/*/overrides.yaml"))
    given = yaml.safe_load(found[-1].read_text()) if found else []
    args = [o for o in given if not o.startswith(("stages=", "run_dir="))] + [f"run_dir={run_dir}"]
    planned = planned_gib(args, [s for s in ORDER_ALL if (run_dir / s).is_dir()])
    rows = []
    for stage in ORDER_ALL:
        gib, seconds = stage_record(run_dir / stage)
        status = "done (recorded)" if gib is not None else "not in the run"
        row = {"shape": "default", "stage": stage, "status": status, "seconds": seconds}
        rows.append(row | compare(gib, planned, stage))
    return rows


def compare(measured: float | None, planned: dict[str, float] | str, stage: str) -> dict:
    """The measured and planned GiB of one stage and their ratio (None where one is missing)."""
    plan = planned.get(stage) if isinstance(planned, dict) else None
    ratio = plan / measured if plan is not None and measured else None
    why = planned if isinstance(planned, str) else None
    return {"measured GiB": measured, "planned GiB": plan, "planned/measured": ratio,
            "no plan": why}  # fmt: skip


COLUMNS = ("shape", "stage", "status", "measured GiB", "planned GiB", "planned/measured",
           "watched GiB", "seconds")  # fmt: skip


def rehearsal_goals(rows: Sequence[dict], checkpoint_gib: dict[str, float]) -> list[dict]:
    """The bench's goals from its rows (``COLUMNS``) and the synthetic checkpoints' sizes."""
    goals = []
    for shape in ("default", "8b", "70b"):
        name = f"{shape}: planned / measured peak, the stage furthest from 1"
        want = f"every stage within {FIT_LO}-{FIT_HI}"
        mine = [r for r in rows if r["shape"].split("-")[0] == shape]  # 70b: both depths
        gaps = [r["stage"] for r in mine if r.get("planned/measured") is None]
        if not mine or gaps:
            why = "not run" if not mine else f"no planned/measured pair for {', '.join(gaps)}"
            goals.append(unmeasured(name, want, why))
            continue
        worst = max(mine, key=lambda r: abs(r["planned/measured"] - 1))
        ratio = worst["planned/measured"]
        goals.append(goal(f"{name} ({worst['stage']})", ratio, want, FIT_LO <= ratio <= FIT_HI))
    name, want = "8b: every stage done, the highest peak GiB", f"<= {MACHINE_GIB}, every stage done"
    mine = [r for r in rows if r["shape"] == "8b"]
    peaks = [r["measured GiB"] for r in mine if r.get("measured GiB") is not None]
    undone = [r["stage"] for r in mine if not str(r.get("status")).startswith("done")]
    if not mine:
        goals.append(unmeasured(name, want, "not run"))
    elif undone:
        goals.append(unmeasured(name, want, f"{', '.join(undone)} did not finish"))
    else:
        goals.append(goal(name, max(peaks), want, max(peaks) <= MACHINE_GIB))
    goals.append(depth_goal(rows, checkpoint_gib))
    return goals


def depth_goal(rows: Sequence[dict], checkpoint_gib: dict[str, float]) -> dict:
    """The 70B-shaped sensitivity and quantize peak at Llama-3-70B's depth over its checkpoint:
    each stage's peak at 2 layers plus its growth from 1 to 2 layers for each further layer, the
    checkpoint grown by the second layer's bytes. At 1 layer the embedding and head alone are 73%
    of the checkpoint, so the share there measures them, not streaming; the growth per layer is
    what streaming keeps at zero."""
    name = f"70b: sensitivity and quantize peak / checkpoint at {FULL_70B_LAYERS} layers, the "
    name += "larger (each stage's growth from 1 to 2 layers extrapolated)"
    want = f"<= {STREAM_SHARE}"
    peaks = {(r["shape"], r["stage"]): r.get("measured GiB") for r in rows}
    pairs = [(sh, st) for sh in ("70b", "70b-2") for st in ("sensitivity", "quantize")]
    lacking = [f"{sh} {st}" for sh, st in pairs if peaks.get((sh, st)) is None]
    lacking += [f"{sh} checkpoint size" for sh in ("70b", "70b-2") if not checkpoint_gib.get(sh)]
    if lacking:
        return unmeasured(name, want, f"no measured {', '.join(lacking)}")
    more = FULL_70B_LAYERS - 2
    full = checkpoint_gib["70b-2"] + more * (checkpoint_gib["70b-2"] - checkpoint_gib["70b"])
    two = {st: peaks[("70b-2", st)] for st in ("sensitivity", "quantize")}
    deep = [two[st] + more * max(0.0, two[st] - peaks[("70b", st)]) for st in two]
    return goal(name, max(deep) / full, want, max(deep) / full <= STREAM_SHARE)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--shapes", default="default,8b,70b,70b-2", help=f"comma list of {', '.join(SHAPES)}"
    )
    p.add_argument(
        "--root",
        default="/tmp/lowbit-rehearsal",
        help="checkpoints, run dirs and logs, one folder per shape (checkpoints kept)",
    )
    p.add_argument("--default-run", default=None,
                   help="a finished default run dir: its bootstrap models and recorded bootstrap "
                   "peak stand for the default's bootstrap (else it is trained too)")  # fmt: skip
    p.add_argument(
        "--limit-gib",
        type=float,
        default=14.0,
        help="stop a stage whose processes hold more than this (shared machine)",
    )
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every child")
    p.add_argument("--fresh", action="store_true", help="remove each shape's run dir first")
    p.add_argument("--per-stage", action="store_true", help="a child per stage, not per shape")
    p.add_argument("--build-only", action="store_true", help="write the checkpoints and stop")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="one more lowbit override of the synthetic shapes' runs (repeatable), after RUN's",
    )  # fmt: skip
    p.add_argument("--out", default="bench-out/rehearsal", help="folder for result.json")
    add_goal_args(p)
    args = p.parse_args()

    rows: list[dict] = []
    built: list[dict] = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            p.error(f"--shapes: unknown shape {name!r}; choose from {', '.join(SHAPES)}")
        shape, root = SHAPES[name], Path(args.root).resolve() / name
        if shape.synthetic:
            shape = dataclasses.replace(shape, overrides=(*shape.overrides, *args.set))
        if args.build_only:
            if shape.synthetic:
                print(build(shape, root)[2], flush=True)
            continue
        if args.fresh:
            shutil.rmtree(root / "run", ignore_errors=True)
        if name == "default" and args.default_run:
            run_dir = Path(args.default_run).resolve()
            rows += from_bootstrap(run_dir, root, args.limit_gib, args.threads, args.per_stage)
            continue
        print(f"\n{name}: {shape}", flush=True)
        shape_rows, shape_built = rehearse(
            shape, root, args.limit_gib, args.threads, args.per_stage
        )
        rows += shape_rows
        built += [shape_built] if shape_built else []
    if args.build_only:
        return 0
    sizes = {b["shape"]: b["checkpoint GiB"] for b in built}
    goals = rehearsal_goals(rows, sizes)
    projected = projection(Path(args.root).resolve() / "full")
    tables = [result_table("peak resident memory per stage: measured and planned", rows, COLUMNS),
              result_table("the synthetic checkpoints (bf16)", built)]  # fmt: skip
    if not isinstance(projected, str):
        title = "the planner's projection for the full models on the experiments' hardware"
        tables.append(result_table(title, projected[0]))
    notes = [f"settings of every user-model stage: {' '.join([*RUN, *args.set])}",
             f"draft: {DRAFT} with tied embeddings; stage children at OMP_NUM_THREADS="
             f"{args.threads}, stopped over {args.limit_gib} GiB"]  # fmt: skip
    if isinstance(projected, str):
        notes.append(f"no projection: {projected}")
    else:
        notes += projected[1] or ["the projection: every stage fits the experiments' devices"]
    notes += sorted({f"no plan: {r['no plan']}" for r in rows if r.get("no plan")})
    print("\n" + markdown_table(rows, COLUMNS))
    write_result(args.out, "rehearsal", tables, goals, args.skip_goal, notes)
    return report_goals(goals, Path(args.out), skip=args.skip_goal)


def projection(root: Path) -> tuple[list[dict], list[str]] | str:
    """The planner's per-rank peaks for the full Llama-3-8B with its 1B draft on one node of
    8 x 80 GB GPUs (``experiment=gpu_8b``) and the full 70B on 4 Slurm nodes of 8 x 64 GB NPUs
    (``experiment=npu_70b``), from their config.json alone (``tests/assets``): rows, and the
    planner's lines for each stage that would not fit; or why there is none."""
    from pipeline.memplan import Capacity

    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.txt"  # the experiments read a local corpus; the plan never opens it
    corpus.write_text("a line of text\n" * 4)
    assets = REPO / "tests" / "assets"
    rows, problems = [], []
    for experiment, (target, draft, device_gb) in HARDWARE.items():
        args = [f"experiment={experiment}", f"model.target.path={assets / target}",
                f"data.path={corpus}", "tracking=none", f"run_dir={root / experiment}"]  # fmt: skip
        args += [f"model.draft.path={assets / draft}"] if draft else []
        try:
            plan = _plan(args)
        except Exception as err:
            return f"{experiment}: the planner failed: {type(err).__name__}: {err}"
        cap = Capacity(None, int(device_gb * 1e9), "unknown", f"{device_gb} GB")
        problems += [f"{experiment}: {line}" for line in plan.fits(cap)]
        for s in plan.stages:
            rows.append({
                "experiment": experiment, "model": plan.model, "ranks": plan.ranks,
                "stage": s.stage, "device GiB per rank": s.device_bytes / GIB,
                "host GiB per rank": s.host_bytes / GIB, "device GiB": device_gb * 1e9 / GIB,
                "fits": s.device_bytes <= device_gb * 1e9, "largest terms": s.largest(),
            })  # fmt: skip
    return rows, problems


# The experiments' hardware: the target's and the draft's config.json, one accelerator's GB.
HARDWARE = {"gpu_8b": ("llama3_8b", "llama3_1b", 80), "npu_70b": ("llama3_70b", None, 64)}


if __name__ == "__main__":
    sys.exit(main())
