"""Kept outlier columns (quant.outliers=keep_fp16): QTensor, RTN, GPTQ, fake-quant, storage."""

from __future__ import annotations

import pytest
import torch

from pipeline.analysis.capture import outlier_columns
from pipeline.quant.allocate import kept_bits
from pipeline.quant.fakequant import FakeQuantLinear
from pipeline.quant.gptq import HessianAccumulator, gptq_quantize
from pipeline.quant.qtensor import QTensor
from pipeline.quant.rtn import quantize_rtn

KEEP = [3, 17, 40]


def _planted(out=32, n_in=64, n=2048, seed=0):
    """A weight and inputs whose channels KEEP are 30x larger than the rest (LLM.int8()'s
    emergent outlier features)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=g)
    x[:, KEEP] *= 30.0
    w = torch.randn(out, n_in, generator=g) * 0.05
    return w, x


def _output_error(w, q, x):
    return ((x @ (w - q).T) ** 2).sum(1).mean().item()


@pytest.mark.parametrize("fmt", ["int2g32", "int3g32-sym", "exp4g32"])
def test_rtn_keeps_columns_exactly_and_nothing_else_changes(fmt):
    w, _ = _planted()
    plain, kept = quantize_rtn(w, fmt), quantize_rtn(w, fmt, keep=torch.tensor(KEEP))
    wq = kept.dequantize()
    assert torch.equal(wq[:, KEEP], w[:, KEEP].half().float())  # exact up to fp16 storage
    others = [j for j in range(w.shape[1]) if j not in KEEP]
    assert torch.equal(wq[:, others], plain.dequantize()[:, others])
    assert not torch.equal(plain.dequantize()[:, KEEP], wq[:, KEEP])  # the feature acted
    assert kept.kept == 3 and kept.keep_idx.dtype == torch.int32
    assert kept.keep_vals.dtype == torch.float16 and kept.keep_vals.shape == (32, 3)


def test_state_dict_roundtrip_and_absent_without_columns():
    w, _ = _planted()
    qt = quantize_rtn(w, "int2g32", keep=[40, 3])
    assert qt.keep_idx.tolist() == [3, 40]  # ascending
    sd = qt.to_state_dict("p")
    assert {"p.keep_idx", "p.keep_vals"} <= set(sd)
    back = QTensor.from_state_dict(sd, "p")
    assert torch.equal(back.dequantize(), qt.dequantize())
    assert not any("keep" in k for k in quantize_rtn(w, "int2g32").to_state_dict("p"))
    with pytest.raises(ValueError, match="keep_vals"):
        QTensor(qt.codes, qt.scales, qt.zeros, qt.fmt, qt.shape, keep_idx=qt.keep_idx,
                keep_vals=qt.keep_vals[:, :1])  # fmt: skip


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_kept_columns_has_lower_output_error(act_order):
    w, x = _planted()
    acc = HessianAccumulator(w.shape[1])
    acc.add_batch(x)
    opts = dict(block_size=16, damp=0.0, act_order=act_order)
    plain, _ = gptq_quantize(w, acc.H, "int2g32", **opts)
    kept, loss = gptq_quantize(w, acc.H, "int2g32", keep=torch.tensor(KEEP), **opts)
    e_plain, e_kept = (
        _output_error(w, plain.dequantize(), x),
        _output_error(w, kept.dequantize(), x),
    )
    assert e_kept < 0.5 * e_plain, (e_kept, e_plain)
    # Keeping the same columns without compensating onto them (RTN's way) is worse: GPTQ
    # pushes the other columns' error onto the kept ones, whose stored values then differ.
    naive = plain.dequantize().clone()
    naive[:, KEEP] = w[:, KEEP]
    assert e_kept < _output_error(w, naive, x)
    assert not torch.equal(kept.keep_vals, w[:, KEEP].half())
    assert loss == pytest.approx(e_kept, rel=2e-3)  # the reported loss is still the error


def test_fakequant_reproduces_kept_columns_and_freezes_them():
    w, x = _planted()
    qt = quantize_rtn(w, "int3g32", keep=KEEP)
    for learn_weights in (False, True):
        layer = FakeQuantLinear.from_qtensor(qt, learn_weights=learn_weights)
        torch.testing.assert_close(layer.quantized_weight(), qt.dequantize(), rtol=0, atol=0)
        layer(x[:8]).square().sum().backward()
        if learn_weights:
            assert layer.weight.grad[:, KEEP].abs().max() == 0  # frozen
            assert layer.weight.grad.abs().max() > 0
        back = layer.to_qtensor()
        assert torch.equal(back.keep_idx, qt.keep_idx) and torch.equal(back.keep_vals, qt.keep_vals)
        assert "kept_columns=3" in repr(layer)


def test_outlier_columns_ranked_by_absmax_and_capped():
    a = torch.ones(100)
    a[[5, 50, 70, 90]] = torch.tensor([20.0, 50.0, 30.0, 40.0])
    assert outlier_columns(a, 0.25) == [5, 50, 70, 90]
    assert outlier_columns(a, 0.02) == [50, 90]  # the two largest, ascending
    assert outlier_columns(a, 0.005) == []  # floor(0.5) columns


def test_kept_bits_counts_fp16_values_and_int32_indices():
    assert kept_bits(32, 3) == 3 * 32 * 16 + 3 * 32
    qt = quantize_rtn(torch.randn(32, 64), "int2g32", keep=KEEP)
    stored = sum(t.numel() * t.element_size() * 8 for k, t in qt.to_state_dict().items()
                 if k.startswith("keep"))  # fmt: skip
    assert stored == kept_bits(32, 3)
