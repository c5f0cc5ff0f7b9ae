"""Pipelined speculative decoding: greedy equivalence, exact sampling law, stats, overlap modes."""

import copy
from types import SimpleNamespace

import pytest
import torch

from pipeline.speculative.decoding import plain_generate
from pipeline.speculative.pipelined import measure_overlap_gain, pipelined_generate, resolve_overlap
from tests.speculative.conftest import N_NEW, record_draft_temperatures


def won_bets(stats) -> int:
    """Rounds whose bet became the next block (each emits one token fewer than n + 1)."""
    return stats.accepted + stats.target_calls - stats.new_tokens


@pytest.mark.parametrize("overlap", ["none", "thread"])
@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("draft_name", ["near_draft", "stranger"])
def test_greedy_pipelined_equals_greedy_target(
    request, target, prompt, greedy_reference, overlap, gamma, draft_name
):
    # near_draft wins and loses bets (partial acceptance); stranger loses nearly all of them.
    draft = request.getfixturevalue(draft_name)
    out, stats = pipelined_generate(
        target, draft, prompt, N_NEW, gamma=gamma, temperature=0, overlap=overlap
    )
    assert torch.equal(out, greedy_reference)
    assert stats.new_tokens == N_NEW
    if draft_name == "near_draft":
        assert 0 < won_bets(stats) < stats.target_calls


def test_self_draft_accepts_everything_at_temperature_one(target, prompt):
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(0)
    out, stats = pipelined_generate(
        target, draft, prompt, 30, gamma=4, temperature=1.0, generator=gen, overlap="thread"
    )
    assert stats.acceptance_rate == 1.0 and stats.alpha_hat == pytest.approx(1.0, abs=1e-5)
    # Every bet is won: each forward emits its 4 drafts plus the bet's first token, as many
    # tokens as a fully accepted speculative round (the last round has no bet: drafts + bonus).
    assert stats.tau == 5.0 and stats.new_tokens == 30 and out.shape == (1, 12 + 30)
    assert won_bets(stats) == stats.target_calls - 1
    assert stats.draft_calls == stats.drafted  # nothing drafted was thrown away


def test_stats_are_consistent(target, near_draft, prompt):
    # Greedy: the tiny models' sampling distributions are nearly uniform, so at temperature 1
    # the near draft is accepted almost always and no bet would be lost.
    out, stats = pipelined_generate(
        target, near_draft, prompt, N_NEW, gamma=3, temperature=0, overlap="none"
    )
    assert stats.new_tokens == out.shape[1] - prompt.shape[1] == N_NEW
    assert 0.0 < stats.acceptance_rate < 1.0
    assert stats.drafted == sum(stats.gammas)
    assert stats.draft_calls > stats.drafted  # lost bets cost draft forwards
    assert stats.beta_count == sum(stats.position_verified)
    assert 0 < won_bets(stats) < stats.target_calls


def test_same_tokens_whatever_the_overlap(target, near_draft, prompt):
    """The draft samples from its own generator, so timing never changes the tokens."""

    def run(seed, overlap):
        gen = torch.Generator().manual_seed(seed)
        return pipelined_generate(
            target, near_draft, prompt, 24, gamma=3, generator=gen, overlap=overlap
        )[0]

    a = run(0, "none")
    assert torch.equal(a, run(0, "thread")) and torch.equal(a, run(0, "none"))
    assert not torch.equal(a, run(1, "none"))


class _TokenCache:
    """The fed tokens, croppable like an HF cache."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def crop(self, max_length: int) -> None:
        keep = max_length if max_length >= 0 else len(self.tokens) + max_length
        del self.tokens[keep:]


class _TrigramLM(torch.nn.Module):
    """Next-token logits from the last two tokens: microseconds per forward, exact law known."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)  # (V, V, V)
        self.config = SimpleNamespace(vocab_size=table.shape[-1])

    def forward(self, input_ids, position_ids=None, cache=None, use_cache=True):
        cache = cache if cache is not None else _TokenCache()
        start = len(cache.tokens)
        cache.tokens.extend(input_ids[0].tolist())
        prev = torch.tensor([0] + cache.tokens[:-1])
        cur = torch.tensor(cache.tokens)
        logits = self.table[prev[start:], cur[start:]]  # (n, V)
        return SimpleNamespace(logits=logits[None], cache=cache)

    def next_probs(self, a: int, b: int) -> torch.Tensor:
        return torch.softmax(self.table[a, b].double(), -1)


def test_sampled_tokens_follow_the_target_law():
    """First three new tokens over many seeds vs the target's exact joint law (chi-square).

    gamma=1 with 4 new tokens runs every path: the bet's first token tested at the bonus
    position (token 2), the rest of a won bet verified as the next block (token 3), lost bets
    and their corrections. Trigram tables stand in for tiny Llamas: 2000 runs take seconds,
    and the exact law is a product of table rows.
    """
    from scipy.stats import chisquare

    v = 3
    gen = torch.Generator().manual_seed(0)
    target = _TrigramLM(3 * torch.randn(v, v, v, generator=gen))
    draft = _TrigramLM(3 * torch.randn(v, v, v, generator=gen))
    prompt = torch.tensor([[1, 2]])
    law = torch.zeros(v, v, v, dtype=torch.float64)
    for a in range(v):
        for b in range(v):
            for c in range(v):
                law[a, b, c] = (
                    target.next_probs(1, 2)[a]
                    * target.next_probs(2, a)[b]
                    * target.next_probs(a, b)[c]
                )
    n, counts, won, lost = 2000, torch.zeros(v**3, dtype=torch.float64), 0, 0
    sampler = torch.Generator().manual_seed(1)
    for _ in range(n):
        out, stats = pipelined_generate(
            target, draft, prompt, 4, gamma=1, generator=sampler, overlap="none"
        )
        a, b, c = out[0, 2:5].tolist()
        counts[(a * v + b) * v + c] += 1
        won += won_bets(stats)
        lost += stats.draft_calls > stats.drafted
    assert won > n // 10 and lost > n // 10  # both outcomes of the bet were exercised
    expected = law.flatten() * n
    keep = expected >= 5  # chi-square needs enough expected mass per cell
    observed = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    expected = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    assert chisquare(observed.numpy(), expected.numpy() * n / expected.sum().item()).pvalue > 0.01


def test_eos_and_edge_cases(target, near_draft, stranger, prompt, greedy_reference):
    eos = int(greedy_reference[0, 12 + 7])
    first = next(i for i in range(12, 12 + N_NEW) if greedy_reference[0, i] == eos)
    out, stats = pipelined_generate(
        target, near_draft, prompt, N_NEW, gamma=3, temperature=0, eos_token_id=eos, overlap="none"
    )
    assert torch.equal(out, greedy_reference[:, : first + 1])
    assert stats.new_tokens == first + 1 - 12
    one = torch.tensor([5])
    ref, _ = plain_generate(target, one, 6, temperature=0)
    out, _ = pipelined_generate(target, stranger, one, 6, gamma=2, temperature=0, overlap="none")
    assert torch.equal(out, ref)
    out, stats = pipelined_generate(target, stranger, one, 0, overlap="none")
    assert out.tolist() == [[5]] and stats.new_tokens == 0
    with pytest.raises(ValueError, match="overlap"):
        pipelined_generate(target, stranger, one, 4, overlap="fast")
    with pytest.raises(ValueError, match="CUDA"):
        pipelined_generate(target, stranger, one, 4, overlap="stream")
    with pytest.raises(ValueError, match="gamma"):
        pipelined_generate(target, stranger, one, 4, gamma=0, overlap="none")


def test_auto_overlap_measures_once_and_keeps_greedy_output(
    target, near_draft, prompt, greedy_reference
):
    gain = measure_overlap_gain(target, near_draft, gamma=2, context_len=8, rounds=2)
    assert gain > 0.0
    mode = resolve_overlap("auto", target, near_draft, gamma=3)
    assert mode in ("thread", "none")
    assert resolve_overlap("auto", target, near_draft, gamma=3) == mode  # cached, not re-timed
    out, _ = pipelined_generate(target, near_draft, prompt, N_NEW, gamma=3, temperature=0)
    assert torch.equal(out, greedy_reference)


def test_blocks_and_bets_sample_on_the_temperature_schedule(
    target, near_draft, prompt, monkeypatch
):
    from pipeline.speculative import pipelined
    from pipeline.speculative.schedule import draft_temperature

    seen = record_draft_temperatures(monkeypatch, pipelined, prompt.shape[1])
    _, stats = pipelined_generate(
        target,
        near_draft,
        prompt,
        30,
        gamma=3,
        temperature=0.8,
        temperature_schedule=True,
        generator=torch.Generator().manual_seed(0),
        overlap="none",
    )
    assert len(seen) > 3 and won_bets(stats) > 0  # bets were won: their rest became blocks
    for committed, temps in seen:
        # A block's or a bet's token that would become new token n is sampled at T(n).
        want = [draft_temperature(committed + k, 0.8) for k in range(len(temps))]
        assert temps == pytest.approx(want, rel=1e-12)  # steps 1e-3 apart differ by ~1e-5
