"""Acceptance scenarios: deterministic, the right lengths, and each set has its property."""

import json

import numpy as np
import pytest
import torch

from pipeline.data.scenarios import (
    SCENARIOS,
    build_scenarios,
    new_tokens_by_scenario,
    repetition_score,
    unigram_frequencies,
)


@pytest.fixture(scope="module")
def corpus() -> list[list[int]]:
    """Zipf-distributed documents of mixed lengths (some longer than 576 tokens)."""
    rng = np.random.default_rng(0)
    vocab = 400
    p = 1.0 / np.arange(1, vocab + 1)
    p /= p.sum()
    return [rng.choice(vocab, size=int(rng.integers(40, 1000)), p=p).tolist() for _ in range(150)]


def _build(corpus, **kw):
    args = {"n_prompts": 6, "prompt_len": 48, "seed": 0} | kw
    return build_scenarios(corpus, **args)


def test_sets_sizes_and_lengths(corpus):
    sets = _build(corpus)
    assert tuple(sets) == SCENARIOS
    assert all(len(sets[name]) == 6 for name in SCENARIOS)
    assert all(len(w) == 576 > 512 for w in sets["long"])
    assert all(len(w) == 48 for name in ("repetition", "rare", "mix") for w in sets[name])
    assert all(isinstance(t, int) for w in sets["mix"] for t in w)


def test_deterministic_for_a_seed(corpus):
    assert _build(corpus) == _build(corpus)
    assert _build(corpus)["mix"] != _build(corpus, seed=1)["mix"]


def test_windows_come_from_the_corpus(corpus):
    text = " " + " ".join(map(str, (t for doc in corpus for t in doc))) + " "
    for name in ("long", "rare", "mix"):
        for w in _build(corpus)[name]:
            assert " " + " ".join(map(str, w)) + " " in text


def test_rare_prompts_have_lower_unigram_frequency_than_mix(corpus):
    sets = _build(corpus)
    freq = unigram_frequencies(corpus)

    def mean_freq(name):
        return np.mean([freq[w].mean() for w in sets[name]])

    assert mean_freq("rare") < 0.8 * mean_freq("mix")


def test_repetition_prompts_repeat_more_than_mix(corpus):
    sets = _build(corpus)

    def mean_rep(name):
        return np.mean([repetition_score(w) for w in sets[name]])

    assert mean_rep("repetition") > 2 * mean_rep("mix")
    natural_only = _build(corpus, constructed_fraction=0.0)
    assert np.mean([repetition_score(w) for w in natural_only["repetition"]]) > mean_rep("mix")


def test_sets_do_not_share_windows(corpus):
    sets = _build(corpus, constructed_fraction=0.0)
    seen = [tuple(w) for name in ("repetition", "rare", "mix") for w in sets[name]]
    assert len(set(seen)) == len(seen)


def test_repetition_score():
    assert repetition_score([1, 2, 3, 4, 5, 6]) == 0.0
    assert repetition_score([7] * 10) > 0.85
    assert repetition_score([1, 2, 1, 2, 1, 2]) > repetition_score([1, 2, 3, 1, 5, 6])


def test_tensor_corpus_gives_the_same_result(corpus):
    rows = torch.tensor([doc[:600] for doc in corpus if len(doc) >= 600])
    as_lists = [doc[:600] for doc in corpus if len(doc) >= 600]
    assert build_scenarios(rows, n_prompts=3, prompt_len=32, seed=2) == build_scenarios(
        as_lists, n_prompts=3, prompt_len=32, seed=2
    )


def test_short_documents_are_concatenated_for_long_contexts():
    docs = [list(range(i, i + 100)) for i in range(0, 1000, 100)]  # ten 100-token documents
    sets = build_scenarios(docs, n_prompts=2, prompt_len=16, long_len=600, seed=0)
    assert all(len(w) == 600 for w in sets["long"])


def test_cache_is_reused_and_rebuilt_when_parameters_change(corpus, tmp_path):
    path = tmp_path / "sub" / "scenarios.json"
    first = _build(corpus, cache_path=path)
    payload = json.loads(path.read_text())
    assert payload["scenarios"] == first
    payload["scenarios"]["mix"] = [[1, 2, 3]]  # a marker: only a cache hit can return it
    path.write_text(json.dumps(payload))
    assert _build(corpus, cache_path=path)["mix"] == [[1, 2, 3]]
    rebuilt = _build(corpus, cache_path=path, seed=5)
    assert rebuilt["mix"] != [[1, 2, 3]] and json.loads(path.read_text())["meta"]["seed"] == 5


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="larger corpus"):
        build_scenarios([[1, 2, 3]], n_prompts=1, prompt_len=8, long_len=16)
    with pytest.raises(ValueError, match="empty corpus"):
        build_scenarios([], n_prompts=1, prompt_len=8)
    with pytest.raises(ValueError, match="n_prompts"):
        build_scenarios([[1, 2, 3]], n_prompts=0, prompt_len=8)


def test_new_tokens_by_scenario_gives_long_its_own_count():
    assert new_tokens_by_scenario(SCENARIOS, 32, 512) == {
        "long": 512,
        "repetition": 32,
        "rare": 32,
        "mix": 32,
    }
    assert new_tokens_by_scenario(["mix", "long"], 32) == {"mix": 32, "long": 32}
