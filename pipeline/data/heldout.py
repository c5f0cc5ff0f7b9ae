"""The held-out perplexity protocol (as GPTQ, lm-evaluation-harness): a whole split as one
stream, non-overlapping windows, each window's first position unscored; every number labelled."""

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
    """As configured, else a user's model context up to 2048, else the bootstrap training length."""
    if configured is not None:
        return configured
    if user_model_context is not None:
        return min(user_model_context, STANDARD_CONTEXT)
    return train_seq_len


def heldout(stream: torch.Tensor, split: str, seq_len: int, limit: int | None = None) -> Heldout:
    """The split's token stream in non-overlapping windows (all of them unless `limit`)."""
    return Heldout(split, windows(stream, seq_len, limit))


def corpus_heldout(corpus: Corpus, split: str = "test", user_context: int | None = None) -> Heldout:
    """The configured protocol (`data.eval_seq_len`, `data.eval_windows`) on one split."""
    data = corpus.data
    seq_len = eval_seq_len(data.eval_seq_len, data.seq_len, user_context)
    return heldout(corpus.stream(split), split, seq_len, data.eval_windows)
