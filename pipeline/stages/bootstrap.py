"""bootstrap: the embedded default models, trained here because nothing can be downloaded.

A byte-level BPE tokenizer, a small Llama target and a smaller Llama draft are trained on the
configured corpus; skipped when `model.target.path` is set. Each model checkpoints into its work
dir every `checkpoint_every` steps, so a rerun after a kill trains only what was not done and
matches an uninterrupted run byte for byte (`pipeline.lit.resume`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pipeline.config import RunConfig, positive, to_plain
from pipeline.data.heldout import heldout
from pipeline.data.text import Corpus
from pipeline.hardware import resolve_precision
from pipeline.lit.lm import CausalLM, WindowData
from pipeline.lit.resume import CKPT_DIR, ResumeCheckpoint, ckpt_interval, resume_from
from pipeline.lit.trainer import (
    Owned,
    build_trainer,
    refuse_owned,
    trainer_kwargs,
    training_owned,
)
from pipeline.models.hf import new_llama, perplexity, save_hf, train_tokenizer
from pipeline.stages import Stage, StageIO

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BootstrapConfig:
    """Train the embedded default models (tokenizer, target, draft) on the corpus."""

    max_steps: int = 1500  # target: 3.1 M tokens, about one pass over the built-in corpus
    draft_max_steps: int = 600
    batch_size: int = 16
    lr: float = 1e-2
    warmup_steps: int = 50
    # auto: bf16-mixed where native, else 32-true (pipeline.hardware); null: trainer.precision.
    precision: str | None = "auto"
    # Steps between resume checkpoints (work dir, each model); null: a tenth of its steps.
    checkpoint_every: int | None = None

    RENAMED = {"ckpt_every": "checkpoint_every"}  # old key names, accepted for one release

    def check(self, prefix: str) -> None:
        positive(
            prefix,
            max_steps=self.max_steps,
            draft_max_steps=self.draft_max_steps,
            batch_size=self.batch_size,
            lr=self.lr,
            checkpoint_every=self.checkpoint_every,
        )


def skip_reason(cfg: BootstrapConfig, run: RunConfig) -> str | None:
    if run.model.target.path:
        return f"model.target.path={run.model.target.path} is used"
    return None


# The Trainer arguments bootstrap sets itself, and what a user sets instead of trainer.<key>.
OWNED = training_owned("bootstrap") | {
    "max_steps": "set stage.bootstrap.max_steps (target) or draft_max_steps instead"
}


def check(cfg: BootstrapConfig, run: RunConfig) -> None:
    refuse_owned(run.trainer, "bootstrap", OWNED)
    trainer_kwargs(run.trainer)


def _trainer_cfg(cfg: BootstrapConfig, run: RunConfig, tag: str) -> dict:
    """The trainer group, with stage.bootstrap.precision (when set) for trainer.precision."""
    trainer = dict(to_plain(run.trainer) or {})
    if not cfg.precision:
        return trainer
    precision = resolve_precision(
        cfg.precision, trainer.get("accelerator"), "stage.bootstrap.precision"
    )
    if precision != trainer.get("precision"):
        log.info(
            "bootstrap: %s in precision %s (stage.bootstrap.precision), not trainer.precision=%s",
            tag,
            precision,
            trainer.get("precision"),
        )
        trainer["precision"] = precision
    return trainer


def _train(
    io: StageIO, run: RunConfig, model, corpus: Corpus, steps: int, cfg: BootstrapConfig, tag: str
) -> int:
    """Train `model` (resuming from its checkpoint); returns the step it started at."""
    work = io.work_dir / tag
    data = WindowData(corpus.stream("train"), corpus.data.seq_len, cfg.batch_size, run.seed)
    module = CausalLM(model, lr=cfg.lr, warmup=cfg.warmup_steps, max_steps=steps)
    resume = resume_from(work, io.dist)
    checkpoints = ResumeCheckpoint(work / CKPT_DIR, ckpt_interval(cfg.checkpoint_every, steps))
    owned = {
        "max_steps": steps,
        "default_root_dir": str(work),
        # Both models log into the stage's run: target-train_loss, draft-lr-AdamW, ...
        "logger": io.log.lightning_logger(prefix=tag) or False,
        "callbacks": [checkpoints],
        "enable_checkpointing": True,
    }
    trainer = build_trainer(
        _trainer_cfg(cfg, run, tag),
        stage="bootstrap",
        name=f"bootstrap {tag}",
        owned={key: Owned(value, OWNED[key]) for key, value in owned.items()},
        # It does not validate (both models are scored once trained); a user key wins.
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    if resume:
        log.info("bootstrap: %s resumes from %s", tag, resume)
    trainer.fit(module, datamodule=data, ckpt_path=resume, weights_only=True)
    return checkpoints.resumed_step


def run(cfg: BootstrapConfig, run: RunConfig, io: StageIO) -> dict:
    m, data = run.model, run.data
    torch.manual_seed(run.seed)
    from pipeline.data.text import load_splits

    # each step takes seconds to tens of seconds before the first training line: say which
    log.info("bootstrap: reading the corpus (%s)", data.source)
    docs = load_splits(data)
    log.info("bootstrap: training a %d-token BPE tokenizer", m.tokenizer.vocab_size)
    tokenizer = train_tokenizer(docs["train"], m.tokenizer.vocab_size)
    log.info("bootstrap: tokenizing the corpus")
    corpus = Corpus(data, tokenizer, splits=docs)
    log.info(
        "bootstrap: corpus %d train documents, %d tokens; vocab %d",
        len(docs["train"]),
        corpus.stream("train").numel(),
        len(tokenizer),
    )
    io.log.log_input(corpus.stream("train"), "training", data, "train")
    metrics = {}
    trained = {}
    for tag, spec, steps in (
        ("target", m.target, cfg.max_steps),
        ("draft", m.draft, cfg.draft_max_steps),
    ):
        model = new_llama(spec, tokenizer, max_positions=max(2048, data.seq_len), seed=run.seed)
        metrics[f"{tag}_resumed_step"] = _train(io, run, model, corpus, steps, cfg, tag)
        trained[tag] = model
    # Scored once both are trained, so a kill during the draft's training wastes no scoring.
    val = heldout(corpus.stream("validation"), "validation", data.seq_len)
    io.log.log_input(val.windows, "validation", data, "validation")
    for tag, model in trained.items():
        ppl = perplexity(model, val.windows)
        log.info("bootstrap: %s perplexity %.2f (%s)", tag, ppl, val.label())
        metrics[f"{tag}_val_ppl"] = ppl  # validation split, every window: see val_window/val_tokens
        metrics[f"{tag}_params"] = sum(t.numel() for t in model.parameters())
        if io.dist.is_main:
            save_hf(model, tokenizer, io.out_dir / tag)
    metrics.update(val_window=val.window, val_tokens=val.tokens)
    return metrics


STAGE = Stage(
    config=BootstrapConfig,
    run=run,
    sections=("model", "data", "trainer"),
    distributed=True,  # trains with the configured Lightning strategy on every rank
    check=check,
    skip_reason=skip_reason,
)
