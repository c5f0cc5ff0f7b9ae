"""A sweep's points side by side: `sweep.md`, `sweep.csv` and the Pareto plot `sweep.png`.

`lowbit -m quant.budget_bits=2.5,3 ...` opens a parent MLflow run for the sweep (`start`); every
point records itself in `<sweep dir>/points/<n>.json` (`SweepPoint`) and nests its workflow's run
under the sweep's. After the last point, `finish` reads each point's finished stages through their
hand-off types, writes the table and plot into the sweep dir and logs them to the sweep's run.
Points may run in other processes or hosts (submitit), so all of it goes through files.

    lowbit-sweep-summary outputs/smoke/.multirun/2026-01-01_12-00-00   # rebuild it afterwards
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from pipeline import plots
from pipeline.config import TrackingConfig
from pipeline.errors import LowbitError
from pipeline.evaluation.acceptance import final_target
from pipeline.evaluation.result import EvalResult
from pipeline.io import write_json
from pipeline.quant.plan import BitPlan
from pipeline.runmodels import finished_stages
from pipeline.speculative.stats import pair_name
from pipeline.streaming.quant_report import QuantReport
from pipeline.tracking import Tracker, reopen

log = logging.getLogger(__name__)

POINTS = "points"
OUTPUTS = ("sweep.md", "sweep.csv", "sweep.png")
FINISHED, FAILED, KILLED, RUNNING = "FINISHED", "FAILED", "KILLED", "RUNNING"
DRAFTS = ("draft_reinforced", "draft_fp")  # the final draft first
# column -> (header, lower is better); bits/weight is the x of every trade-off
METRICS = {
    "ppl": ("ppl ↓", True),
    "alpha": ("α ↑", False),
    "tokens_per_s": ("tokens/s ↑", False),
}
COLUMNS = ("bits", *METRICS)


@dataclass(frozen=True)
class SweepPoint:
    """One point of a sweep as its process recorded it: RUNNING until it ends (a RUNNING record
    after the sweep means its process died), then FINISHED, FAILED or KILLED."""

    num: int
    swept: dict[str, str]  # the values this point gives the keys the sweep varies
    run_dir: str
    status: str = RUNNING
    error: str | None = None
    exit_code: int | None = None

    def path(self, sweep_dir: Path) -> Path:
        return Path(sweep_dir) / POINTS / f"{self.num}.json"

    def save(self, sweep_dir: Path) -> Path:
        path = self.path(sweep_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, asdict(self), indent=1)
        return path

    def ended(self, status: str, error: str | None = None, code: int | None = None) -> SweepPoint:
        return replace(self, status=status, error=error, exit_code=code)

    @classmethod
    def load(cls, path: Path) -> SweepPoint:
        try:
            data = json.loads(Path(path).read_text())
            return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})
        except (OSError, ValueError, TypeError) as e:
            raise LowbitError(f"{path} is not a sweep point record ({e})") from None

    @classmethod
    def all(cls, sweep_dir: Path) -> list[SweepPoint]:
        """Every recorded point in order; an unreadable record as an UNREADABLE point."""
        found = sorted(Path(sweep_dir, POINTS).glob("*.json"), key=lambda p: (len(p.stem), p.stem))
        out = []
        for path in found:
            try:
                out.append(cls.load(path))
            except LowbitError as e:
                num = int(path.stem) if path.stem.isdigit() else -1
                out.append(cls(num, {}, "", "UNREADABLE", f"{e}; rerun this point"))
        return out


@dataclass
class Row:
    """A point's line in the summary: its numbers (None: not measured) and what it is missing."""

    point: SweepPoint
    values: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(COLUMNS))
    missing: list[str] = field(default_factory=list)
    pareto: list[str] = field(default_factory=list)  # the METRICS it is Pareto-optimal in

    @property
    def status(self) -> str:
        p = self.point
        shown = {RUNNING: "unfinished"}.get(p.status, p.status.lower())
        return shown if p.exit_code is None else f"{shown} (exit {p.exit_code})"

    @property
    def note(self) -> str:
        return self.point.error or ("no " + "; no ".join(self.missing) if self.missing else "")

    @property
    def label(self) -> str:
        return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in self.point.swept.items())


def measure(run_dir: Path) -> tuple[dict[str, float | None], list[str]]:
    """The point's numbers from its finished stages, read through their types, and what is
    missing with why: bits/weight as quantized (else as planned), then the final low-bit
    target's perplexity, its final draft's mean acceptance over the scenarios, and the pair's
    speculative tokens/s on the runtime's kernels (plain without a draft)."""
    done = finished_stages(run_dir)
    values: dict[str, float | None] = dict.fromkeys(COLUMNS)
    missing = []
    if "quantize" in done:
        values["bits"] = QuantReport.load(done["quantize"]).avg_bits
    elif "allocate" in done:
        values["bits"] = BitPlan.load(done["allocate"]).avg_bits
    else:
        missing.append("bits/weight (no finished allocate or quantize stage)")
    if "evaluate" not in done:
        return values, [*missing, "ppl, α, tokens/s (no finished evaluate stage)"]
    ev = EvalResult.load(done["evaluate"])
    final = final_target(ev.ppl)
    if final is None:
        return values, [*missing, "ppl, α, tokens/s (evaluate had no low-bit target)"]
    values["ppl"] = ev.ppl[final]
    pair = next((pair_name(d, final) for d in DRAFTS if pair_name(d, final) in ev.acceptance), None)
    if pair is None:
        missing.append("α (no draft)")
    else:
        per = {s: v for s, v in ev.acceptance[pair].items() if s != "mean"}
        values["alpha"] = ev.acceptance[pair].get("mean", sum(per.values()) / max(len(per), 1))
    if ev.speed is None:
        missing.append("tokens/s (stage.evaluate.timing=false)")
    else:
        timed = ev.speed["speculative"].get(pair) if pair else ev.speed["plain"].get(final)
        values["tokens_per_s"] = timed["tokens_per_s"] if timed else None
        if timed is None:
            missing.append("tokens/s (evaluate did not time this model)")
    return values, missing


def pareto(points: list[tuple[float, float]], lower_better: bool) -> list[bool]:
    """Which (bits, metric) points no other dominates: bits no higher and the metric no worse,
    one of the two strictly better."""
    sign = 1.0 if lower_better else -1.0
    keys = [(x, sign * y) for x, y in points]

    def beats(a, b) -> bool:
        return a[0] <= b[0] and a[1] <= b[1] and a != b

    return [not any(beats(other, p) for other in keys) for p in keys]


def rows(sweep_dir: Path) -> list[Row]:
    """A row per recorded point; only finished points get numbers (a failed one's folders may
    hold an earlier run's outputs), with their Pareto marks."""
    found = []
    for point in SweepPoint.all(sweep_dir):
        row = Row(point)
        if point.status == FINISHED:
            try:
                row.values, row.missing = measure(Path(point.run_dir))
            except LowbitError as e:  # a damaged hand-off: the row says which and how to fix
                row.missing = [f"numbers: {e}"]
        found.append(row)
    for name, (_, lower) in METRICS.items():
        both = [r for r in found if r.values.get("bits") is not None and r.values[name] is not None]
        marks = pareto([(r.values["bits"], r.values[name]) for r in both], lower)
        for row, best in zip(both, marks):
            if best:
                row.pareto.append(name)
    return found


def _cell(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def write_table(sweep_dir: Path, found: list[Row]) -> list[Path]:
    """`sweep.md` and `sweep.csv`: a line per point, its swept values first."""
    keys = list(dict.fromkeys(k for r in found for k in r.point.swept))
    heads = ["#", *keys, "bits/weight", *(h for h, _ in METRICS.values()), "Pareto-optimal in"]
    md = [f"# Sweep `{sweep_dir}`", "", "| " + " | ".join([*heads, "status"]) + " |"]
    md.append("|---" * (len(heads) + 1) + "|")
    table = []
    for r in found:
        swept = [r.point.swept.get(k, "") for k in keys]
        cells = [str(r.point.num), *swept, *(_cell(r.values[c]) for c in COLUMNS)]
        status = f"{r.status}: {r.note}" if r.note else r.status
        best = ", ".join(METRICS[m][0].split()[0] for m in r.pareto)
        md.append("| " + " | ".join([*cells, best, status]) + " |")
        table.append([r.point.num, *swept, *(r.values[c] for c in COLUMNS), " ".join(r.pareto),
                      r.status, r.note, r.point.run_dir])  # fmt: skip
    md += ["", DEFINITIONS, "", "![bits/weight against each metric](sweep.png)"]
    md_path, csv_path = Path(sweep_dir) / OUTPUTS[0], Path(sweep_dir) / OUTPUTS[1]
    md_path.write_text("\n".join(md) + "\n")
    with open(csv_path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["point", *keys, *COLUMNS, "pareto", "status", "note", "run_dir"])
        out.writerows([["" if v is None else v for v in line] for line in table])
    return [md_path, csv_path]


DEFINITIONS = (
    "bits/weight: as quantized (scales and zeros included), else as planned; ppl: the final "
    "low-bit target's perplexity on the test split; α: its final draft's acceptance, mean over "
    "the scenarios; tokens/s: that pair decoding speculatively on the runtime's kernels (plain "
    "without a draft). Only finished points have numbers."
)


def plot(sweep_dir: Path, found: list[Row]) -> Path:
    """`sweep.png`: bits/weight against each metric, the Pareto-optimal points marked."""
    panels = [
        (head, [r.values[name] for r in found], [name in r.pareto for r in found])
        for name, (head, _) in METRICS.items()
    ]
    return plots.tradeoffs(
        [r.values["bits"] for r in found],
        panels,
        [r.label for r in found],
        Path(sweep_dir) / OUTPUTS[2],
        f"{len(found)} points of sweep {Path(sweep_dir).name} (Pareto-optimal: starred)",
        "bits/weight",
    )


def start(sweep_dir: Path, tracking: TrackingConfig, name: str, overrides: list[str]) -> str | None:
    """Open the sweep's MLflow run (its id in the sweep dir's marker); None when not tracked."""
    Path(sweep_dir).mkdir(parents=True, exist_ok=True)
    tracker = Tracker(tracking, Path(sweep_dir), active=True)
    tracker.connect()
    params = {"sweep": dict(o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)}
    return tracker.start_parent(f"{name}-sweep", params).run_id


def finish(sweep_dir: Path) -> list[Row]:
    """Write the summary into the sweep dir and log it to the sweep's run, which ends FAILED
    when a point did not finish."""
    sweep_dir = Path(sweep_dir)
    found = rows(sweep_dir)
    paths = [*write_table(sweep_dir, found), plot(sweep_dir, found)]
    run = reopen(sweep_dir)
    for path in paths:
        run.log_artifact(path)
    run.end(FINISHED if all(r.point.status == FINISHED for r in found) else FAILED)
    return found


def main(argv: list[str] | None = None) -> int:
    """`lowbit-sweep-summary SWEEP_DIR`: (re)build a sweep's summary, e.g. after its launching
    process was stopped, and print the table."""
    p = argparse.ArgumentParser(prog="lowbit-sweep-summary", description=main.__doc__)
    p.add_argument("sweep_dir", type=Path, help="the sweep's dir (hydra.sweep.dir)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s] %(message)s")
    if not (args.sweep_dir / POINTS).is_dir():
        log.error(
            "%s holds no sweep points (%s/); give the sweep dir of a `lowbit -m` run "
            "(hydra.sweep.dir, by default <run_dir>/.multirun/<time>; its last line names it)",
            args.sweep_dir,
            POINTS,
        )
        return LowbitError.exit_code
    finish(args.sweep_dir)
    print((args.sweep_dir / OUTPUTS[0]).read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
