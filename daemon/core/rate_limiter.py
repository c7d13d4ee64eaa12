"""Triton's rate limiter (`--rate-limit=execution_count`): executions across every model wait
for the resources their instance group names.

An instance group's `rate_limiter { resources [...] priority }` says what one execution on one
of its instances holds while it runs: `count` copies of each named resource, per device (the
instance's; CPU instances are device 0, as in Triton) or from one pool for the whole daemon
(`global: true`). How many copies exist: `--rate-limit-resource NAME:COUNT[:DEVICE]` where
given, else the most any registered instance asks for, so that every instance can run.

Executions that cannot get their resources wait, in Triton's order: the lowest
(executions so far x priority) first, priority 0 counting as 1, so an instance of priority 2
gets half the turns of one of priority 1. Only the first waiter is tried: one that asks for
much is not overtaken forever by ones that ask for little. An instance whose group names no
resources is not limited at all (Triton's docs), so it never queues here.

Single-threaded: every call comes from the event loop.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from daemon.backend import Backend
from daemon.config import RateLimitResource
from daemon.errors import ConfigError
from daemon.model_config import InstanceGroup

# The pool key of a global resource (a device index otherwise).
GLOBAL = -1


@dataclass(eq=False)
class Ticket:
    """What one instance's execution holds: copies per (device or GLOBAL, resource name)."""

    needs: dict[tuple[int, str], int]
    priority: int
    executions: int = 0

    def rank(self) -> int:
        return self.executions * max(self.priority, 1)


@dataclass(eq=False)
class InstanceLimits:
    """A loaded model's instances that the rate limiter limits, and their tickets: what its
    schedulers call around each execution."""

    limiter: RateLimiter
    tickets: dict[Backend, Ticket]

    async def hold(self, instance: Backend) -> tuple[Ticket | None, int]:
        """Wait for `instance`'s resources and take them: its ticket (for `release`; None, and
        nothing taken, when the instance is not limited) and the nanoseconds waited, which
        count as queue time (as in Triton)."""
        ticket = self.tickets.get(instance)
        if ticket is None:
            return None, 0
        asked = time.monotonic_ns()
        await self.limiter.acquire(ticket)
        return ticket, time.monotonic_ns() - asked

    def release(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            self.limiter.release(ticket)


@dataclass(order=True)
class _Waiter:
    rank: int
    seq: int
    ticket: Ticket = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)


class RateLimiter:
    """The daemon's resource pools and the executions waiting for them."""

    def __init__(self, explicit: Iterable[RateLimitResource] = ()) -> None:
        # (device or None for every device, name) -> copies, from the command line / config.
        self._explicit: dict[tuple[int | None, str], int] = {
            (r.device, r.name): r.count for r in explicit
        }
        self._tickets: list[Ticket] = []
        self._limits: dict[tuple[int, str], int] = {}
        self._held: dict[tuple[int, str], int] = {}
        self._waiting: list[_Waiter] = []
        self._seq = 0

    # ------------------------------------------------------------------ registration

    def register(self, groups: Iterable[tuple[InstanceGroup | None, int]]) -> list[Ticket | None]:
        """A ticket per instance, given each one's group (None: it has none) and device (None:
        not limited). Raises ConfigError, registering nothing, when the pools cannot serve them."""
        tickets: list[Ticket | None] = []
        for group, device in groups:
            limiter = group.rate_limiter if group is not None else None
            if limiter is None or not limiter.resources:
                tickets.append(None)
                continue
            needs: dict[tuple[int, str], int] = {}
            for resource in limiter.resources:
                key = (GLOBAL if resource.global_ else device, resource.name)
                needs[key] = max(needs.get(key, 0), resource.count)
            tickets.append(Ticket(needs, limiter.priority))
        added = [t for t in tickets if t is not None]
        self._limits = self._compute([*self._tickets, *added])  # raises before anything changes
        self._tickets.extend(added)
        return tickets

    def unregister(self, tickets: Iterable[Ticket | None]) -> None:
        gone = {id(t) for t in tickets if t is not None}
        self._tickets = [t for t in self._tickets if id(t) not in gone]
        self._limits = self._compute(self._tickets)
        self._dispatch()

    def limits(self) -> Mapping[tuple[int, str], int]:
        """The copies of each resource that exist now."""
        return dict(self._limits)

    def _compute(self, tickets: list[Ticket]) -> dict[tuple[int, str], int]:
        wanted: dict[tuple[int, str], int] = {}
        for ticket in tickets:
            for key, count in ticket.needs.items():
                wanted[key] = max(wanted.get(key, 0), count)
        global_names = {name for device, name in wanted if device == GLOBAL}
        for device, name in wanted:
            if device != GLOBAL and name in global_names:
                raise ConfigError(
                    f'Resource "{name}" is present as both global and device-specific resource '
                    "in the model configuration."
                )
        if not self._explicit:
            return wanted
        limits = {}
        for (device, name), count in wanted.items():
            if device == GLOBAL:  # one pool: the device a flag names does not matter
                given = [c for (_, n), c in self._explicit.items() if n == name]
            else:
                given = [c for (d, n), c in self._explicit.items() if n == name and d in (device, None)]
            available = max(given, default=0)  # not given: none exist
            if available < count:
                raise ConfigError(
                    f'Resource count for "{name}" is limited to {available} which will prevent '
                    "scheduling of one or more model instances, the minimum required count is "
                    f"{count}"
                )
            limits[(device, name)] = available
        return limits

    # ------------------------------------------------------------------ executions

    async def acquire(self, ticket: Ticket) -> None:
        """Wait until `ticket`'s resources are free and hold them (`release` gives them back).
        No wait, not even a loop iteration, when nothing is queued and they are free."""
        if not self._waiting and self._fits(ticket):
            self._take(ticket)
            return
        waiter = _Waiter(ticket.rank(), self._seq, ticket, asyncio.get_running_loop().create_future())
        self._seq += 1
        heapq.heappush(self._waiting, waiter)
        self._dispatch()
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(ticket)  # granted just before the caller went away
            else:
                self._waiting = [w for w in self._waiting if w is not waiter]
                heapq.heapify(self._waiting)
                self._dispatch()  # it may have blocked the ones behind it
            raise

    def release(self, ticket: Ticket) -> None:
        for key, count in ticket.needs.items():
            self._held[key] -= count
        ticket.executions += 1
        self._dispatch()

    def _fits(self, ticket: Ticket) -> bool:
        return all(
            self._held.get(key, 0) + count <= self._limits.get(key, 0) for key, count in ticket.needs.items()
        )

    def _take(self, ticket: Ticket) -> None:
        for key, count in ticket.needs.items():
            self._held[key] = self._held.get(key, 0) + count

    def _dispatch(self) -> None:
        """Grant the first waiters, in order, while the first one's resources are free."""
        while self._waiting:
            first = self._waiting[0]
            if first.future.done():  # cancelled: its task removes it
                heapq.heappop(self._waiting)
                continue
            if not self._fits(first.ticket):
                return
            heapq.heappop(self._waiting)
            self._take(first.ticket)
            first.future.set_result(None)
