"""Float32 CPU linears whose few-row calls read the weight once (``csrc/f32_rows.cpp``).

MKL's sgemm re-reads a weight for a few rows, which made the float lm_head dominate
speculative verification. :func:`convert` swaps large float32 ``nn.Linear`` layers (parameters
shared); calls outside ``MIN_ROWS..MAX_ROWS`` rows stay on ``F.linear``. docs/kernels.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline import cpu_ext

NAME = "f32rows"  # the kernel name ``kernel_summary`` reports
MIN_ROWS, MAX_ROWS = 1, 12  # the token rows where it beats sgemm (`bench/float_rows.py`)
MIN_BYTES = 4 * 2**20  # smaller weights stay on F.linear: not measured to gain


class FloatRowsLinear(nn.Linear):
    """An ``nn.Linear`` whose few-row float32 CPU calls run ``f32_rows_mm`` on ``isa``."""

    isa: str | None = None  # set by ``of``; None: every call goes to F.linear

    @property
    def kernel(self) -> str | None:
        """``NAME``, or None where every call goes to ``F.linear`` (weight off float32 / CPU)."""
        return NAME if self.isa and _takes(self.weight) else None

    @classmethod
    def of(cls, linear: nn.Linear, isa: str | None = None) -> FloatRowsLinear:
        """The same layer (parameters shared) with this forward on ``isa`` (default: cpu_ext's)."""
        isa = isa or cpu_ext.isa()
        if isa is None:
            raise RuntimeError("the few-row float32 kernel does not run here (cpu_ext.isa() None)")
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        new.weight, new.bias, new.isa = linear.weight, linear.bias, isa
        return new.train(linear.training)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, isa={self.isa}"

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if (
            not MIN_ROWS <= rows <= MAX_ROWS
            or x.dtype != torch.float32
            or self.kernel is None
            or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        ):
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, -1).contiguous()  # (rows, in)
        y = cpu_ext.loaded().f32_rows_mm(x2, self.weight, self.isa)  # (rows, out)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def rows_fn(self) -> Callable[[Tensor], Tensor] | None:
        """:meth:`forward` as a plain function of (rows, in) float32 rows (no bias), or None."""
        if self.kernel is None or self.bias is not None:
            return None
        mm, weight, isa = cpu_ext.loaded().f32_rows_mm, self.weight, self.isa
        return lambda x: mm(x, weight, isa) if x.shape[0] <= MAX_ROWS else F.linear(x, weight)


def _takes(weight: Tensor) -> bool:
    """Whether ``f32_rows_mm`` takes this weight: float32, on the CPU, contiguous."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()


def fits(linear: nn.Module) -> bool:
    """Whether ``linear`` is a plain float32 CPU ``nn.Linear`` worth the kernel."""
    return type(linear) is nn.Linear and _takes(linear.weight) and linear.weight.nbytes >= MIN_BYTES


def convert(model: nn.Module) -> nn.Module:
    """``model`` (in place) with every :func:`fits` linear as a :class:`FloatRowsLinear`."""
    if cpu_ext.extension() is None:
        return model
    for name, mod in list(model.named_modules()):
        if fits(mod):
            model.set_submodule(name, FloatRowsLinear.of(mod))
    return model
