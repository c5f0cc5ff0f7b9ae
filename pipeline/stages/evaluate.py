"""evaluate: perplexity of every model the run produced, and the draft's acceptance.

All numbers use the same held-out windows (`data.eval_windows` windows of `data.seq_len` tokens
from the test split). Acceptance is the closed form α = mean over positions of Σ_x min(p, q),
the probability that speculative sampling accepts the draft's token there.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch

from pipeline.config import data_cfg, model_cfg, parse, positive
from pipeline.data.text import Corpus
from pipeline.models.hf import load_causal_lm, load_tokenizer, perplexity

NEEDS: tuple[str, ...] = ("bootstrap",)
USES: tuple[str, ...] = ()
KEYS = ("model", "data")
DISTRIBUTED = False

log = logging.getLogger("lowbit")


@dataclass(frozen=True)
class EvaluateConfig:
    batch_size: int = 8
    temperature: float = 1.0
    spec_prompts: int = 4
    spec_new_tokens: int = 32
    gamma: int = 4

    def check(self, prefix: str) -> None:
        positive(prefix, batch_size=self.batch_size, temperature=self.temperature,
                 spec_new_tokens=self.spec_new_tokens, gamma=self.gamma)


def validate(cfg) -> None:
    parse(cfg.stage.evaluate, EvaluateConfig, "stage.evaluate")
    model_cfg(cfg)
    data_cfg(cfg)


@torch.no_grad()
def acceptance(target, draft, windows: torch.Tensor, batch_size: int, temperature: float) -> float:
    """α = mean_t Σ_x min(p_t(x), q_t(x)) on teacher-forced windows. windows: (W, T)"""
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i : i + batch_size]
        p = torch.softmax(target(input_ids=x).logits.float() / temperature, -1)  # (B, T, V)
        q = torch.softmax(draft(input_ids=x).logits.float() / temperature, -1)
        beta = torch.minimum(p, q).sum(-1)  # (B, T)
        total += beta.sum().item()
        count += beta.numel()
    return total / count


def run(ctx) -> dict:
    p = parse(ctx.params, EvaluateConfig, "stage.evaluate")
    target_dir, draft_dir = ctx.target_dir(), ctx.draft_dir()
    tokenizer = load_tokenizer(target_dir)
    corpus = Corpus(data_cfg(ctx.cfg), tokenizer)
    win = corpus.eval_windows()
    allow_bin = ctx.cfg.model.allow_bin
    models = {"target_fp": load_causal_lm(target_dir, allow_bin=allow_bin)}
    if draft_dir is not None:
        models["draft_fp"] = load_causal_lm(draft_dir, allow_bin=allow_bin)
    result: dict = {"ppl": {}, "acceptance": {}, "windows": list(win.shape)}
    for name, model in models.items():
        result["ppl"][name] = perplexity(model, win, p.batch_size)
        log.info("evaluate: %s perplexity %.3f", name, result["ppl"][name])
    if "draft_fp" in models:
        a = acceptance(models["target_fp"], models["draft_fp"], win, p.batch_size, p.temperature)
        result["acceptance"]["draft_fp@target_fp"] = {"mix": a}
    (ctx.out_dir / "eval.json").write_text(json.dumps(result, indent=1))
    metrics = {f"ppl_{k}": v for k, v in result["ppl"].items()}
    for pair, per in result["acceptance"].items():
        metrics.update({f"alpha_{pair}_{s}": v for s, v in per.items()})
    return metrics
