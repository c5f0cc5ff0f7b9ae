"""Tiny Llama target/draft pairs shared by the speculative decoding tests."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.speculative.decoding import plain_generate

VOCAB = 64


def tiny_llama(
    seed: int, vocab: int = VOCAB, layers: int = 2, hidden: int = 32
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=2 * hidden,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy with Gaussian noise on every weight: agrees with the original often, not always."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return out


def record_draft_temperatures(monkeypatch, module, prompt_len: int) -> list:
    """Spy on ``module.draft_block``: per call, (new tokens committed before the block, the
    draft's temperature per proposed token)."""
    seen: list[tuple[int, list[float]]] = []
    real = module.draft_block

    def spy(drf, pending, g, vocab, temperature, generator=None, **kw):
        # The committed sequence is what the draft has cached plus what it has not read yet.
        committed = drf.length + pending.shape[1] - prompt_len
        temps = [temperature] * g if isinstance(temperature, float) else list(temperature)
        seen.append((committed, temps))
        return real(drf, pending, g, vocab, temperature, generator, **kw)

    monkeypatch.setattr(module, "draft_block", spy)
    return seen


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine OpenMP spin-waits
    make them tens of times slower; restored after each test module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def make_llama():
    """Factory for tiny Llamas: make_llama(seed, vocab=64, layers=2, hidden=32)."""
    return tiny_llama


@pytest.fixture(scope="session")
def perturb():
    """perturb(model, scale, seed) -> noisy copy."""
    return perturbed


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_llama(0)


@pytest.fixture(scope="module")
def stranger() -> LlamaForCausalLM:
    """Independently initialised draft: disagrees with the target almost always (greedy)."""
    return tiny_llama(1)


@pytest.fixture(scope="module")
def near_draft(target) -> torch.nn.Module:
    """Noisy copy of the target: partial acceptance, so rollbacks of every length happen."""
    return perturbed(target, 0.004, seed=1)


@pytest.fixture
def prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))


N_NEW = 40  # tokens of the greedy reference decodes


@pytest.fixture(scope="module")
def greedy_reference(target):
    """Plain greedy decoding of `prompt` by the target: what every greedy speculative decode
    must reproduce token for token."""
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    out, _ = plain_generate(target, prompt, N_NEW, temperature=0.0)
    return out
