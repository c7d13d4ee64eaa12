"""Loading runs off the event loop: a load blocked in plugin code (import, autocomplete,
load) never stalls requests to other models, and a failed load leaves nothing behind."""

from __future__ import annotations

import asyncio
import re
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from daemon.backend import InferRequest
from daemon.core.hardware import Hardware
from daemon.core.plugins import PluginRegistry
from daemon.core.registry import ModelRegistry
from daemon.core.stats import MetricsRegistry
from daemon.errors import EdgedError
from support import REPO_BACKENDS, python_model

SLOW_PLUGIN = '''
import edged_test_gate

from daemon.backend import TensorBackend

# Import-time work of a heavy runtime, stood in for by a gate the test opens.
edged_test_gate.entered.set()
if not edged_test_gate.gate.wait(timeout=30):
    raise RuntimeError("gate never opened")


class Slow(TensorBackend):
    name = "slowimport"

    def load_sync(self, config, artifact, device):
        pass

    def infer(self, inputs):
        return {"Y": inputs["X"] + 1}
'''


@pytest.fixture
def gate() -> types.ModuleType:
    module = types.ModuleType("edged_test_gate")
    module.gate = threading.Event()  # type: ignore[attr-defined]
    module.entered = threading.Event()  # type: ignore[attr-defined]
    sys.modules["edged_test_gate"] = module
    yield module
    module.gate.set()  # type: ignore[attr-defined]
    del sys.modules["edged_test_gate"]


async def test_a_load_blocked_in_plugin_import_does_not_stall_other_models(
    tmp_path: Path, gate: types.ModuleType
) -> None:
    plugin = tmp_path / "plugins" / "slowimport"
    plugin.mkdir(parents=True)
    (plugin / "manifest.toml").write_text(
        'name = "slowimport"\nversion = "1"\napi-version = 1\nentrypoint = "backend:Slow"\n'
        'artifacts = ["model.bin"]\n'
    )
    (plugin / "backend.py").write_text(SLOW_PLUGIN)
    plugins = PluginRegistry([REPO_BACKENDS, tmp_path / "plugins"])
    plugins.scan()
    registry = ModelRegistry(plugins, Hardware(openvino=False), MetricsRegistry(), tmp_path / "state")
    repo = tmp_path / "repo"
    python_model(repo, "fast", "y = x * 2")
    slow = repo / "slow"
    (slow / "1").mkdir(parents=True)
    (slow / "1" / "model.bin").write_bytes(b"")
    (slow / "model.toml").write_text(
        'backend = "slowimport"\n[[input]]\nname = "X"\ndata_type = "FP32"\ndims = [1]\n'
        '[[output]]\nname = "Y"\ndata_type = "FP32"\ndims = [1]\n'
    )
    try:
        await registry.load("fast", repo / "fast")
        loading = asyncio.create_task(registry.load("slow", slow))
        # The slow plugin's import has started and is blocked on the gate...
        assert await asyncio.to_thread(gate.entered.wait, 30)  # type: ignore[attr-defined]
        assert not loading.done()
        # ...while the other model keeps answering, because the import is not on the loop.
        for value in range(5):
            response = await registry.get("fast").infer(InferRequest({"X": np.array([value], np.float32)}))
            np.testing.assert_array_equal(response.outputs["Y"], [value * 2])
        assert registry.entry("slow").state == "LOADING"  # type: ignore[union-attr]
        gate.gate.set()  # type: ignore[attr-defined]
        await loading
        response = await registry.get("slow").infer(InferRequest({"X": np.array([1], np.float32)}))
        np.testing.assert_array_equal(response.outputs["Y"], [2])
    finally:
        gate.gate.set()  # type: ignore[attr-defined]
        await registry.close()


async def test_a_failed_load_keeps_nothing_loaded(tmp_path: Path) -> None:
    plugins = PluginRegistry([REPO_BACKENDS])
    plugins.scan()
    registry = ModelRegistry(plugins, Hardware(openvino=False), MetricsRegistry(), tmp_path / "state")
    repo = tmp_path / "repo"
    python_model(repo, "good", "y = x")
    python_model(repo, "good", "y = x", version=2)
    (repo / "good" / "2" / "model.py").write_text("raise SystemExit('broken version 2')\n")
    try:
        with pytest.raises(EdgedError, match="version 2"):
            await registry.load("good", repo / "good")
        entry = registry.entry("good")
        assert entry is not None and entry.versions == {} and entry.state == "UNAVAILABLE"
        assert registry.metrics.totals() == []
    finally:
        await registry.close()


def test_thread_budget_follows_the_cpu_affinity_not_the_machine() -> None:
    import subprocess
    import sys

    code = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
        "from daemon.core.loading import usable_cpus; print(usable_cpus())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "1", out.stderr


def test_a_config_asking_for_rescheduling_needs_a_backend_that_can() -> None:
    from daemon.backend import Backend, Capabilities
    from daemon.core.loading import check_capabilities
    from daemon.errors import ConfigError
    from daemon.model_config import config_from_mapping

    class Plain(Backend):
        name = "plain"

    class Rescheduling(Backend):
        name = "rescheduling"
        capabilities = Capabilities(rescheduling=True)

    config = config_from_mapping({"name": "m", "sequence_batching": {"iterative_sequence": True}}, source="test")
    with pytest.raises(ConfigError, match=re.escape(
        "model 'm': sequence_batching.iterative_sequence is set, but backend 'plain' cannot reschedule a request"
    )):
        check_capabilities("plain", Plain, config)
    check_capabilities("rescheduling", Rescheduling, config)
