"""The design's headline table on this machine: what lowbit buys a user who decodes.

Rows (batch 1, greedy, the runtime's kernels):

* ``FP plain``: the FP32 target alone;
* ``FP spec``: the FP target with the FP draft;
* ``int4 + FP draft``: RTN int4g128 of the FP target with the FP draft, the conventional
  baseline;
* ``lowbit plain``: lowbit's target alone;
* ``lowbit``: lowbit's target with its draft, adaptive gamma (which may choose plain decoding;
  one controller over all of a row's runs, as the runtime keeps one across requests).

Columns: ms/token and tokens/s (median of ``--repeats`` runs, min-max), x FP plain, weights +
KV cache resident (MB), on-line alpha, tokens per target call (tau) and the gamma used.

Two levels:

* **trained** (``--run-dir``, repeatable): a finished workflow's own models, each number
  measured on them: FP target and draft, the final (distilled) target with the reinforced draft,
  and RTN int4g128 of the FP target made in memory.
* **at scale** (``--scale``): a random-weight Llama of TinyLlama-1.1B's shape. Its draft is the
  target's own first ``--draft-layers`` layers (shared, so in the target's format: a draft that
  is quantized with its target) and an int8 copy of its lm_head, c ~ 0.1 as 1 B against 8 B.
  Random weights agree by chance only, so each speculative row's agreement is *calibrated* to
  the alpha the trained run measured for that pair (FP draft @ FP target, FP draft @ int4,
  final draft @ lowbit's target; both at gamma 3: an adaptive run's alpha is biased low where
  it steps plain; the trained one on ``--alpha-prompts`` prompts, 64: a greedy continuation's
  tokens agree together, so prompts count, and on the default pair 16 read 0.06 higher than 64
  for the FP draft; the calibrated one on ``--scale-alpha-prompts``, 16, what a 1.1 B FP row
  can decode in minutes), within ``--alpha-tol``: the norms of the layers after the draft's
  are scaled (their cost unchanged) and the scale bisected until the measured alpha matches;
  the trace is printed and kept. lowbit's target takes the trained plan's formats (the allocate
  stage's ``BitPlan``) by relative depth. Every gamma of ``--gammas`` is timed on lowbit's pair
  next to the adaptive choice.

Goals (exit 1 when one is missed or cannot be checked): at scale lowbit >= 3.0 x FP plain
tokens/s and >= 1.4 x the int4 + FP draft row, measured speed-up >= 0.8 x theory at every gamma
of ``--gammas``, every calibrated alpha within tolerance; per run dir lowbit speculative >=
1.0 x lowbit plain (adaptive gamma; the median ratio of passes that alternate the two) and
the final draft's alpha >= the FP draft's on lowbit's target.

Usage:
  python -m bench.headline --run-dir outputs/default --scale --out docs/results/headline
  python -m bench.headline --alphas fp=0.54,int4=0.54,lowbit=0.62 --plan PATH --scale  # no run
  [--threads N] [--repeats 3] [--gammas 2,3,4,5] [--hidden 2048 --layers 22 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import statistics
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from bench import decode_speed as ds
from bench._common import (
    add_goal_args,
    cpu_kernels,
    goal,
    hwm_mib,
    machine,
    markdown_table,
    report_goals,
    result_table,
    unmeasured,
    write_result,
)
from pipeline.runtime import float_rows
from pipeline.runtime.speed import decode_passes, kv_cache_bytes, paired_passes, weight_bytes
from pipeline.speculative.adaptive import AdaptiveGamma
from pipeline.speculative.cost import measure_cost_ratio, measure_verify_cost
from pipeline.speculative.decoding import plain_generate, speculative_decoder
from pipeline.speculative.metrics import theoretical_speedup
from pipeline.speculative.stats import SpecStats

COLUMNS = ("level", "row", "ms/token", "tok/s", "min-max", "x FP plain", "weights+KV MB",
           "alpha", "tokens/call", "gamma")  # fmt: skip
GAMMA_COLUMNS = ("gamma", "alpha", "tokens/call", "tok/s", "speed-up", "theory", "of theory")
CAL_COLUMNS = ("row", "want alpha", "norm scale", "alpha")
PAIRED_COLUMNS = ("level", "passes", "spec / plain", "spec min-max", "plain / plain",
                  "plain min-max")  # fmt: skip
ALPHA_GAMMA = 3  # the draft length every compared or calibrated alpha is measured at
PAIRS = {  # speculative row: the key of the alpha it is calibrated to
    "FP spec": "fp",
    "int4 + FP draft": "int4",
    "lowbit": "lowbit",
}
SCALE_X_FP, SCALE_X_INT4, OF_THEORY = 3.0, 1.4, 0.8


def resident_mb(models: Sequence[nn.Module], context: int) -> float:
    """Weights (each tensor once: a draft shares its target's) and KV caches at ``context``."""
    weights = weight_bytes(nn.ModuleList(models))
    return (weights + sum(kv_cache_bytes(m, context) for m in models)) / 1e6


Passes = tuple[SpecStats, list[float]]  # runtime.speed.decode_passes: merged counters, tok/s


def row(level: str, name: str, passes: Passes, mb: float, gamma: str = "-") -> dict:
    """A table row from ``passes`` (median tokens/s, its min-max; alpha and tau of all)."""
    merged, tps = passes
    med = statistics.median(tps)
    spec = merged.drafted > 0
    return {
        "level": level, "row": name, "ms/token": 1000 / med, "tok/s": med,
        "min-max": f"{min(tps):.1f}-{max(tps):.1f}", "weights+KV MB": mb,
        "alpha": merged.alpha_hat if spec else None, "tokens/call": merged.tau, "gamma": gamma,
    }  # fmt: skip


class Pair:
    """A target and draft timed plainly, at fixed gammas and adaptively, on the same prompts."""

    def __init__(
        self, target: nn.Module, draft: nn.Module | None, prompts, args, alpha_prompts=None
    ) -> None:
        self.target, self.draft, self.prompts, self.args = target, draft, prompts, args
        self.alpha_prompts = alpha_prompts or prompts
        self.context = prompts[0].shape[1] + args.new_tokens
        self.costs: tuple[float, dict[int, float]] | None = None

    def mb(self) -> float:
        return resident_mb([m for m in (self.target, self.draft) if m is not None], self.context)

    def plain_decoder(self):
        """Greedy plain decoding of the target, as the rows time it."""
        return lambda x, g: plain_generate(self.target, x, self.args.new_tokens, 0.0, g)

    def plain(self, level: str, name: str) -> dict:
        runs = decode_passes(self.plain_decoder(), self.prompts, 0, self.args.repeats)
        return row(level, name, runs, resident_mb([self.target], self.context))

    def measured_costs(self) -> tuple[float, dict[int, float]]:
        if self.costs is None:
            gammas = range(1, max(self.args.gammas) + 1)
            x = self.prompts[0]
            self.costs = (
                measure_cost_ratio(self.target, self.draft, input_ids=x),
                measure_verify_cost(self.target, gammas, input_ids=x),
            )
        return self.costs

    def decoder(self, gamma: int | None):
        """Speculative decoding at ``gamma``, or adaptive when None: one window over the warm-up
        and every run, as the runtime keeps one across requests and evaluate across passes."""
        c, v = self.measured_costs()
        window = None
        if gamma is None:
            lo, hi = min(self.args.gammas), max(self.args.gammas)
            window = AdaptiveGamma(lo, hi, 64, cost_ratio=c, verify_cost=v, timed=True)
        return speculative_decoder(
            self.target, self.draft, self.args.new_tokens, gamma=gamma or 1, adaptive=window,
            temperature=0.0,
        )  # fmt: skip

    def runs(self, gamma: int | None) -> Passes:
        return decode_passes(self.decoder(gamma), self.prompts, 0, self.args.repeats)

    def paired(self, level: str) -> dict:
        """Adaptive speculative / plain tokens/s over passes that alternate the two
        (``paired_passes``): the VM's drift between two separate series of passes (10-30%)
        exceeds the few percent this ratio decides. Beside it, plain against plain: what the
        same procedure reads for two equal decoders, the ratio's noise on this machine."""
        plain = self.plain_decoder()
        _, spec, base = paired_passes(self.decoder(None), plain, self.prompts, 0, self.args.paired)
        _, same, base2 = paired_passes(plain, plain, self.prompts, 0, self.args.paired)
        ratios = [s / b for s, b in zip(spec, base)]
        control = [s / b for s, b in zip(same, base2)]
        return {"level": level, "passes": len(ratios), "spec / plain": statistics.median(ratios),
                "spec min-max": f"{min(ratios):.3f}-{max(ratios):.3f}",
                "plain / plain": statistics.median(control),
                "plain min-max": f"{min(control):.3f}-{max(control):.3f}"}  # fmt: skip

    def alpha(self) -> float:
        """Alpha at the fixed gamma ALPHA_GAMMA: the pair's agreement, what calibration matches.
        An adaptive run's alpha is not: its plain steps test nothing, and the probes it drafts
        come right after acceptance fell, so it reads low for a pair that went plain. On
        ``alpha_prompts``, once: greedy passes repeat their tokens, only more prompts narrow it."""
        runs = decode_passes(self.decoder(ALPHA_GAMMA), self.alpha_prompts, 0, 1)
        return row("", "", runs, 0.0)["alpha"]

    def spec(self, level: str, name: str) -> dict:
        runs = self.runs(None)
        used = runs[0].gammas
        gamma = f"adaptive {statistics.mean(used):.1f}" if used else "adaptive 0 (plain)"
        return row(level, name, runs, self.mb(), gamma)

    def sweep(self, plain_tps: float) -> list[dict]:
        """Every gamma of ``--gammas``: measured speed-up against theory at the measured alpha."""
        c, _ = self.measured_costs()
        out = []
        for gamma in self.args.gammas:
            r = row("", "", self.runs(gamma), 0.0)
            theory = float(theoretical_speedup(r["alpha"], gamma, c))
            speedup = r["tok/s"] / plain_tps
            out.append({"gamma": gamma, "alpha": r["alpha"], "tokens/call": r["tokens/call"],
                        "tok/s": r["tok/s"], "speed-up": speedup, "theory": theory,
                        "of theory": speedup / theory})  # fmt: skip
            print(out[-1], flush=True)
        return out


# ---------------------------------------------------------------------------------------------
# At scale: a synthetic target whose draft's agreement is calibrated to a trained pair's alpha.


@contextlib.contextmanager
def tail_norms(model: nn.Module, first: int) -> Iterator[Callable[[float], None]]:
    """``set(scale)``: the norms of layers ``first``.. scaled by ``scale``; restored on exit.

    How much those layers change the residual stream, and so how often the first layers' draft
    agrees with the target, without changing any layer's cost or touching quantized weights.
    """
    norms = [n for layer in model.model.layers[first:]
             for n in (layer.input_layernorm, layer.post_attention_layernorm)]  # fmt: skip
    saved = [n.weight.detach().clone() for n in norms]

    def set_scale(scale: float) -> None:
        with torch.no_grad():
            for n, w in zip(norms, saved, strict=True):
                n.weight.copy_(w * scale)

    try:
        yield set_scale
    finally:
        set_scale(1.0)


def calibrate(pair: Pair, set_scale, want: float, tol: float, steps: int) -> list[dict]:
    """Bisect the tail's norm scale (log scale) until alpha at ALPHA_GAMMA is within ``tol / 2`` of
    ``want``; leaves the closest scale set and returns the trace."""
    lo, hi = math.log(1e-3), math.log(10.0)  # alpha falls as the scale grows
    trace = []
    for _ in range(steps):
        scale = math.exp((lo + hi) / 2)
        set_scale(scale)
        alpha = pair.alpha()
        trace.append({"want alpha": want, "norm scale": scale, "alpha": alpha})
        print(f"calibrate: scale {scale:.4g} alpha {alpha:.3f} (want {want:.3f})", flush=True)
        if abs(alpha - want) <= tol / 2:
            break
        lo, hi = (math.log(scale), hi) if alpha > want else (lo, math.log(scale))
    set_scale(min(trace, key=lambda t: abs(t["alpha"] - want))["norm scale"])
    return trace


def scaled_plan(plan: Mapping[str, str], layers: int) -> Callable[[str], str | None]:
    """A trained plan's formats on a ``layers``-deep model: layer i takes the format of the
    trained layer at the same relative depth, module by module."""
    trained = 1 + max(int(n.split(".")[2]) for n in plan if n.startswith("model.layers."))

    def fmt(name: str) -> str:
        parts = name.split(".")
        parts[2] = str(int(parts[2]) * trained // layers)
        return plan.get(".".join(parts))  # None: a layer the plan keeps float

    return fmt


def at_scale(args: argparse.Namespace, alphas: Mapping[str, float], plan_fmt) -> dict:
    model = ds.llama(args.hidden, args.layers, args.intermediate, args.vocab, args.kv_heads)
    float_rows.convert(model)
    prompts = [torch.randint(0, args.vocab, (1, args.prompt_len),
                             generator=torch.Generator().manual_seed(i))
               for i in range(max(args.prompts, args.scale_alpha_prompts))]  # fmt: skip
    rows, cal, sweep, calibrated = [], [], [], {}
    print(f"at scale: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params", flush=True)
    stages = (("fp", lambda n: None), ("int4", lambda n: "int4g128"), ("lowbit", plan_fmt))
    with tail_norms(model, args.draft_layers) as set_scale:
        for key, fmt in stages:
            with ds.quantized_linears(model, fmt) as target:
                draft = ds.shallow_draft(target, args)
                pair = Pair(target, draft, prompts[: args.prompts], args, prompts)
                if key == "fp":
                    rows.append(pair.plain("at scale", "FP plain"))
                if key == "lowbit":
                    rows.append(pair.plain("at scale", "lowbit plain"))
                name = next(n for n, k in PAIRS.items() if k == key)
                trace = calibrate(pair, set_scale, alphas[key], args.alpha_tol, args.cal_steps)
                cal += [{"row": name, **t} for t in trace]
                calibrated[key] = min(trace, key=lambda t: abs(t["alpha"] - alphas[key]))["alpha"]
                rows.append(pair.spec("at scale", name))
                print(rows[-1], flush=True)
                if key == "lowbit":
                    sweep = pair.sweep(rows[-2]["tok/s"])
    fp = rows[0]["tok/s"]
    for r in rows:
        r["x FP plain"] = r["tok/s"] / fp
    return {"rows": rows, "calibration": cal, "sweep": sweep, "calibrated": calibrated}


# ---------------------------------------------------------------------------------------------
# Trained: a finished run's own models.


def test_prompts(fp_path: Path, n: int, length: int) -> list[torch.Tensor]:
    """``n`` prompts of ``length`` tokens from the built-in corpus's test split, the evaluate
    stage's "mix" scenario."""
    from pipeline.config import DataConfig
    from pipeline.data.text import Corpus
    from pipeline.evaluation.acceptance import heldout_scenarios
    from pipeline.models.hf import load_tokenizer

    tokenizer = load_tokenizer(fp_path)
    docs = Corpus(DataConfig(), tokenizer).splits["test"]
    sets = heldout_scenarios(tokenizer, docs, n_prompts=n, prompt_len=length, long_len=4 * length)
    return [torch.tensor([p]) for p in sets["mix"][:n]]


def trained(run_dir: Path, args: argparse.Namespace) -> dict:
    """The table on ``run_dir``'s models, and the alphas the at-scale rows calibrate to."""
    from pipeline import runmodels
    from pipeline.config import ModelConfig
    from pipeline.models.quantized import load_model
    from pipeline.runtime.inmemory import to_runtime

    inputs = runmodels.finished_stages(run_dir)
    model_cfg = ModelConfig()
    paths = runmodels.targets(model_cfg, inputs) | runmodels.drafts(model_cfg, inputs)
    missing = {"target_fp", "draft_fp"} - set(paths)
    if missing or len(runmodels.quantized_targets(inputs)) == 0:
        raise SystemExit(f"{run_dir}: needs a finished run with a draft and a quantized target")
    fp_path = paths["target_fp"]
    final_t = runmodels.final_target(model_cfg, inputs)
    final_d = runmodels.final_draft(model_cfg, inputs)
    models = {
        "fp": load_model(fp_path, False),
        "draft": load_model(paths["draft_fp"], False),
        "lowbit": load_model(final_t, False),
        "final_draft": load_model(final_d, False),
    }
    int4 = float_rows.convert(copy.deepcopy(models["fp"]).eval())
    models = {k: to_runtime(m, copy_model=False) for k, m in models.items()}
    many = test_prompts(fp_path, max(args.prompts, args.alpha_prompts), args.prompt_len)
    prompts = many[: args.prompts]
    level = f"trained {run_dir.name}"
    fp = Pair(models["fp"], models["draft"], prompts, args, many)
    low = Pair(models["lowbit"], models["final_draft"], prompts, args, many)
    low_fp_draft = Pair(models["lowbit"], models["draft"], prompts, args, many)
    rows = [fp.plain(level, "FP plain"), fp.spec(level, "FP spec")]
    with ds.quantized_linears(int4, lambda n: "int4g128") as t4:
        int4_pair = Pair(t4, models["draft"], prompts, args, many)
        rows.append(int4_pair.spec(level, "int4 + FP draft"))
        alphas = {"int4": int4_pair.alpha()}
    rows += [low.plain(level, "lowbit plain"), low.spec(level, "lowbit")]
    alphas |= {"fp": fp.alpha(), "lowbit": low.alpha()}
    fp_draft_alpha = low_fp_draft.alpha()
    for r in rows:
        r["x FP plain"] = r["tok/s"] / rows[0]["tok/s"]
        print(r, flush=True)
    plan = inputs.get("allocate")  # the allocate stage's folder: BitPlan.load reads its plan
    return {"rows": rows, "alphas": alphas, "fp_draft_on_lowbit": fp_draft_alpha, "plan": plan,
            "paired": low.paired(level)}  # fmt: skip


# ---------------------------------------------------------------------------------------------


def check_goals(runs: Sequence[dict], scale: dict | None, tol: float) -> list[dict]:
    """The goals of each trained run (``runs``: :func:`trained`'s dicts) and of the at-scale level
    (``scale``: :func:`at_scale`'s dict with its target ``alphas``; None: not run, missed)."""
    goals = []
    for t in runs:
        by = {r["row"]: r for r in t["rows"]}
        level = t["rows"][0]["level"]
        ratio = t["paired"]["spec / plain"]
        goals.append(goal(f"{level}: lowbit speculative / lowbit plain (paired passes)", ratio,
                          ">= 1.0", ratio >= 1.0))  # fmt: skip
        final, fp_d = t["alphas"]["lowbit"], t["fp_draft_on_lowbit"]
        goals.append(goal(f"{level}: final draft alpha - FP draft alpha on lowbit's target",
                          final - fp_d, ">= 0", final >= fp_d))  # fmt: skip
    if scale is None:
        return goals + [unmeasured("at scale: lowbit / FP plain", f">= {SCALE_X_FP}",
                                   "run with --scale")]  # fmt: skip
    by = {r["row"]: r for r in scale["rows"]}
    x_fp = by["lowbit"]["tok/s"] / by["FP plain"]["tok/s"]
    x_int4 = by["lowbit"]["tok/s"] / by["int4 + FP draft"]["tok/s"]
    goals += [
        goal("at scale: lowbit / FP plain tok/s", x_fp, f">= {SCALE_X_FP}", x_fp >= SCALE_X_FP),
        goal("at scale: lowbit / int4 + FP draft tok/s", x_int4, f">= {SCALE_X_INT4}",
             x_int4 >= SCALE_X_INT4),
    ]  # fmt: skip
    for name, key in PAIRS.items():  # the scale calibration left set, at ALPHA_GAMMA
        want, got = scale["alphas"][key], scale["calibrated"][key]
        goals.append(goal(f"at scale: {name} alpha - calibrated target {want:.3f}", got - want,
                          f"within +-{tol}", abs(got - want) <= tol))  # fmt: skip
    for s in scale["sweep"]:
        goals.append(goal(f"at scale: measured / theory at gamma {s['gamma']}", s["of theory"],
                          f">= {OF_THEORY}", s["of theory"] >= OF_THEORY))  # fmt: skip
    if not scale["sweep"]:
        goals.append(unmeasured("at scale: measured / theory", f">= {OF_THEORY}", "no --gammas"))
    return goals


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", action="append", default=[], type=Path)
    p.add_argument("--scale", action="store_true", help="also the 1.1B synthetic level")
    p.add_argument(
        "--alphas",
        default=None,
        help="fp=A,int4=A,lowbit=A: calibrate to these instead of the first run's",
    )
    p.add_argument("--plan", type=Path, default=None, help="allocate's folder or plan file")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--draft-head", default="int8")
    p.add_argument("--prompts", type=int, default=2, help="prompts of the timed rows")
    p.add_argument("--alpha-prompts", type=int, default=64, help="prompts of a trained alpha")
    p.add_argument("--scale-alpha-prompts", type=int, default=16, help="of a calibrated alpha")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--paired", type=int, default=15, help="paired passes of the never-slower goal")
    p.add_argument("--gammas", default="2,3,4,5")
    p.add_argument("--alpha-tol", type=float, default=0.03)
    p.add_argument("--cal-steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench-out/headline")
    add_goal_args(p)
    args = p.parse_args()
    args.gammas = [int(g) for g in args.gammas.split(",") if g]
    if args.scale and not args.run_dir and (args.alphas is None or args.plan is None):
        p.error("--scale needs a --run-dir to calibrate to, or --alphas and --plan")
    return args


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    info = f"machine: {machine()}; lowbit CPU kernels: {cpu_kernels()}; threads {threads}"
    print(info, flush=True)
    runs = [trained(d, args) for d in args.run_dir]
    scale = None
    if args.scale:
        alphas = (dict((k, float(v)) for k, v in (a.split("=") for a in args.alphas.split(",")))
                  if args.alphas else runs[0]["alphas"])  # fmt: skip
        from pipeline.quant.plan import BitPlan

        plan_path = args.plan or runs[0]["plan"]
        plan = {n: f.name for n, f in BitPlan.load(plan_path).quantized().items()}
        scale = at_scale(args, alphas, scaled_plan(plan, args.layers)) | {"alphas": alphas}
    rows = [r for t in runs for r in t["rows"]] + (scale["rows"] if scale else [])
    goals = check_goals(runs, scale, args.alpha_tol)
    paired = [t["paired"] for t in runs]
    tables = [result_table("headline", rows, COLUMNS)]
    text = [info, markdown_table(rows, COLUMNS)]
    if paired:
        tables.append(result_table("trained: paired passes (never slower)", paired, PAIRED_COLUMNS))
        text.append(markdown_table(paired, PAIRED_COLUMNS))
    if scale:
        tables += [result_table("at scale: every gamma on lowbit's pair", scale["sweep"],
                                GAMMA_COLUMNS),
                   result_table("at scale: alpha calibration", scale["calibration"],
                                CAL_COLUMNS)]  # fmt: skip
        text += [markdown_table(scale["sweep"], GAMMA_COLUMNS),
                 markdown_table(scale["calibration"], CAL_COLUMNS)]  # fmt: skip
    print("\n\n".join(text) + f"\npeak RSS {hwm_mib():.0f} MiB")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "headline.md").write_text("\n\n".join(text) + "\n")
    write_result(out, "headline", tables, goals, args.skip_goal, [info])
    return report_goals(goals, out, args.skip_goal)


if __name__ == "__main__":
    sys.exit(main())
