"""Stateful models over a real socket: Triton's sequence examples with the real tritonclient,
many interleaved sequences from concurrent clients checked against numpy, implicit state, idle
release, and Triton's error texts."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from sequence_models import (
    simple_sequence_expected,
    simple_sequence_onnx,
    write_accumulator,
    write_accumulator_toml,
    write_py_accumulator,
    write_py_bls_sequence,
    write_py_counter,
    write_py_iterative,
    write_simple_dyna_sequence,
    write_simple_sequence,
)

from support import DaemonProcess, start_daemon_process, wait_until

DYNA_STRATEGY = ("oldest { max_candidate_sequences: 1024 preferred_batch_size: [ 4 ] "
                 "max_queue_delay_microseconds: 200000 }")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    base = tmp_path_factory.mktemp("sequence")
    repo = base / "repo"
    write_simple_sequence(repo)
    write_simple_dyna_sequence(repo)
    write_simple_dyna_sequence(repo, "dyna_batched", strategy=DYNA_STRATEGY, instances=1)
    write_accumulator(repo)
    write_accumulator_toml(repo)
    try:
        import openvino  # noqa: F401

        write_accumulator(repo, "accumulator_openvino", backend="openvino", instances=1)
    except ImportError:
        pass
    write_py_accumulator(repo)
    write_py_counter(repo)
    write_py_bls_sequence(repo)
    write_py_iterative(repo, "py_iterative", max_batch_size=4)
    write_py_iterative(repo, "py_iterative_decoupled", decoupled=True)
    write_py_iterative(repo, "py_iterative_not_none", mode="not_none")
    for scheduling in ("", "dynamic", "sequence"):
        write_py_iterative(repo, f"py_reschedule_{scheduling or 'plain'}", scheduling=scheduling,
                           max_batch_size=4 if scheduling == "dynamic" else 0)
    write_py_iterative(repo, "py_reschedule_decoupled", decoupled=True, scheduling="")
    write_py_iterative(repo, "py_decoupled_sequence", decoupled=True, scheduling="sequence")
    # One slot, released after 300 ms idle.
    write_accumulator(repo, "idle_acc", max_batch_size=1, instances=1, idle_us=300_000)
    process = start_daemon_process(base, "--model-repository", str(repo), http=True)
    yield process
    process.stop()


def _body(value: int, **params: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [value]}],
            "parameters": params}


def _infer(daemon: DaemonProcess, model: str, value: int, **params: Any) -> tuple[int, Any]:
    reply = daemon.post_json(f"/v2/models/{model}/infer", _body(value, **params))
    return reply.status, reply.json()


def _run(daemon: DaemonProcess, model: str, corrid: int | str, values: list[int]) -> list[int]:
    out = []
    for index, value in enumerate(values):
        status, body = _infer(daemon, model, value, sequence_id=corrid, sequence_start=index == 0,
                              sequence_end=index == len(values) - 1)
        assert status == 200, body
        assert [o["name"] for o in body["outputs"]] == ["OUTPUT"]
        out.append(body["outputs"][0]["data"][0])
    return out


# ---------------------------------------------------------------------------- tritonclient


def test_tritonclient_sequence_examples(daemon: DaemonProcess) -> None:
    """Triton's simple_http_sequence_sync_infer_client.py, against both example models."""
    httpclient = pytest.importorskip("tritonclient.http")
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{daemon.http_port}")
    values = [11, 7, 5, 3, 2, 0, 1]

    def send(model: str, corrid: int | str, seq: list[int]) -> list[int]:
        results = []
        for count, value in enumerate(seq, start=1):
            tensor = httpclient.InferInput("INPUT", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.full((1, 1), value, dtype=np.int32))
            result = client.infer(model, [tensor], outputs=[httpclient.InferRequestedOutput("OUTPUT")],
                                  sequence_id=corrid, sequence_start=count == 1,
                                  sequence_end=count == len(seq))
            results.append(int(result.as_numpy("OUTPUT")[0][0]))
        return results

    try:
        for dyna in (False, True):
            model = "simple_dyna_sequence" if dyna else "simple_sequence"
            seq0 = send(model, 1000, [0, *values])
            seq1 = send(model, 1001, [100, *(-v for v in values)])
            assert seq0 == simple_sequence_expected([0, *values], 1000, dyna=dyna)
            assert seq1 == simple_sequence_expected([100, *(-v for v in values)], 1001, dyna=dyna)
        # A string sequence ID (a model without a CORRID control takes any).
        seq2 = send("simple_sequence", str(uuid.uuid4()), [20, *(-v for v in values)])
        assert seq2 == [21, *(-v for v in values)]
        from tritonclient.utils import InferenceServerException

        tensor = httpclient.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.zeros((1, 1), dtype=np.int32))
        with pytest.raises(InferenceServerException, match="must specify the START flag"):
            client.infer("simple_sequence", [tensor], sequence_id=4242)
    finally:
        client.close()


# ---------------------------------------------------------------------------- concurrency


@pytest.mark.parametrize(
    "model", ["accumulator", "accumulator_toml", "py_accumulator", "dyna_batched", "accumulator_openvino"]
)
def test_interleaved_sequences_from_concurrent_clients(daemon: DaemonProcess, model: str) -> None:
    if model == "accumulator_openvino":
        pytest.importorskip("openvino")
    rng = np.random.default_rng(abs(hash(model)) % 2**32)
    clients = 12
    plans = [[rng.integers(-100, 100, size=int(rng.integers(3, 10))).tolist() for _ in range(2)]
             for _ in range(clients)]
    before = daemon.request("GET", f"/v2/models/{model}/stats").json()["model_stats"][0]

    def client(index: int) -> list[tuple[int | str, list[int], list[int]]]:
        done = []
        for turn, values in enumerate(plans[index]):
            corrid: int | str = 5000 + index * 10 + turn
            if model == "py_accumulator":
                corrid = f"stream-{index}-{turn}"
            done.append((corrid, values, _run(daemon, model, corrid, values)))
        return done

    with ThreadPoolExecutor(clients) as pool:
        results = [r for chunk in pool.map(client, range(clients)) for r in chunk]
    for corrid, values, got in results:
        if model == "dyna_batched":
            assert got == simple_sequence_expected(values, int(corrid), dyna=True), corrid
        else:
            assert got == np.cumsum(values).tolist(), corrid
    after = daemon.request("GET", f"/v2/models/{model}/stats").json()["model_stats"][0]
    requests = sum(len(v) for plan in plans for v in plan)
    assert after["inference_count"] - before["inference_count"] == requests
    if model == "dyna_batched":
        # Preferred batch 4, 200 ms window, 12 clients: sequences shared executions.
        assert after["execution_count"] - before["execution_count"] < requests


def test_python_model_sees_correlation_id_and_flags(daemon: DaemonProcess) -> None:
    """Triton's sequence_py pattern: the model keys its state on request.correlation_id() and
    request.flags(); more sequences (6) than candidate slots (4), from concurrent clients."""
    def client(index: int) -> list[int]:
        corrid: int | str = 700 + index if index % 2 else f"text-{index}"
        return _run(daemon, "py_counter", corrid, [0] * (3 + index))

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(client, range(6)))
    for index, got in enumerate(results):
        assert got == list(range(1, 4 + index))


@pytest.mark.parametrize(("model", "corrid"), [("accumulator", 9001), ("py_counter", "bls-text-id")])
def test_a_python_model_drives_a_sequence_through_bls(daemon: DaemonProcess, model: str, corrid: int | str) -> None:
    """BLS requests carry their correlation ID and START/END flags to the sequence batcher, as
    in Triton: the same answers as a client running the sequence itself."""
    values = [3, 1, 4, 1, 5]
    reply = daemon.post_json("/v2/models/py_bls_sequence/infer", {
        "inputs": [{"name": "INPUT", "shape": [5], "datatype": "INT32", "data": values}],
        "parameters": {"model": model, "corrid": corrid},
    })
    assert reply.status == 200, reply.body
    direct = _run(daemon, model, f"direct-{corrid}" if isinstance(corrid, str) else corrid + 1, values)
    assert reply.json()["outputs"][0]["data"] == direct
    reply = daemon.post_json("/v2/models/py_bls_sequence/infer", {
        "inputs": [{"name": "INPUT", "shape": [1], "datatype": "INT32", "data": [1]}],
        "parameters": {"model": model, "corrid": -1},
    })
    assert reply.status == 500
    assert "correlation_id must be an unsigned 64-bit integer or a string, got -1" in reply.json()["error"]


# ---------------------------------------------------------------------------- lifecycle, errors


def test_idle_sequence_is_released(daemon: DaemonProcess) -> None:
    assert _infer(daemon, "idle_acc", 3, sequence_id=1, sequence_start=True)[0] == 200
    # The only slot is held by sequence 1; sequence 2 waits in the backlog until 1 has been
    # idle for 300 ms and is released.
    status, body = _infer(daemon, "idle_acc", 4, sequence_id=2, sequence_start=True)
    assert (status, body["outputs"][0]["data"]) == (200, [4])
    status, body = _infer(daemon, "idle_acc", 1, sequence_id=1)
    assert status == 400
    assert body["error"] == ("inference request for sequence 1 to model 'idle_acc' must specify the "
                             "START flag on the first request of the sequence")
    assert _infer(daemon, "idle_acc", 1, sequence_id=2, sequence_end=True)[1]["outputs"][0]["data"] == [5]


def test_bad_requests_get_tritons_errors(daemon: DaemonProcess) -> None:
    status, body = _infer(daemon, "accumulator", 1)
    assert (status, body["error"]) == (
        400, "inference request to model 'accumulator' must specify a non-zero or non-empty correlation ID")
    status, body = _infer(daemon, "accumulator", 1, sequence_id=77, sequence_start="yes")
    assert status == 400 and body["error"].startswith("Unable to parse 'sequence_start'")
    # Control and state tensors are the server's to send.
    for name in ("START", "STATE_IN"):
        payload = _body(1, sequence_id=78, sequence_start=True)
        payload["inputs"].append({"name": name, "shape": [1, 1], "datatype": "INT32", "data": [1]})
        reply = daemon.post_json("/v2/models/accumulator/infer", payload)
        assert reply.status == 400 and f"unexpected inference input '{name}'" in reply.json()["error"]
    rows2 = {"inputs": [{"name": "INPUT", "shape": [2, 1], "datatype": "INT32", "data": [1, 2]}],
             "parameters": {"sequence_id": 79, "sequence_start": True}}
    reply = daemon.post_json("/v2/models/accumulator/infer", rows2)
    assert reply.status == 400
    assert reply.json()["error"] == ("inference request to model 'accumulator' must specify batch-size 1 "
                                     "due to requirements of sequence batcher")
    status, body = _infer(daemon, "simple_dyna_sequence", 1, sequence_id="text", sequence_start=True)
    assert status == 400 and "takes the correlation ID as UINT64" in body["error"]


def test_bad_control_config_fails_the_load_with_tritons_message(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    bad = write_simple_sequence(repo, "bad_corrid")
    (bad / "config.pbtxt").write_text((bad / "config.pbtxt").read_text().replace(
        "  control_input [\n",
        '  control_input [\n    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID '
        "data_type: TYPE_FP32 } ] },\n",
    ))
    process = start_daemon_process(tmp_path, "--model-repository", str(repo), wait=False)
    try:
        def failed() -> bool:
            index = process.post_json("/v2/repository/index", {}).json()
            return index[0]["state"] == "UNAVAILABLE"

        wait_until(failed, timeout=60)
        row = process.post_json("/v2/repository/index", {}).json()[0]
        assert ("unexpected data type for control CONTROL_SEQUENCE_CORRID for bad_corrid. Allowed data "
                "types are TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING") in row["reason"]
    finally:
        process.stop()


def test_config_and_metadata_as_triton_serves_them(daemon: DaemonProcess) -> None:
    config = daemon.request("GET", "/v2/models/simple_dyna_sequence/config").json()
    sb = config["sequence_batching"]
    assert [c["name"] for c in sb["control_input"]] == ["START", "READY", "END", "CORRID"]
    assert sb["control_input"][3]["control"][0] == {
        "kind": "CONTROL_SEQUENCE_CORRID", "int32_false_true": [], "fp32_false_true": [],
        "bool_false_true": [], "data_type": "TYPE_UINT64"}
    assert sb["oldest"]["max_candidate_sequences"] == 1024
    assert [t["name"] for t in config["input"]] == ["INPUT"]
    meta = daemon.request("GET", "/v2/models/accumulator").json()
    assert [t["name"] for t in meta["inputs"]] == ["INPUT"]
    assert [t["name"] for t in meta["outputs"]] == ["OUTPUT"]
    state = daemon.request("GET", "/v2/models/accumulator/config").json()["sequence_batching"]["state"]
    extensions = daemon.request("GET", "/v2").json()["extensions"]
    assert "sequence" in extensions and "sequence(string_id)" in extensions
    assert state[0]["input_name"] == "STATE_IN" and state[0]["data_type"] == "TYPE_INT32"


def test_graph_inputs_are_autocompleted_without_the_controls(tmp_path: Path) -> None:
    """A config.pbtxt that lists no inputs: the backend reads them from the graph, and the
    control inputs stay out of what clients are asked for."""
    repo = tmp_path / "repo"
    folder = repo / "auto_seq"
    simple_sequence_onnx(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(
        'backend: "onnxruntime"\nmax_batch_size: 8\nsequence_batching {\n  control_input [\n'
        '    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },\n'
        '    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }\n'
        "  ]\n}\n"
    )
    process = start_daemon_process(tmp_path, "--model-repository", str(repo))
    try:
        meta = process.request("GET", "/v2/models/auto_seq").json()
        assert [t["name"] for t in meta["inputs"]] == ["INPUT"]
        assert _run(process, "auto_seq", 1, [4, 5, 6]) == [5, 5, 6]
    finally:
        process.stop()


def test_concurrent_starts_on_many_ids_never_mix(daemon: DaemonProcess) -> None:
    """Every request of a sequence goes to the same stream: two threads per ID is a misuse
    we only need to survive, but one thread per ID over many IDs must be exact."""
    errors: list[str] = []
    lock = threading.Lock()

    def one(corrid: int) -> None:
        got = _run(daemon, "accumulator", corrid, [corrid % 7, 1, 2])
        if got != np.cumsum([corrid % 7, 1, 2]).tolist():
            with lock:
                errors.append(f"{corrid}: {got}")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(9000, 9040)))
    assert errors == []


# ---------------------------------------------------------------------------- iterative sequences


def _runs(daemon: DaemonProcess, model: str, runs: int, *, batched: bool = False, **params: Any) -> Any:
    body = {"inputs": [{"name": "INPUT", "shape": [1, 1] if batched else [1], "datatype": "INT32", "data": [runs]}],
            "parameters": params}
    return daemon.post_json(f"/v2/models/{model}/infer", body)


def _log(body: dict[str, Any]) -> list[dict[str, Any]]:
    outputs = {o["name"]: o["data"] for o in body["outputs"]}
    assert outputs["OUTPUT"] == [0]
    return json.loads(outputs["LOG"][0])


def _events(reply: Any) -> list[dict[str, Any]]:
    assert reply.headers["content-type"].startswith("text/event-stream"), reply.body
    return [json.loads(c[len("data: "):]) for c in reply.body.decode().split("\n\n") if c.strip()]


def _saw(corrid: int, start: bool, batch: int = 1) -> dict[str, Any]:
    """One run's log entry of a request in an iterative sequence (no END: its release ends it)."""
    return {"corrid": corrid, "flags": int(start), "batch": batch, "START": [int(start)], "END": [0],
            "READY": [1], "CORRID": [corrid]}


def test_iterative_sequence_runs_a_rescheduled_request_again(daemon: DaemonProcess) -> None:
    """Triton 2.51's answers (tests/compat checks them side by side): a request without an ID
    gets its own sequence, IDs counted from 1 per model, START only on its first run."""
    first = _runs(daemon, "py_iterative", 3, batched=True)
    assert first.status == 200, first.body
    assert _log(first.json()) == [_saw(1, True), _saw(1, False), _saw(1, False)]
    second = _runs(daemon, "py_iterative", 1, batched=True)
    assert _log(second.json()) == [_saw(2, True)]
    # A client's own ID: its sequence ends when the model releases the request.
    own = _runs(daemon, "py_iterative", 2, batched=True, sequence_id=77, sequence_start=True)
    assert _log(own.json()) == [_saw(77, True), _saw(77, False)]
    after = _runs(daemon, "py_iterative", 1, batched=True, sequence_id=77)
    assert after.status == 400 and after.json()["error"] == (
        "inference request for sequence 77 to model 'py_iterative' must specify the START flag on the "
        "first request of the sequence")
    # START and END on a request the model reschedules: it runs to its end (Triton 2.51 never
    # answers it) and the sequence is over.
    both = _runs(daemon, "py_iterative", 2, batched=True, sequence_id=78, sequence_start=True, sequence_end=True)
    assert both.status == 200, both.body
    assert [e["END"] for e in _log(both.json())] == [[1], [0]]
    assert _runs(daemon, "py_iterative", 1, batched=True, sequence_id=78).status == 400


def test_iterative_requests_share_batches_and_each_gets_its_answer(daemon: DaemonProcess) -> None:
    counts = [1, 5, 2, 4, 3, 6, 2, 5]
    with ThreadPoolExecutor(len(counts)) as pool:
        replies = list(pool.map(lambda n: _runs(daemon, "py_iterative", n, batched=True), counts))
    ids = set()
    for runs, reply in zip(counts, replies, strict=True):
        assert reply.status == 200, reply.body
        log = _log(reply.json())
        assert len(log) == runs
        assert [e["flags"] for e in log] == [1] + [0] * (runs - 1)
        assert len({e["corrid"] for e in log}) == 1 and log[0]["CORRID"] == [log[0]["corrid"]]
        ids.add(log[0]["corrid"])
    assert len(ids) == len(counts)


def test_a_decoupled_iterative_model_streams_every_run(daemon: DaemonProcess) -> None:
    reply = daemon.post_json("/v2/models/py_iterative_decoupled/generate_stream", {"INPUT": 3})
    assert reply.status == 200
    got = _events(reply)
    assert [e["OUTPUT"] for e in got] == [2, 1, 0]
    assert json.loads(got[-1]["LOG"]) == [_saw(1, True), _saw(1, False), _saw(1, False)]
    # /infer carries one response: a request that gets one is served, more are refused.
    assert _runs(daemon, "py_iterative_decoupled", 1).status == 200
    refused = _runs(daemon, "py_iterative_decoupled", 2)
    assert refused.status == 501 and refused.json()["error"] == (
        "HTTP end point doesn't support models with decoupled transaction policy: model "
        "'py_iterative_decoupled' gave 2 responses to one request; use generate_stream for any number of responses")


NOT_ITERATIVE = ("Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while the model is not "
                 "configured to handle such a flag (model '{}' needs sequence_batching {{ iterative_sequence: true }})")


@pytest.mark.parametrize(("model", "params"), [
    ("py_reschedule_plain", {}),
    ("py_reschedule_dynamic", {}),
    ("py_reschedule_sequence", {"sequence_id": 5, "sequence_start": True}),
])
def test_rescheduling_without_iterative_sequences_is_an_error(
    daemon: DaemonProcess, model: str, params: dict[str, Any]
) -> None:
    """Triton 2.51 never answers such a request (its client waits forever)."""
    reply = _runs(daemon, model, 2, batched=model.endswith("dynamic"), **params)
    assert reply.status == 500 and reply.json()["error"] == NOT_ITERATIVE.format(model)
    params = {**params, "sequence_id": 6} if params else {}
    ok = _runs(daemon, model, 1, batched=model.endswith("dynamic"), **params)
    assert ok.status == 200, ok.body


def test_rescheduling_a_decoupled_request_without_iterative_sequences(daemon: DaemonProcess) -> None:
    reply = daemon.post_json("/v2/models/py_reschedule_decoupled/generate_stream", {"INPUT": 2})
    got = _events(reply)
    assert [e.get("OUTPUT") for e in got] == [1, None]
    assert got[1] == {"error": NOT_ITERATIVE.format("py_reschedule_decoupled")}


def test_a_rescheduled_request_gets_no_response_from_execute(daemon: DaemonProcess) -> None:
    reply = _runs(daemon, "py_iterative_not_none", 2)
    assert reply.status == 500
    assert reply.json()["error"].startswith(
        "Failed to process the request(s) for model 'py_iterative_not_none_0_0', message: Expected a None object "
        "in the execute function return list for reschduled request, found type '<class ")
    assert _runs(daemon, "py_iterative_not_none", 1).status == 200


def test_a_decoupled_sequence_models_stream_goes_through_its_sequence_batcher(daemon: DaemonProcess) -> None:
    """It gets its correlation ID and control inputs (they bypassed the batcher before)."""
    reply = daemon.post_json("/v2/models/py_decoupled_sequence/generate_stream",
                             {"INPUT": 1, "sequence_id": 41, "sequence_start": True, "sequence_end": True})
    got = _events(reply)
    assert json.loads(got[0]["LOG"]) == [{**_saw(41, True), "flags": 3, "END": [1]}]
