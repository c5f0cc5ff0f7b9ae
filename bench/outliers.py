"""Does keeping outlier input columns in fp16 beat spending the same bytes on wider formats?

Runs the real workflow on the bootstrap target: bootstrap once (reused), then for each
``quant.outliers`` setting (none, keep_fp16) sensitivity + allocate + quantize with the mixed
candidates at one ``quant.budget_bits`` (2.5 by default). The budget covers the kept columns'
fp16 side matrix and indices, so both plans hold at most the same bytes; the allocator decides
per layer whether a layer's outlier columns are worth their bytes. Every quantized model is
scored on the whole test split (the evaluate protocol). The table shows test perplexity, the
plan's average bits and total bytes, the kept columns and their bytes, and the MAD outlier
shares sensitivity measured.

Goal: keep_fp16 (at one of the ``--caps`` tried) lowers test perplexity at the same budget,
side matrices included; exits 1 when it does not. A plan that keeps no column (the allocator
found wider formats worth more per bit everywhere) is the none plan, with its perplexity.

    python -m bench.outliers --root /tmp/outliers-bench
    python -m bench.outliers --root /tmp/outliers-bench --caps 0.01,0.05 quant.method=rtn
    python -m bench.outliers --root /tmp/s2 model.target.layers=6 model.draft.layers=2 ...

Stage folders are reused across invocations (the workflow skips what is up to date): copy a
finished ``bootstrap`` run into ``<root>/bootstrap`` to skip training.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench._common import (
    bootstrapped,
    compose,
    goal,
    low_bit_model,
    markdown_table,
    parse_bench_args,
    report_goals,
    result_table,
    seed_run,
    unmeasured,
    write_result,
)
from pipeline.analysis.report import SensitivityReport
from pipeline.quant.plan import BitPlan

STAGES = ("sensitivity", "allocate", "quantize")


def _row(run_dir: Path, setting: str, cap: float | None, ppl: float) -> dict:
    plan = BitPlan.load(run_dir / "allocate")
    sens = SensitivityReport.load(run_dir / "sensitivity")
    shares = [s for layer in sens.layers if (s := layer.outlier_share) is not None]
    kept = plan.kept()
    return {
        "outliers": setting,
        "cap": cap,
        "test_ppl": ppl,
        "avg_bits": plan.avg_bits,
        "total_bytes": plan.total_bytes,
        "kept_layers": len(kept),
        "kept_columns": sum(len(c) for c in kept.values()),
        "kept_bytes": plan.kept_bytes or 0,
        "outlier_share_mean": sum(shares) / len(shares) if shares else None,
        "outlier_share_max": max(shares, default=None),
        "predicted_dloss": plan.predicted_dloss,
    }


def outlier_goals(rows: list[dict], budget: float, caps: list[float]) -> list[dict]:
    """The best keep_fp16 plan's test perplexity < the none plan's, and every keep_fp16 plan
    within the budget; each missed when its rows are missing.

    Args:
        rows: One per plan, as ``_row`` makes them.
        budget: ``quant.budget_bits`` of every plan.
        caps: The ``--caps``, one keep_fp16 plan each.
    """
    none = next((r for r in rows if r["outliers"] == "none"), None)
    keeps = {r["cap"]: r for r in rows if r["outliers"] == "keep_fp16"}
    name = f"keep_fp16 test ppl at budget {budget}"
    if none is None or not keeps:
        why = "no none plan" if none is None else "no keep_fp16 plan"
        goals = [unmeasured(name, "< the none plan's", why)]
    else:
        best = min(keeps.values(), key=lambda r: r["test_ppl"])
        ppl, want = best["test_ppl"], none["test_ppl"]
        goals = [goal(f"{name} (best: cap {best['cap']})", ppl, f"< {want:.4f} (none)", ppl < want)]
    for cap in caps:
        name, want = f"keep_fp16 (cap {cap}) avg bits, side matrices included", f"<= {budget}"
        if cap not in keeps:
            goals.append(unmeasured(name, want, "no plan at that cap"))
        else:
            bits = keeps[cap]["avg_bits"]
            goals.append(goal(name, bits, f"{want} (the budget none is held to)", bits <= budget))
    return goals


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. quant.method=rtn")
    p.add_argument("--root", type=Path, default=Path("outputs/outliers"))
    p.add_argument("--budget", type=float, default=2.5, help="quant.budget_bits")
    p.add_argument("--caps", default="0.01", help="quant.outlier_cap values, comma-separated")
    args = parse_bench_args(p)

    from pipeline import workflow
    from pipeline.models.hf import perplexity
    from pipeline.models.quantized import load_quantized

    base = ["tracking=none", *args.overrides]
    recipe = ["quant=mixed", f"quant.budget_bits={args.budget}"]
    boot, _, _, win = bootstrapped(args.root, base)

    caps = [float(c) for c in args.caps.split(",")]
    variants = [("none", None)] + [("keep_fp16", cap) for cap in caps]
    rows = []
    for setting, cap in variants:
        name = setting if cap is None else f"{setting}-cap{cap}"
        run_dir = args.root / f"budget{args.budget}" / name
        seed_run(boot, run_dir, ["bootstrap"])
        stages = f"stages=[{','.join(STAGES)}]"
        quant = [f"quant.outliers={setting}"] + ([f"quant.outlier_cap={cap}"] if cap else [])
        workflow.run(compose([f"run_dir={run_dir}", *base, *recipe, *quant, stages]))
        model = load_quantized(low_bit_model(run_dir, "target_quantized"))
        rows.append(_row(run_dir, setting, cap, perplexity(model, win)))

    print(f"\nbudget {args.budget} bits; eval windows {tuple(win.shape)} (test split)")
    print(markdown_table(rows, list(rows[0])))
    goals, title = outlier_goals(rows, args.budget, caps), f"budget {args.budget} bits, test split"
    tables = [result_table(title, rows)]
    write_result(args.out or args.root, "outliers", tables, goals, args.skip_goal)
    return report_goals(goals, args.root, args.skip_goal)


if __name__ == "__main__":
    sys.exit(main())
