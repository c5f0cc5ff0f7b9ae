"""The fitted importance score: NNLS, the KL measurement, and the combined report."""

from __future__ import annotations

import pytest
import torch

from pipeline.analysis.importance import (
    analyze_combined,
    combine,
    fit_importance,
    fit_layer_names,
    measure_kl,
    nnls,
    rank_agreement,
    spearman,
)
from pipeline.analysis.sensitivity import METHODS, analyze
from pipeline.dist import Dist
from pipeline.quant.rtn import quantize_rtn
from tests.analysis.conftest import tiny_llama, windows

FORMATS = ["int2g32", "int4", "int8"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def predicted(model):
    x = windows()
    return {
        m: {la["name"]: la["dloss"] for la in analyze(model, x, FORMATS, m, probes=2)["layers"]}
        for m in METHODS
    }


def test_nnls_matches_the_constrained_optimum():
    g = torch.Generator().manual_seed(0)
    A = torch.rand(20, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 1e6, 1e-4])
    b = A @ torch.tensor([2.0, 0.0, 3e3], dtype=torch.float64)
    torch.testing.assert_close(nnls(A, b), torch.tensor([2.0, 0.0, 3e3], dtype=torch.float64))
    # The unconstrained solution has a negative weight; NNLS clips it and refits the rest.
    b = A[:, 0] - 0.5e-6 * A[:, 1]
    w = nnls(A, b)
    assert (w >= 0).all() and w[1] == 0
    grid = [nnls(A[:, [0, 2]], b)]  # the best support without the negative column
    torch.testing.assert_close(w[[0, 2]], grid[0])


def test_fit_recovers_a_synthetic_relation_on_a_tiny_model(predicted):
    """Measured = 2·fisher exactly: fisher's weight is 2, the others' 0, and the held-out ρ is
    perfect."""
    names = list(predicted["fisher"])
    fit = fit_layer_names(names, 6)
    held_out = [n for n in names if n not in fit]
    measured = {n: {f: 2 * predicted["fisher"][n][f] for f in FORMATS} for n in names}
    w = fit_importance(predicted, {n: measured[n] for n in fit})
    assert w["fisher"] == pytest.approx(2.0, rel=1e-6)
    assert all(w[m] == pytest.approx(0.0, abs=1e-9) for m in METHODS if m != "fisher")
    rho = rank_agreement(combine(predicted, w), measured, held_out)
    assert all(r == pytest.approx(1.0) for r in rho.values())
    # Another estimator on its own does not rank the held-out layers perfectly.
    assert min(rank_agreement(predicted["gptq_proxy"], measured, held_out).values()) < 0.99


def test_fit_mixes_estimators_when_the_truth_does(predicted):
    names = list(predicted["fisher"])
    measured = {n: {f: 0.5 * predicted["fisher"][n][f] + 3.0 * predicted["gptq_proxy"][n][f]
                    for f in FORMATS} for n in names}  # fmt: skip
    w = fit_importance(predicted, measured)
    truth = {m: {"fisher": 0.5, "gptq_proxy": 3.0}.get(m, 0.0) for m in METHODS}
    assert w == pytest.approx(truth, rel=1e-6)


def test_measure_kl_is_the_kl_of_one_quantized_layer(model):
    x = windows()
    name = "model.layers.1.mlp.down_proj"
    got = measure_kl(model, x, [name], ["int2g32", "int8"], batch_size=4)[name]
    with torch.no_grad():
        base = model(input_ids=x).logits[:, :-1].log_softmax(-1)
        w = model.get_submodule(name).weight
        orig = w.clone()
        w.copy_(quantize_rtn(orig, "int2g32").dequantize())
        q = model(input_ids=x).logits[:, :-1].log_softmax(-1)
        w.copy_(orig)
    expect = (base.exp() * (base - q)).sum(-1).mean()
    assert got["int2g32"] == pytest.approx(float(expect), rel=1e-5)
    assert 0 < got["int8"] < got["int2g32"] / 100
    torch.testing.assert_close(model.get_submodule(name).weight, orig)  # restored


def test_spearman_averages_ties():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)  # scipy's value


def test_combined_report_uses_the_fitted_weights(model):
    x = windows()
    report = analyze_combined(model, x, FORMATS, Dist(), fit_layers=5, probes=2)
    imp = report["importance"]
    assert report["method"] == "combined" and len(imp["fit_layers"]) == 5
    assert all(w >= 0 for w in imp["weights"].values()) and any(imp["weights"].values())
    for layer in report["layers"]:
        est = layer["estimators"]
        for f in FORMATS:
            expect = sum(w * est[m][f] for m, w in imp["weights"].items())
            assert layer["dloss"][f] == pytest.approx(expect)
    assert set(imp["rho_fit"]) == {*METHODS, "combined"}
    assert set(imp["measured_kl"]) == set(imp["fit_layers"])
