"""Round-to-nearest (RTN) quantization with searched group parameters.

Each weight rounds to the nearest level of its group's grid, the grid found by the codec's
search, optionally weighting errors per input column by the Hessian diagonal ``hdiag``. The
baseline GPTQ is measured against, and the sensitivity stage's quantizer.
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
    """Round-to-nearest quantization of a weight (out, in); ``hdiag`` (in,) weights the parameter
    search per input column, ``keep`` lists input columns kept exactly in fp16.
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
