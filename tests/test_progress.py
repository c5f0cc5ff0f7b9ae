"""Long loops off a terminal: periodic log lines with an ETA; nothing for short loops, rank > 0."""

from __future__ import annotations

import logging

from pipeline.progress import progress


def test_off_a_terminal_a_long_loop_logs_its_progress_and_eta(caplog):
    caplog.set_level(logging.INFO, logger="pipeline.progress")
    items = list(progress(range(3, 8), "quantize segments", initial=3, every_s=0.0))
    assert items == [3, 4, 5, 6, 7]  # the loop is untouched
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("quantize segments: 4/8 (50%), ") and "ETA " in lines[0]
    assert lines[-1].startswith("quantize segments: 8/8 (100%), ") and lines[-1].endswith("ETA 0s")


def test_short_loops_other_ranks_and_disabled_loops_say_nothing(caplog):
    caplog.set_level(logging.INFO, logger="pipeline.progress")
    assert list(progress(range(4), "fast")) == [0, 1, 2, 3]  # shorter than 30 s
    assert list(progress(range(4), "rank 1", is_main=False, every_s=0.0)) == [0, 1, 2, 3]
    assert list(progress(range(4), "off", enabled=False, every_s=0.0)) == [0, 1, 2, 3]
    assert caplog.records == []


def test_an_iterator_without_length_counts_what_is_done(caplog):
    caplog.set_level(logging.INFO, logger="pipeline.progress")
    list(progress(iter("abc"), "tokens", every_s=0.0))
    assert caplog.records[-1].getMessage().startswith("tokens: 3 done, ")
