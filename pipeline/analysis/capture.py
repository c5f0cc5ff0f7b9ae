"""Forward hooks that summarise what each linear layer reads (its input x, tokens × in).

* Outliers: per input channel the running absmax; a channel is an outlier by the MAD rule
  |a_c − median(a)| > 3.5 · 1.4826 · MAD(a) (Iglewicz & Hoaglin's modified z-score), since a few
  channels 10-100× the rest make quantization hard (LLM.int8()). Kurtosis from float64 raw
  moments, exact and summable across ranks. The flagged channels and the error of int8
  activations (``pipeline.quant.act8``) tell the runtime what to keep float.
* Optionally H = 2/N Σ xxᵀ per distinct input for the GPTQ proxy; a fused group shares one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist
from torch import Tensor, nn

from pipeline.dist import Dist
from pipeline.quant import act8
from pipeline.quant.gptq import HessianAccumulator

MAD_K = 3.5
MAD_SIGMA = 1.4826
# Past a sixteenth of the inputs a float input costs less than float side columns.
ACT_COLUMNS_CAP = 1 / 16


class InputStats:
    """Running moments of all input values and per-channel absmax of one linear's input."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.moments = torch.zeros(5, dtype=torch.float64, device=device)  # n, Σx, Σx², Σx³, Σx⁴
        self.absmax = torch.zeros(in_features, dtype=torch.float32, device=device)  # (in,)
        # Σ (x̂ − x)², Σ x² of int8 activations x̂, when the input splits into blocks
        self.act8 = torch.zeros(2, dtype=torch.float64, device=device)

    @torch.no_grad()
    def add(self, x: Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1])  # (tokens, in)
        self.absmax = torch.maximum(self.absmax, x.abs().amax(0).float())
        xd = x.double()
        x2 = xd * xd
        self.moments += torch.stack(
            [xd.new_tensor(xd.numel()), xd.sum(), x2.sum(), (x2 * xd).sum(), (x2 * x2).sum()]
        )
        if x.shape[-1] % act8.BLOCK == 0:
            self.act8 += act8.error_sums(x)

    def reduce_(self, dist: Dist) -> None:
        """Sum the moments and take the max of the absmax over ranks."""
        dist.all_reduce_(self.moments)
        dist.all_reduce_(self.act8)
        if dist.world_size > 1:
            tdist.all_reduce(self.absmax, op=tdist.ReduceOp.MAX)

    def summary(self) -> dict[str, Any]:
        """{"share", "kurtosis", "max_over_median", "act8_error"} (None where undefined) and
        "columns", the flagged channels largest first (at most ``ACT_COLUMNS_CAP`` of them)."""
        n = float(self.moments[0])
        kurt = None
        if n > 0:
            _, m1, m2, m3, m4 = (self.moments / n).tolist()  # raw moments E[x^k]
            var = m2 - m1 * m1
            central4 = m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1**4
            kurt = central4 / var**2 if var > 0 else None
        err, ref = self.act8.tolist()
        act8_error = (err / ref) ** 0.5 if ref > 0 else None
        columns = ranked_outliers(self.absmax, ACT_COLUMNS_CAP)
        return {
            **outlier_summary(self.absmax),
            "kurtosis": kurt,
            "act8_error": act8_error,
            "columns": columns,
        }


def outlier_mask(absmax: Tensor) -> Tensor:
    """(in,) bool: the outlier channels of a per-channel absmax (in,) by the MAD rule."""
    a = absmax.double()
    med = a.median()
    mad = (a - med).abs().median()
    return (a - med).abs() > MAD_K * MAD_SIGMA * mad


def outlier_summary(absmax: Tensor) -> dict[str, float | None]:
    """Share of outlier channels (MAD rule) and max/median of the per-channel absmax (in,)."""
    a = absmax.double()
    med = a.median()
    return {
        "share": float(outlier_mask(absmax).double().mean()),
        "max_over_median": float(a.max() / med) if med > 0 else None,
    }


def ranked_outliers(absmax: Tensor, cap: float) -> list[int]:
    """The MAD outliers of absmax (in,), largest first, at most cap · in of them."""
    mask = outlier_mask(absmax)
    limit = int(cap * absmax.numel() + 1e-9)  # floor, safe from 0.07 * 100 = 7.0000001
    ranked = torch.argsort(torch.where(mask, absmax.double(), -1.0), descending=True, stable=True)
    return ranked[: min(limit, int(mask.sum()))].tolist()


def outlier_columns(absmax: Tensor, cap: float) -> list[int]:
    """Columns to keep exactly: the MAD outliers of absmax (in,), largest first, ≤ cap · in."""
    return sorted(ranked_outliers(absmax, cap))


class Capture:
    """Hooks on linears gathering InputStats (and H with ``hessians``); ``shared``: fused groups."""

    def __init__(
        self,
        modules: dict[str, nn.Module],
        hessians: bool = False,
        shared: dict[str, str] | None = None,
    ) -> None:
        self.stats: dict[str, InputStats] = {}
        self.hessians: dict[str, HessianAccumulator] = {}
        shared = {n: o for n, o in (shared or {}).items() if o in modules}
        self._owner = {n: shared.get(n, n) for n in modules}
        self._handles = []
        owners = [n for n in modules if self._owner[n] == n]
        for name in owners:  # one hook per distinct input
            mod = modules[name]
            self.stats[name] = InputStats(mod.in_features, mod.weight.device)
            if hessians:
                self.hessians[name] = HessianAccumulator(mod.in_features, device=mod.weight.device)
            self._handles.append(mod.register_forward_pre_hook(self._hook(name)))
        for name in modules:  # members of a fused group see their owner's statistics
            self.stats.setdefault(name, self.stats[self._owner[name]])

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            self.observe(name, args[0])

        return hook

    def observe(self, name: str, x: Tensor) -> None:
        """Account input x (B, T, in) of ``name`` without running the module (a big lm_head)."""
        self.stats[name].add(x)
        if name in self.hessians:
            self.hessians[name].add_batch(x.detach())

    def hessian(self, name: str) -> Tensor:
        """H of ``name``'s input (in, in); shared within a fused group."""
        return self.hessians[self._owner[name]].H

    def reduce_(self, dist: Dist) -> None:
        """Combine every rank's statistics (and Hessians, weighted by their sample counts)."""
        for name, st in self.stats.items():
            if self._owner[name] == name:  # shared objects are reduced once
                st.reduce_(dist)
        for acc in self.hessians.values():
            n = torch.tensor([float(acc.n_samples)], dtype=torch.float64, device=acc.H.device)
            acc.H.mul_(acc.n_samples)  # back to the sum 2 Σ x xᵀ, which adds across ranks
            dist.all_reduce_(acc.H)
            dist.all_reduce_(n)
            acc.n_samples = int(n.item())
            acc.H.div_(max(acc.n_samples, 1))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
