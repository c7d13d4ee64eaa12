"""Plain helpers for tests (importable as `support` because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
REPO_BACKENDS = REPO_ROOT / "backends"


def load_script(path: Path, name: str) -> types.ModuleType:
    """A module from a file outside any package (packaging/'s scripts), imported under `name`
    and registered there: dataclasses look their module up in sys.modules."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def child_pids(pid: int) -> list[int]:
    """The processes started by any thread of `pid` (the kernel lists them per thread): the
    daemon's HTTP workers, whichever thread started them."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += (int(child) for child in (task / "children").read_text().split())
        except FileNotFoundError:
            # The thread ended between the listing and the read (an executor's idle thread);
            # the kernel gives any children it had to another thread of the process.
            continue
    return sorted(children)


def llamacpp_models(repo: Path, models: dict[str, tuple[dict[str, Any], dict[str, str]]]) -> None:
    """Per model name: a tiny random llama GGUF (gguf_builder.write_tiny_llama with the first
    dict's options) as version 1, and a llama.cpp config with the second dict's parameters."""
    from gguf_builder import write_tiny_llama

    for name, (options, parameters) in models.items():
        (repo / name / "1").mkdir(parents=True)
        write_tiny_llama(repo / name / "1" / "model.gguf", **options)
        params = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in parameters.items())
        (repo / name / "config.pbtxt").write_text('backend: "llamacpp"\n' + params)


def python_model(repo: Path, name: str, body: str, *, version: int = 1) -> Path:
    """Write a Triton-style Python model: FP32 X[-1] -> Y[-1], Y computed by `body` from `x`."""
    folder = repo / name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(
        'backend: "python"\n'
        'input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
    )
    code = "\n".join("        " + line for line in body.splitlines())
    (folder / str(version) / "model.py").write_text(
        "import numpy as np\n"
        "import triton_python_backend_utils as pb_utils\n\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        return [self._one(r) for r in requests]\n\n"
        "    def _one(self, request):\n"
        "        x = pb_utils.get_input_tensor_by_name(request, 'X').as_numpy()\n"
        f"{code}\n"
        "        return pb_utils.InferenceResponse([pb_utils.Tensor('Y', np.asarray(y, dtype=np.float32))])\n"
    )
    return folder


# Each request answers with the CPUs of the thread that runs `execute` and of a thread it starts.
_PLACEMENT_MODEL = """\
import os, threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        seen = []
        child = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
        child.start(); child.join()
        cpus = [sorted(os.sched_getaffinity(0)), seen[0]]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array(cpus, dtype=np.int32).ravel())])
                for _ in requests]
"""


def placement_model(repo: Path, name: str, group: str) -> None:
    """A python model (FP32 X[1] -> INT32 Y) whose answer is the CPUs its `execute` thread may
    run on, then those of a thread it starts; `group`: its config's instance_group line."""
    x_to_y_model(repo, name, _PLACEMENT_MODEL, "TYPE_INT32 dims: [ -1 ]", group)


def x_to_y_model(repo: Path, name: str, source: str, y: str, extra: str = "") -> None:
    """A python model (FP32 X[1] -> Y, `y` its type and dims) written from `source`; `extra`:
    more config lines."""
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(
        'backend: "python"\n'
        'input [{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }]\n'
        f'output [{{ name: "Y" data_type: {y} }}]\n' + extra
    )


# ---------------------------------------------------------------------------- raw HTTP/1.1

# (status, lower-case headers, body) of one response read off a socket.
RawResponse = tuple[int, dict[str, str], bytes]


def read_response(sock: socket.socket, buffered: bytearray) -> RawResponse:
    """One Content-Length response off `sock`; `buffered` holds what was read past it."""
    while b"\r\n\r\n" not in buffered:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before a response")
        buffered += chunk
    head, _, rest = bytes(buffered).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed inside a response")
        rest += chunk
    buffered[:] = rest[length:]
    return int(lines[0].split(" ")[1]), headers, rest[:length]


# A python model using pb_utils' custom metrics. Each request reports what the model reads
# back; with the request parameter `misuse`, also what every misuse raises (Triton 2.51
# sometimes aborts when a model's call to it fails, so tests/compat never sets it).
METRICS_MODEL = '''\
import gc
import json
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

def attempt(call):
    try:
        return ["ok", call()]
    except Exception as exc:
        return [type(exc).__name__, str(exc)]

class TritonPythonModel:
    def initialize(self, args):
        kinds = pb_utils.MetricFamily
        self.counters = kinds(name="model_requests", description="Requests seen", kind=kinds.COUNTER)
        self.gauges = kinds("model_last", "Last input", kinds.GAUGE)
        self.histograms = kinds(name="model_sizes", description="Inputs", kind=kinds.HISTOGRAM)
        self.counter = self.counters.Metric(labels={"model": "metrics", "kind": "a"})
        self.same = self.counters.Metric(labels={"kind": "a", "model": "metrics"})
        self.unlabelled = self.counters.Metric()
        self.gauge = self.gauges.Metric(labels={"model": "metrics"})
        self.hist = self.histograms.Metric(labels={"model": "metrics"}, buckets=[1, 5.0])
        self.rebucketed = self.histograms.Metric(labels={"model": "metrics"}, buckets=[2.0])
        self.empty = self.histograms.Metric(labels={"only": "inf"}, buckets=[])
        self.shared = kinds("model_requests", "Another description", kinds.COUNTER)
        self.temporary = kinds("model_temporary", "Dropped", kinds.GAUGE)
        self.temporary.Metric(labels={"t": "1"}).set(7)
        self.kept = kinds("model_kept", "Metric dropped, family kept", kinds.GAUGE)
        self.kept.Metric(labels={"k": "1"}).set(3)
        if args["model_name"] == "fails":
            raise RuntimeError("initialize gives up")

    def execute(self, requests):
        x = float(pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()[0])
        self.counter.increment(2)
        self.same.increment(np.float64(0.5))
        self.gauge.set(x)
        self.gauge.increment(-0.25)
        for value in (x, 1.0, 9.0):
            self.hist.observe(value)
        self.rebucketed.observe(1.5)
        self.empty.observe(x)
        seen = {
            "values": [self.counter.value(), self.same.value(), self.unlabelled.value(), self.gauge.value(),
                       self.shared.Metric(labels={"model": "metrics", "kind": "a"}).value()],
            "kinds": [int(pb_utils.MetricFamily.COUNTER), int(pb_utils.MetricFamily.GAUGE),
                      int(pb_utils.MetricFamily.HISTOGRAM), repr(pb_utils.MetricFamily.COUNTER),
                      str(pb_utils.MetricFamily.GAUGE), type(pb_utils.MetricFamily.HISTOGRAM).__name__,
                      hasattr(pb_utils, "MetricKind"), type(self.counter).__name__],
            "family_attrs": sorted(a for a in dir(pb_utils.MetricFamily) if not a.startswith("_")),
            "metric_attrs": sorted(a for a in dir(self.counter) if not a.startswith("_")),
        }
        if json.loads(requests[0].parameters()).get("misuse"):
            seen["misuse"] = self._misuse()
        if getattr(self, "temporary", None) is not None:
            self.temporary = None
            gc.collect()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([json.dumps(seen)], dtype=np.object_))])
                for _ in requests]

    def _misuse(self):
        kinds = pb_utils.MetricFamily
        found = {
            "counter_neg": attempt(lambda: self.counter.increment(-1.0)),
            "counter_set": attempt(lambda: self.counter.set(3.0)),
            "gauge_observe": attempt(lambda: self.gauge.observe(1.0)),
            "hist_value": attempt(lambda: self.hist.value()),
            "no_buckets": attempt(lambda: self.histograms.Metric(labels={"x": "y"})),
            "tuple_buckets": attempt(lambda: self.histograms.Metric(labels={"x": "y"}, buckets=(1.0,))),
            "counter_buckets": attempt(lambda: self.counters.Metric(labels={"b": "c"}, buckets=[1.0])),
            "labels_list": attempt(lambda: self.counters.Metric(labels=[("a", "b")])),
            "unsorted": attempt(lambda: self.histograms.Metric(labels={"u": "1"}, buckets=[5.0, 1.0])),
            "label_name": attempt(lambda: self.gauges.Metric(labels={"bad label": "v"})),
            "kind_clash": attempt(lambda: kinds("model_requests", "x", kinds.GAUGE)),
            "bad_name": attempt(lambda: kinds("bad name!", "x", kinds.GAUGE)),
            "text_value": attempt(lambda: self.gauge.increment("1")),
            "int_kind": attempt(lambda: kinds(name="k", description="d", kind=1)),
            # A family the model drops takes its series along; its Metric objects then fail.
            "dropped": attempt(lambda: kinds("dropped", "", kinds.GAUGE).Metric().value()),
        }
        elsewhere = []
        thread = threading.Thread(target=lambda: elsewhere.append(attempt(lambda: kinds("elsewhere", "", kinds.GAUGE))))
        thread.start()
        thread.join()
        found["thread"] = elsewhere[0]
        return found

    def finalize(self):
        self.gauge.set(-1.0)
'''


_CONTROLLER_MODEL = '''\
import json
import numpy as np
import triton_python_backend_utils as pb_utils

CONFIG = json.dumps({"name": "other", "backend": "python", "max_batch_size": 0,
    "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [-1]}],
    "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [-1]}]})
TRIPLE = (
    "import triton_python_backend_utils as pb_utils\\n"
    "class TritonPythonModel:\\n"
    "    def execute(self, requests):\\n"
    "        return [pb_utils.InferenceResponse([pb_utils.Tensor('Y', pb_utils.get_input_tensor_by_name(r, 'X')"
    ".as_numpy() * 3)]) for r in requests]\\n"
).encode()

def attempt(call):
    try:
        return ["ok", call()]
    except Exception as exc:
        return [type(exc).__name__, str(exc)]

def run_other():
    x = pb_utils.Tensor("X", np.array([1.5], dtype=np.float32))
    response = pb_utils.InferenceRequest(model_name="other", requested_output_names=["Y"], inputs=[x]).exec()
    return "error" if response.has_error() else pb_utils.get_output_tensor_by_name(response, "Y").as_numpy().tolist()

STEPS = {
    "ready": lambda: pb_utils.is_model_ready("other"),
    "ready_versions": lambda: [pb_utils.is_model_ready(model_name="other", model_version=v) for v in ("1", "2")],
    "ready_bad_version": lambda: pb_utils.is_model_ready("other", "abc"),
    "ready_version_zero": lambda: pb_utils.is_model_ready("other", "0"),
    "load": lambda: pb_utils.load_model(model_name="other"),
    "load_files": lambda: pb_utils.load_model("other", config=CONFIG, files={"file:1/model.py": TRIPLE}),
    "load_files_without_config": lambda: pb_utils.load_model("other", files={"file:1/model.py": TRIPLE}),
    "load_file_not_named_file": lambda: pb_utils.load_model("other", config=CONFIG, files={"1/model.py": TRIPLE}),
    "load_text_file": lambda: pb_utils.load_model("other", config=CONFIG, files={"file:1/model.py": "text"}),
    "load_unknown": lambda: pb_utils.load_model("nope"),
    "load_itself": lambda: pb_utils.load_model("controller"),
    "unload": lambda: pb_utils.unload_model("other"),
    "unload_unknown": lambda: pb_utils.unload_model("nope", unload_dependents=True),
    "unload_itself": lambda: pb_utils.unload_model("controller"),
    "run": run_other,
}

class TritonPythonModel:
    def initialize(self, args):
        # Asked only where the config says so: Triton 2.51, which supports the API once the
        # server runs, sometimes aborts when a model calls it while it starts.
        at_start = "at_start" in json.loads(args["model_config"])["parameters"]
        self.at_start = attempt(lambda: pb_utils.is_model_ready("controller")) if at_start else None

    def execute(self, requests):
        steps = json.loads(requests[0].parameters())["steps"].split(",")
        done = [[step, *attempt(STEPS[step])] for step in steps]
        out = np.array([json.dumps({"at_start": self.at_start, "done": done})], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", out)]) for _ in requests]

    def finalize(self):
        pb_utils.Logger.log_info("finalize: " + json.dumps(attempt(lambda: pb_utils.is_model_ready("other"))))
'''

_DOUBLING_MODEL = """\
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor('Y', pb_utils.get_input_tensor_by_name(r, 'X').as_numpy() * 2)])
                for r in requests]
"""


def controller_repository(repo: Path, *, at_start: bool = False) -> None:
    """`controller` runs the model loading API on `other` (FP32 X -> 2X), as its requests say;
    `at_start`: its initialize asks too (what it saw comes back as "at_start")."""
    extra = 'parameters { key: "at_start" value { string_value: "yes" } }\n' if at_start else ""
    x_to_y_model(repo, "controller", _CONTROLLER_MODEL, "TYPE_STRING dims: [ 1 ]", extra)
    (repo / "other" / "1").mkdir(parents=True)
    (repo / "other" / "config.pbtxt").write_text(
        'backend: "python"\ninput [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
    )
    (repo / "other" / "1" / "model.py").write_text(_DOUBLING_MODEL)


def run_steps(post: Any, steps: list[str]) -> dict[str, Any]:
    body = {"parameters": {"steps": ",".join(steps)}, "inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [0]}]}
    reply = post("/v2/models/controller/infer", body)
    assert reply.status == 200, reply.body
    return dict(json.loads(json.loads(reply.body)["outputs"][0]["data"][0]))


def raw_request(method: str, target: str, body: bytes = b"", headers: tuple[str, ...] = ()) -> bytes:
    """One HTTP/1.1 request as bytes (Content-Length unless `headers` say it is chunked)."""
    lines = [f"{method} {target} HTTP/1.1", "Host: localhost", *headers]
    if body and not any(h.lower().startswith("transfer-encoding") for h in headers):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def simple_json_body(rows: int = 1, pad: int = 0) -> tuple[bytes, Any, Any]:
    """A JSON infer body for Triton's `simple` model (`rows` of INT32 [16], then `pad` spaces)
    and the sum and difference it must answer."""
    import numpy as np

    a = np.arange(16 * rows, dtype=np.int32).reshape(rows, 16)
    b = np.full((rows, 16), 3, dtype=np.int32)
    body = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [rows, 16], "datatype": "INT32", "data": a.ravel().tolist()},
        {"name": "INPUT1", "shape": [rows, 16], "datatype": "INT32", "data": b.ravel().tolist()},
    ]}).encode() + b" " * pad
    return body, a + b, a - b


def simple_binary_body(a: Any, b: Any, outputs: list[dict[str, Any]]) -> tuple[bytes, str]:
    """A binary infer body for Triton's `simple` model (the JSON header, then INT32 arrays `a`
    and `b`), and its Inference-Header-Content-Length header line."""
    header = json.dumps({
        "inputs": [
            {"name": name, "shape": list(x.shape), "datatype": "INT32", "parameters": {"binary_data_size": x.nbytes}}
            for name, x in (("INPUT0", a), ("INPUT1", b))
        ],
        "outputs": outputs,
    }).encode()
    return header + a.tobytes() + b.tobytes(), f"Inference-Header-Content-Length: {len(header)}"


def json_outputs(body: bytes) -> dict[str, list[Any]]:
    """An infer response's outputs by name (JSON data)."""
    return {o["name"]: o["data"] for o in json.loads(body)["outputs"]}


_SAMPLE = re.compile(r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def metric_samples(text: str, prefixes: tuple[str, ...]) -> Samples:
    """The samples of a Prometheus text whose names start with one of `prefixes`, by name and
    sorted labels. By hand: prometheus_client's parser renames counter samples to `_total`,
    and values written `3` and `3.0` (Triton's and edged's) must compare equal."""
    samples: Samples = {}
    for line in text.splitlines():
        match = _SAMPLE.fullmatch(line)
        if line.startswith("#") or match is None or not match["name"].startswith(prefixes):
            continue
        labels = tuple(sorted(_LABEL.findall(match["labels"] or "")))
        samples.setdefault(match["name"], {})[labels] = float(match["value"])
    return samples


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except (OSError, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix socket: what `curl --unix-socket` does, from Python."""

    def __init__(self, path: Path, timeout: float = 60.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.socket_path)
        self.sock = sock


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class DaemonProcess:
    """`edged serve` running as a real child process, reached over its real Unix socket."""

    proc: subprocess.Popen[bytes]
    socket: Path
    state_dir: Path
    log_path: Path
    http_port: int | None = None

    def request(
        self, method: str, path: str, body: bytes | str | None = None,
        headers: dict[str, str] | None = None, timeout: float = 60.0,
    ) -> Reply:
        conn = UnixHTTPConnection(self.socket, timeout=timeout)
        try:
            payload = body.encode() if isinstance(body, str) else body
            conn.request(method, path, body=payload, headers=headers or {})
            resp = conn.getresponse()
            return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        finally:
            conn.close()

    def post_json(self, path: str, payload: object) -> Reply:
        return self.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})

    def post_ok(self, path: str, payload: object, status: int = 200) -> Any:
        """POST `payload` as JSON to `path` and return the reply's JSON body, asserting its status."""
        reply = self.post_json(path, payload)
        assert reply.status == status, reply.body
        return reply.json()

    def get_json(self, path: str, status: int = 200) -> Any:
        """GET `path`'s JSON body, asserting its status."""
        reply = self.request("GET", path)
        assert reply.status == status, reply.body
        return reply.json()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_daemon_process(
    base: Path, *flags: str, http: bool = False, env: dict[str, str] | None = None,
    wait: bool = True, timeout: float = 120.0,
) -> DaemonProcess:
    sock = base / "edged.sock"
    state = base / "state"
    log_path = base / "daemon.log"
    args = [sys.executable, "-m", "daemon", "serve", "--socket", str(sock), "--state-dir", str(state), *flags]
    port = None
    if http:
        port = free_port()
        args += ["--http", f"127.0.0.1:{port}"]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(args, cwd=REPO_ROOT, env=full_env, stdout=log_file, stderr=subprocess.STDOUT)
    daemon = DaemonProcess(proc, sock, state, log_path, port)
    if wait:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"daemon exited with {proc.returncode}:\n{daemon.log()}")
            if sock.exists():
                try:
                    if daemon.request("GET", "/v2/health/ready", timeout=5).status == 200:
                        break
                except OSError:
                    pass
            if time.monotonic() > deadline:
                # Never leave a daemon behind: the caller gets no handle to stop it.
                daemon.stop(signal.SIGKILL, timeout=10)
                raise AssertionError(f"daemon not ready after {timeout}s:\n{daemon.log()}")
            time.sleep(0.1)
        # Health answers before the HTTP layer is imported (daemon.server._start_http, a few
        # tenths of a second after READY, more on a slow box); requests for other routes wait
        # for it meanwhile, so a test timing its requests from here would time that wait too
        # (tests/test_server.py checks the wait itself). Any answer to `/v2` means it is up.
        daemon.request("GET", "/v2", timeout=max(deadline - time.monotonic(), 5.0))
    return daemon


def failing_generation_plugin(plugins: Path, repo: Path, model: str = "broken") -> None:
    """A generation backend plugin that streams "a", "b" and then fails, as an engine that
    crashes mid-generation does; and a model `model` in `repo` that runs on it. For the API
    layer's handling of an error after a stream's status went out (no runtime is faked: the
    routes under test are the subject)."""
    folder = plugins / "failing"
    folder.mkdir(parents=True)
    (folder / "manifest.toml").write_text(
        'name = "failing"\nversion = "1.0"\napi-version = 1\nentrypoint = "impl:Failing"\n'
        'artifacts = ["failing.txt"]\n'
    )
    (folder / "impl.py").write_text(
        "from daemon.backend import BackendError, GenerateChunk, GenerationBackend\n\n\n"
        "class Failing(GenerationBackend):\n"
        "    name = 'failing'\n\n"
        "    async def load(self, config, artifact, device):\n"
        "        pass\n\n"
        "    async def unload(self):\n"
        "        pass\n\n"
        "    def chat_prompt(self, messages):\n"
        "        return ' '.join(m['content'] for m in messages)\n\n"
        "    async def generate(self, prompt, params):\n"
        "        yield GenerateChunk(text='a')\n"
        "        yield GenerateChunk(text='b')\n"
        "        raise BackendError('the engine failed')\n"
    )
    for path in (plugins, folder):
        path.chmod(0o755)
    (repo / model / "1").mkdir(parents=True)
    (repo / model / "1" / "failing.txt").write_text("x")
    (repo / model / "config.pbtxt").write_text('backend: "failing"\n')


def streamed_chat(chunks: Any) -> tuple[str, str, list[tuple[str, str]], str | None]:
    """(reasoning, content, [(name, arguments)], finish_reason) of a chat reply streamed by the
    `openai` client: each call's id and name once, then its arguments in pieces."""
    reasoning = content = ""
    calls: list[list[str]] = []
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.index == len(calls):
                    assert call.id and call.function and call.function.name
                    calls.append([call.function.name, ""])
                calls[call.index][1] += call.function.arguments or "" if call.function else ""
            finish = choice.finish_reason or finish
    return reasoning, content, [(name, arguments) for name, arguments in calls], finish


def check_responses_stream(client: Any, kwargs: dict[str, Any], whole: Any) -> None:
    """The Responses API streamed with `kwargs` ends in the same text and output items (their
    types and call arguments) as `whole`, the reply unstreamed."""
    with client.responses.stream(**kwargs) as stream:
        list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] \
        == [(i.type, getattr(i, "arguments", None)) for i in whole.output]


def gguf_daemon(factory: Any, models: dict[str, dict[str, Any]]) -> DaemonProcess:
    """A daemon process (HTTP too) serving tiny llama.cpp models: name -> write_tiny_llama's
    keyword arguments. `factory`: pytest's tmp_path_factory."""
    from gguf_builder import write_tiny_llama

    repo = factory.mktemp("gguf-models")
    for name, options in models.items():
        (repo / name / "1").mkdir(parents=True)
        write_tiny_llama(repo / name / "1" / "model.gguf", **options)
        (repo / name / "config.pbtxt").write_text('backend: "llamacpp"\n')
    return start_daemon_process(factory.mktemp("edged"), "--model-repository", str(repo), http=True)


def cut_by_unload(tmp_path: Path, start_daemon: Callable[..., DaemonProcess], path: str, body: dict[str, Any]) -> Reply:
    """The reply to `body` (for model "tiny", asking for far more tokens than a second gives)
    at `path` when the model is unloaded a second into the generation, past a 0.2 s drain
    timeout: the engine cancels it (finish_reason "cancelled")."""
    import concurrent.futures

    from gguf_builder import write_tiny_llama

    (tmp_path / "repo" / "tiny" / "1").mkdir(parents=True)
    write_tiny_llama(tmp_path / "repo" / "tiny" / "1" / "model.gguf", seed=1, n_ctx=16384)
    (tmp_path / "repo" / "tiny" / "config.pbtxt").write_text(
        'backend: "llamacpp"\nparameters { key: "n_ctx" value { string_value: "16384" } }\n'
        'parameters { key: "n_parallel" value { string_value: "1" } }\n'
    )
    (tmp_path / "edged.toml").write_text("[server]\nshutdown-timeout = 0.2\n")
    daemon = start_daemon("--config", str(tmp_path / "edged.toml"), "--model-repository", str(tmp_path / "repo"),
                          "--model-control-mode", "explicit", "--load-model", "tiny")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(daemon.post_json, path, body)
        time.sleep(1.0)  # generating (16000 tokens take far longer)
        assert daemon.request("POST", "/v2/repository/models/tiny/unload", b"").status == 200
        return pending.result(timeout=60)


# A tool for the end-to-end tool-calling tests, and the check of its arguments.
LIGHT_TOOL = {"type": "function", "function": {
    "name": "set_light", "description": "Set a room's light",
    "parameters": {"type": "object", "properties": {
        "room": {"type": "string", "enum": ["hall", "attic"]},
        "on": {"type": "boolean"},
        "level": {"type": "integer"},
    }, "required": ["room", "on"]},
}}


def check_light(arguments: str) -> dict[str, Any]:
    """The arguments of a set_light call (JSON text), each of its schema's type."""
    value = json.loads(arguments)
    assert value["room"] in ("hall", "attic") and isinstance(value["on"], bool)
    assert set(value) <= {"room", "on", "level"} and isinstance(value.get("level", 0), int)
    return dict(value)


def check_required_calls(client: Any, model: str, bias: dict[str, int], *, compact: bool = False) -> None:
    """`tool_choice: required` with LIGHT_TOOL on `model` (`bias`: the logit biases that end the
    tiny model's reply once its calls are complete): for three seeds, the calls come back whole
    with finish_reason tool_calls and no content, each a valid set_light call, and streamed the
    same names and arguments text and the same reasoning; `parallel_tool_calls: false` gives
    one. `compact`: the arguments are compact JSON (a syntax whose values llama-server copies)."""
    kwargs: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Lights in the hall?"}],
                              "tools": [LIGHT_TOOL], "tool_choice": "required", "temperature": 1.0,
                              "max_tokens": 600, "logit_bias": bias}
    for seed in range(3):
        choice = client.chat.completions.create(seed=seed, **kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice.message
        calls = choice.message.tool_calls or []
        assert calls and all(check_light(call.function.arguments) for call in calls)
        if compact:
            assert all(" " not in call.function.arguments for call in calls)
        reasoning, content, stream, finish = streamed_chat(client.chat.completions.create(stream=True, seed=seed, **kwargs))
        assert (content, finish) == ("", "tool_calls")
        assert reasoning == (getattr(choice.message, "reasoning_content", None) or "")
        assert stream == [(call.function.name, call.function.arguments) for call in calls]
    single = client.chat.completions.create(parallel_tool_calls=False, seed=1, **kwargs).choices[0]
    assert len(single.message.tool_calls or []) == 1


def check_auto_calls(client: Any, kwargs: dict[str, Any]) -> None:
    """`tool_choice: auto` (`kwargs`: the chat request, biased so that the tiny model starts a
    call): for two seeds the reply is valid set_light calls with finish_reason tool_calls, and
    streamed the same calls and no content."""
    for seed in range(2):
        choice = client.chat.completions.create(seed=seed, **kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            check_light(call.function.arguments)
        _, content, stream, finish = streamed_chat(client.chat.completions.create(stream=True, seed=seed, **kwargs))
        assert (content, finish) == ("", "tool_calls")
        assert stream == [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]


def check_tool_loop(client: Any, port: int, model: str, kwargs: dict[str, Any], call_text: str) -> None:
    """A required call (`kwargs`: the chat request's fields but model and messages) and its
    result go back through the model's template: the prompt grows by at least `call_text` and
    the result; Ollama's shape of the same conversation (arguments an object, the reasoning as
    `thinking`, the result by tool name) renders the same prompt."""
    import httpx

    question = [{"role": "user", "content": "Lights in the hall?"}]
    tools = kwargs["tools"]
    reply = client.chat.completions.create(model=model, messages=question, **kwargs).choices[0].message
    assert reply.tool_calls
    call = reply.tool_calls[0]
    answered = [*question, reply, {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    base = client.chat.completions.create(model=model, messages=question, tools=tools, max_tokens=1)
    after = client.chat.completions.create(model=model, messages=answered, tools=tools, max_tokens=1)
    assert base.usage is not None and after.usage is not None
    assert after.usage.prompt_tokens > base.usage.prompt_tokens + len(call_text + "done")
    arguments = json.loads(call.function.arguments)
    thinking = {"thinking": reply.reasoning_content} if getattr(reply, "reasoning_content", None) else {}
    body = {"model": model, "stream": False, "tools": tools, "options": {"num_predict": 1},
            "messages": [*question, {"role": "assistant", "content": "", **thinking,
                                     "tool_calls": [{"function": {"name": call.function.name, "arguments": arguments}}]},
                         {"role": "tool", "tool_name": call.function.name, "content": "done"}]}
    response = httpx.post(f"http://127.0.0.1:{port}/api/chat", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["prompt_eval_count"] == after.usage.prompt_tokens


# A python model for the response cache: OUT = IN * the request parameter `factor` (2 if
# none), RUNS = how many requests it has run; a negative first element is an error response.
CACHED_MODEL = '''\
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.runs = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            self.runs += 1
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if x.reshape(-1)[0] < 0:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input")))
                continue
            factor = json.loads(request.parameters()).get("factor", 2)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", (x * factor).astype(np.float32)),
                pb_utils.Tensor("RUNS", np.full(x.shape, self.runs, np.int32)),
            ]))
        return responses
'''


def cached_model(repo: Path, name: str, *, max_batch_size: int = 0,
                 extra: str = "response_cache { enable: true }\n") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(CACHED_MODEL)
    (repo / name / "config.pbtxt").write_text(
        f'backend: "python"\nmax_batch_size: {max_batch_size}\n'
        'input [{ name: "IN" data_type: TYPE_FP32 dims: [ 2 ] }]\n'
        'output [{ name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "RUNS" data_type: TYPE_INT32 dims: [ 2 ] }]\n'
        "instance_group [{ kind: KIND_CPU count: 1 }]\n" + extra
    )


# ---------------------------------------------------------------------------- timed executions (the rate limiter)

# Sleeps X seconds; answers when its execution began and ended.
TIMED = """\
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        began = time.monotonic()
        time.sleep(float(pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()[0]))
        times = np.array([began, time.monotonic()], dtype=np.float64)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", times)]) for _ in requests]
"""

# The same, as a decoupled model: one response, then the final flag.
TIMED_DECOUPLED = """\
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            began = time.monotonic()
            time.sleep(float(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0]))
            times = np.array([began, time.monotonic()], dtype=np.float64)
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", times)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def timed_model(repo: Path, name: str, limiter: str, extra: str = "", source: str = TIMED) -> None:
    """A python model that sleeps X seconds and answers [began, ended]; `limiter`: its instance
    group's rate_limiter block."""
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(
        'backend: "python"\n'
        'input [{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP64 dims: [ 2 ] }]\n'
        f"instance_group [{{ kind: KIND_CPU count: 1 {limiter} }}]\n" + extra
    )


def run_together(post: Callable[[str, dict[str, Any]], Any], models: list[str], seconds: float) -> list[tuple[float, float]]:
    """One request to each model at once; each execution's (began, ended)."""
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [seconds]}]}
    times: list[tuple[float, float]] = [(0.0, 0.0)] * len(models)
    barrier = threading.Barrier(len(models))

    def one(index: int) -> None:
        barrier.wait()
        data = post(models[index], body)["outputs"][0]["data"]
        times[index] = (data[0], data[1])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return times


def most_at_once(times: list[tuple[float, float]]) -> int:
    """The most executions that ran at the same moment."""
    return max(sum(began <= start < ended for began, ended in times) for start, _ in times)


def priority_order(post: Callable[[str, dict[str, Any]], Any]) -> list[str]:
    """Models `p1` and `p2` (rate limiter priorities 1 and 2) have run once each; while `holder`
    holds the one copy of their resource, `p2` asks, then `p1`: the order they then run in."""
    def body(seconds: float) -> dict[str, Any]:
        return {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [seconds]}]}

    for model in ("p1", "p2"):
        post(model, body(0.0))
    began: dict[str, float] = {}

    def run(model: str, seconds: float) -> None:
        began[model] = post(model, body(seconds))["outputs"][0]["data"][0]

    threads = []
    for model, seconds, pause in (("holder", 1.0, 0.3), ("p2", 0.0, 0.3), ("p1", 0.0, 0.0)):
        threads.append(threading.Thread(target=run, args=(model, seconds)))
        threads[-1].start()
        time.sleep(pause)
    for thread in threads:
        thread.join()
    return sorted(("p1", "p2"), key=began.__getitem__)
