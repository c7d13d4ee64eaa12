"""The data plane's in-process tests run under both event loops the daemon can use
(`server.event-loop`): uvloop, its default, and asyncio's. The two run callbacks in different
orders and only asyncio's exposes its internals; under asyncio alone these tests once hid that
the scheduler's direct run never happened under uvloop (daemon/core/scheduler.py:ready_queue)
and that an on-demand model with keep_alive 0 was unloaded before the request that loaded it
could lease it (daemon/core/residency.py: `_waiting`). Real daemons run uvloop already."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
import uvloop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Any]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
