"""Fake-quantized linear layer for quantization-aware training (distillation).

The layer keeps float weights and the per-group grid parameters of a QTensor and computes,
on every forward, ``W_hat = dequant(quant(W))``: the network sees exactly the weights that
will be exported, while gradients flow through the rounding with the straight-through
estimator (STE).

Gradient to the scale follows LSQ (Esser et al., ICLR 2020): with ``v = w / s``,
``d W_hat / d s = round(v) - v`` inside the clipping range and ``-Q_N`` / ``Q_P`` (the code
distance of the clip point from the zero) outside; the weight gradient is passed through
inside the range and zeroed outside. The zero point (asymmetric formats) is learned in code
units and rounded with an STE (LSQ+ style): its gradient is non-zero only for clipped weights.
Scales are rounded to fp16 in the forward (identity gradient), so what trains is what is
stored. LSQ also scales the step-size gradient (``1/sqrt(N * Q_P)``); ``set_grad_scale``
applies any such factor, ``grad_scale_factor`` computes the usual ones.

Exponential formats: the learnable scale is the base ``s`` (every level ``s * r**k`` moves
with it, ``d W_hat / d s = W_hat / s``); the ratio ``r`` stays fixed, a deliberate
simplification: the rounding decision already depends on it discontinuously, and the
base alone recovers most of the range adaptation.
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

    Build it with ``from_qtensor`` (or ``from_linear``); ``to_qtensor`` converts back.

    Attributes:
        weight: (out, in) float weights (trainable iff ``learn_weights``).
        scale: (out, n_groups) scale (exp: base ``s``), trainable iff ``learn_scales``.
        zero: (out, n_groups) zero point in code units (asymmetric int only).
        ratio: (out, n_groups) buffer, exp ratio ``r``.
    """

    def __init__(self, weight: Tensor, fmt: Format, scales: Tensor | None = None,
                 zeros: Tensor | None = None, ratios: Tensor | None = None,
                 bias: Tensor | None = None, learn_scales: bool = True,
                 learn_weights: bool = False) -> None:
        super().__init__()
        self.fmt = fmt
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach().float().clone(), requires_grad=learn_weights)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=learn_weights)
        self.scale = self.zero = None
        if scales is not None:
            self.scale = nn.Parameter(scales.detach().float().clone(), requires_grad=learn_scales)
        if zeros is not None:
            self.zero = nn.Parameter(zeros.detach().float().clone(), requires_grad=learn_scales)
        if ratios is not None:
            self.register_buffer("ratio", ratios.detach().float().clone())
        self.grad_scale = 1.0

    @classmethod
    def from_qtensor(cls, qt: QTensor, bias: Tensor | None = None, learn_scales: bool = True,
                     learn_weights: bool = False) -> FakeQuantLinear:
        """Start from a QTensor: the first forward reproduces ``qt.dequantize()`` exactly."""
        return cls(qt.dequantize(), qt.fmt, qt.scales, qt.zeros, qt.ratios, bias,
                   learn_scales, learn_weights)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: Format | str, **kwargs) -> FakeQuantLinear:
        """RTN-quantize ``linear`` and wrap it (kwargs as in ``from_qtensor``)."""
        return cls.from_qtensor(quantize_rtn(linear.weight, fmt), linear.bias, **kwargs)

    def set_grad_scale(self, factor: float) -> None:
        """Multiply the gradients of scale and zero by ``factor`` from now on."""
        self.grad_scale = float(factor)

    def _params(self) -> tuple[Tensor | None, Tensor | None]:
        s, z = self.scale, self.zero
        if self.grad_scale != 1.0:
            s = _ScaleGrad.apply(s, self.grad_scale)
            z = None if z is None else _ScaleGrad.apply(z, self.grad_scale)
        return s, z

    def quantized_weight(self) -> Tensor:
        """(out, in) float32 quantize-dequantized weight, differentiable by STE."""
        w = self.weight.float()
        if self.fmt.kind == "float":
            return _HalfSTE.apply(w)
        s, z = self._params()
        s = _Fp16STE.apply(s)[..., None]  # (out, n_groups, 1)
        wg = codec.to_groups(w, self.fmt.group_len(self.in_features))  # (out, n_groups, G)
        if self.fmt.kind == "exp":
            w_hat = self._exp_fake(wg, s)
        else:
            if z is None:
                z = torch.tensor(float(1 << (self.fmt.bits - 1)), device=w.device)
            else:
                z = _RoundSTE.apply(z).clamp(0, self.fmt.maxq)[..., None]
            codes = torch.clamp(_RoundSTE.apply(wg / s) + z, 0, self.fmt.maxq)
            w_hat = (codes - z) * s
        return w_hat.flatten(1)[:, : self.in_features]

    def _exp_fake(self, wg: Tensor, s: Tensor) -> Tensor:
        powers = codec.exp_powers(self.ratio)[:, :, None, :]  # (out, n_groups, 1, 8)
        with torch.no_grad():
            m = codec.exp_encode(wg, s, self.ratio[..., None]) % codec.EXP_LEVELS
        mag = s * torch.gather(powers.expand(*m.shape, -1), -1, m[..., None]).squeeze(-1)
        w_hat = torch.where(wg < 0, -mag, mag)
        inside = (wg.abs() <= s * powers[..., -1]).float()  # no weight gradient past the top
        return w_hat + (wg - wg.detach()) * inside

    def forward(self, x: Tensor) -> Tensor:
        w = self.quantized_weight()
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w.to(x.dtype), bias)

    @torch.no_grad()
    def to_qtensor(self) -> QTensor:
        """Quantize the current weights with the current (fp16-rounded) parameters."""
        if self.fmt.kind == "float":
            return float_qtensor(self.weight)
        s = codec.to_fp16(self.scale.float())
        wg = codec.to_groups(self.weight.float(), self.fmt.group_len(self.in_features))
        if self.fmt.kind == "exp":
            p2 = self.ratio.float()
            codes = codec.exp_encode(wg, s[..., None], p2[..., None])
        else:
            if self.zero is None:
                p2 = torch.full_like(s, float(1 << (self.fmt.bits - 1)))
            else:
                p2 = torch.round(self.zero.float()).clamp(0, self.fmt.maxq)
            codes = codec.int_encode(wg, s[..., None], p2[..., None], self.fmt.maxq).long()
        return pack_qtensor(codes.flatten(1)[:, : self.in_features], self.fmt, s, p2)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fmt={self.fmt.name}, bias={self.bias is not None}")
