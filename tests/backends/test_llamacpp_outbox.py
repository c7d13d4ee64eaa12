"""The llama.cpp backend's Outbox: the engine thread's results to the event loop, in order, on
the loop's thread, one wake-up per batch, nothing after close."""

from __future__ import annotations

import array
import asyncio
import fcntl
import os
import termios
import threading

from backends.llamacpp.outbox import Outbox, _write_holding_gil


def _pending_bytes(fd: int) -> int:
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


def test_items_from_threads_arrive_in_order_on_the_loop_thread() -> None:
    async def main() -> list[tuple[int, int, bool]]:
        loop = asyncio.get_running_loop()
        outbox = Outbox(loop)
        got: list[tuple[int, int, bool]] = []
        done = loop.create_future()

        def deliver(item: tuple[int, int]) -> None:
            got.append((*item, threading.current_thread() is threading.main_thread()))
            if len(got) == 4 * 500:
                done.set_result(None)

        def producer(number: int) -> None:
            for i in range(500):
                outbox.put(deliver, (number, i))

        threads = [threading.Thread(target=producer, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        await asyncio.wait_for(done, 10)
        for thread in threads:
            thread.join()
        outbox.close()
        return got

    got = asyncio.run(main())
    assert all(on_loop for _, _, on_loop in got)
    for number in range(4):
        assert [i for n, i, _ in got if n == number] == list(range(500))


def test_one_wake_up_per_batch_the_loop_has_not_taken() -> None:
    loop = asyncio.new_event_loop()
    try:
        outbox = Outbox(loop)
        got: list[int] = []
        for i in range(50):
            outbox.put(got.append, i)
        assert _pending_bytes(outbox._read) == 1 and got == []
        loop.run_until_complete(asyncio.sleep(0.01))
        assert got == list(range(50)) and _pending_bytes(outbox._read) == 0
        outbox.put(got.append, 50)  # taken: the next item wakes the loop again
        assert _pending_bytes(outbox._read) == 1
        loop.run_until_complete(asyncio.sleep(0.01))
        assert got == list(range(51))
        outbox.close()
    finally:
        loop.close()


def test_a_failing_delivery_loses_no_other_item() -> None:
    loop = asyncio.new_event_loop()
    errors: list[BaseException | None] = []
    loop.set_exception_handler(lambda _, context: errors.append(context.get("exception")))
    try:
        outbox = Outbox(loop)
        got: list[int] = []

        def deliver(item: int) -> None:
            if item == 1:
                raise ValueError("no")
            got.append(item)

        for i in range(3):
            outbox.put(deliver, i)
        loop.run_until_complete(asyncio.sleep(0.01))
        assert got == [0, 2]
        assert len(errors) == 1 and isinstance(errors[0], ValueError)
        outbox.close()
    finally:
        loop.close()


def test_nothing_is_delivered_or_written_after_close() -> None:
    loop = asyncio.new_event_loop()
    try:
        outbox = Outbox(loop)
        got: list[int] = []
        outbox.put(got.append, 1)
        loop.run_until_complete(asyncio.sleep(0.01))  # taken: the next put would write again
        number = outbox._write
        outbox.close()
        # An engine thread that outlived its unload: its item is dropped, and nothing is
        # written to the pipe's old number, which another file may have by now (here one does).
        other_read, other_write = os.pipe()
        os.dup2(other_write, number)
        try:
            outbox.put(got.append, 2)
            loop.run_until_complete(asyncio.sleep(0.01))
            assert got == [1] and _pending_bytes(other_read) == 0
        finally:
            for fd in {number, other_read, other_write}:
                os.close(fd)
        outbox.close()  # twice: nothing more
    finally:
        loop.close()


def test_the_wake_up_byte_is_written_by_libc() -> None:
    # Where libc's symbols are found (Linux, macOS): the write that keeps the GIL.
    write = _write_holding_gil()
    assert write is not None
    read_end, write_end = os.pipe()
    try:
        assert write(write_end, b"\0", 1) == 1
        assert os.read(read_end, 8) == b"\0"
    finally:
        os.close(read_end)
        os.close(write_end)
