"""Distillation losses against direct references on tiny tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.lit.losses import (
    attention_distances,
    distill_loss,
    hidden_distances,
    kl_divergence,
    layer_of,
    layer_weights,
    normalised,
)


def _attn(b=2, h=3, t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(b, h, t, t, generator=g), -1)


def test_kl_matches_torch_reference_and_scales_with_temperature():
    g = torch.Generator().manual_seed(0)
    t, s = torch.randn(2, 4, 11, generator=g), torch.randn(2, 4, 11, generator=g)
    for tau in (1.0, 2.0):
        ref = F.kl_div(
            F.log_softmax(s / tau, -1).reshape(-1, 11),
            F.log_softmax(t / tau, -1).reshape(-1, 11),
            log_target=True,
            reduction="batchmean",
        )
        assert torch.allclose(kl_divergence(t, s, tau), ref * tau**2, atol=1e-6)
    assert kl_divergence(t, t.clone()).abs() < 1e-6
    assert kl_divergence(t, s) > 0


def test_kl_rejects_non_positive_temperature():
    x = torch.zeros(1, 1, 3)
    with pytest.raises(ValueError, match="temperature"):
        kl_divergence(x, x, 0.0)


def test_attention_distance_per_layer_reference():
    t = [_attn(seed=0), _attn(seed=1)]
    s = [_attn(seed=2), t[1].clone()]
    d = attention_distances(t, s)
    ref0 = ((t[0] - s[0]) ** 2).sum(-1).mean()
    assert d.shape == (2,)
    assert torch.allclose(d[0], ref0)
    assert d[1] == 0


def test_hidden_distance_is_relative():
    h = torch.randn(2, 5, 8)
    # Same relative perturbation at two scales: the same distance.
    d = hidden_distances([h, 100 * h], [1.1 * h, 110 * h])
    assert torch.allclose(d[0], d[1], rtol=1e-5)
    assert torch.allclose(d[0], torch.tensor(0.01), rtol=1e-4)


def test_layer_count_mismatch_raises():
    with pytest.raises(ValueError, match="teacher has 2"):
        attention_distances([_attn(), _attn()], [_attn()])


def test_layer_of_parses_common_layouts():
    assert layer_of("model.layers.12.self_attn.q_proj") == 12
    assert layer_of("transformer.h.3.attn.c_attn") == 3
    assert layer_of("lm_head") is None


def test_layer_weights_aggregate_mean_and_normalise():
    errors = {
        "model.layers.0.self_attn.q_proj": 0.1,
        "model.layers.0.mlp.up_proj": 0.3,  # layer 0: mean 0.2
        "model.layers.1.self_attn.q_proj": 0.6,  # layer 1: 0.6
        "lm_head": 5.0,  # not a decoder layer: ignored
    }
    w = layer_weights(errors, 3)
    assert torch.allclose(w, torch.tensor([0.25, 0.75, 0.0]))
    assert w[1] > w[0]  # more error, more weight


def test_layer_weights_uniform_without_errors_and_reject_nan():
    assert torch.allclose(layer_weights({}, 4), torch.full((4,), 0.25))
    with pytest.raises(ValueError, match="model.layers.0.q"):
        layer_weights({"model.layers.0.q": float("nan")}, 2)


def test_distill_loss_combines_terms():
    g = torch.Generator().manual_seed(1)
    tl, sl = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g)
    sl.requires_grad_(True)
    ta, sa = [_attn(t=5, seed=3), _attn(t=5, seed=4)], [_attn(t=5, seed=5), _attn(t=5, seed=6)]
    w = torch.tensor([0.3, 0.7])
    out = distill_loss(
        tl, sl, w, alpha=0.5, beta=2.0, temperature=1.0, teacher_attn=ta, student_attn=sa
    )
    attn = (w * attention_distances(ta, sa)).sum()
    assert torch.allclose(out["attn"], attn)
    assert torch.allclose(out["total"], 0.5 * kl_divergence(tl, sl) + 2.0 * attn)
    assert out["hidden"] == 0
    out["total"].backward()
    assert sl.grad is not None and sl.grad.abs().sum() > 0
    # beta = 0: the matching terms are not computed at all.
    assert distill_loss(tl, sl, w, 1.0, 0.0, 1.0, ta, sa)["attn"] == 0


def test_distill_loss_adds_the_students_cross_entropy_on_the_windows_tokens():
    g = torch.Generator().manual_seed(1)
    tl, sl = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g)
    ids = torch.randint(0, 7, (2, 5), generator=g)
    w = torch.tensor([1.0])
    out = distill_loss(tl, sl, w, 1.0, 0.0, 1.0, ce=0.5, ids=ids)
    nll = torch.nn.functional.cross_entropy(sl[:, :-1].reshape(-1, 7), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out["ce"], nll)
    torch.testing.assert_close(out["total"], kl_divergence(tl, sl) + 0.5 * nll)
    # ce = 0 (the default): the term is not computed and the total is the KL alone.
    plain = distill_loss(tl, sl, w, 1.0, 0.0, 1.0, ids=ids)
    assert plain["ce"] == 0 and torch.equal(plain["total"], kl_divergence(tl, sl))


def test_distill_loss_returns_the_per_layer_distances_the_weights_multiply():
    g = torch.Generator().manual_seed(2)
    tl, sl = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g)
    ta, sa = [_attn(t=5, seed=3), _attn(t=5, seed=4)], [_attn(t=5, seed=5), _attn(t=5, seed=6)]
    th = [torch.randn(2, 5, 8, generator=g) for _ in range(2)]
    sh = [torch.randn(2, 5, 8, generator=g) for _ in range(2)]
    w = torch.tensor([0.3, 0.7])
    out = distill_loss(tl, sl, w, 1.0, 1.0, 1.0, ta, sa, th, sh)
    expected = attention_distances(ta, sa) + hidden_distances(th, sh)
    torch.testing.assert_close(out["layers"], expected)
    torch.testing.assert_close((w * out["layers"]).sum(), out["attn"] + out["hidden"])
    assert not out["layers"].requires_grad
    assert torch.equal(distill_loss(tl, sl, w, 1.0, 0.0, 1.0, ta, sa)["layers"], torch.zeros(2))


def test_normalised_weights_sum_to_one_and_follow_the_errors():
    w = normalised(torch.tensor([1.0, 3.0, 0.0]))
    torch.testing.assert_close(w, torch.tensor([0.25, 0.75, 0.0]))
    assert torch.equal(normalised(torch.zeros(4)), torch.full((4,), 0.25))
