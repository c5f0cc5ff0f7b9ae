"""reinforce: train the draft for acceptance against the target it will serve.

The draft is trained on-policy on the acceptance scenarios (long contexts, heavy repetition,
rare words, plain text; cut from the train split) with the loss of
:mod:`pipeline.lit.reinforce` under Lightning (any `trainer=`).

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

Which target: the one the run will deploy. The distilled model when the run has one, else the
quantized one, else the FP target: a low-bit target's distribution moves, and the draft's
acceptance should follow it. Which draft: the user's (`model.draft.path`, FP or a lowbit
quantized directory, whose step sizes and zero points are then what trains) or the bootstrap
draft. Without a draft (a user target and no `model.draft.path`) the target drafts for itself;
there is nothing to reinforce and the workflow skips the stage, saying so.

Outputs: `draft/` (HF dir, or a lowbit quantized dir for a quantized draft, copied unchanged
when the input is kept) and `reinforce.json`: the validation numbers (split, prompts, step-0,
best and every check), and on-line acceptance per scenario on held-out prompts of the test split
before and after, plus the FP draft on the FP target as the reference when the target is
quantized, and a plot. Paths in it are relative to the run dir, so a moved run dir reads alike.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from pipeline.config import data_cfg, model_cfg, parse, positive
from pipeline.data.scenarios import SCENARIOS
from pipeline.data.text import load_splits
from pipeline.errors import ConfigError, LowbitError
from pipeline.lit.guards import load_trained, pick_best
from pipeline.lit.reinforce import DraftReinforce, LossWeights, ReinforceData, prepare_trainable
from pipeline.lit.resume import ResumeCheckpoint, best_and_last, ckpt_interval, resume_from
from pipeline.lit.trainer import build_trainer, trainer_kwargs
from pipeline.models.hf import load_causal_lm, load_tokenizer, save_hf
from pipeline.spec.evaluation import acceptance_table, column, heldout_scenarios, plot_acceptance

NEEDS: tuple[str, ...] = ("bootstrap",)
USES: tuple[str, ...] = ("quantize", "distill")
KEYS = ("model", "data", "trainer")
DISTRIBUTED = True  # trains with the configured Lightning strategy on every rank

log = logging.getLogger("lowbit")


@dataclass(frozen=True)
class ReinforceConfig:
    max_steps: int = 300
    batch_size: int = 8
    gamma: int = 4
    lr: float = 3e-3
    warmup_steps: int = 10
    temperature: float = 1.0
    draft_t0: float = 1.0
    w_acceptance: float = 0.7
    w_throughput: float = 0.3
    baseline_momentum: float = 0.9
    pg_weight: float = 0.1
    tvd_weight: float = 1.0
    kl_weight: float = 0.05
    context_tvd_weight: float = 4.0
    context_positions: int = 64
    grad_clip: float = 1.0
    cost_ratio: float | None = None
    quant_grad_scale: Literal["bits", "lsq", "none"] = "bits"
    checkpoint_every: int | None = None
    monitor_window: int = 20
    scenarios: list[str] = field(default_factory=lambda: list(SCENARIOS))
    train_prompts: int = 64
    eval_prompts: int = 8
    prompt_len: int = 128
    long_len: int = 576
    eval_new_tokens: int = 32
    val_prompts: int = 32
    val_every: int = 50
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


def skip_reason(cfg) -> str | None:
    if cfg.model.target.path and not cfg.model.draft.path:
        return (
            "there is no draft (model.draft.path is null with a user target): the target "
            "drafts for itself, nothing to reinforce; set model.draft.path to train one"
        )
    return None


def validate(cfg) -> None:
    parse(cfg.stage.reinforce, ReinforceConfig, "stage.reinforce")
    model_cfg(cfg)
    data_cfg(cfg)
    trainer_kwargs(cfg.trainer)


def pick_target(ctx) -> tuple[str, Path, bool]:
    """(name, directory, is_quantized) of the target to reinforce against."""
    for stage, name in (("distill", "target_distilled"), ("quantize", "target_quantized")):
        if stage in ctx.inputs and (ctx.inputs[stage] / "model").is_dir():
            return name, ctx.inputs[stage] / "model", True
    return "target_fp", ctx.target_dir(), False


def is_quantized_dir(path: Path) -> bool:
    from pipeline.models.quantized import QUANT_JSON

    return (Path(path) / QUANT_JSON).is_file()


def load_model(path: Path, allow_bin: bool):
    """A causal LM from an HF dir or a lowbit quantized dir (FakeQuantLinear layers)."""
    if is_quantized_dir(path):
        from pipeline.models.quantized import load_quantized

        return load_quantized(path)
    return load_causal_lm(path, allow_bin=allow_bin)


def _scenarios(ctx, p: ReinforceConfig, tokenizer, docs, split: str, n: int) -> dict:
    """Prompt sets of one split, built on rank 0 and cached in the work dir for the others."""

    def build():
        sets = heldout_scenarios(
            tokenizer,
            docs[split],
            n_prompts=n,
            prompt_len=p.prompt_len,
            long_len=p.long_len,
            seed=ctx.cfg.seed,
            cache_path=ctx.work_dir / f"scenarios_{split}.json",
        )
        return {s: sets[s] for s in p.scenarios}

    out = build() if ctx.dist.is_main else None
    ctx.dist.barrier()
    return out if out is not None else build()


def _measure(ctx, p, target_name, target, drafts: dict, scenarios: dict) -> dict:
    return acceptance_table(
        {target_name: target},
        drafts,
        scenarios,
        gamma=p.gamma,
        temperature=p.temperature,
        new_tokens=p.eval_new_tokens,
        seed=ctx.cfg.seed,
    )


def run(ctx) -> dict:
    p = parse(ctx.params, ReinforceConfig, "stage.reinforce")
    data, allow_bin = data_cfg(ctx.cfg), ctx.cfg.model.allow_bin
    torch.manual_seed(ctx.cfg.seed)
    target_name, target_dir, target_quantized = pick_target(ctx)
    draft_dir = ctx.draft_dir()
    tokenizer = load_tokenizer(ctx.target_dir())
    docs = load_splits(data)
    train_sets = _scenarios(ctx, p, tokenizer, docs, "train", p.train_prompts)
    val_sets = _scenarios(ctx, p, tokenizer, docs, "validation", p.val_prompts)
    eval_sets = _scenarios(ctx, p, tokenizer, docs, "test", p.eval_prompts)

    target = load_model(target_dir, allow_bin).requires_grad_(False)
    draft = load_model(draft_dir, allow_bin)
    draft_quantized = is_quantized_dir(draft_dir)
    start_name = "draft_quantized" if draft_quantized else "draft_fp"
    trainable = prepare_trainable(draft, p.quant_grad_scale)
    log.info(
        "reinforce: %s (%s) against %s (%s); %d trainable tensors",
        start_name,
        draft_dir,
        target_name,
        target_dir,
        len(trainable),
    )

    before_file = ctx.work_dir / "before.json"  # survives a crash: the start draft is gone then
    table: dict = {}
    if ctx.dist.is_main:
        if before_file.is_file():
            table = json.loads(before_file.read_text())
        else:
            table = _measure(ctx, p, target_name, target, {start_name: draft.eval()}, eval_sets)
            _write_json(before_file, table)
    ctx.dist.barrier()

    resume = resume_from(ctx.work_dir, ctx.dist)
    trainer, best = _trainer(ctx, p, resume is not None)
    module = DraftReinforce(
        draft,
        target,
        gamma=p.gamma,
        temperature=p.temperature,
        draft_t0=p.draft_t0,
        cost_ratio=p.cost_ratio,
        weights=LossWeights(
            pg=p.pg_weight,
            tvd=p.tvd_weight,
            kl=p.kl_weight,
            w_acceptance=p.w_acceptance,
            w_throughput=p.w_throughput,
            context_tvd=p.context_tvd_weight,
        ),
        lr=p.lr,
        warmup=p.warmup_steps,
        max_steps=p.max_steps,
        baseline_momentum=p.baseline_momentum,
        monitor_window=p.monitor_window,
        seed=ctx.cfg.seed,
        context_positions=p.context_positions,
    )
    data = ReinforceData(
        {s: torch.tensor(v) for s, v in train_sets.items()},
        {s: torch.tensor(v) for s, v in val_sets.items()},
        p.batch_size,
        ctx.cfg.seed,
    )
    if resume:
        log.info("reinforce: resuming from %s", resume)
    module.draft.train()
    trainer.fit(module, datamodule=data, ckpt_path=resume, weights_only=True)

    before = module.val_input
    history = module.val_history
    chosen, kept = pick_best("reinforce", before, history, "alpha", larger_is_better=True)
    if not best.best_model_path:
        raise LowbitError("reinforce: no checkpoint was written; check stage.reinforce.val_every")
    if not ctx.dist.is_main:
        return {}

    after_name = "draft_reinforced"
    device = next(target.parameters()).device  # Lightning may have moved the module back
    # A fresh copy of the starting draft: kept as is, or given the best checkpoint's tensors
    # (whatever the strategy did to the trained module, e.g. ZeRO-3 partitions).
    draft = load_model(draft_dir, allow_bin)
    if kept:
        log.warning(
            "reinforce: no checkpoint beat the starting draft on the validation split (best "
            "teacher-forced alpha %.4f at step %d vs %.4f before training): keeping it unchanged",
            chosen["alpha"],
            chosen["step"],
            before["alpha"],
        )
        table[f"{after_name}@{target_name}"] = table[f"{start_name}@{target_name}"]
    else:
        prepare_trainable(draft, p.quant_grad_scale)
        load_trained(draft, best.best_model_path, "draft.")
    draft = draft.to(device).eval()
    if not kept:
        table.update(_measure(ctx, p, target_name, target, {after_name: draft}, eval_sets))
    pairs = {"before": f"{start_name}@{target_name}", "after": f"{after_name}@{target_name}"}
    if target_quantized:  # the goal: at least the FP draft's acceptance on the FP target
        fp_target = load_causal_lm(ctx.target_dir(), allow_bin=allow_bin).to(device)
        fp_draft = load_model(draft_dir, allow_bin).to(device)
        table.update(_measure(ctx, p, "target_fp", fp_target, {start_name: fp_draft}, eval_sets))
        pairs["reference"] = f"{start_name}@target_fp"

    out = ctx.out_dir / "draft"
    if kept and draft_quantized:
        shutil.copytree(draft_dir, out)  # the input, byte for byte
    elif draft_quantized:
        from pipeline.models.quantized import read_quant_meta, save_quantized_model

        save_quantized_model(draft.cpu(), out, draft_dir, read_quant_meta(draft_dir)["method"])
    else:
        save_hf(draft.cpu(), tokenizer, out)
    report = {
        "target": target_name,
        "target_dir": ctx.describe(target_dir),
        "draft_dir": ctx.describe(draft_dir),
        "draft_quantized": draft_quantized,
        "steps": module.global_step,
        "gamma": p.gamma,
        "temperature": p.temperature,
        "cost_ratio": module.cost_ratio,
        "kept_input": kept,
        "validation": {
            "split": "validation",
            "prompts": {s: [len(v), len(v[0])] for s, v in val_sets.items()},
            "metric": "teacher-forced alpha = mean sum_x min(p, q), mean over scenarios; higher "
            "is better",
            "input": before,
            "best": chosen,
            "history": history,
        },
        "eval_split": "test",
        "eval_prompts": {s: [len(v), len(v[0])] for s, v in eval_sets.items()},
        "eval_new_tokens": p.eval_new_tokens,
        "pairs": pairs,
    }
    metrics = _report(ctx, report, table)
    resumed = next(c for c in trainer.callbacks if isinstance(c, ResumeCheckpoint))
    return metrics | {"resumed": float(resume is not None), "resumed_step": resumed.resumed_step}


def _write_json(path: Path, obj) -> None:
    """Write through a temporary name: a kill mid-write must not leave a file a rerun trusts."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _trainer(ctx, p: ReinforceConfig, resuming: bool):
    """The Trainer and its checkpoint callback; every checkpoint lives in the work dir."""
    val_every = min(p.val_every, p.max_steps)
    ckpt, callbacks = best_and_last(
        ctx.work_dir,
        "val/alpha",
        "max",
        p.early_stop_patience,
        every=ckpt_interval(p.checkpoint_every, p.max_steps),
        val_every=val_every,
    )
    trainer = build_trainer(
        ctx.cfg.trainer,
        max_steps=p.max_steps,
        logger=ctx.log.lightning_logger() or False,
        callbacks=callbacks,
        default_root_dir=str(ctx.work_dir),
        gradient_clip_val=p.grad_clip,
        val_check_interval=val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=1.0,
        # The sanity check scores the starting draft on every prompt (step 0); a resumed run
        # restores that score from its checkpoint instead.
        num_sanity_val_steps=0 if resuming else -1,
        use_distributed_sampler=False,  # each rank draws its own batches (ReinforceData)
    )
    return trainer, ckpt


def _report(ctx, report: dict, table: dict) -> dict:
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
    (ctx.out_dir / "reinforce.json").write_text(json.dumps(report, indent=1))

    import matplotlib.pyplot as plt

    fig = plot_acceptance(
        alpha,
        ylabel="on-line acceptance alpha",
        title=f"draft acceptance on {report['target']}, before/after reinforce",
    )
    fig.savefig(ctx.out_dir / "acceptance.png", dpi=120)
    ctx.log.log_figure(fig, "acceptance.png")
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
    }
    return metrics
