"""Speculative decoding: draft/verify loop, acceptance statistics, rewards for the draft."""

from pipeline.spec.adaptive import AdaptiveGamma
from pipeline.spec.cost import measure_cost_ratio
from pipeline.spec.decoding import plain_generate, speculative_generate
from pipeline.spec.metrics import (
    expected_acceptance,
    teacher_forced_acceptance,
    theoretical_speedup,
    theoretical_tau,
    tvd,
)
from pipeline.spec.pipelined import pipelined_generate
from pipeline.spec.rollout import Rollout, draft_rollout
from pipeline.spec.sampling import Verification, logits_to_probs, sample_tokens, verify_draft
from pipeline.spec.stats import SpecStats

__all__ = [
    "AdaptiveGamma",
    "Rollout",
    "SpecStats",
    "Verification",
    "draft_rollout",
    "expected_acceptance",
    "logits_to_probs",
    "measure_cost_ratio",
    "pipelined_generate",
    "plain_generate",
    "sample_tokens",
    "speculative_generate",
    "teacher_forced_acceptance",
    "theoretical_speedup",
    "theoretical_tau",
    "tvd",
    "verify_draft",
]
