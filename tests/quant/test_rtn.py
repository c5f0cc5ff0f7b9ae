"""Round-to-nearest quantization: grids, idempotence, Hessian weighting, exp4 vs int4."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.quant.formats import parse_format
from pipeline.quant.rtn import quantize_rtn
from tests.quant.test_formats import ALL_FORMATS


def _weights(out: int, n_in: int, seed: int, kind: str = "normal") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n_in, generator=g)
    if kind == "laplace":
        u = torch.rand(out, n_in, generator=g).clamp(1e-6, 1 - 1e-6) - 0.5
        w = -torch.sign(u) * torch.log1p(-2 * u.abs())
    return w * 0.02


# Not the design grid: it is set by 2/3 of a group's max, which its own top level does not
# reproduce, so a second pass sees another max and another grid.
@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from([f for f in ALL_FORMATS if not f.endswith("-design")]),
    out=st.integers(1, 6),
    n_in=st.integers(1, 300),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
)
def test_requantizing_a_dequantized_weight_is_idempotent(name, out, n_in, seed, scale):
    w = _weights(out, n_in, seed) * scale
    once = quantize_rtn(w, name).dequantize()
    twice = quantize_rtn(once, name).dequantize()
    assert torch.equal(once, twice)


@pytest.mark.parametrize("name", ["int2g64", "int3g32-sym", "int4g128", "int8", "exp4g64"])
def test_codes_and_group_params_have_the_documented_layout(name):
    fmt = parse_format(name)
    w = _weights(8, 200, 0)
    qt = quantize_rtn(w, fmt)
    n_groups = fmt.n_groups(200)
    assert qt.codes.dtype == torch.uint8 and qt.codes.shape == (8, 200)
    assert int(qt.codes.max()) <= fmt.maxq
    assert qt.scales.dtype == torch.float16 and qt.scales.shape == (8, n_groups)
    assert (qt.zeros is None) == (fmt.symmetric or fmt.kind == "exp")
    assert (qt.ratios is not None) == (fmt.kind == "exp")
    # error well below the weight scale: the grid fits the data
    err = (qt.dequantize() - w).square().mean() / w.square().mean()
    assert err < {2: 0.25, 3: 0.08, 4: 0.03, 8: 1e-4}[fmt.bits]


def test_symmetric_codes_are_centred():
    w = _weights(4, 128, 1)
    qt = quantize_rtn(w, "int4g32-sym")
    q, _, offset = qt.signed()
    assert torch.equal(offset, torch.zeros_like(offset))
    assert int(q.min()) >= -8 and int(q.max()) <= 7


def test_more_bits_never_hurt():
    w = _weights(16, 256, 2)
    errs = [(quantize_rtn(w, f"int{b}g64").dequantize() - w).square().sum() for b in (2, 3, 4, 8)]
    assert errs[0] > errs[1] > errs[2] > errs[3]


def test_hessian_weighting_lowers_the_weighted_error():
    w = _weights(32, 128, 3)
    hdiag = torch.ones(128)
    hdiag[:8] = 1000.0  # a few very important inputs
    plain = quantize_rtn(w, "int3g128").dequantize()
    weighted = quantize_rtn(w, "int3g128", hdiag=hdiag).dequantize()

    def werr(q):
        return ((q - w).square() * hdiag).sum()

    assert werr(weighted) < werr(plain)


def test_exp4_beats_int4_on_laplace_weights():
    w = _weights(32, 1024, 4, kind="laplace")
    exp_mse = (quantize_rtn(w, "exp4g128").dequantize() - w).square().mean()
    int_mse = (quantize_rtn(w, "int4g128").dequantize() - w).square().mean()
    assert exp_mse < int_mse


def test_exp4_lut_decodes_the_codes():
    w = _weights(4, 64, 5)
    qt = quantize_rtn(w, "exp4g32")
    lut = qt.lut  # (4, 2, 16)
    assert lut.shape == (4, 2, 16)
    assert torch.equal(lut[..., 0], torch.zeros(4, 2))
    assert torch.equal(lut[..., 8:], -lut[..., :8])
    mags = lut[..., 1:8]
    ratio = mags[..., 1:] / mags[..., :-1]
    torch.testing.assert_close(ratio, qt.ratios.float()[..., None].expand_as(ratio))
    col = 40  # group 1
    expect = lut[torch.arange(4), 1, qt.codes[:, col].long()]
    assert torch.equal(qt.dequantize()[:, col], expect)


def test_float_format_is_fp16():
    w = _weights(3, 10, 6)
    qt = quantize_rtn(w, "float")
    assert torch.equal(qt.dequantize(), w.half().float())


@pytest.mark.parametrize("bad", [torch.zeros(3), torch.full((2, 4), float("nan"))])
def test_bad_weights_raise(bad):
    with pytest.raises(ValueError):
        quantize_rtn(bad, "int4g32")


def test_exponential_codes_win_on_heavy_tails_and_lose_on_gaussian_weights():
    """Why exp4g128 is a default candidate: its geometric grid spends levels near zero, where
    heavy-tailed weights crowd, and loses to the uniform grid on Gaussian weights; the
    allocator sees it through ΔL. kurtosis says which case a layer is."""
    from pipeline.analysis.sensitivity import kurtosis

    torch.manual_seed(0)
    gauss = torch.randn(256, 512)
    heavy = torch.distributions.StudentT(2.5).sample((256, 512))

    def err(w, fmt):
        return (quantize_rtn(w, fmt).dequantize() - w).square().mean().item()

    assert kurtosis(gauss) == pytest.approx(3.0, abs=0.1) and kurtosis(heavy) > 6
    assert err(heavy, "exp4g128") < 0.9 * err(heavy, "int4g128")
    assert err(gauss, "exp4g128") > err(gauss, "int4g128")
