"""evaluate: perplexity of every model the run produced, and acceptance of every draft/target pair.

Models are discovered from the run: the FP target and draft, the quantized target (`quantize`),
the distilled target (`distill`) and the reinforced draft (`reinforce`). Every perplexity is the
standard protocol (pipeline/data/heldout.py): the whole test split in non-overlapping windows of
`data.eval_seq_len` tokens; eval.json's `ppl_protocol` records the split, window and tokens.
Acceptance is measured per scenario (long contexts, repetition, rare words, mix) on held-out
prompts: the on-line α of real speculative decoding (mean Σ_x min(p, q) over verified positions),
the teacher-forced α on the prompts, acceptance rate and τ.
Pairs: FP draft vs FP target, FP and reinforced draft vs the final low-bit target, and
self-speculation (the low-bit target drafting for its FP self).
Draft length: adaptive by default (`adaptive`), gamma in [gamma_min, gamma_max] chosen each round
from the acceptance of the last `window` verifications, with the cost ratio c and the
verification costs v(gamma) measured once per pair on the models being evaluated (eval.json
`costs`); `adaptive: false` decodes with the fixed `gamma`. `temperature_schedule` makes the draft
sample at T = temperature * (1 + 0.1 * cos(step / 1000)) over the decoding steps, as reinforce's
rollouts do (`pipeline.speculative.schedule`).
Speed (``timing``) is measured as the runtime decodes: the low-bit targets converted to the
runtime's packed kernels (``pipeline.runtime.inmemory``), plain tokens/s of every model and
speculative tokens/s of every pair beside the theoretical speed-up (``pipeline.runtime.speed``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import torch

from pipeline import runmodels
from pipeline.analysis.errorflow import error_flow, format_error_flow, plot_error_flow
from pipeline.analysis.harness import LmEvalConfig, lm_eval_metrics, run_lm_eval
from pipeline.config import RunConfig, positive
from pipeline.data.heldout import corpus_heldout
from pipeline.data.text import Corpus
from pipeline.models.hf import load_tokenizer, perplexity
from pipeline.models.quantized import load_model
from pipeline.speculative.adaptive import AdaptiveGamma
from pipeline.speculative.cost import measure_cost_ratio, measure_verify_cost
from pipeline.speculative.evaluation import (
    acceptance_table,
    column,
    heldout_scenarios,
    pair_name,
    plot_acceptance,
)
from pipeline.stages import StageIO

NEEDS: tuple[str, ...] = ("bootstrap",)
USES: tuple[str, ...] = ("quantize", "distill", "reinforce")
SECTIONS = ("model", "data")
DISTRIBUTED = False

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvaluateConfig:
    """Perplexity of every model in the run; acceptance of every draft/target pair per scenario."""

    batch_size: int = 8
    temperature: float = 1.0
    scenarios: list[str] = field(default_factory=lambda: ["long", "repetition", "rare", "mix"])
    scenario_prompts: int = 8  # held-out prompts per scenario (teacher-forced alpha uses all)
    prompt_len: int = 128
    long_len: int = 576  # > 512 tokens: the long-context scenario
    spec_prompts: int = 4  # prompts decoded speculatively per scenario
    spec_new_tokens: int = 32
    gamma: int = 4  # the fixed draft length when adaptive is off
    # Adaptive draft length in [gamma_min, gamma_max] from the acceptance of the last `window`
    # verifications (50-100: shorter windows swing with single rounds, longer ones lag a change
    # of text), priced with c and v measured once per pair.
    adaptive: bool = True
    gamma_min: int = 2
    gamma_max: int = 5
    window: int = 64
    # Draft temperature T = temperature * (1 + 0.1 * cos(step / 1000)) over the decoding steps.
    temperature_schedule: bool = False
    # Decode speed on the runtime's packed kernels: plain and speculative tok/s, vs theory.
    timing: bool = True
    error_flow_windows: int = (
        32  # test windows the per-layer drift diagnostic (error_flow.png) runs on
    )
    # Downstream tasks through lm-evaluation-harness (pip install 'lowbit[eval]') on the FP,
    # quantized and distilled targets; empty tasks = off. Nothing is downloaded: a task's data
    # must be in the local datasets cache, or in files named by a task YAML under include_path.
    lm_eval: LmEvalConfig = field(default_factory=LmEvalConfig)

    def check(self, prefix: str) -> None:
        positive(
            prefix,
            batch_size=self.batch_size,
            temperature=self.temperature,
            spec_new_tokens=self.spec_new_tokens,
            gamma=self.gamma,
            gamma_min=self.gamma_min,
            scenario_prompts=self.scenario_prompts,
            spec_prompts=self.spec_prompts,
            error_flow_windows=self.error_flow_windows,
        )
        from pipeline.data.scenarios import SCENARIOS
        from pipeline.errors import ConfigError

        if self.gamma_max < self.gamma_min:
            raise ConfigError(
                f"{prefix}.gamma_max", f"is {self.gamma_max}", f">= gamma_min ({self.gamma_min})"
            )
        if not 50 <= self.window <= 100:
            raise ConfigError(f"{prefix}.window", f"is {self.window}", "50 <= window <= 100")
        for i, s in enumerate(self.scenarios):
            if s not in SCENARIOS:
                raise ConfigError(f"{prefix}.scenarios[{i}]", f"is {s!r}", ", ".join(SCENARIOS))


CONFIG = EvaluateConfig


def _models(run: RunConfig, inputs: dict) -> tuple[dict, dict]:
    """({name: target-like model}, {name: draft model}) present in this run."""
    allow_bin = run.model.allow_bin
    targets = {
        name: load_model(path, allow_bin, **run.model.load_options("target"))
        for name, path in runmodels.targets(run.model, inputs).items()
    }
    # Only the user's own checkpoint may be a .bin one; reinforce writes safetensors.
    drafts = {
        name: load_model(path, allow_bin and name == "draft_fp", **run.model.load_options("draft"))
        for name, path in runmodels.drafts(run.model, inputs).items()
    }
    return targets, drafts


def _pairs(targets: dict, drafts: dict) -> list[tuple[str, str]]:
    final = next((t for t in ("target_distilled", "target_quantized") if t in targets), None)
    pairs = [(d, "target_fp") for d in ("draft_fp",) if d in drafts]
    if final:
        pairs += [(d, final) for d in ("draft_fp", "draft_reinforced") if d in drafts]
        pairs.append((final, "target_fp"))  # self-speculation: low-bit self drafts for FP self
    return pairs


def _save(fig, path) -> None:
    """Write a pyplot figure and free it (pyplot keeps every open figure alive)."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)


def _costs(p: EvaluateConfig, models: dict, pairs, prompt: list[int]) -> dict:
    """c of every pair and v(gamma) of every target, measured once, after ``prompt``."""
    ids = torch.as_tensor([prompt], dtype=torch.long)
    gammas = range(p.gamma_min, p.gamma_max + 1)
    targets = dict.fromkeys(t for _, t in pairs)
    verify = {t: measure_verify_cost(models[t], gammas, input_ids=ids) for t in targets}
    return {
        pair_name(d, t): {
            "cost_ratio": measure_cost_ratio(models[t], models[d], input_ids=ids),
            "verify_cost": verify[t],
        }
        for d, t in pairs
    }


def _adaptive(p: EvaluateConfig, costs: dict):
    """A fresh adaptive draft length for (draft, target), priced with that pair's costs."""

    def make(draft: str, target: str) -> AdaptiveGamma:
        cost = costs[pair_name(draft, target)]
        return AdaptiveGamma(
            p.gamma_min,
            p.gamma_max,
            p.window,
            cost_ratio=cost["cost_ratio"],
            verify_cost=cost["verify_cost"],
        )

    return make


def _speed(p: EvaluateConfig, targets, drafts, pairs, prompts, seed: int) -> dict:
    """Decode speed of every model as the runtime runs it (low-bit targets on packed kernels)."""
    from pipeline.runtime.inmemory import to_runtime
    from pipeline.runtime.speed import decode_speed, format_speed

    # In place: perplexity and acceptance are done, and a copy would double the models' memory.
    # Drafts too, as bench/acceptance.py does: a large float draft takes the runtime's kernels.
    models = {n: to_runtime(m, copy_model=False) for n, m in {**targets, **drafts}.items()}
    ids = [torch.as_tensor([x], dtype=torch.long) for x in prompts[: p.spec_prompts]]
    speed = decode_speed(
        models,
        pairs,
        ids,
        new_tokens=p.spec_new_tokens,
        gamma=p.gamma,
        adaptive=(p.gamma_min, p.gamma_max, p.window) if p.adaptive else None,
        temperature=p.temperature,  # the acceptance tables' temperature: the same α regime
        temperature_schedule=p.temperature_schedule,
        seed=seed,
    )
    for line in format_speed(speed):
        log.info("evaluate: %s", line)
    return speed


def run(cfg: EvaluateConfig, run: RunConfig, io: StageIO) -> dict:
    tokenizer = load_tokenizer(runmodels.fp_target(run.model, io.inputs))
    corpus = Corpus(run.data, tokenizer)
    targets, drafts = _models(run, io.inputs)
    user_context = None
    if run.model.target.path:
        user_context = targets["target_fp"].config.max_position_embeddings
    test = corpus_heldout(corpus, "test", user_context)
    win = test.windows
    result: dict = {"ppl": {}, "ppl_protocol": test.describe(), "acceptance": {}, "speculative": {}}
    log.info("evaluate: perplexity on the %s", test.label())
    for name, model in {**targets, **drafts}.items():
        result["ppl"][name] = perplexity(model, win, cfg.batch_size)
        log.info("evaluate: %-18s perplexity %.3f (%s)", name, result["ppl"][name], test.label())

    # Downstream tasks (lm-evaluation-harness) on the targets: does the drift change answers?
    if cfg.lm_eval.tasks:
        device = next(targets["target_fp"].parameters()).device  # where evaluation runs
        result["lm_eval"] = run_lm_eval(targets, tokenizer, cfg.lm_eval, device)

    # Error flow: where along the depth the low-bit targets drift from FP (before/after distill).
    lowbit = {k.removeprefix("target_"): m for k, m in targets.items() if k != "target_fp"}
    if lowbit:
        probe = win[: cfg.error_flow_windows]  # a diagnostic: a few windows show the trend
        curves = {
            k: error_flow(targets["target_fp"], m, probe, cfg.batch_size) for k, m in lowbit.items()
        }
        result["error_flow"] = curves
        (io.out_dir / "error_flow.md").write_text(format_error_flow(curves) + "\n")
        _save(plot_error_flow(curves), io.out_dir / "error_flow.png")
        log.info(
            "evaluate: error flow (last layer) %s",
            "  ".join(f"{k} {v[-1]:.4f}" for k, v in curves.items()),
        )

    pairs = _pairs(targets, drafts)
    if pairs:
        sets = heldout_scenarios(
            tokenizer,
            corpus.splits["test"],
            n_prompts=cfg.scenario_prompts,
            prompt_len=cfg.prompt_len,
            long_len=cfg.long_len,
            seed=run.seed,
        )
        sets = {s: sets[s] for s in cfg.scenarios}
        adaptive = None
        if cfg.adaptive:
            mix = sets["mix"] if "mix" in sets else next(iter(sets.values()))
            result["costs"] = _costs(cfg, {**drafts, **targets}, pairs, mix[0])
            adaptive = _adaptive(cfg, result["costs"])
        table = acceptance_table(
            targets,
            {**drafts, **targets},
            sets,
            pairs=pairs,
            gamma=cfg.gamma,
            adaptive=adaptive,
            temperature=cfg.temperature,
            temperature_schedule=cfg.temperature_schedule,
            new_tokens=cfg.spec_new_tokens,
            max_prompts=cfg.spec_prompts,
            batch_size=cfg.batch_size,
            seed=run.seed,
        )
        result["speculative"] = table
        result["acceptance"] = {pair: column(table, pair, "alpha") for pair in table}
        fig = plot_acceptance(
            result["acceptance"], ylabel="on-line acceptance α", title="acceptance per scenario"
        )
        _save(fig, io.out_dir / "acceptance.png")
        for pair, per in result["acceptance"].items():
            log.info(
                "evaluate: α %-36s %s", pair, "  ".join(f"{s} {v:.3f}" for s, v in per.items())
            )
            tau = column(table, pair, "tau")["mean"]
            log.info("evaluate: τ %-36s %.2f tokens per target call", pair, tau)
        if cfg.timing:
            prompts = sets["mix"] if "mix" in sets else next(iter(sets.values()))
            result["speed"] = _speed(cfg, targets, drafts, pairs, prompts, run.seed)
    (io.out_dir / "eval.json").write_text(json.dumps(result, indent=1))
    metrics = {f"ppl_{k}": v for k, v in result["ppl"].items()}
    for k, v in result.get("error_flow", {}).items():
        metrics[f"error_flow_last_{k}"] = v[-1]
    metrics.update(lm_eval_metrics(result.get("lm_eval", {})))
    for pair, per in result["acceptance"].items():
        metrics.update({f"alpha_{pair.replace('@', '-vs-')}_{s}": v for s, v in per.items()})
        tau = column(result["speculative"], pair, "tau")["mean"]
        metrics[f"tau_{pair.replace('@', '-vs-')}_mean"] = tau
    speed = result.get("speed", {"plain": {}, "speculative": {}})
    metrics.update({f"tok_s_{k}": v["tokens_per_s"] for k, v in speed["plain"].items()})
    for pair, v in speed["speculative"].items():
        metrics[f"speedup_{pair.replace('@', '-vs-')}"] = v["speedup"]
    return metrics
