"""Helpers shared by the benchmarks: config, quantization, memory, tables, MLflow.

Peak memory is measured two ways, and each table says which:
* ``PeakRSS``: a thread samples this process's resident set (``/proc/self/status``) every
  few milliseconds while a block runs; a row's peak therefore includes what the process
  already held (imports, the FP model kept for comparison).
* ``hwm_mib`` printed by a fresh child process: the kernel's high-water mark of that process's
  own address space (``VmHWM``). Exact, but every row pays the interpreter and imports.
  (``ru_maxrss`` of a child is not used: Linux carries the parent's RSS at fork into it.)
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import logging
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def compose(overrides: Sequence[str]):
    """The config ``lowbit <overrides>`` would run with."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from pipeline import conf_dir
    from pipeline.stages import register_configs

    register_configs()  # the defaults Hydra composes on, from the dataclasses
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def stage_cfg(name: str, *overrides: str):
    """The parsed ``stage.<name>`` that ``lowbit <overrides>`` would hand the stage."""
    from pipeline.workflow import stage_config

    quiet = [] if any(o.startswith("tracking=") for o in overrides) else ["tracking=none"]
    return stage_config(compose([*quiet, *overrides]), name)[0]


def quantize_uniform(
    src: str | Path, out_dir: Path, plan: dict[str, str], calib, *, quant, batch_size: int,
    work_dir: Path, dtype=None, stream: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """The quantize stage's core (``pipeline.streaming.quantize_checkpoint``) on one process.

    Args:
        src: FP checkpoint directory.
        out_dir: The quantized model directory to write.
        plan: ``{linear name: format}``.
        calib: (N, T) calibration token ids.
        quant: A ``QuantConfig``: method, GPTQ settings, segment size, activation budget.
        batch_size: Calibration windows per forward pass.
        work_dir: Scratch folder for committed segments.
        dtype: Compute dtype (default float32, as the stage's default).
        stream: False loads the whole model first (the reference the memory bench compares).

    Returns:
        The quant report (``avg_bits``, ``layers``, ...).
    """
    import torch

    from pipeline.models import StreamingCheckpoint
    from pipeline.streaming import StreamOptions, quant_options, quantize_checkpoint

    ckpt = StreamingCheckpoint(src, dtype=dtype or torch.float32)
    walk = StreamOptions(
        quant.segment_size, batch_size, quant.activation_budget_gb, stream=stream, progress=False
    )
    return quantize_checkpoint(
        ckpt, out_dir, plan, calib, quant_options(quant), walk, work_dir=work_dir
    )


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def rss_mib() -> float:
    """This process's current resident set size in MiB."""
    return _status_mib("VmRSS")


def hwm_mib() -> float:
    """This process's peak resident set size in MiB (since its exec)."""
    return _status_mib("VmHWM")


class PeakRSS:
    """Context manager: the highest resident set size seen while the block ran (MiB)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s, self.peak_mib = interval_s, 0.0
        self._stop = threading.Event()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, rss_mib())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.peak_mib = rss_mib()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mib = max(self.peak_mib, rss_mib())


def run_child(cmd: Sequence[str], timeout_s: float | None = None) -> tuple[str, float, float]:
    """Run ``cmd``; returns (stdout, wall seconds, ``ru_maxrss`` MiB of the child).

    ``ru_maxrss`` includes the parent's RSS at fork time; children that matter print
    ``hwm_mib()`` instead.

    Raises:
        RuntimeError: If the child fails (its stderr tail is in the message).
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    timer = threading.Timer(timeout_s, proc.kill) if timeout_s else None
    if timer:
        timer.start()
    out_chunks: list[str] = []
    err_chunks: list[str] = []
    readers = [
        threading.Thread(target=lambda: out_chunks.append(proc.stdout.read())),
        threading.Thread(target=lambda: err_chunks.append(proc.stderr.read())),
    ]
    for r in readers:
        r.start()
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own ru_maxrss, not all children's
    for r in readers:
        r.join()
    if timer:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "".join(err_chunks)[-2000:]
        raise RuntimeError(f"{cmd[:3]} failed (exit {proc.returncode}):\n{tail}")
    return "".join(out_chunks), wall, usage.ru_maxrss / 1024


def last_json_line(text: str) -> Any:
    """The last line of ``text`` that parses as JSON (children print their result last)."""
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    raise ValueError(f"no JSON result in the child's output:\n{text[-1000:]}")


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}" if abs(v) < 1e6 else f"{v:.4e}"
    return "" if v is None else str(v)


def markdown_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    """Rows (dicts) as a markdown table with the given columns, in that order."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict[str, Any]], columns: Sequence[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def log_mlflow(
    uri: str | None, experiment: str, run_name: str, rows: list[dict[str, Any]], key: str,
    params: dict[str, Any], artifacts: Sequence[Path],
) -> None:  # fmt: skip
    """One MLflow run: numeric columns of each row as ``<row[key]>/<column>`` metrics."""
    if not uri:
        return
    import mlflow

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=run_name):
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        for r in rows:
            label = "".join(ch if ch.isalnum() or ch in "-_./" else "_" for ch in str(r[key]))
            mlflow.log_metrics(
                {f"{label}/{k}": float(v) for k, v in r.items() if isinstance(v, int | float)}
            )
        for a in artifacts:
            mlflow.log_artifact(str(a))
    print(f"logged to MLflow {uri} (experiment {experiment!r})", file=sys.stderr)


# The CPU flags that decide which kernels run (lowbit's AVX-512 VNNI or AVX2 ones, torch's
# bf16 and AMX paths), named in every machine line whether present or not.
def machine() -> str:
    """CPU model, its flags that decide a default, cores, commit, memory and load: the docs'
    machine line (``pipeline.hardware``)."""
    from pipeline.hardware import describe, meminfo, where

    total = meminfo("MemTotal")
    mem = total / 2**30 if total is not None else float("nan")
    return f"{describe(where())}, {mem:.0f} GiB RAM, load avg {os.getloadavg()[0]:.1f}"


def cpu_kernels() -> str:
    """The ISA lowbit's CPU kernels run in and why (auto or ``LOWBIT_CPU_ISA``), e.g. "avx2
    (LOWBIT_CPU_ISA=avx2)"; "none" where torch's kernels serve."""
    from pipeline import cpu_ext

    asked = os.environ.get(cpu_ext.ENV)
    return f"{cpu_ext.isa() or 'none'} ({f'{cpu_ext.ENV}={asked}' if asked else 'auto'})"


def goal(name: str, value: float | None, want: str, met: bool) -> dict[str, Any]:
    """One goal row: what was measured, what it had to be, and whether it was."""
    return {"goal": name, "value": value, "want": want, "verdict": "met" if met else "MISSED"}


def unmeasured(name: str, want: str, why: str) -> dict[str, Any]:
    """A goal whose rows or inputs are missing: missed, so that a run which could not check it
    does not pass; only ``--skip-goal`` takes it out of the verdict."""
    return goal(f"{name} (not measured: {why})", None, want, False)


def add_goal_args(parser: argparse.ArgumentParser) -> None:
    """``--skip-goal TEXT`` (repeatable): the one way to narrow a bench's goals."""
    parser.add_argument(
        "--skip-goal", action="append", default=[], metavar="TEXT",
        help="leave out of the exit status each goal whose name contains TEXT (repeatable); "
        "any other goal that could not be checked counts as missed",
    )  # fmt: skip


def parse_bench_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Add ``--threads``, ``--out`` and ``--skip-goal``, parse, then set up logging and torch's
    threads."""
    parser.add_argument("--threads", type=int, help="torch threads (1 on a busy host)")
    parser.add_argument("--out", type=Path, help="folder for result.json (--root)")
    add_goal_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return args


def _skipped(goals: Sequence[dict[str, Any]], skip: Sequence[str]) -> list[dict[str, Any]]:
    """Goals with each one a ``--skip-goal`` text matches marked skipped (its verdict kept)."""
    return [
        {**g, "verdict": f"skipped ({g['verdict']})"} if any(s in g["goal"] for s in skip) else g
        for g in goals
    ]


def report_goals(
    goals: list[dict[str, Any]], out: Path | None = None, skip: Sequence[str] = ()
) -> int:
    """Print (and write to ``out/goals.md``) the goals table; the exit status: 1 if one missed.

    Args:
        goals: Rows of :func:`goal` and :func:`unmeasured`.
        out: Folder for ``goals.md`` (None: print only).
        skip: ``--skip-goal`` texts; a goal whose name contains one is shown as skipped and
            does not count.
    """
    if not goals:
        print("no goal could be checked: the rows it compares are missing")
        return 1
    goals = _skipped(goals, skip)
    for text in skip:
        if not any(text in g["goal"] for g in goals):
            print(f"--skip-goal {text!r} matches no goal")
    table = markdown_table(goals, ("goal", "value", "want", "verdict"))
    print("\n" + table)
    if out is not None:
        (out / "goals.md").write_text(table + "\n")
    missed = [g["goal"] for g in goals if g["verdict"] == "MISSED"]
    skipped = sum(g["verdict"].startswith("skipped") for g in goals)
    if missed:
        print(f"goals missed: {'; '.join(missed)}")
    else:
        print(f"every goal checked met ({skipped} skipped)" if skipped else "every goal met")
    return 1 if missed else 0


def result_table(title: str, rows: Sequence[dict], columns: Sequence[str] | None = None) -> dict:
    """A result table: ``rows`` as dicts, ``columns`` in order (default: the first row's keys)."""
    columns = list(columns or (rows[0] if rows else ()))
    return {"title": title, "columns": columns, "rows": [[r.get(c) for c in columns] for r in rows]}


def parsed_tables(title: str, lines: str | Sequence[str]) -> list[dict]:
    """The markdown tables a bench printed (``| a | b |`` lines; any other line ends one) as
    result tables, titled ``title``, ``title (2)``, ..."""
    lines = lines.splitlines() if isinstance(lines, str) else lines
    blocks: list[list[list[str]]] = [[]]
    for line in lines:
        if line.strip().startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(c and set(c) <= set("-:") for c in cells):  # not the header's rule
                blocks[-1].append(cells)
        elif blocks[-1]:
            blocks.append([])
    blocks = [b for b in blocks if b]
    return [
        {"title": title if i == 0 else f"{title} ({i + 1})", "columns": b[0], "rows": b[1:]}
        for i, b in enumerate(blocks)
    ]


def _commit() -> tuple[str | None, bool]:
    """HEAD's full hash and whether tracked files other than ``docs/results`` differ from it
    (None outside a checkout)."""
    try:
        git = ["git", "-C", str(REPO)]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()  # fmt: skip
        # the benches' own committed results change as they run: not a change to what ran
        status = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", ".",
                                 ":(exclude)docs/results"],
                                capture_output=True, text=True, timeout=10).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None, False
    return head, bool(status.strip())


def write_result(
    out: str | Path, bench: str, tables: Sequence[dict], goals: Sequence[dict[str, Any]] = (),
    skip: Sequence[str] = (), notes: Sequence[str] = (),
) -> Path:  # fmt: skip
    """Write ``out/result.json``: what ``python -m bench.render`` turns into docs/benchmarks.md.

    Args:
        out: The bench's output folder (``--out``).
        bench: The bench's module name under ``bench/`` (``packing``).
        tables: Rows of :func:`result_table` or :func:`parsed_tables` (empty ones left out).
        goals: Rows of :func:`goal` and :func:`unmeasured` (verdicts as ``report_goals`` gives
            them, ``skip`` applied).
        skip: The ``--skip-goal`` texts.
        notes: Lines that say what the tables were measured on (model shape, ISA, settings).
    """
    import torch

    from pipeline.hardware import cpu_summary

    commit, dirty = _commit()
    result = {
        "bench": bench,
        "command": shlex.join(["python", "-m", f"bench.{bench}", *sys.argv[1:]]),
        "commit": commit,
        "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": cpu_summary()
        | {
            "torch": torch.__version__,
            "load_avg": os.getloadavg()[0],
            "isa_env": os.environ.get("LOWBIT_CPU_ISA", "auto"),  # avx2: AVX-512 flags hidden
        },
        "notes": list(notes),
        "tables": [t for t in tables if t["rows"]],
        "goals": _skipped(goals, skip),
    }
    path = Path(out) / "result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"result: {path}", file=sys.stderr)
    return path


def bootstrapped(root: Path, base: Sequence[str]) -> tuple[Path, Any, Path, Any]:
    """Bootstrap once into ``root/bootstrap`` (reused when up to date).

    Returns:
        That run dir, its composed config, the FP target's directory and the whole test split
        as (windows, seq_len) token ids, which every quality bench scores (evaluate's protocol).
    """
    from pipeline import runmodels, workflow
    from pipeline.config import data_cfg, model_cfg
    from pipeline.data.heldout import corpus_heldout
    from pipeline.data.text import Corpus
    from pipeline.models.hf import load_tokenizer

    boot = Path(root) / "bootstrap"
    workflow.run(compose([f"run_dir={boot}", *base, "stages=[bootstrap]"]))
    cfg = compose([f"run_dir={boot}", *base])
    target = runmodels.fp_target(model_cfg(cfg), runmodels.finished_stages(boot))
    return boot, cfg, target, corpus_heldout(Corpus(data_cfg(cfg), load_tokenizer(target))).windows


def seed_run(src: Path, dst: Path, stages: Sequence[str]) -> None:
    """Start ``dst`` with copies of finished stage folders of ``src`` (skipped when up to date).

    A copy whose stage ``src`` has since redone (other code or config: another fingerprint or
    other outputs) is replaced, so every variant starts from the same upstream results.
    """
    import shutil

    for stage in stages:
        if not (src / stage).exists():
            continue
        if (dst / stage).exists() and _done(dst / stage) != _done(src / stage):
            shutil.rmtree(dst / stage)
        if not (dst / stage).exists():
            shutil.copytree(src / stage, dst / stage)


def _done(stage_dir: Path) -> tuple:
    """What identifies a finished stage folder: its fingerprint and outputs digest."""
    try:
        done = json.loads((stage_dir / "_done.json").read_text())
    except (OSError, ValueError):
        return (None, None)
    return done.get("fingerprint"), done.get("outputs_digest")


def low_bit_model(run_dir: Path, name: str) -> Path:
    """The run's low-bit target ``name`` (target_quantized, target_distilled)."""
    from pipeline import runmodels

    return runmodels.quantized_targets(runmodels.finished_stages(run_dir))[name]
