"""Error feedback during sequential quantization: the worst layers re-quantized one format finer.

After a block is quantized, groups whose measured relative output error
``||X (W - Q)^T|| / ||X W^T||`` exceeds ``threshold`` move to the next finer candidate, largest
error first, paid from the slack the allocator held back (it plans at budget - slack), so the
plan stays within budget. The block is re-quantized from the first moved group on with its
current inputs; fused groups move together. The slack is spent greedily (early blocks may use it
all) or paced evenly over the blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.quant.allocate import layer_bits
from pipeline.quant.formats import Format, as_format
from pipeline.quant.qtensor import QTensor
from pipeline.quant.sequential import QuantOptions, quantize_block


@dataclass(frozen=True)
class Feedback:
    """When and to what a quantized layer moves (the run's ``quant.feedback``, the plan's
    candidates)."""

    threshold: float  # relative output error above which a group is re-quantized
    candidates: tuple[Format, ...]
    slack_bits: int  # the most bits all moves together may add over the plan
    pace: str = "greedy"  # greedy: a block may spend all that is left | even: see allowance


def allowance(fb: Feedback, left: int, block: int, n_blocks: int) -> int:
    """The bits block ``block`` of ``n_blocks`` may spend, ``left`` of the slack remaining:
    all of it (greedy), or its even share plus what earlier blocks left unspent (even), so the
    first blocks measured cannot spend what later ones may need more."""
    if fb.pace == "greedy":
        return left
    if fb.pace != "even":
        raise ValueError(f"pace must be 'greedy' or 'even', got {fb.pace!r}")
    spent = fb.slack_bits - left
    return max(0, min(left, fb.slack_bits * (block + 1) // n_blocks - spent))


def finer(fmt: Format, candidates: Iterable[Format], shape: Sequence[int]) -> Format | None:
    """The cheapest candidate storing an (out, in) weight in more bits than ``fmt``, if any."""
    cost = layer_bits(fmt, shape)
    above = [f for f in candidates if f.kind != "float" and layer_bits(f, shape) > cost]
    return min(above, key=lambda f: (layer_bits(f, shape), f.name), default=None)


def choose(
    report: Mapping[str, dict[str, Any]],
    formats: Mapping[str, Format],
    groups: Sequence[Sequence[str]],
    fb: Feedback,
    slack: int,
) -> tuple[dict[str, Format], int]:
    """``({layer: finer format}, extra bits)``: groups above the threshold, largest error first,
    each taken when its extra bits still fit in ``slack``."""
    wanted = []
    for group in groups:
        names = [n for n in group if n in report]
        error = max((report[n]["rel_output_error"] for n in names), default=0.0)
        if error <= fb.threshold:
            continue
        new = {n: finer(formats[n], fb.candidates, report[n]["shape"]) for n in names}
        if any(f is None for f in new.values()):
            continue  # already the finest candidate
        extra = sum(
            layer_bits(new[n], report[n]["shape"]) - layer_bits(formats[n], report[n]["shape"])
            for n in names
        )
        wanted.append((error, extra, new))
    ups: dict[str, Format] = {}
    spent = 0
    for _error, extra, new in sorted(wanted, key=lambda w: -w[0]):
        if spent + extra <= slack:
            ups.update(new)
            spent += extra
    return ups, spent


def spent_bits(layers: Iterable[dict[str, Any]]) -> int:
    """Bits that feedback added over the plan, from quant report entries."""
    return sum(
        layer_bits(as_format(r["format"]), r["shape"])
        - layer_bits(as_format(r["format_before"]), r["shape"])
        for r in layers
        if r.get("format_before") is not None
    )


@torch.no_grad()
def quantize_block_feedback(
    block: nn.Module,
    formats: dict[str, Format],
    batches: Callable[[], Iterable[Tensor]],
    kwargs: dict,
    groups: Sequence[Sequence[str]],
    opts: QuantOptions,
    fb: Feedback,
    slack: int,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
    keep: dict[str, Sequence[int]] | None = None,
) -> tuple[dict[str, QTensor], dict[str, dict[str, Any]], int]:
    """``quantize_block`` with error feedback paid from ``slack`` bits; also returns the bits
    spent. Each report entry gains ``format_before`` and ``rel_output_error_before`` (the first
    pass's), equal to the final ones where nothing changed."""
    originals = {n: block.get_submodule(n).weight.detach().clone() for n in formats}
    qts, report = quantize_block(block, formats, batches, kwargs, groups, opts, all_reduce, keep)
    for r in report.values():
        r["format_before"], r["rel_output_error_before"] = r["format"], r["rel_output_error"]
    ups, spent = choose(report, formats, groups, fb, slack)
    if not ups:
        return qts, report, 0
    first = next(i for i, g in enumerate(groups) if set(g) & set(ups))
    tail = [tuple(g) for g in groups[first:]]
    redo = {n: ups.get(n, formats[n]) for g in tail for n in g if n in formats}
    for n in redo:  # back to the float weights: the tail is quantized again from scratch
        block.get_submodule(n).weight.copy_(originals[n])
    qts2, report2 = quantize_block(block, redo, batches, kwargs, tail, opts, all_reduce, keep)
    for n, r in report2.items():
        first_pass = report[n]
        r["format_before"] = first_pass["format"]
        r["rel_output_error_before"] = first_pass["rel_output_error"]
        r["seconds"] = round(r["seconds"] + first_pass["seconds"], 4)
    qts.update(qts2)
    report.update(report2)
    return qts, report, spent
