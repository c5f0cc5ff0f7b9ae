"""Codecs: each family's fit / encode / decode / storage / fake-quant agree with each other."""

import math

import pytest
import torch

from pipeline.quant.codec import ExpCodec, ExpDesignCodec, IntCodec, codec_for, exp_lut, to_groups
from pipeline.quant.formats import parse_format
from pipeline.quant.qtensor import QTensor
from pipeline.quant.rtn import quantize_rtn

NAMES = ["int2g32", "int3g64-sym", "int4", "int8g128", "exp4g32", "exp4g128", "exp4g64-design"]


def _w(out: int = 6, n_in: int = 100, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, n_in, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_each_family_has_its_codec():
    assert parse_format("int3g64-sym").codec == IntCodec(3, True)
    assert parse_format("exp4g128").codec == ExpCodec()
    assert parse_format("int4g32").codec is parse_format("int4g128").codec  # one per family
    with pytest.raises(ValueError, match="not quantized"):
        _ = parse_format("float").codec
    with pytest.raises(ValueError, match="not quantized"):
        codec_for("float", 16, True)


@pytest.mark.parametrize("name", NAMES)
def test_decode_of_encode_is_the_stored_weight(name):
    fmt = parse_format(name)
    codec, w = fmt.codec, _w()
    wg = to_groups(w, fmt.group_len(100))
    p1, p2 = codec.fit(wg)
    codes = codec.encode(wg, p1[..., None], p2[..., None])  # (out, n_groups, G)
    decoded = codec.decode(codes, p1[..., None], p2[..., None]).flatten(1)[:, :100]
    qt = QTensor.from_params(codes.flatten(1)[:, :100], fmt, p1, p2)
    assert torch.equal(qt.dequantize(), decoded)
    assert torch.equal(qt.dequantize(), quantize_rtn(w, fmt).dequantize())
    # the stored (fp16 / uint8) parameters load back to exactly what was fitted
    l1, l2 = qt.params()
    assert torch.equal(l1, p1)
    if not (fmt.kind == "int" and fmt.symmetric):
        assert torch.equal(l2, p2)


@pytest.mark.parametrize("name", NAMES)
def test_the_column_rounder_matches_encode_and_decode(name):
    fmt = parse_format(name)
    qt = quantize_rtn(_w(), fmt)
    p1, p2 = qt.params()
    col = _w(seed=1)[:, 0] * 1.7  # (out,) off the grid, some beyond the top level
    p1c, p2c = p1[:, 0], p2[:, 0] if p2.dim() else p2
    codes, q = fmt.codec.rounder(p1c, p2c)(col)
    assert torch.equal(codes, fmt.codec.encode(col, p1c, p2c))
    assert torch.equal(q, fmt.codec.decode(codes, p1c, p2c))


@pytest.mark.parametrize("name", NAMES)
def test_fake_quant_reproduces_the_stored_weight(name):
    fmt = parse_format(name)
    qt = quantize_rtn(_w(), fmt)
    codec, g = fmt.codec, qt.group_len
    p1, p2 = codec.trained(qt.scales.float(), _opt(qt.zeros), _opt(qt.ratios))
    frozen = codec.fake_decode(to_groups(qt.codes, g), p1, p2).flatten(1)[:, :100]
    assert torch.equal(frozen, qt.dequantize())
    # on-grid float weights re-round to themselves
    lsq = codec.fake_quant(to_groups(qt.dequantize(), g), p1, p2).flatten(1)[:, :100]
    assert torch.equal(lsq, qt.dequantize())


def _opt(t):
    return None if t is None else t.float()


def test_exp_lut_lists_every_code_value():
    qt = quantize_rtn(_w(), "exp4g32")
    lut = qt.lut  # (out, n_groups, 16)
    codes = torch.arange(16).expand(6, 4, 16)
    assert torch.equal(ExpCodec().decode(codes, *(p[..., None] for p in qt.params())), lut)
    assert quantize_rtn(_w(), "int4g32").lut is None


def test_int_signed_mapping_recentres_on_the_origin():
    codec = IntCodec(3, False)
    codes = torch.tensor([[0, 3, 4, 7]], dtype=torch.uint8)
    q, scale, offset = codec.signed(codes, torch.ones(1, 1), torch.tensor([[5.0]]))
    assert q.tolist() == [[-4, -1, 0, 3]] and offset.tolist() == [[1.0]]


def _design_levels(amax: float) -> list[float]:
    """The method's grid in plain floats: scale = max * 2/3, log2 step |log2 scale| / 14 (ratio
    on the 1/256 grid), the max's exponent and the six below it, exponents within [-6, 7]."""
    s = float(torch.tensor(amax * 2 / 3).half())
    ratio = 1 + min(max(round((2 ** (abs(math.log2(s)) / 14) - 1) * 256), 1), 256) / 256
    top = min(max(round(math.log2(amax / s) / math.log2(ratio)), 0), 7)
    return [s * ratio**e for e in range(top - 6, top + 1)]


@pytest.mark.parametrize("amax", [0.003, 0.05, 0.4, 0.9, 3.0])
def test_the_design_codec_is_the_method_formula(amax):
    g = torch.linspace(-amax, amax * 0.8, 64)[None, None]  # (1, 1, 64): one group, max |w| = amax
    p1, p2 = codec_for("exp", 4, True, "design").fit(g)
    want = torch.tensor(_design_levels(amax))
    levels = exp_lut(p1, p2)[0, 0, 1:8]  # seven positive magnitudes, code 0 is zero
    assert torch.allclose(levels, want, rtol=2e-3)  # the stored base is fp16
    assert 1 < p2.item() <= 2 and (p2 * 256).item() == round(p2.item() * 256)
    # encode: the nearest of the 16 LUT entries, as exp4 rounds
    codes = ExpDesignCodec().encode(g, p1[..., None], p2[..., None])
    lut = exp_lut(p1, p2)[0, 0]
    nearest = (g[0, 0, :, None] - lut).abs().argmin(-1)
    assert torch.equal(lut[codes[0, 0]], lut[nearest])


def test_the_design_grid_follows_the_weights_magnitude_not_their_shape():
    """Same shape, scaled: exp4's searched grid scales along, the formula's ratio does not."""
    w = _w(4, 128)
    for name in ("exp4g128", "exp4g128-design"):
        a, b = quantize_rtn(w, name), quantize_rtn(w * 8, name)
        same = torch.equal(a.params()[1], b.params()[1])
        assert same == (name == "exp4g128"), name
