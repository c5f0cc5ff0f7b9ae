"""Round-to-nearest (RTN) quantization with searched group parameters.

Every weight is rounded independently to the nearest level of its group's grid; the grid of
each group (scale/zero, or exp base/ratio) is chosen by the format codec's vectorised search,
which minimises the reconstruction error, optionally weighted per input column by the
Hessian diagonal ``hdiag`` (as in SqueezeLLM-style sensitivity weighting: errors on inputs
with large activations cost more). RTN is the baseline GPTQ is measured against, and the
quantizer the sensitivity stage uses to estimate ``Q_b(w)`` for every candidate format.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.quant.codec import to_groups
from pipeline.quant.formats import Format, as_format
from pipeline.quant.qtensor import QTensor


def quantize_rtn(
    w: Tensor, fmt: Format | str, hdiag: Tensor | None = None, keep: Tensor | None = None
) -> QTensor:
    """Quantize a weight matrix by round-to-nearest.

    Args:
        w: Weight (out, in), any float dtype.
        fmt: Format or format name.
        hdiag: Optional (in,) non-negative per-input importance (e.g. the Hessian diagonal)
            weighting the error in the parameter search.
        keep: Optional input columns kept exactly in fp16 (``QTensor.keep_idx``): their error
            is the fp16 rounding only; the other columns are rounded as without them.

    Returns:
        The QTensor.
    """
    fmt = as_format(fmt)
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight (out, in), got shape {tuple(w.shape)}")
    if fmt.kind == "float":
        return QTensor.from_float(w)
    w = w.detach().float()
    if not torch.isfinite(w).all():
        raise ValueError("weight contains NaN/Inf; fix the checkpoint before quantizing")
    g = fmt.group_len(w.shape[1])
    wg = to_groups(w, g)  # (out, n_groups, G)
    weight = None
    if hdiag is not None:
        if hdiag.shape != (w.shape[1],):
            raise ValueError(f"hdiag must have shape ({w.shape[1]},), got {tuple(hdiag.shape)}")
        weight = to_groups(hdiag.detach().float().clamp_min(0)[None], g)  # (1, ng, G)
    codec = fmt.codec
    p1, p2 = codec.fit(wg, weight)  # (out, n_groups)
    codes = codec.encode(wg, p1[..., None], p2[..., None]).flatten(1)[:, : w.shape[1]]
    return QTensor.from_params(codes, fmt, p1, p2).with_kept(w, keep)
