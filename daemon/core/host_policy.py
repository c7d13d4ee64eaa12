"""Host policies (Triton's `--host-policy`): named sets of CPUs that threads are placed on.

As in Triton, a model instance's thread runs on the CPUs of the policy its instance group
names (`instance_group { host_policy: "..." }`; a group that names none takes "cpu" for
KIND_CPU, "gpu_<n>" for KIND_GPU, "model" for KIND_MODEL), and the threads the instance starts
(a runtime's thread pool, a python model's own threads, llama.cpp's decode threads) inherit
them. A policy named by no group costs nothing; a group naming a policy the daemon does not
define runs without one, as in Triton (the load logs it).

edged adds `server.host-policy`: the policy of the daemon's event loop. A python model's thread
and the loop take turns under one interpreter lock, and on a small VM a hand-over between two
vCPUs pays a wake-up of a halted vCPU each way; put on the same CPU they answered one client
1.2x faster and 8 clients 1.1x (docs/performance.md). Threads the loop hands blocking work to,
and the HTTP worker processes started through them, keep every CPU the daemon may use, and so
do instances whose policy sets no CPUs: pinning the loop confines only the loop and what its
own code starts.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from daemon.config import DaemonConfig
from daemon.errors import ConfigError
from daemon.model_config import InstanceGroup

# Linux numbers CPUs below NR_CPUS, at most 8192 in its configuration.
MAX_CPU_ID = 8191
_RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


def parse_cpu_cores(value: str, where: str) -> frozenset[int]:
    """Triton's `cpu-cores` value, "<lower>-<upper>" ranges separated by commas ("0-1,4-5"),
    into CPU ids; a single id ("3") is taken as the range "3-3"."""
    cpus: set[int] = set()
    for part in value.split(","):
        found = _RANGE.fullmatch(part)
        if found is None:
            raise ConfigError(f"{where}: cpu-cores must be '<lower>-<upper>' ranges separated by commas, got {value!r}")
        first, last = int(found[1]), int(found[2] or found[1])
        if first > last:
            raise ConfigError(f"{where}: cpu-cores range {part.strip()!r} ends before it starts")
        if last > MAX_CPU_ID:
            # Refused before the set is built: "0-99999999" took seconds and gigabytes to
            # become a set, only to be refused as CPUs the process may not use.
            raise ConfigError(f"{where}: cpu-cores names CPU {last}, above the highest id Linux gives a CPU ({MAX_CPU_ID})")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def process_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity mask: taskset, a cgroup cpuset); empty
    where the OS has no affinity masks (not Linux)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset()


def format_cpus(cpus: frozenset[int]) -> str:
    """CPU ids as ranges, "0-3,6"."""
    ranges: list[list[int]] = []  # [first, last]
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in ranges)


def default_policy_name(group: InstanceGroup | None, device_kind: str, device_index: int) -> str:
    """The policy an instance group that names none takes (Triton's names)."""
    kind = group.kind if group is not None else "KIND_AUTO"
    if kind == "KIND_AUTO":
        kind = "KIND_GPU" if device_kind.startswith("gpu") else "KIND_CPU"
    if kind == "KIND_GPU":
        return f"gpu_{device_index}"
    return "model" if kind == "KIND_MODEL" else "cpu"


@dataclass(frozen=True, slots=True)
class HostPolicies:
    """The daemon's host policies, checked against the CPUs this process may use."""

    # policy name -> its CPUs (policies that set cpu-cores)
    cpus: Mapping[str, frozenset[int]]
    # Every CPU the process may use, read before any thread was placed: where threads
    # without a policy go back to.
    allowed: frozenset[int]
    names: frozenset[str] = frozenset()  # every defined policy, with or without CPUs
    loop: str = ""  # server.host-policy

    def undefined(self, groups: list[InstanceGroup]) -> list[str]:
        """Policies the groups name that the daemon does not define."""
        return sorted({g.host_policy for g in groups if g.host_policy and g.host_policy not in self.names})

    @classmethod
    def from_config(cls, config: DaemonConfig, allowed: frozenset[int] | None = None) -> HostPolicies:
        allowed = process_cpus() if allowed is None else allowed
        cpus: dict[str, frozenset[int]] = {}
        for name, policy in config.host_policy.items():
            where = f"host policy {name!r}"
            if policy.numa_node is not None:
                raise ConfigError(
                    f"{where}: numa-node is not supported by edged (Triton binds the instance's memory "
                    "to the node with libnuma); use cpu-cores with the node's CPUs"
                )
            if not policy.cpu_cores:
                continue
            if not allowed:
                raise ConfigError(f"{where}: cpu-cores needs CPU affinity masks, which this OS does not have")
            wanted = parse_cpu_cores(policy.cpu_cores, where)
            missing = wanted - allowed
            if missing:
                raise ConfigError(
                    f"{where}: cpu-cores names CPU {format_cpus(frozenset(missing))}, but this process "
                    f"may run only on {format_cpus(allowed)}"
                )
            cpus[name] = wanted
        loop = config.server.host_policy
        if loop and loop not in cpus:
            raise ConfigError(f"server.host-policy names {loop!r}, which is no host policy with cpu-cores")
        return cls(cpus, allowed, frozenset(config.host_policy), loop)

    def for_instance(self, group: InstanceGroup | None, device_kind: str, device_index: int) -> tuple[str, frozenset[int]]:
        """The policy name of an instance of `group` and the CPUs its thread runs on. A policy
        that sets none, or is not defined (Triton runs such an instance without a policy):
        every allowed CPU if the loop, whose thread starts the instance's, is placed; else
        empty, for "leave the thread where it starts"."""
        named = group.host_policy if group is not None else ""
        name = named or default_policy_name(group, device_kind, device_index)
        return name, self.cpus.get(name) or (self.allowed if self.loop else frozenset())

    def place_loop(self, name: str) -> concurrent.futures.ThreadPoolExecutor:
        """Put the calling thread (the event loop's) on policy `name`'s CPUs; returns the
        executor to make the loop's default, whose threads go back to every allowed CPU
        (blocking work, and the worker processes started from it, must not share the loop's)."""
        executor = concurrent.futures.ThreadPoolExecutor(
            thread_name_prefix="asyncio", initializer=os.sched_setaffinity, initargs=(0, self.allowed)
        )
        os.sched_setaffinity(0, self.cpus[name])
        return executor
