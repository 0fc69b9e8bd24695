"""A background producer thread that runs an iterator a few items ahead of its consumer.

Every producer is stopped and joined when the interpreter exits (an ``atexit`` hook, which runs
before finalization). A thread still running then would be killed by CPython the moment it
takes the GIL back, and if that happens inside pyarrow's C++ (a reader freeing its buffers)
the process aborts with ``terminate called without an active exception``. That is what an
iterator abandoned in a reference cycle (an error raised mid-epoch) used to leave behind.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

from ..base.stages import READ_AHEAD, Stage

__all__ = ["prefetch"]

T = TypeVar("T")

_END = object()
_EXIT_JOIN_SECONDS = 30.0  # per producer: at most one item being read when the process ends
_running: set[tuple[threading.Event, threading.Thread]] = set()


def prefetch(items: Iterator[T], depth: int, waited: threading.Event | None = None) -> Iterator[T]:
    """Run ``items`` in a background thread, ``depth`` ahead; errors re-raise in the consumer.

    Arrow decoding releases the GIL, so the next chunks decode while the consumer converts
    and trains on the current one. ``waited`` is set whenever the consumer finds no item
    ready (the producer is the slower side), for the producer to see.
    """
    buffer: queue.Queue[Any] = queue.Queue(depth)
    stop = threading.Event()

    def put(entry: tuple[Any, BaseException | None]) -> bool:
        """Hand ``entry`` over unless the consumer has gone; never block past that."""
        while not stop.is_set():
            try:
                buffer.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((_END, None))
        except BaseException as exc:  # re-raised in the consumer thread
            put((_END, exc))
        finally:
            try:
                if hasattr(items, "close"):  # a generator's own clean-up (its read-ahead) now
                    items.close()
            finally:
                _running.discard(producer)

    thread = threading.Thread(target=produce, name="tdu-prefetch", daemon=True)
    producer = (stop, thread)
    _running.add(producer)
    thread.start()
    try:
        while True:
            if waited is not None and buffer.empty():
                waited.set()
            with Stage(READ_AHEAD):
                item, error = buffer.get()
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        stop.set()


@atexit.register
def _stop_producers() -> None:
    """Stop every producer and wait for it, while threads can still finish cleanly."""
    producers = list(_running)
    for stop, _ in producers:
        stop.set()
    for _, thread in producers:
        # registered by another producer (a nested read-ahead) but not started yet: its stop
        # is set, so once started it ends at its first item
        if thread.ident is not None:
            thread.join(_EXIT_JOIN_SECONDS)
