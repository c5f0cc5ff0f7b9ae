"""Round-to-nearest (RTN) quantization with searched group parameters.

Every weight is rounded independently to the nearest level of its group's grid; the grid of
each group (scale/zero, or exp base/ratio) is chosen by the vectorised search in ``codec``,
which minimises the reconstruction error, optionally weighted per input column by the
Hessian diagonal ``hdiag`` (as in SqueezeLLM-style sensitivity weighting: errors on inputs
with large activations cost more). RTN is the baseline GPTQ is measured against, and the
quantizer the sensitivity stage uses to estimate ``Q_b(w)`` for every candidate format.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.quant import codec
from pipeline.quant.formats import Format, parse_format
from pipeline.quant.qtensor import QTensor


def fit_group_params(
    wg: Tensor, fmt: Format, weight: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Search the two per-group parameters of ``fmt`` for groups ``wg`` of shape (..., G).

    Returns:
        int: ``(scale, zero)``; exp: ``(base, ratio)``; both of shape ``wg.shape[:-1]``.
    """
    if fmt.kind == "exp":
        return codec.fit_exp(wg, weight)
    return codec.fit_int(wg, fmt, weight)


def encode(w: Tensor, fmt: Format, p1: Tensor, p2: Tensor) -> Tensor:
    """Codes (int64) of ``w`` under broadcastable group parameters ``(p1, p2)``."""
    if fmt.kind == "exp":
        return codec.exp_encode(w, p1, p2)
    return codec.int_encode(w, p1, p2, fmt.maxq).long()


def decode(codes: Tensor, fmt: Format, p1: Tensor, p2: Tensor) -> Tensor:
    """Float weights of ``codes`` under broadcastable group parameters ``(p1, p2)``."""
    if fmt.kind == "exp":
        lut = codec.exp_lut(p1, p2)  # (..., 16)
        return torch.gather(lut, -1, codes.unsqueeze(-1)).squeeze(-1)
    return codec.int_decode(codes.float(), p1, p2)


def pack_qtensor(codes: Tensor, fmt: Format, p1: Tensor, p2: Tensor) -> QTensor:
    """Assemble a QTensor from int64 codes (out, in) and float32 group params (out, n_groups)."""
    if fmt.kind == "exp":
        scales, zeros, ratios = p1.half(), None, p2.half()
    else:
        scales, ratios = p1.half(), None
        zeros = None if fmt.symmetric else p2.to(torch.uint8)
    return QTensor(codes.to(torch.uint8), scales, zeros, fmt, tuple(codes.shape), ratios)


def float_qtensor(w: Tensor) -> QTensor:
    """The ``float`` format: fp16 weights stored as their int16 bit pattern."""
    h = w.detach().to(torch.float16)
    if not torch.isfinite(h).all():
        raise ValueError(
            "weight has values that are not finite in fp16 (|w| > 65504 or "
            "NaN/Inf); keep this layer in its original dtype outside lowbit"
        )
    return QTensor(
        h.view(torch.int16).contiguous(), None, None, parse_format("float"), tuple(h.shape)
    )


def quantize_rtn(w: Tensor, fmt: Format | str, hdiag: Tensor | None = None) -> QTensor:
    """Quantize a weight matrix by round-to-nearest.

    Args:
        w: Weight (out, in), any float dtype.
        fmt: Format or format name.
        hdiag: Optional (in,) non-negative per-input importance (e.g. the Hessian diagonal)
            weighting the error in the parameter search.

    Returns:
        The QTensor.
    """
    fmt = parse_format(fmt)
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight (out, in), got shape {tuple(w.shape)}")
    if fmt.kind == "float":
        return float_qtensor(w)
    w = w.detach().float()
    if not torch.isfinite(w).all():
        raise ValueError("weight contains NaN/Inf; fix the checkpoint before quantizing")
    g = fmt.group_len(w.shape[1])
    wg = codec.to_groups(w, g)  # (out, n_groups, G)
    weight = None
    if hdiag is not None:
        if hdiag.shape != (w.shape[1],):
            raise ValueError(f"hdiag must have shape ({w.shape[1]},), got {tuple(hdiag.shape)}")
        weight = codec.to_groups(hdiag.detach().float().clamp_min(0)[None], g)  # (1, ng, G)
    p1, p2 = fit_group_params(wg, fmt, weight)  # (out, n_groups)
    codes = encode(wg, fmt, p1[..., None], p2[..., None]).flatten(1)[:, : w.shape[1]]
    return pack_qtensor(codes, fmt, p1, p2)
