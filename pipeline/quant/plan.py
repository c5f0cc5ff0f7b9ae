"""The bit plan (``bitplan.json``): one format per layer, what allocate hands to quantize.

Formats are ``Format`` objects in memory and their names on disk, parsed once when loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline import handoff
from pipeline.quant.formats import Format, parse_format


@dataclass(frozen=True)
class Recipe:
    """What a plan is asked for: the quant section's candidates (parsed) and limits."""

    formats: tuple[Format, ...]
    budget_bits: float | None = None
    float_fallback: int = 0
    keep_float: tuple[str, ...] = ()
    keep_columns: bool = False  # quant.outliers=keep_fp16
    slack_bits: float = 0.0  # held back for error feedback: the plan is made at budget - slack

    @property
    def plan_bits(self) -> float | None:
        """The average the allocator plans for: the budget less the feedback slack."""
        return None if self.budget_bits is None else self.budget_bits - self.slack_bits


@dataclass(frozen=True)
class BitPlan(handoff.HandOff):
    """Every planned layer's format (``float``: not quantized) and what the plan costs."""

    FILENAME: ClassVar[str] = "bitplan.json"
    SCHEMA: ClassVar[str] = "lowbit.bitplan"
    VERSION: ClassVar[int] = 1
    WRITER: ClassVar[str] = "allocate"

    layers: dict[str, Format]
    budget_bits: float | None
    avg_bits: float
    total_bytes: int
    predicted_dloss: float | None
    fused_groups: list[list[str]]
    candidates: tuple[Format, ...]
    quantized_params: int
    quantized_bytes: int
    keep_float: list[str]
    fallback: list[str]
    exact: bool
    outlier_columns: dict[str, list[int]] | None = None  # keep_fp16 only
    kept_bytes: int | None = None
    score: str | None = None  # the sensitivity estimator whose ΔL the plan minimised
    importance_weights: dict[str, float] | None = None
    feedback_bits: int | None = None  # bits left under the budget for error feedback to spend

    def quantized(self) -> dict[str, Format]:
        """``{layer: format}`` of the layers that are quantized (float ones dropped)."""
        return {n: f for n, f in self.layers.items() if f.kind != "float"}

    def kept(self) -> dict[str, list[int]]:
        """``{layer: kept input columns}``; empty when the plan keeps none."""
        return dict(self.outlier_columns or {})

    def replace(self, **changes: Any) -> BitPlan:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["layers"] = {n: f.name for n, f in self.layers.items()}
        out["candidates"] = [f.name for f in self.candidates]
        return {k: v for k, v in out.items() if v is not None or k in _REQUIRED}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BitPlan:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in data.items() if k in names}
        kw["layers"] = {n: parse_format(f) for n, f in data["layers"].items()}
        kw["candidates"] = tuple(parse_format(f) for f in data["candidates"])
        return cls(**kw)


_REQUIRED = {f.name for f in dataclasses.fields(BitPlan) if f.default is dataclasses.MISSING}
