"""System shared memory over a real daemon: Triton's `simple_http_shm_client.py` and
`simple_http_shm_string_client.py` flows with the real `tritonclient` (TCP) and the same
protocol over the Unix socket, regions made with `tritonclient.utils.shared_memory`."""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
httpclient = pytest.importorskip("tritonclient.http")
shm = pytest.importorskip("tritonclient.utils.shared_memory")
from model_builders import write_simple_repository  # noqa: E402
from tritonclient import utils  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from support import DaemonProcess, wait_until  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")


def _simple_string_onnx(path: Path) -> None:
    """Triton's `simple_string`: BYTES numbers in, their sum and difference out as BYTES."""
    import onnx
    from onnx import TensorProto, helper

    shape: list[Any] = ["batch", 16]
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["INPUT0"], ["a"], to=TensorProto.INT32),
            helper.make_node("Cast", ["INPUT1"], ["b"], to=TensorProto.INT32),
            helper.make_node("Add", ["a", "b"], ["sum"]),
            helper.make_node("Sub", ["a", "b"], ["diff"]),
            helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=TensorProto.STRING),
            helper.make_node("Cast", ["diff"], ["OUTPUT1"], to=TensorProto.STRING),
        ],
        "simple_string",
        [helper.make_tensor_value_info(n, TensorProto.STRING, shape) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info(n, TensorProto.STRING, shape) for n in ("OUTPUT0", "OUTPUT1")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    path.parent.mkdir(parents=True)
    onnx.save(model, str(path))


# A Python model that waits for the test before answering, to hold a request in flight.
_GATED_MODEL = '''
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.gate = os.environ["EDGED_TEST_GATE"]

    def execute(self, requests):
        open(self.gate + ".started", "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", (x * 2).astype(np.float32))])]
'''


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("repo")
    write_simple_repository(path, python=False)
    _simple_string_onnx(path / "simple_string" / "1" / "model.onnx")
    (path / "simple_string" / "config.pbtxt").write_text(
        'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        'input [{ name: "INPUT0" data_type: TYPE_STRING dims: [16] },'
        ' { name: "INPUT1" data_type: TYPE_STRING dims: [16] }]\n'
        'output [{ name: "OUTPUT0" data_type: TYPE_STRING dims: [16] },'
        ' { name: "OUTPUT1" data_type: TYPE_STRING dims: [16] }]\n'
    )
    gated = path / "gated"
    (gated / "1").mkdir(parents=True)
    (gated / "1" / "model.py").write_text(_GATED_MODEL)
    (gated / "config.pbtxt").write_text(
        'backend: "python"\n'
        'input [{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }]\n'
    )
    return path


@pytest.fixture
def gate(tmp_path: Path) -> Path:
    return tmp_path / "gate"


@pytest.fixture
def daemon(start_daemon: Callable[..., DaemonProcess], repo: Path, tmp_path: Path, gate: Path) -> DaemonProcess:
    config = tmp_path / "edged.toml"
    config.write_text('[server]\nshared-memory = "all"\n')
    return start_daemon("--config", str(config), "--model-repository", str(repo), http=True,
                        env={"EDGED_TEST_GATE": str(gate)})


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Any]:
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{daemon.http_port}")
    yield client
    client.close()


@pytest.fixture
def regions() -> Iterator[Callable[[str, int], Any]]:
    """`create(name, size)` -> handle of a fresh POSIX object; every one destroyed at teardown."""
    handles: list[Any] = []

    def create(name: str, size: int) -> Any:
        handle = shm.create_shared_memory_region(name, f"/edged_{name}_{uuid.uuid4().hex[:8]}", size)
        handles.append(handle)
        return handle

    yield create
    for handle in handles:
        shm.destroy_shared_memory_region(handle)


def _key(handle: Any) -> str:
    return str(handle._shm_key)


def _daemon_maps(daemon: DaemonProcess, key: str) -> bool:
    return f"/dev/shm{key}" in Path(f"/proc/{daemon.proc.pid}/maps").read_text()


# --------------------------------------------------------------------------- Triton's examples


def test_simple_http_shm_client(client: Any, daemon: DaemonProcess, regions: Callable[[str, int], Any]) -> None:
    """Step by step what Triton's simple_http_shm_client.py does."""
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()
    input0 = np.arange(16, dtype=np.int32)
    input1 = np.ones(16, dtype=np.int32)
    size = input0.nbytes
    out_handle = regions("output_data", size * 2)
    client.register_system_shared_memory("output_data", _key(out_handle), size * 2)
    in_handle = regions("input_data", size * 2)
    shm.set_shared_memory_region(in_handle, [input0])
    shm.set_shared_memory_region(in_handle, [input1], offset=size)
    client.register_system_shared_memory("input_data", _key(in_handle), size * 2)

    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory("input_data", size)
    inputs[1].set_shared_memory("input_data", size, offset=size)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
    outputs[0].set_shared_memory("output_data", size)
    outputs[1].set_shared_memory("output_data", size, offset=size)
    results = client.infer(model_name="simple", inputs=inputs, outputs=outputs)

    out0 = results.get_output("OUTPUT0")
    assert out0 == {"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16]}  # no data in the body
    sums = shm.get_contents_as_numpy(out_handle, utils.triton_to_np_dtype(out0["datatype"]), out0["shape"])
    out1 = results.get_output("OUTPUT1")
    diffs = shm.get_contents_as_numpy(out_handle, np.int32, out1["shape"], offset=size)
    np.testing.assert_array_equal(sums[0], input0 + input1)
    np.testing.assert_array_equal(diffs[0], input0 - input1)

    status = client.get_system_shared_memory_status()
    assert sorted(status, key=lambda r: r["name"]) == [
        {"name": "input_data", "key": _key(in_handle), "offset": 0, "byte_size": size * 2},
        {"name": "output_data", "key": _key(out_handle), "offset": 0, "byte_size": size * 2},
    ]
    assert _daemon_maps(daemon, _key(in_handle))
    client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []
    assert not _daemon_maps(daemon, _key(in_handle)) and not _daemon_maps(daemon, _key(out_handle))
    assert len(shm.mapped_shared_memory_regions()) == 2


def test_simple_http_shm_string_client(client: Any, regions: Callable[[str, int], Any]) -> None:
    """Step by step what Triton's simple_http_shm_string_client.py does (BYTES in and out)."""
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()
    in0 = np.arange(16, dtype=np.int32)
    in1 = np.ones(16, dtype=np.int32)
    input0 = np.array([str(x).encode() for x in in0], dtype=object)
    input1 = np.array([str(x).encode() for x in in1], dtype=object)
    expected_sum = np.array([str(x).encode() for x in in0 + in1], dtype=object)
    expected_diff = np.array([str(x).encode() for x in in0 - in1], dtype=object)
    ser0, ser1 = utils.serialize_byte_tensor(input0), utils.serialize_byte_tensor(input1)
    size0, size1 = utils.serialized_byte_size(ser0), utils.serialized_byte_size(ser1)
    out0_size = utils.serialized_byte_size(utils.serialize_byte_tensor(expected_sum))
    out1_size = utils.serialized_byte_size(utils.serialize_byte_tensor(expected_diff))

    handles = {}
    for name, size in (("output0_data", out0_size), ("output1_data", out1_size),
                       ("input0_data", size0), ("input1_data", size1)):
        handles[name] = regions(name, size)
    shm.set_shared_memory_region(handles["input0_data"], [ser0])
    shm.set_shared_memory_region(handles["input1_data"], [ser1])
    for name, size in (("output0_data", out0_size), ("output1_data", out1_size),
                       ("input0_data", size0), ("input1_data", size1)):
        client.register_system_shared_memory(name, _key(handles[name]), size)

    inputs = [httpclient.InferInput("INPUT0", [1, 16], "BYTES"), httpclient.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_shared_memory("input0_data", size0)
    inputs[1].set_shared_memory("input1_data", size1)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
    outputs[0].set_shared_memory("output0_data", out0_size)
    outputs[1].set_shared_memory("output1_data", out1_size)
    results = client.infer(model_name="simple_string", inputs=inputs, outputs=outputs)

    out0 = results.get_output("OUTPUT0")
    assert out0["datatype"] == "BYTES" and out0["shape"] == [1, 16]
    r0 = shm.get_contents_as_numpy(handles["output0_data"], utils.triton_to_np_dtype("BYTES"), out0["shape"])
    r1 = shm.get_contents_as_numpy(handles["output1_data"], np.object_, results.get_output("OUTPUT1")["shape"])
    assert list(r0[0]) == list(expected_sum)
    assert list(r1[0]) == list(expected_diff)
    assert len(client.get_system_shared_memory_status()) == 4
    client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []


def test_same_protocol_over_the_unix_socket(daemon: DaemonProcess, regions: Callable[[str, int], Any]) -> None:
    handle = regions("io", 256)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    shm.set_shared_memory_region(handle, [a, b])
    reply = daemon.post_json("/v2/systemsharedmemory/region/io/register",
                             {"key": _key(handle), "offset": 0, "byte_size": 256})
    assert reply.status == 200, reply.body
    body = {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32",
             "parameters": {"shared_memory_region": "io", "shared_memory_byte_size": 64}},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32",
             "parameters": {"shared_memory_region": "io", "shared_memory_byte_size": 64,
                            "shared_memory_offset": 64}},
        ],
        "outputs": [
            {"name": "OUTPUT0", "parameters": {"shared_memory_region": "io", "shared_memory_byte_size": 64,
                                               "shared_memory_offset": 128}},
            {"name": "OUTPUT1"},
        ],
    }
    reply = daemon.post_json("/v2/models/simple/infer", body)
    assert reply.status == 200, reply.body
    outputs = {o["name"]: o for o in reply.json()["outputs"]}
    assert "data" not in outputs["OUTPUT0"] and outputs["OUTPUT1"]["data"] == (a - b).ravel().tolist()
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=128), a + b)
    assert daemon.request("GET", "/v2/systemsharedmemory/region/io/status").json() == [
        {"name": "io", "key": _key(handle), "offset": 0, "byte_size": 256}]
    assert daemon.request("POST", "/v2/systemsharedmemory/region/io/unregister").status == 200
    assert daemon.request("GET", "/v2/systemsharedmemory/status").json() == []


def test_a_large_body_naming_a_region(daemon: DaemonProcess, regions: Callable[[str, int], Any]) -> None:
    # A body of 256 KiB or more is decoded on a worker thread, where no region may be leased
    # (the registry is the loop's): such a request is decoded again on the loop and answered
    # like a small one, and holds no lease afterwards.
    handle = regions("big", 128)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    shm.set_shared_memory_region(handle, [a])
    reply = daemon.post_json("/v2/systemsharedmemory/region/big/register",
                             {"key": _key(handle), "offset": 0, "byte_size": 128})
    assert reply.status == 200, reply.body
    request_id = "r" * (300 * 1024)
    body = {
        "id": request_id,
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32",
             "parameters": {"shared_memory_region": "big", "shared_memory_byte_size": 64}},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [2] * 16},
        ],
        "outputs": [
            {"name": "OUTPUT0", "parameters": {"shared_memory_region": "big", "shared_memory_byte_size": 64,
                                               "shared_memory_offset": 64}},
            {"name": "OUTPUT1"},
        ],
    }
    reply = daemon.post_json("/v2/models/simple/infer", body)
    assert reply.status == 200, reply.body
    answer = reply.json()
    assert answer["id"] == request_id
    outputs = {o["name"]: o for o in answer["outputs"]}
    assert outputs["OUTPUT1"]["data"] == (a - 2).ravel().tolist()
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=64), a + 2)
    # An unknown region: the same answer for a large body as for a small one.
    body["inputs"][0]["parameters"]["shared_memory_region"] = "nowhere"
    large = daemon.post_json("/v2/models/simple/infer", body)
    small = daemon.post_json("/v2/models/simple/infer", body | {"id": "r"})
    assert (large.status, large.body) == (small.status, small.body) == (
        404, b'{"error":"Unable to find shared memory region: \'nowhere\'"}')
    # No lease left behind: unregistering unmaps the region at once.
    assert daemon.request("POST", "/v2/systemsharedmemory/region/big/unregister").status == 200
    assert not _daemon_maps(daemon, _key(handle))


# --------------------------------------------------------------------------- errors


def _error(reply: Any) -> str:
    return str(reply.json()["error"])


def test_bad_registrations_leave_nothing_mapped(daemon: DaemonProcess, regions: Callable[[str, int], Any]) -> None:
    handle = regions("small", 64)
    key = _key(handle)

    def register(name: str, payload: object) -> Any:
        return daemon.request("POST", f"/v2/systemsharedmemory/region/{name}/register", json.dumps(payload))

    assert register("r", {"key": key, "byte_size": 64}).status == 200
    reply = register("r", {"key": key, "byte_size": 64})
    assert (reply.status, _error(reply)) == (400, "shared memory region 'r' already in manager")
    for bad_key in ("/../etc/passwd", "/a/b", "/", ".."):
        reply = register("x", {"key": bad_key, "byte_size": 1})
        assert reply.status == 400 and "invalid shm key" in _error(reply), reply.body
    reply = register("x", {"key": "/edged_no_such_object", "byte_size": 1})
    assert (reply.status, _error(reply)) == (
        400, "Unable to open shared memory region: '/edged_no_such_object' (No such file or directory)")
    for offset, size in ((0, 65), (64, 1), (32, 40)):
        reply = register("x", {"key": key, "offset": offset, "byte_size": size})
        assert reply.status == 400 and "failed to register shared memory region 'x': invalid args" in _error(reply)
    reply = register("x", {"key": key})
    assert reply.status == 400 and "byte_size" in _error(reply)
    reply = register("x", {"key": key, "byte_size": 1, "size": 1})
    assert reply.status == 400 and "size" in _error(reply)
    assert [r["name"] for r in daemon.request("GET", "/v2/systemsharedmemory/status").json()] == ["r"]
    reply = daemon.request("GET", "/v2/systemsharedmemory/region/x/status")
    assert (reply.status, _error(reply)) == (404, "Unable to find system shared memory region: 'x'")
    # Unregistering an unknown name is not an error (Triton); all regions go with /unregister.
    assert daemon.request("POST", "/v2/systemsharedmemory/region/x/unregister").status == 200
    assert daemon.request("POST", "/v2/systemsharedmemory/unregister").status == 200
    assert not _daemon_maps(daemon, key)


def test_bad_infer_requests(client: Any, daemon: DaemonProcess, regions: Callable[[str, int], Any]) -> None:
    handle = regions("data", 128)
    shm.set_shared_memory_region(handle, [np.arange(32, dtype=np.int32)])
    client.register_system_shared_memory("data", _key(handle), 128)

    def infer(in_region: str = "data", in_size: int = 64, in_offset: int = 0,
              out_size: int = 64, out_offset: int = 64) -> None:
        inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory(in_region, in_size, offset=in_offset)
        inputs[1].set_shared_memory("data", 64)
        output = httpclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("data", out_size, offset=out_offset)
        client.infer("simple", inputs, outputs=[output])

    with pytest.raises(InferenceServerException, match="Unable to find shared memory region: 'nope'") as exc:
        infer(in_region="nope")
    assert exc.value.status() == "404"
    with pytest.raises(InferenceServerException, match="Invalid offset \\+ byte size for shared memory region: 'data'"):
        infer(in_offset=100)
    with pytest.raises(InferenceServerException, match="shared_memory_byte_size 60 does not match shape"):
        infer(in_size=60)
    with pytest.raises(InferenceServerException) as exc:
        infer(out_size=32)
    assert exc.value.status() == "400"
    assert exc.value.message() == ("shared memory size specified with the request for output 'OUTPUT0' "
                                   "(32 bytes) should be at least 64 bytes to hold the results")
    # Nothing failed for good: the same regions serve a correct request afterwards.
    infer()
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [16], offset=64),
                                  np.arange(16) * 2)
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": [0] * 16,
                        "parameters": {"shared_memory_region": "data", "shared_memory_byte_size": 64}}]}
    reply = daemon.post_json("/v2/models/simple/infer", body)
    assert reply.status == 400 and "Input must set only one of the following fields" in _error(reply)
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": [0] * 16},
                       {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [0] * 16}],
            "outputs": [{"name": "OUTPUT0", "parameters": {"shared_memory_region": "data",
                                                           "shared_memory_byte_size": 64, "classification": 2}}]}
    reply = daemon.post_json("/v2/models/simple/infer", body)
    assert reply.status == 400 and "can't set both 'shared_memory_region' and 'classification'" in _error(reply)
    # A request rejected after it leased a region (INPUT0 resolved, INPUT1 bad) keeps no lease:
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32",
                        "parameters": {"shared_memory_region": "data", "shared_memory_byte_size": 64}},
                       {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": ["x"] * 16}]}
    assert daemon.post_json("/v2/models/simple/infer", body).status == 400
    client.unregister_system_shared_memory()
    # ...so unregistering unmaps at once: no request above left the region leased.
    assert not _daemon_maps(daemon, _key(handle))


def test_cuda_shared_memory_answers_as_triton_without_gpus(client: Any, daemon: DaemonProcess) -> None:
    assert client.get_cuda_shared_memory_status() == []
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("any")
    reply = daemon.post_json("/v2/cudasharedmemory/region/c/register",
                             {"raw_handle": {"b64": ""}, "device_id": 0, "byte_size": 16})
    assert (reply.status, _error(reply)) == (
        400, "failed to register CUDA shared memory region: 'c', GPUs not supported")
    reply = daemon.request("GET", "/v2/cudasharedmemory/region/c/status")
    assert (reply.status, _error(reply)) == (404, "Unable to find cuda shared memory region: 'c'")


def _gated_infer(daemon: DaemonProcess, gate: Path, inp: Any, out: Any, during: Callable[[], object]) -> dict[str, Any]:
    """Infer on the gated model from a thread; run `during` while the model holds the request.
    Returns {"r": result} or {"error": message}."""
    result: dict[str, Any] = {}

    def run() -> None:  # gevent clients are per thread: this one has its own
        own = httpclient.InferenceServerClient(url=f"127.0.0.1:{daemon.http_port}")
        try:
            result["r"] = own.infer("gated", [inp], outputs=[out])
        except InferenceServerException as exc:
            result["error"] = str(exc)
        finally:
            own.close()

    worker = threading.Thread(target=run)
    worker.start()
    try:
        wait_until(lambda: Path(str(gate) + ".started").exists())
        during()
    finally:
        gate.touch()
        worker.join(60)
    return result


def test_unregister_while_a_request_uses_the_region(
    client: Any, daemon: DaemonProcess, regions: Callable[[str, int], Any], gate: Path
) -> None:
    handle = regions("busy", 32)
    x = np.array([1, 2, 3, 4], dtype=np.float32)
    shm.set_shared_memory_region(handle, [x])
    client.register_system_shared_memory("busy", _key(handle), 32)
    inp = httpclient.InferInput("X", [4], "FP32").set_shared_memory("busy", 16)
    out = httpclient.InferRequestedOutput("Y")
    out.set_shared_memory("busy", 16, offset=16)

    def during() -> None:
        client.unregister_system_shared_memory("busy")
        assert client.get_system_shared_memory_status() == []
        assert _daemon_maps(daemon, _key(handle))  # still mapped: a request is using it
        with pytest.raises(InferenceServerException, match="Unable to find shared memory region: 'busy'"):
            client.infer("simple", [httpclient.InferInput("INPUT0", [1, 16], "INT32").set_shared_memory("busy", 64),
                                    httpclient.InferInput("INPUT1", [1, 16], "INT32").set_shared_memory("busy", 64)])

    result = _gated_infer(daemon, gate, inp, out, during)
    assert result["r"].get_output("Y")["shape"] == [4]
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [4], offset=16), x * 2)
    wait_until(lambda: not _daemon_maps(daemon, _key(handle)))
    assert daemon.alive()


def test_an_output_region_shrunk_while_the_model_runs_is_a_400(
    client: Any, daemon: DaemonProcess, regions: Callable[[str, int], Any], gate: Path
) -> None:
    """The object's size was checked only when the request began: writing the output into an
    object the client shrank meanwhile killed the daemon (SIGBUS)."""
    source, target = regions("in", 16), regions("out", 16)
    shm.set_shared_memory_region(source, [np.array([1, 2, 3, 4], dtype=np.float32)])
    client.register_system_shared_memory("in", _key(source), 16)
    client.register_system_shared_memory("out", _key(target), 16)
    inp = httpclient.InferInput("X", [4], "FP32").set_shared_memory("in", 16)
    out = httpclient.InferRequestedOutput("Y")
    out.set_shared_memory("out", 16)
    result = _gated_infer(daemon, gate, inp, out, lambda: os.truncate(Path("/dev/shm") / _key(target).lstrip("/"), 0))
    assert "shared memory region 'out': its object" in result["error"] and "shrank to 0 bytes" in result["error"]
    assert daemon.alive() and client.is_server_live()
    client.unregister_system_shared_memory()


def test_tcp_callers_refused_by_default(start_daemon: Callable[..., DaemonProcess], repo: Path,
                                        regions: Callable[[str, int], Any]) -> None:
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "explicit",
                          "--load-model", "simple", http=True)
    handle = regions("guarded", 64)
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{daemon.http_port}")
    try:
        with pytest.raises(InferenceServerException, match="Client shared memory is disabled for callers over TCP") as exc:
            client.register_system_shared_memory("guarded", _key(handle), 64)
        assert exc.value.status() == "501"
        # The Unix socket admits the caller; a TCP caller still cannot use the region.
        reply = daemon.post_json("/v2/systemsharedmemory/region/guarded/register", {"key": _key(handle), "byte_size": 64})
        assert reply.status == 200, reply.body
        inputs = [httpclient.InferInput(n, [1, 16], "INT32").set_shared_memory("guarded", 64) for n in ("INPUT0", "INPUT1")]
        with pytest.raises(InferenceServerException, match="disabled for callers over TCP"):
            client.infer("simple", inputs)
        assert client.get_system_shared_memory_status()[0]["name"] == "guarded"
    finally:
        client.close()


def test_off_refuses_every_caller(start_daemon: Callable[..., DaemonProcess], repo: Path, tmp_path: Path,
                                  regions: Callable[[str, int], Any]) -> None:
    config = tmp_path / "off.toml"
    config.write_text('[server]\nshared-memory = "off"\n')
    daemon = start_daemon("--config", str(config), "--model-repository", str(repo),
                          "--model-control-mode", "explicit")
    handle = regions("off", 64)
    reply = daemon.post_json("/v2/systemsharedmemory/region/off/register", {"key": _key(handle), "byte_size": 64})
    assert reply.status == 501 and "Client shared memory is disabled" in _error(reply)
    assert daemon.request("POST", "/v2/systemsharedmemory/unregister").status == 501
    assert daemon.request("GET", "/v2/systemsharedmemory/status").json() == []
    assert not _daemon_maps(daemon, _key(handle))
