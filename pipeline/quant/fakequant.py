"""Fake-quantized linear layer for quantization-aware training (distillation).

The layer keeps the weights (float, or the integer codes) and the per-group grid parameters
of a QTensor and computes, on every forward, ``W_hat = dequant(quant(W))``: the network sees
exactly the weights that will be exported, while gradients flow through the rounding with the
straight-through estimator (STE).

Two modes. With trainable weights (LSQ), the float weights are re-rounded every forward and
the gradient to the scale follows LSQ (Esser et al., ICLR 2020): with ``v = w / s``,
``d W_hat / d s = round(v) - v`` inside the clipping range and ``-Q_N`` / ``Q_P`` (the code
distance of the clip point from the zero) outside; the weight gradient is passed through
inside the range and zeroed outside. The zero point (asymmetric formats) is learned in code
units and rounded with an STE (LSQ+ style): its gradient is non-zero only for clipped weights.
Scales are rounded to fp16 in the forward (identity gradient), so what trains is what is
stored. LSQ also scales the step-size gradient (``1/sqrt(N * Q_P)``); ``set_grad_scale``
applies any such factor, ``grad_scale_factor`` computes the usual ones. With frozen weights
the integer codes are kept and only the grid trains (EfficientQAT's step-size phase):
``W_hat = (codes - z) * s`` and ``d W_hat / d s = codes - z``. Re-rounding frozen weights
instead would be useless: they sit exactly on the grid, where LSQ's ``round(v) - v`` is 0.

Exponential formats: the learnable scale is the base ``s`` (every level ``s * r**k`` moves
with it, ``d W_hat / d s = W_hat / s``); the ratio ``r`` stays as fitted. That is a
simplification (its gradient ``k * s * r**(k-1)`` would be easy to add) which keeps one
trainable parameter per group, as for symmetric int formats.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.quant import codec
from pipeline.quant.formats import Format, parse_format
from pipeline.quant.qtensor import QTensor
from pipeline.quant.rtn import float_qtensor, pack_qtensor, quantize_rtn


class _RoundSTE(torch.autograd.Function):
    """round() forward (bit exact), identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


class _Fp16STE(torch.autograd.Function):
    """Round to the nearest positive fp16 value forward, identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return codec.to_fp16(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


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
    """Gradient factor for scale/zero parameters.

    Args:
        mode: ``"bits"`` (2**-bits, the default), ``"lsq"`` (1/sqrt(numel * Q_P)) or ``"none"``.
        fmt: The layer's format.
        numel: Number of weights the LSQ rule counts (the layer's weights, N_W in LSQ).

    Returns:
        The factor to pass to ``FakeQuantLinear.set_grad_scale``.
    """
    fmt = parse_format(fmt)
    if mode == "none" or fmt.kind == "float":
        return 1.0
    if mode == "bits":
        return 2.0**-fmt.bits
    if mode == "lsq":
        if fmt.kind == "exp":
            q_p = codec.EXP_LEVELS - 1  # positive magnitude levels
        else:
            q_p = (1 << (fmt.bits - 1)) - 1 if fmt.symmetric else fmt.maxq
        return 1.0 / math.sqrt(numel * max(q_p, 1))
    raise ValueError(f"unknown grad scale mode {mode!r}; allowed: bits, lsq, none")


class FakeQuantLinear(nn.Module):
    """Linear layer whose weight is quantize-dequantized on every forward.

    Two modes, chosen by ``learn_weights``:

    * ``True`` (LSQ): float ``weight`` is trained and re-rounded every forward. It starts on
      the grid, where LSQ's scale gradient ``round(v) - v`` is exactly 0; the scale starts
      learning once the weights have moved off the grid.
    * ``False`` (frozen codes, as EfficientQAT's step-size training): the integer codes are
      fixed (buffer ``codes``, uint8) and ``W_hat = (codes - z) * s``, so the scale gets the
      exact gradient ``codes - z``. Re-rounding frozen on-grid weights would give it zero
      gradient. ``weight`` is None in this mode (it saves the float copy).

    Attributes:
        weight: (out, in) float weights, or None with frozen codes.
        codes: (out, in) uint8 frozen codes, or None.
        scale: (out, n_groups) scale (exp: base ``s``), trainable iff ``learn_scales``.
        zero: (out, n_groups) zero point in code units (asymmetric int only), same.
        ratio: (out, n_groups) buffer, exp ratio ``r``.
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

    def _params(self) -> tuple[Tensor, Tensor | None]:
        """Scale (fp16-rounded) and integer zero, (out, n_groups, 1), with gradient scaling."""
        s, z = self.scale, self.zero
        if self.grad_scale != 1.0:
            s = _ScaleGrad.apply(s, self.grad_scale)
            z = None if z is None else _ScaleGrad.apply(z, self.grad_scale)
        s = _Fp16STE.apply(s)[..., None]
        if z is not None:
            z = _RoundSTE.apply(z).clamp(0, self.fmt.maxq)[..., None]
        elif self.fmt.kind == "int":
            z = torch.tensor(float(1 << (self.fmt.bits - 1)), device=s.device)
        return s, z

    def quantized_weight(self) -> Tensor:
        """(out, in) float32 quantize-dequantized weight, differentiable by STE."""
        if self.fmt.kind == "float":
            return _HalfSTE.apply(self.weight.float())
        s, z = self._params()
        g = self.fmt.group_len(self.in_features)
        if self.codes is not None:  # frozen codes
            if self.fmt.kind == "exp":
                c = codec.to_groups(self.codes.long(), g)  # (out, n_groups, G)
                w_hat = self._exp_levels(c % codec.EXP_LEVELS, s)
                w_hat = torch.where(c >= codec.EXP_LEVELS, -w_hat, w_hat)
            else:
                w_hat = (codec.to_groups(self.codes, g).float() - z) * s
        else:  # LSQ on float weights
            wg = codec.to_groups(self.weight.float(), g)  # (out, n_groups, G)
            if self.fmt.kind == "exp":
                with torch.no_grad():
                    m = codec.exp_encode(wg, s, self.ratio[..., None]) % codec.EXP_LEVELS
                mag = self._exp_levels(m, s)
                top = s * codec.exp_powers(self.ratio)[..., -1:]  # (out, n_groups, 1)
                inside = (wg.abs() <= top).float()  # no weight gradient past the top level
                w_hat = torch.where(wg < 0, -mag, mag) + (wg - wg.detach()) * inside
            else:
                codes = torch.clamp(_RoundSTE.apply(wg / s) + z, 0, self.fmt.maxq)
                w_hat = (codes - z) * s
        return w_hat.flatten(1)[:, : self.in_features]

    def _exp_levels(self, m: Tensor, s: Tensor) -> Tensor:
        """Magnitude ``s * r**(m-1)`` (0 for m = 0) of indices m (out, n_groups, G)."""
        powers = codec.exp_powers(self.ratio)[:, :, None, :]  # (out, n_groups, 1, 8)
        return s * torch.gather(powers.expand(*m.shape, -1), -1, m[..., None]).squeeze(-1)

    def forward(self, x: Tensor) -> Tensor:
        w = self.quantized_weight()
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w.to(x.dtype), bias)

    @torch.no_grad()
    def to_qtensor(self) -> QTensor:
        """The current state as a QTensor (fp16 scales, rounded zeros, current codes)."""
        if self.fmt.kind == "float":
            return float_qtensor(self.weight)
        s = codec.to_fp16(self.scale.float())
        if self.fmt.kind == "exp":
            p2 = self.ratio.float()
        elif self.zero is None:
            p2 = torch.full_like(s, float(1 << (self.fmt.bits - 1)))
        else:
            p2 = torch.round(self.zero.float()).clamp(0, self.fmt.maxq)
        if self.codes is not None:
            return pack_qtensor(self.codes.long(), self.fmt, s, p2)
        wg = codec.to_groups(self.weight.float(), self.fmt.group_len(self.in_features))
        if self.fmt.kind == "exp":
            codes = codec.exp_encode(wg, s[..., None], p2[..., None])
        else:
            codes = codec.int_encode(wg, s[..., None], p2[..., None], self.fmt.maxq).long()
        return pack_qtensor(codes.flatten(1)[:, : self.in_features], self.fmt, s, p2)

    def extra_repr(self) -> str:
        mode = "frozen codes" if self.codes is not None else "lsq"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"fmt={self.fmt.name}, mode={mode}, bias={self.bias is not None}"
        )
