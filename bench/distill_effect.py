"""How much of the quantization gap distillation recovers, and what each ingredient adds.

Runs the real workflow on the bootstrap target: bootstrap once, then for each quantization
recipe (uniform GPTQ w2g64, mixed plans at budget_bits=2.5 and 3 via sensitivity + allocate) the
quantize stage once, then the distill stage once per variant: the defaults, what trains (scales
only; scales and norms without the float-kept embeddings and lm_head), gradient scaling (lsq,
none), the attention-matching weight β (1, and 0 = logits KL only) and layer weights that follow
the current per-layer error during training (reweight) instead of quantize's static errors. A
reference recipe, uniform GPTQ w3g128 (3.25 bits/weight), is quantized only. Every model is
scored on the whole test split, which no stage reads (the evaluate protocol), and the table shows

    gap recovered = (ppl_quantized - ppl_distilled) / (ppl_quantized - ppl_fp)

Goals: distill never hands on a model worse than its input (for every distilled recipe and
variant run, test ppl distilled <= quantized); 2.5 bits/weight after the default distillation
<= GPTQ w3g128; and the default variant recovers >= 70% of w2g64's gap. Exits 1 when one is
missed or cannot be checked (a recipe or the default variant left out), unless ``--skip-goal``
leaves it out.

    python -m bench.distill_effect --root /tmp/distill-bench --variants default --threads 1
    python -m bench.distill_effect --root /tmp/distill-bench --shape shape2 --variants default
    python -m bench.distill_effect --root /tmp/distill-bench experiment=smoke

``--shape`` picks a named target shape (``SHAPES``; plain ``model.target.*`` overrides pick any
other), and each shape needs its own ``--root``. Stage folders are reused across invocations
(the workflow skips what is up to date), so a second call with other distill settings only
reruns distill.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

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

RECIPES = {
    "w2g64": ["quant=w2g64"],
    "mixed@2.5": ["quant=mixed", "quant.budget_bits=2.5"],
    "mixed@3": ["quant=mixed", "quant.budget_bits=3"],
    "w3g128": ["quant=w3g128"],  # the uniform 3.25-bit reference: quantized, never distilled
}
REFERENCE = "w3g128"
# A second, wider target with another head count and MLP ratio (its fp32 bootstrap takes
# about 8 minutes on 2 AVX2 cores; 256 wide took hours there).
SHAPES = {
    "default": [],
    "shape2": [
        "model.target.hidden=192",
        "model.target.heads=3",
        "model.target.intermediate=512",
        "model.target.layers=4",
    ],
}
VARIANTS = {
    "default": [],
    "scales": ["stage.distill.trainable=[scales]"],  # step sizes and zero points only
    "no-float": ["stage.distill.trainable=[scales,norms]"],  # embeddings and lm_head frozen
    "lsq": ["stage.distill.train.quant_grad_scale=lsq"],
    "none": ["stage.distill.train.quant_grad_scale=none"],
    "beta=1": ["stage.distill.beta=1"],  # KL and attention matching weighted equally
    "beta=0": ["stage.distill.beta=0"],  # logits KL only
    # Layer weights from the current per-layer distances every 25 steps (12 times in 300).
    "reweight": ["stage.distill.reweight_every=25"],
}
# Share of w2g64's gap the default variant recovers. No such goal at 2.5 and 3 bits, whose gaps
# are a few tenths of a perplexity point: there the goals are "never worse" and "<= w3g128".
GOAL = 0.7


def _cfg(run_dir: Path, overrides: list[str]):
    return compose([f"run_dir={run_dir}", *overrides])


def distill_goals(rows: list[tuple], quantized: dict[str, float], recipes: list[str]) -> list[dict]:
    """The goals: per distilled recipe asked for, no variant run hands on a model worse than its
    input; mixed@2.5 distilled by the defaults <= w3g128 quantized; the defaults recover >=
    ``GOAL`` of w2g64's gap. A goal whose rows did not run is missed.

    Args:
        rows: (recipe, variant, ppl quantized, ppl distilled, gap recovered, kept input,
            seconds) per distill run.
        quantized: Test perplexity after quantize, per recipe run (the reference's included).
        recipes: The ``--recipes``.
    """
    by = {(r[0], r[1]): r for r in rows}
    goals = []
    for recipe in (r for r in recipes if r != REFERENCE):
        name, want = f"{recipe}: test ppl distilled - quantized, worst variant", "<= 0"
        worse = [ppl_d - ppl_q for rec, _, ppl_q, ppl_d, *_ in rows if rec == recipe]
        if worse:
            goals.append(goal(name, max(worse), want, max(worse) <= 0))
        else:
            goals.append(unmeasured(name, want, "--recipes or --variants without it"))
    name = "mixed@2.5 distilled by the defaults: test ppl"
    low, ref = by.get(("mixed@2.5", "default")), quantized.get(REFERENCE)
    if low is None or ref is None:
        missing = "mixed@2.5 with the default variant" if low is None else REFERENCE
        goals.append(
            unmeasured(name, f"<= {REFERENCE}'s", f"--recipes or --variants without {missing}")
        )
    else:
        goals.append(goal(name, low[3], f"<= {ref:.3f} ({REFERENCE})", low[3] <= ref))
    name, want = "w2g64: gap recovered by the defaults", f">= {GOAL:.0%}"
    two = by.get(("w2g64", "default"))
    if two is None:
        goals.append(unmeasured(name, want, "--recipes or --variants without w2g64 default"))
    else:  # a NaN gap (quantizing cost nothing) is missed: nothing was recovered
        goals.append(goal(name, two[4], want, two[4] >= GOAL))
    return goals


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. experiment=smoke")
    p.add_argument("--root", type=Path, default=Path("outputs/distill_effect"))
    p.add_argument("--shape", choices=sorted(SHAPES), default="default", help="target shape")
    p.add_argument("--steps", type=int, default=None, help="stage.distill.train.steps")
    p.add_argument("--lr", type=float, default=None, help="stage.distill.train.lr")
    p.add_argument("--threads", type=int, default=None, help="torch threads (1 on a busy host)")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path, default=None, help="folder for result.json (--root)")
    add_goal_args(p)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from pipeline import workflow
    from pipeline.models.hf import load_causal_lm, perplexity
    from pipeline.models.quantized import load_quantized

    base = ["tracking=none", *SHAPES[args.shape], *args.overrides]
    distill = [f"stage.distill.train.steps={args.steps}"] if args.steps else []
    distill += [f"stage.distill.train.lr={args.lr}"] if args.lr else []
    boot, _, target, win = bootstrapped(args.root, base)
    ppl_fp = perplexity(load_causal_lm(target), win)

    rows, quantized = [], {}
    recipes = args.recipes.split(",")
    analysed = boot  # a run whose sensitivity analysis another budget reuses, once one ran
    for recipe in recipes:
        qrun = args.root / recipe / "quantized"
        seed_run(boot, qrun, ["bootstrap"])
        seed_run(analysed, qrun, ["sensitivity"])  # the analysis does not depend on the budget
        q_stages = ["sensitivity", "allocate", "quantize"] if recipe.startswith("mixed") else []
        q_stages = q_stages or ["quantize"]
        workflow.run(_cfg(qrun, [*base, *RECIPES[recipe], f"stages=[{','.join(q_stages)}]"]))
        analysed = qrun if recipe.startswith("mixed") else analysed
        ppl_q = perplexity(load_quantized(low_bit_model(qrun, "target_quantized")), win)
        quantized[recipe] = ppl_q
        for variant in args.variants.split(",") if recipe != REFERENCE else []:
            drun = args.root / recipe / variant.replace("=", "")
            seed_run(qrun, drun, ["bootstrap", *q_stages])
            overrides = [*base, *RECIPES[recipe], *distill, *VARIANTS[variant], "stages=[distill]"]
            done = workflow.run(_cfg(drun, overrides))
            # The stage's own time as it recorded it: a run reused from an earlier call took 0 s.
            seconds = done["distill"]["timings"]["seconds"]
            kept = bool(done["distill"]["metrics"].get("kept_input"))
            ppl_d = perplexity(load_quantized(low_bit_model(drun, "target_distilled")), win)
            gap = (ppl_q - ppl_d) / (ppl_q - ppl_fp) if ppl_q > ppl_fp else float("nan")
            rows.append((recipe, variant, ppl_q, ppl_d, gap, kept, seconds))

    print(f"\neval windows {tuple(win.shape)} (test split); FP perplexity {ppl_fp:.3f}")
    cols = ("recipe", "variant", "ppl quantized", "ppl distilled", "gap recovered", "kept input",
            "seconds")  # fmt: skip
    table = [dict(zip(cols, r)) for r in rows]
    if REFERENCE in quantized:
        table.append({"recipe": REFERENCE, "variant": "(quantize only)",
                      "ppl quantized": quantized[REFERENCE]})  # fmt: skip
    print(markdown_table(table, cols))
    goals = distill_goals(rows, quantized, recipes)
    notes = [
        f"target shape {args.shape}: {' '.join(SHAPES[args.shape]) or 'the bootstrap default'}"
    ]
    notes += [f"test split: {win.shape[0]} windows of {win.shape[1]} tokens"]
    result = result_table(f"test split, FP ppl {ppl_fp:.4g}", table, cols)
    write_result(args.out or args.root, "distill_effect", [result], goals, args.skip_goal, notes)
    return report_goals(goals, args.root, args.skip_goal)


if __name__ == "__main__":
    sys.exit(main())
