"""The held-out perplexity protocol: a whole split, in non-overlapping windows, labelled.

Quantization papers and tools (GPTQ, llm-compressor, lm-evaluation-harness) report WikiText-2
perplexity the same way: the whole test split is tokenised as one stream, cut into
non-overlapping windows of the model's context (2048 for most), and every position of every
window but the first is scored. lowbit does the same, for every stage that reports a held-out
perplexity, and says which split, window and token count each number is on, so numbers from
different stages (validation during training, test in evaluate) are never confused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.data.text import Corpus, windows

# The context most published perplexities of user models are measured at.
STANDARD_CONTEXT = 2048


@dataclass(frozen=True)
class Heldout:
    """Non-overlapping windows of one split. windows: (W, T)"""

    split: str
    windows: torch.Tensor

    @property
    def window(self) -> int:
        return int(self.windows.shape[1])

    @property
    def tokens(self) -> int:
        """Positions scored: every window's first token has no context and is not scored."""
        return int(self.windows.shape[0] * (self.windows.shape[1] - 1))

    def describe(self) -> dict:
        return {
            "split": self.split,
            "window": self.window,
            "windows": int(self.windows.shape[0]),
            "tokens": self.tokens,
        }

    def label(self) -> str:
        return (
            f"{self.split} split, {self.windows.shape[0]} windows x {self.window}, "
            f"{self.tokens:,} tokens"
        )


def eval_seq_len(configured: int | None, train_seq_len: int, user_model_context: int | None) -> int:
    """The perplexity window: as configured, else the model's context up to 2048 for a user's
    model (`user_model_context`), else the bootstrap models' training length."""
    if configured is not None:
        return configured
    if user_model_context is not None:
        return min(user_model_context, STANDARD_CONTEXT)
    return train_seq_len


def heldout(stream: torch.Tensor, split: str, seq_len: int, limit: int | None = None) -> Heldout:
    """The split's token stream in non-overlapping windows (all of them unless `limit`)."""
    return Heldout(split, windows(stream, seq_len, limit))


def corpus_heldout(corpus: Corpus, split: str = "test", user_context: int | None = None) -> Heldout:
    """The configured protocol on one split of `corpus`: `data.eval_seq_len` windows (resolved as
    in `eval_seq_len`), all of them unless `data.eval_windows` caps the count."""
    data = corpus.data
    seq_len = eval_seq_len(data.eval_seq_len, data.seq_len, user_context)
    return heldout(corpus.stream(split), split, seq_len, data.eval_windows)
