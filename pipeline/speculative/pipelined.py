"""Pipelined speculative decoding: the draft proposes the next block while the target verifies.

PEARL's post-verify (Liu et al., 2024): while the target verifies a block x_1..x_g, the draft
samples a *bet* y_1..y_k that it is accepted; y_1 is tested at the bonus position like any draft,
and y_2..y_k are the next block if all is accepted.

Exact: each round is a standard speculative round on the committed prefix s: every draft is
sampled given s and the drafts before it (a won bet's rest given s + x + y_1) and tested against
the target row at its own position; using a bet's rest depends only on x's and y_1's acceptance
(the draft has its own generator). A won round ends after y_1 with no bonus (the guarantee is per
position): a copy of the last row stands in for the bonus row, its token unused. The overlap never
changes the tokens.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from functools import partial
from typing import Any

import torch

from pipeline.speculative.decoding import (
    CachedLM,
    _as_prompt,
    _cut_at_eos,
    _eos_set,
    block_temperatures,
    draft_block,
    vocab_size,
)
from pipeline.speculative.sampling import Verification, logits_to_probs, verify_draft
from pipeline.speculative.stats import SpecStats

__all__ = [
    "AUTO_MIN_GAIN",
    "OVERLAPS",
    "measure_overlap_gain",
    "pipelined_generate",
    "resolve_overlap",
]

OVERLAPS = ("auto", "stream", "thread", "none")
# "auto" picks the thread overlap only past this gain: smaller ones are timing noise.
AUTO_MIN_GAIN = 1.05

# target -> {(id(draft), gamma, torch threads): mode}; weak so cached choices die with models.
_AUTO_CHOICE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Sequential:
    """Runs the target's and the draft's work one after the other (overlap "none")."""

    def __enter__(self) -> _Sequential:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def draft(self, fn: Callable[[], Any]) -> Any:
        """Draft work nothing else runs beside (a fresh block after a rejection)."""
        return fn()

    def both(self, target_fn: Callable[[], Any], draft_fn: Callable[[], Any]) -> tuple[Any, Any]:
        return target_fn(), draft_fn()


class _Threaded(_Sequential):
    """The draft's share of a round runs in one worker thread beside the target's."""

    def __enter__(self) -> _Threaded:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)

    def both(self, target_fn: Callable[[], Any], draft_fn: Callable[[], Any]) -> tuple[Any, Any]:
        future = self._pool.submit(_without_grad, draft_fn)
        try:
            out = target_fn()
        finally:
            # The draft's cache must not change after we return, even when the target failed.
            wait_futures([future])
        return out, future.result()


class _Streamed(_Sequential):
    """The draft's kernels run on a side CUDA stream, the target's on the current one."""

    def __init__(self, device: torch.device) -> None:
        self._main = torch.cuda.current_stream(device)
        self._side = torch.cuda.Stream(device)

    def draft(self, fn: Callable[[], Any]) -> Any:
        self._side.wait_stream(self._main)
        out = self._on_side(fn)
        self._main.wait_stream(self._side)
        return out

    def both(self, target_fn: Callable[[], Any], draft_fn: Callable[[], Any]) -> tuple[Any, Any]:
        # The target's forward is queued first: the GPU runs it while the host launches more.
        self._side.wait_stream(self._main)
        out = target_fn()
        drafted = self._on_side(draft_fn)
        self._main.wait_stream(self._side)
        return out, drafted

    def _on_side(self, fn: Callable[[], Any]) -> Any:
        # The main stream reads the draft's tensors only after wait_stream.
        with torch.cuda.stream(self._side):
            return fn()


def _without_grad(fn: Callable[[], Any]) -> Any:
    # Grad mode is thread-local: the caller's no_grad does not reach the worker thread.
    with torch.no_grad():
        return fn()


def _overlap(mode: str, device: torch.device) -> _Sequential:
    if mode == "stream":
        return _Streamed(device)
    return _Threaded() if mode == "thread" else _Sequential()


def _draft_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """The draft's own generator, seeded from ``generator``: one shared by threads is racy."""
    rng_device = generator.device if generator is not None else "cpu"
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=rng_device))
    return torch.Generator(device=device).manual_seed(seed)


def _check_cpu(model: torch.nn.Module) -> None:
    param = next(model.parameters(), None)
    if param is not None and param.device.type != "cpu":
        raise ValueError(
            f"measure_overlap_gain times CPU models; got one on {param.device} (on an "
            "accelerator, kernel launches are asynchronous and the overlap is a CUDA stream)"
        )


@torch.no_grad()
def measure_overlap_gain(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    *,
    gamma: int = 4,
    context_len: int = 64,
    rounds: int = 6,
    n_warmup: int = 1,
    seed: int = 0,
) -> float:
    """Sequential / threaded median time of whole greedy decodes (> 1: threads pay), CPU only;
    whole, because an isolated round hides the GIL the loop holds between forwards."""
    if rounds < 1 or gamma < 1:
        raise ValueError(f"need rounds >= 1 and gamma >= 1, got {rounds}, {gamma}")
    _check_cpu(target)
    _check_cpu(draft)
    vocab = min(vocab_size(target), vocab_size(draft))
    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(0, vocab, (1, context_len), generator=gen)
    times: dict[str, list[float]] = {"none": [], "thread": []}
    for i in range(n_warmup + rounds):
        for mode in times:
            _, stats = pipelined_generate(
                target, draft, context, rounds * (gamma + 1), gamma=gamma, temperature=0.0,
                overlap=mode,
            )  # fmt: skip
            if i >= n_warmup:
                times[mode].append(stats.seconds)
    return statistics.median(times["none"]) / max(statistics.median(times["thread"]), 1e-9)


def resolve_overlap(
    overlap: str, target: torch.nn.Module, draft: torch.nn.Module, gamma: int = 4
) -> str:
    """The overlap ``pipelined_generate`` runs with: "stream", "thread" or "none"."""
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap must be one of {OVERLAPS}, got {overlap!r}")
    param = next(draft.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if overlap == "stream" and device.type != "cuda":
        raise ValueError(f"overlap='stream' needs a CUDA draft, the draft is on {device}")
    if overlap != "auto":
        return overlap
    if device.type == "cuda":
        return "stream"
    if device.type != "cpu":
        return "none"
    key = (id(draft), gamma, torch.get_num_threads())
    choices = _AUTO_CHOICE.setdefault(target, {})
    if key not in choices:
        gain = measure_overlap_gain(target, draft, gamma=gamma)
        choices[key] = "thread" if gain >= AUTO_MIN_GAIN else "none"
    return choices[key]


def _score_and_bet(
    ov: _Sequential,
    tgt: CachedLM,
    propose: Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]],
    score: Callable[[torch.Tensor, int], torch.Tensor],
    seq: list[int],
    block: tuple[torch.Tensor, torch.Tensor],
    gamma: int,
    produced: int,
    max_new_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None, int]:
    """The target scores ``block`` while the draft bets; (drafts + y_1, q, p, bet or None, k)."""
    tokens, q = block
    g = tokens.shape[1]
    # If the bet wins, its k - 1 remaining tokens must leave room for next round's last token.
    k = min(gamma + 1, max_new_tokens - produced - g - 1)
    committed = torch.tensor([seq[tgt.length :]], dtype=torch.long, device=tgt.device)
    feed = torch.cat([committed, tokens.to(tgt.device)], dim=1)
    verify = partial(score, feed, g + 1)
    if k < 1:
        return tokens, q, verify(), None, k
    p, bet = ov.both(verify, partial(propose, tokens[:, -1:], k, produced + g))
    # The row after the bet's first token is unknown: a copy stands in (module docstring).
    tokens = torch.cat([tokens, bet[0][:, :1]], dim=1)
    q = torch.cat([q, bet[1][:, :1]], dim=1)
    p = torch.cat([p, p[:, -1:]], dim=1)
    return tokens, q, p, bet, k


def _emit(
    ver: Verification, tokens: torch.Tensor, bet: tuple | None, eos: set[int], stats: SpecStats
) -> tuple[list[int], bool, bool]:
    """Record the round; returns its new tokens (cut at EOS), whether the bet won, whether done."""
    n, drafted = int(ver.n_accepted.item()), tokens.shape[1]
    won = bet is not None and n == drafted
    new = tokens[0, :n].tolist() + ([] if won else [int(ver.next_token.item())])
    new, done = _cut_at_eos(new, eos)
    stats.record_round(drafted, n, len(new), ver.beta[0, : min(n + 1, drafted)].tolist())
    return new, won, done


@torch.no_grad()
def pipelined_generate(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    gamma: int = 4,
    temperature: float = 1.0,
    temperature_schedule: bool = False,
    generator: torch.Generator | None = None,
    eos_token_id: int | list[int] | None = None,
    overlap: str = "auto",
) -> tuple[torch.Tensor, SpecStats]:
    """``speculative_generate`` drafting a bet ahead; ``overlap``: see docs/kernels.md."""
    ids = _as_prompt(input_ids, max_new_tokens)
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    mode = resolve_overlap(overlap, target, draft, gamma)
    eos = _eos_set(eos_token_id)
    seq = ids[0].tolist()
    tgt, drf = CachedLM(target), CachedLM(draft)
    vocab = vocab_size(target)
    draft_gen = _draft_generator(generator, drf.device)
    stats = SpecStats()
    start = time.perf_counter()
    if len(seq) > 1 and max_new_tokens > 0:
        tgt.forward(ids[:, :-1], keep=1)
        drf.forward(ids[:, :-1], keep=1)

    def propose(pending: torch.Tensor, g: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        temps = block_temperatures(temperature, step, g, temperature_schedule)
        return draft_block(drf, pending, g, vocab, temps, draft_gen)

    def score(feed: torch.Tensor, rows: int) -> torch.Tensor:  # (1, rows, V)
        return logits_to_probs(tgt.forward(feed, keep=rows), temperature)

    block = None  # (tokens (1, g), q (1, g, V)): the rest of a won bet
    produced, done = 0, False
    with _overlap(mode, drf.device) as ov:
        while produced < max_new_tokens and not done:
            if block is None:
                g = min(gamma, max_new_tokens - produced - 1)
                pending = torch.tensor([seq[drf.length :]], dtype=torch.long)
                block = ov.draft(partial(propose, pending, g, produced))
            tokens, q, p, bet, k = _score_and_bet(
                ov, tgt, propose, score, seq, block, gamma, produced, max_new_tokens
            )
            ver = verify_draft(
                tokens.to(p.device), q.to(p.device), p, greedy=temperature == 0, generator=generator
            )
            new, won, done = _emit(ver, tokens, bet, eos, stats)
            seq.extend(new)
            produced += len(new)
            # After a won bet no crop: both caches hold the committed sequence but its last token.
            block = (bet[0][:, 1:], bet[1][:, 1:]) if won and not done else None
            if block is not None:
                continue
            stats.draft_calls += k - 1 if bet is not None else 0  # the rest of a lost bet
            tgt.rollback(len(seq) - 1)
            drf.rollback(min(drf.length, len(seq) - 1))
    stats.seconds = time.perf_counter() - start
    return torch.tensor([seq], device=ids.device), stats
