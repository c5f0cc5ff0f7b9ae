"""Write an artifact directory: the draft first, then the model, manifest.json last.

The stage writes into its temp folder, which the workflow renames into place, so a
half-written artifact is never visible.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.artifact.ascend import ExportError
from pipeline.artifact.manifest import write_manifest
from pipeline.export.ascendv1 import write_ascendv1
from pipeline.export.compressed_tensors import write_compressed_tensors
from pipeline.export.options import FORMATS, ExportOptions
from pipeline.export.source import Source

if TYPE_CHECKING:
    import torch


def export_artifact(
    src: Path | str,
    out: Path | str,
    opts: ExportOptions,
    draft: Path | str | None = None,
    labels: dict[str, str] | None = None,
    device: torch.device | str = "cpu",
) -> dict:
    """Export the model directory ``src`` (quantized or FP) to the new directory ``out``, the
    optional ``draft`` into ``out/draft``; return the manifest written.

    ``labels`` ("source", "draft") name them in the manifest (default: the resolved paths);
    tensors are unpacked and packed on ``device``, one at a time, and written from the host.
    """
    if opts.format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {opts.format!r}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; export into a new directory")
    out.mkdir(parents=True, exist_ok=True)
    source = Source.open(src, device)
    draft_info = None
    if draft is not None:  # first: it is small, and a refusal then costs little
        # Exported as it is (FP: FLOAT tensors). It serves lowbit-run only, so the ascend
        # target writes it in the lowbit layout, which also holds a 2/3-bit or exp4 draft.
        # The target's activation plan names the target's layers, not the draft's.
        d_opts = replace(
            opts, format="lowbit" if opts.format == "ascend" else opts.format, act=None
        )
        try:
            d_labels = {"source": labels["draft"]} if labels and "draft" in labels else None
            d_manifest = export_artifact(
                draft, out / "draft", d_opts, labels=d_labels, device=device
            )
        except ExportError as e:
            raise ExportError(
                f"the draft {draft}: {e} (or leave the draft out: stage.export.include_draft=false)"
            ) from None
        draft_info = {"path": "draft", "source": d_manifest["source"]}
    writer = write_compressed_tensors if opts.format == "compressed-tensors" else write_ascendv1
    info = writer(source, out, opts)
    label = (labels or {}).get("source") or str(Path(src).resolve())
    info["source"] = {"path": label, "method": source.method}
    info["draft"] = draft_info
    return write_manifest(out, info)
