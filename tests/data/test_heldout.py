"""The held-out perplexity protocol: whole split, non-overlapping windows, labelled."""

from __future__ import annotations

import torch

from pipeline.data.heldout import STANDARD_CONTEXT, eval_seq_len, heldout


def test_window_is_configured_else_user_context_capped_else_training_length():
    assert eval_seq_len(512, 128, 4096) == 512
    assert eval_seq_len(None, 128, 4096) == STANDARD_CONTEXT  # a 4k-context user model: 2048
    assert eval_seq_len(None, 128, 1024) == 1024  # a short-context user model: its own context
    assert eval_seq_len(None, 128, None) == 128  # the bootstrap models: their training length


def test_the_whole_split_is_scored_in_non_overlapping_windows():
    stream = torch.arange(1000)
    h = heldout(stream, "test", 64)
    assert h.windows.shape == (15, 64)  # 1000 // 64 windows, the 40-token tail dropped
    assert torch.equal(h.windows.flatten(), stream[: 15 * 64])  # contiguous, no overlap, no gap
    assert h.tokens == 15 * 63  # each window's first token has no context
    assert h.describe() == {"split": "test", "window": 64, "windows": 15, "tokens": 945}
    assert "test split" in h.label() and "945 tokens" in h.label()


def test_a_cap_spreads_its_windows_over_the_split_and_says_so():
    h = heldout(torch.arange(1000), "validation", 100, limit=3)
    assert h.describe() == {"split": "validation", "window": 100, "windows": 3, "tokens": 297}
    # windows 0, 3 and 6 of the ten: from the whole split, not its first three hundred tokens
    assert h.windows[:, 0].tolist() == [0, 300, 600]
    assert torch.equal(h.windows[1], torch.arange(300, 400))  # each one still contiguous
