"""The demo/test model builders: valid ONNX, the numbers they promise, a loadable repository."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import model_builders as demo
import numpy as np
import pytest

from daemon.core.layout import read_model_config

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def session(path: Path) -> Any:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_simple_onnx_is_tritons_simple(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    demo.build_simple_onnx(path)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert model.ir_version == demo.IR_VERSION == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 13)]
    sess = session(path)
    assert [(i.name, i.type) for i in sess.get_inputs()] == [
        ("INPUT0", "tensor(int32)"),
        ("INPUT1", "tensor(int32)"),
    ]
    assert [i.shape for i in sess.get_inputs()] == [["batch", 16], ["batch", 16]]
    a = np.arange(48, dtype=np.int32).reshape(3, 16)
    b = np.full((3, 16), 7, dtype=np.int32)
    out0, out1 = sess.run(["OUTPUT0", "OUTPUT1"], {"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(out0, a + b)
    np.testing.assert_array_equal(out1, a - b)


def test_simple_onnx_without_batching_has_fixed_shape(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    demo.build_simple_onnx(path, max_batch=False)
    assert [i.shape for i in session(path).get_inputs()] == [[1, 16], [1, 16]]


def test_simple_repository_layout_and_configs(tmp_path: Path) -> None:
    demo.write_simple_repository(tmp_path)
    assert (tmp_path / "simple" / "1" / "model.onnx").is_file()
    assert (tmp_path / "simple_python" / "1" / "model.py").is_file()

    simple, warnings = read_model_config(tmp_path / "simple")
    assert warnings == []
    assert (simple.name, simple.platform, simple.max_batch_size) == (
        "simple",
        "onnxruntime_onnx",
        8,
    )
    assert [(t.name, t.data_type, t.dims) for t in simple.input + simple.output] == [
        (name, "INT32", [16]) for name in ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1")
    ]
    python, warnings = read_model_config(tmp_path / "simple_python")
    assert warnings == []
    assert (python.name, python.backend, python.max_batch_size) == ("simple_python", "python", 8)
    assert python.input == simple.input and python.output == simple.output

    source = (tmp_path / "simple_python" / "1" / "model.py").read_text()
    tree = ast.parse(source)
    assert "TritonPythonModel" in [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    assert "import triton_python_backend_utils as pb_utils" in source


def test_simple_repository_without_python(tmp_path: Path) -> None:
    demo.write_simple_repository(tmp_path, python=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["simple"]


def test_mlp_weights_reproduce_the_model(tmp_path: Path) -> None:
    path = tmp_path / "mlp.onnx"
    weights = demo.build_mlp_onnx(path, width=8, depth=3, seed=4)
    assert len(weights) == 3
    assert all(w.shape == (8, 8) and b.shape == (8,) and w.dtype == np.float32 for w, b in weights)
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    [got] = session(path).run(["OUTPUT0"], {"INPUT0": x})
    expected = demo.mlp_reference(x, weights)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # The hidden ReLUs matter: without them the result differs.
    linear = x
    for w, b in weights:
        linear = linear @ w + b
    assert not np.allclose(expected, linear)


def test_mlp_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = demo.build_mlp_onnx(tmp_path / "a.onnx", 4, 2, seed=1)
    b = demo.build_mlp_onnx(tmp_path / "b.onnx", 4, 2, seed=1)
    c = demo.build_mlp_onnx(tmp_path / "c.onnx", 4, 2, seed=2)
    assert all(
        np.array_equal(x, y)
        for (wa, ba), (wb, bb) in zip(a, b, strict=True)
        for x, y in ((wa, wb), (ba, bb))
    )
    assert not np.array_equal(a[0][0], c[0][0])
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()


def test_mlp_rejects_empty_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="width"):
        demo.build_mlp_onnx(tmp_path / "x.onnx", width=0, depth=1)


def test_dtype_zoo_has_every_datatype(tmp_path: Path) -> None:
    path = tmp_path / "zoo.onnx"
    names = demo.build_dtype_zoo_onnx(path)
    assert tuple(names) == demo.ZOO_DATATYPES
    sess = session(path)
    types = {i.name: i.type for i in sess.get_inputs()}
    assert types["INPUT_FP16"] == "tensor(float16)"
    assert types["INPUT_BYTES"] == "tensor(string)"
    assert types["INPUT_BOOL"] == "tensor(bool)"
    assert len(types) == len(demo.ZOO_DATATYPES) == 13
    assert {o.name for o in sess.get_outputs()} == {o for _, o in names.values()}


def test_shipped_demo_repository_is_what_the_builders_write(tmp_path: Path) -> None:
    """daemon/demo_models (package data, served with no flags) and the test builders agree."""
    shipped = Path(__file__).resolve().parent.parent / "daemon" / "demo_models"
    demo.write_simple_repository(tmp_path)
    for relative in ("simple/config.pbtxt", "simple_python/config.pbtxt", "simple_python/1/model.py"):
        assert (shipped / relative).read_text() == (tmp_path / relative).read_text(), relative
    assert onnx.load(str(shipped / "simple/1/model.onnx")) == onnx.load(str(tmp_path / "simple/1/model.onnx"))
