"""Curvature estimators on a tiny Llama: against direct autograd, and across 2 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline.analysis.estimators import (
    _probe_sequence,
    _rademacher,
    fisher_diagonal,
    hutchinson_trace,
    mean_gradient,
    sequence_loss,
)
from pipeline.analysis.scores import gptq_share, gradient_weigh
from pipeline.analysis.sensitivity import analyze
from pipeline.dist import Dist
from pipeline.lit.losses import kl_divergence
from pipeline.quant.sequential import QuantOptions
from tests.analysis.conftest import tiny_llama, windows

FORMATS = ["int2", "int4"]  # per channel: rows of 8 and 16 weights


def test_fisher_is_mean_squared_sequence_gradient():
    model, x = tiny_llama(), windows()
    params = {"lm_head": model.lm_head.weight, "down": model.model.layers[1].mlp.down_proj.weight}
    fisher = fisher_diagonal(model, x, params, Dist())
    tokens = x.shape[1] - 1
    expect = {n: torch.zeros_like(p) for n, p in params.items()}
    for s in range(len(x)):
        grads = torch.autograd.grad(sequence_loss(model, x[s : s + 1]), list(params.values()))
        for name, g in zip(params, grads):
            expect[name] += g * g * tokens
    for name in params:
        torch.testing.assert_close(fisher[name], expect[name] / len(x), rtol=1e-5, atol=1e-10)


def test_gradient_term_is_the_first_order_change_of_the_loss():
    """|ḡ·δ| is the mean gradient (one per window, data labels) contracted with δ, and for a
    small δ it is the loss change a step along δ makes (the first-order Taylor term)."""
    model, x = tiny_llama(), windows()
    w = model.model.layers[1].mlp.down_proj.weight
    grad = mean_gradient(model, x, {"down": w}, Dist())["down"]
    expect = sum(
        torch.autograd.grad(sequence_loss(model, x[s : s + 1]), [w])[0] for s in range(len(x))
    )
    torch.testing.assert_close(grad, expect / len(x), rtol=1e-5, atol=1e-10)
    delta = 1e-3 * grad / grad.norm()  # along the gradient: the first-order term dominates
    with torch.no_grad():
        base = sum(float(sequence_loss(model, x[s : s + 1])) for s in range(len(x)))
        w.add_(delta)
        moved = sum(float(sequence_loss(model, x[s : s + 1])) for s in range(len(x)))
        w.sub_(delta)
    predicted = float(gradient_weigh(grad)(delta))
    assert predicted == pytest.approx((moved - base) / len(x), rel=0.05)


def test_model_label_fisher_predicts_the_kl_of_a_perturbation():
    """½ Σ F δ² with sampled labels is the second-order KL(p_w ‖ p_{w+δ}) per token."""
    model, x = tiny_llama(), windows(n=64, seq_len=16)
    w = model.model.layers[1].mlp.down_proj.weight
    fisher = fisher_diagonal(model, x, {"down": w}, Dist(), labels="model", seed=3)["down"]
    delta = 0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(input_ids=x).logits[:, :-1]
        w.add_(delta)
        moved = model(input_ids=x).logits[:, :-1]
        w.sub_(delta)
    kl = float(kl_divergence(base, moved))
    predicted = 0.5 * float((fisher * delta**2).sum())
    # Diagonal and sampled: an estimate, but of the right quantity (not a data-label artefact).
    assert 0.5 < predicted / kl < 2.0, (predicted, kl)
    again = fisher_diagonal(model, x, {"down": w}, Dist(), labels="model", seed=3)["down"]
    torch.testing.assert_close(again, fisher)  # seeded: the same labels every time


def test_hutchinson_probe_is_exact_vHv():
    """One probe's vᵀHv equals the explicit Hessian (built column by column) contracted with v."""
    model, x = tiny_llama(), windows(n=1)
    w = model.model.layers[0].post_attention_layernorm.weight  # (8,): 8 Hessian columns
    with sdpa_kernel(SDPBackend.MATH):  # the fused CPU kernel has no double backward
        (g,) = torch.autograd.grad(sequence_loss(model, x), [w], create_graph=True)
    g = g.reshape(-1)
    H = torch.stack(
        [torch.autograd.grad(g[i], [w], retain_graph=True)[0].reshape(-1) for i in range(g.numel())]
    )  # (8, 8)
    got = _probe_sequence(model, x, [w], probes=1, seed=7)
    v = _rademacher(w.shape, torch.Generator().manual_seed(7), w.device).reshape(-1)
    assert float(got[0]) == pytest.approx(float(v @ H @ v), rel=1e-4)
    tr = hutchinson_trace(model, x, {"o": w}, Dist(), probes=1, seed=0)
    assert set(tr) == {"o"}


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        dist = Dist(rank, world)
        model, x = tiny_llama(), windows(n=5)  # 5 sequences: ranks get 3 and 2
        results = {
            m: analyze(model, x, FORMATS, m, dist, probes=2, batch_size=2)
            for m in ("fisher", "hutchinson", "gptq_proxy", "gradient")
        }
        if rank == 0:
            torch.save(results, out)
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_give_the_single_process_result(tmp_path):
    out = tmp_path / "ranks.pt"
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    multi = torch.load(out, weights_only=False)
    model, x = tiny_llama(), windows(n=5)
    for method, report in multi.items():
        single = analyze(model, x, FORMATS, method, Dist(), probes=2, batch_size=2)
        assert [layer["name"] for layer in report["layers"]] == [
            layer["name"] for layer in single["layers"]
        ]
        for a, b in zip(report["layers"], single["layers"]):
            for f in FORMATS:
                assert a["dloss"][f] == pytest.approx(b["dloss"][f], rel=1e-5, abs=1e-12), (
                    method,
                    a["name"],
                    f,
                )
            for key, value in b["outliers"].items():
                expect = None if value is None else pytest.approx(value, rel=1e-6)
                assert a["outliers"][key] == expect, (method, a["name"], key)


def test_tied_embeddings_are_scored_once_as_lm_head():
    report = analyze(tiny_llama(tied=True), windows(n=2), ["int4"], "gptq_proxy")
    names = [layer["name"] for layer in report["layers"]]
    assert "model.embed_tokens" not in names and names[-1] == "lm_head"
    assert report["tied_embeddings"] and len(names) == 1 + 7 * 2
    assert all(layer["dloss"]["int4"] > 0 for layer in report["layers"])


def test_gptq_delta_scales_each_linear_by_the_share_gptq_leaves():
    """delta=gptq: a linear's ΔL is the estimator's ΔL of RTN's δ times ``gptq_share`` under the
    Hessian of the layer's own inputs; the embedding table (no GPTQ) keeps its ΔL."""
    model, x = tiny_llama(), windows(n=4)
    opts = QuantOptions("gptq", block_size=8, damp=0.01, act_order=True)
    plain = analyze(model, x, FORMATS, "fisher", batch_size=2)
    scaled = analyze(model, x, FORMATS, "fisher", batch_size=2, gptq=opts)
    assert (plain["delta"], scaled["delta"]) == ("rtn", "gptq")
    inputs: dict[str, list] = {}
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: inputs.setdefault(n, []).append(a[0]))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]  # fmt: skip
    with torch.no_grad():
        model(input_ids=x)
    for h in hooks:
        h.remove()
    moved = 0
    for a, b in zip(plain["layers"], scaled["layers"]):
        name = a["name"]
        if name == "model.embed_tokens":
            assert a["dloss"] == b["dloss"]
            continue
        xs = torch.cat(inputs[name]).reshape(-1, model.get_submodule(name).in_features)
        share = gptq_share(model.get_submodule(name).weight, 2 * xs.T @ xs / len(xs), FORMATS, opts)
        for f in FORMATS:
            assert b["dloss"][f] == pytest.approx(a["dloss"][f] * share[f], rel=1e-3), (name, f)
            moved += share[f] < 0.99
    assert moved > 0  # GPTQ left less than RTN's error somewhere
