"""Per-model statistics: Triton's statistics extension and its Prometheus metrics.

`ModelStats` (one per loaded model version) is the single source of truth. The JSON served at
`/v2/models/{m}/stats` and the text served at `/metrics` are both read from it, so the two can
never disagree.

Why a custom collector instead of `prometheus_client.Counter`: Triton exposes its counters
under their bare names (`nv_inference_count{model="m",version="1"} 5`), and dashboards written
for Triton query those names. prometheus_client's own counters always append `_total` (and
`_created`), so `MetricsRegistry` builds the families from the live `ModelStats` at scrape
time, and `render()` writes the classic text format itself. prometheus_client (its `Metric`
data model) is imported at the first scrape, not at start.
"""

from __future__ import annotations

import operator
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from daemon.config import DEFAULT_QUANTILES, parse_quantiles
from daemon.core.custom_metrics import CustomMetricsRegistry
from daemon.core.summary import Summary, quantiles

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

# What contributes metric families to /metrics: called at every scrape.
Collect = Callable[[], Iterable["Metric"]]

# Triton's `reason` label values for nv_inference_request_failure.
FailureReason = Literal["REJECTED", "CANCELED", "BACKEND", "OTHER"]
FAILURE_REASONS: tuple[FailureReason, ...] = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


class ComputePhases(NamedTuple):
    """Triton's three compute durations of one backend execution, in nanoseconds."""

    input_ns: int
    infer_ns: int
    output_ns: int


def compute_phases(elapsed_ns: int, phase_ns: tuple[int, int]) -> ComputePhases:
    """One backend execution of `elapsed_ns` in all, split by the backend's own input and
    output preparation times (`Backend.phase_ns`)."""
    input_ns = min(max(phase_ns[0], 0), elapsed_ns)
    output_ns = min(max(phase_ns[1], 0), elapsed_ns - input_ns)
    return ComputePhases(input_ns, elapsed_ns - input_ns - output_ns, output_ns)


@dataclass(slots=True)
class PhaseTally:
    """The compute phases of one ensemble request's step requests, added up as each step
    request succeeds (Triton's secondary statistics aggregator): the ensemble reports their
    sums as its own compute phases, and adds them to its own caller's tally when it is a step."""

    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0


@dataclass(slots=True)
class Duration:
    """Triton's `$duration_stat`: how many times, and the total nanoseconds."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += max(0, ns)

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class BatchStats:
    """One row of Triton's `batch_stats`: executions of one batch size."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass(frozen=True)
class LatencyMetrics:
    """Which latency metrics models export (Triton's --metrics-config; daemon.config.MetricsConfig)."""

    # nv_inference_*_duration_us and the response cache's per-model counters.
    counters: bool = True
    # nv_inference_*_summary_us (and the cache's) summaries, with these quantiles.
    summaries: bool = False
    quantiles: tuple[float, ...] = parse_quantiles(DEFAULT_QUANTILES)


# What a summary observes (ModelStats.summaries keys): the request, its phases, the cache's.
SUMMARIZED = ("request", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")


class ModelStats:
    """Cumulative statistics of one model version since it was loaded.

    Request-level numbers (`success`, `fail`, `queue`, `compute_*`) are counted once per
    request, as Triton does; `execution_count` and `batch_stats` once per backend execution,
    so `inference_count / execution_count` is the average batch size.
    """

    def __init__(
        self, name: str = "", version: str = "", metrics: MetricsRegistry | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.version = version
        # The labels of this version's /metrics samples: Triton's `_<tag>` for each of the
        # config's metric_tags, then model and version.
        self.labels = {**{f"_{k}": v for k, v in (tags or {}).items()}, "model": name, "version": version}
        # Rows inferred successfully (a request of batch size 8 counts 8).
        self.inference_count = 0
        self.execution_count = 0
        # Milliseconds since the epoch; 0 = never.
        self.last_inference = 0
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.failures: dict[FailureReason, int] = dict.fromkeys(FAILURE_REASONS, 0)
        # The response cache (daemon.core.response_cache): lookups that answered (their
        # durations), and those that did not and whose answer was then kept (lookup + insert).
        self.cache_enabled = False
        self.cache_hit = Duration()
        self.cache_miss = Duration()
        self.batch_stats: dict[int, BatchStats] = {}
        # Requests waiting in the scheduler queue, set by the scheduler.
        self.pending = 0
        # Generation models: the engine's own counters (slots, cache, KV cells), set by the
        # loader and exported as edged_llm_* gauges.
        self.engine_stats: Callable[[], Mapping[str, object]] | None = None
        # Latency summaries in microseconds (SUMMARIZED), when the daemon exports them.
        self.summaries: dict[str, Summary] | None = None
        if metrics is not None and metrics.latency.summaries:
            self.summaries = {name: Summary() for name in SUMMARIZED}
        self._metrics = metrics
        if metrics is not None:
            metrics.add(self)

    # ------------------------------------------------------------------ recording

    def record_success(
        self,
        duration_ns: int,
        batch_size: int = 1,
        *,
        queue_ns: int | None = None,
        compute_input_ns: int | None = None,
        compute_infer_ns: int | None = None,
        compute_output_ns: int | None = None,
        tally: PhaseTally | None = None,
    ) -> None:
        """One request answered. `batch_size` is its row count; phases left None weren't timed.
        The phases are added to `tally` too (the request's `InferRequest.tally`)."""
        self.success.add(duration_ns)
        self.inference_count += batch_size
        self.last_inference = time.time_ns() // 1_000_000
        for stat, ns in (
            (self.queue, queue_ns),
            (self.compute_input, compute_input_ns),
            (self.compute_infer, compute_infer_ns),
            (self.compute_output, compute_output_ns),
        ):
            if ns is not None:
                stat.add(ns)
        if tally is not None:
            tally.input_ns += compute_input_ns or 0
            tally.infer_ns += compute_infer_ns or 0
            tally.output_ns += compute_output_ns or 0
        summaries = self.summaries
        if summaries is not None:
            now = time.monotonic()
            summaries["request"].observe(duration_ns // 1000, now)
            for name, ns in (
                ("queue", queue_ns),
                ("compute_input", compute_input_ns),
                ("compute_infer", compute_infer_ns),
                ("compute_output", compute_output_ns),
            ):
                if ns is not None:
                    summaries[name].observe(ns // 1000, now)

    def record_cache_hit(self, duration_ns: int) -> None:
        """One request answered from the response cache, as Triton counts it: a success with
        no queue time, and neither an inference nor an execution."""
        self.success.add(duration_ns)
        self.queue.add(0)
        self.cache_hit.add(duration_ns)
        self.last_inference = time.time_ns() // 1_000_000
        summaries = self.summaries
        if summaries is not None:
            now = time.monotonic()
            summaries["request"].observe(duration_ns // 1000, now)
            summaries["queue"].observe(0, now)
            summaries["cache_hit"].observe(duration_ns // 1000, now)

    def record_cache_miss(self, duration_ns: int) -> None:
        """A request the cache could not answer, whose answer it then kept (Triton's miss
        time: the lookup and the insertion)."""
        self.cache_miss.add(duration_ns)
        if self.summaries is not None:
            self.summaries["cache_miss"].observe(duration_ns // 1000)

    def record_failure(self, duration_ns: int, reason: FailureReason = "OTHER") -> None:
        """One request failed; `reason` is Triton's failure label."""
        self.fail.add(duration_ns)
        self.failures[reason] += 1
        self.last_inference = time.time_ns() // 1_000_000

    def record_execution(
        self,
        batch_size: int,
        compute_infer_ns: int,
        compute_input_ns: int = 0,
        compute_output_ns: int = 0,
    ) -> None:
        """One backend execution of `batch_size` rows (all requests of the batch together)."""
        self.execution_count += 1
        row = self.batch_stats.get(batch_size)
        if row is None:
            row = self.batch_stats[batch_size] = BatchStats()
        row.compute_input.add(compute_input_ns)
        row.compute_infer.add(compute_infer_ns)
        row.compute_output.add(compute_output_ns)

    def close(self) -> None:
        """Stop exporting this object's metrics (the model version was unloaded)."""
        if self._metrics is not None:
            self._metrics.remove(self.name, self.version, self)

    # ------------------------------------------------------------------ reporting

    def to_triton_json(self, name: str | None = None, version: str | None = None) -> dict[str, Any]:
        """One `$model_stat` object of Triton's statistics extension."""
        return {
            "name": self.name if name is None else name,
            "version": self.version if version is None else version,
            "last_inference": self.last_inference,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.to_json(),
                "fail": self.fail.to_json(),
                "queue": self.queue.to_json(),
                "compute_input": self.compute_input.to_json(),
                "compute_infer": self.compute_infer.to_json(),
                "compute_output": self.compute_output.to_json(),
                "cache_hit": self.cache_hit.to_json(),
                "cache_miss": self.cache_miss.to_json(),
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": row.compute_input.to_json(),
                    "compute_infer": row.compute_infer.to_json(),
                    "compute_output": row.compute_output.to_json(),
                }
                for size, row in sorted(self.batch_stats.items())
            ],
            "memory_usage": [],
            # Per-response statistics: Triton 2.51's python backend leaves them empty, decoupled
            # models included; edged keeps none either.
            "response_stats": {},
        }


# ---------------------------------------------------------------------------- Prometheus

# (metric name, help, value from one ModelStats). Counters in Triton's units: durations in us.
_COUNTERS: tuple[tuple[str, str, Callable[[ModelStats], int]], ...] = (
    ("nv_inference_request_success",
     "Number of successful inference requests, all batch sizes",
     lambda s: s.success.count),
    ("nv_inference_count",
     "Number of inferences performed (does not include cached requests)",
     lambda s: s.inference_count),
    ("nv_inference_exec_count",
     "Number of model executions performed (does not include cached requests)",
     lambda s: s.execution_count),
)
# Left out with Triton's --metrics-config counter_latencies=false.
_LATENCY_COUNTERS: tuple[tuple[str, str, Callable[[ModelStats], int]], ...] = (
    ("nv_inference_request_duration_us",
     "Cumulative inference request duration in microseconds (includes cached requests)",
     lambda s: s.success.ns // 1000),
    ("nv_inference_queue_duration_us",
     "Cumulative inference queuing duration in microseconds (includes cached requests)",
     lambda s: s.queue.ns // 1000),
    ("nv_inference_compute_input_duration_us",
     "Cumulative compute input duration in microseconds (does not include cached requests)",
     lambda s: s.compute_input.ns // 1000),
    ("nv_inference_compute_infer_duration_us",
     "Cumulative compute inference duration in microseconds (does not include cached requests)",
     lambda s: s.compute_infer.ns // 1000),
    ("nv_inference_compute_output_duration_us",
     "Cumulative inference compute output duration in microseconds (does not include cached requests)",
     lambda s: s.compute_output.ns // 1000),
)


_CACHE_COUNTERS: tuple[tuple[str, str, Callable[[ModelStats], int]], ...] = (
    ("nv_cache_num_hits_per_model", "Number of cache hits per model", lambda s: s.cache_hit.count),
    ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds",
     lambda s: s.cache_hit.ns // 1000),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model", lambda s: s.cache_miss.count),
    ("nv_cache_miss_duration_per_model",
     "Total cache miss (insert+lookup) duration per model, in microseconds",
     lambda s: s.cache_miss.ns // 1000),
)


def _counters(
    specs: Iterable[tuple[str, str, Callable[[ModelStats], int]]],
    rows: list[tuple[tuple[str, str], list[ModelStats]]],
) -> Iterator[Metric]:
    """A counter family per spec, a sample per model version (its live objects summed)."""
    from prometheus_client.metrics_core import Metric

    for name, doc, value in specs:
        family = Metric(name, doc, "counter")
        for _key, stats in rows:
            family.add_sample(name, stats[-1].labels, sum(value(s) for s in stats))
        yield family


# (ModelStats.summaries key, metric name, help): Triton's summary families.
_SUMMARIES: tuple[tuple[str, str, str], ...] = (
    ("request", "nv_inference_request_summary_us",
     "Summary of inference request duration in microseconds (includes cached requests)"),
    ("queue", "nv_inference_queue_summary_us",
     "Summary of inference queuing duration in microseconds (includes cached requests)"),
    ("compute_input", "nv_inference_compute_input_summary_us",
     "Cumulative compute input duration in microseconds (does not include cached requests)"),
    ("compute_infer", "nv_inference_compute_infer_summary_us",
     "Cumulative compute inference duration in microseconds (does not include cached requests)"),
    ("compute_output", "nv_inference_compute_output_summary_us",
     "Cumulative inference compute output duration in microseconds (does not include cached requests)"),
)
_CACHE_SUMMARIES: tuple[tuple[str, str, str], ...] = (
    ("cache_hit", "nv_cache_hit_summary_per_model", "Summary of cache hit counts/durations per model, in microseconds."),
    ("cache_miss", "nv_cache_miss_summary_per_model",
     "Summary of cache miss counts/durations per model, in microseconds."),
)


def _summaries(
    specs: Iterable[tuple[str, str, str]], rows: list[tuple[tuple[str, str], list[ModelStats]]],
    wanted: tuple[float, ...],
) -> Iterator[Metric]:
    """A summary family per spec: per model version its count, sum and quantiles."""
    from prometheus_client.metrics_core import Metric

    for key, name, doc in specs:
        family = Metric(name, doc, "summary")
        for _key, stats in rows:
            parts = [s.summaries[key] for s in stats if s.summaries is not None]
            labels = stats[-1].labels
            family.add_sample(f"{name}_count", labels, sum(p.count for p in parts))
            family.add_sample(f"{name}_sum", labels, sum(p.sum for p in parts))
            for q, value in zip(wanted, quantiles(parts, wanted), strict=True):
                family.add_sample(name, {**labels, "quantile": f"{q:g}"}, value)
        yield family


def _triton_families(owner: MetricsRegistry) -> Iterator[Metric]:
    from prometheus_client.metrics_core import Metric

    rows = owner.totals()
    latency = owner.latency
    # Without latency counters Triton 2.51 also stops counting successes and executions (its
    # counters all go through one switch); here they go on.
    yield from _counters(_COUNTERS + _LATENCY_COUNTERS if latency.counters else _COUNTERS, rows)
    failure = Metric(
        "nv_inference_request_failure", "Number of failed inference requests, all batch sizes", "counter"
    )
    for _key, stats in rows:
        for reason in FAILURE_REASONS:
            failure.add_sample(
                failure.name, {**stats[-1].labels, "reason": reason}, sum(s.failures[reason] for s in stats)
            )
    yield failure
    cached = [(key, stats) for key, stats in rows if any(s.cache_enabled for s in stats)]
    if cached and latency.counters:  # as Triton: only for models whose config enables the cache
        yield from _counters(_CACHE_COUNTERS, cached)
    pending = Metric(
        "nv_inference_pending_request_count",
        "Instantaneous number of pending requests awaiting execution per-model.",
        "gauge",
    )
    for _key, stats in rows:
        pending.add_sample(pending.name, stats[-1].labels, sum(s.pending for s in stats))
    yield pending
    if latency.summaries:
        summarized = [(key, stats) for key, stats in rows if any(s.summaries is not None for s in stats)]
        yield from _summaries(_SUMMARIES, summarized, latency.quantiles)
        cached = [(key, stats) for key, stats in summarized if any(s.cache_enabled for s in stats)]
        if cached:
            yield from _summaries(_CACHE_SUMMARIES, cached, latency.quantiles)
    yield from _engine_families(rows)


# Generation engines' counters (GenerationBackend.engine_stats keys) exported per model version.
_ENGINE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("slots", "edged_llm_slots", "Sequence slots of the generation engine"),
    ("busy", "edged_llm_slots_busy", "Slots generating now"),
    ("queued", "edged_llm_queue_length", "Generation requests waiting for a slot"),
    ("kv_cells_used", "edged_llm_kv_cells_used", "KV cache cells holding tokens"),
    ("kv_cells_total", "edged_llm_kv_cells_total", "KV cache cells in all slots"),
)
_ENGINE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("tokens_generated", "edged_llm_tokens_generated", "Tokens generated since the model was loaded"),
    ("decode_seconds", "edged_llm_decode_seconds",
     "Seconds the engine spent in decode steps (prompts and generation); tokens per second "
     "while generating: rate(edged_llm_tokens_generated) / rate(edged_llm_decode_seconds)"),
    ("prompt_tokens_cached", "edged_llm_prompt_tokens_cached",
     "Prompt tokens served from a slot's prefix cache instead of being evaluated"),
    ("prompt_tokens_evaluated", "edged_llm_prompt_tokens_evaluated", "Prompt tokens evaluated"),
)


# llama-server's own /metrics families (its names and help texts' meaning), from the same
# engine counters, with the model and version as labels (llama-server's router mode asks one
# model's server with ?model=). Left out: its prompt_tokens_seconds and
# predicted_tokens_seconds gauges, whose rates llama-server resets at every scrape (a second
# scraper would change what the first reads: compute them from the _total counters with
# rate()), and the speculative-decoding counters (no draft model here).
_LLAMA_SERVER: tuple[tuple[str, str, str, str], ...] = (
    ("counter", "prompt_tokens_evaluated", "llamacpp:prompt_tokens_total",
     "Number of prompt tokens processed, excluding cached tokens"),
    ("counter", "prompt_tokens_cached", "llamacpp:prompt_tokens_cached_total",
     "Number of prompt tokens reused from the cache"),
    ("counter", "prompt_seconds", "llamacpp:prompt_seconds_total",
     "Total time spent processing prompts (from a request taking its slot to its first token)"),
    ("counter", "tokens_generated", "llamacpp:tokens_predicted_total", "Number of generation tokens processed"),
    ("counter", "generation_seconds", "llamacpp:tokens_predicted_seconds_total",
     "Total time spent generating tokens (from a request's first token to its end)"),
    ("counter", "decode_calls", "llamacpp:n_decode_total", "Total number of llama_decode() calls"),
    ("counter", "n_tokens_max", "llamacpp:n_tokens_max", "Largest observed sequence length (prompt + generation)"),
    ("gauge", "busy", "llamacpp:requests_processing", "Number of requests processing"),
    ("gauge", "queued", "llamacpp:requests_deferred", "Number of requests deferred"),
)


def _engine_families(rows: list[tuple[tuple[str, str], list[ModelStats]]]) -> Iterator[Metric]:
    from prometheus_client.metrics_core import Metric

    engines = []
    for key, group in rows:
        # A reload swap has the old and the new engine of one version alive: one series each
        # (two with the same labels make Prometheus reject the whole scrape), their numbers
        # summed as the Triton families' are; the longest sequence is the larger of the two.
        merged: dict[str, int | float] = {}
        for stats in group:
            if stats.engine_stats is None:
                continue
            for name, value in stats.engine_stats().items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    combine = max if name == "n_tokens_max" else operator.add
                    merged[name] = combine(merged[name], value) if name in merged else value
        if merged:
            engines.append((key, merged))
    if not engines:
        return
    own = [("gauge", *row) for row in _ENGINE_GAUGES] + [("counter", *row) for row in _ENGINE_COUNTERS]
    for kind, field_name, name, doc in [*own, *_LLAMA_SERVER]:
        family = Metric(name, doc, kind)
        for (model, version), values in engines:
            value = values.get(field_name)
            if isinstance(value, int | float):
                family.add_sample(name, {"model": model, "version": version}, float(value))
        yield family
    per_decode = Metric("llamacpp:n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call", "gauge")
    for (model, version), values in engines:
        calls, busy = values.get("decode_calls"), values.get("busy_slots_decoding")
        if isinstance(calls, int | float) and isinstance(busy, int | float):
            per_decode.add_sample(per_decode.name, {"model": model, "version": version}, busy / max(calls, 1))
    yield per_decode


class HostCpu:
    """Triton's CPU metrics from procfs (Linux): utilization since the previous scrape (the
    first: since the daemon started), total and used memory. Elsewhere: none."""

    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self._last = self._cpu_times()

    def _cpu_times(self) -> tuple[int, int] | None:
        """(busy, total) jiffies of all CPUs. procfs is generated in memory: no disk I/O."""
        try:
            with open(f"{self._proc}/stat", encoding="ascii") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        total = sum(fields[:8])  # guest time is already inside user and nice
        return total - idle, total

    def _memory(self) -> tuple[int, int] | None:
        try:
            with open(f"{self._proc}/meminfo", encoding="ascii") as f:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.count(" ") >= 1}
        except (OSError, ValueError, IndexError):
            return None
        if "MemTotal" not in info or "MemAvailable" not in info:
            return None
        return info["MemTotal"], info["MemTotal"] - info["MemAvailable"]

    def families(self) -> Iterator[Metric]:
        from prometheus_client.metrics_core import Metric

        now = self._cpu_times()
        if now is not None and self._last is not None:
            busy, total = now[0] - self._last[0], now[1] - self._last[1]
            utilization = Metric("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", "gauge")
            utilization.add_sample(utilization.name, {}, busy / total if total > 0 else 0.0)
            yield utilization
        if now is not None:
            self._last = now
        memory = self._memory()
        if memory is not None:
            for name, doc, value in (
                ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", memory[0]),
                ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", memory[1]),
            ):
                family = Metric(name, doc, "gauge")
                family.add_sample(name, {}, value)
                yield family


class MetricsRegistry:
    """The daemon's metrics, private to it (never prometheus_client's global registry, so two
    daemons in one process, or two tests, don't share counters).

    Each `ModelStats` created with this registry is exported until `remove()`. Objects are held
    weakly: a version whose load failed disappears from `/metrics` with its last reference.
    While a reload swaps an old and a new object of the same model version, both are alive and
    their numbers are summed into one series.
    """

    def __init__(self, latency: LatencyMetrics = LatencyMetrics()) -> None:
        self.latency = latency
        # (model, version) -> live objects, oldest first.
        self._stats: dict[tuple[str, str], list[weakref.ref[ModelStats]]] = {}
        host = HostCpu()
        # Families the models define (python models' pb_utils.MetricFamily).
        self.custom = CustomMetricsRegistry()
        self._sources: list[Collect] = [lambda: _triton_families(self), host.families]

    def register(self, collect: Collect) -> None:
        """Add families to /metrics (e.g. residency's), built at every scrape."""
        self._sources.append(collect)

    def add(self, stats: ModelStats) -> None:
        self._stats.setdefault((stats.name, stats.version), []).append(weakref.ref(stats))

    def remove(self, model: str, version: str, stats: ModelStats | None = None) -> None:
        """Stop exporting a model version.

        With `stats`, exactly that object goes. Without it, the oldest live object of the
        version goes: on a reload the registry creates the new object before retiring the old,
        so this drops the retiring one and keeps the one now serving.
        """
        key = (model, version)
        live = [ref for ref in self._stats.get(key, []) if ref() is not None]
        if stats is not None:
            live = [ref for ref in live if ref() is not stats]
        elif live:
            live = live[1:]
        if live:
            self._stats[key] = live
        else:
            self._stats.pop(key, None)

    def totals(self) -> list[tuple[tuple[str, str], list[ModelStats]]]:
        """Live objects per (model, version), sorted by model then version."""
        rows: list[tuple[tuple[str, str], list[ModelStats]]] = []
        for key in sorted(self._stats):
            alive = [s for s in (ref() for ref in self._stats[key]) if s is not None]
            if alive:
                rows.append((key, alive))
            else:
                del self._stats[key]
        return rows

    def render(self) -> bytes:
        """Prometheus text exposition format 0.0.4 of everything in the registry."""
        sources = [*self._sources, self.custom.families]  # the models' own families last
        return "".join(_render_family(metric) for collect in sources for metric in collect()).encode()


# Classic text format type names (prometheus_client's data model uses OpenMetrics names).
_TEXT_TYPES = {"unknown": "untyped", "info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram"}


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _render_family(metric: Metric) -> str:
    return "".join(_family_lines(metric))


def _family_lines(metric: Metric) -> Iterator[str]:
    from prometheus_client.utils import floatToGoString

    doc = metric.documentation.replace("\\", "\\\\").replace("\n", "\\n")
    yield f"# HELP {metric.name} {doc}\n"
    yield f"# TYPE {metric.name} {_TEXT_TYPES.get(metric.type, metric.type)}\n"
    for sample in metric.samples:
        labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(sample.labels.items()))
        text = f"{sample.name}{{{labels}}}" if labels else sample.name
        yield f"{text} {floatToGoString(sample.value)}\n"
