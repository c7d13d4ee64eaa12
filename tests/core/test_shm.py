"""The shared memory region registry against real POSIX shared memory objects in /dev/shm."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from daemon.core.shm import SHM_ROOT, SharedMemoryRegistry
from daemon.errors import InvalidArgument, NotFound

pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this system")


@pytest.fixture
def make_object() -> Iterator[Callable[[int], str]]:
    """Create a /dev/shm object of the given size (what shm_open + ftruncate do); returns its key."""
    made: list[Path] = []

    def make(size: int) -> str:
        name = f"edged-test-{uuid.uuid4().hex}"
        path = SHM_ROOT / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        os.close(fd)
        made.append(path)
        return "/" + name

    yield make
    for path in made:
        path.unlink(missing_ok=True)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _maps(key: str) -> bool:
    """Whether this process has `key` mapped (what /proc/self/maps says, not what we think)."""
    return f"/dev/shm{key}" in Path("/proc/self/maps").read_text()


def test_register_status_unregister(make_object: Callable[[int], str]) -> None:
    key = make_object(4096)
    registry = SharedMemoryRegistry()
    registry.register("r", key, 0, 4096)
    assert registry.status() == [{"name": "r", "key": key, "offset": 0, "byte_size": 4096}]
    assert registry.status("r") == registry.status()
    assert _maps(key)
    registry.unregister("r")
    assert registry.status() == []
    assert registry.mapped() == 0
    assert not _maps(key)
    registry.unregister("r")  # unknown names are fine, as in Triton
    with pytest.raises(NotFound, match="Unable to find system shared memory region: 'r'"):
        registry.status("r")


def test_data_is_shared_both_ways_at_any_offset(make_object: Callable[[int], str]) -> None:
    key = make_object(8192)
    path = SHM_ROOT / key.lstrip("/")
    values = np.arange(10, dtype=np.float32)
    with path.open("r+b") as f:
        f.seek(100 + 12)
        f.write(values.tobytes())
    registry = SharedMemoryRegistry()
    registry.register("r", key, 100, 4000)  # not page-aligned: mapped from the page below
    lease = registry.acquire("r", 12, 40)
    view = np.frombuffer(lease.buffer, np.float32, 10, lease.start)
    np.testing.assert_array_equal(view, values)
    view[0] = 42.0
    with path.open("rb") as f:
        f.seek(112)
        assert np.frombuffer(f.read(4), np.float32)[0] == 42.0
    del view
    lease.release()
    registry.close()


def test_duplicate_name_keeps_the_first(make_object: Callable[[int], str]) -> None:
    first, second = make_object(64), make_object(64)
    registry = SharedMemoryRegistry()
    registry.register("r", first, 0, 64)
    with pytest.raises(InvalidArgument, match="shared memory region 'r' already in manager"):
        registry.register("r", second, 0, 64)
    assert registry.status("r")[0]["key"] == first
    assert not _maps(second)
    registry.close()


@pytest.mark.parametrize("key", ["", "/", "//", "/..", "..", ".", "/a/b", "../etc/passwd", "/x\0y"])
def test_keys_that_are_not_one_object_name(key: str) -> None:
    registry = SharedMemoryRegistry()
    before = _open_fds()
    with pytest.raises(InvalidArgument, match="invalid shm key"):
        registry.register("r", key, 0, 1)
    assert registry.mapped() == 0 and _open_fds() == before


def test_key_naming_no_object() -> None:
    registry = SharedMemoryRegistry()
    with pytest.raises(InvalidArgument, match="Unable to open shared memory region: '/edged-no-such"):
        registry.register("r", "/edged-no-such-object", 0, 1)
    assert registry.mapped() == 0


def test_symlink_out_of_the_root_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 4096)
    root = tmp_path / "shm"
    root.mkdir()
    (root / "link").symlink_to(secret)
    (root / "dir").mkdir()
    registry = SharedMemoryRegistry(root)
    before = _open_fds()
    with pytest.raises(InvalidArgument, match="Unable to open shared memory region: '/link'"):
        registry.register("r", "/link", 0, 16)
    with pytest.raises(InvalidArgument, match="Unable to open shared memory region: '/dir'"):
        registry.register("r", "/dir", 0, 16)
    assert registry.mapped() == 0 and _open_fds() == before


@pytest.mark.parametrize(("offset", "size"), [(0, 4097), (4096, 1), (4000, 200), (0, 0), (-1, 10)])
def test_window_beyond_the_object(make_object: Callable[[int], str], offset: int, size: int) -> None:
    key = make_object(4096)
    registry = SharedMemoryRegistry()
    before = _open_fds()
    with pytest.raises(InvalidArgument, match="failed to register shared memory region 'r'"):
        registry.register("r", key, offset, size)
    assert registry.mapped() == 0 and _open_fds() == before and not _maps(key)


def test_acquire_checks_name_and_bounds(make_object: Callable[[int], str]) -> None:
    key = make_object(128)
    registry = SharedMemoryRegistry()
    registry.register("r", key, 0, 128)
    with pytest.raises(NotFound, match="Unable to find shared memory region: 'other'"):
        registry.acquire("other", 0, 4)
    with pytest.raises(InvalidArgument, match="Invalid offset for shared memory region: 'r'"):
        registry.acquire("r", 128, 4)
    with pytest.raises(InvalidArgument, match="Invalid offset \\+ byte size for shared memory region: 'r'"):
        registry.acquire("r", 120, 16)
    registry.acquire("r", 0, 128).release()
    registry.close()


def test_unregister_while_leased_keeps_the_mapping_until_release(make_object: Callable[[int], str]) -> None:
    key = make_object(4096)
    registry = SharedMemoryRegistry()
    registry.register("r", key, 0, 4096)
    lease = registry.acquire("r", 0, 16)
    registry.unregister("r")
    # Gone for new requests, and the name can be registered again...
    with pytest.raises(NotFound):
        registry.acquire("r", 0, 16)
    assert registry.status() == []
    # ...but the request in flight still reads valid memory.
    assert _maps(key) and registry.mapped() == 1
    lease.buffer[lease.start] = 7
    assert lease.buffer[lease.start] == 7
    lease.release()
    lease.release()  # idempotent
    assert registry.mapped() == 0 and not _maps(key)


def test_a_live_numpy_view_outlives_unregister(make_object: Callable[[int], str]) -> None:
    key = make_object(4096)
    registry = SharedMemoryRegistry()
    registry.register("r", key, 0, 4096)
    lease = registry.acquire("r", 0, 4096)
    view = np.frombuffer(lease.buffer, np.uint8, 4096, lease.start)
    lease.release()
    registry.unregister("r")  # cannot unmap under the view: left to the GC, never a crash
    assert registry.mapped() == 0
    view[0] = 1
    assert view[0] == 1
    del view, lease  # the last references to the mapping: now it is unmapped
    assert not _maps(key)


def test_an_object_truncated_after_registering_is_refused(make_object: Callable[[int], str]) -> None:
    key = make_object(8192)
    registry = SharedMemoryRegistry()
    registry.register("r", key, 0, 8192)
    os.truncate(SHM_ROOT / key.lstrip("/"), 100)
    with pytest.raises(InvalidArgument, match="shrank to 100 bytes"):
        registry.acquire("r", 0, 16)
    registry.close()
    assert registry.mapped() == 0


def test_close_releases_everything(make_object: Callable[[int], str]) -> None:
    keys = [make_object(64) for _ in range(3)]
    registry = SharedMemoryRegistry()
    before = _open_fds()
    for i, key in enumerate(keys):
        registry.register(f"r{i}", key, 0, 64)
    registry.close()
    assert registry.mapped() == 0 and _open_fds() == before
    assert not any(_maps(key) for key in keys)
