"""Latency summaries: count and sum since load, quantiles of the last minute within 0.5 %."""

from __future__ import annotations

import math

import numpy as np

from daemon.core.summary import Summary, quantiles


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_quantiles_are_within_half_a_percent_of_numpys() -> None:
    clock = Clock()
    summary = Summary(clock)
    rng = np.random.default_rng(11)
    values = rng.lognormal(6, 1.5, 20_000).astype(int)
    for value in values:
        summary.observe(int(value))
    assert summary.count == len(values) and summary.sum == int(values.sum())
    wanted = [0.5, 0.9, 0.95, 0.99, 0.999]
    got = quantiles([summary], wanted)
    for q, value in zip(wanted, got, strict=True):
        exact = float(np.quantile(values, q, method="inverted_cdf"))
        assert abs(value - exact) <= max(1, 0.005 * exact), (q, value, exact)
    # Far fewer buckets than observations: memory follows the spread of values, not their number.
    assert sum(len(slot.buckets) for slot in summary.window()) < 1500


def test_one_value_is_exact_and_zero_is_kept() -> None:
    clock = Clock()
    summary = Summary(clock)
    summary.observe(24613)
    assert quantiles([summary], [0.5, 0.999]) == [24613, 24613]
    summary.observe(0)
    summary.observe(0)
    assert quantiles([summary], [0.5, 0.9]) == [0, 24613]


def test_the_window_is_the_last_minute_and_count_and_sum_are_since_load() -> None:
    clock = Clock()
    summary = Summary(clock)
    summary.observe(100)
    clock.now += 30
    summary.observe(5000)
    assert quantiles([summary], [0.5]) == [100]
    clock.now += 40  # the first observation has aged out, the second not yet
    assert quantiles([summary], [0.5]) == [5000]
    clock.now += 60
    assert all(math.isnan(v) for v in quantiles([summary], [0.5, 0.9]))
    assert (summary.count, summary.sum) == (2, 5100)
    summary.observe(7)
    assert quantiles([summary], [0.5]) == [7]


def test_summaries_of_one_version_merge() -> None:
    """During a reload the old and new objects of a version are exported as one series."""
    clock = Clock()
    old, new = Summary(clock), Summary(clock)
    for value in (10, 20, 30):
        old.observe(value)
    for value in (40, 50):
        new.observe(value)
    assert quantiles([old, new], [0.2, 0.6, 1.0]) == [10, 30, 50]
