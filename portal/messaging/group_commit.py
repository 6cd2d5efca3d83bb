"""Group commit: writes that arrive while one is running go to the database together.

A delivery worker that has sent a record waits for its Sent write (and the claim of its next
record, which rides on it) before it does anything else. With several workers, those writes
queue behind each other at the database, each a round trip, a plan run and a WAL flush of its
own. Here the first writer to arrive runs its write at once (nothing waits for a batch to
fill: at one worker every write goes alone, as before); the writers that arrive while it runs
queue, and the next of them runs all queued writes (at most ``limit``) in one statement.
Each writer still waits for its own write, so nothing is buffered beyond the records the
workers hold anyway: a crash loses no more than it would without batching (each worker's one
record, left in Sending for the stuck-send sweep).

The leader runs ``flush(batch)``, which must set every entry's result and must not raise;
then, when more have queued, it hands the lead to the first of them and goes back to its own
work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar


class Entry:
    """One writer's place in the queue; subclasses carry what the flush needs and returns."""

    __slots__ = ("_leads", "_woken")

    def __init__(self) -> None:
        self._woken = threading.Event()
        self._leads = False


E = TypeVar("E", bound=Entry)


class GroupCommit(Generic[E]):
    """A queue of writes of one kind; ``submit`` returns once the entry's write has run."""

    def __init__(self, flush: Callable[[list[E]], None], limit: int):
        if limit < 1:
            raise ValueError(f"a batch holds at least one write, not {limit}")
        self._flush = flush
        self.limit = limit
        self._lock = threading.Lock()
        self._queued: list[E] = []
        self._running = False  # a leader is flushing; queued entries wait for it
        self.batches = 0
        self.written = 0  # entries flushed (written / batches: the mean batch size)

    def submit(self, entry: E) -> E:
        with self._lock:
            self._queued.append(entry)
            leads = not self._running
            self._running = True
        if not leads:
            entry._woken.wait()
            if not entry._leads:
                return entry  # a leader wrote it
        with self._lock:
            batch = self._queued[: self.limit]
            del self._queued[: self.limit]
            self.batches += 1
            self.written += len(batch)
        try:
            self._flush(batch)
        finally:
            for done in batch:
                if done is not entry:
                    done._woken.set()
            # The lead goes to the first write that queued meanwhile (this thread goes back
            # to its own work), whatever the flush did.
            with self._lock:
                if self._queued:
                    following = self._queued[0]
                    following._leads = True
                    following._woken.set()
                else:
                    self._running = False
        return entry
