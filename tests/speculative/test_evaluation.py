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


def test_adaptive_draft_length_per_pair_and_scenario(target, stranger):
    from pipeline.speculative.adaptive import AdaptiveGamma

    made = []

    def adaptive(draft, target_name):
        made.append((draft, target_name))
        return AdaptiveGamma(2, 5, 64, cost_ratio=0.1)

    kwargs = dict(temperature=0.0, new_tokens=12, max_prompts=2)
    fixed = acceptance_table({"t": target}, {"self": target}, _scenarios(), gamma=2, **kwargs)
    table = acceptance_table(
        {"t": target},
        {"self": target, "other": stranger},
        _scenarios(),
        adaptive=adaptive,
        **kwargs,
    )
    assert made == [("self", "t")] * 2 + [("other", "t")] * 2  # one window per scenario
    for scen, m in table["self@t"].items():
        # Everything accepted: the window pushes gamma up to 5 and each target call emits more.
        assert m["gamma"] > 3.5 and m["tau"] > fixed["self@t"][scen]["tau"]
        assert fixed["self@t"][scen]["gamma"] == 2
    assert all(m["gamma"] < 3 for m in table["other@t"].values())  # rejections: gamma down


def test_the_temperature_schedule_reaches_the_decoder(target, stranger, monkeypatch):
    from pipeline.speculative import evaluation

    seen = []
    real = evaluation.speculative_generate

    def spy(*args, **kwargs):
        seen.append(kwargs["temperature_schedule"])
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation, "speculative_generate", spy)
    for on in (False, True):
        acceptance_table(
            {"t": target}, {"d": stranger}, _scenarios(), new_tokens=4, max_prompts=1,
            temperature_schedule=on,
        )  # fmt: skip
    assert seen == [False, False, True, True]
