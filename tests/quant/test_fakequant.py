"""FakeQuantLinear: exact round trips with QTensor, STE/LSQ gradients, gradient scaling."""

import math

import pytest
import torch

from pipeline.quant.fakequant import FakeQuantLinear, grad_scale_factor
from pipeline.quant.formats import parse_format
from pipeline.quant.rtn import quantize_rtn

FORMATS = ["int2g32", "int3g64-sym", "int4g32", "int8", "int4", "exp4g32", "float"]


def _qt(name, out=8, n_in=80, seed=0):
    w = torch.randn(out, n_in, generator=torch.Generator().manual_seed(seed)) * 0.1
    return quantize_rtn(w, name)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("learn_weights", [False, True])
def test_from_and_to_qtensor_are_bit_exact(name, learn_weights):
    qt = _qt(name)
    m = FakeQuantLinear.from_qtensor(qt, learn_weights=learn_weights)
    assert torch.equal(m.quantized_weight(), qt.dequantize())
    back = m.to_qtensor()
    assert back.fmt == qt.fmt and torch.equal(back.codes, qt.codes)
    for field in ("scales", "zeros", "ratios"):
        a, b = getattr(qt, field), getattr(back, field)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))


def test_forward_is_a_linear_with_the_quantized_weight():
    qt = _qt("int4g32")
    bias = torch.randn(8)
    m = FakeQuantLinear.from_qtensor(qt, bias=bias)
    x = torch.randn(3, 5, 80)
    torch.testing.assert_close(m(x), x @ qt.dequantize().T + bias)


@pytest.mark.parametrize("name", ["int4g32", "int3g64-sym", "exp4g32"])
@pytest.mark.parametrize("learn_weights", [False, True])
def test_gradient_reaches_the_scale_and_grad_scale_multiplies_it(name, learn_weights):
    m = FakeQuantLinear.from_qtensor(_qt(name), learn_weights=learn_weights)
    if learn_weights:  # weights start on the grid, where LSQ's scale gradient is zero
        with torch.no_grad():
            m.weight.add_(0.01 * torch.randn_like(m.weight))
    x = torch.randn(4, 80)
    m(x).square().sum().backward()
    g1 = m.scale.grad.clone()
    assert g1.abs().sum() > 0
    m.scale.grad = None
    m.set_grad_scale(0.125)
    m(x).square().sum().backward()
    torch.testing.assert_close(m.scale.grad, 0.125 * g1)


def test_lsq_scale_gradient_formula():
    """d W_hat / d s = round(v) - v inside the range, -z or maxq - z at the clip points."""
    fmt = parse_format("int3")
    qt = _qt("int3", out=4, n_in=16)
    m = FakeQuantLinear.from_qtensor(qt, learn_weights=True)
    with torch.no_grad():
        m.weight.mul_(1.4).add_(0.003)  # off the grid, some weights beyond the range
    upstream = torch.randn(4, 16)
    (m.quantized_weight() * upstream).sum().backward()

    s = qt.scales.float()  # (4, 1): per channel
    z = qt.zeros.float()
    v = m.weight.detach() / s
    code = torch.round(v) + z
    d = torch.where(code < 0, -z, torch.where(code > fmt.maxq, fmt.maxq - z, torch.round(v) - v))
    torch.testing.assert_close(m.scale.grad, (d * upstream).sum(1, keepdim=True))
    inside = (code >= 0) & (code <= fmt.maxq)
    torch.testing.assert_close(m.weight.grad, upstream * inside)
    assert (~inside).any()  # the example does exercise clipping


def test_frozen_codes_scale_gradient_is_codes_minus_zero():
    qt = _qt("int4g32", out=2, n_in=64)
    m = FakeQuantLinear.from_qtensor(qt)  # learn_weights=False: codes fixed
    assert m.weight is None and m.codes is not None
    upstream = torch.randn(2, 64)
    (m.quantized_weight() * upstream).sum().backward()
    c = (qt.codes.float() - qt.zeros.float().repeat_interleave(32, 1)) * upstream
    torch.testing.assert_close(m.scale.grad, c.view(2, 2, 32).sum(-1))


def test_trained_scales_export_what_the_forward_computed():
    m = FakeQuantLinear.from_qtensor(_qt("int4g32"), learn_weights=True)
    with torch.no_grad():
        m.scale.mul_(1.0371)
        m.zero.add_(0.4)
        m.weight.add_(0.01)
    assert torch.equal(m.to_qtensor().dequantize(), m.quantized_weight().detach())


def test_grad_scale_factors():
    assert grad_scale_factor("bits", "int4g128", 10) == 2.0**-4
    assert grad_scale_factor("lsq", "int4g128", 4096) == pytest.approx(1 / math.sqrt(4096 * 15))
    assert grad_scale_factor("lsq", "int4g128-sym", 4096) == pytest.approx(1 / math.sqrt(4096 * 7))
    assert grad_scale_factor("none", "int2g64", 10) == 1.0
    with pytest.raises(ValueError, match="bits, lsq, none"):
        grad_scale_factor("adam", "int4", 10)


def test_from_linear():
    torch.manual_seed(0)  # an unseeded layer missed the bound about one run in three
    lin = torch.nn.Linear(64, 16)
    m = FakeQuantLinear.from_linear(lin, "int4g32")
    x = torch.randn(2, 64)
    assert (m(x) - lin(x)).abs().max() < 0.1
    assert "int4g32" in repr(m)
