"""Speculative decoding: greedy equivalence with the target, KV rollback, stats, stopping."""

import copy

import pytest
import torch

from pipeline.speculative.adaptive import AdaptiveGamma
from pipeline.speculative.decoding import plain_generate, speculative_generate
from tests.speculative.conftest import N_NEW, record_draft_temperatures


def test_plain_greedy_with_cache_matches_full_recomputation(target, prompt):
    out, stats = plain_generate(target, prompt, 16, temperature=0.0)
    seq = prompt
    with torch.no_grad():
        for _ in range(16):  # no cache at all: argmax of a full forward each step
            nxt = target(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq)
    assert stats.new_tokens == stats.target_calls == 16 and stats.drafted == 0
    # the prompt's forward is timed apart: a part of the pass, not all of it
    assert 0 < stats.prefill_seconds < stats.seconds
    assert stats.merge(stats).prefill_seconds == 2 * stats.prefill_seconds


def test_speculative_times_the_prompt_forward_apart(target, near_draft, prompt):
    _, stats = speculative_generate(target, near_draft, prompt, N_NEW, gamma=3, temperature=0)
    assert 0 < stats.prefill_seconds < stats.seconds


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_equals_greedy_target_with_disagreeing_draft(
    target, stranger, prompt, greedy_reference, gamma
):
    # The stranger's proposals are rejected (almost) every round: every rollback crops the
    # target's whole block and the draft's cache.
    out, stats = speculative_generate(target, stranger, prompt, N_NEW, gamma=gamma, temperature=0)
    assert torch.equal(out, greedy_reference)
    assert stats.new_tokens == N_NEW


@pytest.mark.parametrize("gamma", [2, 4])
def test_greedy_speculative_equals_greedy_target_with_partial_acceptance(
    target, near_draft, prompt, greedy_reference, gamma
):
    out, stats = speculative_generate(target, near_draft, prompt, N_NEW, gamma=gamma, temperature=0)
    assert torch.equal(out, greedy_reference)
    assert 0.0 < stats.acceptance_rate < 1.0  # rollbacks of partial blocks did happen
    assert stats.accepted + stats.target_calls == stats.new_tokens
    assert stats.drafted == sum(stats.gammas) == stats.draft_calls
    assert stats.tau == pytest.approx(N_NEW / stats.target_calls)


def test_greedy_adaptive_gamma_equals_greedy_target(target, near_draft, prompt, greedy_reference):
    adaptive = AdaptiveGamma(gamma_min=1, gamma_max=6, window=4, cost_ratio=0.1)
    out, stats = speculative_generate(
        target, near_draft, prompt, N_NEW, adaptive=adaptive, temperature=0
    )
    assert torch.equal(out, greedy_reference)
    assert all(1 <= g <= 6 for g in stats.gammas)
    assert len(set(adaptive.history)) > 1  # the draft length actually moved


def test_self_draft_accepts_everything(target, prompt):
    out, stats = speculative_generate(target, target, prompt, 30, gamma=4, temperature=0)
    assert stats.acceptance_rate == 1.0 and stats.alpha_hat == pytest.approx(1.0)
    assert stats.tau == 5.0  # 30 tokens = 6 rounds of 4 drafts + 1 bonus
    assert stats.position_acceptance == [1.0] * 4


class _FakeQuantLinear(torch.nn.Module):
    """4-bit symmetric per-row round-to-nearest on the fly: a stand-in for a low-bit linear."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.linear.weight
        scale = w.abs().amax(dim=1, keepdim=True) / 7
        return torch.nn.functional.linear(x, torch.round(w / scale).clamp(-8, 7) * scale)


def test_self_speculative_with_fake_quant_draft(target, prompt, greedy_reference):
    draft = copy.deepcopy(target)
    for layer in draft.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, _FakeQuantLinear(child))
    out, stats = speculative_generate(target, draft, prompt, N_NEW, gamma=3, temperature=0)
    assert torch.equal(out, greedy_reference)
    assert stats.acceptance_rate > 0.0


def test_sampling_is_reproducible_with_a_seeded_generator(target, near_draft, prompt):
    def run(seed):
        gen = torch.Generator().manual_seed(seed)
        return speculative_generate(target, near_draft, prompt, 24, gamma=3, generator=gen)

    (a, sa), (b, _), (c, _) = run(0), run(0), run(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (1, 12 + 24)
    assert 0.0 < sa.alpha_hat <= 1.0 and sa.beta_count == sum(sa.position_verified)


def test_eos_stops_generation(target, near_draft, prompt, greedy_reference):
    eos = int(greedy_reference[0, 12 + 7])  # the 8th greedy token
    first = next(i for i in range(12, 12 + N_NEW) if greedy_reference[0, i] == eos)
    out, stats = speculative_generate(
        target, near_draft, prompt, N_NEW, gamma=4, temperature=0, eos_token_id=eos
    )
    assert torch.equal(out, greedy_reference[:, : first + 1])
    assert stats.new_tokens == first + 1 - 12
    plain, _ = plain_generate(target, prompt, N_NEW, temperature=0, eos_token_id=[eos])
    assert torch.equal(plain, out)


def test_edge_prompts_and_budgets(target, stranger):
    one = torch.tensor([5])
    ref, _ = plain_generate(target, one, 6, temperature=0)
    out, _ = speculative_generate(target, stranger, one, 6, gamma=2, temperature=0)
    assert torch.equal(out, ref) and out.shape == (1, 7)
    out, stats = speculative_generate(target, stranger, one, 0, temperature=0)
    assert out.tolist() == [[5]] and stats.new_tokens == 0
    with pytest.raises(ValueError, match="one non-empty prompt"):
        speculative_generate(target, stranger, torch.zeros(2, 4, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="gamma"):
        speculative_generate(target, stranger, one, 4, gamma=0)


@pytest.mark.slow
def test_speculative_sampling_output_is_distributed_as_target(make_llama):
    """End to end, rollbacks included: the first two new tokens follow the target's joint law.

    (Cropping the target cache wrongly makes this fail with p ~ 1e-14.)
    """
    from scipy.stats import chisquare

    target, draft = make_llama(0, vocab=8), make_llama(1, vocab=8)
    with torch.no_grad():  # sharpen both so p and q differ clearly
        target.lm_head.weight.mul_(40)
        draft.lm_head.weight.mul_(40)
    prompt = torch.tensor([[1, 5, 2]])
    with torch.no_grad():
        p1 = torch.softmax(target(input_ids=prompt).logits[0, -1], -1)  # (8,)
        both = torch.cat([prompt.expand(8, -1), torch.arange(8)[:, None]], dim=1)
        p2 = torch.softmax(target(input_ids=both).logits[:, -1], -1)  # (8, 8)
    joint = (p1[:, None] * p2).flatten().double()  # (64,)

    gen = torch.Generator().manual_seed(0)
    n = 1200
    counts = torch.zeros(64, dtype=torch.float64)
    rejected = 0
    for _ in range(n):
        out, stats = speculative_generate(target, draft, prompt, 3, gamma=2, generator=gen)
        counts[out[0, 3] * 8 + out[0, 4]] += 1
        rejected += stats.accepted < stats.drafted
    assert rejected > n // 10  # rollbacks were exercised
    keep = joint * n >= 5  # chi-square needs enough expected mass per cell
    expected = torch.cat([joint[keep], joint[~keep].sum().view(1)]) * n
    observed = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    expected = expected * observed.sum() / expected.sum()
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 0.01


@pytest.mark.parametrize("schedule", [False, True])
def test_the_draft_samples_on_the_temperature_schedule(
    target, near_draft, prompt, monkeypatch, schedule
):
    from pipeline.speculative import decoding
    from pipeline.speculative.schedule import draft_temperature

    seen = record_draft_temperatures(monkeypatch, decoding, prompt.shape[1])
    gen = torch.Generator().manual_seed(0)
    _, stats = speculative_generate(
        target,
        near_draft,
        prompt,
        24,
        gamma=3,
        temperature=0.8,
        temperature_schedule=schedule,
        generator=gen,
    )
    assert sum(len(t) for _, t in seen) == stats.drafted and len(seen) > 3
    for committed, temps in seen:
        # The draft token that would become new token n is sampled at T(n).
        want = [
            draft_temperature(committed + k, 0.8) if schedule else 0.8 for k in range(len(temps))
        ]
        assert temps == pytest.approx(want, rel=1e-12)  # steps 1e-3 apart differ by ~1e-5
    if schedule:
        assert seen[0][1][0] == pytest.approx(0.88)  # 0.8 * (1 + 0.1 * cos 0)


def test_the_schedule_over_decoding_steps():
    from pipeline.speculative.decoding import block_temperatures

    assert block_temperatures(0.7, 5, 3, schedule=False) == 0.7
    temps = block_temperatures(1.0, 3141, 3, schedule=True)  # cos(3.141..3.143) ~ -1
    assert temps == pytest.approx([0.9, 0.9, 0.9], abs=1e-6)
    assert block_temperatures(2.0, 0, 2, schedule=True) == pytest.approx([2.2, 2.2], abs=1e-6)
    assert block_temperatures(0.0, 10, 2, schedule=True) == [0.0, 0.0]  # greedy stays greedy


def test_the_schedule_keeps_greedy_output_exact(target, near_draft, prompt, greedy_reference):
    out, _ = speculative_generate(
        target, near_draft, prompt, N_NEW, gamma=3, temperature=0, temperature_schedule=True
    )
    assert torch.equal(out, greedy_reference)
