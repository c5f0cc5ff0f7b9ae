"""QTensor: dequantization convention, the signed (Ascend) mapping, the flat state dict."""

import pytest
import torch

from pipeline.quant.formats import parse_format
from pipeline.quant.qtensor import QTensor
from pipeline.quant.rtn import quantize_rtn
from tests.quant.test_formats import ALL_FORMATS


def _qt(name: str, out: int = 6, n_in: int = 100, seed: int = 0) -> QTensor:
    w = torch.randn(out, n_in, generator=torch.Generator().manual_seed(seed))
    return quantize_rtn(w, name)


def test_dequantize_follows_the_documented_formula():
    qt = _qt("int3g32")
    col = torch.arange(100)
    scale = qt.scales.float()[:, col // 32]
    zero = qt.zeros.float()[:, col // 32]
    assert torch.equal(qt.dequantize(), (qt.codes.float() - zero) * scale)
    sym = _qt("int4g64-sym")
    scale = sym.scales.float()[:, col // 64]
    assert torch.equal(sym.dequantize(), (sym.codes.float() - 8) * scale)


@pytest.mark.parametrize("name", [f for f in ALL_FORMATS if f.startswith("int")])
def test_signed_mapping_is_exact(name):
    qt = _qt(name)
    q, scale, offset = qt.signed()
    bits = qt.fmt.bits
    assert q.dtype == torch.int8 and scale.dtype == offset.dtype == torch.float32
    assert int(q.min()) >= -(2 ** (bits - 1)) and int(q.max()) <= 2 ** (bits - 1) - 1
    assert scale.shape == offset.shape == (6, qt.fmt.n_groups(100))
    g = qt.group_len
    offset, scale = offset.repeat_interleave(g, 1)[:, :100], scale.repeat_interleave(g, 1)[:, :100]
    w = (q.float() - offset) * scale
    assert torch.equal(w, qt.dequantize())


def test_signed_rejects_non_int_formats():
    with pytest.raises(ValueError, match="int format"):
        _qt("exp4g32").signed()


@pytest.mark.parametrize("name", ["int2g64", "int4g128-sym", "int8", "exp4g32", "float"])
def test_state_dict_round_trip(name):
    qt = _qt(name)
    sd = qt.to_state_dict("model.layers.0.mlp.up_proj")
    assert all(k.startswith("model.layers.0.mlp.up_proj.") for k in sd)
    back = QTensor.from_state_dict(sd, "model.layers.0.mlp.up_proj")
    assert back.fmt == qt.fmt and back.shape == qt.shape
    assert torch.equal(back.codes, qt.codes)
    assert torch.equal(back.dequantize(), qt.dequantize())


def test_missing_prefix_names_the_expected_keys():
    with pytest.raises(KeyError, match="x.format"):
        QTensor.from_state_dict(_qt("int4g32").to_state_dict("y"), "x")


def test_inconsistent_shapes_are_rejected():
    qt = _qt("int4g32")
    with pytest.raises(ValueError, match="scales shape"):
        QTensor(qt.codes, qt.scales[:, :1], qt.zeros, parse_format("int4g32"), qt.shape)
