"""The longest silences in a lowbit run's log: how long a user watching it waits for a line.

Reads a log lowbit wrote: ``<run_dir>/.hydra/<time>/lowbit.log`` (a run dir stands for its newest
one), a stage's ``<run_dir>/logs/<stage>.log``, or the console output sent to a file. Each record
starts with its time stamp (``[2026-12-02 16:44:22,576][pipeline.workflow][INFO] ...``); a line
without one (a print of Lightning's, a traceback) belongs to the record above it. The table lists
the longest gaps between consecutive records, then each gap with the lines around it.

Goals (exit 1 when one is missed, or when fewer than two time-stamped records leave nothing to
check): no gap longer than ``--max-gap`` seconds (60), so that a long stage keeps saying what it
does; and the log, first to last record, spans at most ``--max-span`` seconds (600: the README's
"about 10 minutes" for the default workflow on 2 cores).

Usage:
  python -m bench.log_gaps /tmp/wf-log [--top 5] [--max-gap 60] [--context 2]
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench._common import (
    add_goal_args,
    goal,
    markdown_table,
    report_goals,
    result_table,
    unmeasured,
    write_result,
)

STAMP = re.compile(r"^\[(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:[,.](\d+))?\]")
COLUMNS = ("gap s", "after line", "next line")


@dataclass(frozen=True)
class Gap:
    seconds: float
    before: int  # index into the lines of the last record before the gap
    after: int  # index of the first record after it


def stamp(line: str) -> datetime | None:
    """The time stamp a log record starts with, or None (a continuation line)."""
    m = STAMP.match(line)
    if m is None:
        return None
    day, time_of_day, fraction = m.groups()
    at = datetime.fromisoformat(f"{day} {time_of_day}")
    return at.replace(microsecond=int((fraction or "0").ljust(6, "0")[:6]))


def gaps(lines: list[str]) -> list[Gap]:
    """Gaps between consecutive time-stamped records, longest first."""
    records = [(i, t) for i, t in enumerate(map(stamp, lines)) if t is not None]
    found = [
        Gap((t - t_prev).total_seconds(), i_prev, i)
        for (i_prev, t_prev), (i, t) in zip(records, records[1:])
    ]
    return sorted(found, key=lambda g: -g.seconds)


def gap_goals(
    found: list[Gap], max_gap: float, span: float | None = None, max_span: float | None = None
) -> list[dict]:
    """No gap longer than ``max_gap`` seconds and (with ``max_span``) a log no longer than
    ``max_span``; each missed when fewer than two time-stamped records leave nothing to check."""
    checks = [("longest gap between log lines, s", max(g.seconds for g in found) if found else None,
               max_gap)]  # fmt: skip
    if max_span is not None:
        name = "the log's span, first to last record, s"
        checks.append((name, span if found else None, max_span))
    return [
        goal(name, value, f"<= {want:g}", value <= want)
        if value is not None
        else unmeasured(name, f"<= {want:g}", "fewer than two time-stamped records")
        for name, value, want in checks
    ]


def log_file(path: Path) -> Path:
    """`path`, or for a run dir its newest lowbit.log."""
    if not path.is_dir():
        return path
    logs = sorted(path.glob(".hydra/*/lowbit.log"), key=lambda p: p.stat().st_mtime)
    if not logs:
        raise SystemExit(f"{path} holds no .hydra/*/lowbit.log: pass a log file")
    return logs[-1]


def _short(line: str, width: int = 110) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", type=Path, help="a log file, or a run dir (its newest lowbit.log)")
    p.add_argument("--top", type=int, default=5, help="gaps to list")
    p.add_argument("--max-gap", type=float, default=60.0, help="the goal, in seconds")
    p.add_argument("--max-span", type=float, default=600.0,
                   help="the whole log's goal, s (0: none, e.g. for one stage's log)")  # fmt: skip
    p.add_argument("--context", type=int, default=2, help="lines shown either side of a gap")
    p.add_argument("--out", type=Path, default=None, help="folder for result.json (none: no file)")
    add_goal_args(p)
    args = p.parse_args(argv)

    max_span = args.max_span or None
    path = log_file(args.log)
    lines = path.read_text(errors="replace").splitlines()
    found = gaps(lines)
    print(f"{path}: {len(lines)} lines, {len(found) + 1 if found else 0} time-stamped records")
    if not found:
        print(
            "fewer than two time-stamped records ([YYYY-MM-DD HH:MM:SS,mmm] ...): no gap to check"
        )
        return report_goals(gap_goals(found, args.max_gap, None, max_span), skip=args.skip_goal)
    top = found[: args.top]
    rows = [
        {
            "gap s": round(g.seconds, 1),
            "after line": f"{g.before + 1}: {_short(lines[g.before], 60)}",
            "next line": f"{g.after + 1}: {_short(lines[g.after], 60)}",
        }
        for g in top
    ]
    print("\n" + markdown_table(rows, COLUMNS))
    for g in top:
        print(f"\n{g.seconds:.1f} s of silence after line {g.before + 1}:")
        start, end = max(0, g.before - args.context), min(len(lines), g.after + args.context + 1)
        for i in range(start, end):
            mark = ">" if i in (g.before, g.after) else " "
            print(f"{mark} {i + 1:6d}  {_short(lines[i])}")
    stamps = [t for t in map(stamp, lines) if t is not None]
    seconds = (stamps[-1] - stamps[0]).total_seconds()
    goals = gap_goals(found, args.max_gap, seconds, max_span)
    span = f"the log spans {seconds:.0f} s, first to last record"
    print(span)
    if args.out:
        write_result(args.out, "log_gaps", [result_table(str(path), rows, COLUMNS)], goals,
                     args.skip_goal, notes=[span])  # fmt: skip
    return report_goals(goals, skip=args.skip_goal)


if __name__ == "__main__":
    sys.exit(main())
