"""Pipelined speculative decoding: the draft proposes the next block while the target verifies.

PEARL's post-verify (Liu et al., "PEARL: Parallel Speculative Decoding with Adaptive Draft
Length", 2024). In :func:`~pipeline.speculative.decoding.speculative_generate` the two models take
turns: the draft proposes gamma tokens x_1..x_g, then waits while the target verifies them.
Here, while the target runs its one cached forward over the block, the draft keeps going from
x_g and samples a *bet* y_1..y_k (k = gamma + 1) on the outcome that the whole block is
accepted. The target's forward ends with the row p(. | s, x) that would give the bonus token;
instead, the bet's first token y_1 is tested against that row like any draft token, so a round
verifies x_1..x_g, y_1 with the unchanged :func:`~pipeline.speculative.sampling.verify_draft`:

- everything accepted (the bet is won): x and y_1 are emitted (g + 1 tokens, as many as a
  fully accepted speculative round), and y_2..y_k, already drafted, are the next round's block:
  the next target forward starts at once, without a draft phase before it;
- a rejection: the accepted prefix plus the correction token are emitted as usual (at y_1 the
  correction comes from max(0, p - q) like at any position), the rest of the bet is discarded
  and the draft's cache is cropped back to the committed sequence.

Why the output is still distributed as the target's (and at temperature 0 equals greedy target
decoding): each round is a standard speculative round on the committed prefix s with drafts
x_1..x_g, y_1, because
1. each draft was sampled from the draft conditioned on s and the drafts before it: x by
   construction, y_1 after s + x, and a won bet's y_2..y_k after s + x + y_1, which is exactly
   the next round's committed prefix;
2. each is tested against the target row at its own position, and the correction token (at the
   first rejection) is sampled from the residual of that row, as in verify_draft;
3. whether a bet's rest becomes the next block depends only on the acceptance of x and y_1
   (their tokens and the verification's uniforms), never on y_2..y_k, so that block is
   distributed as freshly drafted tokens would be; the draft samples from a generator of its
   own, independent of the verification's uniforms and correction samples.
The one departure: a won round ends after y_1 without a bonus token, because the target row
after y_1 is not computed yet. Ending a round after an accepted draft is allowed: speculative
sampling's guarantee is per position (each emitted token ~ p(. | prefix)), and that position is
the next round's first. (verify_draft wants a row after the last draft; a copy of the previous
row stands in, and the bonus token it may yield is discarded.)

Costs: the bet is one draft forward longer than a block, and a lost bet's forwards are wasted
(hidden behind the target's forward when the overlap works). In ``stats``, ``drafted`` and
``gammas`` count y_1 as a draft of its round, ``draft_calls`` counts every draft forward (lost
bets included), and the rounds whose bet was won number ``stats.accepted + stats.target_calls
- stats.new_tokens`` (without an end-of-sequence cut).

The schedule, and hence the token stream for a given ``generator``, is the same whatever the
overlap; only the wall time changes:
- ``"stream"`` (CUDA): the draft's kernels go to a side ``torch.cuda.Stream``; the target's
  forward is launched first on the current stream so its kernels queue while the host launches
  the draft's. The draft's generator lives on its device so drafting never waits for the host.
  Written for CUDA but not run in this project's CI (CPU-only machines).
- ``"thread"`` (any device, meant for CPU): the draft runs in a second Python thread. ATen
  releases the GIL inside its kernels, but the Python of each HF forward (module calls, cache
  bookkeeping) holds it, so small models barely overlap. ``torch.set_num_threads`` is
  process-wide: ATen applies the count to every thread that runs an op, so two concurrent
  forwards use up to twice that many OpenMP threads and oversubscribe the cores (spin-waiting
  OpenMP threads make it worse); lowering the count helps the overlap but slows every
  sequential step too. :func:`measure_overlap_gain` measures the net effect under the current
  setting.
- ``"none"``: sequential, the same bets and reuse; slower than speculative decoding (the lost
  bets are paid in full), useful as the reference of the other two.
- ``"auto"``: ``"stream"`` on CUDA; on a CPU ``"thread"`` only if :func:`measure_overlap_gain`
  finds it at least :data:`AUTO_MIN_GAIN` times faster (measured once per target, draft,
  gamma and thread count), else ``"none"``; ``"none"`` on other devices.

PEARL's pre-verify (the target checks the first draft token while the draft writes the rest)
is not implemented: it adds a target forward per round, which pays only when the target would
otherwise sit idle, not when both models compete for the same CPU cores.
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
from pipeline.speculative.sampling import logits_to_probs, verify_draft
from pipeline.speculative.stats import SpecStats

__all__ = [
    "AUTO_MIN_GAIN",
    "OVERLAPS",
    "measure_overlap_gain",
    "pipelined_generate",
    "resolve_overlap",
]

OVERLAPS = ("auto", "stream", "thread", "none")
# Thread overlap must beat sequential by this factor for "auto" to pick it: a smaller measured
# gain is within timing noise and would not survive a busier machine.
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
        """Run the target's and the draft's work; returns (target result, draft result)."""
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
        # Order the side stream after the work queued so far, but not after the target's
        # forward, which is launched first so the GPU starts on it while the host launches
        # the draft's kernels.
        self._side.wait_stream(self._main)
        out = target_fn()
        drafted = self._on_side(draft_fn)
        self._main.wait_stream(self._side)
        return out, drafted

    def _on_side(self, fn: Callable[[], Any]) -> Any:
        # Everything the draft allocates lives on the side stream; the main stream reads it
        # only after wait_stream, and the verification's .item() syncs before it is freed.
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
    """The draft's own generator, seeded from ``generator`` (or the global RNG).

    A generator shared by two threads would hand out its numbers in whatever order the threads
    ask, so the tokens would depend on timing; with one generator per model the token stream
    is fixed by the seed whatever the overlap, and the side stream samples on its device.
    """
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
    """How much faster pipelined decoding runs with the draft in a second thread.

    Times whole greedy decodes (``rounds`` blocks of gamma + 1 tokens after a random context of
    ``context_len`` tokens) with overlap "thread" and "none", alternating so a change of load
    hits both, and returns the ratio of their median times. Whole decodes, not one isolated
    round: on this project's CPU an isolated verify-while-drafting round ran 1.13-1.17x faster
    threaded while whole decodes ran 1-4% slower (the loop's Python holds the GIL between
    the forwards; docs/benchmarks.md). Measured under the current ``torch.set_num_threads``
    (see the module docstring), for CPU models only.

    Args:
        target: the verifying model (on the CPU).
        draft: the proposing model (on the CPU).
        gamma: draft length per round.
        context_len: length of the random context.
        rounds: blocks of gamma + 1 tokens per timed decode; also the timed decodes per mode.
        n_warmup: untimed decodes of each kind first (allocator and thread-pool warm-up).
        seed: seed of the random context.

    Returns:
        sequential time / threaded time: > 1 when the thread overlap pays.
    """
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
    """The overlap ``pipelined_generate`` runs with: ``overlap`` itself unless it is "auto".

    Returns:
        "stream", "thread" or "none" (see the module docstring for what "auto" picks).
    """
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
    """Generate up to ``max_new_tokens`` tokens distributed as the target's, drafting ahead.

    Same contract as :func:`~pipeline.speculative.decoding.speculative_generate` (batch size 1, any
    HF-style causal LM with a croppable cache); the schedule is the module docstring's.

    Args:
        target: the model whose distribution is reproduced (eval mode).
        draft: the proposing model (same tokenizer).
        input_ids: (1, T) or (T,) prompt.
        max_new_tokens: generation budget; rounds near the end draft fewer tokens.
        gamma: drafts the target's forward scores per round (a block of gamma tokens; the
            bet's first token, tested at the bonus position, comes on top).
        temperature: applied to both models; 0 = greedy (output equals greedy target decoding).
        temperature_schedule: the draft samples new token n at the decoding-step schedule's
            temperature, as in :func:`~pipeline.speculative.decoding.speculative_generate`; a
            bet's tokens are sampled at the steps they would be emitted at.
        generator: randomness of the verification; the draft's own generator is seeded from
            it, so a seeded generator gives the same tokens with every ``overlap``.
        eos_token_id: stop after emitting any of these tokens.
        overlap: "auto", "stream", "thread" or "none" (see the module docstring).

    Returns:
        (sequence, stats): the (1, T + n) prompt plus new tokens, and the round statistics
        (``stats.seconds`` excludes the one-off measurement "auto" may run first).
    """
    ids = _as_prompt(input_ids, max_new_tokens)
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    mode = resolve_overlap(overlap, target, draft, gamma)
    greedy = temperature == 0
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

    def score(feed: torch.Tensor, rows: int) -> torch.Tensor:
        return logits_to_probs(tgt.forward(feed, keep=rows), temperature)  # (1, rows, V)

    block = None  # (tokens (1, g), q (1, g, V)): the rest of a won bet, drafted last round
    produced, done = 0, False
    with _overlap(mode, drf.device) as ov:
        while produced < max_new_tokens and not done:
            if block is None:
                g = min(gamma, max_new_tokens - produced - 1)
                pending = torch.tensor([seq[drf.length :]], dtype=torch.long)
                block = ov.draft(partial(propose, pending, g, produced))
            tokens, q = block
            g = tokens.shape[1]
            # A round emits at most g + 1 tokens; if the bet wins, its k - 1 remaining tokens
            # are the next round's drafts, which must leave room for that round's last token.
            k = min(gamma + 1, max_new_tokens - produced - g - 1)
            committed = torch.tensor([seq[tgt.length :]], dtype=torch.long, device=tgt.device)
            feed = torch.cat([committed, tokens.to(tgt.device)], dim=1)
            verify = partial(score, feed, g + 1)
            bet = None
            if k >= 1:  # (then g >= 1: the draft has read all of the block but its last token)
                p, bet = ov.both(verify, partial(propose, tokens[:, -1:], k, produced + g))
                # The bet's first token takes the bonus position. The row after it is not
                # known until the next forward; a copy stands in, and the bonus it yields when
                # everything is accepted is discarded (the round ends there).
                tokens = torch.cat([tokens, bet[0][:, :1]], dim=1)
                q = torch.cat([q, bet[1][:, :1]], dim=1)
                p = torch.cat([p, p[:, -1:]], dim=1)
            else:
                p = verify()
            ver = verify_draft(
                tokens.to(p.device), q.to(p.device), p, greedy=greedy, generator=generator
            )
            n, drafted = int(ver.n_accepted.item()), tokens.shape[1]
            won = bet is not None and n == drafted
            new = tokens[0, :n].tolist() + ([] if won else [int(ver.next_token.item())])
            new, done = _cut_at_eos(new, eos)
            seq.extend(new)
            produced += len(new)
            stats.record_round(drafted, n, len(new), ver.beta[0, : min(n + 1, drafted)].tolist())
            if won and not done:
                # The caches need no crop: the target holds the committed sequence but its last
                # token (the bet's first), the draft also the rest of the bet but its last token.
                block = (bet[0][:, 1:], bet[1][:, 1:])
                continue
            block = None
            if bet is not None:
                stats.draft_calls += k - 1  # forwards spent on the rest of a lost bet
            tgt.rollback(len(seq) - 1)
            drf.rollback(min(drf.length, len(seq) - 1))
    stats.seconds = time.perf_counter() - start
    return torch.tensor([seq], device=ids.device), stats
