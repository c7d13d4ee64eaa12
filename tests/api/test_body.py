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
