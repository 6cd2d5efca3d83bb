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

The leader runs ``flush(batch)``, which sets every entry's result (an entry whose flush
ended before it did must read as failed, not as written); then, when more have queued, it
hands the lead to the first of them and goes back to its own work.

A write that has queued for ``wait_s`` without a leader taking it (the running statement is
stuck: a lock, a hung connection) leaves the queue and runs alone, as it would without the
group commit, and so does every write that arrives while a leader has been running longer
than that: one slow statement holds up the writes in it, not every writer of the process.
"""

from __future__ import annotations

import threading
import time
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

    def __init__(self, flush: Callable[[list[E]], None], limit: int, wait_s: float = 1.0):
        if limit < 1:
            raise ValueError(f"a batch holds at least one write, not {limit}")
        self._flush = flush
        self.limit = limit
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._queued: list[E] = []
        self._running = False  # a leader is flushing; queued entries wait for it
        self._since = 0.0  # when the running leader started (time.monotonic)
        self.batches = 0
        self.written = 0  # entries flushed (written / batches: the mean batch size)
        self.withdrawn = 0  # entries that ran alone beside a leader stuck over wait_s

    def submit(self, entry: E, wait_s: float | None = None) -> E:
        """Run ``entry``'s write, with those that queue meanwhile; ``wait_s`` (default: the
        queue's) bounds the wait for a stuck leader, after which the write runs alone."""
        wait_s = self.wait_s if wait_s is None else wait_s
        with self._lock:
            now = time.monotonic()
            stuck = self._running and now - self._since > wait_s
            leads = not self._running
            if stuck:
                self.withdrawn += 1
            else:
                self._queued.append(entry)
                if leads:
                    self._running, self._since = True, now
        if stuck:
            self._flush([entry])  # alone, beside the stuck statement
            return entry
        if not leads:
            try:
                if not entry._woken.wait(wait_s) and self._withdraw(entry):
                    self._flush([entry])  # alone, beside the stuck statement
                    return entry
                entry._woken.wait()
            except BaseException:
                self._abandon(entry)  # an interrupt in the wait: nobody may wait for us
                raise
            if not entry._leads:
                return entry  # a leader wrote it
        batch: list[E] = []
        try:
            with self._lock:
                batch = self._queued[: self.limit]
                del self._queued[: self.limit]
                self.batches += 1
                self.written += len(batch)
            self._flush(batch)
        finally:
            for done in batch:
                if done is not entry:
                    done._woken.set()
            # The lead goes to the first write that queued meanwhile (this thread goes back
            # to its own work), whatever the flush did.
            with self._lock:
                if not batch and entry in self._queued:  # interrupted before taking it
                    self._queued.remove(entry)
                self._hand_on()
        return entry

    def _hand_on(self) -> None:
        """The lead to the first queued write, or nobody runs (under the lock)."""
        if self._queued:
            following = self._queued[0]
            following._leads = True
            self._since = time.monotonic()
            following._woken.set()
        else:
            self._running = False

    def _withdraw(self, entry: E) -> bool:
        """Take ``entry`` out of the queue when no leader has taken it (it will run alone)."""
        with self._lock:
            if entry._woken.is_set() or entry not in self._queued:
                return False  # in a running batch, or handed the lead: wait for that
            self._queued.remove(entry)
            self.withdrawn += 1
            return True

    def _abandon(self, entry: E) -> None:
        """A waiting writer interrupted (KeyboardInterrupt in a main thread): out of the
        queue unwritten, and a lead handed to it goes on to the next write."""
        with self._lock:
            if entry in self._queued:
                self._queued.remove(entry)
                if entry._leads:
                    self._hand_on()
