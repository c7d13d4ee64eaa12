"""The event loop the daemon and its HTTP workers run on (`server.event-loop`).

uvloop by default: with the infer path compiled (packaging/native.py), asyncio's own Python
(selector, transports, callbacks) is the largest share of a small request's CPU, and uvloop
runs the same loop in C on libuv. Measured side by side with `bench/trees.py`, 32 clients of a
small model: ~1.2x the throughput at ~0.8x the server CPU per request (docs/performance.md).
"asyncio" keeps the standard library's loop, for a platform without uvloop or to rule it out.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from daemon.config import EventLoop
from daemon.errors import EdgedError

T = TypeVar("T")


def loop_factory(kind: EventLoop) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What `asyncio.Runner` makes its loop with (None: asyncio's default)."""
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        raise EdgedError(
            f'server.event-loop = "uvloop", but uvloop cannot be imported ({exc}); install it '
            '(pip install uvloop) or set server.event-loop = "asyncio"'
        ) from None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], kind: EventLoop) -> T:
    """Run `main` to completion on a new loop of `kind`, as `asyncio.run` does."""
    try:
        factory = loop_factory(kind)
    except BaseException:
        main.close()  # never awaited: no "coroutine was never awaited" warning on top of the error
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def describe(loop: asyncio.AbstractEventLoop) -> str:
    """The running loop as the startup log names it: "uvloop 0.23.0" or "asyncio"."""
    module = type(loop).__module__.partition(".")[0]
    version = getattr(sys.modules.get(module), "__version__", None)  # asyncio has none
    return f"{module} {version}" if version else module
