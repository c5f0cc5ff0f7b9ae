"""Fake-quantized linear layer for quantization-aware training (distillation).

Every forward computes ``W_hat = dequant(quant(W))`` from the QTensor's weights and grid, so
the network sees exactly the exported weights; gradients pass the rounding by the
straight-through estimator. With trainable weights the step size follows LSQ (Esser et al.,
ICLR 2020): ``d W_hat / d s = round(v) - v`` inside the clip range, the clip point's code
distance outside; the zero point trains in code units (LSQ+). With frozen codes only the grid
trains (EfficientQAT): ``d W_hat / d s = codes - z``, since on-grid weights would give
``round(v) - v = 0``. Scales are rounded to fp16 in the forward, so what trains is what is
stored. The per-family forward is the codec's (``fmt.codec``). Kept columns are frozen buffers.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.quant.codec import to_groups
from pipeline.quant.formats import Format, as_format
from pipeline.quant.qtensor import QTensor
from pipeline.quant.rtn import quantize_rtn


class _HalfSTE(torch.autograd.Function):
    """Cast to fp16 and back forward (the `float` format), identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.to(torch.float16).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient multiplied by ``factor`` backward."""

    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def grad_scale_factor(mode: str, fmt: Format | str, numel: int) -> float:
    """Gradient factor for scale/zero parameters (for ``FakeQuantLinear.set_grad_scale``).

    ``mode``: ``"bits"`` (2**-bits), ``"lsq"`` (1/sqrt(numel * Q_P), numel = the layer's weights)
    or ``"none"``.
    """
    fmt = as_format(fmt)
    if mode == "none" or fmt.kind == "float":
        return 1.0
    if mode == "bits":
        return 2.0**-fmt.bits
    if mode == "lsq":
        return 1.0 / math.sqrt(numel * max(fmt.codec.lsq_levels, 1))
    raise ValueError(f"unknown grad scale mode {mode!r}; allowed: bits, lsq, none")


class FakeQuantLinear(nn.Module):
    """Linear layer whose weight is quantize-dequantized on every forward.

    ``learn_weights=True`` (LSQ): float ``weight`` is trained and re-rounded every forward;
    ``False``: frozen uint8 ``codes``, ``W_hat = (codes - z) * s``. ``scale`` (exp: the base) and
    ``zero`` (code units, asymmetric int) train iff ``learn_scales``; ``ratio`` is a buffer.
    """

    def __init__(
        self,
        qt: QTensor,
        bias: Tensor | None = None,
        learn_scales: bool = True,
        learn_weights: bool = False,
    ) -> None:
        super().__init__()
        self.fmt = qt.fmt
        self.out_features, self.in_features = qt.shape
        frozen = not learn_weights and qt.fmt.kind != "float"
        weight = None if frozen else nn.Parameter(qt.dequantize(), requires_grad=learn_weights)
        self.register_parameter("weight", weight)
        self.register_buffer("codes", qt.codes.clone() if frozen else None)
        self.bias = (
            None
            if bias is None
            else nn.Parameter(bias.detach().clone(), requires_grad=learn_weights)
        )
        self.scale = self.zero = None
        if qt.scales is not None:
            self.scale = nn.Parameter(qt.scales.float(), requires_grad=learn_scales)
        if qt.zeros is not None:
            self.zero = nn.Parameter(qt.zeros.float(), requires_grad=learn_scales)
        self.register_buffer("ratio", None if qt.ratios is None else qt.ratios.float())
        kept = qt.keep_idx is not None
        self.register_buffer("keep_idx", qt.keep_idx.long() if kept else None)  # (k,)
        self.register_buffer("keep_vals", qt.keep_vals.clone() if kept else None)  # (out, k)
        self.grad_scale = 1.0

    @classmethod
    def from_qtensor(
        cls,
        qt: QTensor,
        bias: Tensor | None = None,
        learn_scales: bool = True,
        learn_weights: bool = False,
    ) -> FakeQuantLinear:
        """Start from a QTensor: the first forward reproduces ``qt.dequantize()`` exactly."""
        return cls(qt, bias, learn_scales, learn_weights)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: Format | str, **kwargs) -> FakeQuantLinear:
        """RTN-quantize ``linear`` and wrap it (kwargs as in ``from_qtensor``)."""
        return cls(quantize_rtn(linear.weight, fmt), linear.bias, **kwargs)

    def set_grad_scale(self, factor: float) -> None:
        """Multiply the gradients of scale and zero by ``factor`` from now on."""
        self.grad_scale = float(factor)

    def _params(self) -> tuple[Tensor, Tensor]:
        """The codec's ``(p1, p2)`` as trained, (out, n_groups), with gradient scaling."""
        s, z = self.scale, self.zero
        if self.grad_scale != 1.0:
            s = _ScaleGrad.apply(s, self.grad_scale)
            z = None if z is None else _ScaleGrad.apply(z, self.grad_scale)
        return self.fmt.codec.trained(s, z, self.ratio)

    def quantized_weight(self) -> Tensor:
        """(out, in) float32 quantize-dequantized weight, differentiable by STE."""
        if self.fmt.kind == "float":
            return _HalfSTE.apply(self.weight.float())
        p1, p2 = self._params()
        g = self.fmt.group_len(self.in_features)
        if self.codes is not None:  # frozen codes
            w_hat = self.fmt.codec.fake_decode(to_groups(self.codes, g), p1, p2)
        else:  # LSQ on float weights
            w_hat = self.fmt.codec.fake_quant(to_groups(self.weight.float(), g), p1, p2)
        w_hat = w_hat.flatten(1)[:, : self.in_features]
        if self.keep_idx is not None:  # exact, frozen: no gradient reaches these columns
            w_hat = w_hat.index_copy(1, self.keep_idx, self.keep_vals.to(w_hat.dtype))
        return w_hat

    def forward(self, x: Tensor) -> Tensor:
        w = self.quantized_weight()
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w.to(x.dtype), bias)

    @torch.no_grad()
    def to_qtensor(self) -> QTensor:
        """The current state as a QTensor (fp16 scales, rounded zeros, current codes)."""
        if self.fmt.kind == "float":
            return QTensor.from_float(self.weight)
        codec = self.fmt.codec
        zero = None if self.zero is None else self.zero.float()
        ratio = None if self.ratio is None else self.ratio.float()
        p1, p2 = codec.trained(self.scale.float(), zero, ratio)
        if self.codes is not None:
            qt = QTensor.from_params(self.codes.long(), self.fmt, p1, p2)
        else:
            wg = to_groups(self.weight.float(), self.fmt.group_len(self.in_features))
            codes = codec.encode(wg, p1[..., None], p2[..., None]).flatten(1)
            qt = QTensor.from_params(codes[:, : self.in_features], self.fmt, p1, p2)
        if self.keep_idx is None:
            return qt
        return replace(qt, keep_idx=self.keep_idx.int(), keep_vals=self.keep_vals.clone())

    def extra_repr(self) -> str:
        mode = "frozen codes" if self.codes is not None else "lsq"
        kept = "" if self.keep_idx is None else f", kept_columns={self.keep_idx.numel()}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"fmt={self.fmt.name}, mode={mode}, bias={self.bias is not None}{kept}"
        )
