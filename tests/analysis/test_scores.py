"""ΔL weightings against direct formulas on tiny tensors."""

from __future__ import annotations

import pytest
import torch

from pipeline.analysis.scores import (
    embedding_weigh,
    fisher_weigh,
    gptq_share,
    hessian_weigh,
    layer_dloss,
    quant_error,
    trace_weigh,
)
from pipeline.quant.gptq import gptq_quantize
from pipeline.quant.rtn import quantize_rtn
from pipeline.quant.sequential import QuantOptions

FORMATS = ["int2g32", "int3g32", "int4g32", "int8"]


def test_quant_error_is_rtn_minus_weight():
    w = torch.randn(8, 64)
    d = quant_error(w, "int3g32")
    assert torch.equal(d, quantize_rtn(w, "int3g32").dequantize() - w)


def test_fisher_dloss_matches_formula_and_falls_with_bits():
    torch.manual_seed(0)
    w, f = torch.randn(16, 64), torch.rand(16, 64)
    dl = layer_dloss(w, FORMATS, fisher_weigh(f))
    d = quant_error(w, "int3g32")
    assert dl["int3g32"] == pytest.approx(0.5 * float((f * d * d).sum()), rel=1e-6)
    values = [dl[k] for k in FORMATS]
    assert values == sorted(values, reverse=True) and values[-1] > 0


def test_full_hessian_weighting_is_mean_output_error():
    """½ Σ_rows δ H δᵀ with H = 2/N Σ x xᵀ equals the mean ‖δ x‖² over the N inputs."""
    torch.manual_seed(0)
    x = torch.randn(500, 32)  # (N, in)
    H = 2 * x.T @ x / x.shape[0]
    d = torch.randn(8, 32)
    direct = float(((x @ d.T) ** 2).sum(1).mean())
    assert float(hessian_weigh(H, "full")(d)) == pytest.approx(direct, rel=1e-4)
    diag = 0.5 * float((d * d * H.diagonal()).sum())
    assert float(hessian_weigh(H, "diag")(d)) == pytest.approx(diag, rel=1e-6)
    with pytest.raises(ValueError, match="full"):
        hessian_weigh(H, "rows")


def test_trace_weighting_clamps_negative_traces():
    d = torch.ones(4, 8)
    assert float(trace_weigh(6.4, 32)(d)) == pytest.approx(0.5 * 6.4 / 32 * 32)
    assert float(trace_weigh(-1.0, 32)(d)) == 0.0


def test_embedding_weighting_ignores_unseen_tokens():
    d = torch.zeros(5, 4)
    d[3] = 1.0  # error only on token 3
    counts = torch.tensor([4.0, 0, 0, 0, 0])
    assert float(embedding_weigh(counts)(d)) == 0.0
    counts[3] = 4.0  # token 3 is half of all tokens: Σ freq ‖δ‖² = 0.5 * 4
    assert float(embedding_weigh(counts)(d)) == pytest.approx(2.0)


def test_gptq_share_is_the_output_error_gptq_leaves_of_rtns():
    """Inputs on a few directions: GPTQ moves the error where no input goes, so it leaves a small
    share of RTN's output error; the share is the ratio of the two errors under H."""
    torch.manual_seed(0)
    x = torch.randn(400, 4) @ torch.randn(4, 64)  # (N, in), rank 4
    H = 2 * x.T @ x / len(x)
    w = torch.randn(16, 64)
    opts = QuantOptions("gptq", block_size=32, damp=0.01, act_order=True)
    share = gptq_share(w, H, ["int2g32", "int4g32"], opts)
    assert all(0 < s < 0.2 for s in share.values())
    qt, _ = gptq_quantize(w, H, "int2g32", 32, 0.01, True)
    g, r = qt.dequantize() - w, quant_error(w, "int2g32")
    assert share["int2g32"] == pytest.approx(float(((g @ H) * g).sum() / ((r @ H) * r).sum()))
    # inputs in every direction leave GPTQ less room: a larger share
    full = torch.randn(400, 64)
    assert gptq_share(w, 2 * full.T @ full / 400, ["int2g32"], opts)["int2g32"] > 0.5


def test_gptq_share_of_a_weight_rtn_stores_exactly_is_one():
    w = quantize_rtn(torch.randn(8, 64), "int4g32").dequantize()  # already on the grid
    opts = QuantOptions("gptq", block_size=32, damp=0.01, act_order=False)
    assert gptq_share(w, torch.eye(64), ["int4g32"], opts) == {"int4g32": 1.0}
