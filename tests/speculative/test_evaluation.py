"""Per-scenario acceptance tables and their plot."""

import torch

from pipeline.speculative.evaluation import acceptance_table, column, plot_acceptance

VOCAB = 64


def _scenarios():
    gen = torch.Generator().manual_seed(0)
    return {
        "long": torch.randint(0, VOCAB, (2, 20), generator=gen).tolist(),
        "mix": torch.randint(0, VOCAB, (3, 8), generator=gen).tolist(),
    }


def test_self_pair_accepts_everything_and_a_stranger_does_not(target, stranger):
    table = acceptance_table(
        {"t": target},
        {"self": target, "other": stranger},
        _scenarios(),
        gamma=3,
        temperature=0.0,  # random tiny models are near-uniform: compare their argmaxes
        new_tokens=8,
        max_prompts=2,
    )
    assert set(table) == {"self@t", "other@t"}
    for m in table["self@t"].values():
        assert abs(m["alpha_tf"] - 1) < 1e-5 and abs(m["alpha"] - 1) < 1e-5
        assert m["acceptance_rate"] == 1.0 and m["tau"] > 2.0
        assert "tokens_per_s" not in m
    assert all(m["alpha"] < 0.5 for m in table["other@t"].values())


def test_column_and_plot(target, stranger):
    table = acceptance_table(
        {"t": target}, {"d": stranger}, _scenarios(), new_tokens=4, max_prompts=1
    )
    col = column(table, "d@t")
    assert set(col) == {"long", "mix", "mean"}
    assert abs(col["mean"] - (col["long"] + col["mix"]) / 2) < 1e-9
    fig = plot_acceptance({"before": col, "after": col})
    assert len(fig.axes[0].patches) == 2 * 3  # two series, three groups
