"""The engine thread's results, handed to the event loop.

`loop.call_soon_threadsafe` wakes the loop by writing to its self-pipe with `socket.send`,
which lets go of the GIL for the system call. The loop thread wakes up, takes the GIL and
runs its whole turn (the chunk through the route, SSE encoding, the socket write) while the
engine thread, back from the write, waits for the GIL before it can start its next
llama_decode. py-spy on one stream: 4 % of the engine thread in that write, the decode
waiting behind it.

Here the engine thread queues the item and wakes the loop through a pipe of its own, once
per batch the loop has not yet taken, and writes the byte through libc's `write` called by
`ctypes.PyDLL`, which keeps the GIL. The engine thread goes straight on into its next
llama_decode (which lets go of the GIL), and the loop's turn runs during that decode.
py-spy, one stream: the engine thread in llama_decode 94 % of its time before, 99 % after.
Tokens/s, the tree before and after up at once with llama-server, taking turns (streamed
chat, 128 tokens each, 2 vCPUs), six runs of 16 or 32 rounds: 8 streams +4.2, +4.5, +4.7,
+2.1, -0.2 and -0.8 %; 1 stream +0.0 to +2.3 % (median +0.8 %). Small, and in the spread of
one run, but on the same side in most. The loop's turn still takes CPU from the decode's threads
on two vCPUs; where the machine has a core to spare it runs beside them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _write_holding_gil() -> Callable[[int, bytes, int], int] | None:
    """libc's write(2) called without letting go of the GIL; None where the process has no
    libc symbols to find (then os.write, which lets go of it, still works)."""
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError):
        return None
    write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    write.restype = ctypes.c_ssize_t
    return write


class Outbox:
    """Items for one event loop from other threads, each delivered there in the order put.

    Made and closed on the loop's thread; `put` from any thread. After `close` an item is
    dropped: nobody waits for it (the model is unloaded).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        # A full pipe (never: one byte per batch the loop has not taken) must not block.
        os.set_blocking(self._write, False)
        self._items: deque[tuple[Callable[[Any], None], Any]] = deque()
        self._woken = False
        self._closed = False
        self._write_byte = _write_holding_gil()
        loop.add_reader(self._read, self._drain)

    def emitter(self, deliver: Callable[[T], None]) -> Callable[[T], None]:
        """A callback the engine thread may call: runs `deliver(item)` on the loop's thread."""
        return lambda item: self.put(deliver, item)

    def put(self, deliver: Callable[[T], None], item: T) -> None:
        # Under the GIL from here to the write (libc's write keeps it), so `close` on the
        # loop's thread cannot come between the check and the write to the pipe's number.
        if self._closed:
            return
        self._items.append((deliver, item))
        if self._woken:
            return  # the loop has a byte to wake it and will take this item with the rest
        self._woken = True
        if self._write_byte is not None:
            self._write_byte(self._write, b"\0", 1)
        else:
            with contextlib.suppress(OSError):
                os.write(self._write, b"\0")

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._read, 4096)
        # Before taking the items: an item put after this line writes a byte again.
        self._woken = False
        items = self._items
        while items:
            deliver, item = items.popleft()
            try:
                deliver(item)
            except Exception as exc:  # one failed delivery must not lose the others
                self.loop.call_exception_handler({"message": "delivering an engine result failed", "exception": exc})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._items.clear()
        if not self.loop.is_closed():
            self.loop.remove_reader(self._read)
        os.close(self._read)
        os.close(self._write)
