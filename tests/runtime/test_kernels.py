"""Packed kernels against the reference they replace, the choice per format, the fallbacks."""

from __future__ import annotations

import logging

import pytest
import torch

from pipeline.artifact.lowbit_format import pack_linear, plan_layer, unpack_linear
from pipeline.quant.rtn import quantize_rtn
from pipeline.runtime import kernels
from pipeline.runtime.backends import TorchQuantLinear, kernel_summary
from pipeline.runtime.inmemory import runtime_linear, to_runtime
from pipeline.runtime.kernels import TOLERANCE, build, relative_error


def _codes(fmt, shape=(64, 256)):
    torch.manual_seed(1)
    qt = quantize_rtn(torch.randn(*shape) * 0.02, fmt)
    info = plan_layer("l", qt.fmt, qt.shape, "lowbit")
    return qt, unpack_linear(pack_linear(qt, info), info)


@pytest.mark.parametrize(
    ("fmt", "want"),
    [
        ("int4g128", "int4pack"),
        ("int4g32-sym", "int4pack"),
        ("int3g64", "int4pack"),
        ("int2g64", "int4pack"),
        ("int4", "int4pack"),  # per channel: the scale repeated per 256-column block
        ("int2", "int4pack"),
        ("int8", "int8pack"),  # asymmetric: the offset folded as -sum(x) * offset * scale
        ("int8-sym", "int8pack"),
        ("exp4g128", "dense-bf16"),
        ("int8g128", "reference"),  # no grouped int8 kernel
    ],
)
def test_kernel_matches_reference(fmt, want):
    qt, codes = _codes(fmt)
    layer = build(codes)
    assert layer.name == want
    x = torch.randn(5, 256)
    ref = x @ qt.dequantize().T  # the oracle: the quantizer's own dequantization
    err = relative_error(layer(x), ref)
    # bf16 activations and scales cost ~3e-3; an unpacking bug (a swapped nibble, a wrong
    # zero) costs O(1).
    assert err < (1e-6 if want == "reference" else 1e-2), err
    assert layer(x).dtype == x.dtype  # the caller's dtype comes back


@pytest.mark.parametrize(
    ("fmt", "shape"),
    [
        ("int4g128", (64, 200)),  # k not a multiple of the group: no whole blocks
        ("int4g64", (40, 256)),  # n not a multiple of 16 (the int4 packing's tile)
        ("int8", (64, 200)),  # k % 16 != 0: the int8 kernel would read past the row
    ],
)
def test_shapes_a_kernel_cannot_take_fall_back_to_reference(fmt, shape):
    qt, codes = _codes(fmt, shape)
    layer = build(codes)
    assert layer.name == "reference"
    x = torch.randn(2, shape[1])
    torch.testing.assert_close(layer(x), x @ qt.dequantize().T)


def test_a_kernel_that_disagrees_is_replaced_and_named(monkeypatch, caplog):
    _, codes = _codes("int4g128")

    def wrong(self, x):  # e.g. a platform whose packing convention differs
        return torch.zeros(x.shape[0], 64)

    monkeypatch.setattr(kernels.Int4Pack, "forward", wrong)
    with caplog.at_level(logging.WARNING, logger="pipeline.runtime.kernels"):
        layer = build(codes, name="model.layers.0.mlp.up_proj")
    assert layer.name == "reference"
    assert "model.layers.0.mlp.up_proj" in caplog.text and "differs" in caplog.text
    # unchecked, the wrong kernel stays: the check is what catches it
    assert build(codes, check=False).name == "int4pack"


def test_a_kernel_that_raises_falls_back(monkeypatch, caplog):
    _, codes = _codes("int8")

    def refuse(self, x):
        raise RuntimeError("no kernel for this device\nsecond line")

    monkeypatch.setattr(kernels.Int8Pack, "forward", refuse)
    with caplog.at_level(logging.WARNING, logger="pipeline.runtime.kernels"):
        assert build(codes, name="lm").name == "reference"
    assert "RuntimeError: no kernel for this device" in caplog.text
    assert "second line" not in caplog.text


def test_reference_on_request_and_unknown_kernel():
    _, codes = _codes("int4g128")
    assert build(codes, kernel="reference").name == "reference"
    with pytest.raises(ValueError, match="kernel must be one of"):
        build(codes, kernel="fast")
    packed = TorchQuantLinear(codes, kernel="auto")
    with pytest.raises(TypeError, match="reference"):
        packed.weight_matrix()


def test_bias_batch_dims_and_w8a8_dynamic():
    qt, codes = _codes("int8-sym")
    bias = torch.randn(64)
    layer = TorchQuantLinear(codes, bias, kernel="auto")
    x = torch.randn(2, 3, 256)
    got = layer(x)
    assert got.shape == (2, 3, 64) and layer.kernel == "int8pack"
    assert relative_error(got, x @ qt.dequantize().T + bias) < 1e-2


def test_to_runtime_converts_a_fake_quant_model(qmodels):
    from pipeline.quant.fakequant import FakeQuantLinear

    model = qmodels.fp_model().eval()
    mlp = model.model.layers[0].mlp
    for name, fmt in (("up_proj", "int4g64"), ("down_proj", "exp4g64"), ("gate_proj", "float")):
        mlp.set_submodule(name, FakeQuantLinear.from_linear(getattr(mlp, name), fmt))
    rt = to_runtime(model)
    assert kernel_summary(rt) == "int4pack x1, dense-bf16 x1"
    assert isinstance(model.model.layers[0].mlp.up_proj, FakeQuantLinear)  # a copy converted
    assert isinstance(rt.model.layers[0].mlp.gate_proj, FakeQuantLinear)  # float stays
    x = torch.randint(0, 200, (1, 12))
    with torch.no_grad():
        err = relative_error(rt(input_ids=x).logits, model(input_ids=x).logits)
    assert err < TOLERANCE
    qt = model.model.layers[0].mlp.up_proj.to_qtensor()
    ref = runtime_linear("up", qt, kernel="reference")
    assert ref.kernel == "reference" and torch.equal(ref.weight_matrix(), qt.dequantize())
