"""Perplexity of every model on one held-out protocol (pipeline/data/heldout.py)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import nn

from pipeline.data.heldout import Heldout
from pipeline.models.hf import perplexity

log = logging.getLogger(__name__)


def perplexities(
    models: Mapping[str, nn.Module], test: Heldout, batch_size: int
) -> dict[str, float]:
    """``{name: perplexity}`` of each model on every window of ``test``; each model is looked
    up where it is used, so a ModelShelf that loads them one at a time can free the last."""
    log.info("evaluate: perplexity on the %s", test.label())
    out = {}
    for name in models:
        out[name] = perplexity(models[name], test.windows, batch_size)
        log.info("evaluate: %-18s perplexity %.3f (%s)", name, out[name], test.label())
    return out
