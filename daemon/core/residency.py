"""On-demand model residency: load on first use, unload after idling, stay within a memory budget.

A model whose config says `load: on-demand` is not loaded at start. The first request that needs
it waits while it loads (concurrent first requests share one load); after its last request it
stays loaded for `keep_alive` and is then unloaded. A daemon-wide memory budget bounds what all
loaded models may hold together: before a load that would not fit, the least recently used idle
on-demand models are evicted; a load that cannot fit even then fails with InsufficientMemory
(507) naming the budget, never with the kernel's OOM killer.

A model's cost is estimated before its load (GGUF: weights + KV cache for its context and
slots, from the file's metadata; tensor models: the size of their files x a per-backend factor)
and, when `measure` is on, replaced after the load by the growth of the process RSS measured
around it (loads are serialized, so the growth belongs to that load). Models loaded at start
count against the budget with their estimate and are never evicted.

An in-flight request holds a `Lease`; eviction and idle unloads pick only models without leases,
decided and marked in one synchronous step on the event loop, so a request is never cut.

Hooks (the only coupling to the rest of the daemon): handlers call `await acquire(name)` before
resolving a model and release the lease when the response is done; the repository awaits
`on_demand(name, path)` to leave such models out of its startup and rescan loads. Config files
and cost estimates are read in worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

from daemon.core import layout
from daemon.errors import EdgedError, InsufficientMemory, InvalidArgument, Unavailable
from daemon.model_config import ModelConfig, lora_entries, parse_keep_alive, parse_memory_size

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from daemon.config import ResidencyConfig
    from daemon.core.registry import ModelRegistry

log = logging.getLogger(__name__)

MiB = 1024 * 1024
DEFAULT_FACTOR = 1.5
# Backend by artifact name when the config does not name one (for the factor only).
_ARTIFACT_BACKENDS = {".onnx": "onnxruntime", ".xml": "openvino", ".plan": "tensorrt",
                      ".engine": "tensorrt", ".py": "python", ".gguf": "llamacpp"}
# llama.cpp defaults the backend uses (backends/llamacpp/backend.py documents them).
_LLAMA_SLOTS, _LLAMA_CTX_PER_SLOT, _LLAMA_BATCH, _LLAMA_PAD = 4, 4096, 512, 256

State = Literal["loading", "ready", "unloading"]


# ---------------------------------------------------------------------------- memory facts


def total_memory() -> int | None:
    """MemTotal of this machine in bytes (None where /proc/meminfo is missing)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss() -> int:
    """Resident set size of this process in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# ---------------------------------------------------------------------------- GGUF metadata

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
                 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: Path, *, keep_arrays: bool = False) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (arrays are skipped unless `keep_arrays`: the
    vocabulary alone can be megabytes). Raises ValueError for a file that is not GGUF."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        (version,) = struct.unpack("<I", f.read(4))
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version}")
        _n_tensors, n_kv = struct.unpack("<QQ", f.read(16))
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = _gguf_string(f)
            (kind,) = struct.unpack("<I", f.read(4))
            if kind == _GGUF_ARRAY:
                (item_kind,) = struct.unpack("<I", f.read(4))
                (count,) = struct.unpack("<Q", f.read(8))
                if keep_arrays:
                    metadata[key] = [_gguf_value(f, item_kind) for _ in range(count)]
                else:
                    _skip_array(f, item_kind, count)
            else:
                metadata[key] = _gguf_value(f, kind)
        return metadata


def _skip_array(f: BinaryIO, kind: int, count: int) -> None:
    """Past an array without decoding it: one seek for fixed-size items; strings are walked
    by their lengths (a 128k-token vocabulary and its merges: ~0.3 s decoded, far less so)."""
    if kind == _GGUF_STRING:
        length = struct.Struct("<Q")
        for _ in range(count):
            (n,) = length.unpack(f.read(8))
            f.seek(n, os.SEEK_CUR)
        return
    fmt = _GGUF_SCALARS.get(kind)
    if fmt is None:
        raise ValueError(f"unknown GGUF array item type {kind}")
    f.seek(count * struct.calcsize(fmt), os.SEEK_CUR)


def _gguf_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def _gguf_value(f: BinaryIO, kind: int) -> Any:
    if kind == _GGUF_STRING:
        return _gguf_string(f)
    fmt = _GGUF_SCALARS.get(kind)
    if fmt is None:
        raise ValueError(f"unknown GGUF value type {kind}")
    (value,) = struct.unpack(fmt, f.read(struct.calcsize(fmt)))
    return value


def gguf_context_per_sequence(metadata: dict[str, Any], parameters: dict[str, str]) -> int:
    """Tokens of context each sequence gets under the llamacpp backend's parameters."""
    arch = str(metadata.get("general.architecture", "llama"))
    slots = _int(parameters.get("n_parallel"), _LLAMA_SLOTS)
    if parameters.get("embedding", "").strip().lower() in ("1", "true", "yes", "on"):
        return _int(parameters.get("n_batch"), _LLAMA_BATCH)
    total = _int(parameters.get("n_ctx"), 0)
    if total:
        return total // max(slots, 1)
    trained = int(metadata.get(f"{arch}.context_length", 0) or _LLAMA_CTX_PER_SLOT)
    return min(trained, _LLAMA_CTX_PER_SLOT)


def gguf_cost(path: Path, parameters: dict[str, str]) -> int:
    """Weights (the file) + an f16 KV cache for every slot's context, in bytes."""
    size = path.stat().st_size
    try:
        meta = read_gguf_metadata(path)
    except (OSError, ValueError, struct.error):
        return size
    arch = str(meta.get("general.architecture", "llama"))
    layers = int(meta.get(f"{arch}.block_count", 0))
    heads = int(meta.get(f"{arch}.attention.head_count", 1)) or 1
    heads_kv = int(meta.get(f"{arch}.attention.head_count_kv", heads)) or heads
    embd = int(meta.get(f"{arch}.embedding_length", 0))
    k_len = int(meta.get(f"{arch}.attention.key_length", embd // heads))
    v_len = int(meta.get(f"{arch}.attention.value_length", embd // heads))
    embedding = parameters.get("embedding", "").strip().lower() in ("1", "true", "yes", "on")
    slots = 1 if embedding else _int(parameters.get("n_parallel"), _LLAMA_SLOTS)
    per_seq = gguf_context_per_sequence(meta, parameters)
    # llama.cpp pads each sequence's context to a multiple of 256.
    per_seq = -(-per_seq // _LLAMA_PAD) * _LLAMA_PAD
    kv = layers * per_seq * slots * heads_kv * (k_len + v_len) * 2
    return size + kv


def _lora_bytes(version_dir: Path, text: str) -> int:
    """The sizes of the LoRA adapter files of the llamacpp backend's `lora` parameter
    (`path[:scale],...` from the version directory): llama.cpp reads them into memory."""
    total = 0
    for name, _ in lora_entries(text):
        with contextlib.suppress(OSError):
            if name and (version_dir / name).is_file():
                total += (version_dir / name).stat().st_size
    return total


def _int(raw: str | None, default: int) -> int:
    try:
        return int(raw) if raw and raw.strip() else default
    except ValueError:
        return default


def _estimate(model_dir: Path, config: ModelConfig | None, factors: dict[str, float]) -> int:
    """`estimate_cost`, reading the config when not given; the 1 MiB floor if unreadable.
    Blocking (file reads): a worker thread's job."""
    try:
        if config is None:
            config = layout.read_model_config(model_dir)[0]
        return estimate_cost(model_dir, config, factors)
    except (OSError, EdgedError):
        return MiB


def estimate_cost(model_dir: Path, config: ModelConfig, factors: dict[str, float]) -> int:
    """Estimated bytes the versions the policy selects will hold once loaded."""
    versions = layout.select_versions(layout.list_versions(model_dir), config.version_policy)
    total = 0
    for version in versions:
        version_dir = model_dir / str(version)
        files = [p for p in version_dir.rglob("*") if p.is_file()]
        ggufs = [p for p in files if p.suffix == ".gguf"]
        if ggufs and config.backend in ("", "auto", "llamacpp"):
            # The model's own file (LoRA adapters may sit beside it, and the directory lists
            # files in no fixed order), then the adapters its `lora` parameter loads.
            named = version_dir / (config.default_model_filename or "model.gguf")
            total += gguf_cost(named if named.is_file() else sorted(ggufs)[0], config.parameters)
            total += _lora_bytes(version_dir, config.parameters.get("lora", ""))
            continue
        backend = config.backend if config.backend not in ("", "auto") else next(
            (_ARTIFACT_BACKENDS[p.suffix] for p in files if p.suffix in _ARTIFACT_BACKENDS), ""
        )
        size = sum(p.stat().st_size for p in files)
        total += int(size * factors.get(backend, DEFAULT_FACTOR))
    return max(total, MiB)


# ---------------------------------------------------------------------------- residency


@dataclass
class Resident:
    """What residency knows about one loaded (or loading) model."""

    name: str
    on_demand: bool
    keep_alive: float | None  # seconds; None = forever
    cost: int
    measured: bool = False
    state: State = "ready"
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    # Wall clock (time.time()) when it unloads if still idle; None = never (in use or pinned).
    expires_at: float | None = None
    loaded_at: float = field(default_factory=time.time)
    load_seconds: float = 0.0
    timer: asyncio.TimerHandle | None = None


class Lease:
    """One request's hold on a model: while any lease is held the model is never unloaded."""

    __slots__ = ("_owner", "load_ns", "resident")

    def __init__(self, owner: Residency | None, resident: Resident | None, load_ns: int = 0) -> None:
        self._owner = owner
        self.resident = resident
        # Nanoseconds this request waited for the model to load (Ollama's load_duration).
        self.load_ns = load_ns

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None and self.resident is not None:
            owner._release(self.resident)


class Residency:
    def __init__(
        self,
        registry: ModelRegistry,
        config: ResidencyConfig,
        *,
        memory_total: int | None = None,
        rss: Callable[[], int] = current_rss,
    ) -> None:
        self.registry = registry
        self.config = config
        self.factors = {**config.backend_factors}
        total = memory_total if memory_total is not None else total_memory()
        self.budget: int | None = (
            parse_memory_size(config.memory_budget, total) if config.memory_budget else None
        )
        self.default_keep_alive = parse_keep_alive(config.default_keep_alive)
        self._rss = rss
        self._residents: dict[str, Resident] = {}
        self._loads: dict[str, asyncio.Task[None]] = {}
        # The loads among them that a load under way asked for (`_nested`).
        self._nested_loads: set[asyncio.Task[None]] = set()
        # Requests waiting in `acquire` for each model's load: it is theirs to lease next, so
        # neither its idle time nor an eviction starts until they have (or have gone).
        self._waiting: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Cost estimates running in worker threads; a budget decision waits for them.
        self._estimates: set[asyncio.Task[None]] = set()
        # Loads and evictions one at a time: the budget check and the RSS measurement need it.
        self._lock = asyncio.Lock()
        # The model a load is loading, in its context: what the load runs (a warmup, the BLS
        # calls it makes) sees it.
        self._loading: contextvars.ContextVar[Resident | None] = contextvars.ContextVar(
            "residency_loading", default=None
        )
        self._policies: dict[str, tuple[Path, bool, float | None]] = {}
        self.loads = 0  # on-demand loads done
        self.evictions = 0
        self.idle_unloads = 0
        # Exported on /metrics beside Triton's families (the registry's private collector registry).
        registry.metrics.register(lambda: _residency_families(self))

    # ------------------------------------------------------------------ policy

    async def on_demand(self, name: str, path: Path) -> bool:
        """Does this repository model load on demand? (Repository hook; reads its config.)"""
        return (await self._policy(name, path))[0]

    def on_demand_models(self) -> list[str]:
        """Repository models that load on demand (as last seen by the repository; no file reads)."""
        return sorted(
            name for name, (path, on_demand, _) in self._policies.items()
            if on_demand and (entry := self.registry.entry(name)) is not None and entry.path == path
        )

    async def _policy(self, name: str, path: Path) -> tuple[bool, float | None]:
        try:
            config, _ = await asyncio.to_thread(layout.read_model_config, path)
        except EdgedError:
            cached = self._policies.get(name)
            return (cached[1], cached[2]) if cached and cached[0] == path else (False, None)
        on_demand, keep = self._policy_of(config)
        self._policies[name] = (path, on_demand, keep)
        return on_demand, keep

    def _policy_of(self, config: ModelConfig) -> tuple[bool, float | None]:
        keep = parse_keep_alive(config.keep_alive) if config.keep_alive else self.default_keep_alive
        return config.load == "on-demand", keep

    async def estimate(self, name: str) -> int:
        """Bytes `name` is expected to hold once loaded. The files (and a GGUF's metadata,
        hundreds of milliseconds for a large vocabulary) are read in a worker thread."""
        entry = self.registry.entry(name)
        if entry is None or entry.path is None:
            return MiB
        config = entry.versions[max(entry.versions)].config if entry.versions else None
        return await asyncio.to_thread(_estimate, entry.path, config, self.factors)

    # ------------------------------------------------------------------ hooks

    async def acquire(self, name: str, keep_alive: float | Literal["default"] | None = "default") -> Lease:
        """Hold `name` for one request, loading it first when it is on-demand and not loaded.

        `keep_alive` (seconds, None = forever) replaces the model's keep_alive from now on, as
        Ollama's per-request keep_alive does. A model residency does not manage (unknown, or not
        on-demand and not loaded) gets an empty lease: the registry then answers as before.
        """
        lease = self.try_acquire(name, keep_alive)
        if lease is not None:
            return lease
        load_ns = 0
        self._waiting[name] = self._waiting.get(name, 0) + 1
        try:
            for _attempt in range(3):
                resident = self._ready(name)
                if resident is not None:
                    return self._lease(resident, keep_alive, load_ns)
                entry = self.registry.entry(name)
                if entry is None or entry.path is None or not await self.on_demand(name, entry.path):
                    return Lease(None, None)
                started = time.monotonic_ns()
                await self._ensure_loaded(name)
                load_ns += time.monotonic_ns() - started
            raise Unavailable(f"model '{name}' was unloaded again before it could serve; retry")
        finally:
            self._done_waiting(name)

    def _done_waiting(self, name: str) -> None:
        """A request left `acquire` (with a lease, or without: an error, a cancellation). The
        last one to go without a lease leaves the model idle: its idle time starts now."""
        left = self._waiting[name] - 1
        if left:
            self._waiting[name] = left
            return
        del self._waiting[name]
        resident = self._residents.get(name)
        if resident is not None and resident.state == "ready" and not resident.in_flight and resident.timer is None:
            self._schedule_expiry(resident)

    def try_acquire(self, name: str, keep_alive: float | Literal["default"] | None = "default") -> Lease | None:
        """`acquire` without waiting: a lease if `name` is loaded and servable, else None.
        (The hot path: a request for a loaded model costs no coroutine.)"""
        resident = self._ready(name)
        if resident is None:
            return None
        return self._lease(resident, keep_alive, 0)

    def _lease(self, resident: Resident, keep_alive: float | Literal["default"] | None, load_ns: int) -> Lease:
        if keep_alive != "default":
            if keep_alive == 0 and not resident.on_demand:
                raise InvalidArgument(
                    f"keep_alive: model '{resident.name}' is loaded at start (load: startup) and "
                    "is not unloaded by keep_alive 0; set load = \"on-demand\" in its config"
                )
            resident.keep_alive = keep_alive
        resident.in_flight += 1
        resident.last_used = time.monotonic()
        resident.expires_at = None
        if resident.timer is not None:
            resident.timer.cancel()
            resident.timer = None
        return Lease(self, resident, load_ns)

    def _ready(self, name: str) -> Resident | None:
        """The resident record of a loaded, servable model (tracking startup models lazily)."""
        entry = self.registry.entry(name)
        if entry is None or not entry.versions:
            return None
        resident = self._residents.get(name)
        if resident is None:
            # Loaded at start or by an explicit load: its policy is in the config it was loaded
            # with; its cost is estimated in a worker thread (0 until then, see _make_room).
            on_demand, keep = self._policy_of(entry.versions[max(entry.versions)].config)
            resident = Resident(name, on_demand, keep if on_demand else None, 0)
            self._residents[name] = resident
            task = asyncio.create_task(self._estimate_into(resident))
            self._estimates.add(task)
            task.add_done_callback(self._estimates.discard)
        return resident if resident.state == "ready" else None

    async def _estimate_into(self, resident: Resident) -> None:
        cost = await self.estimate(resident.name)
        if not resident.measured:
            resident.cost = cost

    def _release(self, resident: Resident) -> None:
        resident.in_flight -= 1
        resident.last_used = time.monotonic()
        if resident.in_flight == 0:
            self._schedule_expiry(resident)

    async def unload(self, name: str) -> bool:
        """Ollama's `keep_alive: 0` with no prompt: unload now, or once in-flight requests end.
        Returns whether the model was loaded."""
        resident = self._ready(name)
        if resident is None:
            return False
        if not resident.on_demand:
            raise InvalidArgument(
                f"keep_alive: model '{name}' is loaded at start (load: startup) and is not unloaded "
                "by keep_alive 0; set load = \"on-demand\" in its config"
            )
        resident.keep_alive = 0.0
        if resident.in_flight == 0:
            async with self._lock:
                if resident.state == "ready" and resident.in_flight == 0:
                    resident.state = "unloading"
                    await self._unload(resident, "keep_alive 0")
        return True

    @contextlib.asynccontextmanager
    async def room_for(self, name: str, path: Path) -> AsyncIterator[None]:
        """Room in the budget for a copy of `name` loaded from `path` that residency does not
        keep (an update's check of an on-demand model): idle models are evicted as for a load,
        and no load runs meanwhile (the RSS it measures would count the copy)."""
        async with self._lock:
            await self._make_room(name, await asyncio.to_thread(_estimate, path, None, self.factors))
            yield

    # ------------------------------------------------------------------ loading

    async def _ensure_loaded(self, name: str) -> None:
        task = self._loads.get(name)
        nested = self._nested()
        # Inside a load, a load of `name` that is waiting for the lock would wait for ever: this
        # one goes ahead of it (which then finds the model loaded).
        if task is None or (nested and task not in self._nested_loads):
            task = asyncio.create_task(self._load(name), name=f"load {name}")
            self._loads[name] = task
            if nested:
                self._nested_loads.add(task)
            task.add_done_callback(lambda t: self._load_done(name, t))
        # Shielded: a waiter that goes away does not cancel the load the others wait for.
        await asyncio.shield(task)

    def _load_done(self, name: str, task: asyncio.Task[None]) -> None:
        self._nested_loads.discard(task)
        if self._loads.get(name) is task:
            del self._loads[name]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter already got it

    def _nested(self) -> bool:
        """Whether this runs for a load under way (a BLS from its warmup to an ensemble over an
        on-demand step): that load holds the lock and waits for what it asked. Tasks the load
        started that run on after it (a scheduler's workers) find it done."""
        outer = self._loading.get()
        return outer is not None and outer.state == "loading" and self._residents.get(outer.name) is outer

    async def _load(self, name: str) -> None:
        if self._nested():
            # The lock is the asking load's, which waits for this one: no wait for it here.
            # (This load's RSS growth counts in that load's measurement too.)
            await self._load_locked(name)
            return
        async with self._lock:
            await self._load_locked(name)

    async def _load_locked(self, name: str) -> None:
        """Load `name`, residency's lock held (by this load or by the one that asked for it)."""
        if self._ready(name) is not None:
            return
        current = self._residents.get(name)
        if current is not None and current.state == "loading":  # only its own load can ask so
            raise Unavailable(
                f"model '{name}' is asked for by its own load (its warmup, through an ensemble) "
                "and cannot serve before it has loaded"
            )
        entry = self.registry.entry(name)
        if entry is None or entry.path is None:
            raise Unavailable(f"model '{name}' left the repository")
        path = entry.path
        _, keep = await self._policy(name, path)
        cost = await self.estimate(name)
        await self._make_room(name, cost)
        resident = Resident(name, True, keep, cost, state="loading")
        self._residents[name] = resident
        log.info("model %s: loading on demand (estimated %d MiB)", name, cost // MiB)
        before = self._rss()
        started = time.monotonic()
        token = self._loading.set(resident)
        try:
            await self.registry.load(name, path)
        except BaseException:
            self._residents.pop(name, None)
            raise
        finally:
            self._loading.reset(token)
        resident.load_seconds = time.monotonic() - started
        resident.loaded_at = time.time()
        grown = self._rss() - before
        if self.config.measure and grown > 0:
            resident.cost, resident.measured = grown, True
        resident.state = "ready"
        resident.last_used = time.monotonic()
        self.loads += 1
        log.info(
            "model %s: loaded on demand in %.2f s (%s %d MiB, keep_alive %s)", name,
            resident.load_seconds, "measured" if resident.measured else "estimated",
            resident.cost // MiB, "forever" if keep is None else f"{keep:g} s",
        )
        # Its waiters lease it next, and its idle time starts when the last lease ends. Not
        # before: with keep_alive 0 the idle unload is due at once, and under uvloop its
        # timer ran before the waiters resumed, so that a request for a model with
        # keep_alive 0 unloaded it three times over and failed. With no waiter left (all
        # went away), it idles from now.
        if not self._waiting.get(name):
            self._schedule_expiry(resident)

    def _used(self, besides: str) -> int:
        self._sync()
        return sum(r.cost for r in self._residents.values() if r.name != besides)

    async def _make_room(self, name: str, cost: int) -> None:
        """Evict least recently used idle on-demand models until `cost` fits the budget."""
        if self.budget is None:
            return
        self._sync()  # tracks what others loaded meanwhile: their estimates start now
        if self._estimates:
            await asyncio.gather(*self._estimates, return_exceptions=True)
        used = self._used(name)
        if used + cost <= self.budget:
            return
        idle = sorted(
            (r for r in self._residents.values()
             if r.on_demand and r.state == "ready" and r.in_flight == 0 and r.name != name
             and not self._waiting.get(r.name)),
            key=lambda r: r.last_used,
        )
        victims: list[Resident] = []
        for resident in idle:
            if used + cost <= self.budget:
                break
            victims.append(resident)
            used -= resident.cost
        if used + cost > self.budget:
            held = ", ".join(
                f"{r.name} {r.cost // MiB} MiB{' (in use)' if r.in_flight else ''}"
                for r in self._residents.values() if r.name != name and r not in victims
            )
            raise InsufficientMemory(
                f"model '{name}' needs about {cost // MiB} MiB but the memory budget "
                f"(residency.memory-budget = {self.config.memory_budget}, {self.budget // MiB} MiB) "
                f"has {max(self.budget - used, 0) // MiB} MiB free after evicting every idle model"
                + (f"; held by: {held}" if held else "")
            )
        # Marked in the same step as the choice: no request can take a lease on them now.
        for victim in victims:
            victim.state = "unloading"
        for victim in victims:
            await self._unload(victim, f"evicted (least recently used) to make room for {name}")
            self.evictions += 1

    async def _unload(self, resident: Resident, why: str) -> None:
        if resident.timer is not None:
            resident.timer.cancel()
        try:
            await self.registry.unload(resident.name)
        finally:
            if self._residents.get(resident.name) is resident:
                del self._residents[resident.name]
        entry = self.registry.entry(resident.name)
        if entry is not None and not entry.versions:
            # Not UNAVAILABLE: readiness (all_ready) must not flip because a model idled out.
            entry.state = "UNKNOWN"
            entry.reason = "unloaded (load: on-demand); the next request loads it"
        log.info("model %s: unloaded: %s", resident.name, why)

    def _sync(self) -> None:
        """Forget models unloaded by others (explicit unload, repository removal)."""
        for name, resident in list(self._residents.items()):
            entry = self.registry.entry(name)
            if resident.state == "ready" and (entry is None or not entry.versions):
                if resident.timer is not None:
                    resident.timer.cancel()
                del self._residents[name]
        for loaded in self.registry.loaded():
            self._ready(loaded.name)

    # ------------------------------------------------------------------ idling

    def _schedule_expiry(self, resident: Resident) -> None:
        if resident.timer is not None:
            resident.timer.cancel()
            resident.timer = None
        resident.expires_at = None
        if not resident.on_demand or resident.keep_alive is None or resident.state != "ready":
            return
        resident.expires_at = time.time() + resident.keep_alive
        loop = asyncio.get_running_loop()
        resident.timer = loop.call_later(resident.keep_alive, self._expire, resident)

    def _expire(self, resident: Resident) -> None:
        resident.timer = None
        task = asyncio.create_task(self._expire_now(resident))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _expire_now(self, resident: Resident) -> None:
        async with self._lock:
            if resident.state != "ready" or resident.in_flight or self._residents.get(resident.name) is not resident:
                return
            resident.state = "unloading"
            try:
                await self._unload(resident, f"idle for keep_alive {resident.keep_alive:g} s")
                self.idle_unloads += 1
            except EdgedError as exc:
                log.error("model %s: idle unload failed: %s", resident.name, exc.message)

    # ------------------------------------------------------------------ views

    def residents(self) -> list[Resident]:
        """Loaded and loading models, most recently used first (for /api/ps and metrics)."""
        self._sync()
        return sorted(self._residents.values(), key=lambda r: r.last_used, reverse=True)

    async def close(self) -> None:
        for resident in self._residents.values():
            if resident.timer is not None:
                resident.timer.cancel()
                resident.timer = None
        for task in [*self._tasks, *self._estimates, *self._loads.values()]:
            task.cancel()
        for task in [*self._tasks, *self._estimates, *self._loads.values()]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _residency_families(owner: Residency) -> Iterator[Metric]:
    from prometheus_client.metrics_core import Metric

    size = Metric("edged_model_memory_bytes",
                  "Memory a loaded or loading model counts against the budget (estimated or measured)", "gauge")
    in_flight = Metric("edged_model_requests_in_flight", "Requests holding a model loaded", "gauge")
    for resident in owner.residents():
        labels = {"model": resident.name, "state": resident.state,
                  "source": "measured" if resident.measured else "estimated"}
        size.add_sample(size.name, labels, resident.cost)
        in_flight.add_sample(in_flight.name, {"model": resident.name}, resident.in_flight)
    yield size
    yield in_flight
    if owner.budget is not None:
        budget = Metric("edged_memory_budget_bytes", "residency.memory-budget in bytes", "gauge")
        budget.add_sample(budget.name, {}, owner.budget)
        yield budget
    for name, doc, value in (
        ("edged_on_demand_loads", "Models loaded on demand by a request", owner.loads),
        ("edged_evictions", "Idle models unloaded to make room within the memory budget", owner.evictions),
        ("edged_idle_unloads", "On-demand models unloaded after idling for keep_alive", owner.idle_unloads),
    ):
        family = Metric(name, doc, "counter")
        family.add_sample(name + "_total", {}, value)
        yield family

