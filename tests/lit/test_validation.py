"""The training stages' validation pieces on tiny tensors: the distill sums against a direct
reference, and the validation loaders that every rank reads whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.lit.distill import HeldoutBatches, window_sums
from pipeline.lit.losses import kl_divergence
from pipeline.lit.reinforce import ScenarioPrompts


def test_window_sums_match_cross_entropy_and_kl():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (3, 7), generator=g)  # (B, T)
    t, s = torch.randn(3, 7, 11, generator=g), torch.randn(3, 7, 11, generator=g)  # (B, T, V)
    per_window = window_sums(t, s, ids)  # (B, 3)
    sums = per_window.sum(0)
    n = 3 * 6  # the last position predicts nothing
    ce = F.cross_entropy(s[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    ce_t = F.cross_entropy(t[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    # The references reduce in float32, in an order that differs between CPUs: float32's tolerance.
    close = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(sums[0] / n, ce.double(), **close)
    torch.testing.assert_close(sums[1] / n, ce_t.double(), **close)
    torch.testing.assert_close(sums[2] / n, kl_divergence(t[:, :-1], s[:, :-1]).double(), **close)
    assert window_sums(t, t, ids)[:, 2].abs().max() < 1e-6  # a student equal to its teacher: KL 0
    # Each window on its own: the scores the keep decision pairs.
    for b in range(3):
        ce_b = F.cross_entropy(s[b, :-1], ids[b, 1:], reduction="sum")
        torch.testing.assert_close(per_window[b, 0], ce_b.double(), rtol=1e-6, atol=0)


def test_validation_loaders_yield_every_item_once_in_order():
    windows = torch.arange(70).view(7, 10)
    assert torch.equal(torch.cat(list(HeldoutBatches(windows, 3))), windows)
    prompts = {"long": torch.zeros(3, 8), "mix": torch.ones(5, 4)}
    batches = list(ScenarioPrompts(prompts, 2))
    assert [(name, len(b)) for name, b in batches] == [
        ("long", 2),
        ("long", 1),
        ("mix", 2),
        ("mix", 2),
        ("mix", 1),
    ]
