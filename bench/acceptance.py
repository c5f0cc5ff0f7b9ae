"""Acceptance and speed of every draft/target pair a run produced, per scenario.

Pairs (whichever exist in the run):
- FP draft on the FP target, on the quantized target (quantize/model) and on the distilled one
  (distill/model): what quantizing the target costs the draft;
- the reinforced draft (reinforce/draft) on the target it was trained against and on the FP
  target: what reinforcement buys back;
- self-speculation: RTN int3g128 / int2g64 copies of the target drafting for the FP target and
  for its RTN int8 copy.

Per pair and scenario (held-out prompts of the test split): teacher-forced alpha, on-line alpha
of speculative decoding, acceptance rate, tau (on the fake-quant models: exact numerics).
Then speed as the runtime decodes (``pipeline.runtime.speed``): every low-bit model converted to
the runtime's packed kernels, plain tokens/s of each model with the kernels it ran, speculative
tokens/s of each pair on the mix prompts, the measured speed-up and beside it the theoretical
one (1 - a^(g+1)) / ((1 - a)(g c + 1)) at the alpha of that decode and c measured on these
models. Timings share the machine with whatever else runs: run it alone.

Goals (the reinforced draft against the target it was trained for, on teacher-forced alpha,
which scores every prompt position without sampling noise; on-line alpha is printed beside it):
alpha >= the FP draft's on the FP target, and >= the FP draft's on that same target + 0.05;
every pair with a low-bit target reaches >= 0.8 x its theoretical speed-up. Exits 1 when one is
missed or cannot be checked: a run without a reinforce stage misses the alpha goals unless
``--skip-goal draft_reinforced`` leaves them out.

Usage:
  python -m bench.acceptance --run-dir outputs/smoke [--prompts 16] [--new-tokens 32]
      [--gamma 4] [--prompt-len 128] [--long-len 576] [--speed-prompts 4] [--threads N]
      [--out DIR] [--mlflow URI] [--skip-goal TEXT ...]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

from bench._common import add_goal_args, goal, parsed_tables, report_goals, unmeasured, write_result
from pipeline import runmodels
from pipeline.config import DataConfig, ModelConfig
from pipeline.data.text import load_splits
from pipeline.evaluation.acceptance import (
    acceptance_table,
    column,
    heldout_scenarios,
    plot_acceptance,
)
from pipeline.models.hf import load_tokenizer
from pipeline.models.quantized import load_model
from pipeline.quant.fakequant import FakeQuantLinear
from pipeline.runtime.inmemory import to_runtime
from pipeline.runtime.speed import decode_speed, format_speed
from pipeline.speculative.stats import pair_name

SELF_FORMATS = {"self_int3": "int3g128", "self_int2": "int2g64"}
COLUMNS = (
    ("alpha_tf", "α tf", "{:.3f}"),
    ("alpha", "α", "{:.3f}"),
    ("acceptance_rate", "acc rate", "{:.3f}"),
    ("tau", "τ", "{:.2f}"),
)
OF_THEORY = 0.8  # measured speed-up / theoretical, for pairs with a low-bit target


@torch.no_grad()
def rtn_copy(model: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """A copy whose decoder linears are RTN fake-quant layers (lm_head stays float)."""
    out = copy.deepcopy(model)
    for layer in out.model.layers:
        for name, mod in list(layer.named_modules()):
            if isinstance(mod, torch.nn.Linear):
                layer.set_submodule(name, FakeQuantLinear.from_linear(mod, fmt))
    return out.eval()


def collect_models(run_dir: Path) -> tuple[dict, dict, list[tuple[str, str]], Path, str | None]:
    """(targets, drafts, pairs, FP target dir, the target the draft was reinforced against)."""
    finished = runmodels.finished_stages(run_dir)
    if "bootstrap" not in finished:
        raise SystemExit(f"{run_dir} has no bootstrap/target; run `lowbit run_dir={run_dir}` first")
    model = ModelConfig()  # the run's embedded pair: bootstrap's target and draft
    found = runmodels.targets(model, finished)
    targets = {name: load_model(path, allow_bin=False) for name, path in found.items()}
    targets["target_int8"] = rtn_copy(targets["target_fp"], "int8")
    drafts = {name: rtn_copy(targets["target_fp"], fmt) for name, fmt in SELF_FORMATS.items()}
    pairs = [(s, t) for s in SELF_FORMATS for t in ("target_fp", "target_int8")]
    found_drafts = runmodels.drafts(model, finished)
    if "draft_fp" in found_drafts:
        drafts["draft_fp"] = load_model(found_drafts["draft_fp"], allow_bin=False)
        pairs = [("draft_fp", t) for t in targets if t != "target_int8"] + pairs
    trained_on = None
    if "draft_reinforced" in found_drafts:
        drafts["draft_reinforced"] = load_model(found_drafts["draft_reinforced"], allow_bin=False)
        report = finished["reinforce"] / "reinforce.json"
        trained_on = json.loads(report.read_text())["target"]
        pairs = [("draft_reinforced", t) for t in dict.fromkeys([trained_on, "target_fp"])] + pairs
    return targets, drafts, pairs, found["target_fp"], trained_on


def acceptance_goals(table: dict, trained_on: str | None, gain: float = 0.05) -> list[dict]:
    """The module docstring's alpha goals, on the mean over scenarios of teacher-forced alpha.

    Both are expected of every run: without a reinforce stage, or without a pair's row, each
    is missed as not measured.
    """
    mean = {pair: per["mean"]["alpha_tf"] for pair, per in table.items() if "mean" in per}
    ours = f"draft_reinforced@{trained_on}" if trained_on else "draft_reinforced"
    fp, same = "draft_fp@target_fp", f"draft_fp@{trained_on or '<its target>'}"

    def at_least(base: str, plus: float) -> dict:
        name = f"{ours} >= {base}" + (f" + {plus}" if plus else "")
        if trained_on is None:
            return unmeasured(name, f">= α tf of {base}", "the run has no reinforce stage")
        missing = [pair for pair in (ours, base) if pair not in mean]
        if missing:
            return unmeasured(name, f">= α tf of {base}", f"no {' or '.join(missing)} row")
        want = mean[base] + plus
        return goal(name, mean[ours], f">= {want:.4f}", mean[ours] >= want)

    return [at_least(fp, 0.0), at_least(same, gain)]


def speed_goals(speed: dict, pairs: list[tuple[str, str]]) -> list[dict]:
    """Measured speed-up >= OF_THEORY x theoretical for every pair with a low-bit target; a pair
    without its speed row is missed."""
    measured = speed.get("speculative", {})
    goals = []
    for draft, target in pairs:
        if target == "target_fp":
            continue
        name, want = f"{pair_name(draft, target)} speed-up of theory", f">= {OF_THEORY}"
        m = measured.get(pair_name(draft, target))
        if m is None:
            goals.append(unmeasured(name, want, "no speed row"))
        else:
            goals.append(goal(name, m["of_theory"], want, m["of_theory"] >= OF_THEORY))
    return goals


def markdown(table: dict) -> str:
    rows = [
        "| pair | scenario | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
        "|---|---|" + "---:|" * len(COLUMNS),
    ]
    for pair, per in table.items():
        for scen, m in per.items():
            cells = [f.format(m[k]) if k in m else "-" for k, _, f in COLUMNS]
            rows.append(f"| {pair} | {scen} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--data-path", default=None, help="the run's data.path (null = built-in)")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts per scenario")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--speed-prompts", type=int, default=4, help="mix prompts timed per model")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--long-len", type=int, default=576)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-out/acceptance"))
    ap.add_argument("--mlflow", default=None, help="tracking URI to log the numbers to")
    add_goal_args(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    targets, drafts, pairs, target_dir, trained_on = collect_models(args.run_dir)
    data = DataConfig(path=args.data_path)
    docs = load_splits(data)
    scenarios = heldout_scenarios(
        load_tokenizer(target_dir),
        docs["test"],
        n_prompts=args.prompts,
        prompt_len=args.prompt_len,
        long_len=args.long_len,
        seed=args.seed,
    )
    table = acceptance_table(
        targets,
        drafts,
        scenarios,
        pairs=pairs,
        gamma=args.gamma,
        temperature=args.temperature,
        new_tokens=args.new_tokens,
        seed=args.seed,
    )
    for per in table.values():
        keys = next(iter(per.values()))
        per["mean"] = {k: sum(m[k] for m in per.values()) / len(per) for k in keys}
    text = markdown(table)
    print(
        f"gamma={args.gamma} temperature={args.temperature} prompts={args.prompts} "
        f"new_tokens={args.new_tokens} prompt_len={args.prompt_len} long_len={args.long_len} "
        f"threads={torch.get_num_threads()}\n"
    )
    print(text)
    # In place (the acceptance table is done): every model as the runtime runs it.
    models = {n: to_runtime(m, copy_model=False) for n, m in {**targets, **drafts}.items()}
    prompts = [torch.as_tensor([p]) for p in scenarios["mix"][: args.speed_prompts]]
    speed = decode_speed(
        models,
        pairs,
        prompts,
        new_tokens=args.new_tokens,
        gamma=args.gamma,
        temperature=args.temperature,
        seed=args.seed,
    )
    speed_text = "\n".join(format_speed(speed))
    print("\n" + speed_text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "acceptance.json").write_text(
        json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "table": table, "speed": speed},
            indent=1,
        )
    )
    (args.out / "acceptance.md").write_text(text + "\n\n" + speed_text + "\n")
    series = {pair: {s: v for s, v in column(table, pair).items() if s != "mean"} for pair in table}
    fig = plot_acceptance(series, ylabel="on-line acceptance alpha", title="per scenario")
    fig.savefig(args.out / "acceptance.png", dpi=120)
    if args.mlflow:
        import mlflow

        mlflow.set_tracking_uri(args.mlflow)
        mlflow.set_experiment("lowbit-bench")
        with mlflow.start_run(run_name="acceptance"):
            for pair, per in table.items():
                for scen, m in per.items():
                    mlflow.log_metrics(
                        {f"{pair}.{scen}.{k}".replace("@", "_at_"): v for k, v in m.items()}
                    )
            mlflow.log_artifacts(str(args.out))
    goals = acceptance_goals(table, trained_on) + speed_goals(speed, pairs)
    tables = parsed_tables("acceptance", text) + parsed_tables("speed", speed_text)
    write_result(args.out, "acceptance", tables, goals, args.skip_goal)
    return report_goals(goals, args.out, args.skip_goal)


if __name__ == "__main__":
    sys.exit(main())
