"""bootstrap: the embedded default models, trained here because nothing can be downloaded.

A byte-level BPE tokenizer, a small Llama target and a smaller Llama draft are trained on the
configured corpus (the built-in one by default) with Lightning. Skipped when the user points
`model.target.path` at a real checkpoint.

Resume: each model checkpoints into `<work dir>/<target|draft>/checkpoints/last.ckpt` every
`ckpt_every` steps (null: a tenth of its steps) and at its last step, so a rerun after a kill
trains only what was not done: a finished target is restored, not retrained, and a model killed
mid-way continues from its last checkpoint with the batches and random streams of an
uninterrupted run (`pipeline.lit.resume`), which it matches byte for byte. The tokenizer is
retrained (a second; BPE training is deterministic).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pipeline.config import data_cfg, model_cfg, parse, positive
from pipeline.data.heldout import heldout
from pipeline.data.text import Corpus
from pipeline.lit.lm import CausalLM, WindowData
from pipeline.lit.resume import CKPT_DIR, ResumeCheckpoint, ckpt_interval, resume_from
from pipeline.lit.trainer import build_trainer, trainer_kwargs
from pipeline.models.hf import new_llama, perplexity, save_hf, train_tokenizer

NEEDS: tuple[str, ...] = ()
KEYS = ("model", "data", "trainer")
DISTRIBUTED = True  # trains with the configured Lightning strategy on every rank

log = logging.getLogger("lowbit")


@dataclass(frozen=True)
class BootstrapConfig:
    max_steps: int = 1500
    draft_max_steps: int = 600
    batch_size: int = 16
    lr: float = 1e-2
    warmup_steps: int = 50
    # bf16 autocast: 1.7x the fp32 tokens/s on a CPU with AVX512-BF16, so more steps fit the budget
    precision: str | None = "bf16-mixed"
    ckpt_every: int | None = None  # steps between resume checkpoints; None: a tenth of each run

    def check(self, prefix: str) -> None:
        positive(
            prefix,
            max_steps=self.max_steps,
            draft_max_steps=self.draft_max_steps,
            batch_size=self.batch_size,
            lr=self.lr,
            ckpt_every=self.ckpt_every,
        )


def skip_reason(cfg) -> str | None:
    if cfg.model.target.path:
        return f"model.target.path={cfg.model.target.path} is used"
    return None


def validate(cfg) -> None:
    parse(cfg.stage.bootstrap, BootstrapConfig, "stage.bootstrap")
    model_cfg(cfg)
    data_cfg(cfg)
    trainer_kwargs(cfg.trainer)


def _train(ctx, model, corpus: Corpus, steps: int, p: BootstrapConfig, tag: str) -> int:
    """Train `model` (resuming from its checkpoint); returns the step it started at."""
    work = ctx.work_dir / tag
    data = WindowData(corpus.stream("train"), corpus.data.seq_len, p.batch_size, ctx.cfg.seed)
    module = CausalLM(model, lr=p.lr, warmup=p.warmup_steps, max_steps=steps)
    resume = resume_from(work, ctx.dist)
    checkpoints = ResumeCheckpoint(work / CKPT_DIR, ckpt_interval(p.ckpt_every, steps))
    logger = ctx.log.lightning_logger()
    if logger is not None:
        logger._prefix = tag  # metrics appear as target-train_loss / draft-train_loss
    precision = {"precision": p.precision} if p.precision else {}
    trainer = build_trainer(
        ctx.cfg.trainer,
        **precision,
        max_steps=steps,
        logger=logger or False,
        callbacks=[checkpoints],
        default_root_dir=str(work),
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    if resume:
        log.info("bootstrap: %s resumes from %s", tag, resume)
    trainer.fit(module, datamodule=data, ckpt_path=resume, weights_only=True)
    return checkpoints.resumed_step


def run(ctx) -> dict:
    p = parse(ctx.params, BootstrapConfig, "stage.bootstrap")
    m, data = model_cfg(ctx.cfg), data_cfg(ctx.cfg)
    torch.manual_seed(ctx.cfg.seed)
    from pipeline.data.text import load_splits

    docs = load_splits(data)
    tokenizer = train_tokenizer(docs["train"], m.tokenizer.vocab_size)
    corpus = Corpus(data, tokenizer, splits=docs)
    log.info(
        "bootstrap: corpus %d train documents, %d tokens; vocab %d",
        len(docs["train"]),
        corpus.stream("train").numel(),
        len(tokenizer),
    )
    metrics = {}
    trained = {}
    for tag, spec, steps in (
        ("target", m.target, p.max_steps),
        ("draft", m.draft, p.draft_max_steps),
    ):
        model = new_llama(spec, tokenizer, max_positions=max(2048, data.seq_len), seed=ctx.cfg.seed)
        metrics[f"{tag}_resumed_step"] = _train(ctx, model, corpus, steps, p, tag)
        trained[tag] = model
    # Scored once both are trained, so a kill during the draft's training wastes no scoring.
    val = heldout(corpus.stream("validation"), "validation", data.seq_len)
    for tag, model in trained.items():
        ppl = perplexity(model, val.windows)
        log.info("bootstrap: %s perplexity %.2f (%s)", tag, ppl, val.label())
        metrics[f"{tag}_val_ppl"] = ppl  # validation split, every window: see val_window/val_tokens
        metrics[f"{tag}_params"] = sum(t.numel() for t in model.parameters())
        if ctx.dist.is_main:
            save_hf(model, tokenizer, ctx.out_dir / tag)
    metrics.update(val_window=val.window, val_tokens=val.tokens)
    return metrics
