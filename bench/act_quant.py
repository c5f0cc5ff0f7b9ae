"""What do the runtime's int8 activations cost in perplexity, and what does outlier handling buy?

lowbit's W*A8 CPU kernels quantize activations to int8 per 32 columns (``pipeline.quant.act8``).
For each trained run (``--run NAME=DIR``: a run dir with a finished bootstrap) and weight format
(``--formats``), the FP target's decoder linears are RTN-quantized once and built as the runtime's
torch-backend layers through the export's packing (``pipeline.runtime.inmemory``); lm_head stays
float. Every row scores the whole test split (evaluate's protocol) with the same codes:

- ``A16``: the reference kernel, the codes dequantized, float32 activations (the W*A16 reference);
- ``A8``: the W*A8 kernel, int8 activations per 32 columns;
- ``A8+cols``: A8, each layer's MAD outlier input channels (at most ``--cap`` of its inputs) in
  float beside the int8 GEMM (``stage.export.act_columns``);
- ``A8+fallback``: A8, layers whose int8 activation error ``||x̂ - x|| / ||x||`` exceeds
  ``--threshold`` on the A16 kernels (``stage.export.act_threshold``).

The outlier channels and the activation errors come from a sensitivity report
(``SensitivityReport``): the run's own, or, when it predates them, the sensitivity stage run
again under ``--root`` on a copy of the run's bootstrap.

Goal: for every run and format, the int8 activations of an export with the default settings
(``stage.export.act_columns`` / ``act_threshold``) cost at most 0.2% perplexity over A16; exits
1 when one is missed or cannot be measured.

    python -m bench.act_quant --run default=/work/runs/default --run shape2=/work/runs/shape2 \\
        --threads 1 --out docs/results/act_quant
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from bench._common import (
    compose,
    cpu_kernels,
    goal,
    markdown_table,
    parse_bench_args,
    report_goals,
    result_table,
    seed_run,
    stage_cfg,
    unmeasured,
    write_result,
)

GOAL = 0.002  # the relative perplexity int8 activations may add over float ones
VARIANTS = ("A16", "A8", "A8+cols", "A8+fallback")


def _report(name: str, run: Path, root: Path, overrides: list[str]):
    """The run's sensitivity report, redone under ``root`` when it lacks activation statistics;
    with the run's FP target and test windows. None when the run has no finished bootstrap."""
    from pipeline import runmodels, workflow
    from pipeline.analysis.report import SensitivityReport
    from pipeline.config import data_cfg
    from pipeline.data.heldout import corpus_heldout
    from pipeline.data.text import Corpus
    from pipeline.models.hf import load_tokenizer

    stages = runmodels.finished_stages(run)
    if "bootstrap" not in stages:
        return None
    target = stages["bootstrap"] / "target"
    report = SensitivityReport.load(stages["sensitivity"]) if "sensitivity" in stages else None
    if report is None or not report.measured_activations():
        own = root / name
        seed_run(run, own, ["bootstrap"])
        base = [f"run_dir={own}", "tracking=none", *overrides, "stages=[sensitivity]"]
        workflow.run(compose(base))
        report = SensitivityReport.load(own / "sensitivity")
    cfg = compose([f"run_dir={run}", "tracking=none", *overrides])
    windows = corpus_heldout(Corpus(data_cfg(cfg), load_tokenizer(target))).windows
    return report, target, windows


def _quantized(fp, fmt: str):
    """A copy of ``fp`` with every linear but lm_head RTN-quantized to ``fmt``."""
    import copy

    import torch

    from pipeline.quant.fakequant import FakeQuantLinear
    from pipeline.quant.rtn import quantize_rtn

    model = copy.deepcopy(fp)
    for name, lin in list(model.named_modules()):
        if isinstance(lin, torch.nn.Linear) and name != "lm_head":
            qt = quantize_rtn(lin.weight.detach(), fmt)
            model.set_submodule(name, FakeQuantLinear.from_qtensor(qt, lin.bias))
    return model


def _plans(report, cap: float, threshold: float) -> dict[str, tuple[str, dict | None]]:
    """{variant: (kernel, activation plan)}; the default export's plan as "default"."""
    default = stage_cfg("export")
    return {
        "A16": ("reference", None),
        "A8": ("auto", None),
        "A8+cols": ("auto", report.activation_plan(cap, None)),
        "A8+fallback": ("auto", report.activation_plan(0.0, threshold)),
        "default": ("auto", report.activation_plan(default.act_columns, default.act_threshold)),
    }


def measure(name: str, run: Path, root: Path, args: argparse.Namespace):
    """One row per (format, variant) of run ``name``: perplexity and the plan's size; one per
    linear: its input's int8 activation error and outlier channels; a note on the model."""
    import torch

    from pipeline.models.hf import load_causal_lm, perplexity
    from pipeline.runtime.inmemory import to_runtime

    found = _report(name, run, root, args.overrides)
    if found is None:
        return [], [], f"{name}: not measured, {run} has no finished bootstrap stage"
    report, target, windows = found
    formats, cap, threshold = args.formats.split(","), args.cap, args.threshold
    errors = [la.act8_error for la in report.layers if la.act8_error is not None]
    fp = load_causal_lm(target, torch.float32)
    with torch.no_grad():
        fp_ppl = perplexity(fp, windows)
    rows = []
    for fmt in formats:
        q = _quantized(fp, fmt)
        ppl = {}
        seen = {}  # (kernel, plan) -> variant: a plan two variants share is scored once
        for variant, (kernel, plan) in _plans(report, cap, threshold).items():
            model = to_runtime(q, kernel, act=plan)
            key = (kernel, repr(sorted((plan or {}).items())))
            if key not in seen:
                with torch.no_grad():
                    seen[key] = perplexity(model, windows)
            ppl[variant] = seen[key]
            plan = plan or {}
            rows.append({
                "run": name, "format": fmt, "activations": variant, "test_ppl": ppl[variant],
                "vs_A16": ppl[variant] / ppl["A16"] - 1, "kernels": model_kernels(model),
                "float_columns": sum(len(p["act_columns"]) for p in plan.values()),
                "a16_layers": sum(p["a16"] for p in plan.values()),
            })  # fmt: skip
            logging.info("%s %s %s: ppl %.4f", name, fmt, variant, ppl[variant])
    layers = [
        {"run": name, "layer": la.name, "act8_error": la.act8_error,
         "outlier_channels": len(la.act_columns), "inputs": la.shape[1]}
        for la in report.layers if la.act8_error is not None
    ]  # fmt: skip
    shape = fp.config
    note = (f"{name}: hidden {shape.hidden_size}, heads {shape.num_attention_heads}, "
            f"intermediate {shape.intermediate_size}, layers {shape.num_hidden_layers}; "
            f"FP test ppl {fp_ppl:.4f} on {tuple(windows.shape)} windows; int8 activation error "
            f"per layer {min(errors):.4f}..{max(errors):.4f}")  # fmt: skip
    return rows, layers, note


def model_kernels(model) -> str:
    from pipeline.runtime.backends import kernel_summary

    return kernel_summary(model)


def act_goals(rows: list[dict], runs: list[str], formats: list[str]) -> list[dict]:
    """Per run and format: the default export's int8 activations within GOAL of A16."""
    goals = []
    for run in runs:
        for fmt in formats:
            name = f"{run} {fmt}: ppl of int8 activations (export defaults) over A16"
            got = {r["activations"]: r for r in rows if r["run"] == run and r["format"] == fmt}
            if "default" not in got or "A16" not in got:
                goals.append(unmeasured(name, f"<= {GOAL:.1%}", "no trained model"))
                continue
            cost = got["default"]["vs_A16"]
            goals.append(goal(name, cost, f"<= {GOAL:.1%}", cost <= GOAL))
    return goals


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="config overrides the runs share (their data)")
    p.add_argument("--run", action="append", default=[], metavar="NAME=DIR",
                   help="a trained run (repeatable)")  # fmt: skip
    p.add_argument("--formats", default="int4g128,int8", help="weight formats, comma-separated")
    p.add_argument("--cap", type=float, default=1 / 32, help="A8+cols: share of inputs in float")
    p.add_argument("--threshold", type=float, default=0.01, help="A8+fallback: act8 error")
    p.add_argument("--root", type=Path, default=Path("outputs/act_quant"))
    args = parse_bench_args(p)
    runs = dict(r.split("=", 1) for r in args.run)
    if not runs:
        p.error("give at least one --run NAME=DIR")
    formats = args.formats.split(",")
    rows, layers, notes = [], [], [f"lowbit CPU kernels: {cpu_kernels()}"]
    for name, run in runs.items():
        got, per_layer, note = measure(name, Path(run), args.root, args)
        rows, layers = rows + got, layers + per_layer
        notes.append(note)
    columns = ["run", "format", "activations", "test_ppl", "vs_A16", "float_columns",
               "a16_layers", "kernels"]  # fmt: skip
    print(markdown_table(rows, columns))
    goals = act_goals(rows, list(runs), formats)
    notes.append(f"A8+cols: cap {args.cap}; A8+fallback: threshold {args.threshold}; "
                 "default: the export's defaults")  # fmt: skip
    print(markdown_table(layers, list(layers[0]) if layers else []))
    tables = [
        result_table("test perplexity by activation path", rows, columns),
        result_table("int8 activation error and MAD outlier channels per input (sensitivity)",
                     layers),
    ]  # fmt: skip
    write_result(args.out or args.root, "act_quant", tables, goals, args.skip_goal, notes)
    args.root.mkdir(parents=True, exist_ok=True)
    return report_goals(goals, args.root, args.skip_goal)


if __name__ == "__main__":
    sys.exit(main())
