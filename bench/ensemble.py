"""What an ensemble request costs in the daemon's own code: in process, no HTTP.

    .venv/bin/python bench/ensemble.py [--rounds 3] [--requests 2000]

    # another tree: its own copy of this script runs it (bench/common.py puts the script's
    # checkout first on the path)
    git worktree add /tmp/base <commit> && cp bench/ensemble.py /tmp/base/bench/
    .venv/bin/python /tmp/base/bench/ensemble.py

A two-step ensemble of python models (X + 1, then * 2, INT32 [1, 16]) is loaded into a
ModelRegistry of the script's tree, and every round prints the microseconds per request
asked one at a time and with 16 asking at once. Compare two trees by running them one after
the other, twice each, on a quiet machine: the figures move a few percent between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np
from common import machine

import daemon
from daemon.backend import InferRequest
from daemon.core.hardware import Hardware
from daemon.core.plugins import PluginRegistry
from daemon.core.registry import ModelRegistry
from daemon.core.stats import MetricsRegistry

TENSOR = "data_type: TYPE_INT32 dims: [ 16 ]"


def write_step(repo: Path, name: str, expression: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        f'backend: "python"\nmax_batch_size: 8\ninput [{{ name: "X" {TENSOR} }}]\noutput [{{ name: "Y" {TENSOR} }}]\n'
    )
    (repo / name / "1" / "model.py").write_text(
        "import numpy as np\nimport triton_python_backend_utils as pb_utils\n\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        out = []\n"
        "        for r in requests:\n"
        "            x = pb_utils.get_input_tensor_by_name(r, 'X').as_numpy()\n"
        f"            out.append(pb_utils.InferenceResponse([pb_utils.Tensor('Y', np.asarray({expression}, np.int32))]))\n"
        "        return out\n"
    )


def write_ensemble(repo: Path) -> None:
    (repo / "pipe" / "1").mkdir(parents=True)
    (repo / "pipe" / "config.pbtxt").write_text(
        f'platform: "ensemble"\nmax_batch_size: 8\ninput [{{ name: "IN" {TENSOR} }}]\n'
        f'output [{{ name: "OUT" {TENSOR} }}]\nensemble_scheduling {{ step [\n'
        '  { model_name: "add" model_version: -1 input_map { key: "X" value: "IN" } output_map { key: "Y" value: "MID" } },\n'
        '  { model_name: "twice" model_version: -1 input_map { key: "X" value: "MID" } output_map { key: "Y" value: "OUT" } }\n'
        "] }\n"
    )


async def run(rounds: int, requests: int) -> None:
    tree = Path(daemon.__file__).resolve().parents[1]
    print(f"tree {tree}; {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        write_step(repo, "add", "x + 1")
        write_step(repo, "twice", "x * 2")
        write_ensemble(repo)
        plugins = PluginRegistry([tree / "backends"])
        plugins.scan()
        registry = ModelRegistry(plugins, Hardware(openvino=False), MetricsRegistry(), Path(tmp) / "state")
        try:
            for name in ("add", "twice", "pipe"):
                await registry.load(name, repo / name)
            pipe = registry.get("pipe")
            x = np.arange(16, dtype=np.int32).reshape(1, 16)
            answer = (await pipe.infer(InferRequest({"IN": x}))).outputs["OUT"]
            np.testing.assert_array_equal(answer, (x + 1) * 2)

            async def ask(count: int) -> None:
                for _ in range(count):
                    await pipe.infer(InferRequest({"IN": x}))

            await ask(200)  # warm
            for number in range(rounds):
                started = time.perf_counter()
                await ask(requests)
                alone = (time.perf_counter() - started) / requests * 1e6
                started = time.perf_counter()
                await asyncio.gather(*(ask(requests // 16) for _ in range(16)))
                together = (time.perf_counter() - started) / (requests // 16 * 16) * 1e6
                print(f"round {number}: one at a time {alone:.0f} us/request, 16 at once {together:.0f} us/request")
        finally:
            await registry.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    asyncio.run(run(args.rounds, args.requests))


if __name__ == "__main__":
    main()
