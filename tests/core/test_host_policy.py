"""Host policies (Triton's --host-policy cpu-cores): which CPUs a model instance's thread, the
threads it starts, and the daemon's event loop run on, read from the kernel of a real daemon."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from daemon.config import DaemonConfig, load_config
from daemon.core.host_policy import HostPolicies, default_policy_name, format_cpus, parse_cpu_cores
from daemon.errors import ConfigError
from daemon.model_config import InstanceGroup
from support import DaemonProcess, child_pids, placement_model

ALLOWED = frozenset(os.sched_getaffinity(0))


def _config(policies: dict[str, dict[str, Any]], loop: str = "") -> DaemonConfig:
    return msgspec.convert({"host-policy": policies, "server": {"host-policy": loop}}, DaemonConfig)


def test_cpu_cores_read_as_triton_writes_them() -> None:
    assert parse_cpu_cores("0-1,4-5", "p") == {0, 1, 4, 5}
    assert parse_cpu_cores("3", "p") == {3}
    assert parse_cpu_cores(" 2-2 , 0-0", "p") == {0, 2}
    assert format_cpus(frozenset({0, 1, 2, 5, 7, 8})) == "0-2,5,7-8"
    for bad in ("", "a-b", "1-", "-1", "0-1;2", "3-1"):
        with pytest.raises(ConfigError, match="host policy 'p'"):
            parse_cpu_cores(bad, "host policy 'p'")
    assert parse_cpu_cores("8191", "p") == {8191}
    # Refused before a set of every id in the range is built (10**12 of them would not fit).
    for bad in ("8192", "0-999999999999"):
        with pytest.raises(ConfigError, match=r"host policy 'p': cpu-cores names CPU \d+, above the highest id Linux gives a CPU \(8191\)"):
            parse_cpu_cores(bad, "host policy 'p'")


def test_default_policy_names_are_tritons() -> None:
    assert default_policy_name(InstanceGroup(kind="KIND_CPU"), "gpu:nvidia", 1) == "cpu"
    assert default_policy_name(InstanceGroup(kind="KIND_GPU"), "gpu:nvidia", 1) == "gpu_1"
    assert default_policy_name(InstanceGroup(kind="KIND_MODEL"), "cpu", 0) == "model"
    assert default_policy_name(InstanceGroup(), "cpu", 0) == "cpu"
    assert default_policy_name(None, "gpu:nvidia", 0) == "gpu_0"


def test_policies_this_box_cannot_honour_stop_the_daemon() -> None:
    allowed = frozenset({0, 1})
    with pytest.raises(ConfigError, match=r"host policy 'p': cpu-cores names CPU 2-3, but this process may run only on 0-1"):
        HostPolicies.from_config(_config({"p": {"cpu-cores": "1-3"}}), allowed)
    with pytest.raises(ConfigError, match="host policy 'p': numa-node is not supported by edged"):
        HostPolicies.from_config(_config({"p": {"numa-node": 0}}), allowed)
    with pytest.raises(ConfigError, match=r"server\.host-policy names 'q', which is no host policy with cpu-cores"):
        HostPolicies.from_config(_config({"p": {"cpu-cores": "0"}, "q": {}}, loop="q"), allowed)
    with pytest.raises(ConfigError, match="host policy 'p': cpu-cores needs CPU affinity masks"):
        HostPolicies.from_config(_config({"p": {"cpu-cores": "0"}}), frozenset())
    with pytest.raises(msgspec.ValidationError, match="cpu-count"):
        _config({"p": {"cpu-count": "0"}})


def test_instances_take_their_groups_policy_else_every_cpu() -> None:
    policies = HostPolicies.from_config(_config({"cpu": {"cpu-cores": "1"}, "other": {"cpu-cores": "0"}, "empty": {}}),
                                        frozenset({0, 1}))
    assert policies.for_instance(InstanceGroup(kind="KIND_CPU"), "cpu", 0) == ("cpu", {1})
    assert policies.for_instance(None, "cpu", 0) == ("cpu", {1})
    assert policies.for_instance(InstanceGroup(host_policy="other"), "cpu", 0) == ("other", {0})
    # A policy without CPUs, or one the daemon does not define (Triton: no policy): left
    # where it starts, or, with the loop placed (the loop starts it), on every CPU.
    assert policies.for_instance(InstanceGroup(host_policy="empty"), "cpu", 0) == ("empty", set())
    assert policies.for_instance(InstanceGroup(host_policy="nowhere"), "cpu", 0) == ("nowhere", set())
    assert policies.for_instance(InstanceGroup(kind="KIND_GPU"), "gpu:nvidia", 0) == ("gpu_0", set())
    placed = HostPolicies.from_config(_config({"cpu": {"cpu-cores": "1"}}, loop="cpu"), frozenset({0, 1}))
    assert placed.for_instance(InstanceGroup(host_policy="nowhere"), "cpu", 0) == ("nowhere", {0, 1})
    assert placed.for_instance(InstanceGroup(kind="KIND_CPU"), "cpu", 0) == ("cpu", {1})
    assert policies.undefined([InstanceGroup(host_policy="nowhere"), InstanceGroup(host_policy="other")]) == ["nowhere"]


def test_the_config_file_and_tritons_flag_say_the_same(tmp_path: Path) -> None:
    from daemon.cli import apply_flags, build_parser

    file = tmp_path / "edged.toml"
    file.write_text('[server]\nhost-policy = "loop"\n[host-policy.loop]\ncpu-cores = "0-1,3-3"\n')
    args = build_parser().parse_args(["serve", "--host-policy=loop,cpu-cores=0-1,3-3", "--server-host-policy", "loop"])
    assert apply_flags(DaemonConfig(), args) == load_config(file)
    from daemon.errors import EdgedError

    with pytest.raises(EdgedError, match="--host-policy must be NAME,SETTING=VALUE, got 'loop'"):
        apply_flags(DaemonConfig(), build_parser().parse_args(["serve", "--host-policy", "loop"]))


# ------------------------------------------------------------------- a real daemon

def _cpus_seen(daemon: DaemonProcess, model: str) -> tuple[list[int], list[int]]:
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [0.0]}]}
    data = daemon.post_ok(f"/v2/models/{model}/infer", body)["outputs"][0]["data"]
    return data[: len(data) // 2], data[len(data) // 2 :]


def _thread_cpus(pid: int) -> dict[int, frozenset[int]]:
    """Each thread of `pid` -> the CPUs the kernel lets it run on."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            found[int(tid)] = frozenset(os.sched_getaffinity(int(tid)))
    return found


@pytest.mark.skipif(len(ALLOWED) < 2, reason="placing threads needs two CPUs to tell them apart")
def test_instances_and_the_loop_run_where_their_policies_say(tmp_path: Path, start_daemon: Callable[..., DaemonProcess]) -> None:
    pinned = max(ALLOWED)
    repo = tmp_path / "repo"
    placement_model(repo, "placed", 'instance_group [{ kind: KIND_CPU count: 2 host_policy: "pinned" }]\n')
    placement_model(repo, "free", "instance_group [{ kind: KIND_CPU }]\n")
    daemon = start_daemon(
        "--model-repository", str(repo), f"--host-policy=pinned,cpu-cores={pinned}",
        "--server-host-policy", "pinned", "--workers", "1",
    )
    try:
        # The instance's thread and a thread the model starts: the policy's CPU (both
        # instances: the requests are spread over them).
        for _ in range(4):
            assert _cpus_seen(daemon, "placed") == ([pinned], [pinned])
        # No policy: every CPU, though the event loop that loaded it is pinned.
        assert _cpus_seen(daemon, "free") == (sorted(ALLOWED), sorted(ALLOWED))
        # The event loop is the main thread; the worker process, started by a thread of the
        # loop's executor, keeps every CPU.
        threads = _thread_cpus(daemon.proc.pid)
        assert threads[daemon.proc.pid] == {pinned}
        workers = child_pids(daemon.proc.pid)
        assert len(workers) == 1
        assert set(_thread_cpus(workers[0]).values()) == {ALLOWED}
        # Only the loop and the two instances' threads are held to the one CPU.
        assert sum(cpus == {pinned} for cpus in threads.values()) == 3, threads
        model = daemon.get_json("/v2/models/placed")
        assert model["selection"]["host_policies"] == {"pinned": str(pinned)}
        assert "host_policies" not in daemon.get_json("/v2/models/free")["selection"]
        config = daemon.get_json("/v2/models/placed/config")
        assert [g["host_policy"] for g in config["instance_group"]] == ["pinned"]
    finally:
        daemon.stop()
    assert "event loop on CPUs" in daemon.log()


@pytest.mark.skipif(len(ALLOWED) < 2, reason="placing threads needs two CPUs to tell them apart")
def test_llama_cpp_threads_keep_every_cpu_beside_a_pinned_loop(tmp_path: Path, start_daemon: Callable[..., DaemonProcess]) -> None:
    """llama.cpp's engine thread is started from the event loop's thread; without a policy it
    and the decode threads it starts must not inherit the loop's CPU, and with one they run on
    the policy's CPUs, with one decode thread per CPU."""
    pytest.importorskip("llama_cpp")
    from support import llamacpp_models

    pinned = max(ALLOWED)
    repo = tmp_path / "repo"
    llamacpp_models(repo, {"tiny": ({}, {}), "placed": ({}, {})})
    with (repo / "placed" / "config.pbtxt").open("a") as config:
        config.write('instance_group [{ kind: KIND_CPU host_policy: "loop" }]\n')
    daemon = start_daemon(
        "--model-repository", str(repo), f"--host-policy=loop,cpu-cores={pinned}",
        "--server-host-policy", "loop",
    )
    try:
        for model in ("tiny", "placed"):
            reply = daemon.post_ok("/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 8})
            assert reply["usage"]["completion_tokens"] >= 1
        threads = _thread_cpus(daemon.proc.pid)
        held = sorted(tid for tid, cpus in threads.items() if cpus != ALLOWED)
        # The loop, and the placed model's engine thread, which decodes alone on its one CPU.
        assert len(held) == 2 and daemon.proc.pid in held, json.dumps({str(t): sorted(c) for t, c in threads.items()})
        assert all(threads[tid] == {pinned} for tid in held)
        selection = daemon.get_json("/v2/models/placed")["selection"]
        assert selection["host_policies"] == {"loop": str(pinned)} and selection["threads_per_instance"] == 1
        # The thread budget counts the daemon's CPUs, not the loop's.
        assert daemon.get_json("/v2/models/tiny")["selection"]["threads_per_instance"] == len(ALLOWED)
    finally:
        daemon.stop()


def test_an_unknown_policy_runs_the_instance_without_one(tmp_path: Path, start_daemon: Callable[..., DaemonProcess]) -> None:
    """As Triton: a group naming a policy the daemon does not define loads, on every CPU."""
    repo = tmp_path / "repo"
    placement_model(repo, "placed", 'instance_group [{ kind: KIND_CPU host_policy: "nowhere" }]\n')
    daemon = start_daemon("--model-repository", str(repo))
    try:
        assert _cpus_seen(daemon, "placed") == (sorted(ALLOWED), sorted(ALLOWED))
    finally:
        daemon.stop()
    assert "instance_group host_policy 'nowhere' is not defined" in daemon.log()


def test_a_policy_naming_a_cpu_the_daemon_may_not_use_stops_it(tmp_path: Path) -> None:
    import subprocess
    import sys

    from support import REPO_ROOT

    outside = max(ALLOWED) + 1
    done = subprocess.run(
        [sys.executable, "-m", "daemon", "serve", "--socket", str(tmp_path / "s.sock"), "--state-dir",
         str(tmp_path / "state"), f"--host-policy=cpu,cpu-cores={outside}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode != 0
    assert f"host policy 'cpu': cpu-cores names CPU {outside}, but this process may run only on" in done.stderr + done.stdout
