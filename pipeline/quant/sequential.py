"""Sequential quantization of one decoder block (GPTQ's "true sequential" order).

Each linear sees the inputs of the already quantized linears before it, so later layers
compensate earlier rounding. Linears reading one tensor share a Hessian ((q, k, v) -> o ->
(gate, up) -> down), all-reduced over ranks so all compute the same codes. ``rel_output_error``
is ``||X D^T|| / ||X W^T||``, D = W - Q; for GPTQ ``sqrt(tr(D H D^T) / tr(W H W^T))``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.quant.gptq import HessianAccumulator, gptq_quantize
from pipeline.quant.qtensor import QTensor
from pipeline.quant.rtn import quantize_rtn


@dataclass(frozen=True)
class QuantOptions:
    """How each linear is quantized (see ``gptq_quantize``); defaults: the run's ``quant``."""

    method: str  # gptq | rtn
    block_size: int
    damp: float
    act_order: bool


class _Stop(Exception):
    """Raised by a capture hook: the rest of the block's forward is not needed."""


def block_groups(linears: Sequence[str], fused: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    """Linears in execution order, those sharing an input merged into one group."""
    out: list[tuple[str, ...]] = []
    for name in linears:
        group = next((tuple(g) for g in fused if name in g), (name,))
        if group not in out:
            out.append(group)
    return out


class _OutputError:
    """RTN's statistics: sums of ||x W^T||^2 and ||x D^T||^2 over tokens, per linear."""

    def __init__(self, weights: dict[str, Tensor], deltas: dict[str, Tensor]) -> None:
        self.weights, self.deltas = weights, deltas
        device = next(iter(weights.values())).device  # all-reduced there (NCCL needs the GPU)
        self.sums = torch.zeros(2 * len(weights) + 1, dtype=torch.float64, device=device)

    def add_batch(self, x: Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # (tokens, in)
        for i, name in enumerate(self.weights):
            self.sums[2 * i] += (x @ self.weights[name].float().t()).square().sum()
            self.sums[2 * i + 1] += (x @ self.deltas[name].t()).square().sum()
        self.sums[-1] += x.shape[0]


def _capture(modules: Iterable[nn.Module], stat: Any) -> list:
    def hook(_module: nn.Module, args: tuple) -> None:
        stat.add_batch(args[0].detach())
        raise _Stop

    return [m.register_forward_pre_hook(hook) for m in modules]


@torch.no_grad()
def run_block(block: nn.Module, batches: Callable[[], Iterable[Tensor]], kwargs: dict) -> None:
    """Run every batch through ``block``, tolerating a capture hook's early stop."""
    for x in batches():
        with contextlib.suppress(_Stop):
            block(x, **kwargs)


@torch.no_grad()
def quantize_block(
    block: nn.Module,
    formats: dict[str, str],
    batches: Callable[[], Iterable[Tensor]],
    kwargs: dict,
    groups: Sequence[Sequence[str]],
    opts: QuantOptions,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
    keep: dict[str, Sequence[int]] | None = None,
) -> tuple[dict[str, QTensor], dict[str, dict[str, Any]]]:
    """Quantize ``block``'s linears in ``formats`` group by group, leaving them dequantized."""
    keep = {n: c for n, c in (keep or {}).items() if len(c)}
    qtensors: dict[str, QTensor] = {}
    report: dict[str, dict[str, Any]] = {}
    for group in groups:
        names = [n for n in group if n in formats]
        if not names:
            continue
        mods = {n: block.get_submodule(n) for n in names}
        weights = {n: m.weight.detach().float() for n, m in mods.items()}  # (out, in)
        fmts = {n: formats[n] for n in names}
        kept = {n: keep[n] for n in names if n in keep}
        inputs = _GroupInputs(block, list(mods.values()), batches, kwargs)
        if opts.method == "rtn":
            qts, rep = _rtn_group(weights, fmts, inputs, all_reduce, kept)
        else:
            qts, rep = _gptq_group(weights, fmts, inputs, opts, all_reduce, kept)
        for n in kept:
            rep[n]["kept_columns"] = qts[n].kept
        qtensors.update(qts)
        report.update(rep)
        for n, m in mods.items():
            m.weight.copy_(qts[n].dequantize().to(m.weight))
    return qtensors, report


@dataclass(frozen=True)
class _GroupInputs:
    """The inputs of a group of linears that read the same tensor, fed to a statistic."""

    block: nn.Module
    linears: list[nn.Module]
    batches: Callable[[], Iterable[Tensor]]
    kwargs: dict

    def feed(self, stat: Any) -> None:
        """Run the batches through the block up to the group, ``stat.add_batch`` on each."""
        handles = _capture(self.linears, stat)
        try:
            run_block(self.block, self.batches, self.kwargs)
        finally:
            for h in handles:
                h.remove()


def _rtn_group(weights, formats, inputs: _GroupInputs, all_reduce, keep):
    """RTN needs no data: quantize first, then measure the output error on the inputs."""
    t0 = time.perf_counter()
    qtensors = {n: quantize_rtn(weights[n], formats[n], keep=keep.get(n)) for n in weights}
    deltas = {n: weights[n] - qtensors[n].dequantize().to(weights[n]) for n in weights}
    stat = _OutputError(weights, deltas)
    inputs.feed(stat)
    share = (time.perf_counter() - t0) / len(weights)
    sums = stat.sums if all_reduce is None else all_reduce(stat.sums)
    tokens = max(sums[-1].item(), 1.0)
    report = {}
    for i, n in enumerate(weights):
        ref, err = sums[2 * i].item(), sums[2 * i + 1].item()
        report[n] = _entry(formats[n], weights[n], err / tokens, err, ref, share)
    return qtensors, report


def _gptq_group(weights, formats, inputs: _GroupInputs, opts: QuantOptions, all_reduce, keep):
    """One Hessian of the group's shared input, then GPTQ on each linear."""
    t0 = time.perf_counter()
    first = next(iter(weights.values()))
    stat = HessianAccumulator(first.shape[1], device=first.device)
    inputs.feed(stat)
    share = (time.perf_counter() - t0) / len(weights)
    H = stat.H if all_reduce is None else _reduce_hessian(stat, all_reduce)  # (in, in)
    if stat.n_samples == 0 and all_reduce is None:
        raise ValueError("no calibration tokens reached this layer")
    qtensors, report = {}, {}
    for n, w in weights.items():
        t1 = time.perf_counter()
        qt, loss = gptq_quantize(
            w, H, formats[n], block_size=opts.block_size, damp=opts.damp,
            act_order=opts.act_order, keep=keep.get(n),
        )  # fmt: skip
        qtensors[n] = qt
        d = w - qt.dequantize().to(w)
        err = float(((d @ H) * d).sum())
        ref = float(((w @ H) * w).sum())
        report[n] = _entry(formats[n], w, loss, err, ref, share + time.perf_counter() - t1)
    return qtensors, report


def _reduce_hessian(acc: HessianAccumulator, all_reduce: Callable[[Tensor], Tensor]) -> Tensor:
    """The Hessian of all ranks' inputs: counts-weighted mean of the per-rank means."""
    n = torch.tensor([float(acc.n_samples)], dtype=torch.float64, device=acc.H.device)
    H = acc.H.mul_(acc.n_samples)
    all_reduce(H)
    total = all_reduce(n).item()
    if total == 0:
        raise ValueError("no calibration tokens reached this layer: quant.calib.samples is 0?")
    return H.div_(total)


def _entry(
    fmt: str, w: Tensor, loss: float, err: float, ref: float, seconds: float
) -> dict[str, Any]:
    rel = (max(err, 0.0) / ref) ** 0.5 if ref > 0 else 0.0
    return {
        "format": str(fmt),
        "shape": list(w.shape),
        "gptq_loss": float(loss),
        "rel_output_error": float(rel),
        "seconds": round(seconds, 4),
    }
