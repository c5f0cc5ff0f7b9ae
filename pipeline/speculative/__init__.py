"""Speculative decoding: draft/verify loop, acceptance statistics, rewards for the draft."""

from pipeline.speculative.adaptive import AdaptiveGamma
from pipeline.speculative.cost import measure_cost_ratio
from pipeline.speculative.decoding import plain_generate, speculative_generate
from pipeline.speculative.metrics import (
    expected_acceptance,
    teacher_forced_acceptance,
    theoretical_speedup,
    theoretical_tau,
    tvd,
)
from pipeline.speculative.monitor import AcceptanceMonitor
from pipeline.speculative.pipelined import pipelined_generate
from pipeline.speculative.rollout import Rollout, draft_rollout
from pipeline.speculative.sampling import Verification, logits_to_probs, sample_tokens, verify_draft
from pipeline.speculative.schedule import draft_temperature
from pipeline.speculative.stats import SpecStats

__all__ = [
    "AcceptanceMonitor",
    "AdaptiveGamma",
    "Rollout",
    "SpecStats",
    "Verification",
    "draft_rollout",
    "draft_temperature",
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
