"""What a reinforce run reports: on-line acceptance of the draft before and after in the serving
mode (greedy at serve_temperature 0), and the teacher-forced validation it was selected on
(`reinforce.json`, a plot, the stage metrics)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pipeline.data.scenarios import new_tokens_by_scenario
from pipeline.evaluation.acceptance import acceptance_table, column, plot_acceptance
from pipeline.io import write_json
from pipeline.lit.fit import Fit
from pipeline.lit.keep import Margin

log = logging.getLogger(__name__)

AFTER = "draft_reinforced"  # the trained draft's name in the tables
_SELECTION = {
    "alpha": "teacher-forced alpha = mean sum_x min(p, q) at the serving temperature, mean over "
    "scenarios; higher is better",
    "greedy_match": "greedy match = share of positions where the draft's argmax is the target's, "
    "mean over scenarios (serving greedily); higher is better",
}


def measure(cfg, seed: int, target_name: str, target, drafts: dict, scenarios: dict) -> dict:
    """On-line acceptance of each draft against the target on the held-out prompts, decoded at
    the serving temperature (at 0 alpha is the greedy acceptance, alpha_tf the greedy match)."""
    return acceptance_table(
        {target_name: target},
        drafts,
        scenarios,
        gamma=cfg.gamma,
        temperature=cfg.serve_temperature,
        new_tokens=new_tokens_by_scenario(scenarios, cfg.eval_new_tokens, cfg.long_new_tokens),
        seed=seed,
    )


def before(cfg, seed: int, io, target_name, target, drafts, scenarios) -> dict:
    """The starting draft's test-split acceptance (rank 0; the others get {}), measured once:
    `before.json` in the work dir survives a crash, after which the starting draft is gone."""
    before_file = io.work_dir / "before.json"
    table: dict = {}
    if io.dist.is_main:
        if before_file.is_file():
            table = json.loads(before_file.read_text())
        else:
            table = measure(cfg, seed, target_name, target, drafts, scenarios)
            write_json(before_file, table)
    io.dist.barrier()
    return table


def _shapes(sets: dict) -> dict[str, list[int]]:
    return {s: [len(v), len(v[0])] for s, v in sets.items()}


def summary(cfg, fit: Fit, module, sets: dict) -> dict:
    """The training, validation and test-split settings of reinforce.json."""
    return {
        "steps": module.global_step,
        "gamma": cfg.gamma,
        "serve_temperature": cfg.serve_temperature,
        "cost_ratio": module.cost_ratio,
        "kept_input": fit.kept,
        "validation": {
            "split": "validation",
            "prompts": _shapes(sets["validation"]),
            "metric": _SELECTION[cfg.selection_key],
            "selected_on": cfg.selection_key,
            "alpha_temperature": cfg.alpha_temperature,
            **fit.validation(),
        },
        "eval_split": "test",
        "eval_prompts": _shapes(sets["test"]),
        "eval_new_tokens": cfg.eval_new_tokens,
        "long_new_tokens": cfg.long_new_tokens or cfg.eval_new_tokens,
        "training": {
            "nan_skipped": fit.nan_skipped,
            "guard_lr_scale": fit.guard_lr_scale,
            "monitor_lr_drops": module.monitor.drops,
            "monitor_lr_scale": module.lr_scale,
        },
    }


def write(io, report: dict, table: dict) -> dict:
    """Write reinforce.json and the before/after plot; returns the stage metrics."""
    pairs = report["pairs"]
    alpha = {k: column(table, pair, "alpha") for k, pair in pairs.items()}
    report["summary"] = {
        "alpha": alpha,
        "alpha_tf": {k: column(table, pair, "alpha_tf") for k, pair in pairs.items()},
        "acceptance_rate": {k: column(table, pair, "acceptance_rate") for k, pair in pairs.items()},
        "gain": {s: alpha["after"][s] - alpha["before"][s] for s in alpha["after"]},
    }
    report["acceptance"] = table
    (io.out_dir / "reinforce.json").write_text(json.dumps(report, indent=1))
    _plot(io, alpha, report["target"])
    shown = "  ".join(
        f"{s} {alpha['before'][s]:.3f}->{alpha['after'][s]:.3f}" for s in alpha["after"]
    )
    log.info("reinforce: alpha %s", shown)
    return _metrics(report, alpha)


def _plot(io, alpha: dict, target: str) -> None:
    import matplotlib.pyplot as plt

    fig = plot_acceptance(
        alpha,
        ylabel="on-line acceptance alpha",
        title=f"draft acceptance on {target}, before/after reinforce",
    )
    fig.savefig(Path(io.out_dir) / "acceptance.png", dpi=120)
    io.log.log_figure(fig, "acceptance.png")
    plt.close(fig)


def _metrics(report: dict, alpha: dict) -> dict:
    val = report["validation"]
    written = val["input"] if report["kept_input"] else val["best"]
    # The first three make the workflow's summary line.
    metrics = {
        "alpha_before_mean": alpha["before"]["mean"],
        "alpha_after_mean": alpha["after"]["mean"],
        "kept_input": float(report["kept_input"]),
    }
    if val["keep"] is not None:  # the keep decision's alpha gain
        metrics |= Margin.load(val["keep"]).metrics()
    if val["input"] is not None:
        metrics["val_alpha_tf_before_mean"] = val["input"]["alpha"]
        metrics["val_greedy_match_before_mean"] = val["input"]["greedy_match"]
    metrics |= {
        "serve_temperature": report["serve_temperature"],
        "val_alpha_tf_after_mean": written["alpha"],
        "val_greedy_match_after_mean": written["greedy_match"],
        "val_alpha_tf_best_mean": val["best"]["alpha"],
        "best_step": val["best"]["step"],
        "val_prompts": float(min(n for n, _ in val["prompts"].values())),
    }
    metrics |= {f"alpha_after_{s}": v for s, v in alpha["after"].items()}
    metrics |= {f"alpha_before_{s}": v for s, v in alpha["before"].items()}
    if "reference" in alpha:
        metrics["alpha_reference_mean"] = alpha["reference"]["mean"]
    metrics |= {
        "alpha_gain_mean": report["summary"]["gain"]["mean"],
        "cost_ratio": report["cost_ratio"],
        "steps": float(report["steps"]),
        "nan_skipped": float(report["training"]["nan_skipped"]),
        "lr_drops": float(report["training"]["monitor_lr_drops"]),
    }
    return metrics
