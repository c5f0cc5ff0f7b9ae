"""The sensitivity report (``sensitivity.json``): ΔL per layer and format, input outliers;
the estimators build its fields as a dict, readers get this type."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline import handoff


@dataclass(frozen=True)
class LayerScore:
    """One scored tensor; ``outliers``: its input's MAD outlier share, kurtosis, max/median."""

    name: str
    shape: tuple[int, int]
    params: int
    weight_kurtosis: float
    dloss: dict[str, float]  # {format name: predicted loss increase}
    outliers: dict[str, float | None]
    outlier_columns: list[int] | None = None  # quant.outliers=keep_fp16 only
    dloss_keep: dict[str, float] | None = None  # ΔL with outlier_columns kept in fp16
    estimators: dict[str, dict[str, float]] | None = None  # importance=combined: each ΔL

    @property
    def outlier_share(self) -> float | None:
        return self.outliers.get("share")

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

    def by_name(self) -> dict[str, LayerScore]:
        return {layer.name: layer for layer in self.layers}

    @property
    def importance_weights(self) -> dict[str, float] | None:
        return None if self.importance is None else self.importance["weights"]

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
