"""Does the fitted importance score rank layers better than each estimator alone?

On an FP target (the bootstrap's, by default from a finished run), with the calibration windows
the sensitivity stage uses (never the test split):

1. The three estimators' ΔL (fisher, hutchinson, gptq_proxy) for every scored layer.
2. The measured KL(p_FP ‖ p_Q) per token of every layer RTN-quantized alone, each candidate.
3. Splits of the layers into fit / held-out: the stage's own (``fit_layers`` spread evenly) and
   ``--splits`` random ones of the same size. Weights are fitted on the fit layers
   (``pipeline.analysis.importance``); Spearman ρ of each score vs the measured KL is taken on
   the held-out layers only, per format.

    python -m bench.importance_fit /path/to/target [--fit-layers 8] [--splits 50]

Prints markdown tables (ρ per estimator and combined; the fitted weights). Goal: on the
stage's split, the combined score's mean held-out ρ ≥ the best single estimator's; exits 1
when it is missed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import astuple
from pathlib import Path

import numpy as np
import torch

from bench._common import (
    add_goal_args,
    compose,
    goal,
    parsed_tables,
    report_goals,
    stage_cfg,
    unmeasured,
    write_result,
)
from pipeline.analysis.importance import (
    combine,
    fit_importance,
    fit_layer_names,
    measure_kl,
    rank_agreement,
)
from pipeline.analysis.sensitivity import METHODS, analyze
from pipeline.config import data_cfg, quant_cfg
from pipeline.data.text import Corpus
from pipeline.dist import Dist
from pipeline.models.hf import load_causal_lm, load_tokenizer


def held_out_rho(predicted, measured, fit: list[str], held: list[str]) -> tuple[dict, dict]:
    """{score: {format: ρ on ``held``}} of every estimator and of the combination fitted on
    ``fit``, and the fitted weights."""
    weights = fit_importance(predicted, {n: measured[n] for n in fit})
    scores = {**predicted, "combined": combine(predicted, weights)}
    return {k: rank_agreement(s, measured, held) for k, s in scores.items()}, weights


def fit_goals(held: dict[str, dict[str, float]], formats: list[str]) -> list[dict]:
    """On the stage's split: the combined score's mean held-out ρ over ``formats`` >= the best
    single estimator's; missed when a score has no ρ for every format.

    Args:
        held: {score (each of METHODS, "combined"): {format: held-out ρ}}.
        formats: The candidates the ρ were taken for.
    """
    name = "combined held-out ρ >= the best single estimator's"
    if not formats:
        return [unmeasured(name, ">= the best single ρ", "no candidate format")]
    missing = [k for k in (*METHODS, "combined") if not set(formats) <= set(held.get(k, {}))]
    if missing:
        return [unmeasured(name, ">= the best single ρ", f"no ρ of {', '.join(missing)}")]
    mean_rho = {k: float(np.mean([held[k][f] for f in formats])) for k in (*METHODS, "combined")}
    best = max(METHODS, key=lambda m: mean_rho[m])
    return [goal(f"{name} ({best})", mean_rho["combined"], f">= {mean_rho[best]:.4g}",
                 mean_rho["combined"] >= mean_rho[best])]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target", help="FP target HF dir")
    stage = stage_cfg("sensitivity")
    ap.add_argument("--fit-layers", type=int, default=stage.fit_layers)
    ap.add_argument("--splits", type=int, default=50, help="random fit/held-out splits")
    ap.add_argument("--blocks-only", action="store_true", help="decoder-block linears only")
    ap.add_argument("--json", help="also write every measurement to this file")
    ap.add_argument("--out", default="bench-out/importance_fit", help="folder for result.json")
    add_goal_args(ap)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = compose(["tracking=none"])
    model, tokenizer = load_causal_lm(args.target), load_tokenizer(args.target)
    calib = Corpus(data_cfg(cfg), tokenizer).calibration(
        *astuple(quant_cfg(cfg).calib), cfg.seed
    )  # (S, T): the stage's windows
    cands = list(cfg.quant.candidates)
    probes = stage.hutchinson_probes
    t0 = time.time()
    reports = {m: analyze(model, calib, cands, m, probes=probes, seed=cfg.seed) for m in METHODS}
    predicted = {m: {la["name"]: la["dloss"] for la in r["layers"]} for m, r in reports.items()}
    names = list(predicted["fisher"])
    if args.blocks_only:
        names = [n for n in names if ".layers." in n]
    t1 = time.time()
    measured = measure_kl(model, calib, names, cands, Dist())
    took = f"estimators {t1 - t0:.0f}s, KL {time.time() - t1:.0f}s"
    print(f"target {args.target}: calib {tuple(calib.shape)}, {len(names)} layers x "
          f"{len(cands)} formats; {took}")  # fmt: skip

    k = args.fit_layers
    stage_fit = fit_layer_names(names, k)
    rng = random.Random(0)
    splits = [stage_fit] + [rng.sample(names, k) for _ in range(args.splits)]
    results = [held_out_rho(predicted, measured, fit, [n for n in names if n not in fit])
               for fit in splits]  # fmt: skip
    keys = [*METHODS, "combined"]

    def row(label: str, rho: dict[str, float]) -> str:
        cells = [rho[f] for f in cands] + [float(np.mean([rho[f] for f in cands]))]
        return f"| {label} | " + " | ".join(f"{c:.3f}" for c in cells) + " |"

    head = ["| score | " + " | ".join(cands) + " | mean |", "|---|" + "---|" * (len(cands) + 1)]
    stage_rows = [*head, *(row(key, results[0][0][key]) for key in keys)]
    stage_title = (f"Held-out Spearman ρ vs measured KL, the stage's split ({k} fit layers, "
                   f"{len(names) - len(stage_fit)} held out)")  # fmt: skip
    print(f"\n### {stage_title}\n\n" + "\n".join(stage_rows))
    print(f"\nweights {results[0][1]}")
    random_title = f"Held-out Spearman ρ, mean ± std over {args.splits} random {k}-layer fits"
    random_rows = list(head)
    for key in keys:
        per = [{f: r[0][key][f] for f in cands} for r in results[1:]]
        mean = {f: float(np.mean([p[f] for p in per])) for f in cands}
        sd = {f: float(np.std([p[f] for p in per])) for f in cands}
        means = [float(np.mean([p[f] for f in cands])) for p in per]
        cells = [f"{mean[f]:.3f} ± {sd[f]:.3f}" for f in cands]
        cells.append(f"{np.mean(means):.3f} ± {np.std(means):.3f}")
        random_rows.append(f"| {key} | " + " | ".join(cells) + " |")
    print(f"\n### {random_title}\n\n" + "\n".join(random_rows))
    best_single = [max(float(np.mean([r[0][m][f] for f in cands])) for m in METHODS)
                   for r in results[1:]]  # fmt: skip
    comb = [float(np.mean([r[0]["combined"][f] for f in cands])) for r in results[1:]]
    wins = sum(c >= b for c, b in zip(comb, best_single))
    print(f"\ncombined ≥ the split's best single estimator (mean ρ) in {wins}/{args.splits} splits")
    ws = np.array([[r[1][m] for m in METHODS] for r in results[1:]])
    print("weights over random splits (median): "
          + ", ".join(f"{m} {w:.3g}" for m, w in zip(METHODS, np.median(ws, 0))))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"predicted": predicted, "measured": measured, "splits": splits,
             "results": results}, indent=1))  # fmt: skip
    # The goal: on the stage's own split, the combined score ranks the held-out layers at least
    # as well as the best single estimator (mean ρ over the formats).
    goals = fit_goals(results[0][0], cands)
    tables = parsed_tables(stage_title, stage_rows) + parsed_tables(random_title, random_rows)
    notes = [f"weights on the stage's split: {results[0][1]}", took]
    write_result(args.out, "importance_fit", tables, goals, args.skip_goal, notes)
    return report_goals(goals, skip=args.skip_goal)


if __name__ == "__main__":
    sys.exit(main())
