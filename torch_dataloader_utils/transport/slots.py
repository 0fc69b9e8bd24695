"""Shared-memory slots: where DataLoader workers write the numeric columns of their packets.

Each tensor a worker puts on the DataLoader queue costs a fresh shared-memory segment, a file
descriptor handed over a socket and page faults on both sides; so a worker writes a packet's
numeric columns (``transport.packet``) into a slot of :class:`SharedSlots`: a few shared-memory
buffers per worker, allocated once per iteration by the main process and reused. The queue then
carries only offsets (:class:`Slab`).

The main process hands out views of a slot (no copy) and takes the slot back once every view
is gone. So that a training loop that keeps batches can never starve a worker, at most
``slots - 2`` slots per worker stay lent out; a packet arriving beyond that is copied out and
its slot freed at once. Workers wait while all their slots are busy, which bounds memory.

A waiting worker blocks on a semaphore of its own, released by the main process whenever it
frees one of the worker's slots or starts or ends an iteration (no polling). Every
``_PARENT_CHECK`` seconds without news it checks that the main process is still alive, and
exits at once when it is not: a worker waiting here never returns to torch's worker loop,
whose watchdog would otherwise notice, so a trainer killed alone (the OOM killer) leaves no
worker behind.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..base.compat import new_shared_storage, storage_use_count

__all__ = ["SharedSlots", "Slab"]

_FREE, _BUSY = 0, 1
_GENERATION, _EPOCH, _FLAGS = 0, 1, 2  # positions in SharedSlots.control
# Seconds a waiting worker blocks before it checks that the main process is alive.
_PARENT_CHECK = 0.25
_ORPHANED_EXIT = 70  # a worker's exit status once its main process is gone (EX_SOFTWARE)
_GUARDED: set[int] = set()  # worker processes whose parent guard thread runs


@dataclass(frozen=True)
class Slab:
    """A tensor stored at byte ``offset`` of a slot; ``numpy`` restores a numpy array."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    numpy: bool


class SharedSlots:
    """``slots`` shared-memory buffers of ``slot_bytes`` per worker, and their flags.

    ``control[0]`` is the iteration's generation (a worker of an older one stops waiting);
    ``control[1]`` the epoch when the iteration starts one afresh, else -1 (so persistent
    workers follow ``set_epoch`` without a restart); ``control[2 + w * slots + s]`` is slot
    ``s`` of worker ``w``: free or busy.

    ``context`` is the multiprocessing start method the workers use, for the wake-up
    semaphores; the default, ``"spawn"``, makes semaphores that also work in forked and
    forkserver workers. ``"fork"`` makes semaphores without a name (unlinked at once), which
    leave nothing behind when the process is SIGKILLed.
    """

    def __init__(
        self,
        num_workers: int,
        slots: int = 4,
        slot_bytes: int = 2 << 20,
        *,
        context: str | None = None,
    ) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        # Allocated shared from the start: share_memory_() would allocate twice and copy.
        self.buffers = [
            [
                torch.empty(0, dtype=torch.uint8).set_(new_shared_storage(slot_bytes))
                for _ in range(slots)
            ]
            for _ in range(num_workers)
        ]
        self.control = torch.zeros(_FLAGS + num_workers * slots, dtype=torch.int64)
        self.control.share_memory_()  # type: ignore[no-untyped-call]
        self._lent: dict[tuple[int, int], int] = {}  # main process: (worker, slot) -> use count
        # One per worker, released when something it may be waiting for changed.
        wake = multiprocessing.get_context(context or "spawn")
        self._wake = [wake.Semaphore(0) for _ in range(num_workers)]
        self._owner = os.getpid()
        self._parent: tuple[int, int] | None = None  # worker: (its pid, its parent's pid)

    @property
    def _flags(self) -> np.ndarray:
        return self.control.numpy()

    def begin(self, fresh_epoch: int | None) -> int:
        """Main process, before workers (re)start: new generation (returned, for ``end``);
        slots not lent are free.

        ``fresh_epoch`` is the epoch the iteration starts from its beginning, ``None`` for a
        resume. Slots still viewed by batches of an earlier iteration stay lent until those go.
        """
        flags = self._flags
        flags[_GENERATION] += 1
        flags[_EPOCH] = -1 if fresh_epoch is None else fresh_epoch
        for worker in {w for w, _ in self._lent}:
            self._reclaim(worker)
        fresh = np.full(len(flags) - _FLAGS, _FREE, dtype=flags.dtype)
        for worker, slot in self._lent:
            fresh[worker * self.slots + slot] = _BUSY
        flags[_FLAGS:] = fresh  # one store: a lent slot never reads FREE in between
        self._wake_all()
        return int(flags[_GENERATION])

    def fresh_epoch(self) -> int | None:
        """Worker: the epoch this iteration starts afresh, ``None`` when it resumes."""
        epoch = int(self._flags[_EPOCH])
        return None if epoch < 0 else epoch

    def generation(self) -> int:
        return int(self._flags[_GENERATION])

    def end(self, generation: int) -> None:
        """Main process: the iteration ``begin`` numbered ``generation`` is over; its workers
        still waiting for a slot give up. A no-op once a newer iteration has begun: an older
        iterator closed late (``del``, the garbage collector) must not end the running one."""
        if self._flags[_GENERATION] != generation:
            return
        self._flags[_GENERATION] += 1
        self._wake_all()

    def acquire(self, worker: int, generation: int) -> int | None:
        """Worker: a free slot, marked busy; ``None`` once the iteration has ended.

        Blocks while every slot is busy; exits the process if the main process dies meanwhile.
        """
        flags = self._flags
        first = _FLAGS + worker * self.slots
        self._watch_parent()
        while flags[_GENERATION] == generation:
            free = np.flatnonzero(flags[first : first + self.slots] == _FREE)
            if len(free):
                slot = int(free[0])
                flags[first + slot] = _BUSY
                if flags[_GENERATION] != generation:  # a new iteration began: not ours
                    flags[first + slot] = _FREE
                    return None
                return slot
            if not self._wake[worker].acquire(timeout=_PARENT_CHECK) and self._orphaned():
                os._exit(_ORPHANED_EXIT)  # nobody is left to report to or clean up for
        return None

    def guard_worker(self) -> None:
        """Worker: exit within ``_PARENT_CHECK`` seconds once the main process is gone, also
        while idle in torch's worker loop (which notices only after its 5 s poll)."""
        self._watch_parent()
        if os.getpid() in _GUARDED:
            return
        _GUARDED.add(os.getpid())
        threading.Thread(target=self._guard, name="tdu-parent-guard", daemon=True).start()

    def _guard(self) -> None:
        while True:
            time.sleep(_PARENT_CHECK)
            if self._orphaned():
                os._exit(_ORPHANED_EXIT)

    def _watch_parent(self) -> None:
        """Worker: remember its parent, to notice when it is adopted by another one."""
        if self._parent is None or self._parent[0] != os.getpid():
            self._parent = (os.getpid(), os.getppid())

    def _orphaned(self) -> bool:
        """Worker: has the main process died? Its children are then adopted (a new parent
        pid); a worker started by a forkserver also checks the main process itself."""
        assert self._parent is not None
        if os.getppid() != self._parent[1]:
            return True
        try:
            os.kill(self._owner, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # pragma: no cover - alive, under another user
            pass
        return False

    def _wake_all(self) -> None:
        for wake in self._wake:
            wake.release()

    def view(self, worker: int, slot: int, slab: Slab) -> torch.Tensor:
        nbytes = int(np.prod(slab.shape)) * slab.dtype.itemsize
        raw = self.buffers[worker][slot][slab.offset : slab.offset + nbytes]
        return raw.view(slab.dtype).view(slab.shape)

    def lend_or_copy(self, worker: int, slot: int) -> bool:
        """Main process, on receiving a packet in ``slot``: may its batches view the slot?"""
        self._reclaim(worker)
        if sum(1 for w, _ in self._lent if w == worker) >= self.slots - 2:
            return False
        self._lent[worker, slot] = storage_use_count(self.buffers[worker][slot].untyped_storage())
        return True

    def free(self, worker: int, slot: int) -> None:
        self._flags[_FLAGS + worker * self.slots + slot] = _FREE
        self._wake[worker].release()

    def _reclaim(self, worker: int) -> None:
        """Free the lent slots of ``worker`` whose views the training loop has dropped."""
        for key in [k for k in self._lent if k[0] == worker]:
            storage = self.buffers[key[0]][key[1]].untyped_storage()
            if storage_use_count(storage) <= self._lent[key]:
                del self._lent[key]
                self.free(*key)
