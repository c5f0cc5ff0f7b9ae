"""The quant report (``quant_report.json``): what quantization did to each linear.

It holds only what the weights determine (no times), so a resumed or forced rerun leaves its
digest, and every reader's fingerprint, unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline import handoff

RUN_FACTS = ("seconds", "resumed_segments")  # vary from run to run with the same result


@dataclass(frozen=True)
class QuantLayer:
    format: str
    shape: tuple[int, int]
    gptq_loss: float
    rel_output_error: float  # ‖(W − Q)X‖ / ‖WX‖ on the calibration inputs
    kept_columns: int = 0
    # Error feedback's first pass (quant.feedback): the planned format and its error.
    format_before: str | None = None
    rel_output_error_before: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {**dataclasses.asdict(self), "shape": list(self.shape)}
        if not self.kept_columns:
            del out["kept_columns"]
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantLayer:
        kw = {k: v for k, v in data.items() if k not in RUN_FACTS}
        return cls(**{**kw, "shape": tuple(data["shape"])})


@dataclass(frozen=True)
class QuantReport(handoff.HandOff):
    FILENAME: ClassVar[str] = "quant_report.json"
    SCHEMA: ClassVar[str] = "lowbit.quant_report"
    VERSION: ClassVar[int] = 1
    WRITER: ClassVar[str] = "quantize"

    method: str
    segments: int
    world_size: int
    calib_samples: int
    calib_seq_len: int
    quantized_layers: int
    avg_bits: float
    mean_rel_output_error: float
    max_rel_output_error: float
    layers: dict[str, QuantLayer]
    feedback_bits: int | None = None  # bits error feedback added over the plan

    @property
    def rel_output_error(self) -> dict[str, float]:
        """``{linear name: relative output error}``."""
        return {n: r.rel_output_error for n, r in self.layers.items()}

    @property
    def moved(self) -> dict[str, tuple[str, str]]:
        """``{linear: (planned format, final format)}`` of the layers error feedback moved."""
        return {
            n: (r.format_before, r.format)
            for n, r in self.layers.items()
            if r.format_before is not None and r.format_before != r.format
        }

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["layers"] = {n: r.to_dict() for n, r in self.layers.items()}
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantReport:
        """From the file, or from ``quantize_checkpoint``'s summary (its run facts dropped)."""
        kw = {k: v for k, v in data.items() if k not in RUN_FACTS}
        return cls(
            **{**kw, "layers": {n: QuantLayer.from_dict(r) for n, r in kw["layers"].items()}}
        )
