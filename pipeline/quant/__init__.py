"""Quantization math: formats and their codecs, RTN and GPTQ, fake-quant layers, bit packing.

Pure tensor code: tensors and small frozen dataclasses in, tensors out; no file I/O (QTensor
files: ``pipeline.models.qtensor_io``).
"""

from pipeline.quant.codec import Codec, ExpCodec, IntCodec
from pipeline.quant.fakequant import FakeQuantLinear, grad_scale_factor
from pipeline.quant.formats import GRAMMAR, Format, parse_format
from pipeline.quant.gptq import HessianAccumulator, gptq_quantize
from pipeline.quant.packing import (
    pack_bits,
    pack_int4_ascend,
    pack_int4_npu_int32,
    unpack_bits,
    unpack_int4_ascend,
    unpack_int4_npu_int32,
)
from pipeline.quant.qtensor import QTensor
from pipeline.quant.rtn import quantize_rtn

__all__ = [
    "GRAMMAR",
    "Codec",
    "ExpCodec",
    "FakeQuantLinear",
    "Format",
    "HessianAccumulator",
    "IntCodec",
    "QTensor",
    "gptq_quantize",
    "grad_scale_factor",
    "pack_bits",
    "pack_int4_ascend",
    "pack_int4_npu_int32",
    "parse_format",
    "quantize_rtn",
    "unpack_bits",
    "unpack_int4_ascend",
    "unpack_int4_npu_int32",
]
