"""Fixtures of the differential oracle: one tritonserver and one edged over the same repository."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from compat.models import STARTUP, write_repository
from compat.servers import ORACLE_ENV, Server, oracle_problem, start_edged, start_triton


@pytest.fixture(scope="session")
def compat_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    problem = oracle_problem()
    if problem is not None:
        pytest.skip(problem)
    repo = tmp_path_factory.mktemp("compat-repo")
    write_repository(repo)
    return repo


@pytest.fixture(scope="session")
def triton(compat_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_triton(Path(os.environ[ORACLE_ENV]), compat_repo, tmp_path_factory.mktemp("triton"), STARTUP)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def edged(compat_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_edged(compat_repo, tmp_path_factory.mktemp("edged"), STARTUP)
    yield server
    server.stop()
