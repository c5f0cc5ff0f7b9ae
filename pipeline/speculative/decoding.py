"""Speculative decoding with KV caches, and plain decoding as its baseline.

Leviathan et al. (2023), Chen et al. (2023): the draft proposes gamma tokens, the target scores
them in one cached forward, ``verify_draft`` keeps the accepted prefix plus one token. After every
round each cache holds a prefix of the committed sequence minus its last token; positions are
explicit, so rotary phases survive a rollback. Batch size 1: rows would need ragged caches.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence

import torch

from pipeline.models.lean import LeanLM, lean
from pipeline.speculative.adaptive import AdaptiveGamma
from pipeline.speculative.sampling import (
    logits_to_probs,
    sample_tokens,
    verify_draft,
    verify_greedy,
)
from pipeline.speculative.schedule import draft_temperature
from pipeline.speculative.stats import SpecStats

__all__ = [
    "CachedLM",
    "SpecStats",
    "block_temperatures",
    "draft_block",
    "draft_probs",
    "plain_generate",
    "speculative_generate",
    "vocab_size",
]


class CachedLM:
    """A causal LM with its KV cache: feeds tokens at the right positions and rolls back.

    Built without grad from a model in eval mode, it runs ``pipeline.models.lean``'s forward
    where that reproduces the model's (the same logits, less framework time per step).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        inference = not torch.is_grad_enabled() and not model.training
        self.model = model = lean(model) if inference else model
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        param = next(model.parameters(), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.cache = None
        self.length = 0  # tokens held by the cache

    def forward(self, tokens: torch.Tensor, keep: int | torch.Tensor | None = None) -> torch.Tensor:
        """Feed (B, n) tokens after the cached ones; logits of the ``keep`` rows (None: all)."""
        n = tokens.shape[-1]
        kwargs = {} if self.cache is None else {self._cache_kw: self.cache}
        if not isinstance(self.model, LeanLM):  # the lean forward numbers the cache's next rows
            positions = torch.arange(self.length, self.length + n, device=self.device)
            kwargs["position_ids"] = positions[None]
        if keep is not None and self._keep_kw:
            kwargs["logits_to_keep"] = keep  # skip the vocabulary projection of unused rows
        out = self.model(input_ids=tokens.to(self.device), use_cache=True, **kwargs)
        cache = getattr(out, "cache", None)
        self.cache = cache if cache is not None else getattr(out, "past_key_values", None)
        if self.cache is None or not hasattr(self.cache, "crop"):
            raise TypeError(
                f"{type(self.model).__name__} did not return a croppable KV cache; speculative "
                "decoding needs an HF causal LM returning a Cache (e.g. DynamicCache)"
            )
        self.length += n
        logits = out.logits
        if keep is None or self._keep_kw:  # (the model kept the rows itself)
            return logits
        return logits[:, -keep:] if isinstance(keep, int) else logits[:, keep.to(logits.device)]

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens."""
        if length < self.length:
            # Negative: "remove this many" in both the 4.x and 5.x cache APIs.
            self.cache.crop(length - self.length)
            self.length = length


def _as_prompt(input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must be one non-empty prompt of shape (1, T) or (T,), got "
            f"{tuple(ids.shape)}; call the function once per prompt"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    return ids


def _eos_set(eos_token_id: int | list[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)


def _cut_at_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    for i, tok in enumerate(tokens):
        if tok in eos:
            return tokens[: i + 1], True
    return tokens, False


def draft_probs(logits: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    """(1, V_q) draft logits -> (1, V_p) probs on the target's vocabulary (missing ones: q = 0)."""
    q = logits_to_probs(logits[..., :vocab], temperature)
    if q.shape[-1] < vocab:
        q = torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
    return q


def draft_block(
    drf: CachedLM,
    pending: torch.Tensor,
    g: int,
    vocab: int,
    temperature: float | Sequence[float],
    generator: torch.Generator | None = None,
    *,
    probs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample ``g`` tokens after ``pending`` (1, m), the last unread; q is None if not ``probs``."""
    temps = [temperature] * g if isinstance(temperature, (int, float)) else list(temperature)
    if len(temps) != g:
        raise ValueError(f"draft_block got {len(temps)} temperatures for {g} tokens")
    tokens, q_rows = [], []
    for t in temps:
        q_logits = drf.forward(pending, keep=1)[:, -1]  # (1, V_q)
        if probs:
            q = draft_probs(q_logits, vocab, t)  # (1, V)
            tok = sample_tokens(q, generator, t == 0)  # (1,)
            q_rows.append(q)
        else:  # greedy: the argmax alone, no one-hot row over the vocabulary
            tok = q_logits[..., :vocab].argmax(-1)
        tokens.append(tok)
        pending = tok.view(1, 1)
    if not g:
        empty = torch.zeros(1, 0, dtype=torch.long, device=drf.device)
        return empty, torch.zeros(1, 0, vocab, device=drf.device) if probs else None
    return torch.stack(tokens, 1), torch.stack(q_rows, 1) if probs else None


def block_temperatures(
    temperature: float, first_step: int, g: int, schedule: bool
) -> float | list[float]:
    """The draft's temperature for ``g`` tokens from ``first_step`` (per token on a schedule)."""
    if not schedule:
        return temperature
    return [draft_temperature(first_step + k, temperature) for k in range(g)]


def speculative_decoder(
    target: torch.nn.Module, draft: torch.nn.Module, max_new_tokens: int, **settings
):
    """``fn(prompt, generator)`` decoding with ``speculative_generate``'s keyword ``settings``:
    the form ``stats.decode_prompts`` takes."""
    return lambda x, g: speculative_generate(
        target, draft, x, max_new_tokens, generator=g, **settings
    )


@torch.no_grad()
def speculative_generate(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    gamma: int = 4,
    adaptive: AdaptiveGamma | None = None,
    temperature: float = 1.0,
    temperature_schedule: bool = False,
    generator: torch.Generator | None = None,
    eos_token_id: int | list[int] | None = None,
) -> tuple[torch.Tensor, SpecStats]:
    """Up to ``max_new_tokens`` tokens distributed as the target's; ``adaptive`` (updated in
    place) overrides ``gamma`` and may ask for plain steps (gamma 0), ``temperature_schedule``
    changes the draft's sampling only."""
    ids = _as_prompt(input_ids, max_new_tokens)
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    greedy = temperature == 0
    eos = _eos_set(eos_token_id)
    seq = ids[0].tolist()
    tgt, drf = CachedLM(target), CachedLM(draft)
    stats = SpecStats()
    start = time.perf_counter()
    if len(seq) > 1 and max_new_tokens > 0:
        tgt.forward(ids[:, :-1], keep=1)  # the draft reads the prompt when it first drafts
    stats.prefill_seconds = time.perf_counter() - start
    vocab = vocab_size(target)
    produced, done = 0, False
    while produced < max_new_tokens and not done:
        round_start = time.perf_counter()
        # Never draft past the budget: a round emits at most g + 1 tokens.
        g = min(adaptive.gamma if adaptive is not None else gamma, max_new_tokens - produced - 1)
        if adaptive is not None and adaptive.gamma == 0:  # plain steps; the draft skips them
            n, done = _plain_steps(
                tgt, seq, max_new_tokens - produced, stats, temperature, generator, eos, adaptive
            )
            produced += n
            continue
        # Committed tokens the draft has not read yet: (1, 1), (1, 2) after a full accept, or
        # every token since it last drafted (the prompt, plain steps): one forward catches up.
        pending = torch.tensor([seq[drf.length :]], dtype=torch.long)
        temps = block_temperatures(temperature, produced, g, temperature_schedule)
        draft_t, q_probs = draft_block(drf, pending, g, vocab, temps, generator, probs=not greedy)
        draft_t = draft_t.to(tgt.device)  # (1, g)
        feed = torch.cat([torch.tensor([seq[tgt.length :]], device=tgt.device), draft_t], dim=1)
        logits = tgt.forward(feed, keep=g + 1)  # (1, g+1, V)
        if greedy:
            ver = verify_greedy(draft_t, logits.argmax(-1))
        else:
            p = logits_to_probs(logits, temperature)
            ver = verify_draft(draft_t, q_probs.to(p.device), p, generator=generator)

        n = int(ver.n_accepted.item())
        n_verified = min(n + 1, g)
        new, done = _cut_at_eos(draft_t[0, :n].tolist() + [int(ver.next_token.item())], eos)
        seq.extend(new)
        produced += len(new)
        stats.record_round(g, n, len(new), ver.beta[0, :n_verified].tolist())
        tgt.rollback(len(seq) - 1)
        drf.rollback(min(drf.length, len(seq) - 1))
        if adaptive is not None:
            # timed: the gamma asked for, no catch-up (a probe's priced out paying speculation)
            steady = g == adaptive.gamma and pending.shape[1] <= 2
            timed = time.perf_counter() - round_start if steady else None
            adaptive.update(n, n_verified, timed)
    stats.seconds = time.perf_counter() - start
    return torch.tensor([seq], device=ids.device), stats


@torch.no_grad()
def plain_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    eos_token_id: int | list[int] | None = None,
) -> tuple[torch.Tensor, SpecStats]:
    """Token-by-token decoding with a KV cache, the baseline; returns as speculative_generate."""
    ids = _as_prompt(input_ids, max_new_tokens)
    seq = ids[0].tolist()
    stats = SpecStats()
    start = time.perf_counter()
    args = (stats, temperature, generator, _eos_set(eos_token_id))
    _plain_steps(CachedLM(model), seq, max_new_tokens, *args, first_token_from=start)
    stats.seconds = time.perf_counter() - start
    return torch.tensor([seq], device=ids.device), stats


def _plain_steps(
    lm: CachedLM,
    seq: list[int],
    budget: int,
    stats: SpecStats,
    temperature: float,
    generator: torch.Generator | None,
    eos: set[int],
    adaptive: AdaptiveGamma | None = None,
    first_token_from: float | None = None,
) -> tuple[int, bool]:
    """Plain steps after ``seq`` (extended in place) until ``budget`` tokens, an end of sequence
    or ``adaptive`` asks for a round: (tokens, at eos). The baseline's loop too, at its cost."""
    feed = torch.tensor([seq[lm.length :]], device=lm.device)  # the prompt, or the unread
    for n in range(1, budget + 1):
        start = time.perf_counter()
        tok = _next_token(lm.forward(feed, keep=1)[:, -1], temperature, generator)
        seq.append(int(tok.item()))
        if first_token_from is not None and n == 1:
            stats.prefill_seconds = time.perf_counter() - first_token_from
        stats.record_round(0, 0, 1, [])
        if adaptive is not None:
            adaptive.update(0, 0, time.perf_counter() - start)
        if seq[-1] in eos:
            return n, True
        if adaptive is not None and adaptive.gamma:
            return n, False
        feed = tok.view(1, 1)
    return budget, False


def _next_token(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> torch.Tensor:
    """(1, V) logits -> (1,) next token; greedy takes the argmax without a one-hot row."""
    if temperature == 0:
        return logits.argmax(-1)
    return sample_tokens(logits_to_probs(logits, temperature), generator)


def vocab_size(model: torch.nn.Module) -> int:
    """Vocabulary size of a causal LM (from its config, else its output embedding)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        vocab = model.get_output_embeddings().weight.shape[0]
    return int(vocab)
