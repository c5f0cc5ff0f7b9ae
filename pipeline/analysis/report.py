"""The sensitivity report (``sensitivity.json``): ΔL per layer and format, input outliers;
the estimators build its fields as a dict, readers get this type."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline import handoff


@dataclass(frozen=True)
class LayerScore:
    """One scored tensor; ``outliers``: its input's MAD outlier share, kurtosis, max/median,
    the relative error of int8 activations per 32 columns and the flagged channels."""

    name: str
    shape: tuple[int, int]
    params: int
    weight_kurtosis: float
    dloss: dict[str, float]  # {format name: predicted loss increase}
    outliers: dict[str, Any]
    outlier_columns: list[int] | None = None  # quant.outliers=keep_fp16 only
    dloss_keep: dict[str, float] | None = None  # ΔL with outlier_columns kept in fp16
    estimators: dict[str, dict[str, float]] | None = None  # importance=combined: each ΔL

    @property
    def outlier_share(self) -> float | None:
        return self.outliers.get("share")

    @property
    def act8_error(self) -> float | None:
        """||x̂ − x|| / ||x|| of this input as int8 per 32 columns (None: not measured)."""
        return self.outliers.get("act8_error")

    @property
    def act_columns(self) -> list[int]:
        """The input's MAD outlier channels, largest first (empty in reports that predate them)."""
        return list(self.outliers.get("columns") or ())

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["shape"] = list(self.shape)
        return {k: v for k, v in out.items() if v is not None or k not in _OPTIONAL}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerScore:
        return cls(**{**data, "shape": tuple(data["shape"])})


_OPTIONAL = {"outlier_columns", "dloss_keep", "estimators"}


@dataclass(frozen=True)
class SensitivityReport(handoff.HandOff):
    """Every scored layer of the target, in model order, and how the scores were estimated."""

    FILENAME: ClassVar[str] = "sensitivity.json"
    SCHEMA: ClassVar[str] = "lowbit.sensitivity"
    VERSION: ClassVar[int] = 1
    WRITER: ClassVar[str] = "sensitivity"

    method: str  # fisher | hutchinson | gptq_proxy | combined
    weighting: str | None
    fisher_labels: str | None
    candidates: list[str]
    samples: int
    seq_len: int
    tied_embeddings: bool
    fused_groups: list[list[str]]
    layers: tuple[LayerScore, ...]
    streamed: bool | None = None
    importance: dict[str, Any] | None = None  # combined: fitted weights, fit layers, KL, ρ
    outliers: str | None = None  # quant.outliers and outlier_cap when columns were scored
    outlier_cap: float | None = None
    delta: str | None = None  # whose error ΔL weighs: rtn | gptq (RTN's, scaled); None: rtn

    def by_name(self) -> dict[str, LayerScore]:
        return {layer.name: layer for layer in self.layers}

    @property
    def importance_weights(self) -> dict[str, float] | None:
        return None if self.importance is None else self.importance["weights"]

    def measured_activations(self) -> bool:
        """Whether the report holds activation errors and outlier channels (newer reports)."""
        return any(la.act8_error is not None for la in self.layers)

    def activation_plan(self, cap: float, threshold: float | None) -> dict[str, dict[str, Any]]:
        """{linear: its ``LayerInfo`` activation fields}: the first ``cap`` of its inputs'
        outlier channels stay float (``act_columns``); with ``threshold``, a layer whose int8
        activation error exceeds it runs float activations (``a16``)."""
        plan = {}
        for la in self.layers:
            if la.act8_error is None:
                continue
            cols = la.act_columns[: int(cap * la.shape[1] + 1e-9)]
            a16 = threshold is not None and la.act8_error > threshold
            if cols or a16:
                plan[la.name] = {"act_columns": () if a16 else tuple(sorted(cols)), "a16": a16}
        return plan

    def replace(self, **changes: Any) -> SensitivityReport:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["layers"] = [layer.to_dict() for layer in self.layers]
        return {k: v for k, v in out.items() if v is not None or k in _REQUIRED}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SensitivityReport:
        layers = tuple(LayerScore.from_dict(la) for la in data["layers"])
        return cls(**{**data, "layers": layers})


_REQUIRED = {
    f.name for f in dataclasses.fields(SensitivityReport) if f.default is dataclasses.MISSING
}
