"""On-demand residency with real backends (ONNX Runtime, the Python backend, llama.cpp's GGUF
metadata): first request loads, concurrent first requests load once, idle unload, LRU eviction
under a memory budget, in-flight requests never cut, cost estimates and their correction."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest

from daemon.backend import InferRequest
from daemon.config import DaemonConfig, ResidencyConfig, load_config
from daemon.core import layout
from daemon.core.hardware import Hardware
from daemon.core.plugins import PluginRegistry
from daemon.core.registry import ModelRegistry
from daemon.core.repository import RepositoryManager
from daemon.core.residency import (
    MiB,
    Residency,
    estimate_cost,
    gguf_cost,
    read_gguf_metadata,
)
from daemon.core.stats import MetricsRegistry
from daemon.errors import ConfigError, InsufficientMemory, InvalidArgument
from daemon.model_config import to_triton_json

pytest.importorskip("onnxruntime")

from model_builders import build_mlp_onnx, mlp_reference

from support import REPO_BACKENDS, DaemonProcess, python_model

ON_DEMAND = 'parameters { key: "load" value { string_value: "on-demand" } }\n'


def keep(value: str) -> str:
    return f'parameters {{ key: "keep_alive" value {{ string_value: "{value}" }} }}\n'


def mlp(repo: Path, name: str, extra: str = ON_DEMAND) -> object:
    (repo / name / "1").mkdir(parents=True)
    weights = build_mlp_onnx(repo / name / "1" / "model.onnx", width=8, depth=1, seed=len(name))
    (repo / name / "config.pbtxt").write_text('backend: "onnxruntime"\n' + extra)
    return weights


def _until_exists(gate: Path) -> str:
    """Python source that waits (60 s at most) for the file `gate` to exist: a model held
    in a step until the test opens the gate, instead of for a time a loaded machine may outrun."""
    return (
        f"import os, time\ndeadline = time.monotonic() + 60\n"
        f"while not os.path.exists({str(gate)!r}) and time.monotonic() < deadline:\n"
        f"    time.sleep(0.01)\n"
    )


def python_plus_one(repo: Path, name: str, gate: Path | None = None, extra: str = ON_DEMAND) -> None:
    """y = x + 1; with a `gate`, each execute is held until that file exists."""
    python_model(repo, name, (_until_exists(gate) if gate else "") + "y = x + 1")
    config = repo / name / "config.pbtxt"
    config.write_text(config.read_text() + extra)


class World:
    def __init__(self, tmp_path: Path, repo: Path, **residency: object) -> None:
        plugins = PluginRegistry([REPO_BACKENDS])
        plugins.scan()
        self.registry = ModelRegistry(plugins, Hardware(openvino=False), MetricsRegistry(), tmp_path / "state")
        # measure=False: costs are the (deterministic) estimates; test_measured_cost covers RSS.
        config = ResidencyConfig(measure=False, **residency)  # type: ignore[arg-type]
        self.residency = Residency(self.registry, config, memory_total=8 << 30)
        self.repository = RepositoryManager(self.registry, [repo], "none")
        self.repository.on_demand = self.residency.on_demand

    def loaded(self) -> set[str]:
        return {m.name for m in self.registry.loaded()}

    async def infer(self, name: str, x: np.ndarray) -> np.ndarray:
        lease = await self.residency.acquire(name)
        try:
            model = self.registry.get(name)
            response = await model.infer(InferRequest({model.config.input[0].name: x}))
            return next(iter(response.outputs.values()))
        finally:
            lease.release()

    async def close(self) -> None:
        await self.residency.close()
        await self.registry.close()


async def wait_for(condition: Callable[[], bool], seconds: float = 60.0) -> None:
    """Poll observable state (bounded: a loaded CI machine can be slow to load or unload)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {seconds} s")
        await asyncio.sleep(0.02)


X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)


async def test_first_request_loads_and_concurrent_first_requests_load_once(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    weights = mlp(repo, "lazy")
    mlp(repo, "eager", extra="")
    world = World(tmp_path, repo)
    try:
        assert await world.repository.startup() == []
        assert world.loaded() == {"eager"}  # the on-demand model waits for its first request
        assert world.registry.all_ready()
        outputs = await asyncio.gather(*(world.infer("lazy", X) for _ in range(6)))
        assert world.residency.loads == 1
        for out in outputs:
            np.testing.assert_allclose(out, mlp_reference(X, weights), rtol=1e-4, atol=1e-5)  # type: ignore[arg-type]
        assert world.loaded() == {"eager", "lazy"}
        # A poll/SIGHUP rescan leaves on-demand models alone, loaded or not.
        await world.repository.rescan()
        assert world.residency.loads == 1 and world.loaded() == {"eager", "lazy"}
    finally:
        await world.close()


async def test_slow_load_is_visible_and_shared_by_concurrent_first_requests(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_plus_one(repo, "slowload")
    # A load that takes a while (initialize waits for the test): every request that arrives
    # meanwhile waits for the same load.
    load_gate = tmp_path / "load"
    initialize = "    def initialize(self, args):\n" + "".join(
        "        " + line + "\n" for line in _until_exists(load_gate).splitlines()
    )
    model_py = repo / "slowload" / "1" / "model.py"
    model_py.write_text(model_py.read_text().replace(
        "class TritonPythonModel:\n", "class TritonPythonModel:\n" + initialize + "\n",
    ))
    world = World(tmp_path, repo)
    try:
        await world.repository.startup()
        x = np.array([1.0], dtype=np.float32)
        first = asyncio.create_task(world.infer("slowload", x))
        await wait_for(lambda: [r.state for r in world.residency.residents()] == ["loading"])
        rest = [asyncio.create_task(world.infer("slowload", x)) for _ in range(4)]
        for _ in range(5):
            await asyncio.sleep(0)  # the four reach residency while the load still waits
        assert [r.state for r in world.residency.residents()] == ["loading"]
        load_gate.touch()
        for out in await asyncio.gather(first, *rest):
            np.testing.assert_allclose(out, x + 1)
        assert world.residency.loads == 1
        assert [r.state for r in world.residency.residents()] == ["ready"]
    finally:
        load_gate.touch()
        await world.close()


async def test_idle_model_unloads_after_keep_alive_and_reloads(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    mlp(repo, "lazy", ON_DEMAND + keep("200ms"))
    world = World(tmp_path, repo)
    try:
        await world.repository.startup()
        await world.infer("lazy", X)
        (resident,) = world.residency.residents()
        assert resident.keep_alive == pytest.approx(0.2) and resident.expires_at is not None
        entry = world.registry.entry("lazy")
        assert entry is not None
        # The end of the unload (versions go first, the state when the backend has unloaded).
        await wait_for(lambda: entry.state == "UNKNOWN")
        assert "lazy" not in world.loaded() and not world.residency.residents()
        assert world.registry.all_ready()  # idling out does not make the daemon unready
        await world.repository.rescan()
        assert "lazy" not in world.loaded()  # and a rescan does not bring it back
        await world.infer("lazy", X)
        assert world.residency.loads == 2
        # Unloaded behind residency's back (explicit repository unload): the next request loads it.
        await world.registry.unload("lazy")
        await world.infer("lazy", X)
        assert world.residency.loads == 3
    finally:
        await world.close()


async def test_request_keep_alive_overrides_and_zero_unloads(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    mlp(repo, "lazy", ON_DEMAND + keep("1h"))
    mlp(repo, "eager", extra="")
    world = World(tmp_path, repo)
    try:
        await world.repository.startup()
        lease = await world.residency.acquire("lazy", keep_alive=None)  # Ollama's negative: forever
        lease.release()
        (resident,) = [r for r in world.residency.residents() if r.name == "lazy"]
        assert resident.keep_alive is None and resident.expires_at is None
        assert await world.residency.unload("lazy") is True
        assert "lazy" not in world.loaded()
        assert await world.residency.unload("lazy") is False  # not loaded: nothing to do
        with pytest.raises(InvalidArgument, match="load: startup"):
            await world.residency.unload("eager")
        with pytest.raises(InvalidArgument, match="keep_alive"):
            await world.residency.acquire("eager", keep_alive=0)
    finally:
        await world.close()


async def test_budget_evicts_least_recently_used_idle_model(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name in ("a", "b", "c"):
        mlp(repo, name)
    # Each tiny model is estimated at the 1 MiB floor: two fit.
    world = World(tmp_path, repo, memory_budget="2MiB")
    try:
        await world.repository.startup()
        assert await world.residency.estimate("a") == MiB
        await world.infer("a", X)
        await world.infer("b", X)
        await world.infer("a", X)  # b is now the least recently used
        await world.infer("c", X)
        assert world.loaded() == {"a", "c"}
        await world.infer("b", X)
        assert world.loaded() == {"b", "c"}
        assert world.residency.loads == 4
        text = world.registry.metrics.render().decode()
        assert "edged_evictions_total 2.0" in text and "edged_on_demand_loads_total 4.0" in text
        assert 'edged_model_memory_bytes{model="b",source="estimated",state="ready"} 1.048576e+06' in text
        assert "edged_memory_budget_bytes 2.097152e+06" in text
    finally:
        await world.close()


async def test_in_flight_requests_are_never_cut(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    gate = tmp_path / "finish"
    python_plus_one(repo, "slow", gate, ON_DEMAND + keep("0s"))
    mlp(repo, "other")
    world = World(tmp_path, repo, memory_budget="1MiB")
    try:
        await world.repository.startup()
        x = np.array([1.0, 2.0], dtype=np.float32)
        running = asyncio.create_task(world.infer("slow", x))
        await wait_for(lambda: any(r.in_flight for r in world.residency.residents()))
        # The only model that could make room is in use: the load fails, naming the budget.
        with pytest.raises(InsufficientMemory, match=r"memory-budget = 1MiB") as caught:
            await world.infer("other", X)
        assert "slow 1 MiB (in use)" in caught.value.message
        # keep_alive 0 while in flight: unloads once the request is done, not before.
        assert await world.residency.unload("slow") is True
        assert "slow" in world.loaded()
        gate.touch()  # the request held in execute until now
        np.testing.assert_allclose(await running, x + 1)
        await wait_for(lambda: "slow" not in world.loaded())
        await world.infer("other", X)  # room now
        assert world.loaded() == {"other"}
    finally:
        gate.touch()
        await world.close()


def test_a_daemon_answers_each_request_to_a_keep_alive_0_model_then_unloads_it(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    # The real daemon (uvloop): the model's idle unload, due at once with keep_alive 0, waits
    # for the request that loaded it. It once ran first, and every such request failed with
    # "was unloaded again before it could serve; retry".
    repo = tmp_path / "repo"
    weights = mlp(repo, "lazy", ON_DEMAND + keep("0s"))
    daemon = start_daemon("--model-repository", str(repo))
    body = {"inputs": [{"name": "INPUT0", "shape": [2, 8], "datatype": "FP32", "data": X.ravel().tolist()}]}

    def lazy_state() -> str:
        (entry,) = [e for e in daemon.post_ok("/v2/repository/index", {}) if e["name"] == "lazy"]
        return str(entry.get("state", ""))

    for _ in range(3):
        reply = daemon.post_ok("/v2/models/lazy/infer", body)
        (output,) = reply["outputs"]
        np.testing.assert_allclose(
            np.array(output["data"], np.float32).reshape(output["shape"]), mlp_reference(X, weights), rtol=1e-5
        )
        deadline = time.monotonic() + 60
        while lazy_state() == "READY":
            assert time.monotonic() < deadline, "a keep_alive 0 model stayed loaded"
            time.sleep(0.02)


async def test_measured_rss_replaces_the_estimate(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    mlp(repo, "lazy")
    readings = iter([100 * MiB, 107 * MiB])
    world = World(tmp_path, repo)
    world.residency.config = msgspec.structs.replace(world.residency.config, measure=True)
    world.residency._rss = lambda: next(readings)
    try:
        await world.repository.startup()
        await world.infer("lazy", X)
        (resident,) = world.residency.residents()
        assert resident.measured and resident.cost == 7 * MiB
    finally:
        await world.close()


def test_tensor_estimate_is_file_size_times_backend_factor(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "big" / "1").mkdir(parents=True)
    (repo / "big" / "1" / "model.onnx").write_bytes(b"\0" * (4 * MiB))
    (repo / "big" / "config.pbtxt").write_text('backend: "onnxruntime"\n')
    config, _ = layout.read_model_config(repo / "big")
    assert estimate_cost(repo / "big", config, {}) == 6 * MiB  # default factor 1.5
    assert estimate_cost(repo / "big", config, {"onnxruntime": 2.0}) == 8 * MiB


def test_gguf_estimate_is_weights_plus_kv_cache(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from gguf_builder import write_tiny_llama

    path = write_tiny_llama(tmp_path / "model.gguf", n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ctx=256)
    meta = read_gguf_metadata(path)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 2
    size = path.stat().st_size
    head_dim = 64 // 4
    # Defaults: 4 slots x min(trained 256, 4096) tokens; K and V, f16, 2 KV heads, 2 layers.
    assert gguf_cost(path, {}) == size + 2 * 256 * 4 * 2 * (2 * head_dim) * 2
    # n_ctx is the total over the slots; each slot's share is padded to 256.
    assert gguf_cost(path, {"n_ctx": "1000", "n_parallel": "2"}) == size + 2 * 512 * 2 * 2 * (2 * head_dim) * 2


def test_residency_settings_in_model_toml_and_config_pbtxt(tmp_path: Path) -> None:
    toml = tmp_path / "a"
    toml.mkdir()
    (toml / "model.toml").write_text('backend = "onnxruntime"\nload = "on-demand"\nkeep_alive = "10m"\n')
    config, _ = layout.read_model_config(toml)
    assert (config.load, config.keep_alive) == ("on-demand", "10m")
    pbtxt = tmp_path / "b"
    pbtxt.mkdir()
    (pbtxt / "config.pbtxt").write_text(
        'backend: "llamacpp"\n' + ON_DEMAND + keep("30s") + 'parameters { key: "n_ctx" value { string_value: "512" } }\n'
    )
    config, _ = layout.read_model_config(pbtxt)
    # Lifted out of `parameters`, so a backend never sees them as its own options.
    assert (config.load, config.keep_alive, config.parameters) == ("on-demand", "30s", {"n_ctx": "512"})
    served = to_triton_json(config)["parameters"]
    assert served["load"] == {"string_value": "on-demand"} and served["keep_alive"] == {"string_value": "30s"}
    (toml / "model.toml").write_text('load = "on-demand"\nkeep_alive = "soon"\n')
    with pytest.raises(ConfigError, match="keep_alive"):
        layout.read_model_config(toml)
    (toml / "model.toml").write_text('load = "lazy"\n')
    with pytest.raises(ConfigError, match="load"):
        layout.read_model_config(toml)


def test_daemon_residency_config(tmp_path: Path) -> None:
    path = tmp_path / "edged.toml"
    path.write_text('[residency]\nmemory-budget = "75%"\ndefault-keep-alive = "30s"\n')
    config = load_config(path)
    assert config.residency.memory_budget == "75%"
    assert DaemonConfig().residency.memory_budget == ""
    path.write_text('[residency]\nmemory-budget = "lots"\n')
    with pytest.raises(ConfigError, match="memory-budget"):
        load_config(path)
    path.write_text('[residency]\ndefault-keep-alive = "5 minutes"\n')
    with pytest.raises(ConfigError, match="keep"):
        load_config(path)


async def test_configs_and_costs_are_read_off_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule for blocking work: reading a model's config and its files for the cost estimate
    (a GGUF's metadata walks the whole vocabulary: ~0.3 s for a 128k-token one) happens in a
    worker thread, for the first request to a startup model as for an on-demand load."""
    import threading

    from daemon.core import residency as residency_module

    repo = tmp_path / "repo"
    mlp(repo, "startup", extra="")
    mlp(repo, "lazy")
    loop_thread = threading.current_thread()
    reads: list[tuple[str, bool]] = []
    real_cost, real_config = residency_module.estimate_cost, layout.read_model_config

    def cost(*args: object) -> int:
        reads.append(("cost", threading.current_thread() is loop_thread))
        return real_cost(*args)  # type: ignore[arg-type]

    def config(*args: object) -> object:
        reads.append(("config", threading.current_thread() is loop_thread))
        return real_config(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(residency_module, "estimate_cost", cost)
    monkeypatch.setattr(layout, "read_model_config", config)
    world = World(tmp_path, repo, memory_budget="1GiB")
    try:
        await world.repository.startup()
        await world.infer("startup", X)  # first request: the startup model gets tracked
        await world.infer("lazy", X)  # on-demand: policy, estimate, budget (waits for the other)
        assert world.loaded() == {"startup", "lazy"}
        assert {kind for kind, _ in reads} == {"cost", "config"}
        assert not [kind for kind, on_loop in reads if on_loop], reads
        assert all(r.cost == MiB for r in world.residency.residents())
    finally:
        await world.close()


def test_gguf_estimate_is_the_models_file_plus_its_lora_adapters(tmp_path: Path) -> None:
    """A version directory with LoRA adapter GGUFs beside model.gguf (the `lora` parameter):
    the model's own file gives the weights and KV cache, whatever order the directory lists
    them in, and the adapters it loads add their size (llama.cpp reads them into memory)."""
    pytest.importorskip("gguf")
    from gguf_builder import write_tiny_llama, write_tiny_lora

    version = tmp_path / "m" / "1"
    (version / "adapters").mkdir(parents=True)
    model = write_tiny_llama(version / "model.gguf", n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ctx=256)
    first = write_tiny_lora(version / "a.gguf", model)  # listed before model.gguf
    second = write_tiny_lora(version / "adapters" / "b.gguf", model, seed=2)
    write_tiny_lora(version / "unused.gguf", model, seed=3)  # not in the parameter: never loaded
    (tmp_path / "m" / "config.pbtxt").write_text(
        'backend: "llamacpp"\nparameters { key: "lora" value { string_value: "a.gguf, adapters/b.gguf:0.5" } }\n'
        'parameters { key: "n_ctx" value { string_value: "16384" } }\n'  # above the 1 MiB floor
    )
    config, _ = layout.read_model_config(tmp_path / "m")
    adapters = first.stat().st_size + second.stat().st_size
    assert estimate_cost(tmp_path / "m", config, {}) == gguf_cost(model, config.parameters) + adapters
