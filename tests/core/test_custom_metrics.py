"""The daemon's registry of model-defined metric families (Triton's custom metrics), read
back through the /metrics text the daemon serves."""

from __future__ import annotations

import math

import pytest

from daemon.core.stats import MetricsRegistry
from daemon.errors import InvalidArgument, Unsupported
from support import Samples, metric_samples


def scrape(metrics: MetricsRegistry) -> Samples:
    """The served text's samples other than the daemon's own."""
    return metric_samples(metrics.render().decode(), ("requests_custom", "last_value", "input_hist", "shared", "h", "served", "g", "c"))


def test_counter_gauge_and_histogram_are_served() -> None:
    metrics = MetricsRegistry()
    counter = metrics.custom.family("requests_custom", "Requests seen", "counter").metric({"model": "m"}, None)
    gauge = metrics.custom.family("last_value", "Last input", "gauge").metric({}, None)
    histogram = metrics.custom.family("input_hist", "Inputs", "histogram").metric({"model": "m"}, [1.0, 5.0])
    counter.increment(2.0)
    counter.increment(1)
    gauge.set(4.5)
    gauge.increment(-1.25)
    for value in (0.5, 3.0, 9.0, 1.0):
        histogram.observe(value)

    assert counter.value() == 3.0
    assert gauge.value() == 3.25
    text = metrics.render().decode()
    assert "# HELP requests_custom Requests seen\n# TYPE requests_custom counter\n" in text
    assert "# TYPE input_hist histogram\n" in text
    samples = scrape(metrics)
    assert samples["requests_custom"] == {(("model", "m"),): 3.0}
    assert samples["last_value"] == {(): 3.25}
    # Buckets are cumulative; a value equal to a bound is in that bucket.
    assert samples["input_hist_bucket"] == {
        (("le", "1.0"), ("model", "m")): 2.0,
        (("le", "5.0"), ("model", "m")): 3.0,
        (("le", "+Inf"), ("model", "m")): 4.0,
    }
    assert samples["input_hist_count"] == {(("model", "m"),): 4.0}
    assert samples["input_hist_sum"] == {(("model", "m"),): 13.5}


def test_one_series_per_label_set_and_one_family_per_name() -> None:
    metrics = MetricsRegistry()
    first = metrics.custom.family("shared", "first description", "counter")
    # Another model (or instance) opening the family by name: the same family, first text kept.
    second = metrics.custom.family("shared", "second description", "counter")
    a = first.metric({"model": "m", "kind": "a"}, None)
    b = second.metric({"kind": "a", "model": "m"}, None)  # the same labels in another order
    a.increment(2)
    b.increment(1)
    assert a.value() == b.value() == 3.0
    assert "# HELP shared first description\n" in metrics.render().decode()
    # A histogram's series keeps the buckets it was made with.
    histogram = metrics.custom.family("h", "", "histogram")
    histogram.metric({"x": "1"}, [1.0, 5.0])
    histogram.metric({"x": "1"}, [2.0]).observe(1.5)
    assert scrape(metrics)["h_bucket"][(("le", "5.0"), ("x", "1"))] == 1.0


def test_a_series_lives_while_a_handle_holds_it() -> None:
    metrics = MetricsRegistry()
    old = metrics.custom.family("served", "", "counter")
    old.metric({"model": "m"}, None).increment(5)
    old.metric({"only": "old"}, None).increment(1)
    # A reload: the new version opens its family before the old one closes.
    new = metrics.custom.family("served", "", "counter")
    kept = new.metric({"model": "m"}, None)
    old.close()
    old.close()  # idempotent
    assert kept.value() == 5.0
    assert scrape(metrics)["served"] == {(("model", "m"),): 5.0}
    new.close()
    assert "served" not in metrics.render().decode()
    # With every handle closed the name is free again, for any kind.
    metrics.custom.family("served", "", "gauge").metric({}, None).set(1)
    assert scrape(metrics)["served"] == {(): 1.0}


def test_a_closed_handles_series_refuse_operations() -> None:
    metrics = MetricsRegistry()
    family = metrics.custom.family("gone", "", "gauge")
    series = family.metric({}, None)
    family.close()
    with pytest.raises(InvalidArgument, match="'MetricFamily' has been deleted"):
        series.set(1.0)
    with pytest.raises(InvalidArgument, match="'MetricFamily' has been deleted"):
        series.value()


def test_a_family_without_series_is_not_served() -> None:
    metrics = MetricsRegistry()
    metrics.custom.family("empty_one", "nothing yet", "gauge")
    assert "empty_one" not in metrics.render().decode()


# Triton 2.51's words, read from its python backend in this setup (tests/compat runs the same
# operations on both servers).
@pytest.mark.parametrize(
    ("kind", "op", "value", "error", "message"),
    [
        ("counter", "increment", -1.0, InvalidArgument,
         "TRITONSERVER_METRIC_KIND_COUNTER can only be incremented monotonically by non-negative values."),
        ("counter", "set", 3.0, Unsupported, "TRITONSERVER_METRIC_KIND_COUNTER does not support Set"),
        ("counter", "observe", 3.0, Unsupported, "TRITONSERVER_METRIC_KIND_COUNTER does not support Observe"),
        ("gauge", "observe", 1.0, Unsupported, "TRITONSERVER_METRIC_KIND_GAUGE does not support Observe"),
        ("histogram", "increment", 1.0, Unsupported, "TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Increment"),
        ("histogram", "set", 1.0, Unsupported, "TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Set"),
        ("histogram", "value", None, Unsupported, "TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Value"),
    ],
)
def test_an_operation_the_kind_lacks_is_refused(
    kind: str, op: str, value: float | None, error: type[Exception], message: str
) -> None:
    metrics = MetricsRegistry()
    series = metrics.custom.family("f", "", kind).metric({}, [1.0] if kind == "histogram" else None)  # type: ignore[arg-type]
    with pytest.raises(error) as caught:
        getattr(series, op)() if value is None else getattr(series, op)(value)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("bad name!", "Invalid metric name"),
        ("", "Invalid metric name"),
        ("9lives", "Invalid metric name"),
        ("nv_inference_count", "metric name 'nv_inference_count' is reserved: names starting with nv_, edged_, llamacpp: are the server's own families"),
        ("edged_anything", "metric name 'edged_anything' is reserved"),
        ("llamacpp:tokens", "metric name 'llamacpp:tokens' is reserved"),
    ],
)
def test_bad_and_reserved_family_names_are_refused(name: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        MetricsRegistry().custom.family(name, "", "gauge")
    assert str(caught.value).startswith(message)


def test_a_name_of_another_kind_is_refused() -> None:
    metrics = MetricsRegistry()
    metrics.custom.family("clash", "", "counter")
    with pytest.raises(InvalidArgument, match=r"^Family name already exists with different type$"):
        metrics.custom.family("clash", "", "gauge")
    metrics.custom.family("a:b", "", "gauge")  # colons are allowed, as in Prometheus


@pytest.mark.parametrize(
    ("labels", "buckets", "message"),
    [
        ({"bad label": "v"}, None, "Invalid label name"),
        ({"__reserved": "v"}, None, "Invalid label name"),
        ({"n": 1}, None, "label 'n' must be a string, not int"),
    ],
)
def test_bad_labels_are_refused(labels: dict[str, object], buckets: list[float] | None, message: str) -> None:
    family = MetricsRegistry().custom.family("g", "", "gauge")
    with pytest.raises(InvalidArgument) as caught:
        family.metric(labels, buckets)  # type: ignore[arg-type]
    assert str(caught.value) == message


def test_histogram_buckets() -> None:
    metrics = MetricsRegistry()
    family = metrics.custom.family("h", "", "histogram")
    with pytest.raises(InvalidArgument, match=r"^Bucket Boundaries must be strictly sorted$"):
        family.metric({"u": "1"}, [5.0, 1.0])
    with pytest.raises(InvalidArgument, match=r"^Bucket Boundaries must be strictly sorted$"):
        family.metric({"u": "1"}, [1.0, 1.0])
    with pytest.raises(InvalidArgument, match=r"^Bucket boundaries not found in Metric args\.$"):
        family.metric({"u": "1"}, None)
    with pytest.raises(InvalidArgument, match=r"^Unexpected buckets found\.$"):
        metrics.custom.family("c", "", "counter").metric({}, [1.0])
    only_inf = family.metric({"e": "1"}, [])
    only_inf.observe(2.0)
    only_inf.observe(math.nan)  # NaN is in no finite bucket, and makes the sum NaN
    samples = scrape(metrics)
    assert samples["h_bucket"] == {(("e", "1"), ("le", "+Inf")): 2.0}
    assert math.isnan(samples["h_sum"][(("e", "1"),)])


def test_non_finite_values_are_served_as_prometheus_spells_them() -> None:
    metrics = MetricsRegistry()
    metrics.custom.family("g", "", "gauge").metric({}, None).set(math.nan)
    metrics.custom.family("c", "", "counter").metric({}, None).increment(math.inf)
    text = metrics.render().decode()
    assert "\ng NaN\n" in text
    assert "\nc +Inf\n" in text
