"""ModelStats numbers, Triton's statistics JSON shape, and the Prometheus exposition."""

from __future__ import annotations

import gc
import re

import msgspec
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon.core.stats import LatencyMetrics, MetricsRegistry, ModelStats, compute_phases

DURATION_KEYS = {"count", "ns"}


def samples(metrics: MetricsRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse the rendered text with prometheus_client's own parser (so it must be valid)."""
    text = metrics.render().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_records_follow_triton_semantics() -> None:
    stats = ModelStats("m", "3")
    stats.record_success(5_000, 2, queue_ns=1_000, compute_input_ns=0, compute_infer_ns=3_000, compute_output_ns=0)
    stats.record_success(7_000, 3, queue_ns=2_000, compute_input_ns=0, compute_infer_ns=3_000, compute_output_ns=0)
    stats.record_execution(5, 3_000)
    stats.record_failure(11_000, "BACKEND")
    stats.record_failure(1_000)

    doc = stats.to_triton_json("m", "3")
    assert doc["name"] == "m"
    assert doc["version"] == "3"
    assert doc["inference_count"] == 5  # rows, not requests
    assert doc["execution_count"] == 1
    assert doc["last_inference"] > 1_600_000_000_000  # ms since the epoch
    inference = doc["inference_stats"]
    assert inference["success"] == {"count": 2, "ns": 12_000}
    assert inference["fail"] == {"count": 2, "ns": 12_000}
    assert inference["queue"] == {"count": 2, "ns": 3_000}
    assert inference["compute_infer"] == {"count": 2, "ns": 6_000}
    assert inference["compute_input"] == {"count": 2, "ns": 0}
    assert set(inference) >= {"success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit"}
    assert all(set(v) == DURATION_KEYS for v in inference.values())
    assert doc["batch_stats"] == [
        {
            "batch_size": 5,
            "compute_input": {"count": 1, "ns": 0},
            "compute_infer": {"count": 1, "ns": 3_000},
            "compute_output": {"count": 1, "ns": 0},
        }
    ]
    assert stats.failures == {"REJECTED": 0, "CANCELED": 0, "BACKEND": 1, "OTHER": 1}
    # The document is what the transport serializes: it must be plain JSON.
    assert msgspec.json.decode(msgspec.json.encode(doc)) == doc


def test_batch_stats_sorted_by_size_and_timing_optional() -> None:
    stats = ModelStats("m", "1")
    for size in (4, 1, 4, 2):
        stats.record_execution(size, 100)
    stats.record_success(50)  # an ensemble records only the end-to-end time
    doc = stats.to_triton_json()
    assert [row["batch_size"] for row in doc["batch_stats"]] == [1, 2, 4]
    assert doc["batch_stats"][2]["compute_infer"] == {"count": 2, "ns": 200}
    assert doc["execution_count"] == 4
    assert doc["inference_stats"]["queue"] == {"count": 0, "ns": 0}
    assert doc["inference_count"] == 1


def test_render_exposes_triton_names_and_values() -> None:
    metrics = MetricsRegistry()
    stats = ModelStats("resnet", "2", metrics)
    stats.record_success(2_500_000, 4, queue_ns=500_000, compute_infer_ns=1_800_000)
    stats.record_success(1_500_000, 1, queue_ns=100_000, compute_infer_ns=1_200_000)
    stats.record_execution(5, 1_800_000)
    stats.record_failure(10, "REJECTED")
    stats.pending = 3
    text = metrics.render().decode()

    labels = 'model="resnet",version="2"'
    assert f"nv_inference_request_success{{{labels}}} 2.0" in text
    assert f"nv_inference_count{{{labels}}} 5.0" in text
    assert f"nv_inference_exec_count{{{labels}}} 1.0" in text
    assert f"nv_inference_request_duration_us{{{labels}}} 4000.0" in text
    assert f"nv_inference_queue_duration_us{{{labels}}} 600.0" in text
    assert f"nv_inference_compute_infer_duration_us{{{labels}}} 3000.0" in text
    assert f"nv_inference_pending_request_count{{{labels}}} 3.0" in text
    assert 'nv_inference_request_failure{model="resnet",reason="REJECTED",version="2"} 1.0' in text
    assert 'nv_inference_request_failure{model="resnet",reason="BACKEND",version="2"} 0.0' in text
    # Triton's bare counter names: no prometheus_client `_total` / `_created` munging.
    assert "# TYPE nv_inference_request_success counter" in text
    assert "# TYPE nv_inference_pending_request_count gauge" in text
    assert not re.search(r"^nv_\w+_total[ {]", text, re.MULTILINE)
    assert "_created" not in text

    parsed = samples(metrics)
    key = (("model", "resnet"), ("version", "2"))
    assert parsed[("nv_inference_count_total", key)] == 5
    assert parsed[("nv_inference_pending_request_count", key)] == 3


def test_registry_is_private_not_the_global_one() -> None:
    first, second = MetricsRegistry(), MetricsRegistry()
    stats = ModelStats("a", "1", first)  # the registry holds stats weakly: keep a reference
    stats.record_success(1)
    assert b'model="a"' in first.render()
    assert b'model="a"' not in second.render()
    assert b"nv_inference" not in generate_latest(REGISTRY)


def test_remove_and_reload_swap() -> None:
    metrics = MetricsRegistry()
    old = ModelStats("m", "1", metrics)
    old.record_success(1, 7)
    other = ModelStats("n", "1", metrics)
    other.record_success(1, 2)
    # A reload creates the new object first, then retires the old one by name and version.
    new = ModelStats("m", "1", metrics)
    new.record_success(1, 1)
    assert samples(metrics)[("nv_inference_count_total", (("model", "m"), ("version", "1")))] == 8
    metrics.remove("m", "1")
    assert samples(metrics)[("nv_inference_count_total", (("model", "m"), ("version", "1")))] == 1
    new.close()
    text = metrics.render().decode()
    assert 'model="m"' not in text
    assert 'nv_inference_count{model="n",version="1"} 2.0' in text
    metrics.remove("n", "1", other)
    assert b'model="n"' not in metrics.render()


def test_dropped_stats_disappear_from_metrics() -> None:
    metrics = MetricsRegistry()
    stats = ModelStats("failed-load", "1", metrics)
    assert b'model="failed-load"' in metrics.render()
    del stats
    gc.collect()
    assert b'model="failed-load"' not in metrics.render()


def test_label_values_are_escaped() -> None:
    metrics = MetricsRegistry()
    stats = ModelStats('we"ird\\name', "1", metrics)
    stats.record_success(1)
    text = metrics.render().decode()
    assert 'model="we\\"ird\\\\name"' in text
    names = {labels for (_, labels) in samples(metrics)}
    assert (("model", 'we"ird\\name'), ("version", "1")) in names


def test_host_cpu_metrics_from_procfs(tmp_path) -> None:
    """Triton's nv_cpu_* gauges: utilization between scrapes (busy = all but idle and iowait),
    memory used = MemTotal - MemAvailable; nothing where procfs is missing."""
    from daemon.core.stats import HostCpu

    def stat(user: int, idle: int, iowait: int) -> None:
        (tmp_path / "stat").write_text(f"cpu  {user} 0 0 {idle} {iowait} 0 0 0 0 0\ncpu0 1 2 3 4\n")

    stat(100, 1000, 0)
    (tmp_path / "meminfo").write_text("MemTotal:        8000 kB\nMemFree:  1000 kB\nMemAvailable:    6000 kB\n")
    host = HostCpu(str(tmp_path))
    stat(130, 1060, 10)  # +30 busy of +100
    values = {m.name: m.samples[0].value for m in host.families()}
    assert values == {"nv_cpu_utilization": 0.3, "nv_cpu_memory_total_bytes": 8000 * 1024,
                      "nv_cpu_memory_used_bytes": 2000 * 1024}
    stat(130, 1160, 10)  # idle since the previous scrape
    assert next(host.families()).samples[0].value == 0.0
    assert list(HostCpu(str(tmp_path / "nowhere")).families()) == []


def test_compute_phases_split_an_execution() -> None:
    """The backend's input and output times out of the whole; infer is the rest, never < 0."""
    assert compute_phases(10_000, (1_000, 2_000)) == (1_000, 7_000, 2_000)
    assert compute_phases(10_000, (0, 0)) == (0, 10_000, 0)  # a backend that reports none
    # Clocks read apart can overshoot the scheduler's own: clamped, the sum stays the whole.
    assert compute_phases(10_000, (8_000, 5_000)) == (8_000, 0, 2_000)
    assert compute_phases(10_000, (-5, 12_000)) == (0, 0, 10_000)


def test_engine_families_during_a_reload_swap_are_one_series() -> None:
    """While a reload has the old and the new engine of one model version alive, each engine
    family (edged_llm_*, llamacpp:*) has one series for it, as the Triton families: counters
    and gauges summed, the longest sequence the larger, busy slots per decode over both."""
    metrics = MetricsRegistry()
    old, new = ModelStats("m", "1", metrics), ModelStats("m", "1", metrics)
    old.engine_stats = lambda: {"busy": 2, "tokens_generated": 10, "n_tokens_max": 90, "decode_calls": 4,
                                "busy_slots_decoding": 8}
    new.engine_stats = lambda: {"busy": 1, "tokens_generated": 5, "n_tokens_max": 30, "decode_calls": 6,
                                "busy_slots_decoding": 6}
    text = metrics.render().decode()
    assert text.count('llamacpp:requests_processing{model="m",version="1"}') == 1
    got = samples(metrics)  # prometheus_client's parser: the text must be valid
    key = (("model", "m"), ("version", "1"))
    assert got[("llamacpp:requests_processing", key)] == 3 and got[("edged_llm_slots_busy", key)] == 3
    assert got[("llamacpp:tokens_predicted_total", key)] == 15 and got[("llamacpp:n_tokens_max_total", key)] == 90  # the parser names counters _total
    assert got[("llamacpp:n_busy_slots_per_decode", key)] == 14 / 10


def test_latency_summaries_and_counters_follow_the_metrics_config() -> None:
    """Triton's --metrics-config: summary_latencies adds its summary families (count, sum,
    quantiles of the last minute), counter_latencies=false removes the duration counters."""
    metrics = MetricsRegistry(LatencyMetrics(counters=False, summaries=True, quantiles=(0.5, 0.75)))
    stats = ModelStats("m", "1", metrics)
    cached = ModelStats("c", "1", metrics)
    cached.cache_enabled = True
    for duration in (1_000_000, 3_000_000, 2_000_000):
        stats.record_success(duration, 1, queue_ns=10_000, compute_input_ns=5_000, compute_infer_ns=duration // 2,
                             compute_output_ns=7_000)
    cached.record_cache_miss(40_000)
    cached.record_cache_hit(12_000)
    text = metrics.render().decode()
    assert "# TYPE nv_inference_request_summary_us summary" in text
    assert 'nv_inference_request_summary_us_count{model="m",version="1"} 3' in text
    assert 'nv_inference_request_summary_us_sum{model="m",version="1"} 6000' in text
    assert 'nv_inference_request_summary_us{model="m",quantile="0.5",version="1"} 2000' in text
    assert 'nv_inference_request_summary_us{model="m",quantile="0.75",version="1"} 3000' in text
    assert 'nv_inference_compute_infer_summary_us_sum{model="m",version="1"} 3000' in text
    # A cache hit is a request with no queue time; the cache's summaries only for its models.
    assert 'nv_inference_queue_summary_us{model="c",quantile="0.5",version="1"} 0' in text
    assert 'nv_cache_hit_summary_per_model_sum{model="c",version="1"} 12' in text
    assert 'nv_cache_miss_summary_per_model_count{model="c",version="1"} 1' in text
    assert 'nv_cache_hit_summary_per_model_count{model="m"' not in text
    # No duration counters; what counts requests and executions still counts.
    assert "nv_inference_request_duration_us" not in text and "nv_cache_num_hits_per_model" not in text
    assert 'nv_inference_request_success{model="m",version="1"} 3' in text
    parsed = samples(metrics)  # valid exposition format
    assert parsed[("nv_inference_compute_output_summary_us_count", (("model", "m"), ("version", "1")))] == 3
    # The default: counters, no summaries.
    plain = MetricsRegistry()
    ModelStats("m", "1", plain).record_success(1_000, 1, queue_ns=0)
    text = plain.render().decode()
    assert "nv_inference_request_duration_us" in text and "summary" not in text


def test_metric_tags_label_every_sample_of_the_model() -> None:
    """Triton's metric_tags: `_<key>` labels on each of the model's samples (checked side by
    side in tests/compat)."""
    metrics = MetricsRegistry(LatencyMetrics(summaries=True))
    stats = ModelStats("m", "1", metrics, tags={"team": "vision", "tier": "gold"})
    stats.cache_enabled = True
    stats.record_success(1_000, 1, queue_ns=0)
    stats.record_failure(10, "BACKEND")
    ModelStats("plain", "1", metrics).record_success(1_000, 1)
    parsed = samples(metrics)
    tagged = {name for name, labels in parsed if ("_team", "vision") in labels and ("_tier", "gold") in labels}
    mine = {name for name, labels in parsed if ("model", "m") in labels}
    assert mine and tagged == mine
    assert ("nv_inference_request_failure_total", (("_team", "vision"), ("_tier", "gold"), ("model", "m"),
                                                   ("reason", "BACKEND"), ("version", "1"))) in parsed
    assert not any(label == "_team" for name, labels in parsed if ("model", "plain") in labels for label, _ in labels)
