"""One float32 linear, a few token rows: torch's ``F.linear`` (MKL sgemm) against the runtime's
few-row kernel (``pipeline/runtime/float_rows.py``, ``f32rows``).

The shape defaults to a 1B Llama's lm_head (vocab 32000 x hidden 2048, 262 MB): the float layer
a quantized model keeps, and the one speculative verification's gamma + 1 rows hit hardest.
Each cell is the best of ``--repeats`` calls in milliseconds, the two paths interleaved per
round so that drifts of the machine hit both; ``v`` is t(rows) / t(1 row of F.linear), what a
verification of that many rows costs in single-token steps.

f32rows runs on the ISA ``pipeline.cpu_ext`` picks (``LOWBIT_CPU_ISA``: auto, avx512gfni, avx512,
avx2); the output names it and the CPU.

Goal (exit 1 when missed, or when no measured row count lets it be checked): f32rows at most
F.linear's time at every row count from ``MIN_ROWS`` to ``MAX_ROWS``, the range where
``float_rows`` routes calls to it.

Usage:
  python -m bench.float_rows [--threads 1] [--n 32000 --k 2048] [--rows 1,2,3,4,5,6,8,12,16,32]
  LOWBIT_CPU_ISA=avx2 python -m bench.float_rows --threads 2     # the AVX2 kernel
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench._common import (
    add_goal_args,
    cpu_kernels,
    goal,
    machine,
    markdown_table,
    report_goals,
    result_table,
    unmeasured,
    write_csv,
    write_result,
)
from pipeline import cpu_ext
from pipeline.runtime import float_rows

GOAL = f"F.linear / f32rows at {float_rows.MIN_ROWS}-{float_rows.MAX_ROWS} rows"
COLUMNS = ("rows", "F.linear ms", "f32rows ms", "F.linear / f32rows", "v F.linear", "v f32rows")


def ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def routed_goals(rows: list[dict]) -> list[dict]:
    """f32rows at most F.linear's time at the worst measured row count the runtime routes to it;
    missed when ``--rows`` measured none of them."""
    routed = [r for r in rows if float_rows.MIN_ROWS <= r["rows"] <= float_rows.MAX_ROWS]
    if not routed:
        return [unmeasured(GOAL, ">= 1", "--rows holds no count in that range")]
    worst = min(routed, key=lambda r: r["F.linear / f32rows"])
    ratio = worst["F.linear / f32rows"]
    return [goal(f"{GOAL} (worst: {worst['rows']} rows)", ratio, ">= 1", ratio >= 1)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=32000, help="out features")
    p.add_argument("--k", type=int, default=2048, help="in features")
    p.add_argument("--rows", default="1,2,3,4,5,6,8,12,16,32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="bench-out/float_rows")
    add_goal_args(p)
    args = p.parse_args()
    try:
        counts = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    ext, isa = cpu_ext.extension(), cpu_ext.isa()
    if ext is None:  # the goal cannot be checked here: missed, unless --skip-goal
        why = f"lowbit's CPU kernels do not run here ({cpu_kernels()}; no AVX2, or no compiler)"
        return report_goals([unmeasured(GOAL, ">= 1", why)], skip=args.skip_goal)
    if args.threads:
        torch.set_num_threads(args.threads)
    w = torch.randn(args.n, args.k) * 0.02
    rows, best = [], {}
    for m in counts:
        x = torch.randn(m, args.k)
        paths = {
            "F.linear": lambda x=x: F.linear(x, w),
            "f32rows": lambda x=x: ext.f32_rows_mm(x, w, isa),
        }
        for fn in paths.values():  # warm-up
            fn()
        for _ in range(args.repeats):  # interleaved rounds
            for name, fn in paths.items():
                best[m, name] = min(best.get((m, name), float("inf")), ms(fn))
        rows.append({"rows": m, "isa": isa, **{f"{name} ms": best[m, name] for name in paths}})
    one = rows[0]["F.linear ms"] if rows[0]["rows"] == 1 else float("nan")
    for r in rows:
        r["F.linear / f32rows"] = r["F.linear ms"] / r["f32rows ms"]
        r["v F.linear"], r["v f32rows"] = r["F.linear ms"] / one, r["f32rows ms"] / one
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = (f"machine: {machine()}\nf32rows: {cpu_kernels()}; threads {torch.get_num_threads()}; "
            f"weight {args.n} x {args.k} float32 ({4 * args.n * args.k / 1e6:.0f} MB)\n\n"
            + markdown_table(rows, COLUMNS))  # fmt: skip
    print(text)
    (out / "float_rows.md").write_text(text + "\n")
    write_csv(out / "float_rows.csv", rows, ("isa", *COLUMNS))
    goals, notes = routed_goals(rows), text.split("\n\n")[0].splitlines()[1:]
    write_result(out, "float_rows", [result_table("", rows, COLUMNS)], goals, args.skip_goal, notes)
    return report_goals(goals, out, args.skip_goal)


if __name__ == "__main__":
    sys.exit(main())
