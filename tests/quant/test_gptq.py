"""GPTQ: Hessian accumulation, error vs RTN, the loss it reports, robustness."""

import pytest
import torch

from pipeline.quant.gptq import HessianAccumulator, gptq_quantize
from pipeline.quant.rtn import quantize_rtn


def _layer(out=32, n_in=128, n=1024, seed=0):
    """A linear with correlated calibration inputs (low-rank mixing plus noise)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(16, n_in, generator=g)
    x = torch.randn(n, 16, generator=g) @ mix + 0.1 * torch.randn(n, n_in, generator=g)
    w = torch.randn(out, n_in, generator=g) * 0.05
    return w, x


def _hessian(x):
    acc = HessianAccumulator(x.shape[-1])
    for chunk in x.split(100):
        acc.add_batch(chunk)
    return acc


def _output_error(w, q, x):
    """Mean over samples of ||(W - Q) x||^2."""
    return ((x @ (w - q).T) ** 2).sum(1).mean().item()


def test_accumulator_is_the_running_mean_of_2xxT():
    _, x = _layer()
    acc = _hessian(x.view(8, -1, 128))  # leading dims are all samples
    torch.testing.assert_close(acc.H, 2 * x.T @ x / len(x), rtol=1e-4, atol=1e-4)
    assert acc.n_samples == len(x)
    a, b = _hessian(x[:300]), _hessian(x[300:])
    a.merge(b)
    torch.testing.assert_close(a.H, acc.H, rtol=1e-4, atol=1e-4)


def test_accumulator_rejects_wrong_width():
    with pytest.raises(ValueError, match="128"):
        HessianAccumulator(128).add_batch(torch.zeros(4, 64))


@pytest.mark.parametrize("name", ["int4g32", "int3g64-sym", "int2g64", "exp4g32", "int4"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_correlated_inputs(name, act_order):
    w, x = _layer()
    H = _hessian(x).H
    q, _ = gptq_quantize(w, H, name, act_order=act_order)
    rtn = quantize_rtn(w, name)
    assert _output_error(w, q.dequantize(), x) < 0.8 * _output_error(w, rtn.dequantize(), x)


@pytest.mark.parametrize(
    ("name", "act_order", "block_size"),
    [("int4g32", False, 128), ("int4g32", True, 48), ("exp4g64", True, 40), ("int3", False, 16)],
)
def test_reported_loss_is_the_output_error_and_block_size_free(name, act_order, block_size):
    """With no dampening the summed GPTQ loss equals the layer-output error exactly, which
    also checks that the stored codes (un-permuted) are the ones the loop quantized."""
    w, x = _layer(n_in=96, n=2048)
    H = _hessian(x.double()).H.float()
    q, loss = gptq_quantize(w, H, name, block_size=block_size, damp=0.0, act_order=act_order)
    assert loss == pytest.approx(_output_error(w, q.dequantize(), x), rel=2e-3)
    q_ref, _ = gptq_quantize(w, H, name, block_size=96, damp=0.0, act_order=act_order)
    assert torch.equal(q.dequantize(), q_ref.dequantize())


def test_dead_inputs_are_zeroed_not_fatal():
    w, x = _layer()
    x[:, :5] = 0.0  # never-activated inputs
    q, loss = gptq_quantize(w, _hessian(x).H, "int4g32")
    assert torch.isfinite(torch.tensor(loss))
    assert torch.equal(q.dequantize()[:, :5], torch.zeros(32, 5))


def test_non_positive_definite_hessian_gets_more_dampening():
    w, _ = _layer(n_in=64)
    v = torch.randn(64, 1)
    H = v @ v.T - 1e-3 * torch.eye(64)  # rank one and indefinite
    with pytest.warns(UserWarning, match="damp"):
        q, loss = gptq_quantize(w, H, "int4g32", damp=0.0)
    assert torch.isfinite(q.dequantize()).all() and loss == loss


def test_bad_hessians_raise_clear_errors():
    w, _ = _layer(n_in=64)
    with pytest.raises(ValueError, match="does not match"):
        gptq_quantize(w, torch.eye(32), "int4g32")
    with pytest.raises(ValueError, match="NaN"):
        gptq_quantize(w, torch.full((64, 64), float("nan")), "int4g32")


def test_float_format_passes_through():
    w, x = _layer()
    q, loss = gptq_quantize(w, _hessian(x).H, "float")
    assert torch.equal(q.dequantize(), w.half().float())
    assert loss == pytest.approx(_output_error(w, q.dequantize(), x), rel=1e-2)
