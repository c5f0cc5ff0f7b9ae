"""reinforce: train the draft for acceptance against the target it will serve.

The draft is trained on-policy on the acceptance scenarios (long contexts, heavy repetition,
rare words, plain text; cut from the train split) with the loss of
:func:`pipeline.lit.losses.reinforce_loss` under Lightning (any `trainer=`;
:mod:`pipeline.lit.reinforce`).

Selection: the draft is validated on `val_prompts` prompts per scenario cut from the validation
split (never the test split the report's before/after numbers come from) before the first step
(the starting draft), every `val_every` steps and at the last step; the metric is the
teacher-forced expected acceptance alpha = mean sum_x min(p, q) against the target, per
scenario, then averaged over the scenarios. After each validation `checkpoints/best.ckpt` in the
work dir keeps the best by that alpha, whose weights, not the last ones, are the result;
`early_stop_patience` optionally stops once it no longer improves. When no checkpoint beats the
starting draft, the starting draft is handed on unchanged, with a warning and `kept_input: true`
in `reinforce.json`.

Reproducibility and resume: the throughput term of the reward uses c = draft/target step time.
With `cost_ratio` set, a run is reproducible run to run, bit for bit. With `cost_ratio: null` c
is measured (a timing, so it differs between runs) once, when training starts, and recorded in
every checkpoint: a rerun after a kill reuses it (`DraftReinforce`).
`checkpoints/last.ckpt` in the work dir is written every `checkpoint_every` steps (null: a tenth
of max_steps, so a kill loses at most ~10% of the training) and after each validation; a rerun
resumes from it with the batches (indexed by step), reward baseline, random streams and
validation history of the killed run, reuses the starting draft's scores (`before.json`), and
writes the bytes an uninterrupted run with the same c writes (`pipeline.lit.resume`).

Which target: the one the run will deploy (`pipeline.runmodels.final_target`). The distilled
model when the run has one, else the quantized one, else the FP target: a low-bit target's
distribution moves, and the draft's acceptance should follow it. Which draft: the user's
(`model.draft.path`, FP or a lowbit quantized directory, whose step sizes and zero points are
then what trains) or the bootstrap draft. Without a draft (a user target and no
`model.draft.path`) the target drafts for itself; there is nothing to reinforce and the workflow
skips the stage, saying so.

Outputs: `draft/` (HF dir, or a lowbit quantized dir for a quantized draft, copied unchanged
when the input is kept) and `reinforce.json`: the validation numbers (split, prompts, step-0,
best and every check), and on-line acceptance per scenario on held-out prompts of the test split
before and after, plus the FP draft on the FP target as the reference when the target is
quantized, and a plot. Paths in it are relative to the run dir, so a moved run dir reads alike.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from pipeline import runmodels
from pipeline.config import ModelConfig, RunConfig, positive
from pipeline.data.scenarios import SCENARIOS
from pipeline.data.text import load_splits
from pipeline.errors import ConfigError
from pipeline.evaluation.acceptance import (
    acceptance_table,
    column,
    heldout_scenarios,
    plot_acceptance,
)
from pipeline.io import write_json
from pipeline.lit.fit import (
    Fit,
    Selection,
    best_weights,
    check_clip,
    check_fit_trainer,
    fit_validated,
)
from pipeline.lit.guards import NanGuard
from pipeline.lit.losses import LossWeights
from pipeline.lit.reinforce import DraftReinforce, ReinforceData, load_draft
from pipeline.models.hf import load_causal_lm, load_tokenizer, save_hf
from pipeline.models.quantized import (
    is_quantized_dir,
    load_model,
    read_quant_meta,
    save_quantized_model,
)
from pipeline.stages import StageIO

NEEDS: tuple[str, ...] = ("bootstrap",)
USES: tuple[str, ...] = ("quantize", "distill")
SECTIONS: tuple[str, ...] = ("model", "data", "trainer")
DISTRIBUTED = True  # trains with the configured Lightning strategy on every rank

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReinforceConfig:
    """Acceptance-rate reinforcement of the draft against the (quantized, when the run has one)
    target. Loss = pg_weight * policy gradient (R = w_acceptance * acceptance + w_throughput *
    throughput, moving baseline) + tvd_weight * TVD(p, q) on visited positions + kl_weight *
    KL(q || q_start) + context_tvd_weight * TVD(p, q) on context positions."""

    max_steps: int = 300
    batch_size: int = 8  # contexts per step and rank (one scenario per step, equal lengths)
    gamma: int = 4  # draft tokens proposed per context
    lr: float = 3e-3  # for the bootstrap-sized draft; lower it for large drafts
    warmup_steps: int = 10
    temperature: float = 1.0  # decoding temperature the acceptance is trained and measured at
    # T0 of the draft sampling schedule T = T0 * (1 + 0.1 * cos(step / 1000)).
    draft_t0: float = 1.0
    w_acceptance: float = 0.7
    w_throughput: float = 0.3
    baseline_momentum: float = 0.9
    pg_weight: float = 0.1
    tvd_weight: float = 1.0  # lambda_tvd
    kl_weight: float = 0.05  # lambda_kl, anchor to the starting draft
    # TVD(p, q) on context_positions teacher-forced positions of each context (DistillSpec's
    # fixed-data term: K/gamma times the on-policy signal). Default pair, 300 steps, validation
    # alpha gain: 0 -> +1.9 points, 1 -> +4.5, 2 -> +5.3, 4 -> +6.0 (lr 3e-3; docs/benchmarks.md).
    context_tvd_weight: float = 4.0
    context_positions: int = 64
    grad_clip: float = 1.0  # gradient-norm clipping, 1.0-3.0 as in distill
    nan_guard: bool = True  # skip a non-finite step, restore the last good state, halve the lr
    # c = draft/target step time in the throughput reward. Set: a run is reproducible run to
    # run, bit for bit. null: measured once when training starts (timing noise: differs between
    # runs), recorded in the checkpoints, and reused by a rerun after a kill.
    cost_ratio: float | None = None
    # Quantized draft: scale/zero gradient factor (bits | lsq | none).
    quant_grad_scale: Literal["bits", "lsq", "none"] = "bits"
    # Resume checkpoint (last.ckpt, in the stage's work dir) every N steps and after each
    # validation; null: a tenth of max_steps, so a kill loses at most ~10% of the training. A
    # rerun resumes from it and writes what an uninterrupted run writes, byte for byte.
    checkpoint_every: int | None = None
    # Sliding-window acceptance monitor (the dynamic strategy): the on-policy acceptance of the
    # last monitor_window steps is logged (alpha_window); when its newer half is lower than its
    # older half by more than lr_drop_threshold, the lr is multiplied by lr_drop_factor for the
    # rest of the run (and the window starts over). 64 steps: with the four scenarios taken in
    # turn, each half holds 8 batches of each, so the halves compare like with like. 0.05 =
    # five points of acceptance between half-window means: a fall, not one hard batch.
    # lr_drop_threshold null: monitor only.
    monitor_window: int = 64
    lr_drop_threshold: float | None = 0.05
    lr_drop_factor: float = 0.5
    scenarios: list[str] = field(default_factory=lambda: list(SCENARIOS))
    train_prompts: int = 64  # prompts per scenario from the train split
    # Held-out prompts per scenario (test split) for the reported before/after.
    eval_prompts: int = 8
    prompt_len: int = 128
    long_len: int = 576  # > 512: the long-context scenario
    eval_new_tokens: int = 32  # tokens generated per held-out prompt for measured acceptance
    # Validation on the validation split (never test): teacher-forced alpha = mean sum_x min(p, q)
    # of the draft against the target on fixed prompts, before training (the starting draft) and
    # every val_every steps; the best checkpoint is the result, and the starting draft is handed
    # on unchanged when none beats it.
    #
    # val_prompts: per scenario: 128 prompts, ~30k scored positions. Per-prompt alpha differs by
    # sd 0.02-0.035 between prompts and a draft's change by sd 0.003-0.008 (smoke models):
    # standard errors ~0.003 (level) and ~0.001 (checkpoint vs checkpoint), well below the 0.011
    # alpha the last-step draft lost (0.618 -> 0.607).
    val_prompts: int = 32
    val_every: int = 50  # validate (and keep the best.ckpt) every N steps, and at the last step
    # Stop after N checks without a better alpha; null: train max_steps.
    early_stop_patience: int | None = None

    def check(self, prefix: str) -> None:
        positive(
            prefix,
            max_steps=self.max_steps,
            batch_size=self.batch_size,
            gamma=self.gamma,
            lr=self.lr,
            temperature=self.temperature,
            draft_t0=self.draft_t0,
            grad_clip=self.grad_clip,
            cost_ratio=self.cost_ratio,
            checkpoint_every=self.checkpoint_every,
            monitor_window=self.monitor_window,
            train_prompts=self.train_prompts,
            eval_prompts=self.eval_prompts,
            eval_new_tokens=self.eval_new_tokens,
            val_prompts=self.val_prompts,
            val_every=self.val_every,
            early_stop_patience=self.early_stop_patience,
        )
        for key in (
            "w_acceptance",
            "w_throughput",
            "pg_weight",
            "tvd_weight",
            "kl_weight",
            "context_tvd_weight",
            "context_positions",
            "warmup_steps",
        ):
            if getattr(self, key) < 0:
                raise ConfigError(f"{prefix}.{key}", f"must be >= 0, got {getattr(self, key)}")
        check_clip(prefix, "grad_clip", self.grad_clip)
        if self.monitor_window < 2:
            raise ConfigError(f"{prefix}.monitor_window", f"is {self.monitor_window}", ">= 2")
        if self.lr_drop_threshold is not None and self.lr_drop_threshold < 0:
            raise ConfigError(
                f"{prefix}.lr_drop_threshold", f"is {self.lr_drop_threshold}", ">= 0, or null"
            )
        if not 0 < self.lr_drop_factor <= 1:
            raise ConfigError(
                f"{prefix}.lr_drop_factor", f"is {self.lr_drop_factor}", "0 < lr_drop_factor <= 1"
            )
        if not 0 <= self.baseline_momentum < 1:
            raise ConfigError(
                f"{prefix}.baseline_momentum",
                f"is {self.baseline_momentum}",
                "0 <= baseline_momentum < 1",
            )
        bad = [s for s in self.scenarios if s not in SCENARIOS] or (not self.scenarios and ["[]"])
        if bad:
            raise ConfigError(
                f"{prefix}.scenarios", f"contains {bad}", f"a non-empty list from {list(SCENARIOS)}"
            )
        if self.prompt_len < 2 or self.long_len < 2:
            raise ConfigError(f"{prefix}.prompt_len", "and long_len must be >= 2")


CONFIG = ReinforceConfig


def skip_reason(cfg: ReinforceConfig, run: RunConfig) -> str | None:
    if run.model.target.path and not run.model.draft.path:
        return (
            "there is no draft (model.draft.path is null with a user target): the target "
            "drafts for itself, nothing to reinforce; set model.draft.path to train one"
        )
    return None


def check(cfg: ReinforceConfig, run: RunConfig) -> None:
    check_fit_trainer("reinforce", run.trainer)  # Lightning's arguments, none the stage sets


def run(cfg: ReinforceConfig, run: RunConfig, io: StageIO) -> dict:
    """Reinforce into `io.out_dir` (`io`: the workflow's StageIO); returns the stage metrics."""
    allow_bin, seed = run.model.allow_bin, run.seed
    torch.manual_seed(seed)
    target_name, target_dir = _target(run.model, io.inputs)
    draft_dir = runmodels.fp_draft(run.model, io.inputs)
    tokenizer = load_tokenizer(runmodels.fp_target(run.model, io.inputs))
    docs = load_splits(run.data)
    sets = {
        split: _scenarios(cfg, seed, io, tokenizer, docs, split, n)
        for split, n in (
            ("train", cfg.train_prompts),
            ("validation", cfg.val_prompts),
            ("test", cfg.eval_prompts),
        )
    }
    # The target only scores (frozen): it loads as the user asked (model.target.dtype); the
    # draft trains and keeps fp32 master weights.
    target = load_model(target_dir, allow_bin, **run.model.load_options("target"))
    target.requires_grad_(False)
    draft = load_draft(draft_dir, allow_bin, cfg.quant_grad_scale)
    start = "draft_quantized" if is_quantized_dir(draft_dir) else "draft_fp"
    trainable = sum(p.requires_grad for p in draft.parameters())
    log.info(
        "reinforce: %s (%s) against %s (%s); %d trainable tensors",
        *(start, draft_dir, target_name, target_dir, trainable),
    )
    table = _before(cfg, seed, io, target_name, target, {start: draft.eval()}, sets["test"])
    module = _module(cfg, draft, target, seed)
    guard = NanGuard(lr_key="stage.reinforce.lr") if cfg.nan_guard else None
    fit = _fit(cfg, run, io, module, sets, guard)
    if not io.dist.is_main:
        return {}

    device = next(target.parameters()).device  # Lightning may have moved the module back
    draft = _result(cfg, fit, draft_dir, allow_bin).to(device).eval()
    pairs = {"before": f"{start}@{target_name}", "after": f"{AFTER}@{target_name}"}
    if fit.kept:
        table[pairs["after"]] = table[pairs["before"]]
    else:
        table.update(_measure(cfg, seed, target_name, target, {AFTER: draft}, sets["test"]))
    if target_name != "target_fp":  # the goal: at least the FP draft's acceptance on the FP target
        fp_target = load_causal_lm(
            runmodels.fp_target(run.model, io.inputs),
            allow_bin=allow_bin,
            **run.model.load_options("target"),
        )
        fp_draft = {start: load_model(draft_dir, allow_bin).to(device)}
        table.update(_measure(cfg, seed, "target_fp", fp_target.to(device), fp_draft, sets["test"]))
        pairs["reference"] = f"{start}@target_fp"
    _save_draft(draft, draft_dir, io.out_dir / "draft", fit.kept, tokenizer)
    report = {
        "target": target_name,
        "target_dir": io.describe(target_dir),
        "draft_dir": io.describe(draft_dir),
        "draft_quantized": start == "draft_quantized",
        **_summary(cfg, fit, module, sets),
        "pairs": pairs,
        "training": {
            "nan_skipped": guard.skipped if guard else 0,
            "guard_lr_scale": guard.lr_scale if guard else 1.0,
            "monitor_lr_drops": module.monitor.drops,
            "monitor_lr_scale": module.lr_scale,
        },
    }
    return _report(io, report, table) | fit.resume_metrics()


AFTER = "draft_reinforced"  # the trained draft's name in the tables


def _target(model: ModelConfig, inputs: dict[str, Path]) -> tuple[str, Path]:
    """(name, directory) of the target to reinforce against: the run's final target."""
    return list(runmodels.targets(model, inputs).items())[-1]


def _scenarios(cfg: ReinforceConfig, seed: int, io, tokenizer, docs, split: str, n: int) -> dict:
    """Prompt sets of one split, built on rank 0 and cached in the work dir for the others."""

    def build():
        sets = heldout_scenarios(
            tokenizer,
            docs[split],
            n_prompts=n,
            prompt_len=cfg.prompt_len,
            long_len=cfg.long_len,
            seed=seed,
            cache_path=io.work_dir / f"scenarios_{split}.json",
        )
        return {s: sets[s] for s in cfg.scenarios}

    out = build() if io.dist.is_main else None
    io.dist.barrier()
    return out if out is not None else build()


def _measure(cfg: ReinforceConfig, seed: int, target_name, target, drafts: dict, scenarios) -> dict:
    return acceptance_table(
        {target_name: target},
        drafts,
        scenarios,
        gamma=cfg.gamma,
        temperature=cfg.temperature,
        new_tokens=cfg.eval_new_tokens,
        seed=seed,
    )


def _before(cfg: ReinforceConfig, seed: int, io, target_name, target, drafts, scenarios) -> dict:
    """The starting draft's test-split acceptance (rank 0; the others get {}), measured once:
    `before.json` in the work dir survives a crash, after which the starting draft is gone."""
    before_file = io.work_dir / "before.json"
    table: dict = {}
    if io.dist.is_main:
        if before_file.is_file():
            table = json.loads(before_file.read_text())
        else:
            table = _measure(cfg, seed, target_name, target, drafts, scenarios)
            write_json(before_file, table)
    io.dist.barrier()
    return table


def _module(cfg: ReinforceConfig, draft, target, seed: int) -> DraftReinforce:
    return DraftReinforce(
        draft,
        target,
        gamma=cfg.gamma,
        temperature=cfg.temperature,
        draft_t0=cfg.draft_t0,
        cost_ratio=cfg.cost_ratio,
        weights=LossWeights(
            pg=cfg.pg_weight,
            tvd=cfg.tvd_weight,
            kl=cfg.kl_weight,
            w_acceptance=cfg.w_acceptance,
            w_throughput=cfg.w_throughput,
            context_tvd=cfg.context_tvd_weight,
        ),
        lr=cfg.lr,
        warmup=cfg.warmup_steps,
        max_steps=cfg.max_steps,
        baseline_momentum=cfg.baseline_momentum,
        monitor_window=cfg.monitor_window,
        seed=seed,
        context_positions=cfg.context_positions,
        lr_drop_threshold=cfg.lr_drop_threshold,
        lr_drop_factor=cfg.lr_drop_factor,
    )


def _fit(
    cfg: ReinforceConfig,
    run: RunConfig,
    io,
    module: DraftReinforce,
    sets: dict,
    guard: NanGuard | None,
) -> Fit:
    """Train on the train prompts, validating on the validation ones; every checkpoint lives in
    the work dir."""
    data = ReinforceData(
        {s: torch.tensor(v) for s, v in sets["train"].items()},
        {s: torch.tensor(v) for s, v in sets["validation"].items()},
        cfg.batch_size,
        run.seed,
    )
    return fit_validated(
        "reinforce",
        module,
        data,
        trainer_cfg=run.trainer,
        work_dir=io.work_dir,
        dist=io.dist,
        logger=io.log.lightning_logger() or False,
        select=Selection("val/alpha", "alpha", larger_is_better=True),
        max_steps=cfg.max_steps,
        val_every=cfg.val_every,
        ckpt_every=cfg.checkpoint_every,
        patience=cfg.early_stop_patience,
        callbacks=[guard] if guard else [],
        clip=("grad_clip", cfg.grad_clip),
        use_distributed_sampler=False,  # each rank draws its own batches (ReinforceData)
    )


def _result(cfg: ReinforceConfig, fit: Fit, draft_dir: Path, allow_bin: bool):
    """A fresh copy of the starting draft: kept as is, or given the best checkpoint's tensors
    (whatever the strategy did to the trained module, e.g. ZeRO-3 partitions)."""
    if not fit.kept:
        return best_weights(
            fit, "draft.", lambda: load_draft(draft_dir, allow_bin, cfg.quant_grad_scale)
        )
    log.warning(
        "reinforce: no checkpoint beat the starting draft on the validation split (best "
        "teacher-forced alpha %.4f at step %d vs %.4f before training): keeping it unchanged",
        fit.chosen["alpha"],
        fit.chosen["step"],
        fit.before["alpha"],
    )
    return load_model(draft_dir, allow_bin)


def _save_draft(draft, draft_dir: Path, out: Path, kept: bool, tokenizer) -> None:
    """`draft/`: the input byte for byte when kept, else in the input's representation."""
    if kept and is_quantized_dir(draft_dir):
        shutil.copytree(draft_dir, out)
    elif is_quantized_dir(draft_dir):
        save_quantized_model(draft.cpu(), out, draft_dir, read_quant_meta(draft_dir)["method"])
    else:
        save_hf(draft.cpu(), tokenizer, out)


def _shapes(sets: dict) -> dict[str, list[int]]:
    return {s: [len(v), len(v[0])] for s, v in sets.items()}


def _summary(cfg: ReinforceConfig, fit: Fit, module: DraftReinforce, sets: dict) -> dict:
    """The training, validation and test-split settings of reinforce.json."""
    return {
        "steps": module.global_step,
        "gamma": cfg.gamma,
        "temperature": cfg.temperature,
        "cost_ratio": module.cost_ratio,
        "kept_input": fit.kept,
        "validation": {
            "split": "validation",
            "prompts": _shapes(sets["validation"]),
            "metric": "teacher-forced alpha = mean sum_x min(p, q), mean over scenarios; higher "
            "is better",
            "input": fit.before,
            "best": fit.chosen,
            "history": fit.history,
        },
        "eval_split": "test",
        "eval_prompts": _shapes(sets["test"]),
        "eval_new_tokens": cfg.eval_new_tokens,
    }


def _report(io, report: dict, table: dict) -> dict:
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

    import matplotlib.pyplot as plt

    fig = plot_acceptance(
        alpha,
        ylabel="on-line acceptance alpha",
        title=f"draft acceptance on {report['target']}, before/after reinforce",
    )
    fig.savefig(io.out_dir / "acceptance.png", dpi=120)
    io.log.log_figure(fig, "acceptance.png")
    plt.close(fig)
    shown = "  ".join(
        f"{s} {alpha['before'][s]:.3f}->{alpha['after'][s]:.3f}" for s in alpha["after"]
    )
    log.info("reinforce: alpha %s", shown)
    val = report["validation"]
    written = val["input"] if report["kept_input"] else val["best"]
    # The first four make the workflow's summary line: test-split on-line alpha, and whether
    # the starting draft was kept.
    metrics = {
        "alpha_before_mean": alpha["before"]["mean"],
        "alpha_after_mean": alpha["after"]["mean"],
        "kept_input": float(report["kept_input"]),
    }
    if val["input"] is not None:
        metrics["val_alpha_tf_before_mean"] = val["input"]["alpha"]
    metrics |= {
        "val_alpha_tf_after_mean": written["alpha"],
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
