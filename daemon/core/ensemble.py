"""Ensembles: Triton's `ensemble_scheduling`, a DAG of models served as one model.

Each step maps ensemble tensors to a step model's inputs (`input_map`: step name -> ensemble
name) and its outputs back (`output_map`: step name -> ensemble name). Steps whose inputs are all
available run concurrently, wave by wave; every step goes through the step model's own
scheduler, so batching still happens per model. Errors name the failing step.
"""

from __future__ import annotations

import asyncio
import time

from daemon.backend import InferRequest, InferResponse
from daemon.core.registry import ModelRegistry
from daemon.core.stats import ModelStats
from daemon.errors import ConfigError, EdgedError
from daemon.model_config import EnsembleStep, ModelConfig


class EnsembleRunner:
    def __init__(self, registry: ModelRegistry, name: str, version: int, config: ModelConfig, stats: ModelStats) -> None:
        self.registry = registry
        self.name = name
        self.config = config
        self.stats = stats
        assert config.ensemble_scheduling is not None
        self.steps = config.ensemble_scheduling.step
        self._check_graph()

    def _check_graph(self) -> None:
        """Reject configs whose steps can never all run: every input must be produced somewhere."""
        if not self.steps:
            raise ConfigError(f"ensemble '{self.name}': ensemble_scheduling has no steps")
        available = {t.name for t in self.config.input}
        remaining = list(enumerate(self.steps))
        while remaining:
            ready = [(i, s) for i, s in remaining if set(s.input_map.values()) <= available]
            if not ready:
                i, step = remaining[0]
                missing = sorted(set(step.input_map.values()) - available)
                raise ConfigError(
                    f"ensemble '{self.name}': step {i} (model '{step.model_name}') needs "
                    f"{missing}, which no ensemble input or earlier step produces"
                )
            for _, step in ready:
                available |= set(step.output_map.values())
            remaining = [(i, s) for i, s in remaining if (i, s) not in ready]
        missing_outputs = sorted({t.name for t in self.config.output} - available)
        if missing_outputs:
            raise ConfigError(f"ensemble '{self.name}': outputs {missing_outputs} are produced by no step")

    async def _run_step(self, index: int, step: EnsembleStep, tensors: dict[str, object], parent: InferRequest) -> dict[str, object]:
        inputs = {inner: tensors[outer] for inner, outer in step.input_map.items()}
        request = InferRequest(
            inputs=inputs,  # type: ignore[arg-type]
            id=parent.id,
            requested_outputs=tuple(step.output_map),
            # As in Triton, every step sees the request's parameters.
            parameters=dict(parent.parameters),
            priority=parent.priority,
            timeout_us=parent.timeout_us,
        )
        version = None if step.model_version < 0 else str(step.model_version)
        try:
            response = await self.registry.infer(step.model_name, version, request)
        except EdgedError as exc:
            error = type(exc)(
                f"ensemble '{self.name}' step {index} (model '{step.model_name}'): {exc.message}"
            )
            raise error from exc
        produced: dict[str, object] = {}
        for inner, outer in step.output_map.items():
            if inner not in response.outputs:
                raise ConfigError(
                    f"ensemble '{self.name}' step {index} (model '{step.model_name}') "
                    f"did not produce output '{inner}'"
                )
            produced[outer] = response.outputs[inner]
        return produced

    async def infer(self, request: InferRequest) -> InferResponse:
        started = time.monotonic_ns()
        tensors: dict[str, object] = dict(request.inputs)
        remaining = list(enumerate(self.steps))
        try:
            while remaining:
                ready = [(i, s) for i, s in remaining if set(s.input_map.values()) <= tensors.keys()]
                results = await asyncio.gather(*(self._run_step(i, s, tensors, request) for i, s in ready))
                for produced in results:
                    tensors.update(produced)
                remaining = [(i, s) for i, s in remaining if (i, s) not in ready]
        except EdgedError:
            self.stats.record_failure(time.monotonic_ns() - started)
            raise
        wanted = request.requested_outputs or tuple(t.name for t in self.config.output)
        outputs = {name: tensors[name] for name in wanted if name in tensors}
        self.stats.record_success(time.monotonic_ns() - started, request.batch_size())
        return InferResponse(outputs)  # type: ignore[arg-type]


def install_ensembles(registry: ModelRegistry) -> None:
    registry.ensemble_factory = EnsembleRunner
