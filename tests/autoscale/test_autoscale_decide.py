"""The autoscaler's arithmetic over scripted usage series: busy ratio and decisions."""

from __future__ import annotations

import pytest

from polyserve.autoscale.decide import Decider
from polyserve.autoscale.ratio import HostLoad, Sample, Tracker, pool_ratio


def sample(uptime: float, busy_ms: int, at: float, workers: int = 2) -> Sample:
    return Sample(uptime_s=uptime, busy_ms=busy_ms, workers=workers, in_flight=0, at=at)


# -- busy ratio ---------------------------------------------------------------------


def test_a_host_first_seen_gives_a_baseline_then_deltas():
    t = Tracker()
    assert t.observe("a", sample(100, 5_000, at=1000)).status == "new"
    load = t.observe("a", sample(110, 8_000, at=1010))
    assert load == HostLoad("a", "ok", busy_s=3.0, capacity_s=20.0)


def test_a_restart_seen_as_uptime_going_down_is_a_new_baseline():
    t = Tracker()
    t.observe("a", sample(100, 50_000, at=1000))
    assert t.observe("a", sample(3, 90_000, at=1010)).status == "restarted"
    assert t.observe("a", sample(13, 91_000, at=1020)) == HostLoad("a", "ok", 1.0, 20.0)


def test_a_restart_missed_between_scrapes_is_caught_by_the_clock():
    """Uptime went up, but by more than the time that passed: another boot."""
    t = Tracker()
    t.observe("a", sample(2, 100, at=1000))
    assert t.observe("a", sample(40, 9_000, at=1010)).status == "restarted"


def test_counters_that_go_down_are_a_restart():
    t = Tracker()
    t.observe("a", sample(100, 9_000, at=1000))
    assert t.observe("a", sample(110, 1_000, at=1010)).status == "restarted"


def test_an_unanswered_host_keeps_its_baseline_and_counts_over_the_gap_when_back():
    t = Tracker()
    t.observe("a", sample(100, 0, at=1000))
    assert t.observe("a", None).status == "unanswered"
    assert t.observe("a", sample(120, 4_000, at=1020)) == HostLoad("a", "ok", 4.0, 40.0)


def test_a_host_that_does_not_answer_is_unhealthy_not_idle():
    """Its capacity is left out: one busy host and one silent one is a busy pool."""
    loads = [HostLoad("a", "ok", busy_s=9.0, capacity_s=10.0), HostLoad("b", "unanswered")]
    assert pool_ratio(loads) == pytest.approx(0.9)


def test_no_host_answering_twice_gives_no_figure():
    assert pool_ratio([HostLoad("a", "new"), HostLoad("b", "restarted")]) is None
    assert pool_ratio([]) is None


def test_forgotten_hosts_start_over():
    t = Tracker()
    t.observe("a", sample(100, 0, at=1000))
    t.forget([])
    assert t.observe("a", sample(110, 0, at=1010)).status == "new"


# -- decisions ----------------------------------------------------------------------


def decider(lo: int = 1, hi: int = 5, up: float = 30, down: float = 600) -> Decider:
    return Decider("cpu", lo, hi, target=0.5, up_window_s=up, down_window_s=down)


def run(d: Decider, current: int, series: list[float | None], step: float = 10) -> list[int]:
    """Feed one ratio per interval, acting on each decision; the host counts after each."""
    counts = []
    for i, ratio in enumerate(series):
        current = d.decide(i * step, current, ratio, demand=False).desired
        counts.append(current)
    return counts


def test_desired_is_ceil_of_current_times_ratio_over_target_after_the_up_window():
    d = decider(up=0)
    decision = d.decide(0, current=2, ratio=0.8, demand=False)
    assert (decision.raw, decision.desired) == (4, 4)  # ceil(2 * 0.8 / 0.5) = 4


def test_a_spike_shorter_than_the_up_window_adds_no_host():
    assert run(decider(up=30), 1, [0.5, 2.0, 2.0, 0.5, 0.5]) == [1, 1, 1, 1, 1]


def test_load_sustained_over_the_up_window_scales_up_to_its_smallest_ask():
    # asks: 1, 4, 3, 4, 5 (ceil(n * r / 0.5)); at t=30 the window [0, 30] saw 1..4: no;
    # at t=40 the window [10, 40] saw 4, 3, 4: up to 3.
    counts = run(decider(up=30), 1, [0.5, 2.0, 1.5, 2.0, 2.5])
    assert counts == [1, 1, 1, 1, 3]


def test_scale_down_waits_for_the_down_window_and_takes_its_largest_ask():
    d = decider(up=0, down=60)
    counts = run(d, 4, [0.5] + [0.1] * 8)  # asks 4 at t=0, then 1s
    assert counts[:7] == [4] * 7  # t=0..60: the window [t-60, t] still holds the 4
    assert counts[7:] == [1, 1]  # t=70: every ask in the window is 1


def test_flapping_load_does_not_flap_the_pool():
    counts = run(decider(up=30, down=60), 2, [1.0, 0.1] * 10)
    assert set(counts) == {2}


def test_a_fresh_autoscaler_does_not_scale_down_before_it_has_watched_a_window():
    d = decider(up=0, down=60)
    assert d.decide(0, current=4, ratio=0.0, demand=False).desired == 4


def test_bounds_act_at_once():
    d = decider(lo=2, hi=3, up=300, down=300)
    assert d.decide(0, current=0, ratio=None, demand=False).desired == 2  # below min
    assert d.decide(10, current=5, ratio=None, demand=False).desired == 3  # above max
    assert d.decide(20, current=3, ratio=9.0, demand=False).raw == 3  # clamped ask


def test_no_figure_holds_the_pool():
    d = decider(up=0, down=0)
    assert d.decide(0, current=3, ratio=None, demand=False).desired == 3


def test_demand_at_zero_brings_a_pool_up_at_once():
    d = Decider("gpu", 0, 2, target=0.5, up_window_s=30, down_window_s=600)
    assert d.decide(0, current=0, ratio=None, demand=False).desired == 0
    decision = d.decide(10, current=0, ratio=None, demand=True)
    assert decision.desired == 1
    assert "demand" in decision.reason


def test_an_idle_pool_goes_back_to_its_minimum_after_the_down_window():
    d = Decider("gpu", 0, 2, target=0.5, up_window_s=0, down_window_s=30)
    assert d.decide(0, current=0, ratio=None, demand=True).desired == 1
    counts = [d.decide(t, current=1, ratio=0.0, demand=False).desired for t in (10, 20, 30, 40)]
    assert counts == [1, 1, 1, 0]  # t=30's window still holds t=0's demand
