"""error_flow: zero for identical models, grows where a layer was perturbed; plot and table."""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline.analysis.errorflow import error_flow, format_error_flow, plot_error_flow
from tests.analysis.conftest import tiny_llama, windows


def test_identical_models_have_zero_error():
    model = tiny_llama()
    errors = error_flow(model, copy.deepcopy(model), windows(), batch_size=4)
    assert len(errors) == model.config.num_hidden_layers
    assert errors == pytest.approx([0.0] * len(errors), abs=1e-7)


def test_perturbing_one_layer_shows_from_that_layer_on():
    fp = tiny_llama()
    q = copy.deepcopy(fp)
    with torch.no_grad():
        w = q.model.layers[1].mlp.down_proj.weight
        w.add_(0.3 * torch.randn_like(w))
    errors = error_flow(fp, q, windows())
    assert errors[0] == pytest.approx(0.0, abs=1e-7)  # layer 0 untouched
    assert errors[1] > 1e-3

    # A larger perturbation gives a larger error, and perturbing layer 0 propagates.
    q2 = copy.deepcopy(fp)
    with torch.no_grad():
        q2.model.layers[1].mlp.down_proj.weight.copy_(w + 0.6 * torch.randn_like(w))
        q2.model.layers[0].self_attn.v_proj.weight.mul_(1.5)
    errors2 = error_flow(fp, q2, windows())
    assert errors2[0] > 1e-3
    assert errors2[1] > errors[1]


def test_batching_does_not_change_the_result():
    fp, q = tiny_llama(0), tiny_llama(1)
    x = windows(n=7)
    assert error_flow(fp, q, x, batch_size=2) == pytest.approx(error_flow(fp, q, x, batch_size=7))


def test_depth_mismatch_and_empty_windows_are_rejected():
    fp = tiny_llama()
    with pytest.raises(ValueError, match="non-empty"):
        error_flow(fp, fp, torch.zeros(0, 4, dtype=torch.long))
    shallow = copy.deepcopy(fp)
    shallow.model.layers = shallow.model.layers[:1]
    shallow.config.num_hidden_layers = 1
    with pytest.raises(ValueError, match="differ in depth"):
        error_flow(fp, shallow, windows())


def test_plot_and_table():
    curves = {"quantized": [0.01, 0.05], "distilled": [0.005, 0.02]}
    fig = plot_error_flow(curves)
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["quantized", "distilled"]
    assert ax.get_yscale() == "log"
    table = format_error_flow(curves)
    assert "| 1 | 0.0500 | 0.0200 |" in table
    import matplotlib.pyplot as plt

    plt.close(fig)
