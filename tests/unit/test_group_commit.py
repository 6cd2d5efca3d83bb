"""The group commit's queue: every write runs exactly once, in its own thread's wait, at most
``limit`` at a time, and a failing flush strands nobody."""

from __future__ import annotations

import threading
import time

import pytest

from portal.messaging.sending.group_commit import Entry, GroupCommit


class Write(Entry):
    __slots__ = ("flushed_by", "n", "result")

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.flushed_by: str | None = None
        self.result: int | None = None


def test_one_writer_alone_writes_each_entry_in_a_batch_of_its_own() -> None:
    batches: list[list[int]] = []

    def flush(batch: list[Write]) -> None:
        batches.append([w.n for w in batch])
        for w in batch:
            w.result = w.n * 10

    commit = GroupCommit(flush, limit=16)
    results = [commit.submit(Write(i)).result for i in range(5)]
    assert results == [0, 10, 20, 30, 40]
    assert batches == [[0], [1], [2], [3], [4]]


def test_writes_that_arrive_during_a_flush_go_together_each_once_within_the_limit() -> None:
    batches: list[list[int]] = []
    lock = threading.Lock()

    def flush(batch: list[Write]) -> None:
        time.sleep(0.01)  # a statement's round trip: the others queue meanwhile
        with lock:
            batches.append([w.n for w in batch])
        for w in batch:
            w.flushed_by = threading.current_thread().name
            w.result = w.n

    commit = GroupCommit(flush, limit=4)
    threads_n, per_thread = 12, 20
    got: dict[int, int | None] = {}

    def writer(t: int) -> None:
        for i in range(per_thread):
            n = t * 1000 + i
            done = commit.submit(Write(n))
            assert done.flushed_by is not None
            got[n] = done.result

    threads = [threading.Thread(target=writer, args=(t,), name=f"w{t}") for t in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)

    flushed = [n for batch in batches for n in batch]
    expected = {t * 1000 + i for t in range(threads_n) for i in range(per_thread)}
    assert sorted(flushed) == sorted(expected)  # each once
    assert got == {n: n for n in expected}
    assert max(len(b) for b in batches) == 4  # they did go together, never more than 4
    assert commit.written == len(expected)
    assert commit.batches == len(batches) < len(expected)


def test_a_flush_that_raises_wakes_its_batch_and_hands_the_lead_on() -> None:
    release = threading.Event()
    calls: list[list[int]] = []

    def flush(batch: list[Write]) -> None:
        calls.append([w.n for w in batch])
        if batch[0].n == 0:
            release.wait(5)
            raise RuntimeError("the database went away")
        for w in batch:
            w.result = w.n

    commit = GroupCommit(flush, limit=16)
    outcome: dict[int, object] = {}

    def writer(n: int) -> None:
        try:
            outcome[n] = commit.submit(Write(n)).result
        except RuntimeError as exc:
            outcome[n] = str(exc)

    first = threading.Thread(target=writer, args=(0,))
    first.start()
    while not calls:
        time.sleep(0.001)
    others = [threading.Thread(target=writer, args=(n,)) for n in (1, 2, 3)]
    for thread in others:
        thread.start()
    time.sleep(0.05)  # queued behind the failing flush
    release.set()
    for thread in [first, *others]:
        thread.join(5)
    assert outcome == {0: "the database went away", 1: 1, 2: 2, 3: 3}
    assert calls[0] == [0]
    assert sorted(calls[1]) == [1, 2, 3]
    # Nothing is left running: the next write leads at once.
    assert commit.submit(Write(9)).result == 9


def test_a_batch_holds_at_least_one_write() -> None:
    with pytest.raises(ValueError, match="at least one"):
        GroupCommit(lambda batch: None, limit=0)


def test_writes_behind_a_stuck_statement_go_alone_after_the_wait_and_batching_resumes() -> None:
    release = threading.Event()
    batches: list[list[int]] = []

    def flush(batch: list[Write]) -> None:
        batches.append([w.n for w in batch])
        if batch[0].n == 0:
            release.wait(10)  # a statement stuck on a lock
        for w in batch:
            w.result = w.n

    commit = GroupCommit(flush, limit=16, wait_s=0.2)
    stuck = threading.Thread(target=commit.submit, args=(Write(0),))
    stuck.start()
    while not batches:
        time.sleep(0.001)
    # Queued behind it: out of the queue after the wait, written alone meanwhile.
    started = time.monotonic()
    assert commit.submit(Write(1)).result == 1
    assert 0.2 <= time.monotonic() - started < 5
    # The statement has now run longer than the wait: the next one goes alone at once.
    started = time.monotonic()
    assert commit.submit(Write(2)).result == 2
    assert time.monotonic() - started < 0.2
    assert commit.withdrawn == 2
    assert batches == [[0], [1], [2]]
    release.set()
    stuck.join(5)
    # The stuck statement ended: the next write leads (no leader left behind, nothing queued).
    assert commit.submit(Write(3)).result == 3
    assert batches[-1] == [3]
    assert commit.withdrawn == 2


class _Interrupted(threading.Event):
    """A waiting writer's wake-up that raises as Ctrl-C would in a main thread."""

    def wait(self, timeout: float | None = None) -> bool:
        if super().wait(timeout):
            raise KeyboardInterrupt
        return False


def test_a_writer_interrupted_while_it_waits_strands_nobody() -> None:
    release = threading.Event()
    batches: list[list[int]] = []

    def flush(batch: list[Write]) -> None:
        batches.append([w.n for w in batch])
        if batch[0].n == 0:
            release.wait(10)
        for w in batch:
            w.result = w.n

    commit = GroupCommit(flush, limit=16, wait_s=30)
    leader = threading.Thread(target=commit.submit, args=(Write(0),))
    leader.start()
    while not batches:
        time.sleep(0.001)
    interrupted = Write(1)
    interrupted._woken = _Interrupted()
    raised: list[BaseException] = []

    def submit_interrupted() -> None:
        try:
            commit.submit(interrupted)
        except KeyboardInterrupt as exc:
            raised.append(exc)

    first = threading.Thread(target=submit_interrupted)
    first.start()
    while len(commit._queued) < 1:
        time.sleep(0.001)
    results: dict[int, int | None] = {}
    second = threading.Thread(target=lambda: results.update({2: commit.submit(Write(2)).result}))
    second.start()
    while len(commit._queued) < 2:
        time.sleep(0.001)
    # The leader ends: the lead goes to the interrupted writer, which hands it on as it leaves.
    release.set()
    for thread in (leader, first, second):
        thread.join(5)
    assert len(raised) == 1
    assert interrupted.result is None
    assert results == {2: 2}
    assert batches == [[0], [2]]
    assert commit.submit(Write(3)).result == 3  # nothing left running
