"""Codecs: one per format family, each owning its fit, encode, decode, storage and fake-quant.

``IntCodec`` (uniform codes, per-group scale and zero), ``ExpCodec`` (4-bit sign + index on
a geometric grid, decoded through a LUT) and ``ExpDesignCodec`` (the same codes on the method's
formula grid). Callers take the codec from the format
(``fmt.codec``) and never branch on the family; ``float`` has no codec.
"""

from __future__ import annotations

from functools import cache

from pipeline.quant.codec.base import (
    Codec,
    expand_groups,
    to_fp16,
    to_groups,
)
from pipeline.quant.codec.exp_design import ExpDesignCodec
from pipeline.quant.codec.exponential import EXP_LEVELS, ExpCodec, exp_lut
from pipeline.quant.codec.integer import IntCodec


@cache
def codec_for(kind: str, bits: int, symmetric: bool, variant: str = "") -> Codec:
    """The codec of a quantized format family (``kind`` "int" or "exp"; ``variant`` "design":
    exp4 on the method's formula grid)."""
    if kind == "int":
        return IntCodec(bits, symmetric)
    if kind == "exp":
        return ExpDesignCodec() if variant == "design" else ExpCodec()
    raise ValueError(f"{kind!r} weights are not quantized; only int and exp formats have a codec")


__all__ = [
    "EXP_LEVELS",
    "Codec",
    "ExpCodec",
    "ExpDesignCodec",
    "IntCodec",
    "codec_for",
    "exp_lut",
    "expand_groups",
    "to_fp16",
    "to_groups",
]
