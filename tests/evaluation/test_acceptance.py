"""Per-scenario acceptance tables, their plot, the pairs a run measures and their costs."""

import torch

from pipeline.evaluation.acceptance import acceptance_table, column, plot_acceptance

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
    from pipeline.speculative import decoding

    seen = []
    real = decoding.speculative_generate

    def spy(*args, **kwargs):
        seen.append(kwargs["temperature_schedule"])
        return real(*args, **kwargs)

    monkeypatch.setattr(decoding, "speculative_generate", spy)  # what speculative_decoder calls
    for on in (False, True):
        acceptance_table(
            {"t": target}, {"d": stranger}, _scenarios(), new_tokens=4, max_prompts=1,
            temperature_schedule=on,
        )  # fmt: skip
    assert seen == [False, False, True, True]


def test_the_greedy_mode_is_measured_beside_the_temperature(target, stranger, monkeypatch):
    """With `greedy`, each cell also holds greedy decoding's numbers: the same as a table decoded
    at temperature 0, and decoded once more only when the temperature is not 0 already."""
    from pytest import approx

    from pipeline.speculative import decoding

    decoded_at = []
    real = decoding.speculative_generate

    def spy(*args, **kwargs):
        decoded_at.append(kwargs["temperature"])
        return real(*args, **kwargs)

    monkeypatch.setattr(decoding, "speculative_generate", spy)
    models = ({"t": target}, {"self": target, "other": stranger}, _scenarios())
    kwargs = dict(gamma=3, new_tokens=8, max_prompts=2)
    both = acceptance_table(*models, temperature=1.0, greedy=True, **kwargs)
    assert decoded_at == ([1.0] * 2 + [0.0] * 2) * 4  # 2 pairs x 2 scenarios, 2 prompts each
    decoded_at.clear()
    greedy = acceptance_table(*models, temperature=0.0, greedy=True, **kwargs)
    assert decoded_at == [0.0] * 8
    for pair, per in both.items():
        for scen, m in per.items():
            g = greedy[pair][scen]
            assert m["greedy_match"] == approx(g["alpha_tf"]) == approx(g["greedy_match"])
            assert m["alpha_greedy"] == approx(g["alpha"]) and m["tau_greedy"] == approx(g["tau"])
    for m in both["self@t"].values():  # a draft that is its target: every argmax agrees
        assert m["greedy_match"] == approx(1.0) and m["tau_greedy"] > 2.0
    assert all(m["greedy_match"] < 0.5 for m in both["other@t"].values())


def test_the_adaptive_draft_length_is_priced_with_the_measured_costs(monkeypatch):
    from pipeline.evaluation import acceptance
    from tests.speculative.conftest import perturbed, tiny_llama

    # Stand-in timings (cost.py's own tests time real models): c by draft, v by gamma.
    timed = []

    def cost_ratio(target, draft, input_ids):
        timed.append(("c", draft.tag))
        return {"near": 0.5, "small": 0.05}[draft.tag]

    def verify_cost(target, gammas, input_ids):
        timed.append(("v", target.tag))
        return {g: 1.0 + g / 10 for g in gammas}

    monkeypatch.setattr(acceptance, "measure_cost_ratio", cost_ratio)
    monkeypatch.setattr(acceptance, "measure_verify_cost", verify_cost)
    target = tiny_llama(0)
    models = {"t": target, "near": perturbed(target, 0.004, seed=1), "small": tiny_llama(2)}
    for name, m in models.items():
        m.tag = name
    pairs = [("near", "t"), ("small", "t")]
    costs = acceptance.measure_costs(models, pairs, list(range(16)), range(2, 6))
    assert sorted(timed) == [("c", "near"), ("c", "small"), ("v", "t")]  # v once per target
    assert costs["small@t"]["cost_ratio"] == 0.05 and costs["near@t"]["cost_ratio"] == 0.5
    assert costs["near@t"]["verify_cost"] == {2: 1.2, 3: 1.3, 4: 1.4, 5: 1.5}
    make = acceptance.adaptive_gamma(costs, 2, 5, 64)
    window = make("small", "t")
    assert window.cost_ratio == 0.05 and window.verify_cost == costs["small@t"]["verify_cost"]
    assert (window.gamma_min, window.gamma_max, window._rounds.maxlen) == (2, 5, 64)
    assert make("small", "t") is not window  # a fresh window per scenario


def test_run_pairs_take_the_final_low_bit_target_and_self_speculation():
    from pipeline.evaluation.acceptance import run_pairs

    assert run_pairs(["target_fp"], ["draft_fp"]) == [("draft_fp", "target_fp")]
    targets = ["target_fp", "target_quantized", "target_distilled"]
    assert run_pairs(targets, ["draft_fp", "draft_reinforced"]) == [
        ("draft_fp", "target_fp"),
        ("draft_fp", "target_distilled"),
        ("draft_reinforced", "target_distilled"),
        ("target_distilled", "target_fp"),
    ]
    assert run_pairs(["target_fp", "target_quantized"], []) == [("target_quantized", "target_fp")]


def test_new_tokens_per_scenario(target):
    """{scenario: n}: each scenario decodes its own count (the long one up to the method's 512)."""
    kwargs = dict(gamma=3, temperature=0.0, max_prompts=1)
    per = acceptance_table(
        {"t": target}, {"self": target}, _scenarios(), new_tokens={"long": 24, "mix": 2}, **kwargs
    )["self@t"]
    for n, scen in ((24, "long"), (2, "mix")):
        alone = acceptance_table(
            {"t": target}, {"self": target}, _scenarios(), new_tokens=n, **kwargs
        )
        assert per[scen] == alone["self@t"][scen]
    # a self pair accepts every draft: 2 tokens take one target call, 24 take several of 4
    assert per["mix"]["tau"] <= 2.0 < per["long"]["tau"]


def test_scenarios_cut_from_batched_tokenization_equal_one_call(monkeypatch):
    """Tokenizing a split a batch of documents at a time (its peak is one batch's encodings)
    cuts the very prompts one call over every document does."""
    from pipeline.data.scenarios import build_scenarios
    from pipeline.evaluation import acceptance
    from pipeline.models.hf import train_tokenizer

    words = ["river", "hill", "stone", "cloud", "field", "lamp", "bread", "music"]
    docs = [" ".join(words[(i * k) % 8] for k in range(3, 40)) + f" x{i}" for i in range(50)]
    tokenizer = train_tokenizer(docs, 200)
    monkeypatch.setattr(acceptance, "TOKENIZE_BATCH", 7)  # 50 documents: 8 calls
    shape = dict(n_prompts=3, prompt_len=12, long_len=30, seed=1)
    batched = acceptance.heldout_scenarios(tokenizer, docs, **shape)
    whole = build_scenarios(tokenizer(docs, add_special_tokens=False)["input_ids"], **shape)
    assert batched == whole and all(batched[s] for s in batched)
