"""The sliding-window acceptance monitor: a fall over the window is detected once."""

import pytest

from pipeline.speculative.monitor import AcceptanceMonitor


def test_a_fall_larger_than_the_threshold_is_detected_once():
    monitor = AcceptanceMonitor(window=8, threshold=0.06)
    assert not any(monitor.update(0.7) for _ in range(8))  # flat: nothing
    assert monitor.fall == pytest.approx(0.0) and monitor.mean == pytest.approx(0.7)
    # Newer half after k steps at 0.6: falls of 0.025, 0.05, then 0.075 > 0.06.
    hits = [monitor.update(0.6) for _ in range(3)]
    assert hits == [False, False, True] and monitor.drops == 1
    assert len(monitor.values) == 0  # starts over: the same fall is not acted on twice
    assert not any(monitor.update(0.6) for _ in range(8))


def test_noise_below_the_threshold_and_a_rise_do_not_count():
    monitor = AcceptanceMonitor(window=8, threshold=0.05)
    for a in [0.70, 0.74, 0.68, 0.72, 0.69, 0.71, 0.70, 0.69]:  # fall of 0.0125
        assert not monitor.update(a)
    rising = AcceptanceMonitor(window=4, threshold=0.0)
    assert not any(rising.update(a) for a in [0.5, 0.5, 0.9, 0.9])
    assert rising.fall == pytest.approx(-0.4)


def test_monitor_only_and_state_round_trip():
    watch = AcceptanceMonitor(window=4, threshold=None)
    assert not any(watch.update(a) for a in [0.9, 0.9, 0.1, 0.1])  # no threshold: never acts
    copy = AcceptanceMonitor(window=4, threshold=None)
    copy.load_state_dict(watch.state_dict())
    assert list(copy.values) == [0.9, 0.9, 0.1, 0.1] and copy.fall == pytest.approx(0.8)
    with pytest.raises(ValueError, match="window"):
        AcceptanceMonitor(window=1)
