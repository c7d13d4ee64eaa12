"""Triton's rate limiter (`--rate-limit=execution_count`): the resource pools and the order of
waiters in a RateLimiter, then executions of real python models over the socket, read from the
times each execution ran."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from daemon.cli import apply_flags, build_parser
from daemon.config import DaemonConfig, RateLimitResource
from daemon.core.rate_limiter import GLOBAL, RateLimiter, Ticket
from daemon.errors import ConfigError, EdgedError
from daemon.model_config import InstanceGroup, ModelRateLimiter, RateLimiterResource
from support import (
    TIMED_DECOUPLED,
    DaemonProcess,
    most_at_once,
    priority_order,
    run_together,
    timed_model,
)

# ---------------------------------------------------------------------------- the pools


def _group(*resources: tuple[str, int, bool], priority: int = 0) -> InstanceGroup:
    return InstanceGroup(rate_limiter=ModelRateLimiter(
        [RateLimiterResource(name, global_=is_global, count=count) for name, count, is_global in resources],
        priority,
    ))


def test_resources_default_to_the_most_any_instance_asks_for() -> None:
    # The example of Triton's rate limiter docs, on one device.
    limiter = RateLimiter()
    limiter.register([
        (_group(("R1", 4, False), ("R2", 4, False)), 0),
        (_group(("R2", 5, False), ("R3", 10, False), ("R4", 5, False)), 0),
        (_group(("R1", 1, False), ("R3", 7, False), ("R4", 2, False)), 0),
    ])
    assert limiter.limits() == {(0, "R1"): 4, (0, "R2"): 5, (0, "R3"): 10, (0, "R4"): 5}


def test_explicit_resources_per_device_and_global() -> None:
    # The docs' two-device example: R1 on every device, R2 per device, R3 global.
    explicit = [RateLimitResource("R1", 10), RateLimitResource("R2", 5, 0), RateLimitResource("R2", 8, 1),
                RateLimitResource("R3", 2)]
    limiter = RateLimiter(explicit)
    limiter.register([(_group(("R1", 1, False), ("R2", 1, False), ("R3", 1, True)), d) for d in (0, 1)])
    assert limiter.limits() == {(0, "R1"): 10, (0, "R2"): 5, (1, "R1"): 10, (1, "R2"): 8, (GLOBAL, "R3"): 2}


def test_too_few_copies_or_a_resource_both_global_and_not_fail_the_registration() -> None:
    limiter = RateLimiter([RateLimitResource("R", 1)])
    with pytest.raises(ConfigError, match=r'^Resource count for "R" is limited to 1 which will prevent scheduling '
                                          r"of one or more model instances, the minimum required count is 2$"):
        limiter.register([(_group(("R", 2, False)), 0)])
    with pytest.raises(ConfigError, match=r'limited to 0 .* the minimum required count is 1'):
        limiter.register([(_group(("S", 1, False)), 0)])  # not given: no copies
    assert limiter.limits() == {}  # nothing was registered
    limiter = RateLimiter()
    limiter.register([(_group(("R", 1, True)), 0)])
    with pytest.raises(ConfigError, match=r'^Resource "R" is present as both global and device-specific'):
        limiter.register([(_group(("R", 1, False)), 0)])
    assert limiter.limits() == {(GLOBAL, "R"): 1}


def test_an_instance_without_resources_gets_no_ticket_and_unregistering_shrinks_the_pools() -> None:
    limiter = RateLimiter()
    small, none, empty = limiter.register([(_group(("R", 1, False)), 0), (InstanceGroup(), 0),
                                           (_group(priority=3), 0)])
    assert small is not None and none is None and empty is None
    (big,) = limiter.register([(_group(("R", 3, False)), 0)])
    assert limiter.limits() == {(0, "R"): 3}
    limiter.unregister([big])
    assert limiter.limits() == {(0, "R"): 1}


def _run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_waiters_go_by_executions_times_priority_and_the_first_blocks_the_rest() -> None:
    async def scenario() -> list[str]:
        limiter = RateLimiter()
        one, two, wide = limiter.register([
            (_group(("R", 1, False), priority=1), 0),
            (_group(("R", 1, False), priority=2), 0),
            (_group(("R", 2, False)), 0),
        ])
        assert one is not None and two is not None and wide is not None
        granted: list[str] = []

        async def run(name: str, ticket: Ticket) -> None:
            await limiter.acquire(ticket)
            granted.append(name)
            await asyncio.sleep(0)
            limiter.release(ticket)

        # Both have run once: `one` ranks 1 x 1, `two` 1 x 2, `wide` 1 x 1 (and asked first).
        for ticket in (one, two, wide):
            ticket.executions = 1
        await limiter.acquire(one)  # holds one of the two copies
        tasks = [asyncio.create_task(run(n, t)) for n, t in (("wide", wide), ("two", two), ("one", one))]
        await asyncio.sleep(0)
        # `wide` needs both copies: it heads the queue, so `two` and `one` wait behind it
        # though one copy is free.
        assert granted == []
        limiter.release(one)
        await asyncio.gather(*tasks)
        return granted

    assert _run(scenario()) == ["wide", "one", "two"]


def test_a_cancelled_waiter_leaves_the_queue_and_unblocks_those_behind() -> None:
    async def scenario() -> None:
        limiter = RateLimiter()
        small, wide = limiter.register([(_group(("R", 1, False)), 0), (_group(("R", 2, False)), 0)])
        assert small is not None and wide is not None
        await limiter.acquire(small)
        blocked = asyncio.create_task(limiter.acquire(wide))
        await asyncio.sleep(0)
        behind = asyncio.create_task(limiter.acquire(small))
        await asyncio.sleep(0)
        assert not behind.done()  # behind `wide`, though a copy is free
        blocked.cancel()
        await asyncio.wait_for(behind, 1)  # granted once `wide` left the queue
        limiter.release(small)
        limiter.release(small)
        await asyncio.wait_for(limiter.acquire(wide), 1)  # both copies back

    _run(scenario())


# ---------------------------------------------------------------------------- flags


def test_flags_as_tritons() -> None:
    def config(*flags: str) -> DaemonConfig:
        return apply_flags(DaemonConfig(), build_parser().parse_args(["serve", *flags]))

    parsed = config("--rate-limit", "EXECUTION_COUNT", "--rate-limit-resource", "R1:10",
                    "--rate-limit-resource", "R2:5:1")
    assert parsed.rate_limit.mode == "execution_count"
    assert parsed.rate_limit.resources == [RateLimitResource("R1", 10), RateLimitResource("R2", 5, 1)]
    for bad in ("R1", "R1:x", ":1", "R1:1:2:3", "R1:-1"):
        with pytest.raises(EdgedError, match="--rate-limit-resource"):
            config("--rate-limit-resource", bad)


# ---------------------------------------------------------------------------- a real daemon

def _post(daemon: DaemonProcess) -> Callable[[str, dict[str, Any]], Any]:
    return lambda model, body: daemon.post_ok(f"/v2/models/{model}/infer", body)


_ONE_R = "rate_limiter { resources [{ name: \"R\" count: 1 }] }"


def test_executions_across_models_wait_for_the_resource(tmp_path: Path, start_daemon: Callable[..., DaemonProcess]) -> None:
    repo = tmp_path / "repo"
    for name in ("a", "b", "c"):
        timed_model(repo, name, _ONE_R)
    timed_model(repo, "free", "")  # names no resources: never waits
    daemon = start_daemon("--model-repository", str(repo), "--rate-limit", "execution_count")
    times = run_together(_post(daemon), ["a", "b", "c"], 0.3)
    assert most_at_once(times) == 1, times
    times = run_together(_post(daemon), ["a", "free"], 0.3)
    assert most_at_once(times) == 2, times
    # The wait is queue time in the statistics (Triton's too): two of the three waited.
    stats = [daemon.get_json(f"/v2/models/{m}/stats")["model_stats"][0]["inference_stats"] for m in "abc"]
    waited = sorted(s["queue"]["ns"] for s in stats)
    assert waited[1] > 0.25e9 and waited[2] > 0.25e9, stats


def test_more_copies_or_the_limiter_off_let_them_run_together(
    tmp_path: Path, start_daemon: Callable[..., DaemonProcess]
) -> None:
    repo = tmp_path / "repo"
    for name in ("a", "b"):
        timed_model(repo, name, _ONE_R)
    daemon = start_daemon("--model-repository", str(repo), "--rate-limit", "execution_count",
                          "--rate-limit-resource", "R:2")
    assert most_at_once(run_together(_post(daemon), ["a", "b"], 0.3)) == 2
    daemon.stop()
    daemon = start_daemon("--model-repository", str(repo))  # off: Triton's default
    assert most_at_once(run_together(_post(daemon), ["a", "b"], 0.3)) == 2
    assert "rate_limiter is ignored: the rate limiter is off" in daemon.log()


def test_a_lower_priority_waits_more(tmp_path: Path, start_daemon: Callable[..., DaemonProcess]) -> None:
    repo = tmp_path / "repo"
    timed_model(repo, "holder", _ONE_R)
    for priority in (1, 2):
        timed_model(repo, f"p{priority}", f'rate_limiter {{ resources [{{ name: "R" count: 1 }}] priority: {priority} }}')
    daemon = start_daemon("--model-repository", str(repo), "--rate-limit", "execution_count")
    # p2 asked first, but has run once at priority 2 against p1's once at priority 1.
    assert priority_order(_post(daemon)) == ["p1", "p2"]


def test_sequence_and_decoupled_models_wait_too(tmp_path: Path, start_daemon: Callable[..., DaemonProcess]) -> None:
    repo = tmp_path / "repo"
    timed_model(repo, "plain", _ONE_R)
    timed_model(repo, "stateful", _ONE_R, "sequence_batching { max_sequence_idle_microseconds: 5000000 }\n")
    timed_model(repo, "streamed", _ONE_R, "model_transaction_policy { decoupled: true }\n", TIMED_DECOUPLED)
    daemon = start_daemon("--model-repository", str(repo), "--rate-limit", "execution_count")

    def post(model: str, body: dict[str, Any]) -> Any:
        if model == "stateful":
            body = {**body, "parameters": {"sequence_id": 7, "sequence_start": True, "sequence_end": True}}
        if model == "streamed":
            reply = daemon.post_json("/v2/models/streamed/generate_stream", {"X": body["inputs"][0]["data"]})
            assert reply.status == 200, reply.body
            event = json.loads(reply.body.split(b"data: ", 1)[1].split(b"\n", 1)[0])
            return {"outputs": [{"data": event["Y"]}]}
        return daemon.post_ok(f"/v2/models/{model}/infer", body)

    times = run_together(post, ["plain", "stateful", "streamed"], 0.3)
    assert most_at_once(times) == 1, times


def test_load_failures_name_the_resource(tmp_path: Path, start_daemon: Callable[..., DaemonProcess]) -> None:
    repo = tmp_path / "repo"
    timed_model(repo, "two", 'rate_limiter { resources [{ name: "R" count: 2 }] }')
    timed_model(repo, "global", 'rate_limiter { resources [{ name: "G" global: true count: 1 }] }')
    timed_model(repo, "local", 'rate_limiter { resources [{ name: "G" count: 1 }] }')
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "explicit",
                          "--rate-limit", "execution_count", "--rate-limit-resource", "R:1",
                          "--rate-limit-resource", "G:1")
    reply = daemon.request("POST", "/v2/repository/models/two/load", "{}")
    assert reply.status == 400
    assert ('Resource count for "R" is limited to 1 which will prevent scheduling of one or more model '
            "instances, the minimum required count is 2") in reply.json()["error"]
    assert daemon.request("POST", "/v2/repository/models/global/load", "{}").status == 200
    reply = daemon.request("POST", "/v2/repository/models/local/load", "{}")
    assert reply.status == 400
    assert 'Resource "G" is present as both global and device-specific resource' in reply.json()["error"]
    # The failed loads left the pools as they were: the global model still serves.
    assert daemon.post_ok("/v2/models/global/infer", {"inputs": [
        {"name": "X", "datatype": "FP32", "shape": [1], "data": [0.0]}]})["outputs"]


def test_the_served_config_has_the_rate_limiter_only_where_set() -> None:
    from daemon.model_config import ModelConfig, to_triton_json

    config = ModelConfig(instance_group=[InstanceGroup(), _group(("R", 2, True), priority=3)])
    groups = to_triton_json(config, model_name="m")["instance_group"]
    assert "rate_limiter" not in groups[0]  # Triton leaves an unset message out
    assert groups[1]["rate_limiter"] == {"resources": [{"name": "R", "global": True, "count": 2}], "priority": 3}
