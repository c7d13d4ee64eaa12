"""Cost of the residency hook on the hot path: `registry.get` alone vs lease + get + release,
for a loaded ONNX model, side by side in one process.

    .venv/bin/python bench/residency_hook.py [--requests 200000]

Prints microseconds per request for both and their difference (what every KServe/OpenAI/Ollama
request pays for on-demand residency when its model is already loaded).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the model builders are test fixtures

from model_builders import build_mlp_onnx  # noqa: E402

from daemon.config import ResidencyConfig  # noqa: E402
from daemon.core.hardware import Hardware  # noqa: E402
from daemon.core.plugins import PluginRegistry  # noqa: E402
from daemon.core.registry import ModelRegistry  # noqa: E402
from daemon.core.residency import Residency  # noqa: E402
from daemon.core.stats import MetricsRegistry  # noqa: E402


async def run(requests: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        (repo / "m" / "1").mkdir(parents=True)
        build_mlp_onnx(repo / "m" / "1" / "model.onnx", width=4, depth=1)
        (repo / "m" / "config.pbtxt").write_text('backend: "onnxruntime"\n')
        plugins = PluginRegistry([ROOT / "backends"])
        plugins.scan()
        registry = ModelRegistry(plugins, Hardware(openvino=False), MetricsRegistry(), repo / "state")
        await registry.load("m", repo / "m")
        residency = Residency(registry, ResidencyConfig())
        results = {}
        for label in ("get", "lease+get"):
            best = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                if label == "get":
                    for _ in range(requests):
                        registry.get("m")
                else:
                    for _ in range(requests):
                        lease = residency.try_acquire("m") or await residency.acquire("m")
                        registry.get("m")
                        lease.release()
                best = min(best, (time.perf_counter() - started) / requests)
            results[label] = best * 1e6
            print(f"{label}: {results[label]:.2f} us per request")
        print(f"hook overhead: {results['lease+get'] - results['get']:.2f} us per request")
        await residency.close()
        await registry.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    asyncio.run(run(parser.parse_args().requests))


if __name__ == "__main__":
    main()
