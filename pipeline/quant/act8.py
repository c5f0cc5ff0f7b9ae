"""Int8 activations per 32 columns (llama.cpp's Q8_0), as lowbit's W*A8 CPU kernels make them:
codes ``round(x * 127 / max|x|)`` and one scale ``max|x| / 127`` per block. An outlier channel
stretches its block's scale; :func:`split` takes flagged channels out before quantizing, to be
multiplied in float beside the int8 GEMM (LLM.int8()'s decomposition).
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32  # columns per activation scale (csrc/w4a8.cpp)


def fake_act8(x: Tensor) -> Tensor:
    """x (..., k), k a multiple of 32 -> the values the kernels' int8 codes stand for (float32,
    halves to even as ``cvtps2dq``): ``W @ fake_act8(x)`` is what the kernels compute."""
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"activations have {k} columns, not a multiple of {BLOCK}")
    xb = x.float().reshape(*x.shape[:-1], k // BLOCK, BLOCK)  # (..., blocks, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127.0)).reshape(x.shape)


def split(x: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """(x with columns ``idx`` zeroed, x[..., idx]): the int8 part and the float part."""
    return x.index_fill(-1, idx, 0.0), x.index_select(-1, idx)


def error_sums(x: Tensor) -> Tensor:
    """(2,) float64: Σ (fake_act8(x) − x)² and Σ x², summable over batches and ranks."""
    x = x.reshape(-1, x.shape[-1]).float()  # (tokens, k)
    d = (fake_act8(x) - x).double()
    return torch.stack([(d * d).sum(), x.double().square().sum()])
