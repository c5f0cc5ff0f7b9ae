"""Backends: the torch reference layer, and the torch_npu path against a stand-in kernel."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

from pipeline.artifact.lowbit_format import pack_linear, plan_layer, unpack_linear
from pipeline.errors import LowbitError
from pipeline.quant.rtn import quantize_rtn
from pipeline.runtime.backends import (
    NpuQuantLinear,
    TorchQuantLinear,
    quantize_tokens_int8,
    resolve,
)


def _codes(fmt, shape=(64, 256), target="lowbit", **kw):
    torch.manual_seed(1)
    qt = quantize_rtn(torch.randn(*shape), fmt)
    info = plan_layer("l", qt.fmt, qt.shape, target, **kw)
    return qt, unpack_linear(pack_linear(qt, info), info)


def _npu_weight_quant_batchmatmul(
    x,
    weight,
    antiquant_scale,
    antiquant_offset=None,
    quant_scale=None,
    quant_offset=None,
    bias=None,
    antiquant_group_size=0,
):
    """What the kernel computes per ASCEND.md: x @ ((w + offset) * scale) + bias, w (K, N)."""
    if weight.dtype == torch.int32:  # int4: element 8j+i at bits 4i..4i+3 of int32 j
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        nib = (weight[..., None] >> shifts) & 0xF  # (K, N/8, 8)
        weight = ((nib ^ 8) - 8).reshape(weight.shape[0], -1)
    k = weight.shape[0]
    g = antiquant_group_size or k
    scale = antiquant_scale.reshape(-1, weight.shape[1]).repeat_interleave(g, 0)[:k]
    offset = antiquant_offset.reshape(-1, weight.shape[1]).repeat_interleave(g, 0)[:k]
    w = (weight.to(x.dtype) + offset) * scale  # (K, N)
    y = x @ w
    return y if bias is None else y + bias


@pytest.fixture
def fake_torch_npu(monkeypatch):
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    mod.npu_weight_quant_batchmatmul = _npu_weight_quant_batchmatmul
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    return mod


@pytest.mark.parametrize(
    "fmt",
    ["int4g128", "int4g64-sym", "int4", "int8", "int8g128", "int2g64", "int3g128", "exp4g128"],
)
def test_npu_layout_matches_reference(fake_torch_npu, fmt):
    qt, codes = _codes(fmt)
    bias = torch.randn(64)
    ref = TorchQuantLinear(codes, bias)
    npu = NpuQuantLinear(codes, bias, torch.float32)
    if codes.info.type != "W4A16_EXP":  # 2/3/4-bit codes go to the kernel as int4 in int32
        want = torch.int8 if codes.info.bits == 8 else torch.int32
        assert npu.weight.dtype == want and npu.scale.shape[1] == 64
    x = torch.randn(3, 5, 256)
    torch.testing.assert_close(npu(x), ref(x), atol=1e-4, rtol=1e-4)
    w = qt.dequantize()
    torch.testing.assert_close(ref(x), x @ w.T + bias, atol=1e-4, rtol=1e-4)


def test_reference_partial_group_and_bitexact_weight():
    qt, codes = _codes("exp4g64", shape=(8, 200))
    assert torch.equal(TorchQuantLinear(codes).weight_matrix(), qt.dequantize())
    qt, codes = _codes("int3g64", shape=(8, 200))
    assert torch.equal(TorchQuantLinear(codes).weight_matrix(), qt.dequantize())


def test_w8a8_dynamic_quantizes_activations_per_token():
    qt, codes = _codes("int8-sym", target="ascend", w8a8_dynamic=True)
    assert codes.info.type == "W8A8_DYNAMIC"
    layer = TorchQuantLinear(codes)
    x = torch.randn(4, 256) * torch.tensor([[1.0], [10.0], [0.1], [3.0]])
    xq = quantize_tokens_int8(x)
    s = x.abs().amax(-1, keepdim=True) / 127
    assert torch.allclose(xq / s, torch.round(xq / s), atol=1e-3)  # on each token's int8 grid
    assert (xq - x).abs().max() <= s.max() / 2 + 1e-6
    torch.testing.assert_close(layer(x), xq @ qt.dequantize().T)


def test_resolve_backends(monkeypatch, fake_torch_npu):
    assert resolve("torch")[0] == "torch"
    assert resolve("npu") == ("npu", "npu")
    monkeypatch.delitem(sys.modules, "torch_npu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert resolve("auto")[0] == "torch"  # no torch_npu: the reference backend
    with pytest.raises(LowbitError, match="torch_npu"):
        resolve("npu")
    with pytest.raises(ValueError, match="backend"):
        resolve("cuda")


def test_whole_model_on_the_npu_path(fake_torch_npu, qmodels, tmp_path):
    from pipeline.export import export_artifact
    from pipeline.runtime import load
    from tests.export.models import export_options, tokens

    art = tmp_path / "a"
    export_artifact(
        qmodels.get(("int4g128", "int8", "int2g64", "exp4g128")),
        art,
        export_options(float_dtype="keep"),
    )
    npu = load(art, "npu", device="cpu", dtype=torch.float32)
    ref = load(art, "torch", device="cpu", kernel="reference")
    assert npu.backend == "npu"
    assert any(isinstance(m, NpuQuantLinear) for m in npu.model.modules())
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(
            npu.model(input_ids=x).logits, ref.model(input_ids=x).logits, atol=1e-4, rtol=1e-4
        )
