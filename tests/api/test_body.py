"""Request bodies: size caps before and after decompression, decompression off the loop."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import pytest

from daemon.api.body import BodyTooLarge, inflate
from daemon.errors import InvalidArgument
from support import python_model


def test_inflate_caps_the_output_not_just_the_input() -> None:
    bomb = gzip.compress(b"\0" * (10 * 1024 * 1024))
    assert len(bomb) < 20_000
    with pytest.raises(BodyTooLarge, match=r"exceeds the maximum allowed input size of 1048576 bytes \(after gzip"):
        inflate(bomb, "gzip", 1024 * 1024)
    assert inflate(gzip.compress(b"abc"), "gzip", 10) == b"abc"
    # deflate: both the zlib-wrapped and the raw form, as HTTP clients send either.
    assert inflate(zlib.compress(b"abc"), "deflate", 10) == b"abc"
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert inflate(raw.compress(b"abc") + raw.flush(), "deflate", 10) == b"abc"
    with pytest.raises(InvalidArgument, match="not valid gzip data"):
        inflate(b"not gzip", "gzip", 10)
    with pytest.raises(InvalidArgument, match="gzip body is truncated"):
        inflate(gzip.compress(b"abc" * 100)[:-10], "gzip", 1000)


def test_gzip_bomb_and_bad_encodings_over_the_socket(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x + 1")
    config = tmp_path / "edged.toml"
    config.write_text("[server]\nmax-request-bytes = 1048576\n")
    daemon = start_daemon("--config", str(config), "--model-repository", str(repo))
    bomb = gzip.compress(b" " * (64 * 1024 * 1024))
    reply = daemon.request("POST", "/v2/models/m/infer", bomb,
                           {"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert reply.status == 400
    assert reply.json()["error"] == (
        "request size exceeds the maximum allowed input size of 1048576 bytes (after gzip decoding)"
    )
    reply = daemon.request("POST", "/v2/models/m/infer", b"xx", {"Content-Encoding": "br"})
    assert reply.status == 501 and reply.json() == {"error": "Unsupported compression type"}  # Triton's
    good = {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    reply = daemon.request("POST", "/v2/models/m/infer", gzip.compress(json.dumps(good).encode()),
                           {"Content-Encoding": "gzip"})
    assert reply.status == 200 and reply.json()["outputs"][0]["data"] == [2.0]


def test_large_binary_bodies_arrive_whole_and_aligned(start_daemon, tmp_path: Path) -> None:
    """A large binary body is read into one buffer (daemon.api.body.read_tensor_body): whatever the
    JSON header's length, the model sees the exact values as an aligned, read-only array."""
    import numpy as np

    repo = tmp_path / "repo"
    python_model(repo, "m", "y = np.append(x + 1, [float(x.flags.aligned), float(x.flags.writeable)])")
    daemon = start_daemon("--model-repository", str(repo))
    values = np.arange(300_000, dtype=np.float32)  # 1.2 MB, many socket reads
    raw = values.tobytes()
    for pad in ("", " ", "  ", "   "):  # header lengths of every residue mod 4
        header = json.dumps({"inputs": [{"name": "X", "shape": [values.size], "datatype": "FP32",
                                         "parameters": {"binary_data_size": len(raw)}}]}) + pad
        reply = daemon.request("POST", "/v2/models/m/infer", header.encode() + raw,
                               {"Inference-Header-Content-Length": str(len(header))})
        assert reply.status == 200, reply.body
        out = np.asarray(reply.json()["outputs"][0]["data"], dtype=np.float32)
        np.testing.assert_array_equal(out[:-2], values + 1)
        assert out[-2:].tolist() == [1.0, 0.0]  # aligned, read-only
    # The raw form (the whole body is the one input) takes the same path.
    reply = daemon.request("POST", "/v2/models/m/infer", raw, {"Inference-Header-Content-Length": "0"})
    assert reply.status == 200, reply.body
    json_length = int({k.lower(): v for k, v in reply.headers.items()}["inference-header-content-length"])
    out = np.frombuffer(reply.body[json_length:], dtype="<f4")  # a raw request is answered in binary
    np.testing.assert_array_equal(out[:-2], values + 1)
    assert out[-2:].tolist() == [1.0, 0.0]
    # A header length past the body's end is still the codec's 400.
    reply = daemon.request("POST", "/v2/models/m/infer", raw,
                           {"Inference-Header-Content-Length": str(len(raw) + 1)})
    assert reply.status == 400
    assert reply.json()["error"] == "inference header size should be in range (0, 1200000), got: 1200001"
