"""The data plane's in-process tests run under both event loops the daemon can use
(`server.event-loop`): uvloop, its default, and asyncio's. The two run callbacks in different
orders and only asyncio's exposes its internals; under asyncio alone these tests once hid that
the scheduler's direct run never happened under uvloop (daemon/core/scheduler.py:ready_queue)
and that an on-demand model with keep_alive 0 was unloaded before the request that loaded it
could lease it (daemon/core/residency.py: `_waiting`). Real daemons run uvloop already.

Not doubled: the modules whose tests write a plugin by name into a temporary directory. The
plugin registry keeps a plugin's modules by name for the process (daemon/core/plugins.py), so
the second run would import the first's."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
import uvloop

_ONE_LOOP = frozenset({"test_loading.py", "test_selection.py"})


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Any]:
    if item.path.name in _ONE_LOOP:
        return {"asyncio": asyncio.new_event_loop}
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
