"""`report.md`: a run's outcome on one page, from what the stages wrote alone (so it is the same
whether a stage ran now or in an earlier invocation)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.analysis.errorflow import format_error_flow
from pipeline.errors import LowbitError
from pipeline.evaluation.acceptance import column
from pipeline.evaluation.result import GREEDY, EvalResult
from pipeline.hardware import describe
from pipeline.stages import ORDER


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _stage_table(run_dir: Path) -> list[str]:
    rows = ["| stage | seconds | key metrics |", "|---|---|---|"]
    for stage in ORDER:
        done = _load(run_dir / stage / "_done.json")
        if done is None:
            continue
        shown = [
            f"{k}={_fmt(v)}"
            for k, v in done.get("metrics", {}).items()
            if isinstance(v, int | float) and k != "world_size"
        ][:5]
        rows.append(f"| {stage} | {done['timings']['seconds']:.1f} | {', '.join(shown)} |")
    return rows


def _machines(run_dir: Path) -> list[str]:
    """Where each stage ran (CPU, flags, commit): every timing above is that machine's."""
    seen: dict[str, list[str]] = {}
    for stage in ORDER:
        done = _load(run_dir / stage / "_done.json")
        machine = (done or {}).get("timings", {}).get("machine")
        if machine:
            seen.setdefault(describe(machine), []).append(stage)
    if len(seen) == 1:
        return ["", f"Measured on {next(iter(seen))}."]
    return ["", *[f"- {', '.join(stages)}: {line}" for line, stages in seen.items()]]


def _keep_decisions(run_dir: Path) -> list[str]:
    """What each training stage handed on, and the validation margin it decided on."""
    rows = []
    for stage in ("distill", "reinforce"):
        m = ((_load(run_dir / stage / "_done.json") or {}).get("metrics")) or {}
        if "keep_gain" in m:
            handed = "its input" if m["kept_input"] else f"step {m['best_step']:.0f}"
            rows.append(
                f"| {stage} | {handed} | {m['keep_gain']:+.4g} | [{m['keep_ci_low']:+.4g}, "
                f"{m['keep_ci_high']:+.4g}] ({m['keep_confidence']:.0%} each) | "
                f"{m['keep_windows']:.0f} |"
            )
    if not rows:
        return []
    title = "## Keep decisions (best check vs input, paired bootstrap over windows)"
    head = "| stage | hands on | validation gain | bounds | windows |"
    return [title, "", head, "|---" * 5 + "|", *rows, ""]


def _eval_tables(ev: EvalResult) -> list[str]:
    proto, where = ev.ppl_protocol, "held-out windows"
    if proto:
        where = f"{proto['split']} split, {proto['windows']} windows x {proto['window']}, "
        where += f"{proto['tokens']:,} tokens"
    out = [f"## Perplexity ({where})", "", "| model | ppl |", "|---|---|"]
    out += [f"| {k} | {v:.3f} |" for k, v in ev.ppl.items()]
    if ev.acceptance:
        scenarios = list(dict.fromkeys(s for per in ev.acceptance.values() for s in per))
        out += ["", "## Acceptance α (draft@target, per scenario)", ""]
        out += ["| pair | " + " | ".join(scenarios) + " |", "|---" * (len(scenarios) + 1) + "|"]
        for pair, per in ev.acceptance.items():
            cells = [f"{per[s]:.3f}" if s in per else "" for s in scenarios]
            out.append(f"| {pair} | " + " | ".join(cells) + " |")
    out += _modes_table(ev)
    if ev.speed_table:
        from pipeline.evaluation.speed import format_speed_table

        out += ["", "## Decode speed against FP plain (batch 1; ratios of side-by-side passes)", ""]
        out += format_speed_table(ev.speed_table)
    if ev.speed:
        from pipeline.runtime.speed import format_speed

        out += ["", "## Decode speed (batch 1, as the runtime runs each model)", ""]
        out += format_speed(ev.speed)
    out += _lm_eval_table(ev.lm_eval)
    if ev.error_flow:
        out += ["", "## Error flow (relative hidden-state error after each decoder layer)", ""]
        out += format_error_flow(ev.error_flow).splitlines()
    return out


def _modes_table(ev: EvalResult) -> list[str]:
    """Each pair's acceptance and tokens per target call at the run's temperature and greedily."""
    pairs = [pair for pair in ev.acceptance if ev.has_greedy(pair)]
    if not pairs:
        return []
    at = "T" if ev.temperature is None else f"T = {ev.temperature:g}"
    out = ["", "## Both decoding modes (mean over scenarios; τ: tokens per target call)", ""]
    head = f"| pair | α ({at}) | τ ({at}) | greedy match | greedy α | greedy τ |"
    out += [head, "|---" * 6 + "|"]
    for pair in pairs:
        mean = {m: column(ev.speculative, pair, m)["mean"] for m in ("alpha", "tau", *GREEDY)}
        out.append(
            f"| {pair} | {mean['alpha']:.3f} | {mean['tau']:.2f} | {mean['greedy_match']:.3f} | "
            f"{mean['alpha_greedy']:.3f} | {mean['tau_greedy']:.2f} |"
        )
    return out


def _evaluation(run_dir: Path) -> list[str]:
    folder = run_dir / "evaluate"
    if not EvalResult.path(folder).exists():
        return []
    try:
        return _eval_tables(EvalResult.load(folder))
    except LowbitError as err:  # the report still shows the other stages
        return [f"Evaluation not shown: {err}"]


def _lm_eval_table(res: dict) -> list[str]:
    """One row per task and metric (acc, acc_norm...), one column per model: value ± stderr."""
    if not res:
        return []
    models = list(res)
    rows = {}  # (task, metric) -> {model: cell}
    for model, tasks in res.items():
        for task, metrics in tasks.items():
            for m, v in metrics.items():
                if not m.endswith("_stderr"):
                    err = metrics.get(f"{m}_stderr")
                    cell = f"{v:.3f}" + (f" ± {err:.3f}" if err is not None else "")
                    rows.setdefault((task, m), {})[model] = cell
    out = ["", "## Downstream tasks (lm-evaluation-harness)", ""]
    out += ["| task | metric | " + " | ".join(models) + " |", "|---" * (len(models) + 2) + "|"]
    for (task, m), cells in rows.items():
        out.append(f"| {task} | {m} | " + " | ".join(cells.get(k, "") for k in models) + " |")
    return out


def _artifact_size(run_dir: Path) -> list[str]:
    manifest = _load(run_dir / "export" / "artifact" / "manifest.json")
    if manifest is None:
        return []
    total = sum(
        p.stat().st_size for p in (run_dir / "export" / "artifact").rglob("*") if p.is_file()
    )
    return [
        "",
        "## Artifact",
        "",
        f"`export/artifact/`: {total / 2**20:.2f} MiB (format {manifest.get('format', '?')})",
    ]


def write_report(run_dir: Path) -> Path:
    """Write `<run_dir>/report.md` from the stage folders present; returns its path."""
    lines = [f"# lowbit run `{run_dir.name}`", "", "## Stages", "", *_stage_table(run_dir)]
    lines += [*_machines(run_dir), ""]
    lines += _keep_decisions(run_dir)
    lines += _evaluation(run_dir)
    plots = [p for s in ORDER for p in sorted((run_dir / s).glob("*.png"))]
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({p.relative_to(run_dir)})" for p in plots]
    lines += _artifact_size(run_dir)
    path = run_dir / "report.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path
