"""transformers' generate as an outside oracle: lowbit's greedy decoders give its tokens.

``model.generate(do_sample=False)`` and its assisted generation
(``assistant_model=draft``) are independent implementations of greedy decoding and of greedy
speculative decoding; every lowbit decoder (plain, speculative with fixed or adaptive draft
length, pipelined) must emit exactly their tokens, including where an end-of-sequence token
stops the output.
"""

import pytest
import torch

from pipeline.speculative.adaptive import AdaptiveGamma
from pipeline.speculative.decoding import plain_generate, speculative_generate
from pipeline.speculative.pipelined import pipelined_generate
from tests.speculative.conftest import N_NEW


def hf_generate(target, prompt, eos: int | None, draft=None) -> torch.Tensor:
    # eos None: generate to the budget (the tiny configs carry eos 2, which random models emit)
    return target.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        assistant_model=draft,
        do_sample=False,
        max_new_tokens=N_NEW,
        eos_token_id=eos,
        pad_token_id=0,
    )


def lowbit_decoders():
    return {
        "plain": lambda t, d, p, eos: plain_generate(t, p, N_NEW, 0.0, eos_token_id=eos),
        "gamma4": lambda t, d, p, eos: speculative_generate(
            t, d, p, N_NEW, gamma=4, temperature=0, eos_token_id=eos
        ),
        "adaptive": lambda t, d, p, eos: speculative_generate(
            t,
            d,
            p,
            N_NEW,
            adaptive=AdaptiveGamma(1, 6, window=4, cost_ratio=0.1),
            temperature=0,
            eos_token_id=eos,
        ),
        "pipelined": lambda t, d, p, eos: pipelined_generate(
            t, d, p, N_NEW, gamma=3, temperature=0, eos_token_id=eos
        ),
    }


@pytest.fixture(scope="module")
def hf_greedy(target):
    prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return hf_generate(target, prompt, eos=None)


def test_hf_greedy_is_the_reference_the_other_tests_use(hf_greedy, greedy_reference):
    assert torch.equal(hf_greedy, greedy_reference)


@pytest.mark.parametrize("draft_name", ["near_draft", "stranger"])
def test_hf_assisted_generation_is_greedy(target, prompt, hf_greedy, draft_name, request):
    draft = request.getfixturevalue(draft_name)
    with torch.no_grad():
        assisted = hf_generate(target, prompt, eos=None, draft=draft)
    assert torch.equal(assisted, hf_greedy)


@pytest.mark.parametrize("decoder", sorted(lowbit_decoders()))
@pytest.mark.parametrize("draft_name", ["near_draft", "stranger"])
def test_lowbit_decoders_emit_hf_tokens(target, prompt, hf_greedy, decoder, draft_name, request):
    draft = request.getfixturevalue(draft_name)
    out, stats = lowbit_decoders()[decoder](target, draft, prompt, None)
    assert torch.equal(out, hf_greedy)
    assert stats.new_tokens == N_NEW


@pytest.fixture(scope="module")
def hf_stopped(target, near_draft, hf_greedy):
    """(eos, HF's assisted output with it): a token the greedy continuation first emits at
    step 10 or later becomes the end-of-sequence token."""
    prompt_len = hf_greedy.shape[1] - N_NEW
    new = hf_greedy[0, prompt_len:].tolist()
    step = next(i for i in range(10, N_NEW) if new[i] not in new[:i])
    with torch.no_grad():
        ref = hf_generate(target, hf_greedy[:, :prompt_len], eos=new[step], draft=near_draft)
    assert ref.shape[1] == prompt_len + step + 1  # HF stopped right after the eos
    return new[step], ref


@pytest.mark.parametrize("decoder", sorted(lowbit_decoders()))
def test_lowbit_decoders_stop_where_hf_stops(target, near_draft, prompt, hf_stopped, decoder):
    eos, ref = hf_stopped
    out, _ = lowbit_decoders()[decoder](target, near_draft, prompt, eos)
    assert torch.equal(out, ref)
