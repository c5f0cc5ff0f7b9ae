"""Exponential 4-bit codes in the mixed plan: where the allocator picks them, and what they buy.

Runs the real workflow on the bootstrap target: for each budget, sensitivity + allocate +
quantize (GPTQ) once with the default candidates and once with the exponential formats removed,
and scores both quantized targets on the whole test split (the evaluate protocol). Per linear of
the target it also reports the kurtosis of its trained weights (Pearson, 3 for a Gaussian), the
format the plan with exp4 chose, and how many of the 16 code levels round-to-nearest int4g128 and
exp4g128 actually use on those weights:

    level use = mean over groups of (distinct codes in the group) / 16

(exp4's codes 0 and 8 both decode to zero, so it can reach 15/16 at most) and, less sensitive
to a single stray weight per level, ``2**H / 16`` with H the entropy of a group's code histogram
(the effective number of levels). Goal: at every budget the plan with exp4 available is no worse
(test perplexity) than the plan without it; exits 1 when it is, or when a plan could not be
scored.

    python -m bench.exp_codes --root /tmp/exp-bench
    python -m bench.exp_codes --root /tmp/exp-bench-s2 --budgets 3.0 model.target.layers=6 ...

Stage folders are reused across invocations (the workflow skips what is up to date).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from torch import Tensor

from bench._common import (
    add_goal_args,
    bootstrapped,
    compose,
    goal,
    low_bit_model,
    markdown_table,
    report_goals,
    result_table,
    seed_run,
    unmeasured,
    write_result,
)
from pipeline.analysis.report import SensitivityReport
from pipeline.quant.plan import BitPlan

EXP = "exp"  # format-name prefix of the exponential family
TOL = 0.0  # the plan with exp4 may not be worse at all


def _cfg(run_dir: Path, overrides: list[str]):
    return compose([f"run_dir={run_dir}", *overrides])


def level_use(codes: Tensor, group: int) -> tuple[float, float]:
    """(distinct-code share, effective-level share) of (out, in) codes, averaged over groups."""
    out, n = codes.shape
    g = codes[:, : n - n % group].reshape(out, -1, group).reshape(-1, group).long()  # (groups, G)
    hist = torch.zeros(g.shape[0], 16).scatter_add_(1, g, torch.ones_like(g, dtype=torch.float))
    distinct = (hist > 0).sum(1).float().mean().item() / 16
    p = hist / group
    entropy = -(p * torch.log2(p.clamp_min(1e-30))).sum(1)  # bits per group
    return distinct, (2**entropy).mean().item() / 16


def layer_rows(target: Path, plan: BitPlan, sensitivity: SensitivityReport) -> list[dict]:
    """Per planned linear: chosen format, weight kurtosis, level use of int4g128 / exp4g128."""
    from pipeline.analysis.sensitivity import kurtosis
    from pipeline.models.hf import load_causal_lm
    from pipeline.quant.rtn import quantize_rtn

    model = load_causal_lm(target)
    dloss = {layer.name: layer.dloss for layer in sensitivity.layers}
    rows = []
    for name, fmt in plan.quantized().items():
        w = model.get_submodule(name).weight.detach().float()
        int4 = level_use(quantize_rtn(w, "int4g128").codes, 128)
        exp4 = level_use(quantize_rtn(w, "exp4g128").codes, 128)
        d = dloss.get(name, {})
        rows.append(
            {
                "layer": name,
                "chosen": fmt.name,
                "kurtosis": round(kurtosis(w), 2),
                "int4 levels": f"{int4[0]:.0%} ({int4[1]:.0%})",
                "exp4 levels": f"{exp4[0]:.0%} ({exp4[1]:.0%})",
                "ΔL int4/exp4": (
                    f"{d['int4g128'] / d['exp4g128']:.2f}"
                    if d.get("exp4g128") and "int4g128" in d
                    else ""
                ),
                "_use": (int4, exp4),
            }
        )
    return rows


def exp_goals(ppl: dict[str, dict[str, float]], budgets: list[str]) -> list[dict]:
    """Per budget asked for: test perplexity with exp4 available <= without it (+ ``TOL``);
    missed when either plan was not scored.

    Args:
        ppl: {budget: {"with exp4" | "without": test perplexity}}.
        budgets: The ``--budgets``.
    """
    goals = []
    for budget in budgets:
        name = f"{budget} bits: test ppl with exp4 <= without"
        got = ppl.get(budget, {})
        if "with exp4" not in got or "without" not in got:
            goals.append(unmeasured(name, "<= without", "a plan was not scored"))
            continue
        want = got["without"] + TOL
        goals.append(
            goal(name, round(got["with exp4"], 3), f"<= {want:.3f}", got["with exp4"] <= want)
        )
    return goals


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="config overrides (e.g. another model shape)")
    p.add_argument("--root", type=Path, default=Path("outputs/exp_codes"))
    p.add_argument("--budgets", default="3.0,2.5", help="quant.budget_bits values")
    p.add_argument("--out", type=Path, default=None, help="folder for result.json (--root)")
    add_goal_args(p)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    from pipeline import workflow
    from pipeline.models.hf import load_causal_lm, perplexity
    from pipeline.models.quantized import load_quantized

    base = ["tracking=none", "quant=mixed", *args.overrides]
    boot, cfg, target, win = bootstrapped(args.root, base)
    ppl_fp = perplexity(load_causal_lm(target), win)
    with_exp = list(cfg.quant.candidates)
    without = [c for c in with_exp if not c.startswith(EXP)]
    if without == with_exp:
        print(f"quant.candidates {with_exp} hold no exponential format: nothing to compare")
        return report_goals(exp_goals({}, args.budgets.split(",")), args.root, args.skip_goal)

    stages = "stages=[sensitivity,allocate,quantize]"
    rows, ppls, per_layer = [], {}, None
    for budget in args.budgets.split(","):
        ppl = ppls[budget] = {}
        for label, cands in (("with exp4", with_exp), ("without", without)):
            run = args.root / f"b{budget}" / label.replace(" ", "_")
            seed_run(boot, run, ["bootstrap"])
            over = [*base, f"quant.budget_bits={budget}", f"quant.candidates=[{','.join(cands)}]"]
            workflow.run(_cfg(run, [*over, stages]))
            plan = BitPlan.load(run / "allocate")
            ppl[label] = perplexity(load_quantized(low_bit_model(run, "target_quantized")), win)
            counts = {f.name: list(plan.layers.values()).count(f) for f in plan.candidates}
            rows.append(
                {
                    "budget": budget,
                    "candidates": label,
                    "avg bits": round(plan.avg_bits, 4),
                    "test ppl": round(ppl[label], 3),
                    "layers per format": ", ".join(f"{f} {n}" for f, n in counts.items() if n),
                }
            )
            if per_layer is None and label == "with exp4":
                sens = SensitivityReport.load(run / "sensitivity")
                per_layer = layer_rows(target, plan, sens)

    print(f"\nFP test perplexity {ppl_fp:.3f} ({tuple(win.shape)} windows)\n")
    print(
        markdown_table(rows, ("budget", "candidates", "avg bits", "test ppl", "layers per format"))
    )
    cols = ("layer", "chosen", "kurtosis", "int4 levels", "exp4 levels", "ΔL int4/exp4")
    print("\nPer linear (levels: distinct codes per group / 16, effective 2^H / 16 in brackets)\n")
    print(markdown_table(per_layer, cols))
    use = torch.tensor([[*r["_use"][0], *r["_use"][1]] for r in per_layer]).mean(0).tolist()
    print(
        f"\nmean level use, every quantized linear: int4g128 {use[0]:.1%} distinct / "
        f"{use[1]:.1%} effective; exp4g128 {use[2]:.1%} / {use[3]:.1%}"
    )
    goals = exp_goals(ppls, args.budgets.split(","))
    tables = [result_table(f"test split, FP ppl {ppl_fp:.3f}", rows),
              result_table("per linear (levels: distinct, 2^H)", per_layer, cols)]  # fmt: skip
    write_result(args.out or args.root, "exp_codes", tables, goals, args.skip_goal)
    return report_goals(goals, args.root, args.skip_goal)


if __name__ == "__main__":
    sys.exit(main())
