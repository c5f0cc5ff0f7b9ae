"""The runtime's float32 linears on CPU: few-row calls read the weight once (``csrc/f32_rows.cpp``,
AVX-512 or AVX2 as ``cpu_ext.isa()`` picks).

A quantized model keeps some layers float (lm_head above all: 32000 x 2048 float32 is a third
of a 4-bit 1B model's bytes per token), and an FP model is all float. MKL's sgemm streams such a
weight near memory speed for one row but not for a few (it packs and re-reads it), and does
not split one row over two threads. One 32000 x 2048 layer, ms, best of 10 interleaved calls
(``python -m bench.float_rows --threads 1|2``, AVX-512):

=====  ================  ================
rows   1 thread          2 threads
       F.linear/f32rows  F.linear/f32rows
=====  ================  ================
1      14.1 / 10.9       15.8 / 11.7
3      44.5 / 15.3       48.7 / 10.6
5      52.4 / 20.3       50.9 / 11.6
12     65.1 / 43.5       51.4 / 26.2
32     89.5 / 107.3      66.1 / 56.6
=====  ================  ================

Speculative verification runs gamma + 1 rows, so there the float head alone cost 3.5 decode
steps; here 1.1-1.4. :func:`convert` gives every float32 ``nn.Linear`` of a CPU model this
layer, which takes the calls of ``MIN_ROWS`` to ``MAX_ROWS`` token rows on weights of at least
``MIN_BYTES`` and leaves every other call (prompts, training, other dtypes) to ``F.linear``.
The weight and bias are the original parameters, shared, so tied embeddings stay tied and no
memory is added. Results differ from ``F.linear`` by summation order only (~1e-7 relative).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.runtime import cpu_ext

NAME = "f32rows"  # the kernel name ``kernel_summary`` reports
MIN_ROWS, MAX_ROWS = 1, 12  # the token rows where it beats sgemm (module table)
# Weights measured on a whole model are >= 4 MiB; a 1 MB weight in cache still gains at 1-3 rows
# and ties at 5, but smaller layers (the embedded default's) stay on F.linear until measured.
MIN_BYTES = 4 * 2**20


class FloatRowsLinear(nn.Linear):
    """An ``nn.Linear`` whose few-row float32 CPU calls run ``f32_rows_mm`` on ``isa``."""

    isa: str | None = None  # set by ``of``; None: every call goes to F.linear

    @property
    def kernel(self) -> str | None:
        """``NAME``, or None where every call goes to ``F.linear`` (a weight cast off float32
        or off the CPU), so that ``kernel_summary`` does not claim it."""
        return NAME if self.isa and _takes(self.weight) else None

    @classmethod
    def of(cls, linear: nn.Linear, isa: str | None = None) -> FloatRowsLinear:
        """The same layer (its parameters shared, not copied) with this forward, on ``isa``'s
        kernel ("avx512", "avx2"; default: ``cpu_ext.isa()``)."""
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


def _takes(weight: Tensor) -> bool:
    """Whether ``f32_rows_mm`` takes this weight: float32, on the CPU, contiguous."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()


def fits(linear: nn.Module) -> bool:
    """Whether ``linear`` is a plain float32 CPU ``nn.Linear`` worth the kernel."""
    return type(linear) is nn.Linear and _takes(linear.weight) and linear.weight.nbytes >= MIN_BYTES


def convert(model: nn.Module) -> nn.Module:
    """``model`` (in place) with every :func:`fits` linear as a :class:`FloatRowsLinear`; a
    no-op where the CPU extension is unavailable (``cpu_ext``)."""
    if cpu_ext.extension() is None:
        return model
    for name, mod in list(model.named_modules()):
        if fits(mod):
            model.set_submodule(name, FloatRowsLinear.of(mod))
    return model
