"""The method's exponential formula (``exp4g128-design``) against lowbit's searched exp4g128.

On the trained target (the bootstrap one, or ``--from`` a finished run's), per format among
int4g128 (the reference), exp4g128 and exp4g128-design: round-to-nearest codes of every decoder
linear give

    level use    mean over groups of distinct codes / 16, and 2**H / 16 (H: the entropy of a
                 group's code histogram, the effective levels; the method claims 89% for its grid)
    small-value  RMS error of the weights below their group's median |w|, int4g128's over the
    resolution   format's (the method claims 4x for its grid)

and a uniform GPTQ quantize of the whole target in that format is scored on the whole test split
(the evaluate protocol). Goal: exp4g128, the exponential format of the default candidates, is
no worse in test perplexity than the formula's grid; exits 1 when it is, or when one was not
scored.

    python -m bench.exp_design --root /tmp/exp-design --from outputs/default
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from bench import _common as common
from bench._common import compose, goal, report_goals, seed_run, unmeasured
from bench.exp_codes import level_use

FORMATS = ("int4g128", "exp4g128", "exp4g128-design")
DEFAULT, DESIGN = "exp4g128", "exp4g128-design"


def small_rms(w: torch.Tensor, wq: torch.Tensor, group: int) -> float:
    """RMS error of the weights at or below their group median |w| (in_features % group == 0)."""
    g, e = w.reshape(-1, group), (wq - w).reshape(-1, group)  # (groups, G)
    small = g.abs() <= g.abs().median(-1, keepdim=True).values
    return e[small].square().mean().sqrt().item()


def codes_rows(target: Path) -> list[dict]:
    """Per format: level use and small-weight RMS error over every decoder linear (RTN)."""
    from pipeline.models.hf import load_causal_lm
    from pipeline.quant.rtn import quantize_rtn

    model = load_causal_lm(target)
    linears = [m.weight.detach().float() for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and ".layers." in n]  # fmt: skip
    rows = []
    for fmt in FORMATS:
        use, err = [], []
        for w in linears:
            qt = quantize_rtn(w, fmt)
            use.append(level_use(qt.codes, 128))
            err.append(small_rms(w, qt.dequantize(), 128))
        distinct, effective = torch.tensor(use).mean(0).tolist()
        rows.append({"format": fmt, "distinct": round(distinct, 4),
                     "effective (2^H)": round(effective, 4), "_err": err})  # fmt: skip
    ref = rows[0]["_err"]
    for r in rows:
        ratios = torch.tensor(ref) / torch.tensor(r.pop("_err"))
        r["small-value resolution vs int4g128"] = round(ratios.mean().item(), 3)
    return rows


def design_goals(ppl: dict[str, float]) -> list[dict]:
    """exp4g128's test perplexity <= exp4g128-design's (missed when either was not scored)."""
    name = f"test ppl {DEFAULT} <= {DESIGN}"
    if DEFAULT not in ppl or DESIGN not in ppl:
        return [unmeasured(name, f"<= {DESIGN}", "a format was not scored")]
    want = ppl[DESIGN]
    return [goal(name, round(ppl[DEFAULT], 3), f"<= {want:.3f}", ppl[DEFAULT] <= want)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="config overrides (e.g. another model shape)")
    p.add_argument("--root", type=Path, default=Path("outputs/exp_design"))
    p.add_argument("--from", dest="src", type=Path, default=None,
                   help="a finished run dir whose bootstrap stage to reuse")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="folder for result.json (--root)")
    common.add_goal_args(p)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    from pipeline import workflow
    from pipeline.models.hf import load_causal_lm, perplexity
    from pipeline.models.quantized import load_quantized

    base = ["tracking=none", *args.overrides]
    if args.src is not None:
        seed_run(args.src, args.root / "bootstrap", ["bootstrap"])
    boot, _, target, win = common.bootstrapped(args.root, base)
    ppl_fp = perplexity(load_causal_lm(target), win)
    codes = codes_rows(target)
    ppl = {}
    for fmt in FORMATS:
        run = args.root / fmt
        seed_run(boot, run, ["bootstrap"])
        over = [f"run_dir={run}", *base, f"quant.candidates=[{fmt}]", "stages=[quantize]"]
        workflow.run(compose(over))
        ppl[fmt] = perplexity(load_quantized(common.low_bit_model(run, "target_quantized")), win)
    for r in codes:
        r["test ppl (GPTQ)"] = round(ppl[r["format"]], 3)
    cols = ("format", "distinct", "effective (2^H)", "small-value resolution vs int4g128",
            "test ppl (GPTQ)")  # fmt: skip
    print(f"\nFP test perplexity {ppl_fp:.3f} ({tuple(win.shape)} windows)\n")
    print(common.markdown_table(codes, cols))
    goals = design_goals(ppl)
    title = f"decoder linears, RTN codes; test split, FP ppl {ppl_fp:.3f}"
    tables = [common.result_table(title, codes, cols)]
    common.write_result(args.out or args.root, "exp_design", tables, goals, args.skip_goal)
    return report_goals(goals, args.root, args.skip_goal)


if __name__ == "__main__":
    sys.exit(main())
