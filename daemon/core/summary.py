"""Prometheus summaries of request latencies, as Triton exports them with
`--metrics-config summary_latencies=true` (its prometheus-cpp summaries): a count and a sum
since the model loaded, and quantiles over the last minute.

prometheus-cpp estimates quantiles with CKMS to the rank error each quantile is configured
with; here every observation goes to a logarithmic bucket 1 % wide, so any quantile of the
window is within 0.5 % of a value observed in it (and exact when the bucket holds one value:
each bucket keeps its smallest and largest), with memory bounded by the buckets the values
reach (a few hundred), not by the request rate. The window is five age buckets of 12 s, rotated
as time passes, as prometheus-cpp's default (60 s, 5 buckets).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

AGE_SECONDS = 60.0
AGE_BUCKETS = 5
_SLOT_SECONDS = AGE_SECONDS / AGE_BUCKETS
_LOG_WIDTH = math.log(1.01)


class _Slot:
    """The observations of one 12 s age bucket: per logarithmic bucket, count, min and max."""

    __slots__ = ("buckets", "index")

    def __init__(self, index: int) -> None:
        self.index = index
        self.buckets: dict[int, list[float]] = {}


class Summary:
    """One model version's summary of one latency (microseconds)."""

    __slots__ = ("_clock", "_slots", "count", "sum")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.count = 0
        self.sum = 0
        self._slots: list[_Slot] = []
        self._clock = clock

    def observe(self, value: int, now: float | None = None) -> None:
        """One latency; `now` is this summary's clock, read once by a caller observing several."""
        self.count += 1
        self.sum += value
        index = int((self._clock() if now is None else now) // _SLOT_SECONDS)
        slots = self._slots
        if not slots or slots[-1].index != index:
            slots.append(_Slot(index))
            # Only the slots still inside the window are kept.
            while slots[0].index <= index - AGE_BUCKETS:
                slots.pop(0)
        key = int(math.log(value) / _LOG_WIDTH) if value > 0 else -1
        buckets = slots[-1].buckets
        bucket = buckets.get(key)
        if bucket is None:
            buckets[key] = [1, value, value]
        else:
            bucket[0] += 1
            if value < bucket[1]:
                bucket[1] = value
            elif value > bucket[2]:
                bucket[2] = value

    def window(self) -> list[_Slot]:
        oldest = int(self._clock() // _SLOT_SECONDS) - AGE_BUCKETS
        return [slot for slot in self._slots if slot.index > oldest]


def quantiles(summaries: Sequence[Summary], wanted: Sequence[float]) -> list[float]:
    """Each wanted quantile of the observations of the last minute of `summaries` together
    (NaN when there are none, as prometheus-cpp reports it)."""
    merged: dict[int, list[float]] = {}
    for summary in summaries:
        for slot in summary.window():
            for key, (count, low, high) in slot.buckets.items():
                into = merged.get(key)
                if into is None:
                    merged[key] = [count, low, high]
                else:
                    into[0] += count
                    into[1] = min(into[1], low)
                    into[2] = max(into[2], high)
    total = sum(bucket[0] for bucket in merged.values())
    if not total:
        return [math.nan for _ in wanted]
    ordered = sorted(merged.items())
    values: list[float] = []
    for q in wanted:
        rank = max(1, math.ceil(q * total))
        seen = 0.0
        for key, (count, low, high) in ordered:
            seen += count
            if seen >= rank:
                middle = math.exp((key + 0.5) * _LOG_WIDTH) if key >= 0 else 0.0
                values.append(round(min(max(middle, low), high)))
                break
    return values
