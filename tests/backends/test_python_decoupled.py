"""The python backend's Triton parity pieces, driven directly: response senders (decoupled and
not), streaming with cancellation, auto_complete_config and its validation, BLS without a
registry, and pb_utils.ModelConfig's rules. The daemon-level behaviour over a socket is in
tests/api/test_python_models.py."""

from __future__ import annotations

import contextlib
import shutil
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from daemon.backend import Backend, Device, InferRequest, InferResponse, InstanceContext
from daemon.errors import BackendError, ConfigError, EdgedError, InvalidArgument, Unsupported
from daemon.model_config import ModelConfig, TensorConfig, TransactionPolicy

ClassOf = Callable[[str], type[Backend]]
MODELS = Path(__file__).resolve().parent.parent / "python_models"


def copy_model(repo: Path, name: str) -> Path:
    version_dir = repo / name / "1"
    version_dir.mkdir(parents=True)
    shutil.copy(MODELS / name / "model.py", version_dir / "model.py")
    return version_dir


def write_model(repo: Path, name: str, source: str) -> Path:
    version_dir = repo / name / "1"
    version_dir.mkdir(parents=True)
    (version_dir / "model.py").write_text(textwrap.dedent(source), encoding="utf-8")
    return version_dir


def mock_llm_config() -> ModelConfig:
    return ModelConfig(
        name="mock_llm",
        backend="python",
        input=[
            TensorConfig(name="PROMPT", data_type="BYTES", dims=[1, 1]),
            TensorConfig(name="STREAM", data_type="BOOL", dims=[1, 1]),
        ],
        output=[TensorConfig(name="TEXT", data_type="BYTES", dims=[1, -1])],
        model_transaction_policy=TransactionPolicy(decoupled=True),
    )


def llm_request(prompt: str, stream: bool, **parameters: object) -> InferRequest:
    return InferRequest(
        {
            "PROMPT": np.array([[prompt.encode()]], dtype=np.object_),
            "STREAM": np.array([[stream]]),
        },
        parameters=dict(parameters),
    )


async def load(cls: type[Backend], config: ModelConfig, artifact: Path) -> Backend:
    backend = cls(InstanceContext(config.name, 1))
    await backend.load(config, artifact, Device("cpu"))
    return backend


def text_of(result: object) -> str:
    assert isinstance(result, InferResponse), result
    return result.outputs["TEXT"].item().decode()


# --------------------------------------------------------------------------- decoupled


async def test_stream_yields_every_response_then_ends(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    backend = await load(
        backend_class("python"), mock_llm_config(), copy_model(tmp_path, "mock_llm")
    )
    results = [r async for r in backend.execute_stream(llm_request("a b c", True, ERROR_AT=1))]
    final_error = [r async for r in backend.execute_stream(llm_request("a", True, FAIL_LAST=True))]
    await backend.unload()
    assert text_of(results[0]) == "a" and text_of(results[2]) == "c"
    assert isinstance(results[1], BackendError) and results[1].message == "bad token 1"
    assert len(results) == 3
    # The final response's error keeps its code: INVALID_ARG is a client error.
    assert text_of(final_error[0]) == "a"
    assert isinstance(final_error[1], InvalidArgument)
    assert final_error[1].message == "An Error Occurred"
    assert backend.streams_active == 0


async def test_execute_takes_exactly_one_response(backend_class: ClassOf, tmp_path: Path) -> None:
    backend = await load(
        backend_class("python"), mock_llm_config(), copy_model(tmp_path, "mock_llm")
    )
    one, three, none = await backend.execute(
        [llm_request("x y", False), llm_request("x y z", True), llm_request("x", True, COUNT=0)]
    )
    await backend.unload()
    assert text_of(one) == "x"
    assert isinstance(three, Unsupported) and three.status == 501
    assert "model 'mock_llm' gave 3 responses" in three.message
    assert isinstance(none, Unsupported) and "gave 0 responses" in none.message


async def test_closing_the_stream_cancels_the_request(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    config = ModelConfig(
        name="slow_stream",
        backend="python",
        input=[TensorConfig(name="MARKER", data_type="BYTES", dims=[1])],
        output=[TensorConfig(name="N", data_type="INT32", dims=[1])],
        model_transaction_policy=TransactionPolicy(decoupled=True),
    )
    backend = await load(backend_class("python"), config, copy_model(tmp_path, "slow_stream"))
    marker = tmp_path / "marker"
    request = InferRequest({"MARKER": np.array([str(marker).encode()], dtype=np.object_)})
    seen = []
    async with contextlib.aclosing(backend.execute_stream(request)) as results:
        async for result in results:
            assert isinstance(result, InferResponse)
            seen.append(int(result.outputs["N"].item()))
            if len(seen) == 2:
                break
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        await __import__("asyncio").sleep(0.02)
    await backend.unload()
    assert seen == [0, 1]
    assert marker.read_text().startswith("cancelled after ")
    assert backend.streams_active == 0


SENDER_MODEL = """
    import json

    import numpy as np
    import triton_python_backend_utils as pb_utils

    FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


    class TritonPythonModel:
        def execute(self, requests):
            mode = json.loads(requests[0].parameters()).get("mode")
            if mode == "list":
                return [pb_utils.InferenceResponse([]) for _ in requests]
            if mode == "raise":
                raise pb_utils.TritonModelException("model gave up")
            for request in requests:
                sender = request.get_response_sender()
                x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
                if mode == "bad_flags":
                    try:
                        sender.send(None)
                    except pb_utils.TritonModelException as exc:
                        x = np.array([len(str(exc))], dtype=np.float32)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 1)]), flags=FINAL)
            return None
"""


def sender_config(decoupled: bool) -> ModelConfig:
    return ModelConfig(
        name="sender",
        backend="python",
        max_batch_size=4,
        input=[TensorConfig(name="X", data_type="FP32", dims=[1])],
        output=[TensorConfig(name="Y", data_type="FP32", dims=[1])],
        model_transaction_policy=TransactionPolicy(decoupled=decoupled),
    )


def x_request(mode: str = "") -> InferRequest:
    return InferRequest({"X": np.array([[1.0]], dtype=np.float32)}, parameters={"mode": mode})


async def test_non_decoupled_model_may_answer_through_the_sender(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    # Triton lets a non-decoupled model return None and send exactly one response per request.
    backend = await load(
        backend_class("python"), sender_config(False), write_model(tmp_path, "sender", SENDER_MODEL)
    )
    results = await backend.execute([x_request(), x_request()])
    streamed = [r async for r in backend.execute_stream(x_request())]
    listed = [r async for r in backend.execute_stream(x_request("list"))]
    await backend.unload()
    for result in [*results, *streamed]:
        assert isinstance(result, InferResponse) and result.outputs["Y"].tolist() == [[2.0]]
    assert len(listed) == 1 and isinstance(listed[0], InferResponse)


async def test_decoupled_model_must_return_none_and_raises_end_the_stream(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    backend = await load(
        backend_class("python"), sender_config(True), write_model(tmp_path, "sender", SENDER_MODEL)
    )
    [listed] = await backend.execute([x_request("list")])
    streamed = [r async for r in backend.execute_stream(x_request("list"))]
    raised = [r async for r in backend.execute_stream(x_request("raise"))]
    [bad] = [r async for r in backend.execute_stream(x_request("bad_flags"))]
    await backend.unload()
    for error in (listed, *streamed):
        assert isinstance(error, BackendError) and "execute must return None" in error.message
    assert len(streamed) == 1
    assert len(raised) == 1 and isinstance(raised[0], BackendError)
    assert "TritonModelException: model gave up" in raised[0].message
    # send(None) without the final flag is refused to the model (the length of the message).
    assert isinstance(bad, InferResponse) and bad.outputs["Y"].item() > 10


async def test_bls_without_a_registry_is_a_model_error(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    source = """
        import threading

        import triton_python_backend_utils as pb_utils


        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for request in requests:
                    errors = []
                    for call in (self._here, self._thread):
                        try:
                            call()
                        except pb_utils.TritonModelException as exc:
                            errors.append(str(exc))
                    out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(" | ".join(errors))))
                return out

            def _here(self):
                pb_utils.InferenceRequest(model_name="other", inputs=[]).exec()

            def _thread(self):
                caught = []

                def run():
                    try:
                        pb_utils.InferenceRequest(model_name="other", inputs=[]).exec()
                    except pb_utils.TritonModelException as exc:
                        caught.append(exc)

                thread = threading.Thread(target=run)
                thread.start()
                thread.join()
                raise caught[0]
    """
    backend = await load(
        backend_class("python"), sender_config(False), write_model(tmp_path, "sender", source)
    )
    [result] = await backend.execute([x_request()])
    await backend.unload()
    assert isinstance(result, EdgedError)
    here, thread = result.message.split(" | ")
    assert "BLS calls are not available" in here
    assert "must be called from the thread running the model's execute" in thread


# --------------------------------------------------------------------------- auto_complete_config


async def test_autocomplete_fills_the_config(
    backend_class: ClassOf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EDGED_TEST_AUTOCOMPLETE", raising=False)
    version_dir = copy_model(tmp_path, "auto_complete")
    written = ModelConfig(
        name="auto_complete", input=[TensorConfig(name="INPUT0", data_type="FP32", dims=[4])]
    )
    config = backend_class("python").autocomplete(written, version_dir)
    assert config.max_batch_size == 4
    assert config.dynamic_batching is not None
    assert [(t.name, t.data_type, t.dims) for t in config.input] == [
        ("INPUT0", "FP32", [4]),
        ("INPUT1", "FP32", [4]),
    ]
    assert [t.name for t in config.output] == ["OUTPUT0", "OUTPUT1"]
    assert not config.model_transaction_policy.decoupled
    # The module imported for auto-complete is gone again.
    assert not [m for m in sys.modules if m.startswith("edged_python_autocomplete_")]


@pytest.mark.parametrize(
    ("mode", "error", "expected"),
    [
        ("bad_type", ConfigError, r"auto_complete_config.*TYPE_NOT_A_TYPE"),
        (
            "raise",
            BackendError,
            r"auto_complete_config raised ValueError: unable to load model 'auto_complete', "
            r"configuration expects datatype TYPE_FP32 for input 'INPUT0', model provides TYPE_INT8",
        ),
    ],
)
async def test_autocomplete_result_is_validated(
    backend_class: ClassOf,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    error: type[Exception],
    expected: str,
) -> None:
    monkeypatch.setenv("EDGED_TEST_AUTOCOMPLETE", mode)
    version_dir = copy_model(tmp_path, "auto_complete")
    with pytest.raises(error, match=expected):
        backend_class("python").autocomplete(ModelConfig(name="auto_complete"), version_dir)


# What Triton's L0_model_config autofill cases check for python models, with our own models:
# (written config.pbtxt lines, body of auto_complete_config, the error message expected).
F4 = '{"name": "%s", "data_type": "TYPE_FP32", "dims": [4]}'
AUTOCOMPLETE_ERRORS = {
    "conflicting_max_batch_size": (
        "max_batch_size: 6",
        "c.set_max_batch_size(4)",
        "configuration specified max_batch_size 6, but in auto-complete-config function for "
        "model 'conflicting_max_batch_size' specified max_batch_size 4",
    ),
    "input_mismatch_datatype": (
        'input [{ name: "I" data_type: TYPE_INT32 dims: [4] }]',
        "c.add_input(%s)" % (F4 % "I"),
        "unable to load model 'input_mismatch_datatype', configuration expects datatype "
        "TYPE_INT32 for input 'I', model provides TYPE_FP32",
    ),
    "output_mismatch_dims": (
        'output [{ name: "O" data_type: TYPE_FP32 dims: [16] }]',
        "c.add_output(%s)" % (F4 % "O"),
        "model 'output_mismatch_dims', tensor 'O': the model expects dims [4] but the model "
        "configuration specifies dims [16]",
    ),
    "input_missing_dims": (
        "",
        'c.add_input({"name": "I", "data_type": "TYPE_FP32"})',
        "input 'I' in auto-complete-config function for model 'input_missing_dims' is missing "
        "'dims' property.",
    ),
    "output_missing_name": (
        "",
        'c.add_output({"data_type": "TYPE_FP32", "dims": [1]})',
        "output in auto-complete-config function for model 'output_missing_name' is missing "
        "'name' property.",
    ),
    "input_wrong_property": (
        "",
        'c.add_input({"name": "I", "data_type": "TYPE_FP32", "dims": [1], "shape": [1]})',
        "input 'I' in auto-complete-config function for model 'input_wrong_property' contains "
        "property other than 'name', 'data_type', 'dims' and 'optional'.",
    ),
    "output_wrong_property": (
        "",
        'c.add_output({"name": "O", "data_type": "TYPE_FP32", "dims": [1], "optional": True})',
        "output 'O' in auto-complete-config function for model 'output_wrong_property' contains "
        "property other than 'name', 'data_type' and 'dims'.",
    ),
    "policy_invalid_args": (
        "",
        'c.set_model_transaction_policy({"invalid": "argument"})',
        "model transaction property in auto-complete-config function for model "
        "'policy_invalid_args' contains property other than 'decoupled'",
    ),
    "policy_mismatch": (
        "model_transaction_policy { decoupled: true }",
        'c.set_model_transaction_policy({"decoupled": False})',
        "trying to change decoupled property in auto-complete-config for model "
        "'policy_mismatch', which is already set to 'True'",
    ),
    "no_return": (
        "",
        "return None",
        "auto_complete_config function in model 'no_return' must return a valid pb.ModelConfig object.",
    ),
}


@pytest.mark.parametrize("name", sorted(AUTOCOMPLETE_ERRORS))
async def test_autocomplete_errors_as_triton(
    backend_class: ClassOf, tmp_path: Path, name: str
) -> None:
    from daemon.core.triton_config import parse_pbtxt

    written, body, message = AUTOCOMPLETE_ERRORS[name]
    source = (
        "class TritonPythonModel:\n"
        "    @staticmethod\n"
        "    def auto_complete_config(c):\n"
        f"        {body}\n"
        "        return c\n"
        "    def execute(self, requests):\n"
        "        return []\n"
    )
    version_dir = write_model(tmp_path, name, source)
    config, _ = parse_pbtxt(f'name: "{name}"\nbackend: "python"\n{written}\n', source="test")
    with pytest.raises(BackendError) as info:
        backend_class("python").autocomplete(config, version_dir)
    assert message in info.value.message
    assert not [m for m in sys.modules if m.startswith("edged_python_autocomplete_")]


async def test_autocomplete_may_declare_a_model_decoupled(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    source = """
        class TritonPythonModel:
            @staticmethod
            def auto_complete_config(c):
                c.set_model_transaction_policy(dict(decoupled=True))
                c.add_input({"name": "I", "data_type": "TYPE_STRING", "dims": [1], "optional": True})
                c.add_output({"name": "O", "data_type": "TYPE_INT64", "dims": [-1]})
                return c
    """
    version_dir = write_model(tmp_path, "declares", source)
    config = backend_class("python").autocomplete(ModelConfig(name="declares"), version_dir)
    assert config.model_transaction_policy.decoupled
    assert [(t.name, t.data_type, t.dims, t.optional) for t in config.input] == [
        ("I", "BYTES", [1], True)
    ]
    assert [(t.name, t.data_type, t.dims) for t in config.output] == [("O", "INT64", [-1])]


async def test_model_without_autocomplete_keeps_its_config(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    version_dir = write_model(tmp_path, "plain", "class TritonPythonModel:\n    pass\n")
    config = sender_config(False)
    assert backend_class("python").autocomplete(config, version_dir) is config


# --------------------------------------------------------------------------- response parameters


async def test_response_parameters_as_newer_triton(backend_class: ClassOf, tmp_path: Path) -> None:
    # Triton's python backend (after 2.51) takes `InferenceResponse(..., parameters={...})`:
    # str keys, bool/int/str values; anything else fails that response with INVALID_ARG.
    source = """
        import json

        import triton_python_backend_utils as pb_utils


        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for request in requests:
                    params = json.loads(request.parameters())["set"]
                    if params == "int_key":
                        params = {1: "x"}
                    try:
                        out.append(pb_utils.InferenceResponse([], parameters=params))
                    except pb_utils.TritonModelException as exc:
                        error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                        out.append(pb_utils.InferenceResponse(error=error))
                return out
    """
    backend = await load(
        backend_class("python"), sender_config(False), write_model(tmp_path, "params", source)
    )
    cases = [{"a": "1", "c": 3, "d": False}, {"f": 0.5}, ["x"], "int_key"]
    requests = [InferRequest(x_request().inputs, parameters={"set": c}) for c in cases]
    ok, float_value, listed, int_key = await backend.execute(requests)
    await backend.unload()
    assert isinstance(ok, InferResponse) and ok.parameters == {"a": "1", "c": 3, "d": False}
    assert isinstance(float_value, InvalidArgument)
    assert float_value.message == (
        "Expect parameters values to have type bool/int/str, found type <class 'float'>"
    )
    assert isinstance(listed, InvalidArgument) and listed.message.endswith("got <class 'list'>")
    assert isinstance(int_key, InvalidArgument)
    assert int_key.message == "Expect parameters keys to have type str, found type <class 'int'>"


# --------------------------------------------------------------------------- unload, contract


def slow_stream_config() -> ModelConfig:
    return ModelConfig(
        name="slow_stream",
        backend="python",
        input=[TensorConfig(name="MARKER", data_type="BYTES", dims=[1])],
        output=[TensorConfig(name="N", data_type="INT32", dims=[1])],
        model_transaction_policy=TransactionPolicy(decoupled=True),
    )


async def test_unload_cancels_open_streams_then_ends_them(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    import asyncio

    cls = backend_class("python")
    backend = await load(cls, slow_stream_config(), copy_model(tmp_path, "slow_stream"))
    backend.stream_drain_seconds = 0.1  # type: ignore[attr-defined]
    marker = tmp_path / "marker"
    request = InferRequest({"MARKER": np.array([str(marker).encode()], dtype=np.object_)})
    first = asyncio.Event()
    results: list[object] = []

    async def consume() -> None:
        async for result in backend.execute_stream(request):
            results.append(result)
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 30)
    await backend.unload()
    await asyncio.wait_for(task, 30)
    # The model saw the cancellation and sent its final flag itself: no error in the stream.
    assert marker.read_text().startswith("cancelled after ")
    assert results and all(isinstance(r, InferResponse) for r in results)

    # A model that ignores cancellation: its stream is ended for it after the grace period.
    source = """
        class TritonPythonModel:
            def execute(self, requests):
                self.kept = [r.get_response_sender() for r in requests]
                return None
    """
    config = slow_stream_config()
    config.name = "stuck"
    stuck = await load(cls, config, write_model(tmp_path, "stuck", source))
    stuck.stream_drain_seconds = stuck.stream_cancel_grace_seconds = 0.05  # type: ignore[attr-defined]
    stream = stuck.execute_stream(request)
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.05)
    await stuck.unload()
    ended = await asyncio.wait_for(pending, 30)
    assert isinstance(ended, EdgedError) and ended.status == 503
    assert ended.message == "model 'stuck' was unloaded"


def test_execute_stream_is_checked_at_registration() -> None:
    from daemon.core.plugins import check_backend_class

    class Wrong(Backend):
        async def execute_stream(self):  # type: ignore[override]
            yield None

    class Right(Backend):
        async def execute_stream(self, request):  # type: ignore[override]
            yield request

    assert check_backend_class(Wrong).startswith("method 'execute_stream': takes 0 argument(s)")
    assert check_backend_class(Right) == ""
