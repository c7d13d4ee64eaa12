"""HTTP worker processes (`server.workers`): more than one core for HTTP and the infer codec's
framing, with one copy of every model.

Why: every step of a request in the daemon runs under one interpreter lock, so at load the
daemon uses one core and no more while a 2-core box has the other mostly idle
(docs/performance.md). A worker is a process of its own, with its own lock:

- The daemon accepts every connection. It keeps the first `KEEP` open connections (one client
  pays no process hop) and hands each later one, before reading a byte of it, to the worker
  holding the fewest (SCM_RIGHTS over the control socket, daemon.api.channel).
- The worker serves the connection with the same front (daemon.api.front): it parses HTTP,
  sends each plain infer request's body to the daemon as one frame, and writes the answer. The
  daemon decodes, runs and encodes exactly as for its own connections (`Front.answer`); the
  frames of many requests travel in one system call at load.
- Any other request (admin, LLM routes, readiness, anything not plain) sends the connection
  back to the daemon at that request's start, with the bytes read and not answered; the daemon
  serves it from there on as it serves its own (access checks see the client's own socket).

A worker that dies is started again; its connections are lost, its requests in the daemon
cancelled. Stop: the daemon tells each worker to stop; a worker closes idle connections,
lets its requests finish (the daemon keeps answering them), and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import msgspec

from daemon.api.channel import (
    ANSWER,
    CANCEL,
    CLOSED,
    CONNECTION,
    HANDBACK,
    HANDBACK_FD,
    REQUEST,
    STOP,
    FrameReader,
    Writer,
    frame,
    receive_control,
    send_control,
)
from daemon.api.front import binary_offset

if TYPE_CHECKING:
    from daemon.api.front import Front
    from daemon.config import DaemonConfig

log = logging.getLogger(__name__)

# Open connections the daemon serves itself before handing new ones to workers.
KEEP = 1
# A worker that exits is started again after this long.
_RESTART_S = 1.0
# The environment variables a worker reads: its descriptors ("control,frames") and its config.
FDS_ENV, CONFIG_ENV = "EDGED_WORKER_FDS", "EDGED_WORKER_CONFIG"
HANDBACK_ID = struct.Struct("<I")


def worker_command() -> list[str]:
    """How this program starts a worker: the frozen executable's `worker` command, or the package's."""
    if getattr(sys, "frozen", False):
        return [sys.executable, "worker"]
    return [sys.executable, "-m", "daemon", "worker"]


def _header_offset(kind: int, meta: Any) -> int | None:
    """Where a request frame's binary tensor data starts (to receive its body aligned)."""
    if kind != REQUEST or not isinstance(meta, list) or len(meta) < 3 or not isinstance(meta[2], str):
        return None
    return binary_offset(meta[2])


class _Worker:
    """One worker process and the daemon's end of its two channels."""

    def __init__(self, pool: WorkerPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.proc: subprocess.Popen[bytes] | None = None
        self.control: socket.socket | None = None
        self.writer: Writer | None = None
        self.up = False
        self.connections = 0  # handed to it and not closed
        self.tasks: dict[int, asyncio.Task[None]] = {}
        # A connection handed back arrives in two parts (descriptor, bytes), paired by id.
        self.handback_fds: dict[int, int] = {}
        self.handback_bytes: dict[int, tuple[bytes, tuple[int, str] | None]] = {}
        self.gone = asyncio.get_running_loop().create_future()

    async def start(self, config_json: bytes) -> None:
        loop = asyncio.get_running_loop()
        control, control_far = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        frames, frames_far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            env = {
                **os.environ,
                FDS_ENV: f"{control_far.fileno()},{frames_far.fileno()}",
                CONFIG_ENV: config_json.decode(),
            }
            # Popen forks and execs: not on the loop.
            self.proc = await asyncio.to_thread(
                subprocess.Popen, worker_command(), env=env, pass_fds=(control_far.fileno(), frames_far.fileno())
            )
        except BaseException:
            for sock in (control, frames):
                sock.close()
            raise
        finally:
            control_far.close()
            frames_far.close()
        control.setblocking(False)
        self.control = control
        loop.add_reader(control.fileno(), self._on_control)
        transport, _ = await loop.connect_accepted_socket(
            lambda: FrameReader(self._dispatch, self._lost, _header_offset), frames
        )
        self.writer = Writer(transport)
        self.up = True

    def hand_out(self, sock: socket.socket) -> bool:
        if not self.up or self.control is None:
            return False
        try:
            send_control(self.control, CONNECTION, sock.fileno())
        except OSError:
            return False
        self.connections += 1
        self.pool.connections += 1
        return True

    def stop(self) -> None:
        if self.up and self.control is not None:
            with contextlib.suppress(OSError):
                send_control(self.control, STOP)

    # ------------------------------------------------------------------ from the worker

    def _dispatch(self, kind: int, ident: int, meta: Any, body: bytes | memoryview) -> None:
        if kind == REQUEST:
            model, version, header_length, unix, url = meta
            self.tasks[ident] = asyncio.get_running_loop().create_task(
                self._answer(ident, model, version, header_length, unix, url.encode("latin-1"), body)
            )
        elif kind == CANCEL:
            task = self.tasks.pop(ident, None)
            if task is not None:
                task.cancel()
        elif kind == CLOSED:
            self.connections -= 1
            self.pool.connections -= 1
        elif kind == HANDBACK:
            failure = (int(meta[0]), str(meta[1])) if meta else None
            self.handback_bytes[ident] = (bytes(body), failure)
            self._adopt(ident)

    async def _answer(
        self, ident: int, model: str, version: str | None, header_length: str | None, unix: bool, url: bytes,
        body: bytes | memoryview,
    ) -> None:
        try:
            if isinstance(body, memoryview):
                body = body.toreadonly()
            status, payload, json_length = await self.pool.front.answer(model, version, body, header_length, unix, url)
        finally:
            self.tasks.pop(ident, None)
        if self.writer is not None:
            self.writer.send(frame(ANSWER, ident, [status, json_length], payload))

    def _on_control(self) -> None:
        assert self.control is not None
        while True:
            message = receive_control(self.control)
            if message is None:
                return
            data, fd = message
            if not data:
                self._close_control()
                return
            if data[:1] == HANDBACK_FD and fd is not None:
                (ident,) = HANDBACK_ID.unpack_from(data, 1)
                self.handback_fds[ident] = fd
                self._adopt(ident)
            elif fd is not None:
                os.close(fd)

    def _adopt(self, ident: int) -> None:
        if ident not in self.handback_fds or ident not in self.handback_bytes:
            return  # the other half is on its way
        fd = self.handback_fds.pop(ident)
        prefix, failure = self.handback_bytes.pop(ident)
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            return
        self.pool.front.adopt(sock, prefix, failure)

    def _close_control(self) -> None:
        if self.control is not None:
            asyncio.get_running_loop().remove_reader(self.control.fileno())
            self.control.close()
            self.control = None

    def _lost(self) -> None:
        """The frame stream closed: the worker exited (or is exiting)."""
        self.up = False
        self.writer = None
        self._close_control()
        for task in self.tasks.values():
            task.cancel()  # nobody can read their answers
        self.tasks.clear()
        for fd in self.handback_fds.values():
            os.close(fd)
        self.handback_fds.clear()
        self.handback_bytes.clear()
        self.pool.connections -= self.connections
        self.connections = 0
        if not self.gone.done():
            self.gone.set_result(None)
        self.pool.worker_lost(self)


class WorkerPool:
    """The daemon's HTTP worker processes (`server.workers` of them), owned by the server."""

    def __init__(self, count: int, front: Front, config: DaemonConfig) -> None:
        self.count = count
        self.front = front
        self.config_json = msgspec.json.encode({"server": config.server, "logging": config.logging})
        self.workers: list[_Worker] = []
        self.connections = 0  # handed to workers and not closed: they count towards the cap
        self.stopping = False
        self._restarts: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        for index in range(self.count):
            await self._spawn(index)

    async def _spawn(self, index: int) -> None:
        worker = _Worker(self, index)
        try:
            await worker.start(self.config_json)
        except OSError as exc:
            log.error("HTTP worker %d did not start: %s; serving its connections here", index, exc)
            return
        if index < len(self.workers):
            self.workers[index] = worker
        else:
            self.workers.append(worker)

    def takes(self, local_connections: int) -> bool:
        return local_connections >= KEEP and not self.stopping and any(w.up for w in self.workers)

    def hand_out(self, sock: socket.socket) -> bool:
        for worker in sorted((w for w in self.workers if w.up), key=lambda w: w.connections):
            if worker.hand_out(sock):
                return True
        return False

    def worker_lost(self, worker: _Worker) -> None:
        proc = worker.proc
        if self.stopping:
            return
        code = proc.poll() if proc is not None else None
        log.error("HTTP worker %d stopped (exit status %s); starting it again", worker.index, code)
        task = asyncio.get_running_loop().create_task(self._restart(worker))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, worker: _Worker) -> None:
        if worker.proc is not None:
            await asyncio.to_thread(worker.proc.wait)
        await asyncio.sleep(_RESTART_S)
        if not self.stopping:
            await self._spawn(worker.index)

    async def stop(self, grace_s: float) -> None:
        """Workers stop taking requests, finish theirs within `grace_s` (the daemon answers
        them meanwhile), and exit; one still running after that is killed."""
        self.stopping = True
        for task in self._restarts:
            task.cancel()
        for worker in self.workers:
            worker.stop()
        waiting = [w.gone for w in self.workers if not w.gone.done()]
        if waiting:
            await asyncio.wait(waiting, timeout=grace_s + 1.0)
        for worker in self.workers:
            proc = worker.proc
            if proc is None:
                continue
            if proc.poll() is None:
                proc.kill()
            await asyncio.to_thread(proc.wait)
