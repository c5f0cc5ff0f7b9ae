"""Progress of long loops: a tqdm bar on a terminal, periodic log lines with an ETA elsewhere
(a bar in a log file is one ever-growing line); only rank 0 reports."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import TypeVar

from tqdm.auto import tqdm

log = logging.getLogger(__name__)

EVERY_S = 30.0  # seconds between two log lines of one loop
T = TypeVar("T")


def progress(
    items: Iterable[T],
    desc: str,
    *,
    total: int | None = None,
    initial: int = 0,
    unit: str = "it",
    enabled: bool = True,
    is_main: bool = True,
    every_s: float = EVERY_S,
) -> Iterable[T]:
    """``items``, reporting progress: a bar, or off a terminal a line every ``every_s`` seconds;
    ``initial`` items were done before (a resumed loop)."""
    if not (enabled and is_main):
        return items
    if total is None and isinstance(items, Sized):
        total = initial + len(items)
    if sys.stderr.isatty():
        return tqdm(items, desc=desc, total=total, initial=initial, unit=unit, leave=False)
    return _logged(items, desc, total, initial, every_s)


def _logged(
    items: Iterable[T], desc: str, total: int | None, initial: int, every_s: float
) -> Iterator[T]:
    start = last = time.monotonic()
    done, reported = initial, None  # reported: the count of the last line
    for item in items:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= every_s:
            log.info("%s", _line(desc, done, total, initial, now - start))
            last, reported = now, done
    if reported not in (None, done):  # the end of a loop that said it was running
        log.info("%s", _line(desc, done, total, initial, time.monotonic() - start))


def _line(desc: str, done: int, total: int | None, initial: int, elapsed: float) -> str:
    return f"{desc}: {status(done, total, initial, elapsed)}"


def status(
    done: int, total: int | None, initial: int, elapsed: float, fields: Sequence[str] = ()
) -> str:
    """``k/n (p%), <fields>, 1m05s elapsed, ETA 2m10s``, the ETA at the rate since ``initial``
    (``k done, <fields>, 1m05s elapsed`` without a total)."""
    shown = "".join(f", {f}" for f in fields)
    if total is None:
        return f"{done} done{shown}, {clock(elapsed)} elapsed"
    rate = (done - initial) / elapsed if elapsed > 0 else 0.0
    eta = clock((total - done) / rate) if rate > 0 else "unknown"
    pct = 100.0 * done / total if total else 100.0
    return f"{done}/{total} ({pct:.0f}%){shown}, {clock(elapsed)} elapsed, ETA {eta}"


def clock(seconds: float) -> str:
    """``2h05m00s``, ``4m10s``, ``9s``."""
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"
