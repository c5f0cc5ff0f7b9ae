"""The acceptance scenarios: prompt sets on which draft/target agreement is measured and trained.

``long`` (``long_len`` > 512 tokens: position errors accumulate), ``repetition`` (highest rep-n,
Welleck et al. 2020, plus repeated corpus phrases), ``rare`` (highest mean unigram surprisal:
small models disagree most) and ``mix`` (random, the reference); the last three are disjoint
draws from one pool, and everything depends only on the corpus and the seed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pipeline.io import write_json

__all__ = [
    "SCENARIOS",
    "build_scenarios",
    "new_tokens_by_scenario",
    "repetition_score",
    "unigram_frequencies",
]

SCENARIOS = ("long", "repetition", "rare", "mix")
_FORMAT_VERSION = 1


def new_tokens_by_scenario(
    scenarios, new_tokens: int, long_new_tokens: int | None = None
) -> dict[str, int]:
    """Tokens generated per prompt in each of ``scenarios``: ``long_new_tokens`` in ``long`` (the
    method's 512: how acceptance holds far into a generation), ``new_tokens`` elsewhere and when
    it is None."""
    long = long_new_tokens or new_tokens
    return {s: long if s == "long" else new_tokens for s in scenarios}


def _as_docs(token_ids: Sequence) -> list[np.ndarray]:
    """Any list of token id sequences (lists, tensors, arrays, a 2-D tensor) -> int64 arrays."""
    if hasattr(token_ids, "tolist") and not isinstance(token_ids, list):
        token_ids = token_ids.tolist()
    docs = [np.asarray(doc, dtype=np.int64).ravel() for doc in token_ids]
    docs = [doc for doc in docs if doc.size]
    if not docs:
        raise ValueError("build_scenarios got an empty corpus; pass a list of token id lists")
    if min(int(doc.min()) for doc in docs) < 0:
        raise ValueError("token ids must be >= 0")
    return docs


def unigram_frequencies(docs: Sequence) -> np.ndarray:
    """Relative frequency of every token id in the corpus, shape (max_id + 1,)."""
    counts = np.bincount(np.concatenate(_as_docs(docs)))
    return counts / counts.sum()


def repetition_score(window: Sequence[int], max_n: int = 4) -> float:
    """Mean over n = 1..max_n of rep-n = 1 - distinct n-grams / n-grams, in [0, 1)."""
    w = np.asarray(window, dtype=np.int64)
    reps = []
    for n in range(1, min(max_n, w.size) + 1):
        grams = np.lib.stride_tricks.sliding_window_view(w, n)  # (L - n + 1, n)
        reps.append(1.0 - np.unique(grams, axis=0).shape[0] / grams.shape[0])
    return float(np.mean(reps))


def _windows(docs: list[np.ndarray], length: int, count: int, rng: np.random.Generator):
    """(count, length) int64: tiles inside documents, else of the concatenated corpus, else
    (tiny corpora) random, possibly overlapping, windows."""
    for source in (docs, [np.concatenate(docs)]):
        sizes = np.array([doc.size for doc in source])  # (D,)
        # A random offset per document so tiles do not always start at token 0.
        offsets = rng.integers(0, sizes % length + 1)  # (D,)
        counts = np.where(sizes >= length, (sizes - offsets) // length, 0)  # tiles per document
        if counts.sum() >= count:
            picks = rng.choice(int(counts.sum()), size=count, replace=False)  # global tile ids
            ends = np.cumsum(counts)
            doc_idx = np.searchsorted(ends, picks, side="right")
            starts = offsets[doc_idx] + (picks - ends[doc_idx] + counts[doc_idx]) * length
            return np.stack([source[d][s : s + length] for d, s in zip(doc_idx, starts)])
    stream = source[0]
    if stream.size < length:
        raise ValueError(
            f"the corpus has {stream.size} tokens but scenario windows need {length}; "
            "use a larger corpus or lower prompt_len / long_len"
        )
    starts = rng.integers(0, stream.size - length + 1, size=count)
    return np.stack([stream[s : s + length] for s in starts])


def _repeated_phrases(docs: list[np.ndarray], length: int, count: int, rng: np.random.Generator):
    """Prompts made by repeating a corpus phrase of 4-16 tokens up to ``length`` tokens."""
    out = []
    for _ in range(count):
        phrase = _windows(docs, int(rng.integers(4, 17)), 1, rng)[0]
        out.append(np.resize(phrase, length))  # np.resize repeats the phrase cyclically
    return np.stack(out) if out else np.zeros((0, length), dtype=np.int64)


def _fingerprint(docs: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for doc in docs:
        h.update(np.int64(doc.size).tobytes())
        h.update(doc.tobytes())
    return h.hexdigest()


def build_scenarios(
    token_ids: Sequence,
    *,
    n_prompts: int,
    prompt_len: int,
    long_len: int = 576,
    seed: int = 0,
    cache_path: str | Path | None = None,
    constructed_fraction: float = 0.5,
    pool_factor: int = 16,
) -> dict[str, list[list[int]]]:
    """The four scenarios' ``n_prompts`` token id lists, cut from the documents ``token_ids``;
    ``cache_path`` is reused when its parameters and corpus hash match."""
    if n_prompts < 1 or prompt_len < 2 or long_len < 2:
        raise ValueError(
            f"need n_prompts >= 1, prompt_len >= 2, long_len >= 2; got {n_prompts}, "
            f"{prompt_len}, {long_len}"
        )
    if not 0.0 <= constructed_fraction <= 1.0:
        raise ValueError(f"constructed_fraction must be in [0, 1], got {constructed_fraction}")
    docs = _as_docs(token_ids)
    meta = {
        "version": _FORMAT_VERSION,
        "n_prompts": n_prompts,
        "prompt_len": prompt_len,
        "long_len": long_len,
        "seed": seed,
        "constructed_fraction": constructed_fraction,
        "pool_factor": pool_factor,
        "corpus_sha256": _fingerprint(docs),
    }
    if cache_path is not None and Path(cache_path).is_file():
        cached = json.loads(Path(cache_path).read_text())
        if cached.get("meta") == meta:
            return cached["scenarios"]

    rng = np.random.default_rng(seed)
    with np.errstate(divide="ignore"):  # ids absent from the corpus never occur in a window
        surprisal = -np.log(unigram_frequencies(docs))  # (V,)
    n_constructed = round(constructed_fraction * n_prompts)
    n_pool = max(pool_factor, 3) * n_prompts
    pool = _windows(docs, prompt_len, n_pool, rng)  # (K, prompt_len)
    free = np.ones(len(pool), dtype=bool)

    def take(order: np.ndarray, n: int) -> np.ndarray:
        # Highest-ranked windows not used by another set; with a tiny pool, reuse is allowed.
        chosen = [k for k in order if free[k]][:n]
        chosen += [k for k in order if k not in chosen][: n - len(chosen)]
        free[chosen] = False
        return pool[chosen]

    rare = take(np.argsort(-surprisal[pool].mean(axis=1), kind="stable"), n_prompts)
    rep_scores = np.array([repetition_score(w) for w in pool])
    natural = take(np.argsort(-rep_scores, kind="stable"), n_prompts - n_constructed)
    repetition = np.concatenate([natural, _repeated_phrases(docs, prompt_len, n_constructed, rng)])
    mix = take(rng.permutation(len(pool)), n_prompts)
    long = _windows(docs, long_len, n_prompts, rng)

    scenarios = {name: arr.tolist() for name, arr in zip(SCENARIOS, (long, repetition, rare, mix))}
    if cache_path is not None:
        cache_path = Path(cache_path)
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(cache_path, {"meta": meta, "scenarios": scenarios})
    return scenarios
