"""reinforce: train the draft for acceptance against the target it will serve.

The draft (`model.draft.path` or the bootstrap draft) trains on-policy on the acceptance
scenarios against the run's final target (`pipeline.lit.reinforce`) for the decoding it will
serve (`serve_temperature`, stage.evaluate.temperature's by default: greedy at 0, sampled at T);
the checkpoint best on the validation split in that mode (greedy match at 0, teacher-forced
alpha(T) otherwise) is kept when its gain holds beyond the noise of the prompts
(`pipeline.lit.keep`), else the starting draft. `cost_ratio` set: reproducible
bit for bit; null: measured once, kept for a resume. Without a draft the target drafts for
itself and the stage is skipped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline import runmodels
from pipeline.config import ModelConfig, RunConfig, positive
from pipeline.data.scenarios import SCENARIOS
from pipeline.data.text import load_splits
from pipeline.errors import ConfigError
from pipeline.evaluation.acceptance import heldout_scenarios
from pipeline.lit import reinforce_report as rr
from pipeline.lit.config import RENAMED
from pipeline.lit.fit import Selection, check_fit_trainer, fit_validated
from pipeline.lit.reinforce import (
    DraftReinforce,
    ReinforceData,
    ReinforceHParams,
    load_draft,
    result_draft,
    save_draft,
)
from pipeline.models.hf import load_causal_lm, load_tokenizer
from pipeline.models.quantized import is_quantized_dir, load_model
from pipeline.stages import Stage, StageIO

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReinforceConfig(ReinforceHParams):
    """`stage.reinforce`: the training's settings (ReinforceHParams) and the stage's own."""

    scenarios: list[str] = field(default_factory=lambda: list(SCENARIOS))
    train_prompts: int = 64  # prompts per scenario from the train split
    eval_prompts: int = 8  # held-out prompts per scenario (test split): the before/after
    prompt_len: int = 128
    long_len: int = 576  # > 512: the long-context scenario
    eval_new_tokens: int = 32  # tokens generated per held-out prompt for measured acceptance
    long_new_tokens: int | None = None  # per held-out long prompt; null: eval_new_tokens
    val_prompts: int = 32  # per scenario, validation split: the checkpoint selection

    RENAMED = RENAMED | {
        "temperature": "serve_temperature",
        "checkpoint_every": "train.checkpoint_every",
        "grad_clip": "train.grad_clip",
        "quant_grad_scale": "train.quant_grad_scale",
    }
    # One setting drives both: the draft trains for the decoding evaluate measures.
    LINKED = {"serve_temperature": "stage.evaluate.temperature"}

    def check(self, prefix: str) -> None:
        super().check(prefix)
        positive(prefix, train_prompts=self.train_prompts, eval_prompts=self.eval_prompts)
        positive(prefix, eval_new_tokens=self.eval_new_tokens, val_prompts=self.val_prompts)
        positive(prefix, long_new_tokens=self.long_new_tokens)
        bad = [s for s in self.scenarios if s not in SCENARIOS] or (not self.scenarios and ["[]"])
        if bad:
            raise ConfigError(
                f"{prefix}.scenarios", f"contains {bad}", f"a non-empty list from {list(SCENARIOS)}"
            )
        if self.prompt_len < 2 or self.long_len < 2:
            raise ConfigError(f"{prefix}.prompt_len", "and long_len must be >= 2")


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
    allow_bin, seed, grad_scale = run.model.allow_bin, run.seed, cfg.train.quant_grad_scale
    torch.manual_seed(seed)
    target_name, target_dir = _target(run.model, io.inputs)
    draft_dir = runmodels.fp_draft(run.model, io.inputs)
    tokenizer = load_tokenizer(runmodels.fp_target(run.model, io.inputs))
    docs = load_splits(run.data, tokenizer)
    counts = {"train": cfg.train_prompts, "validation": cfg.val_prompts, "test": cfg.eval_prompts}
    sets = {s: _scenarios(cfg, seed, io, tokenizer, docs[s], s, n) for s, n in counts.items()}
    # The target only scores: it loads as the user asked; the draft keeps fp32 master weights.
    target = load_model(target_dir, allow_bin, device=io.device, **run.model.load_options("target"))
    target.requires_grad_(False)
    draft = load_draft(draft_dir, allow_bin, grad_scale).to(io.device)
    start = "draft_quantized" if is_quantized_dir(draft_dir) else "draft_fp"
    log.info("reinforce: %s (%s) against %s (%s)", start, draft_dir, target_name, target_dir)
    table = rr.before(cfg, seed, io, target_name, target, {start: draft.eval()}, sets["test"])
    module = DraftReinforce(draft, target, cfg, seed)
    tensors = {s: {k: torch.tensor(v) for k, v in sets[s].items()} for s in ("train", "validation")}
    for split, context in (("train", "training"), ("validation", "validation")):
        for scenario, prompts in tensors[split].items():  # (n, prompt tokens) per scenario
            io.log.log_input(prompts, context, run.data, f"{split}/{scenario}")
    data = ReinforceData(tensors["train"], tensors["validation"], cfg.train.batch, seed)
    fit = fit_validated(
        "reinforce",
        module,
        data,
        cfg.train,
        trainer_cfg=run.trainer,
        work_dir=io.work_dir,
        dist=io.dist,
        logger=io.log.lightning_logger() or False,
        select=Selection(
            f"val/{cfg.selection_key}",
            cfg.selection_key,
            larger_is_better=True,
            keep=cfg.keep,
            seed=seed,
            windows_key="val_prompts",
        ),
        use_distributed_sampler=False,  # each rank draws its own batches (ReinforceData)
    )
    if not io.dist.is_main:
        return {}

    device = io.device  # not the module's: Lightning may have moved it back to the CPU
    target.to(device)
    draft = result_draft(fit, draft_dir, allow_bin, grad_scale, cfg.selection_key)
    draft = draft.to(device).eval()
    pairs = {"before": f"{start}@{target_name}", "after": f"{rr.AFTER}@{target_name}"}
    if fit.kept:
        table[pairs["after"]] = table[pairs["before"]]
    else:
        table |= rr.measure(cfg, seed, target_name, target, {rr.AFTER: draft}, sets["test"])
    if target_name != "target_fp":  # the goal: at least the FP draft's acceptance on the FP target
        fp_dir = runmodels.fp_target(run.model, io.inputs)
        options = run.model.load_options("target")
        fp_target = load_causal_lm(fp_dir, allow_bin=allow_bin, device=device, **options)
        fp_draft = {start: load_model(draft_dir, allow_bin, device=device)}
        table |= rr.measure(cfg, seed, "target_fp", fp_target, fp_draft, sets["test"])
        pairs["reference"] = f"{start}@target_fp"
    save_draft(draft, draft_dir, io.out_dir / "draft", fit.kept, tokenizer)
    report = {
        "target": target_name,
        "target_dir": io.describe(target_dir),
        "draft_dir": io.describe(draft_dir),
        "draft_quantized": start == "draft_quantized",
        **rr.summary(cfg, fit, module, sets),
        "pairs": pairs,
    }
    return rr.write(io, report, table) | fit.resume_metrics()


def _target(model: ModelConfig, inputs: dict[str, Path]) -> tuple[str, Path]:
    """(name, directory) of the target to reinforce against: the run's final target."""
    return list(runmodels.targets(model, inputs).items())[-1]


def _scenarios(cfg: ReinforceConfig, seed: int, io, tokenizer, docs, split: str, n: int) -> dict:
    """Prompt sets of one split, built on rank 0 and cached in the work dir for the others."""

    def build():
        sets = heldout_scenarios(
            tokenizer,
            docs,
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


STAGE = Stage(
    config=ReinforceConfig,
    run=run,
    needs=("bootstrap",),
    uses=("quantize", "distill"),
    sections=("model", "data", "trainer"),
    distributed=True,  # trains with the configured Lightning strategy on every rank
    check=check,
    skip_reason=skip_reason,
)
