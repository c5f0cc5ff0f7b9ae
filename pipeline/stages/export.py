"""export: pack the quantized model for its runtime, with a manifest, into MLflow.

The model exported is distill's when distill ran, else quantize's; the draft (reinforce's when
reinforce ran, else the FP draft) goes along into ``artifact/draft`` so ``lowbit-run`` can
decode speculatively. Formats: ``ascend`` (msModelSlim ascendv1, what MindIE loads),
``lowbit`` (ascendv1 plus 2/3-bit and exp4 tensors, for ``pipeline.runtime``) and
``compressed-tensors`` (vLLM). Formats a target cannot run are refused when the config is
validated, before any stage computes, and again per layer at export. The artifact is logged to
MLflow and registered as a pyfunc model whose ``predict`` generates text.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.config import model_cfg, parse, positive, quant_cfg
from pipeline.errors import ConfigError, LowbitError
from pipeline.export.artifact import ExportOptions, export_artifact
from pipeline.export.ascend import ExportError
from pipeline.quant.formats import parse_format

NEEDS: tuple[str, ...] = ("quantize",)
USES: tuple[str, ...] = ("bootstrap", "distill", "reinforce")
KEYS = ("model",)  # which draft is exported depends on model.draft.path
DISTRIBUTED = False

log = logging.getLogger("lowbit")


@dataclass(frozen=True)
class ExportConfig:
    format: Literal["ascend", "lowbit", "compressed-tensors"] = "lowbit"
    widen: bool = False
    shard_bytes: int = 2_000_000_000
    float_dtype: Literal["float16", "bfloat16", "float32", "keep"] = "float16"
    w8a8_dynamic: bool = False
    include_draft: bool = True
    log_artifact: bool = True
    register_model: bool = True
    model_name: str | None = None

    def check(self, prefix: str) -> None:
        positive(prefix, shard_bytes=self.shard_bytes)

    def options(self) -> ExportOptions:
        return ExportOptions(
            self.format, self.widen, self.shard_bytes, self.float_dtype, self.w8a8_dynamic
        )


def check_candidates(p: ExportConfig, candidates: list[str]) -> None:
    """Refuse, at config time, quant.candidates the export format cannot hold."""
    from pipeline.export import compressed_tensors
    from pipeline.export.lowbit_format import plan_layer

    if p.format == "lowbit":
        return
    shape = (4096, 4096)  # a typical layer: only the format decides here
    groups = {}
    for i, name in enumerate(candidates):
        fmt = parse_format(name)
        if fmt.kind == "float":
            continue
        try:
            if p.format == "ascend":
                info = plan_layer(f"quant.candidates[{i}]", fmt, shape, "ascend", p.widen)
                if info.type == "W4A16" and info.group_size:
                    groups[info.group_size] = name
            else:
                compressed_tensors.plan_layer(f"quant.candidates[{i}]", name, shape)
        except ExportError as e:
            raise ConfigError("stage.export.format", f"is {p.format!r}, but {e}") from None
    if len(groups) > 1:
        raise ConfigError(
            "stage.export.format",
            f"is 'ascend', but quant.candidates {sorted(groups.values())} use different int4 "
            "group sizes and the ascendv1 description holds one group_size per model",
            "candidates with one int4 group size, or stage.export.format=lowbit",
        )


def validate(cfg) -> None:
    p = parse(cfg.stage.export, ExportConfig, "stage.export")
    model_cfg(cfg)
    check_candidates(p, quant_cfg(cfg).candidates)


def model_dir(ctx) -> Path:
    """distill/model when distill ran, else quantize/model."""
    for stage in ("distill", "quantize"):
        if stage in ctx.inputs and (ctx.inputs[stage] / "model").is_dir():
            return ctx.inputs[stage] / "model"
    raise LowbitError("export found no quantized model: run the quantize stage first")


def draft_dir(ctx) -> Path | None:
    """reinforce/draft when reinforce ran, else the FP draft (None when there is none)."""
    if "reinforce" in ctx.inputs and (ctx.inputs["reinforce"] / "draft").is_dir():
        return ctx.inputs["reinforce"] / "draft"
    return ctx.draft_dir()


def run(ctx) -> dict:
    p = parse(ctx.params, ExportConfig, "stage.export")
    src = model_dir(ctx)
    draft = draft_dir(ctx) if p.include_draft else None
    art = ctx.out_dir / "artifact"
    t0 = time.time()
    labels = {"source": ctx.describe(src)} | ({"draft": ctx.describe(draft)} if draft else {})
    manifest = export_artifact(src, art, p.options(), draft=draft, labels=labels)
    seconds = time.time() - t0
    files = manifest["files"]
    draft_bytes = sum(f["bytes"] for k, f in files.items() if k.startswith("draft/"))
    summary = {
        "format": p.format,
        "source": labels["source"],
        "draft": labels.get("draft"),
        "artifact_bytes": sum(f["bytes"] for f in files.values()) - draft_bytes,
        "draft_bytes": draft_bytes,
        "weights_bytes": manifest["weights_bytes"],
        "fp16_bytes": manifest["fp16_bytes"],
        "layers": {n: d["type"] for n, d in manifest["layers"].items()},
    }
    (ctx.out_dir / "export.json").write_text(json.dumps(summary, indent=1))
    log.info(
        "export: %s artifact %.2f MB (weights %.2f MB vs %.2f MB in fp16) in %s",
        p.format,
        summary["artifact_bytes"] / 1e6,
        manifest["weights_bytes"] / 1e6,
        manifest["fp16_bytes"] / 1e6,
        art,
    )
    if p.log_artifact:
        ctx.log.log_artifact(art)
    if p.register_model and ctx.log.active:
        from pipeline.export.mlflow_model import log_model

        name = p.model_name or f"{ctx.cfg.name}-{p.format}"
        log_model(ctx.log.uri, ctx.log.run_id, art, name)
    return {
        "artifact_bytes": float(summary["artifact_bytes"]),
        "weights_bytes": float(manifest["weights_bytes"]),
        "fp16_bytes": float(manifest["fp16_bytes"]),
        "compression": manifest["fp16_bytes"] / max(manifest["weights_bytes"], 1),
        "quantized_layers": float(len(manifest["layers"])),
        "export_seconds": seconds,
    }
