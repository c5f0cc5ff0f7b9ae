"""Segment-wise streaming quantization of a checkpoint (the quantize stage's core).

The engine walks the checkpoint segment by segment and each block is quantized in GPTQ's
sequential order on the outputs of the *already quantized* blocks before it, so later layers
compensate earlier rounding; each segment becomes one shard of the quantized model directory.
A killed run resumes after the last committed segment from the same activations (same codes).
With several ranks the windows are split, Hessians all-reduced, every rank computes the same
codes and rank 0 writes. Kept columns (``keep``) are stored exactly in fp16 by the quantizer.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from pipeline.dist import Dist
from pipeline.errors import LowbitError
from pipeline.models.adapters import linear_names
from pipeline.models.checkpoint import StreamingCheckpoint
from pipeline.models.quantized import QuantizedWriter
from pipeline.quant.allocate import kept_bits
from pipeline.quant.feedback import Feedback, allowance, quantize_block_feedback, spent_bits
from pipeline.quant.formats import Format, as_format
from pipeline.quant.qtensor import QTensor
from pipeline.quant.sequential import QuantOptions, block_groups, quantize_block
from pipeline.streaming.engine import Batches, BlockSource, BlockWalk, StreamOptions
from pipeline.streaming.workdir import WorkDir

if TYPE_CHECKING:
    from pipeline.config import QuantConfig


def quant_options(quant: QuantConfig) -> QuantOptions:
    """The per-layer quantizer settings of the run's ``quant`` section."""
    return QuantOptions(
        method=quant.method, block_size=quant.block_size, damp=quant.damp, act_order=quant.act_order
    )


class _Head(nn.Module):
    """Final norm + lm_head, so the head is quantized like a one-linear block."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm(x))


class _QuantizeStep:
    """Quantizes each block before its output pass. Parts: 0 the embeddings, ``k + 1``
    segment ``k``, ``n_seg + 1`` the head; float tensors keep their stored dtype."""

    def __init__(
        self,
        raw,
        plan,
        opts,
        reduce,
        writer: QuantizedWriter | None,
        n_seg: int,
        keep,
        feedback: Feedback | None = None,
        slack: int = 0,
    ):
        self.raw, self.a, self.plan, self.opts, self.keep = raw, raw.adapter, plan, opts, keep
        self.reduce, self.writer, self.n_seg = reduce, writer, n_seg
        self.feedback, self.slack = feedback, slack  # slack: the bits feedback has left
        self.groups = block_groups(self.a.linears, self.a.fused)
        self.qtensors: dict[str, QTensor] = {}
        self.floats: dict[str, Tensor] = {}
        self.report: dict[str, dict] = {}

    def embed(self, ids: Tensor) -> Tensor:
        # The stored table: fp16 is half the fp32 copy, and part 0 keeps the stored dtype.
        table = self.raw.tensor(self.a.embed + ".weight")  # (vocab, C)
        if self.writer and not self.writer.has_part(0):
            self.writer.write_part(0, {self.a.embed + ".weight": table})
        return table

    def before(self, i: int, block: nn.Module, batches: Batches, kwargs: dict) -> None:
        prefix = self.a.block_prefix(i)
        formats = {n[len(prefix) :]: f for n, f in self.plan.items() if n.startswith(prefix)}
        keep = {n[len(prefix) :]: c for n, c in self.keep.items() if n.startswith(prefix)}
        args = (block, formats, batches, kwargs, self.groups, self.opts)
        if self.feedback is None:
            qts, rep = quantize_block(*args, self.reduce, keep)
        else:
            allow = allowance(self.feedback, self.slack, i, self.raw.num_layers)
            qts, rep, spent = quantize_block_feedback(
                *args, self.feedback, allow, self.reduce, keep
            )
            self.slack -= spent
        self.qtensors.update({prefix + n: qt for n, qt in qts.items()})
        self.report.update({prefix + n: r for n, r in rep.items()})
        skip = {prefix + n + ".weight" for n in qts}
        names = [n for n in self.raw.names() if n.startswith(prefix) and n not in skip]
        self.floats.update({n: self.raw.tensor(n) for n in names})

    def after(self, i: int, block: nn.Module) -> None:
        pass

    def end_segment(self, k: int) -> dict:
        if self.writer:
            self.writer.write_part(k + 1, self.floats, self.qtensors)
        report = self.report
        self.qtensors, self.floats, self.report = {}, {}, {}
        return report

    def head(self, source: BlockSource, batches: Batches) -> dict:
        """Final norm (float) and lm_head (quantized only if the plan lists it): the last part."""
        a = self.a
        floats = {a.final_norm + ".weight": self.raw.tensor(a.final_norm + ".weight")}
        qtensors, report = {}, {}
        if "lm_head" in self.plan:
            head = _Head(source.norm(), source.lm_head())
            formats, groups = {"lm_head": self.plan["lm_head"]}, [("lm_head",)]
            keep = {"lm_head": self.keep[a.lm_head]} if a.lm_head in self.keep else {}
            qtensors, report = quantize_block(
                head, formats, batches, {}, groups, self.opts, self.reduce, keep
            )
            del head
        elif a.lm_head + ".weight" in self.raw:
            floats[a.lm_head + ".weight"] = self.raw.tensor(a.lm_head + ".weight")
        if self.writer:
            self.writer.write_part(self.n_seg + 1, floats, qtensors)
        return report


def _check_plan(plan: dict[str, Format], config: Any, keep: dict[str, list[int]]) -> None:
    unknown = sorted(set(plan) - set(linear_names(config)))
    unknown += sorted(set(keep) - set(plan))  # kept columns of a layer that is not quantized
    if unknown:
        raise LowbitError(
            f"the quantization plan names layers the model does not have: "
            f"{unknown[:5]}; re-run allocate for this model"
        )


@torch.no_grad()
def quantize_checkpoint(
    ckpt: StreamingCheckpoint,
    out_dir: str | Path,
    plan: Mapping[str, Format | str],
    calib: Tensor,
    opts: QuantOptions,
    walk: StreamOptions,
    *,
    work_dir: str | Path,
    dist: Dist | None = None,
    keep: dict[str, list[int]] | None = None,
    feedback: Feedback | None = None,
) -> dict[str, Any]:
    """Quantize ``ckpt`` into ``out_dir`` with ``plan`` {linear: format} (unlisted: float) on
    ``calib`` (N, T); returns ``QuantReport``'s fields plus the run facts. ``feedback``: error
    feedback in the decoder blocks."""
    t_start = time.time()
    dist = dist or Dist()
    raw = StreamingCheckpoint(ckpt.path, ckpt.allow_bin)  # float tensors in their stored dtype
    keep = {n: list(c) for n, c in (keep or {}).items() if len(c)}
    plan = {n: as_format(f) for n, f in plan.items()}
    _check_plan(plan, ckpt.config, keep)
    names = {n: f.name for n, f in plan.items()}
    key = [str(ckpt.path.resolve()), names, dataclasses.asdict(opts), str(ckpt.dtype)]
    if keep:  # another set of kept columns is another result (none: the key as it always was)
        key.append(keep)
    if feedback:
        key.append(
            [
                feedback.threshold,
                [f.name for f in feedback.candidates],
                feedback.slack_bits,
                feedback.pace,
            ]
        )
    work = WorkDir(work_dir, key)
    engine = BlockWalk("quantize", ckpt, calib, walk, dist, work)
    writer = QuantizedWriter(out_dir, parts_dir=work.path / "parts") if dist.is_main else None
    reduce = dist.all_reduce_ if dist.world_size > 1 else None
    n_seg = len(engine.segments)
    slack = 0
    if feedback:  # what finished segments of a resumed run spent is no longer there to spend
        done = [r for rep in work.reports(engine.start) for r in rep.values()]
        slack = feedback.slack_bits - spent_bits(done)
    step = _QuantizeStep(raw, plan, opts, reduce, writer, n_seg, keep, feedback, slack)
    result = engine.run(step)
    layers: dict[str, dict] = {}
    for report in result.reports:
        layers.update(report)
    layers.update(result.head)
    names = {n: layers[n]["format"] for n in names}  # error feedback may have moved some
    overrides = {}
    if "lm_head" in plan and getattr(ckpt.config, "tie_word_embeddings", False):
        overrides["tie_word_embeddings"] = False  # the quantized head is its own tensor now
    if writer:
        writer.close(
            n_seg + 2,
            src_dir=ckpt.path,
            method=opts.method,
            layers=names,
            config_overrides=overrides,
            kept={n: len(c) for n, c in keep.items()},
        )
    dist.barrier()
    seconds = time.time() - t_start
    formats = {f.name: f for f in [*plan.values(), *(feedback.candidates if feedback else ())]}
    summary = _summary(layers, formats, opts.method, n_seg, result.resumed, dist, calib, seconds)
    if feedback:
        summary["feedback_bits"] = spent_bits(layers.values())
    return summary


def _summary(layers, formats, method, n_seg, start, dist, calib, seconds) -> dict[str, Any]:
    """The quant report's fields (``QuantReport.from_dict``) plus the run facts."""
    bits = numel = 0
    for r in layers.values():
        out_f, in_f = r["shape"]
        bits += formats[r["format"]].bits_per_weight(in_f) * out_f * in_f
        bits += kept_bits(out_f, r.get("kept_columns", 0))  # the fp16 side matrix
        numel += out_f * in_f
    errors = [r["rel_output_error"] for r in layers.values()]
    return {
        "method": method,
        "segments": n_seg,
        "resumed_segments": start,
        "world_size": dist.world_size,
        "calib_samples": int(calib.shape[0]),
        "calib_seq_len": int(calib.shape[1]),
        "quantized_layers": len(layers),
        "avg_bits": bits / numel if numel else 16.0,
        "mean_rel_output_error": sum(errors) / len(errors) if errors else 0.0,
        "max_rel_output_error": max(errors, default=0.0),
        "seconds": round(seconds, 3),
        "layers": layers,
    }
