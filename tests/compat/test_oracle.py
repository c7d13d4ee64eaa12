"""Differential test: every corpus request goes to real Triton 2.51 and to edged; the answers
must agree (see compat/corpus.py for how far). Run with `make compat`.

With EDGED_COMPAT_DUMP=<file>, both answers of every case are appended to that file as JSON
lines, to read what Triton says where a case fails.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from compat.corpus import Case, cases
from compat.servers import Reply, Server

CASES = cases()


def _dump(case: Case, theirs: Reply, ours: Reply) -> None:
    path = os.environ.get("EDGED_COMPAT_DUMP")
    if not path:
        return
    def show(reply: Reply) -> dict[str, object]:
        return {"status": reply.status, "ihcl": reply.headers.get("inference-header-content-length"),
                "content-type": reply.headers.get("content-type"), "body": reply.body[:600].decode("latin-1")}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": case.id, "triton": show(theirs), "edged": show(ours)}) + "\n")


def _split(reply: Reply) -> tuple[dict[str, Any], bytes]:
    length = reply.headers.get("inference-header-content-length")
    if length is None:
        return json.loads(reply.body), b""
    n = int(length)
    return json.loads(reply.body[:n]), reply.body[n:]


def _tensors(reply: Reply) -> dict[str, tuple[str, list[int], str, object]]:
    """name -> (datatype, shape, 'json'|'binary', data) with binary data as raw bytes."""
    header, rest = _split(reply)
    found: dict[str, tuple[str, list[int], str, object]] = {}
    offset = 0
    for output in header["outputs"]:
        size = (output.get("parameters") or {}).get("binary_data_size")
        if size is None:
            found[output["name"]] = (output["datatype"], output["shape"], "json", output["data"])
        else:
            found[output["name"]] = (output["datatype"], output["shape"], "binary", rest[offset : offset + size])
            offset += size
    assert offset == len(rest), "binary bytes not claimed by any output"
    return found


def _compare_error(case: Case, theirs: Reply, ours: Reply) -> None:
    their_text = json.loads(theirs.body)["error"] if theirs.body else ""
    body = json.loads(ours.body) if ours.body else {}
    if their_text:
        assert set(body) == {"error"} and isinstance(body["error"], str), ours.body
    our_text = body.get("error", "")
    for needle in case.needles:
        assert needle in their_text, f"corpus needle {needle!r} not in Triton's {their_text!r}"
        assert needle in our_text, f"{needle!r} missing from {our_text!r} (Triton: {their_text!r})"


def _compare_success(case: Case, theirs: Reply, ours: Reply) -> None:
    if not theirs.body:
        assert not ours.body, ours.body
        return
    if theirs.headers.get("content-type", "").startswith("text/event-stream"):
        assert ours.headers.get("content-type", "").startswith("text/event-stream"), ours.headers
        assert ours.body == theirs.body
        return
    if case.index_without is not None:
        def rows(body: bytes) -> list[tuple[str, str, str]]:
            return [(r["name"], r.get("version", ""), "UNAVAILABLE" if r.get("state") == "UNLOADING" else r.get("state", ""))
                    for r in json.loads(body) if r["name"] not in case.index_without]
        assert rows(ours.body) == rows(theirs.body)
        return
    if case.keys is not None:
        their_json, our_json = json.loads(theirs.body), json.loads(ours.body)
        if isinstance(their_json, list):
            assert our_json == their_json
        else:
            assert {k: our_json.get(k) for k in case.keys} == {k: their_json.get(k) for k in case.keys}
        return
    if case.path.endswith("/infer"):
        # Same header semantics: binary answers iff Triton's is.
        assert ("inference-header-content-length" in ours.headers) == (
            "inference-header-content-length" in theirs.headers), ours.headers
        their_header, _ = _split(theirs)
        our_header, _ = _split(ours)
        for key in ("model_name", "model_version", "id"):
            assert our_header.get(key) == their_header.get(key), key
        their_tensors, our_tensors = _tensors(theirs), _tensors(ours)
        assert list(our_tensors) == list(their_tensors) or set(our_tensors) == set(their_tensors)
        for name, (datatype, shape, kind, data) in their_tensors.items():
            o_datatype, o_shape, o_kind, o_data = our_tensors[name]
            assert (o_datatype, o_shape, o_kind) == (datatype, shape, kind), name
            if kind == "json" and datatype in ("FP32", "FP64"):
                np.testing.assert_array_equal(np.array(o_data, dtype=np.float64), np.array(data, dtype=np.float64))
            else:
                assert o_data == data, name
        return
    assert json.loads(ours.body) == json.loads(theirs.body)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_same_answer(case: Case, triton: Server, edged: Server) -> None:
    theirs = triton.request(case.method, case.path, case.body, case.headers, chunked=case.chunked)
    ours = edged.request(case.method, case.path, case.body, case.headers, chunked=case.chunked)
    _dump(case, theirs, ours)
    if case.deviation is not None:
        # Triton's own answer must still be what the deviation describes, or it is stale.
        assert theirs.status != case.deviation[0] or theirs.body != ours.body
        assert ours.status == case.deviation[0], (ours.status, ours.body, "Triton:", theirs.status, theirs.body)
        if ours.status >= 400:
            text = json.loads(ours.body)["error"]
            for needle in case.needles:
                assert needle in text, (needle, text)
        return
    assert ours.status == theirs.status, (
        f"edged {ours.status} {ours.body[:300]!r}; Triton {theirs.status} {theirs.body[:300]!r}")
    if theirs.status >= 400:
        _compare_error(case, theirs, ours)
    else:
        _compare_success(case, theirs, ours)


def test_oversized_request(triton: Server, edged: Server) -> None:
    """64 MiB is both servers' default cap. Triton 2.51 fails the body with a 500 (its JSON
    parser gives up); Triton >= 2.58 answers 400 "... exceeds the maximum allowed input size",
    which edged follows (docs/compatibility.md)."""
    body = b" " * (64 * 1024 * 1024 + 1)
    theirs = triton.request("POST", "/v2/models/add_sub/infer", body, {"Content-Type": "application/json"})
    ours = edged.request("POST", "/v2/models/add_sub/infer", body, {"Content-Type": "application/json"})
    assert theirs.status >= 400
    assert ours.status == 400, ours.body
    assert "exceeds the maximum allowed input size" in json.loads(ours.body)["error"]


def test_instance_group_names(triton: Server, edged: Server) -> None:
    """Triton names an unnamed instance group <model>_<index> in the config it serves, and
    spells out its host policy (none set: "")."""
    path = "/v2/models/add_sub/config"
    theirs = json.loads(triton.request("GET", path, None, {}).body)["instance_group"]
    ours = json.loads(edged.request("GET", path, None, {}).body)["instance_group"]
    assert [g["name"] for g in ours] == [g["name"] for g in theirs] == ["add_sub_0"]
    assert [g["host_policy"] for g in ours] == [g["host_policy"] for g in theirs] == [""]


def test_served_configs_are_tritons(triton: Server, edged: Server) -> None:
    """`GET /v2/models/{m}/config` for every model both servers run (python models, batching
    and not, a sequence model, versioned ones): the same document as Triton 2.51 serves, once
    it has completed the config, all but its `optimization` defaults (docs/compatibility.md)."""
    from compat.models import STARTUP

    for model in STARTUP:
        theirs, ours = (json.loads(s.request("GET", f"/v2/models/{model}/config").body) for s in (triton, edged))
        theirs.pop("optimization", None)
        assert ours == theirs, model


def test_system_shared_memory_round_trip(triton: Server, edged: Server) -> None:
    """Inputs read from and outputs written to a registered POSIX region, on both servers:
    the same statuses, the same response header, the same bytes in the region."""
    region = shared_memory.SharedMemory(create=True, size=64)
    try:
        a, b = np.array([1, 2, 3, 4], np.int32), np.array([10, 20, 30, 40], np.int32)
        register = json.dumps({"key": f"/{region.name}", "offset": 0, "byte_size": 64}).encode()

        def shm(offset: int) -> dict[str, object]:
            return {"shared_memory_region": "io", "shared_memory_byte_size": 16, "shared_memory_offset": offset}

        infer = json.dumps({
            "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 4], "parameters": shm(0)},
                       {"name": "INPUT1", "datatype": "INT32", "shape": [1, 4], "parameters": shm(16)}],
            "outputs": [{"name": "OUTPUT0", "parameters": shm(32)}, {"name": "OUTPUT1", "parameters": shm(48)}],
        }).encode()
        answers = []
        for server in (triton, edged):
            region.buf[:64] = a.tobytes() + b.tobytes() + bytes(32)
            got = [server.request("POST", "/v2/systemsharedmemory/region/io/register", register,
                                  {"Content-Type": "application/json"}).status]
            reply = server.request("POST", "/v2/models/add_sub/infer", infer, {"Content-Type": "application/json"})
            got += [reply.status, json.loads(reply.body), bytes(region.buf[32:64])]
            status = json.loads(server.request("GET", "/v2/systemsharedmemory/region/io/status").body)
            got.append([{k: r[k] for k in ("name", "key", "offset", "byte_size")} for r in status])
            got.append(server.request("POST", "/v2/systemsharedmemory/region/io/unregister", b"",
                                      {"Content-Type": "application/json"}).status)
            got.append(server.request("POST", "/v2/models/add_sub/infer", infer,
                                      {"Content-Type": "application/json"}).status)
            answers.append(got)
        theirs, ours = answers
        assert theirs[3] == (a + b).tobytes() + (a - b).tobytes()
        assert ours == theirs
    finally:
        region.close()
        region.unlink()


def _shape(value: Any) -> Any:
    """The structure of a JSON value: keys and element shapes, not the numbers."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


def test_statistics_have_tritons_layout(triton: Server, edged: Server) -> None:
    """After the same requests, `/stats` has the same keys at every level on both servers."""
    body = json.dumps({"inputs": [
        {"name": n, "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]} for n in ("INPUT0", "INPUT1")]}).encode()
    layouts = []
    for server in (triton, edged):
        for _ in range(3):
            assert server.request("POST", "/v2/models/add_sub/infer", body, {"Content-Type": "application/json"}).status == 200
        stats = json.loads(server.request("GET", "/v2/models/add_sub/stats").body)
        layouts.append(_shape(stats))
    theirs, ours = layouts
    assert ours == theirs


def _metrics(server: Server) -> str:
    """The server's /metrics text (Triton's metrics port; edged's TCP listener, with its token)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.metrics_port, timeout=30)
    conn.request("GET", "/metrics", headers=server.auth)
    return conn.getresponse().read().decode()


def _start_with_cache(start: Any, repo: Path, workdir: Path, models: list[str], flags: list[str]) -> Server:
    """`start_triton` or `start_edged` with `flags`; Triton also needs its cache library's directory."""
    from compat.servers import ORACLE_ENV, _triton_root, start_triton

    if start is not start_triton:
        return start(repo, workdir, models, flags)  # type: ignore[no-any-return]
    venv = Path(os.environ[ORACLE_ENV])
    root = _triton_root(venv)
    assert root is not None
    return start_triton(venv, repo, workdir, models, [*flags, "--cache-directory", str(root / "caches")])


def _families(server: Server) -> dict[str, tuple[str, set[tuple[str, ...]]]]:
    """Prometheus family -> (type, label-name sets of its samples)."""
    text = _metrics(server)
    found: dict[str, tuple[str, set[tuple[str, ...]]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            found[name] = (kind, set())
        elif line and not line.startswith("#"):
            match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?", line)
            assert match is not None, line
            name = match.group(1)
            base = re.sub(r"_(bucket|sum|count|total)$", "", name)
            labels = tuple(sorted(pair.split("=")[0] for pair in (match.group(2) or "").split(",") if pair))
            found.setdefault(base if base in found else name, ("untyped", set()))[1].add(labels)
    return found


def test_metrics_have_tritons_families(triton: Server, edged: Server) -> None:
    """Triton's families (nv_*) with the same types and label names, so its dashboards work.
    Left out: the pinned memory pool (edged has none) and GPU families (a CPU-only oracle)."""
    theirs = {k: v for k, v in _families(triton).items() if k.startswith("nv_") and "pinned_memory" not in k}
    ours = {k: v for k, v in _families(edged).items() if k.startswith("nv_")}
    assert ours == theirs


def _samples(server: Server, model: str) -> dict[str, float]:
    out = {}
    for line in _metrics(server).splitlines():
        match = re.match(r'(nv_inference_\w+)\{(.*)\} (\S+)$', line)
        if match and f'model="{model}"' in match.group(2):
            reason = re.search(r'reason="(\w+)"', match.group(2))
            out[match.group(1) + (f"[{reason.group(1)}]" if reason else "")] = float(match.group(3))
    return out


def test_metric_counts_move_as_tritons(triton: Server, edged: Server) -> None:
    """The same requests move the same counters by the same amounts (durations aside)."""
    good = json.dumps({"inputs": [{"name": n, "datatype": "INT32", "shape": [2, 4], "data": list(range(8))}
                                  for n in ("INPUT0", "INPUT1")]}).encode()
    bad = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [2, 4], "data": list(range(8))}]}).encode()
    deltas = []
    for server in (triton, edged):
        before = _samples(server, "add_sub")
        for body in (good, good, good, bad):
            server.request("POST", "/v2/models/add_sub/infer", body, {"Content-Type": "application/json"})
        after = _samples(server, "add_sub")
        deltas.append({k: after[k] - before.get(k, 0) for k in after if "duration" not in k})
    theirs, ours = deltas
    assert theirs["nv_inference_count"] == 6 and theirs["nv_inference_request_success"] == 3
    assert ours == theirs


def test_model_errors_as_tritons(triton: Server, edged: Server) -> None:
    """An error response and an exception from execute: status, the model's text, and the
    failure counters (reason BACKEND) move alike."""
    def infer(server: Server, value: float) -> Reply:
        body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [value]}]})
        return server.request("POST", "/v2/models/faulty/infer", body.encode(), {"Content-Type": "application/json"})

    seen = []
    for server in (triton, edged):
        before = _samples(server, "faulty")
        replies = [infer(server, v) for v in (1.0, -1.0, 0.0)]
        after = _samples(server, "faulty")
        seen.append(([r.status for r in replies], {k: after[k] - before.get(k, 0) for k in after if "duration" not in k},
                     [json.loads(r.body).get("error", "") for r in replies]))
    (their_status, their_counts, their_text), (our_status, our_counts, our_text) = seen
    assert our_status == their_status
    # One deliberate difference (docs/compatibility.md): Triton 2.51 counts a request the model
    # answered with an error response as a success; edged counts it as a BACKEND failure.
    moved = {"nv_inference_request_success": -1, "nv_inference_count": -1, "nv_inference_request_failure[BACKEND]": 1}
    assert our_counts == {k: v + moved.get(k, 0) for k, v in their_counts.items()}
    assert their_counts["nv_inference_exec_count"] == 3  # an execution that raised counts too
    assert "negative input refused" in their_text[1] and "negative input refused" in our_text[1]
    assert "zero is not allowed" in their_text[2] and "zero is not allowed" in our_text[2]


def test_a_burst_beyond_the_queue_is_refused_as_tritons(triton: Server, edged: Server) -> None:
    """max_queue_size 1, one slow instance: of a burst of five, what runs and what is refused
    with which status and text (the count depends on timing, the answers must not)."""
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}).encode()
    answers = []
    for server in (triton, edged):
        with ThreadPoolExecutor(5) as pool:
            replies = list(pool.map(lambda _, s=server: s.request(
                "POST", "/v2/models/queued/infer", body, {"Content-Type": "application/json"}), range(5)))
        refused = {(r.status, json.loads(r.body)["error"]) for r in replies if r.status != 200}
        answers.append((sum(r.status == 200 for r in replies) >= 1, refused))
    theirs, ours = answers
    assert theirs[0] and ours[0] and theirs[1], theirs
    assert {status for status, _ in ours[1]} == {status for status, _ in theirs[1]}
    for _, text in ours[1]:  # Triton's text, then edged's detail
        assert text.startswith(next(iter(theirs[1]))[1]), (text, theirs[1])


def test_decoupled_statistics_as_tritons(triton: Server, edged: Server) -> None:
    """Streams of 3, 1 and 0 responses: the same counts and layout in /stats (durations aside)."""
    def counts(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: counts(v) for k, v in value.items() if k not in ("ns", "last_inference")}
        if isinstance(value, list):
            return [counts(v) for v in value]
        return value

    seen = []
    for server in (triton, edged):
        before = json.loads(server.request("GET", "/v2/models/countdown/stats").body)["model_stats"][0]
        for n in (3, 1, 0):
            server.request("POST", "/v2/models/countdown/generate_stream", json.dumps({"IN": n}).encode(),
                           {"Content-Type": "application/json"})
        # Triton records a stream's execution after its last event has gone out, and its
        # success a little after that (seen: the executions there, a success missing): poll
        # (both servers alike) until three of each show, or give up and compare what is there.
        deadline = time.monotonic() + 5
        while True:
            after = json.loads(server.request("GET", "/v2/models/countdown/stats").body)["model_stats"][0]
            done = (
                after["execution_count"] - before["execution_count"] >= 3
                and after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] >= 3
            )
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        seen.append((counts(before), counts(after)))
    (their_before, their_after), (our_before, our_after) = seen
    assert their_after["execution_count"] - their_before["execution_count"] == 3
    assert _shape(our_after) == _shape(their_after)
    for key in ("inference_count", "execution_count"):
        assert our_after[key] - our_before[key] == their_after[key] - their_before[key], key
    for key, stat in their_after["inference_stats"].items():
        assert our_after["inference_stats"][key]["count"] - our_before["inference_stats"][key]["count"] == (
            stat["count"] - their_before["inference_stats"][key]["count"]), key


def test_ensemble_statistics_as_tritons(triton: Server, edged: Server) -> None:
    """An ensemble's /stats: per successful request one execution of its batch size (1 where it
    does not batch), and compute phases that are the sums of its steps' (the step model `add_sub`
    serves `twice` alone here: their phase totals move together, on both servers). A failed
    request counts as a failure only. The same counts on both servers, durations aside."""
    def stat(server: Server, model: str) -> dict[str, Any]:
        return json.loads(server.request("GET", f"/v2/models/{model}/stats").body)["model_stats"][0]  # type: ignore[no-any-return]

    def counts(value: dict[str, Any]) -> dict[str, int]:
        """Every count of a model's statistics, by where it is (batch_stats rows by batch size)."""
        found = {"inference_count": value["inference_count"], "execution_count": value["execution_count"]}
        found |= {f"inference_stats.{k}": v["count"] for k, v in value["inference_stats"].items()}
        for row in value["batch_stats"]:
            found |= {f"batch_stats.{row['batch_size']}.{k}": v["count"] for k, v in row.items() if k != "batch_size"}
        return found

    def phases(value: dict[str, Any]) -> list[int]:
        return [value["inference_stats"][p]["ns"] for p in ("compute_input", "compute_infer", "compute_output")]

    pair = [{"name": n, "datatype": "INT32", "shape": [rows, 4], "data": [1, 2, 3, 4] * rows}
            for rows in (1, 2) for n in ("A", "B")]
    x = {"name": "X", "datatype": "FP32", "shape": [2], "data": [0, 1]}
    requests = [
        ("twice", {"inputs": pair[:2]}), ("twice", {"inputs": pair[2:]}), ("twice", {"inputs": pair[:2]}),
        ("fork", {"inputs": [x]}),  # `faulty` refuses the zero: a failure
        ("fork", {"inputs": [x], "outputs": [{"name": "kept"}]}),
    ]
    seen = []
    for server in (triton, edged):
        before = {m: stat(server, m) for m in ("twice", "add_sub", "fork")}
        statuses = [server.request("POST", f"/v2/models/{model}/infer", json.dumps(body).encode(),
                                   {"Content-Type": "application/json"}).status for model, body in requests]
        after = {m: stat(server, m) for m in ("twice", "add_sub", "fork")}
        moved = {m: [a - b for a, b in zip(phases(after[m]), phases(before[m]), strict=True)] for m in after}
        assert moved["twice"] == moved["add_sub"] and min(moved["twice"]) > 0, (server.name, moved)
        # What these requests added (the session's other tests asked these models before).
        seen.append((statuses, {m: {k: n - counts(before[m]).get(k, 0) for k, n in counts(after[m]).items()}
                                for m in ("twice", "fork")}))
    theirs, ours = seen
    assert theirs[0] == [200, 200, 200, 500, 200]
    assert ours == theirs


@pytest.mark.parametrize(("accept", "encoding"), [
    ("gzip", "gzip"), ("deflate", "deflate"), ("gzip;q=0.2, deflate;q=0.9", "deflate"),
    ("gzip, deflate, br", "gzip"), ("br, gzip", "gzip"), ("gzip;q=0.5, deflate;q=0.5", "gzip"),
    ("br", None), ("identity", None), ("gzip;q=0", None),
])
@pytest.mark.parametrize("binary", [False, True])
def test_compressed_responses_as_tritons(
    triton: Server, edged: Server, accept: str, encoding: str | None, binary: bool
) -> None:
    """Accept-Encoding: the same encoding chosen, the whole body compressed, the JSON header's
    length before compression, the same tensors once inflated."""
    import gzip
    import zlib

    outputs = [{"name": n, "parameters": {"binary_data": binary}} for n in ("OUTPUT0", "OUTPUT1")]
    body = json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]},
        {"name": "INPUT1", "datatype": "INT32", "shape": [1, 4], "data": [10, 20, 30, 40]},
    ], "outputs": outputs}).encode()
    headers = {"Content-Type": "application/json", "Accept-Encoding": accept}
    replies = [s.request("POST", "/v2/models/add_sub/infer", body, headers) for s in (triton, edged)]
    theirs, ours = (
        Reply(r.status, r.headers, {"gzip": gzip.decompress, "deflate": zlib.decompress}.get(
            r.headers.get("content-encoding", ""), lambda b: b)(r.body))
        for r in replies
    )
    assert ours.status == theirs.status == 200
    assert ours.headers.get("content-encoding") == theirs.headers.get("content-encoding") == encoding, ours.headers
    assert ours.headers.get("inference-header-content-length") is not None or not binary
    assert _tensors(ours) == _tensors(theirs)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="placing threads needs two CPUs to tell them apart")
def test_host_policy_cpu_cores_as_tritons(compat_repo: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`--host-policy=<name>,cpu-cores=<range>` on both servers, with models whose instance
    groups name a policy, take the default one ("cpu" for KIND_CPU) or name one neither server
    defines: each model's `execute` thread and a thread it starts run on the same CPUs on both.
    (Triton runs python models in a stub process; it starts from the pinned instance thread.)"""
    from compat.servers import ORACLE_ENV, start_edged, start_triton
    from support import placement_model

    allowed = sorted(os.sched_getaffinity(0))
    pinned, default = allowed[-1], allowed[0]
    repo = tmp_path_factory.mktemp("host-policy-repo")
    placement_model(repo, "named", 'instance_group [{ kind: KIND_CPU host_policy: "pinned" }]\n')
    placement_model(repo, "by_kind", "instance_group [{ kind: KIND_CPU }]\n")
    placement_model(repo, "undefined", 'instance_group [{ kind: KIND_CPU host_policy: "nowhere" }]\n')
    models = ["named", "by_kind", "undefined"]
    flags = [f"--host-policy=pinned,cpu-cores={pinned}-{pinned}", f"--host-policy=cpu,cpu-cores={default}-{default}"]
    triton = start_triton(Path(os.environ[ORACLE_ENV]), repo, tmp_path_factory.mktemp("triton-hp"), models, flags)
    try:
        edged = start_edged(repo, tmp_path_factory.mktemp("edged-hp"), models, flags)
        try:
            body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [0.0]}]}).encode()
            for model in models:
                answers = [
                    json.loads(s.request("POST", f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"}).body)
                    for s in (triton, edged)
                ]
                theirs, ours = (a["outputs"][0]["data"] for a in answers)
                assert ours == theirs, (model, ours, theirs)
            expected = {"named": [pinned] * 2, "by_kind": [default] * 2, "undefined": allowed * 2}
            assert {m: json.loads(edged.request("POST", f"/v2/models/{m}/infer", body,
                                                {"Content-Type": "application/json"}).body)["outputs"][0]["data"]
                    for m in models} == expected
        finally:
            edged.stop()
    finally:
        triton.stop()


_GROUPS_MODEL = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        groups = json.loads(args["model_config"])["instance_group"]
        self.seen = json.dumps([args["model_instance_name"], [[g["name"], g["kind"], g["count"]] for g in groups]])

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([self.seen], dtype=np.object_))])
                for _ in requests]
'''


def test_instance_groups_a_python_model_sees_as_tritons(
    compat_repo: object, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Without instance_group Triton makes one group named after the model (its instance is
    `<model>_0`); an unnamed group is `<model>_<index>`. Both servers serve the same groups and
    give `initialize` the same instance name and groups, and serve the same completed config
    (all but Triton's `optimization` defaults: docs/compatibility.md)."""
    from compat.servers import ORACLE_ENV, start_edged, start_triton
    from support import x_to_y_model

    repo = tmp_path_factory.mktemp("groups-repo")
    for name, group in (
        ("no_group", ""),
        ("unnamed", "instance_group [{ kind: KIND_CPU }]\nmax_batch_size: 4\ndynamic_batching { }\n"),
    ):
        x_to_y_model(repo, name, _GROUPS_MODEL, "TYPE_STRING dims: [ 1 ]", group)
    models = ["no_group", "unnamed"]
    bodies = {
        model: json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": shape, "data": [0.0]}]}).encode()
        for model, shape in (("no_group", [1]), ("unnamed", [1, 1]))
    }
    answers = []
    for start in (start_triton, start_edged):
        args = (Path(os.environ[ORACLE_ENV]),) if start is start_triton else ()
        server = start(*args, repo, tmp_path_factory.mktemp("groups"), models)
        try:
            configs = {model: json.loads(server.request("GET", f"/v2/models/{model}/config").body) for model in models}
            for config in configs.values():
                config.pop("optimization", None)
            answers.append(configs)
            answers.append({
                model: (
                    [(g["name"], g["kind"], g["count"]) for g in configs[model]["instance_group"]],
                    json.loads(json.loads(server.request(
                        "POST", f"/v2/models/{model}/infer", bodies[model], {"Content-Type": "application/json"}
                    ).body)["outputs"][0]["data"][0]),
                )
                for model in models
            })
        finally:
            server.stop()
    their_configs, theirs, our_configs, ours = answers
    assert theirs["no_group"] == ([("no_group", "KIND_CPU", 1)], ["no_group_0", [["no_group", "KIND_CPU", 1]]])
    assert ours == theirs
    assert their_configs["unnamed"]["dynamic_batching"]["preferred_batch_size"] == [4]
    assert our_configs == their_configs


_HELPERS_MODEL = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def kind(numpy_type):
    return None if numpy_type is None else np.dtype(numpy_type).str


class TritonPythonModel:
    def execute(self, requests):
        texts = np.array([b"a\\x00", "\\u00e9", 3, b""], dtype=np.object_)
        packed = pb_utils.serialize_byte_tensor(texts)
        numbers = np.arange(6, dtype=np.float32).reshape(2, 3)
        request = pb_utils.InferenceRequest(
            model_name="m", inputs=[], requested_output_names=[],
            preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0),
        )
        request.set_flags(pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
        pb_utils.Logger.log("helpers", pb_utils.Logger.LogLevel.INFO)
        seen = {
            "codes": [pb_utils.numpy_to_triton_type(t) for t in (
                np.bool_, np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32, np.int64,
                np.float16, np.float32, np.float64, np.object_, np.bytes_, np.str_, np.complex64)],
            "types": [kind(pb_utils.triton_to_numpy_type(code)) for code in range(16)],
            "table": {name: kind(t) for name, t in pb_utils.TRITON_STRING_TO_NUMPY.items()},
            "packed": packed.hex(),
            "unpacked": [item.hex() for item in pb_utils.deserialize_bytes_tensor(packed).tolist()],
            "empty": repr(pb_utils.serialize_byte_tensor(np.array([], dtype=np.object_))),
            "not_bytes": repr(pb_utils.serialize_byte_tensor(numbers)),
            "decoupled": [pb_utils.using_decoupled_model_transaction_policy(c) for c in (
                {}, {"model_transaction_policy": {"decoupled": True}})],
            "constants": [int(c) for c in (
                pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL, pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
                pb_utils.TRITONSERVER_MEMORY_CPU, pb_utils.TRITONSERVER_MEMORY_GPU)],
            "flags": request.flags(),
            "dlpack": pb_utils.Tensor.from_dlpack("D", pb_utils.Tensor("N", numbers).to_dlpack()).as_numpy().tolist(),
            "levels": [name for name in ("INFO", "WARNING", "ERROR", "VERBOSE") if hasattr(pb_utils.Logger.LogLevel, name)],
        }
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([json.dumps(seen)], dtype=np.object_))])
                for _ in requests]
'''


def test_pb_utils_helpers_answer_as_tritons(compat_repo: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The module-level helpers of `triton_python_backend_utils` a model calls (type codes,
    BYTES serialization, DLPack, constants) give the same answers on both servers."""
    from compat.servers import ORACLE_ENV, start_edged, start_triton
    from support import x_to_y_model

    repo = tmp_path_factory.mktemp("helpers-repo")
    x_to_y_model(repo, "helpers", _HELPERS_MODEL, "TYPE_STRING dims: [ 1 ]")
    body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [0.0]}]}).encode()
    answers = []
    for start in (start_triton, start_edged):
        args = (Path(os.environ[ORACLE_ENV]),) if start is start_triton else ()
        server = start(*args, repo, tmp_path_factory.mktemp("helpers"), ["helpers"])
        try:
            reply = server.request("POST", "/v2/models/helpers/infer", body, {"Content-Type": "application/json"})
            assert reply.status == 200, reply.body
            answers.append(json.loads(json.loads(reply.body)["outputs"][0]["data"][0]))
        finally:
            server.stop()
    theirs, ours = answers
    assert theirs["codes"][10] == 11 and theirs["unpacked"] == ["6100", "c3a9", "33", ""]
    assert ours == theirs


def test_custom_metrics_as_tritons(compat_repo: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A python model's own metric families (`pb_utils.MetricFamily`): what the model reads
    back, and the samples both servers serve at /metrics after the same requests (shared
    label sets and families, ignored buckets of an existing series, a dropped family). Only
    operations that succeed: Triton 2.51 sometimes aborts when a model's call to it fails (a
    boost lock_exception in its python backend), so the error texts, read from it by hand, are
    checked in tests/backends/test_python.py."""
    from compat.servers import ORACLE_ENV, start_edged, start_triton
    from support import METRICS_MODEL, metric_samples, x_to_y_model

    repo = tmp_path_factory.mktemp("metrics-repo")
    x_to_y_model(repo, "metrics", METRICS_MODEL, "TYPE_STRING dims: [ 1 ]")
    answers = []
    for start in (start_triton, start_edged):
        args = (Path(os.environ[ORACLE_ENV]),) if start is start_triton else ()
        server = start(*args, repo, tmp_path_factory.mktemp("metrics"), ["metrics"])
        try:
            seen = []
            for x in (0.5, 3.0):
                body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [x]}]}).encode()
                reply = server.request("POST", "/v2/models/metrics/infer", body, {"Content-Type": "application/json"})
                assert reply.status == 200, reply.body
                seen.append(json.loads(json.loads(reply.body)["outputs"][0]["data"][0]))
            text = _metrics(server)
            helps = sorted(line for line in text.splitlines() if line.startswith(("# HELP model_", "# TYPE model_")))
            # Bucket bounds as numbers: Triton writes le="1", edged le="1.0".
            samples = {
                name: {tuple((k, str(float(v))) if k == "le" else (k, v) for k, v in labels): value
                       for labels, value in rows.items()}
                for name, rows in metric_samples(text, ("model_",)).items()
            }
            answers.append((seen, helps, samples))
        finally:
            server.stop()
    theirs, ours = answers
    assert theirs[0][1]["values"] == [5.0, 5.0, 0.0, 2.75, 5.0]
    assert "model_temporary" not in str(theirs[2]) and "model_kept" in str(theirs[2])
    assert ours == theirs


def test_model_loading_api_as_tritons(compat_repo: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`pb_utils.load_model`, `unload_model` and `is_model_ready` from a model, explicit mode:
    the same steps give the same answers on both servers (a BLS call shows which model serves).
    No failing call: Triton 2.51 sometimes aborts when one fails (a boost lock_exception in its
    python backend), so the error texts, read from it by hand, are checked in
    tests/api/test_python_models.py."""
    from compat.servers import ORACLE_ENV, start_edged, start_triton
    from support import controller_repository, run_steps

    repo = tmp_path_factory.mktemp("control-repo")
    controller_repository(repo)
    # Files are sent for a model not loaded: for a loaded one, Triton 2.51 keeps serving it
    # when the config sent is its own (docs/compatibility.md).
    steps = [
        ["ready", "run", "load", "ready", "ready_versions", "ready_version_zero", "run", "unload", "ready", "run",
         "unload_unknown"],
        ["load_files", "run", "unload", "load", "run"],
    ]
    answers = []
    for start in (start_triton, start_edged):
        args = (Path(os.environ[ORACLE_ENV]),) if start is start_triton else ()
        server = start(*args, repo, tmp_path_factory.mktemp("control"), ["controller"])
        try:
            def post(path: str, body: object, server: Server = server) -> Reply:
                return server.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})

            answers.append([run_steps(post, group)["done"] for group in steps])
        finally:
            server.stop()
    theirs, ours = answers
    assert theirs[1][1] == ["run", "ok", [4.5]] and theirs[1][4] == ["run", "ok", [3.0]]
    assert ours == theirs


def test_iterative_sequences_as_tritons(compat_repo: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Request rescheduling (`sequence_batching { iterative_sequence: true }`): what the model
    sees on every run (auto correlation IDs, flags, control inputs), the answers, a decoupled
    model's stream and the errors, equal on both servers. Not the cases Triton 2.51 never
    answers (a rescheduled request that also carried END, or one on a model without
    iterative sequences: tests/api/test_sequence.py) nor requests at once (their batches
    depend on timing)."""
    from sequence_models import write_py_iterative

    from compat.servers import ORACLE_ENV, start_edged, start_triton

    repo = tmp_path_factory.mktemp("iterative-repo")
    write_py_iterative(repo, "iterative", max_batch_size=4)
    write_py_iterative(repo, "iterative_decoupled", decoupled=True)
    write_py_iterative(repo, "iterative_not_none", mode="not_none")
    models = ["iterative", "iterative_decoupled", "iterative_not_none"]

    def infer(server: Server, model: str, runs: int, **params: Any) -> tuple[int, Any]:
        batched = model == "iterative"
        body = {"inputs": [{"name": "INPUT", "shape": [1, 1] if batched else [1], "datatype": "INT32", "data": [runs]}]}
        if params:
            body["parameters"] = params
        reply = server.request("POST", f"/v2/models/{model}/infer", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
        answer = json.loads(reply.body)
        if "error" in answer:
            # The type of the response object differs (Triton's is its C++ binding's).
            return reply.status, answer["error"].split("found type")[0]
        return reply.status, {o["name"]: (o["shape"], o["data"]) for o in answer["outputs"]}

    answers = []
    for start in (start_triton, start_edged):
        args = (Path(os.environ[ORACLE_ENV]),) if start is start_triton else ()
        server = start(*args, repo, tmp_path_factory.mktemp("iterative"), models)
        try:
            seen: list[Any] = [
                infer(server, "iterative", 3),
                infer(server, "iterative", 1),
                infer(server, "iterative", 2, sequence_id=77, sequence_start=True),
                infer(server, "iterative", 1, sequence_id=77),
                infer(server, "iterative", 1, sequence_id=79),
                infer(server, "iterative_not_none", 2),
                infer(server, "iterative_not_none", 1),
            ]
            stream = server.request("POST", "/v2/models/iterative_decoupled/generate_stream",
                                    json.dumps({"INPUT": 3}).encode(), {"Content-Type": "application/json"})
            seen.append((stream.status, [c for c in stream.body.decode().split("\n\n") if c.strip()]))
            answers.append(seen)
        finally:
            server.stop()
    theirs, ours = answers
    assert theirs[0][0] == 200 and len(json.loads(theirs[0][1]["LOG"][1][0])) == 3
    assert theirs[3][0] == 400 and theirs[5][0] == 500 and len(theirs[7][1]) == 3
    assert ours == theirs


def test_response_cache_as_tritons(compat_repo: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Triton's response cache (`response_cache { enable: true }` with `--cache-config
    local,size=N`): repeated requests answered without running, the statistics and the
    per-model and cache metrics, and the configs refused, equal on both servers. Not what
    Triton 2.51 gets wrong (other outputs asked for, error responses: it answers them from the
    first request's entry; tests/api/test_response_cache.py)."""
    from compat.servers import start_edged, start_triton
    from support import cached_model, metric_samples

    repo = tmp_path_factory.mktemp("cache-repo")
    cached_model(repo, "cached")
    cached_model(repo, "uncached", extra="")
    cached_model(repo, "refused", extra="sequence_batching { }\nresponse_cache { enable: true }\n")
    answers = []
    for start in (start_triton, start_edged):
        server = _start_with_cache(start, repo, tmp_path_factory.mktemp("cache"), ["cached", "uncached"],
                                   ["--cache-config", "local,size=1048576"])
        try:
            seen: list[Any] = []
            for model in ("cached", "uncached"):
                for x in ([1, 2], [1, 2], [1, 3], [1, 2]):
                    body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2], "data": x}]}
                    reply = server.request("POST", f"/v2/models/{model}/infer", json.dumps(body).encode(),
                                           {"Content-Type": "application/json"})
                    seen.append((reply.status, {o["name"]: o["data"] for o in json.loads(reply.body)["outputs"]}))
                stats = json.loads(server.request("GET", f"/v2/models/{model}/stats").body)["model_stats"][0]
                seen.append((stats["inference_count"], stats["execution_count"],
                             {k: v["count"] for k, v in stats["inference_stats"].items()}))
            text = _metrics(server)
            per_model = metric_samples(text, ("nv_cache_num_hits_per_model", "nv_cache_num_misses_per_model"))
            gauges = sorted(line.split()[2] for line in text.splitlines()
                            if line.startswith("# TYPE nv_cache_") and line.endswith(" gauge"))
            # Refused by both; the answers differ: Triton 2.51 a 500 "failed to poll from model
            # repository" (the reason is in its log), edged a 400 with the reason.
            refused = server.request("POST", "/v2/repository/models/refused/load", b"")
            ready = server.request("GET", "/v2/models/refused/ready")
            seen += [per_model, gauges, refused.status >= 400, ready.status]
            answers.append(seen)
        finally:
            server.stop()
    theirs, ours = answers
    assert theirs[1] == theirs[0] and theirs[3][1]["RUNS"] == [1, 1] and theirs[4][2]["cache_hit"] == 2
    assert theirs[-2:] == [True, 400]
    assert ours == theirs


def test_polled_ensembles_wait_for_their_steps_as_tritons(compat_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Polling the repository (and so at start in every mode): an ensemble whose step model is in
    no repository (directly, or through an inner ensemble) is not loaded; once the step is
    there a poll loads it; when the step leaves, the ensemble goes with it. The same readiness
    and answers on both servers."""
    import shutil

    from compat.servers import ORACLE_ENV, start_edged, start_triton

    x = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1, 2]}]}).encode()
    ensembles = ("ens_missing_step", "chain", "chain_outer")
    answers = []
    for start in (start_triton, start_edged):
        repo = tmp_path_factory.mktemp("poll-repo")
        for name in ("identity_fp32", *ensembles):
            shutil.copytree(compat_repo / name, repo / name)
        args = (Path(os.environ[ORACLE_ENV]),) if start is start_triton else ()
        # Triton exits when a model fails at start unless told not to; edged never does.
        flags = ["--exit-on-error=false"] if start is start_triton else []
        server = start(*args, repo, tmp_path_factory.mktemp("poll"), [],  # type: ignore[operator]
                       ["--model-control-mode", "poll", "--repository-poll-secs", "1", *flags],
                       ready="/v2/models/identity_fp32/ready")

        def look(until_ready: bool | None = None) -> list[tuple[int, int, str]]:
            deadline = time.monotonic() + 30
            while True:
                seen = []
                for model in ensembles:
                    ready = server.request("GET", f"/v2/models/{model}/ready").status  # noqa: B023
                    reply = server.request("POST", f"/v2/models/{model}/infer", x,  # noqa: B023
                                           {"Content-Type": "application/json"})
                    body = json.loads(reply.body)
                    seen.append((ready, reply.status, body["outputs"][0]["data"] if reply.status == 200
                                 else "Request for unknown model" in body["error"]))
                if until_ready is None or all((r == 200) == until_ready for r, _, _ in seen):
                    return seen
                if time.monotonic() > deadline:
                    return seen
                time.sleep(0.2)

        try:
            seen = [look()]
            shutil.copytree(compat_repo / "identity_fp32", repo / "no_such_model")
            config = repo / "no_such_model" / "config.pbtxt"
            config.write_text(config.read_text().replace('"identity_fp32"', '"no_such_model"'))
            shutil.copytree(compat_repo / "chain_step", repo / "chain_step")
            seen.append(look(until_ready=True))
            shutil.rmtree(repo / "chain_step")
            shutil.rmtree(repo / "no_such_model")
            seen.append(look(until_ready=False))
            answers.append(seen)
        finally:
            server.stop()
    theirs, ours = answers
    assert theirs == [[(400, 404, True)] * 3, [(200, 200, [1.0, 2.0])] * 3, [(400, 404, True)] * 3]
    assert ours == theirs


def test_an_ensembles_response_cache_as_tritons(compat_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """An ensemble with `response_cache`: infer and generate both answer a repeat from the cache
    (the ensemble's own statistics count the hits, its step runs once per miss), on both servers."""
    import shutil

    from compat.servers import start_edged, start_triton

    repo = tmp_path_factory.mktemp("ensemble-cache-repo")
    for name in ("chain_step", "chain"):
        shutil.copytree(compat_repo / name, repo / name)
    config = repo / "chain" / "config.pbtxt"
    config.write_text(config.read_text() + "response_cache { enable: true }\n")
    x = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1, 2]}]}).encode()
    requests = [("infer", x), ("infer", x), ("generate", b'{"X": [1, 2]}'), ("generate", b'{"X": [1, 2]}'),
                ("generate", b'{"X": [3, 4]}')]
    answers = []
    for start in (start_triton, start_edged):
        server = _start_with_cache(start, repo, tmp_path_factory.mktemp("ensemble-cache"), ["chain_step", "chain"],
                                   ["--cache-config", "local,size=1048576"])
        try:
            seen: list[Any] = []
            for route, body in requests:
                reply = server.request("POST", f"/v2/models/chain/{route}", body, {"Content-Type": "application/json"})
                answer = json.loads(reply.body)
                seen.append((reply.status, answer["outputs"][0]["data"] if route == "infer" else answer["Y"]))
            for model in ("chain", "chain_step"):
                stats = json.loads(server.request("GET", f"/v2/models/{model}/stats").body)["model_stats"][0]
                seen.append((stats["inference_count"], stats["execution_count"],
                             {k: v["count"] for k, v in stats["inference_stats"].items()}))
            answers.append(seen)
        finally:
            server.stop()
    theirs, ours = answers
    assert theirs[5][2]["cache_hit"] == 3 and theirs[6][1] == 2
    assert ours == theirs


def test_model_warmup_as_tritons(compat_repo: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`model_warmup`: the samples each instance runs before the model is served (zeros on three
    instances, two groups, three times each; a file's data in a batch of three; a batch-size-0 sample skipped),
    the statistics they leave, the first request's answer and the served config, equal on
    both servers."""
    from compat.servers import ORACLE_ENV, start_edged, start_triton
    from support import cached_model

    repo = tmp_path_factory.mktemp("warmup-repo")
    zeros = '{ key: "IN" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } }'
    cached_model(repo, "warm", extra="instance_group [{ kind: KIND_CPU count: 2 }]\n"
                 f'model_warmup [{{ name: "zeros" batch_size: 1 count: 3 inputs {zeros} }}]\n')
    cached_model(repo, "warm_batch", max_batch_size=4, extra=(
        'model_warmup [{ name: "file" batch_size: 3 inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 2 ] '
        f'input_data_file: "in.bin" }} }} }}, {{ name: "none" batch_size: 0 inputs {zeros} }}]\n'))
    (repo / "warm_batch" / "warmup").mkdir()
    (repo / "warm_batch" / "warmup" / "in.bin").write_bytes(np.array([3, 4], np.float32).tobytes())
    answers = []
    for start in (start_triton, start_edged):
        args = (Path(os.environ[ORACLE_ENV]),) if start is start_triton else ()
        server = start(*args, repo, tmp_path_factory.mktemp("warmup"), ["warm", "warm_batch"])
        try:
            seen: list[Any] = []
            for model, shape in (("warm", [2]), ("warm_batch", [1, 2])):
                stats = json.loads(server.request("GET", f"/v2/models/{model}/stats").body)["model_stats"][0]
                seen.append((stats["inference_count"], stats["execution_count"],
                             {k: v["count"] for k, v in stats["inference_stats"].items()},
                             [(row["batch_size"], row["compute_infer"]["count"]) for row in stats["batch_stats"]]))
                body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": shape, "data": [1, 2]}]}
                reply = server.request("POST", f"/v2/models/{model}/infer", json.dumps(body).encode(),
                                       {"Content-Type": "application/json"})
                seen.append({o["name"]: o["data"] for o in json.loads(reply.body)["outputs"]})
                seen.append(json.loads(server.request("GET", f"/v2/models/{model}/config").body)["model_warmup"])
            answers.append(seen)
        finally:
            server.stop()
    theirs, ours = answers
    assert theirs[0][:2] == (9, 9) and theirs[1]["RUNS"] == [4, 4] and theirs[3][3] == [(3, 1)]
    assert ours == theirs


# Each request learns how many requests its execution held and how many inputs it carried.
_BATCH_SEEN = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", np.array([[len(requests), len(r.inputs())]],
                                                                             dtype=np.int32))])
                for r in requests]
"""


def test_ragged_batching_as_tritons(compat_repo: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`allow_ragged_batch` on a python model: requests of different shapes share a batch with
    it and not without it, the served config spells it out, on both servers. And what edged
    does differently on purpose: without it, a batch takes the queued requests of the head's
    shape past one of another shape (Triton's batch ends there); and Triton's python backend
    loads a `batch_input` and never feeds it, where edged refuses it."""
    from compat.servers import ORACLE_ENV, start_edged, start_triton

    repo = tmp_path_factory.mktemp("ragged-repo")
    for name, ragged, extra in (
        ("rag", True, ""), ("flat", False, ""),
        ("bio", True, 'batch_input [{ kind: BATCH_ELEMENT_COUNT target_name: "n" data_type: TYPE_INT32 '
                      'source_input: "x" }]\n'),
    ):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(_BATCH_SEEN)
        (repo / name / "config.pbtxt").write_text(
            'backend: "python"\nmax_batch_size: 8\n'
            f'input [ {{ name: "x" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: {str(ragged).lower()} }} ]\n'
            'output [ { name: "y" data_type: TYPE_INT32 dims: [ 2 ] } ]\n'
            "instance_group [{ count: 1 kind: KIND_CPU }]\n"
            "dynamic_batching { max_queue_delay_microseconds: 800000 }\n" + extra
        )

    def send(server: Server, model: str, lengths: list[int]) -> list[list[int]]:
        """The requests queued in this order (40 ms apart, well inside the batch's delay)."""
        def call(n: int) -> list[int]:
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, n], "data": [0.5] * n}]}
            reply = server.request("POST", f"/v2/models/{model}/infer", json.dumps(body).encode(),
                                   {"Content-Type": "application/json"})
            assert reply.status == 200, reply.body
            return json.loads(reply.body)["outputs"][0]["data"]

        with ThreadPoolExecutor(len(lengths)) as pool:
            futures = []
            for n in lengths:
                futures.append(pool.submit(call, n))
                time.sleep(0.04)
            return [future.result() for future in futures]

    mixed, sorted_ = [2, 3, 2, 5], [2, 2, 3, 5]
    answers = []
    for start in (start_triton, start_edged):
        args = (Path(os.environ[ORACLE_ENV]),) if start is start_triton else ()
        models = ["rag", "flat", "bio"] if start is start_triton else ["rag", "flat"]
        server = start(*args, repo, tmp_path_factory.mktemp("ragged"), models)
        try:
            seen: list[Any] = [send(server, "rag", mixed), send(server, "flat", sorted_),
                               send(server, "flat", mixed)]
            for model in ("rag", "flat"):
                config = json.loads(server.request("GET", f"/v2/models/{model}/config").body)
                seen.append((config["input"], config["batch_input"], config["batch_output"]))
            if start is start_triton:
                seen.append(send(server, "bio", mixed))
            answers.append(seen)
        finally:
            server.stop()
    theirs, ours = answers
    assert theirs[0] == [[4, 1]] * 4  # one execution of all four
    assert theirs[1] == [[2, 1], [2, 1], [1, 1], [1, 1]]  # equal shapes together
    assert theirs[2] == [[1, 1]] * 4  # Triton: the 3 ends the first batch, and so on
    assert ours[2] == [[2, 1], [1, 1], [2, 1], [1, 1]]  # edged: both 2s in the first
    assert theirs[5] == [[4, 1]] * 4  # Triton loads the batch input, and its model never sees it
    assert ours[:2] + ours[3:] == theirs[:2] + theirs[3:5]

def test_latency_metrics_config_as_tritons(compat_repo: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`--metrics-config summary_latencies=true` with quantiles of one's own, and
    `counter_latencies=false`: the same families, samples and labels on both servers, with the
    same counts (durations differ by server). And where edged differs on purpose: Triton 2.51
    leaves out the request summary of a model with the response cache, and without latency
    counters stops counting successes and executions too."""
    from compat.servers import start_edged, start_triton
    from support import cached_model, metric_samples

    repo = tmp_path_factory.mktemp("latency-repo")
    cached_model(repo, "m", max_batch_size=4, extra="dynamic_batching { }\n")
    cached_model(repo, "c")
    flags = ["--cache-config", "local,size=1048576", "--metrics-config", "summary_latencies=true",
             "--metrics-config", "summary_quantiles=0.5:0.05,0.75:0.01", "--metrics-config", "counter_latencies=false"]
    prefixes = ("nv_inference_", "nv_cache_hit", "nv_cache_miss", "nv_cache_num_hits_per", "nv_cache_num_misses_per")
    answers = []
    for start in (start_triton, start_edged):
        server = _start_with_cache(start, repo, tmp_path_factory.mktemp("latency"), ["m", "c"], flags)
        try:
            for model, shape in (("m", [1, 2]), ("m", [1, 2]), ("m", [1, 2]), ("c", [2]), ("c", [2])):
                body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": shape, "data": [1, 2]}]}
                reply = server.request("POST", f"/v2/models/{model}/infer", json.dumps(body).encode(),
                                       {"Content-Type": "application/json"})
                assert reply.status == 200, reply.body
            text = _metrics(server)
            samples = metric_samples(text, prefixes)
            types = {line.split()[2]: line.split()[3] for line in text.splitlines()
                     if line.startswith("# TYPE ") and line.split()[2].startswith(prefixes)}
            answers.append((samples, types))
        finally:
            server.stop()
    (theirs, their_types), (ours, our_types) = answers
    # What differs on purpose, checked, then set aside.
    c = (("model", "c"), ("version", "1"))
    m = (("model", "m"), ("version", "1"))
    assert theirs["nv_inference_request_success"] == {c: 0, m: 0}
    assert ours["nv_inference_request_success"] == {c: 2, m: 3}
    assert ours["nv_inference_count"] == {c: 1, m: 3} and ours["nv_inference_exec_count"] == {c: 1, m: 3}
    for name in ("nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count"):
        theirs.pop(name), ours.pop(name)
    assert c not in theirs["nv_inference_request_summary_us_count"]
    assert ours["nv_inference_request_summary_us_count"][c] == 2
    for name in ("nv_inference_request_summary_us_count", "nv_inference_request_summary_us_sum",
                 "nv_inference_request_summary_us"):
        ours[name] = {labels: v for labels, v in ours[name].items() if ("model", "c") not in labels}
    assert our_types == their_types
    assert {name: sorted(samples) for name, samples in ours.items()} == {
        name: sorted(samples) for name, samples in theirs.items()}
    counts = {name: samples for name, samples in theirs.items() if name.endswith("_count")}
    assert counts["nv_inference_queue_summary_us_count"] == {c: 2, m: 3}
    assert counts["nv_cache_hit_summary_per_model_count"] == {c: 1}
    assert {name: samples for name, samples in ours.items() if name.endswith("_count")} == counts
    # One value observed once: its quantiles are that value, on both servers.
    for samples in (theirs, ours):
        quantile = samples["nv_cache_hit_summary_per_model"]
        assert quantile[(("model", "c"), ("quantile", "0.5"), ("version", "1"))] == samples[
            "nv_cache_hit_summary_per_model_sum"][c]


def test_metric_tags_as_tritons(compat_repo: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`metric_tags`: the same `_<key>` labels on the model's samples, and the served config, on
    both servers."""
    from compat.servers import ORACLE_ENV, start_edged, start_triton
    from support import cached_model, metric_samples

    repo = tmp_path_factory.mktemp("tags-repo")
    cached_model(repo, "t", extra='metric_tags { key: "team" value: "vision" }\nmetric_tags { key: "tier" value: "gold" }\n')
    answers = []
    for start in (start_triton, start_edged):
        args = (Path(os.environ[ORACLE_ENV]),) if start is start_triton else ()
        server = start(*args, repo, tmp_path_factory.mktemp("tags"), ["t"])
        try:
            body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2], "data": [1, 2]}]}
            reply = server.request("POST", "/v2/models/t/infer", json.dumps(body).encode(),
                                   {"Content-Type": "application/json"})
            assert reply.status == 200, reply.body
            samples = metric_samples(_metrics(server), ("nv_inference_",))
            config = json.loads(server.request("GET", "/v2/models/t/config").body)
            answers.append(({name: sorted(labels) for name, labels in samples.items()},
                            samples["nv_inference_count"], config["metric_tags"]))
        finally:
            server.stop()
    theirs, ours = answers
    labels = (("_team", "vision"), ("_tier", "gold"), ("model", "t"), ("version", "1"))
    assert theirs[1] == {labels: 1} and theirs[2] == {"team": "vision", "tier": "gold"}
    assert ours == theirs


_TRACE_CONTEXT = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", np.array(
            [repr(r.trace().get_context()), type(r.trace()).__name__], dtype=np.object_))]) for r in requests]
"""


_MODEL_DIR = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.at_init = pb_utils.get_model_dir()
        self.repository = args["model_repository"]

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", np.array(
            [self.at_init, pb_utils.get_model_dir(), self.repository], dtype=np.object_))]) for r in requests]
"""


def _strings_on_both(tmp_path_factory: pytest.TempPathFactory, source: str, count: int) -> tuple[Path, list[Any]]:
    """A python model `m` (source) answering one FP32 request with `count` strings, on Triton
    then edged: the repository and each server's (status, strings)."""
    from compat.servers import ORACLE_ENV, start_edged, start_triton

    repo = tmp_path_factory.mktemp("strings-repo")
    (repo / "m" / "1").mkdir(parents=True)
    (repo / "m" / "1" / "model.py").write_text(source)
    (repo / "m" / "config.pbtxt").write_text(
        'backend: "python"\ninput [{ name: "x" data_type: TYPE_FP32 dims: [ 1 ] }]\n'
        f'output [{{ name: "y" data_type: TYPE_STRING dims: [ {count} ] }}]\n')
    answers = []
    for start in (start_triton, start_edged):
        args = (Path(os.environ[ORACLE_ENV]),) if start is start_triton else ()
        server = start(*args, repo, tmp_path_factory.mktemp("strings"), ["m"])
        try:
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}
            reply = server.request("POST", "/v2/models/m/infer", json.dumps(body).encode(),
                                   {"Content-Type": "application/json"})
            answers.append((reply.status, json.loads(reply.body)["outputs"][0]["data"]))
        finally:
            server.stop()
    return repo, answers


def test_get_model_dir_as_tritons(compat_repo: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`pb_utils.get_model_dir()` in initialize and execute: the model file's directory (its
    version's), beside `args["model_repository"]` (the model's), on both servers."""
    repo, (theirs, ours) = _strings_on_both(tmp_path_factory, _MODEL_DIR, 3)
    assert theirs == (200, [str(repo / "m" / "1"), str(repo / "m" / "1"), str(repo / "m")])
    assert ours == theirs


def test_a_requests_trace_as_tritons(compat_repo: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`request.trace()` is a `pb_utils.InferenceTrace` whose `get_context()` is None without
    an OpenTelemetry trace, on both servers."""
    _, (theirs, ours) = _strings_on_both(tmp_path_factory, _TRACE_CONTEXT, 2)
    assert theirs == (200, ["None", "InferenceTrace"])
    assert ours == theirs


def _poster(server: Server) -> Any:
    """POST an infer body to a model of `server`; its JSON answer (a 200)."""
    def post(model: str, body: dict[str, Any]) -> Any:
        reply = server.request("POST", f"/v2/models/{model}/infer", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
        assert reply.status == 200, reply.body
        return json.loads(reply.body)
    return post


def _load(server: Server, model: str) -> tuple[int, str]:
    reply = server.request("POST", f"/v2/repository/models/{model}/load", b"{}")
    return reply.status, json.loads(reply.body or b"{}").get("error", "")


def test_rate_limiter_as_tritons(compat_repo: object, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`--rate-limit=execution_count`: two models that each hold the one copy of R run one at a
    time; of two waiting for it, the one with the lower executions x priority runs first; loading a model that needs two copies makes two (the most any instance asks for), so
    they run together, and unloading it takes it back; the load errors of too few copies given by
    `--rate-limit-resource` and of a resource both global and per device. The same on both."""
    from compat.servers import ORACLE_ENV, start_edged, start_triton
    from support import most_at_once, priority_order, run_together, timed_model

    repo = tmp_path_factory.mktemp("rate-repo")
    for name in ("a", "b"):
        timed_model(repo, name, 'rate_limiter { resources [{ name: "R" count: 1 }] }')
    timed_model(repo, "two", 'rate_limiter { resources [{ name: "R" count: 2 }] }')
    timed_model(repo, "global", 'rate_limiter { resources [{ name: "G" global: true count: 1 }] }')
    timed_model(repo, "local", 'rate_limiter { resources [{ name: "G" count: 1 }] }')
    timed_model(repo, "holder", 'rate_limiter { resources [{ name: "R" count: 1 }] }')
    for priority in (1, 2):
        timed_model(repo, f"p{priority}", f'rate_limiter {{ resources [{{ name: "R" count: 1 }}] priority: {priority} }}')
    answers = []
    for start in (start_triton, start_edged):
        args = (Path(os.environ[ORACLE_ENV]),) if start is start_triton else ()
        seen: list[Any] = []
        models = ["a", "b", "holder", "p1", "p2"]
        server = start(*args, repo, tmp_path_factory.mktemp("rate"), models, ["--rate-limit=execution_count"])
        try:
            seen.append(most_at_once(run_together(_poster(server), ["a", "b"], 0.4)))
            seen.append(priority_order(_poster(server)))
            config = json.loads(server.request("GET", "/v2/models/a/config").body)
            seen.append(config["instance_group"][0]["rate_limiter"])
            seen.append(_load(server, "two"))
            seen.append(most_at_once(run_together(_poster(server), ["a", "b"], 0.4)))
            seen.append(server.request("POST", "/v2/repository/models/two/unload", b"{}").status)
            time.sleep(1)  # the unload finishes after its answer on Triton
            seen.append(most_at_once(run_together(_poster(server), ["a", "b"], 0.4)))
            seen.append(_load(server, "global"))
            status, error = _load(server, "local")
            seen.append((status, 'Resource "G" is present as both global and device-specific resource' in error))
        finally:
            server.stop()
        server = start(*args, repo, tmp_path_factory.mktemp("rate"), ["a"],
                       ["--rate-limit=execution_count", "--rate-limit-resource=R:1"])
        try:
            status, error = _load(server, "two")
            seen.append((status, 'Resource count for "R" is limited to 1 which will prevent scheduling of '
                                 "one or more model instances, the minimum required count is 2" in error))
        finally:
            server.stop()
        answers.append(seen)
    theirs, ours = answers
    served = {"resources": [{"name": "R", "global": False, "count": 1}], "priority": 0}
    assert theirs == [1, ["p1", "p2"], served, (200, ""), 2, 200, 1, (200, ""), (400, True), (400, True)]
    assert ours == theirs
