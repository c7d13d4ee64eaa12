"""System (POSIX) shared memory regions, as Triton's system_shared_memory extension has them.

A client creates an object with `shm_open` (it appears under /dev/shm), registers a window of
it under a region name, then names that region in infer requests: inputs are read straight
from the mapping, outputs written straight into it, so no tensor crosses the socket.

Safety rules this module keeps:
- A key names one object directly under /dev/shm, exactly as glibc's `shm_open` resolves it
  (leading slashes stripped; no other slash, no "." or ".."); it is opened with O_NOFOLLOW, so a
  symlink cannot point the daemon at another file, and only a regular file is accepted.
- Every request holds a `Lease` on each region it uses. Unregistering removes the name at once
  (new requests no longer find it) but the mapping stays until the last lease is released, so
  a request in flight finishes on valid memory.
- The object's size is checked again on every lease: a client that truncates its object after
  registering gets a 400 instead of the daemon reading past the end of the file (SIGBUS). The
  window between that check and the read remains; as in Triton, a client racing truncate
  against its own request can still crash the reader, which is why only trusted callers may
  register regions (see docs/operations.md).
- numpy views keep a buffer export on the mmap; closing a mapping that is still exported
  raises BufferError, in which case the mapping is left to the garbage collector, which unmaps
  it when the last view dies. Memory is never unmapped under a live array.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from daemon.errors import InvalidArgument, NotFound

log = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass(eq=False)
class Region:
    """One registered window `[offset, offset + byte_size)` of a shared memory object."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    mapping: mmap.mmap
    # Where the window starts inside `mapping` (the mapping starts at a page boundary).
    delta: int
    leases: int = 0
    retired: bool = False

    def status(self) -> dict[str, object]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


@dataclass(eq=False)
class Lease:
    """A request's hold on `[offset, offset + byte_size)` of a region (offsets within the region)."""

    region: Region
    offset: int
    byte_size: int
    registry: SharedMemoryRegistry
    released: bool = field(default=False)

    @property
    def buffer(self) -> mmap.mmap:
        return self.region.mapping

    @property
    def start(self) -> int:
        """Where the leased bytes start in `buffer`."""
        return self.region.delta + self.offset

    def check_size(self) -> None:
        """Check again, right before the outputs are written, that the object still holds
        the region: the lease's check was made before the model ran, and a python model may
        run for seconds, during which a client could shrink its object."""
        _check_object_size(self.region)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.registry._release(self.region)


def _check_object_size(region: Region) -> None:
    size = os.fstat(region.fd).st_size
    if region.offset + region.byte_size > size:
        raise InvalidArgument(
            f"shared memory region '{region.name}': its object '{region.key}' shrank to {size} bytes, "
            f"below the registered offset {region.offset} + byte_size {region.byte_size}"
        )


def _object_path(root: Path, name: str, key: str) -> Path:
    """The file `shm_open(key)` opens, or InvalidArgument when the key is not a plain name."""
    bare = key.lstrip("/")
    if not bare or bare in (".", "..") or "/" in bare or "\0" in bare:
        raise InvalidArgument(
            f"cannot register shared memory region '{name}' - invalid shm key '{key}': a key "
            "is one name directly under /dev/shm, like '/my_region'"
        )
    return root / bare


class SharedMemoryRegistry:
    """Region name -> mapped region. Every method runs on the event loop (all are short syscalls)."""

    def __init__(self, root: Path = SHM_ROOT) -> None:
        self.root = root
        self._regions: dict[str, Region] = {}
        # Unregistered regions still leased by requests in flight.
        self._retired: set[Region] = set()

    # ------------------------------------------------------------------ control

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if name in self._regions:
            raise InvalidArgument(f"shared memory region '{name}' already in manager")
        if offset < 0 or byte_size <= 0:
            raise InvalidArgument(
                f"failed to register shared memory region '{name}': offset must be >= 0 and "
                f"byte_size > 0, got offset {offset} and byte_size {byte_size}"
            )
        path = _object_path(self.root, name, key)
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            raise InvalidArgument(
                f"Unable to open shared memory region: '{key}' ({exc.strerror})"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidArgument(
                    f"failed to register shared memory region '{name}': '{key}' is not a "
                    "shared memory object"
                )
            if offset + byte_size > info.st_size:
                raise InvalidArgument(
                    f"failed to register shared memory region '{name}': invalid args: offset "
                    f"{offset} + byte_size {byte_size} exceeds the {info.st_size}-byte object '{key}'"
                )
            # mmap offsets must be page-aligned; map from the page holding `offset`.
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            delta = offset - start
            try:
                mapping = mmap.mmap(fd, delta + byte_size, mmap.MAP_SHARED,
                                    mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
            except OSError as exc:
                raise InvalidArgument(
                    f"failed to register shared memory region '{name}': cannot map '{key}': "
                    f"{exc.strerror}"
                ) from None
        except BaseException:
            os.close(fd)
            raise
        self._regions[name] = Region(name, key, offset, byte_size, fd, mapping, delta)
        log.info("shared memory region %s registered: key=%s offset=%d byte_size=%d",
                 name, key, offset, byte_size)

    def unregister(self, name: str) -> None:
        """Drop a region (unknown names are fine, as in Triton). In-flight leases keep it mapped."""
        region = self._regions.pop(name, None)
        if region is None:
            return
        region.retired = True
        if region.leases:
            self._retired.add(region)
            log.info("shared memory region %s unregistered; unmapped when %d request(s) finish",
                     name, region.leases)
        else:
            _unmap(region)
            log.info("shared memory region %s unregistered", name)

    def unregister_all(self) -> None:
        for name in list(self._regions):
            self.unregister(name)

    def status(self, name: str | None = None) -> list[dict[str, object]]:
        if name is None:
            return [region.status() for region in self._regions.values()]
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"Unable to find system shared memory region: '{name}'")
        return [region.status()]

    def close(self) -> None:
        """Shutdown: unregister everything; mappings still leased are unmapped on release."""
        self.unregister_all()

    def mapped(self) -> int:
        """How many mappings are open (registered or retired but leased): for tests and stats."""
        return len(self._regions) + len(self._retired)

    # ------------------------------------------------------------------ requests

    def acquire(self, name: str, offset: int, byte_size: int) -> Lease:
        """Lease `[offset, offset + byte_size)` of region `name` for one request."""
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"Unable to find shared memory region: '{name}'")
        if offset < 0 or (offset >= region.byte_size and byte_size > 0):
            raise InvalidArgument(f"Invalid offset for shared memory region: '{name}'")
        if byte_size < 0 or offset + byte_size > region.byte_size:
            raise InvalidArgument(
                f"Invalid offset + byte size for shared memory region: '{name}' (offset {offset} "
                f"+ byte size {byte_size} exceeds its {region.byte_size} bytes)"
            )
        _check_object_size(region)
        region.leases += 1
        return Lease(region, offset, byte_size, self)

    def _release(self, region: Region) -> None:
        region.leases -= 1
        if region.leases == 0 and region.retired:
            self._retired.discard(region)
            _unmap(region)


def _unmap(region: Region) -> None:
    with contextlib.suppress(OSError):
        os.close(region.fd)
    try:
        region.mapping.close()
    except BufferError:
        # A numpy view of the mapping is still alive (a backend kept an input array): the
        # mmap object unmaps itself when that last view is garbage collected.
        log.debug("shared memory region %s: mapping still referenced; left to the GC", region.name)
