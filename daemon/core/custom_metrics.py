"""Metrics that models define themselves (Triton's custom metrics), exported at /metrics.

A python model's `pb_utils.MetricFamily(...)` / `family.Metric(labels=...)` end up here through
the backend contract's `CustomMetrics` hook. What Triton 2.51 does, checked side by side
(`tests/compat/test_oracle.py`), and kept here:

- Families are the server's, not a model's: two models (or two instances, or a reload's old and
  new version) that create a family of one name and kind share it, and the first description
  stays. The same name as another kind is refused.
- Within a family, one series per label set: a second `Metric` with the same labels (in any
  order) is the same series, and its buckets, if different, are ignored.
- A series lives while some open family handle holds it: closing a handle (the model deleted
  its `MetricFamily`, or its instance was unloaded) releases its series, and a series no handle
  holds leaves /metrics. So a reload, whose new version opens its families before the old
  version closes its own, keeps the counts going; an unload removes them. (Triton 2.51 keeps
  an unloaded python model's series until the server exits: its stub process ends without
  deleting them.)

Different on purpose: the names of the daemon's own families (`nv_*`, `edged_*`,
`llamacpp:*`) are refused, where Triton hands a model its own `nv_inference_count` family to
increment; two families of one name would make Prometheus reject the whole scrape.

Values change on model threads and are read by the scrape on the event loop, so every read and
write takes the registry's lock (a few hundred nanoseconds; none of it blocks).
"""

from __future__ import annotations

import itertools
import math
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from daemon.errors import InvalidArgument, Unsupported

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from daemon.backend import MetricKind

# Prometheus's data model (Triton's prometheus-cpp checks the same).
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# The daemon's own families start with these (daemon/core/stats.py, residency, the engines').
RESERVED_PREFIXES = ("nv_", "edged_", "llamacpp:")

_TRITON_KIND = {"counter": "COUNTER", "gauge": "GAUGE", "histogram": "HISTOGRAM"}


class _Series:
    __slots__ = ("bounds", "counts", "labels", "refs", "total", "value")

    def __init__(self, labels: tuple[tuple[str, str], ...], bounds: tuple[float, ...]) -> None:
        self.labels = labels
        self.value = 0.0
        # Histograms: upper bounds (the +Inf bucket is implicit), per-bucket (not cumulative)
        # counts with the +Inf bucket last, and the sum of what was observed.
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.refs = 0


class _Family:
    __slots__ = ("description", "handles", "kind", "name", "series")

    def __init__(self, name: str, description: str, kind: MetricKind) -> None:
        self.name = name
        self.description = description
        self.kind = kind
        self.series: dict[tuple[tuple[str, str], ...], _Series] = {}
        self.handles = 0


class CustomMetricsRegistry:
    """The daemon's custom metric families (one registry per daemon; `MetricsRegistry` owns it
    and adds `families` to every scrape). Implements the contract's `CustomMetrics`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}

    def family(self, name: str, description: str, kind: MetricKind) -> FamilyHandle:
        if not isinstance(name, str) or not _METRIC_NAME.fullmatch(name):
            raise InvalidArgument("Invalid metric name")
        if name.startswith(RESERVED_PREFIXES):
            raise InvalidArgument(
                f"metric name '{name}' is reserved: names starting with "
                f"{', '.join(RESERVED_PREFIXES)} are the server's own families"
            )
        with self._lock:
            family = self._families.get(name)
            if family is None:
                family = self._families[name] = _Family(name, description, kind)
            elif family.kind != kind:
                raise InvalidArgument("Family name already exists with different type")
            family.handles += 1
        return FamilyHandle(self, family)

    def families(self) -> Iterator[Metric]:
        """The families as prometheus_client's data model, for the scrape."""
        from prometheus_client.metrics_core import Metric

        with self._lock:
            snapshot = [
                (f.name, f.description, f.kind, [(s.labels, s.value, s.bounds, list(s.counts), s.total) for s in f.series.values()])
                for f in self._families.values()
                if f.series  # a family without series is not shown (as Triton's prometheus-cpp)
            ]
        for name, description, kind, rows in snapshot:
            metric = Metric(name, description, kind)
            for labels, value, bounds, counts, total in rows:
                base = dict(labels)
                if kind != "histogram":
                    metric.add_sample(name, base, value)
                    continue
                cumulative = 0
                for bound, count in zip((*bounds, math.inf), counts, strict=True):
                    cumulative += count
                    metric.add_sample(f"{name}_bucket", {**base, "le": _bound_text(bound)}, cumulative)
                metric.add_sample(f"{name}_count", base, cumulative)
                metric.add_sample(f"{name}_sum", base, total)
            yield metric

    # Called by the handles, under no lock of their own.

    def _series(self, owner: FamilyHandle, labels: Mapping[str, str], bounds: tuple[float, ...]) -> _Series:
        key = tuple(sorted(labels.items()))
        family = owner._family
        with self._lock:  # one lock with `_release`: a handle closing meanwhile keeps no series
            if owner.closed:
                raise _closed_error()
            series = family.series.get(key)
            if series is None:
                series = family.series[key] = _Series(key, bounds)
            series.refs += 1
            owner._series.append(series)
        return series

    def _release(self, owner: FamilyHandle) -> None:
        family = owner._family
        with self._lock:
            if owner.closed:
                return
            owner.closed = True
            for one in owner._series:
                one.refs -= 1
                if one.refs == 0 and family.series.get(one.labels) is one:
                    del family.series[one.labels]
            owner._series = []
            family.handles -= 1
            if family.handles == 0 and not family.series and self._families.get(family.name) is family:
                del self._families[family.name]

    def _update(self, family: _Family, series: _Series, op: str, value: float) -> None:
        kind = family.kind
        if op == "increment":
            if kind == "histogram":
                raise Unsupported("TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Increment")
            if kind == "counter" and value < 0.0:
                raise InvalidArgument(
                    "TRITONSERVER_METRIC_KIND_COUNTER can only be incremented monotonically by non-negative values."
                )
            with self._lock:
                series.value += value
        elif op == "set":
            if kind != "gauge":
                raise Unsupported(f"TRITONSERVER_METRIC_KIND_{_TRITON_KIND[kind]} does not support Set")
            with self._lock:
                series.value = value
        else:
            if kind != "histogram":
                raise Unsupported(f"TRITONSERVER_METRIC_KIND_{_TRITON_KIND[kind]} does not support Observe")
            # The first bucket whose bound is >= value; NaN falls in +Inf, as in prometheus-cpp.
            index = next((i for i, bound in enumerate(series.bounds) if value <= bound), len(series.bounds))
            with self._lock:
                series.counts[index] += 1
                series.total += value

    def _read(self, family: _Family, series: _Series) -> float:
        if family.kind == "histogram":
            raise Unsupported("TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Value")
        with self._lock:
            return series.value


class FamilyHandle:
    """One `MetricFamily` of a model: the series it created stay exported until `close()`."""

    def __init__(self, registry: CustomMetricsRegistry, family: _Family) -> None:
        self._registry = registry
        self._family = family
        self._series: list[_Series] = []
        self.closed = False

    def metric(self, labels: Mapping[str, str], buckets: Sequence[float] | None) -> SeriesHandle:
        for key, value in labels.items():
            if not isinstance(key, str) or not _LABEL_NAME.fullmatch(key) or key.startswith("__"):
                raise InvalidArgument("Invalid label name")
            if not isinstance(value, str):
                raise InvalidArgument(f"label '{key}' must be a string, not {type(value).__name__}")
        bounds: tuple[float, ...] = ()
        if self._family.kind == "histogram":
            if buckets is None:
                raise InvalidArgument("Bucket boundaries not found in Metric args.")
            bounds = tuple(float(b) for b in buckets)
            if any(not a < b for a, b in itertools.pairwise(bounds)):
                raise InvalidArgument("Bucket Boundaries must be strictly sorted")
        elif buckets is not None:
            raise InvalidArgument("Unexpected buckets found.")
        return SeriesHandle(self, self._registry._series(self, labels, bounds))

    def close(self) -> None:
        """Release this handle's series (idempotent)."""
        self._registry._release(self)


class SeriesHandle:
    """One labelled series, as the model's `Metric` uses it."""

    __slots__ = ("_owner", "_series")

    def __init__(self, owner: FamilyHandle, series: _Series) -> None:
        self._owner = owner
        self._series = series

    def increment(self, value: float) -> None:
        self._op("increment", value)

    def set(self, value: float) -> None:
        self._op("set", value)

    def observe(self, value: float) -> None:
        self._op("observe", value)

    def value(self) -> float:
        if self._owner.closed:
            raise _closed_error()
        return self._owner._registry._read(self._owner._family, self._series)

    def _op(self, op: str, value: float) -> None:
        if self._owner.closed:
            raise _closed_error()
        self._owner._registry._update(self._owner._family, self._series, op, value)


def _closed_error() -> InvalidArgument:
    # Triton's words: a Metric used after its MetricFamily was deleted.
    return InvalidArgument(
        "Invalid metric operation as the corresponding 'MetricFamily' has been deleted. The "
        "'MetricFamily' object should be deleted AFTER its corresponding 'Metric' objects have been deleted."
    )


def _bound_text(bound: float) -> str:
    from prometheus_client.utils import floatToGoString

    return str(floatToGoString(bound))
