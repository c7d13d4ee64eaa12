"""The sequence batcher driven with real asyncio and real (numpy) tensor backends.

`RowMemory` keeps one running sum per *batch row* inside the backend, the way Triton's custom
sequence backend does: its answers are right only if every sequence stays in its slot's row
(direct strategy) and padding rows carry READY false. `StateAdder` keeps nothing itself: its
running sum travels as implicit state that the scheduler must carry between requests.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from daemon.backend import (
    RESCHEDULED,
    Capabilities,
    Device,
    ExecuteResult,
    InferRequest,
    InferResponse,
    InstanceContext,
    ResponseSink,
    StepResult,
    TensorBackend,
)
from daemon.core.layout import parse_model_toml
from daemon.core.scheduler import make_scheduler
from daemon.core.sequence import SequenceBatcher, client_config, runtime_config
from daemon.core.stats import ModelStats
from daemon.core.triton_config import PbtxtParser
from daemon.errors import BackendError, ConfigError, InvalidArgument, Unavailable
from daemon.model_config import ModelConfig, config_from_mapping, to_triton_json


class RowMemory(TensorBackend):
    """OUT[i] = running sum of INPUT in batch row i, reset by START, untouched when not READY."""

    name = "test-rowmemory"

    def load_sync(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        self.acc = np.zeros(max(1, config.max_batch_size), dtype=np.int64)
        # (row, corrid) of every ready row, and the number of padding rows, in order.
        self.rows: list[tuple[int, int]] = []
        self.padding = 0
        self.gate = threading.Event()
        self.gate.set()

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.gate.wait(10)
        x, start, ready = inputs["INPUT"][:, 0], inputs["START"][:, 0], inputs["READY"][:, 0]
        corrid = inputs["CORRID"][:, 0]
        out = np.zeros((len(x), 1), dtype=np.int64)
        for row in range(len(x)):
            if ready[row]:
                self.acc[row] = (0 if start[row] else self.acc[row]) + x[row]
                self.rows.append((row, int(corrid[row])))
            else:
                self.padding += 1
                assert corrid[row] == 0
            out[row, 0] = self.acc[row]
        return {"OUTPUT": out}


class StateAdder(TensorBackend):
    """ACC = STATE_IN * (1 - START) + INPUT, returned as OUTPUT and STATE_OUT; records which
    sequences (CORRID) shared each execution."""

    name = "test-stateadder"

    def load_sync(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        self.batches: list[list[int]] = []

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        keep = (~inputs["START"]).astype(np.float32)
        acc = inputs["STATE_IN"] * keep + inputs["INPUT"]
        self.batches.append([int(c) for c in inputs["CORRID"][:, 0]])
        return {"OUTPUT": acc, "STATE_OUT": acc}


ROW_CONFIG = {
    "name": "rows",
    "max_batch_size": 4,
    "input": [{"name": "INPUT", "data_type": "INT64", "dims": [1]}],
    "output": [{"name": "OUTPUT", "data_type": "INT64", "dims": [1]}],
    "sequence_batching": {
        "control_input": [
            {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}]},
            {"name": "READY", "control": [{"kind": "CONTROL_SEQUENCE_READY", "fp32_false_true": [0, 1]}]},
            {"name": "CORRID", "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "TYPE_UINT64"}]},
        ],
    },
}

STATE_CONFIG = {
    "name": "adder",
    "max_batch_size": 2,
    "input": [{"name": "INPUT", "data_type": "FP32", "dims": [2]}],
    "output": [{"name": "OUTPUT", "data_type": "FP32", "dims": [2]}],
    "sequence_batching": {
        "oldest": {"max_candidate_sequences": 3, "max_queue_delay_microseconds": 2000},
        "control_input": [
            {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START", "bool_false_true": [False, True]}]},
            {"name": "CORRID", "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "INT64"}]},
        ],
        "state": [{"input_name": "STATE_IN", "output_name": "STATE_OUT", "data_type": "FP32", "dims": [2]}],
    },
}


async def _scheduler(cls: type[TensorBackend], mapping: dict[str, Any], instances: int = 1,
                     **changes: Any) -> tuple[SequenceBatcher, list[Any]]:
    config = config_from_mapping({**mapping, **changes}, source="test")
    loaded = []
    for index in range(instances):
        backend = cls(InstanceContext(config.name, 1, index, instances))
        await backend.load(runtime_config(config), Path("."), Device("cpu"))
        loaded.append(backend)
    scheduler = make_scheduler(client_config(config), loaded, ModelStats(config.name, "1"))
    assert isinstance(scheduler, SequenceBatcher)
    await scheduler.start()
    return scheduler, loaded


def _request(value: Any, dtype: Any = np.int64, **params: Any) -> InferRequest:
    return InferRequest(inputs={"INPUT": np.asarray([value], dtype=dtype).reshape(1, -1)},
                        parameters=params)


async def _run_sequence(scheduler: SequenceBatcher, corrid: Any, values: Sequence[Any],
                        dtype: Any = np.int64) -> list[np.ndarray]:
    outputs = []
    for index, value in enumerate(values):
        response = await scheduler.submit(_request(
            value, dtype, sequence_id=corrid, sequence_start=index == 0,
            sequence_end=index == len(values) - 1,
        ))
        outputs.append(response.outputs["OUTPUT"][0])
        assert set(response.outputs) == {"OUTPUT"}  # the state output is the server's
    return outputs


# ---------------------------------------------------------------------------- config


def test_pbtxt_and_toml_give_the_same_config() -> None:
    pbtxt = """
name: "m"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000
  oldest { max_candidate_sequences: 8 preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 100 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }
  ]
  state [ { input_name: "S_IN" output_name: "S_OUT" data_type: TYPE_FP32 dims: [ -1 ]
            initial_state: { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true name: "z" } } ]
}
"""
    toml = """
name = "m"
max_batch_size = 4
input = [{ name = "INPUT", data_type = "TYPE_INT32", dims = [1] }]
output = [{ name = "OUTPUT", data_type = "INT32", dims = [1] }]
[sequence_batching]
max_sequence_idle_microseconds = 5000
oldest = { max_candidate_sequences = 8, preferred_batch_size = [2, 4], max_queue_delay_microseconds = 100 }
control_input = [
  { name = "START", control = [{ kind = "CONTROL_SEQUENCE_START", int32_false_true = [0, 1] }] },
  { name = "CORRID", control = [{ kind = "CONTROL_SEQUENCE_CORRID", data_type = "TYPE_STRING" }] },
]
[[sequence_batching.state]]
input_name = "S_IN"
output_name = "S_OUT"
data_type = "FP32"
dims = [-1]
initial_state = [{ data_type = "FP32", dims = [3], zero_data = true, name = "z" }]
"""
    from_pbtxt, warnings = PbtxtParser().parse(pbtxt, source="config.pbtxt")
    assert warnings == []
    assert from_pbtxt == parse_model_toml(toml, source="model.toml")
    sb = from_pbtxt.sequence_batching
    assert sb is not None and sb.oldest is not None and sb.oldest.max_candidate_sequences == 8
    assert sb.control_input[1].control[0].data_type == "BYTES"
    served = to_triton_json(client_config(from_pbtxt))["sequence_batching"]
    assert served["control_input"][1]["control"][0]["data_type"] == "TYPE_STRING"
    assert served["state"][0]["data_type"] == "TYPE_FP32"
    assert "direct" not in served and served["oldest"]["preferred_batch_size"] == [2, 4]
    # What a client is told it may send: no control or state tensors.
    runtime = runtime_config(from_pbtxt)
    assert [t.name for t in runtime.input] == ["INPUT", "START", "CORRID", "S_IN"]
    assert [t.name for t in runtime.output] == ["OUTPUT", "S_OUT"]
    assert client_config(runtime).input == from_pbtxt.input


def test_triton_defaults_are_shown() -> None:
    config = client_config(config_from_mapping(STATE_CONFIG, source="t"))
    assert config.sequence_batching is not None
    assert config.sequence_batching.max_sequence_idle_microseconds == 1_000_000
    assert config.sequence_batching.oldest is not None
    assert config.sequence_batching.oldest.preferred_batch_size == [2]


def test_dynamic_and_sequence_batching_exclude_each_other() -> None:
    with pytest.raises(ConfigError, match="at most one of dynamic_batching and sequence_batching"):
        config_from_mapping({**ROW_CONFIG, "dynamic_batching": {}}, source="model.toml")
    with pytest.raises(ConfigError, match="line"):  # protobuf's oneof, with the position
        PbtxtParser().parse("dynamic_batching {}\nsequence_batching {}\n", source="config.pbtxt")


def _with_controls(controls: list[dict[str, Any]], **sb: Any) -> ModelConfig:
    return config_from_mapping({**ROW_CONFIG, "sequence_batching": {"control_input": controls, **sb}},
                               source="t")


@pytest.mark.parametrize(("controls", "extra", "message"), [
    ([{"name": "S", "control": [{"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1, 2]}]}], {},
     "sequence batching control 'int32_false_true' must have exactly 2 entries for CONTROL_SEQUENCE_START for rows"),
    ([{"name": "S", "control": [{"kind": "CONTROL_SEQUENCE_START"}]}], {},
     "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' "
     "for CONTROL_SEQUENCE_START for rows"),
    ([{"name": "S", "control": [{"kind": "CONTROL_SEQUENCE_END", "int32_false_true": [0, 1],
                                 "fp32_false_true": [0, 1]}]}], {},
     "sequence batching specifies more than one from"),
    ([{"name": "C", "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "FP32"}]}], {},
     "unexpected data type for control CONTROL_SEQUENCE_CORRID for rows. Allowed data types are "
     "TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"),
    ([{"name": "A", "control": [{"kind": "CONTROL_SEQUENCE_READY", "int32_false_true": [0, 1]}]},
      {"name": "B", "control": [{"kind": "CONTROL_SEQUENCE_READY", "int32_false_true": [0, 1]}]}], {},
     "sequence batching specifies multiple CONTROL_SEQUENCE_READY tensors for rows"),
    ([{"name": "A", "control": [{"kind": "CONTROL_SEQUENCE_READY", "int32_false_true": [0, 1]}]},
      {"name": "A", "control": [{"kind": "CONTROL_SEQUENCE_END", "int32_false_true": [0, 1]}]}], {},
     "sequence batching control tensor 'A' is specified for multiple control kinds for rows"),
    ([], {"oldest": {"preferred_batch_size": [8]}},
     "sequence batching preferred batch size must be <= max batch size for rows"),
    ([], {"state": [{"input_name": "I", "output_name": "O", "data_type": "FP32", "dims": [2],
                     "initial_state": [{"data_type": "INT32", "dims": [2], "zero_data": True, "name": "z"}]}]},
     "The data type used for 'initial_state' field of state 'I' does not match the state data type."),
])
def test_bad_sequence_config_is_refused_with_tritons_message(
    controls: list[dict[str, Any]], extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        runtime_config(_with_controls(controls, **extra))
    assert message in caught.value.message


async def test_more_sequence_slots_than_the_batcher_lists_are_refused() -> None:
    # max_batch_size gives the direct strategy a slot each, listed on the event loop.
    with pytest.raises(ConfigError, match=r"model 'rows': sequence_batching gives each instance 2147483647 sequence slots \(max_batch_size\); at most 4096"):
        await _scheduler(RowMemory, ROW_CONFIG, max_batch_size=2**31 - 1)


# ---------------------------------------------------------------------------- direct


async def test_direct_keeps_each_sequence_in_its_row_and_pads_the_rest() -> None:
    scheduler, (backend,) = await _scheduler(RowMemory, ROW_CONFIG)
    rng = np.random.default_rng(3)
    # Six sequences, four slots: two wait in the backlog until a slot frees.
    sequences = {1000 + n: rng.integers(-50, 50, size=int(rng.integers(3, 9))).tolist() for n in range(6)}
    try:
        results = await asyncio.gather(*(_run_sequence(scheduler, c, v) for c, v in sequences.items()))
    finally:
        await scheduler.stop(5)
    for (corrid, values), got in zip(sequences.items(), results, strict=True):
        np.testing.assert_array_equal(np.concatenate(got), np.cumsum(values), err_msg=str(corrid))
    rows_of: dict[int, set[int]] = {}
    for row, corrid in backend.rows:
        rows_of.setdefault(corrid, set()).add(row)
    assert set(rows_of) == set(sequences)
    assert all(len(rows) == 1 for rows in rows_of.values()), rows_of  # one slot for life
    assert scheduler.pending() == 0


async def test_direct_pads_an_idle_slot_with_ready_false() -> None:
    scheduler, (backend,) = await _scheduler(RowMemory, ROW_CONFIG)
    try:
        await scheduler.submit(_request(5, sequence_id=1, sequence_start=True))  # slot 0
        await scheduler.submit(_request(7, sequence_id=2, sequence_start=True))  # slot 1
        backend.padding = 0
        # Only sequence 2 has work: slot 0 is padded, and sequence 1's sum is untouched.
        response = await scheduler.submit(_request(1, sequence_id=2))
        assert response.outputs["OUTPUT"][0, 0] == 8 and backend.padding == 1
        response = await scheduler.submit(_request(1, sequence_id=1, sequence_end=True))
        assert response.outputs["OUTPUT"][0, 0] == 6
    finally:
        await scheduler.stop(5)


# ---------------------------------------------------------------------------- oldest + state


async def test_oldest_batches_sequences_and_carries_implicit_state() -> None:
    scheduler, (backend,) = await _scheduler(StateAdder, STATE_CONFIG)
    rng = np.random.default_rng(11)
    sequences = {n: rng.integers(-9, 9, size=(int(rng.integers(2, 7)), 2)).astype(np.float32)
                 for n in range(1, 8)}
    try:
        results = await asyncio.gather(
            *(_run_sequence(scheduler, c, list(v), np.float32) for c, v in sequences.items())
        )
    finally:
        await scheduler.stop(5)
    for (corrid, values), got in zip(sequences.items(), results, strict=True):
        np.testing.assert_array_equal(np.stack(got), np.cumsum(values, axis=0), err_msg=str(corrid))
    assert max(len(b) for b in backend.batches) == 2  # sequences shared executions
    assert all(len(set(b)) == len(b) for b in backend.batches)  # never twice in one batch


async def test_start_on_an_active_id_restarts_the_sequence() -> None:
    scheduler, _ = await _scheduler(StateAdder, STATE_CONFIG)
    try:
        await scheduler.submit(_request([1, 1], np.float32, sequence_id=9, sequence_start=True))
        await scheduler.submit(_request([1, 1], np.float32, sequence_id=9))
        # Triton: a warning, the old sequence ends early, and the state starts over.
        again = await scheduler.submit(_request([5, 5], np.float32, sequence_id=9, sequence_start=True))
        np.testing.assert_array_equal(again.outputs["OUTPUT"], [[5, 5]])
        more = await scheduler.submit(_request([1, 2], np.float32, sequence_id=9, sequence_end=True))
        np.testing.assert_array_equal(more.outputs["OUTPUT"], [[6, 7]])
    finally:
        await scheduler.stop(5)


async def test_string_ids_and_corrid_types() -> None:
    scheduler, _ = await _scheduler(StateAdder, STATE_CONFIG)
    try:
        with pytest.raises(InvalidArgument, match="takes the correlation ID as INT64"):
            await scheduler.submit(_request([1, 1], np.float32, sequence_id="abc", sequence_start=True))
        with pytest.raises(InvalidArgument, match="does not fit the INT64"):
            await scheduler.submit(_request([1, 1], np.float32, sequence_id=2**63, sequence_start=True))
    finally:
        await scheduler.stop(5)


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("params", "message"), [
    ({"sequence_id": 5}, "inference request for sequence 5 to model 'rows' must specify the START "
                         "flag on the first request of the sequence"),
    ({"sequence_id": "nope"}, "model 'rows' takes the correlation ID as UINT64"),
    ({}, "inference request to model 'rows' must specify a non-zero or non-empty correlation ID"),
    ({"sequence_id": 0, "sequence_start": True}, "must specify a non-zero or non-empty correlation ID"),
    ({"sequence_id": -1}, "Unable to parse 'sequence_id'"),
    ({"sequence_id": 1.5}, "Unable to parse 'sequence_id'"),
    ({"sequence_id": 1, "sequence_start": 1}, "Unable to parse 'sequence_start'"),
    ({"sequence_id": 1, "sequence_end": "yes"}, "Unable to parse 'sequence_end'"),
])
async def test_bad_sequence_requests(params: dict[str, Any], message: str) -> None:
    scheduler, _ = await _scheduler(RowMemory, ROW_CONFIG)
    try:
        with pytest.raises(InvalidArgument) as caught:
            await scheduler.submit(_request(1, **params))
        assert message in caught.value.message
        two_rows = InferRequest(inputs={"INPUT": np.ones((2, 1), np.int64)},
                                parameters={"sequence_id": 3, "sequence_start": True})
        with pytest.raises(InvalidArgument, match="must specify batch-size 1 due to requirements of sequence batcher"):
            await scheduler.submit(two_rows)
    finally:
        await scheduler.stop(5)


async def test_the_backend_gets_correlation_id_and_flags_not_parameters() -> None:
    seen: list[dict[str, Any]] = []

    class Recorder(RowMemory):
        async def execute(self, batch: Sequence[InferRequest]) -> list[Any]:
            seen.extend({**r.parameters, "corrid": r.correlation_id, "flags": r.flags} for r in batch)
            return await super().execute(batch)

    scheduler, _ = await _scheduler(Recorder, ROW_CONFIG)
    try:
        await scheduler.submit(_request(1, sequence_id=4, sequence_start=True, custom="x"))
        await scheduler.submit(_request(1, sequence_id=4))
        await scheduler.submit(_request(1, sequence_id=4, sequence_end=True))
    finally:
        await scheduler.stop(5)
    # Triton's correlation ID and request flags (START = 1, END = 2) instead.
    assert seen == [{"custom": "x", "corrid": 4, "flags": 1}, {"corrid": 4, "flags": 0},
                    {"corrid": 4, "flags": 2}]


# ---------------------------------------------------------------------------- idle, backlog


async def test_idle_sequence_is_released_and_its_slot_reused() -> None:
    config = {**ROW_CONFIG, "max_batch_size": 1,
              "sequence_batching": {**ROW_CONFIG["sequence_batching"], "max_sequence_idle_microseconds": 50_000}}
    scheduler, _ = await _scheduler(RowMemory, config)
    try:
        await scheduler.submit(_request(1, sequence_id=1, sequence_start=True))
        # The only slot is taken: sequence 2 waits in the backlog until 1 is released as idle.
        second = await asyncio.wait_for(
            scheduler.submit(_request(2, sequence_id=2, sequence_start=True)), timeout=10
        )
        assert second.outputs["OUTPUT"][0, 0] == 2
        with pytest.raises(InvalidArgument, match="sequence 1 to model 'rows' must specify the START flag"):
            await scheduler.submit(_request(1, sequence_id=1))
    finally:
        await scheduler.stop(5)


async def test_backlog_request_timeout() -> None:
    config = {**ROW_CONFIG, "max_batch_size": 1}
    scheduler, _ = await _scheduler(RowMemory, config)
    try:
        await scheduler.submit(_request(1, sequence_id=1, sequence_start=True))
        waiting = InferRequest(inputs={"INPUT": np.ones((1, 1), np.int64)}, timeout_us=20_000,
                               parameters={"sequence_id": 2, "sequence_start": True})
        with pytest.raises(Unavailable, match="timeout of the corresponding sequence has been expired"):
            await asyncio.wait_for(scheduler.submit(waiting), timeout=10)
        assert scheduler.pending() == 0
        done = await scheduler.submit(_request(1, sequence_id=1, sequence_end=True))
        assert done.outputs["OUTPUT"][0, 0] == 2
    finally:
        await scheduler.stop(5)


async def test_cancelled_request_ends_its_sequence() -> None:
    scheduler, (backend,) = await _scheduler(RowMemory, ROW_CONFIG)
    try:
        await scheduler.submit(_request(1, sequence_id=1, sequence_start=True))
        backend.gate.clear()  # hold the instance busy
        running = asyncio.create_task(scheduler.submit(_request(1, sequence_id=1)))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(scheduler.submit(_request(1, sequence_id=1)))
        await asyncio.sleep(0)
        queued.cancel()
        backend.gate.set()
        assert (await running).outputs["OUTPUT"][0, 0] == 2
        with pytest.raises(asyncio.CancelledError):
            await queued
        with pytest.raises(InvalidArgument, match="START flag"):
            await scheduler.submit(_request(1, sequence_id=1))
        assert scheduler.pending() == 0
    finally:
        backend.gate.set()
        await scheduler.stop(5)


async def test_stop_refuses_new_sequences_and_drains() -> None:
    scheduler, (backend,) = await _scheduler(RowMemory, ROW_CONFIG)
    await scheduler.submit(_request(1, sequence_id=1, sequence_start=True))
    backend.gate.clear()
    running = asyncio.create_task(scheduler.submit(_request(2, sequence_id=1)))
    await asyncio.sleep(0.05)
    stopping = asyncio.create_task(scheduler.stop(10))
    await asyncio.sleep(0.05)
    with pytest.raises(Unavailable, match="stopped accepting new inference requests"):
        await scheduler.submit(_request(1, sequence_id=2, sequence_start=True))
    backend.gate.set()
    assert (await running).outputs["OUTPUT"][0, 0] == 3
    await stopping


async def test_direct_waits_for_minimum_slot_utilization() -> None:
    config = {**ROW_CONFIG, "sequence_batching": {
        **ROW_CONFIG["sequence_batching"],
        "direct": {"max_queue_delay_microseconds": 30_000_000, "minimum_slot_utilization": 0.5},
    }}
    scheduler, _ = await _scheduler(RowMemory, config)
    try:
        first = asyncio.create_task(scheduler.submit(_request(3, sequence_id=1, sequence_start=True)))
        await asyncio.sleep(0.2)
        assert not first.done()  # 1 of 4 slots ready: below 0.5, and the delay is 30 s
        second = await asyncio.wait_for(
            scheduler.submit(_request(4, sequence_id=2, sequence_start=True)), timeout=10
        )
        assert second.outputs["OUTPUT"][0, 0] == 4
        assert (await first).outputs["OUTPUT"][0, 0] == 3
    finally:
        await scheduler.stop(5)


class NoBatchState(TensorBackend):
    """max_batch_size 0: no batch dimension anywhere, controls of shape [1]."""

    name = "test-nobatch"

    def load_sync(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        assert config.max_batch_size == 0

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert inputs["START"].shape == (1,) and inputs["STATE_IN"].shape == (3,)
        acc = inputs["STATE_IN"] * (1 - inputs["START"][0]) + inputs["INPUT"]
        return {"OUTPUT": acc, "STATE_OUT": acc}


async def test_models_without_a_batch_dimension() -> None:
    config = {
        "name": "flat", "max_batch_size": 0,
        "input": [{"name": "INPUT", "data_type": "FP32", "dims": [3]}],
        "output": [{"name": "OUTPUT", "data_type": "FP32", "dims": [3]}],
        "sequence_batching": {
            "control_input": [{"name": "START", "control": [
                {"kind": "CONTROL_SEQUENCE_START", "fp32_false_true": [0, 1]}]}],
            "state": [{"input_name": "STATE_IN", "output_name": "STATE_OUT", "data_type": "FP32", "dims": [3]}],
        },
    }
    # Two instances, one slot each: the third sequence waits for a free one.
    scheduler, _ = await _scheduler(NoBatchState, config, instances=2)
    rng = np.random.default_rng(5)
    plans = {n: rng.integers(-5, 5, size=(4, 3)).astype(np.float32) for n in (1, 2, 3)}

    async def run(corrid: int, values: np.ndarray) -> np.ndarray:
        out = []
        for index, value in enumerate(values):
            response = await scheduler.submit(InferRequest(
                inputs={"INPUT": value}, parameters={"sequence_id": corrid, "sequence_start": index == 0,
                                                     "sequence_end": index == len(values) - 1}))
            out.append(response.outputs["OUTPUT"])
        return np.stack(out)

    try:
        results = await asyncio.gather(*(run(c, v) for c, v in plans.items()))
    finally:
        await scheduler.stop(5)
    for values, got in zip(plans.values(), results, strict=True):
        np.testing.assert_array_equal(got, np.cumsum(values, axis=0))


async def test_correlation_id_and_flags_set_by_the_transport_are_used() -> None:
    scheduler, _ = await _scheduler(RowMemory, ROW_CONFIG)
    try:
        first = InferRequest(inputs={"INPUT": np.full((1, 1), 4, np.int64)}, correlation_id=12, flags=1)
        assert (await scheduler.submit(first)).outputs["OUTPUT"][0, 0] == 4
        last = InferRequest(inputs={"INPUT": np.full((1, 1), 3, np.int64)}, correlation_id=12, flags=2)
        assert (await scheduler.submit(last)).outputs["OUTPUT"][0, 0] == 7
        with pytest.raises(InvalidArgument, match="must specify the START flag"):
            await scheduler.submit(InferRequest(inputs={"INPUT": np.ones((1, 1), np.int64)}, correlation_id=12))
    finally:
        await scheduler.stop(5)


# ---------------------------------------------------------------------------- iterative sequences


class Countdown(TensorBackend):
    """Runs each request INPUT times, asking to run it again (RESCHEDULED) until then; OUTPUT
    is the runs left. A request with a sink gets a response from every run, the last final
    (none with parameter `defer`: as a model that would send it later from its own thread).
    Records (correlation ID, flags) of every run."""

    name = "test-countdown"
    capabilities = Capabilities(decoupled=True, rescheduling=True)

    def load_sync(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        self.runs: list[tuple[Any, int]] = []
        self.left: dict[Any, int] = {}
        self.gate = asyncio.Event()
        self.gate.set()

    async def execute(self, batch: Sequence[InferRequest]) -> list[ExecuteResult]:
        return await self.execute_step(batch, [None] * len(batch))  # type: ignore[return-value]

    async def execute_step(self, batch: Sequence[InferRequest], sinks: Sequence[ResponseSink | None]) -> list[StepResult]:
        await self.gate.wait()
        results: list[StepResult] = []
        for request, sink in zip(batch, sinks, strict=True):
            self.runs.append((request.correlation_id, request.flags))
            if request.flags & 1:  # START: the runs asked for
                self.left[request.correlation_id] = int(request.inputs["INPUT"].reshape(-1)[0])
            self.left[request.correlation_id] -= 1
            left = self.left[request.correlation_id]
            response = InferResponse({"OUTPUT": np.array([left], np.int64)})
            if sink is not None and not (left <= 0 and request.parameters.get("defer")):
                sink.send(response, left <= 0)
            results.append(RESCHEDULED if left > 0 else None if sink is not None else response)
        return results


COUNTDOWN_CONFIG = {
    "name": "countdown",
    "max_batch_size": 0,
    "input": [{"name": "INPUT", "data_type": "INT64", "dims": [1]}],
    "output": [{"name": "OUTPUT", "data_type": "INT64", "dims": [1]}],
    "sequence_batching": {"iterative_sequence": True},
}


def _runs(count: int, **params: Any) -> InferRequest:
    return InferRequest(inputs={"INPUT": np.array([count], np.int64)}, parameters=params)


async def test_a_rescheduled_request_runs_again_in_its_own_sequence() -> None:
    scheduler, (backend,) = await _scheduler(Countdown, COUNTDOWN_CONFIG)
    try:
        assert (await scheduler.submit(_runs(3))).outputs["OUTPUT"].tolist() == [0]
        assert (await scheduler.submit(_runs(2))).outputs["OUTPUT"].tolist() == [0]
        assert backend.runs == [(1, 1), (1, 0), (1, 0), (2, 1), (2, 0)]
        assert scheduler.pending() == 0
    finally:
        await scheduler.stop(5)


async def test_an_abandoned_iterative_stream_runs_no_more_and_frees_its_slot() -> None:
    scheduler, (backend,) = await _scheduler(Countdown, COUNTDOWN_CONFIG, model_transaction_policy={"decoupled": True})
    try:
        stream = scheduler.submit_stream(_runs(10**9))
        first = await stream.__anext__()
        assert isinstance(first, InferResponse)
        backend.gate.clear()
        await asyncio.sleep(0.02)  # its next run waits at the gate
        await stream.aclose()  # the client went away
        backend.gate.set()  # that run ends, and asks to run again
        await asyncio.sleep(0.05)
        ran = len(backend.runs)
        await asyncio.sleep(0.05)
        assert len(backend.runs) == ran and scheduler.pending() == 0
        # The one slot is free again.
        results = [r async for r in scheduler.submit_stream(_runs(2))]
        assert [r.outputs["OUTPUT"].tolist() for r in results if isinstance(r, InferResponse)] == [[1], [0]]
    finally:
        await scheduler.stop(5)


async def test_stop_fails_a_request_still_being_rescheduled() -> None:
    scheduler, _ = await _scheduler(Countdown, COUNTDOWN_CONFIG)
    endless = asyncio.create_task(scheduler.submit(_runs(10**9)))
    await asyncio.sleep(0.05)
    await scheduler.stop(0.1)
    with pytest.raises(Unavailable, match="was unloaded before the request finished"):
        await endless


async def test_a_reschedule_outside_iterative_sequences_is_an_error() -> None:
    config = {**COUNTDOWN_CONFIG, "sequence_batching": {}}
    scheduler, _ = await _scheduler(Countdown, config)
    try:
        with pytest.raises(BackendError, match="returned Rescheduled instead of a response"):
            await scheduler.submit(_runs(2, sequence_id=1, sequence_start=True))
    finally:
        await scheduler.stop(5)


async def test_stop_waits_for_a_released_stream_then_ends_it() -> None:
    scheduler, _ = await _scheduler(Countdown, COUNTDOWN_CONFIG, model_transaction_policy={"decoupled": True})
    stream = scheduler.submit_stream(_runs(2, defer=True))
    first = await stream.__anext__()
    assert isinstance(first, InferResponse) and first.outputs["OUTPUT"].tolist() == [1]
    stopping = asyncio.create_task(scheduler.stop(0.2))
    await asyncio.sleep(0.1)
    assert not stopping.done()  # the drain waits for the model's final flag
    last = await stream.__anext__()
    assert isinstance(last, Unavailable) and "was unloaded before the request finished" in last.message
    await stopping


async def test_requests_queued_behind_an_iterative_request_under_its_id() -> None:
    """The rescheduled request runs until it is released; then a START queued behind it goes on
    in the slot, and a request without START finds the sequence over."""
    scheduler, (backend,) = await _scheduler(Countdown, COUNTDOWN_CONFIG)
    try:
        for second, fails in (({"sequence_start": True}, False), ({}, True)):
            backend.gate.clear()
            first = asyncio.create_task(scheduler.submit(_runs(3, sequence_id=9, sequence_start=True)))
            await asyncio.sleep(0.02)
            behind = asyncio.create_task(scheduler.submit(_runs(1, sequence_id=9, **second)))
            await asyncio.sleep(0.02)
            backend.runs.clear()
            backend.gate.set()
            assert (await first).outputs["OUTPUT"].tolist() == [0]
            if fails:
                with pytest.raises(InvalidArgument, match="must specify the START flag"):
                    await behind
                assert backend.runs == [(9, 1), (9, 0), (9, 0)]
            else:
                assert (await behind).outputs["OUTPUT"].tolist() == [0]
                assert backend.runs == [(9, 1), (9, 0), (9, 0), (9, 1)]
            assert scheduler.pending() == 0
    finally:
        backend.gate.set()
        await scheduler.stop(5)
