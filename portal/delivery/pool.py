"""A pool of delivery workers for one channel, fed by a poller and by the workers themselves.

A worker that finishes a record claims its own next one at once. An idle worker waits for the
poller, which every ``POLL_INTERVAL_S`` (or at once, when woken by a NOTIFY) claims one due
record per idle worker. Either way the claim is one statement (``scan.claim_due``); after a
send that ends Sent, the worker's next claim is part of the Sent write's statement. Both
take records in the same fair order: transactional first, tenants in turn within a stream.

Broadcast records hold at most ``broadcast_cap`` of the workers (``BROADCAST_MAX_SHARE`` of
the pool, and never all of them: one worker stays free for transactional work). A claim
that may return broadcast records first reserves a slot for each under the pool's lock;
when none is free the worker claims transactional work only (``scan.TRANSACTIONAL_ONLY``),
and declines the next claim inside the Sent write, which would take either stream.

At most ``pool size - 1`` workers are in flight to any one server or provider: each attempt
runs inside ``scan.gating_routes(self.routes)``, and the attempt asks ``scan.enter_route``
once its server or provider is chosen.

A worker may claim several records in its Sent write (``held``), at most
``claim.NEXT_CLAIM_MAX``, which is 1: measured end to end, holding bought no throughput and
made other tenants' mail wait (see there). Above 1, while one tenant's backlog is deep: one at
first, twice as many after a claim that came back full and of one tenant; one again after a
claim that did not, and one whenever another worker of the pool is waiting for work. It
works through the records it holds, in the fair order (``in_turns``), before it claims
again; each keeps its own status and version and is prepared just before its own send. A
worker that holds any broadcast record holds one broadcast slot, whatever their number.
After a kill -9 the records a worker held and had not begun are swept as a retry of a record
never prepared, so never resent as ambiguous: the one in flight is, as before.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import Engine

from portal.messaging.sending.claim import (
    ALL_STREAMS,
    TRANSACTIONAL_ONLY,
    RouteGate,
    claim_due,
    claiming_next,
    gating_routes,
    in_turns,
    is_broadcast,
)
from portal.models import Channel, MailSendRecord, SmsSendRecord
from portal.models.direct import holding
from portal.models.record import Stream

log = logging.getLogger("portal.delivery")


class WorkerContext(Protocol):
    def close(self) -> None: ...


@dataclass(frozen=True)
class ChannelSpec:
    """How to deliver one channel: its table, how many workers, and one attempt."""

    channel: Channel
    model: type[MailSendRecord] | type[SmsSendRecord]
    concurrency: int
    make_context: Callable[[], Any]
    process: Callable[[Any, Any], None]
    broadcast_max_share: float = 0.75  # Settings.broadcast_max_share (BROADCAST_MAX_SHARE)
    # How long a worker may hold a claimed record it has not begun (half of
    # STUCK_SEND_THRESHOLD_S): later, one an earlier attempt prepared is left to the sweep,
    # which may have given it to another worker already (an unprepared one is safe to go on
    # with: preparation writes by version, so a record taken from it stops there).
    max_hold_s: float = 150.0


# How long ``ChannelPool.stop`` waits for the claims under way (a claim statement takes
# milliseconds; a database that does not answer is not waited for longer).
CLAIM_STOP_WAIT_S = 5.0


def broadcast_cap(workers: int, share: float) -> int:
    """How many of ``workers`` broadcast records may hold at once: ``share`` of them, rounded
    down, and at most all but one; at least one (a pool of one worker shares it)."""
    return max(1, min(math.floor(share * workers), workers - 1))


class ChannelPool:
    """Worker threads plus a poller for one channel."""

    def __init__(self, engine: Engine, spec: ChannelSpec, poll_interval_s: float):
        self.engine = engine
        self.spec = spec
        self.poll_interval_s = poll_interval_s
        self.stop_claiming = threading.Event()
        self.wake = threading.Event()
        self.handoff: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        # Claims under way (a claim statement, or a Sent write asked to claim): ``stop``
        # waits for them, so that once it returns no claim runs any more.
        self._claiming = 0
        self._claims_over = threading.Condition(self._lock)
        self._idle = 0
        self._in_flight = 0
        self._threads: list[threading.Thread] = []
        self.claimed_total = 0
        self.claimed_with_sent = 0  # of which claimed inside a Sent write
        self.claims_with_sent = 0  # the claims made in Sent writes (several records each)
        self._failures = 0
        self._last_report = 0.0
        self.broadcast_cap = broadcast_cap(spec.concurrency, spec.broadcast_max_share)
        self._broadcast = 0  # broadcast records held (claimed, not yet done) + reservations
        self._current = threading.local()  # the record this worker thread works on
        # At most pool size - 1 workers in flight per server or provider (scan.enter_route).
        self.routes = RouteGate(spec.concurrency - 1)

    # --- life cycle ----------------------------------------------------------------------

    def start(self) -> None:
        name = self.spec.channel.value
        for i in range(self.spec.concurrency):
            thread = threading.Thread(target=self._work, name=f"{name}-worker-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        poller = threading.Thread(target=self._poll, name=f"{name}-poller", daemon=True)
        poller.start()
        self._threads.append(poller)

    def stop(self) -> None:
        """Claim nothing more; workers finish the record in hand and exit. Returns once no
        claim is under way (at most ``CLAIM_STOP_WAIT_S``): a claim that began before the stop
        may still take a record, none after this returns (a worker's "claiming nothing more"
        line is said after it)."""
        self.stop_claiming.set()
        self.wake.set()
        with self._claims_over:
            self._claims_over.wait_for(lambda: self._claiming == 0, CLAIM_STOP_WAIT_S)

    def _begin_claim(self) -> bool:
        """Count a claim about to run; False (and not counted) once stopping."""
        with self._lock:
            if self.stop_claiming.is_set():
                return False
            self._claiming += 1
            return True

    def _end_claim(self) -> None:
        with self._lock:
            self._claiming -= 1
            if self._claiming == 0:
                self._claims_over.notify_all()

    def join(self, deadline: float) -> bool:
        """Wait until ``deadline`` (monotonic) for the threads; True when all have ended."""
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # --- claiming ------------------------------------------------------------------------

    @property
    def broadcast_held(self) -> int:
        return self._broadcast

    def _reserve(self, k: int, handing_over: bool = False) -> int:
        """Reserve up to ``k`` broadcast slots (``handing_over``: this thread's broadcast
        record is about to be done, so its slot counts as free)."""
        with self._lock:
            held = self._broadcast - (1 if handing_over else 0)
            reserved = max(0, min(k, self.broadcast_cap - held))
            self._broadcast += reserved
            return reserved

    def _settle(self, reserved: int, records: list[Any]) -> None:
        """Keep a reserved slot for each broadcast record claimed; free the rest."""
        used = sum(1 for record in records if is_broadcast(record))
        with self._lock:
            self._broadcast -= reserved - used

    def _claim(self, k: int) -> list[Any]:
        """Up to ``k`` due records in the fair order, broadcast ones only into free slots
        (none once stopping)."""
        if not self._begin_claim():
            return []
        try:
            return self._claim_slots(k)
        finally:
            self._end_claim()

    def _claim_slots(self, k: int) -> list[Any]:
        reserved = self._reserve(k)
        records: list[Any] = []
        try:
            if reserved < k:
                # Not enough broadcast slots for all k: transactional first, then broadcast
                # (or transactional come since) into the slots there are.
                records = self._claim_streams(k, TRANSACTIONAL_ONLY)
                if reserved and len(records) < k:
                    records += self._claim_streams(min(reserved, k - len(records)), ALL_STREAMS)
            else:
                records = self._claim_streams(k, ALL_STREAMS)
        finally:
            self._settle(reserved, records)
        return records

    def _claim_streams(self, k: int, streams: tuple[Stream, ...]) -> list[Any]:
        try:
            records = claim_due(self.engine, self.spec.model, k, streams)
        except Exception as exc:
            # The database is away (restart, failover): say so, wait, try again. Every
            # thread polls, so an outage would print a traceback per thread per poll: one
            # full report every 30 s, one line otherwise, and a wait that grows to 5 s.
            self._failures += 1
            now = time.monotonic()
            extra = {"channel": self.spec.channel.value, "failures": self._failures}
            if now - self._last_report > 30:
                self._last_report = now
                log.exception("claim failed; retrying", extra=extra)
            else:
                log.warning("claim failed again: %s", type(exc).__name__, extra=extra)
            self.stop_claiming.wait(min(5.0, self.poll_interval_s * 2 ** min(self._failures, 6)))
            return []
        self._failures = 0
        with self._lock:
            self.claimed_total += len(records)
        return records

    def _poll(self) -> None:
        while not self.stop_claiming.is_set():
            self.wake.wait(self.poll_interval_s)
            self.wake.clear()
            if self.stop_claiming.is_set():
                break
            with self._lock:
                idle = self._idle - self.handoff.qsize()
            if idle <= 0:
                continue
            for record in self._claim(idle):
                self.handoff.put(record)

    # --- working -------------------------------------------------------------------------

    def _work(self) -> None:
        context = self.spec.make_context()
        try:
            # A backlog waiting at start is taken at once, not after the first poll interval.
            with holding(self.engine):
                record: Any = self._claim_own()
            while True:
                if record is None:
                    record = self._wait_for_work()
                    if record is None:
                        break  # stopping, nothing handed over
                # While there is work, its statements share one connection; none is held
                # while the worker waits.
                with holding(self.engine):
                    while record is not None:
                        record = self._attempt_and_next(context, record)
        finally:
            context.close()

    def _attempt(self, context: Any, record: Any) -> None:
        with self._lock:
            self._in_flight += 1
        self._current.record = record
        try:
            with gating_routes(self.routes):
                self.spec.process(context, record)
        except Exception:
            # Even the failure write failed (the database is away): the record stays in
            # Sending for the stuck-send sweep; this thread must live on.
            log.exception(
                "delivery attempt could not be recorded; leaving it to the sweep",
                extra={"channel": self.spec.channel.value, "record_id": record.id},
            )
        finally:
            self._current.record = None
            with self._lock:
                self._in_flight -= 1
            self._let_go(record)

    def _let_go(self, record: Any) -> None:
        """A worker holds one broadcast slot while any broadcast record is in its hands."""
        if is_broadcast(record) and not any(is_broadcast(r) for r, _t in self._held()):
            with self._lock:
                self._broadcast -= 1

    def _held(self) -> deque[tuple[Any, float]]:
        """The records this worker thread claimed in its last Sent write and has not begun,
        with when (monotonic)."""
        held: deque[tuple[Any, float]] | None = getattr(self._current, "held", None)
        if held is None:
            held = self._current.held = deque()
        return held

    def _next_held(self) -> Any:
        """The next record this worker holds (None: none). One an earlier attempt prepared
        and held past ``max_hold_s`` stays in Sending for the sweep (see ChannelSpec)."""
        held = self._held()
        while held:
            record, since = held.popleft()
            if record.prepared_at is None or time.monotonic() - since <= self.spec.max_hold_s:
                return record
            log.warning(
                "held too long to send; left to the stuck-send sweep",
                extra={"channel": self.spec.channel.value, "record_id": record.id},
            )
            self._let_go(record)
        return None

    def _attempt_and_next(self, context: Any, record: Any) -> Any:
        """One attempt, then this worker's next record: the next it holds, else a send that
        ends Sent claims the next ones in its Sent write (``scan.claiming_next``: one
        statement and one commit fewer per record); any other outcome claims one on its own."""
        self._current.reserved = 0
        self._current.claiming = False
        try:
            with claiming_next(self.spec.model, self._may_claim) as following:
                self._attempt(context, record)
        finally:
            if self._current.claiming:  # the Sent write was asked to claim: it is over
                self._current.claiming = False
                self._end_claim()
        reserved, self._current.reserved = self._current.reserved, 0
        records = following.records if following.ran else []
        # The worker's one slot, kept when any of the records it now holds is broadcast.
        used = 1 if any(is_broadcast(r) for r in records) else 0
        with self._lock:
            self._broadcast -= reserved - used
        held = self._held()
        if following.ran:
            with self._lock:
                self.claimed_total += len(records)
                self.claimed_with_sent += len(records)
                self.claims_with_sent += 1
            # More at a time only while one tenant's backlog fills the claims: with several
            # tenants due, a record held behind others waits for their sends.
            deep = len(records) == following.k and len({r.tenant_id for r in records}) == 1
            self._current.want = following.k * 2 if deep else 1  # capped by the claim
            now = time.monotonic()
            held.extend((r, now) for r in in_turns(records))
        if held:
            return self._next_held()
        return None if following.ran else self._claim_own()

    def _may_claim(self) -> int:
        """Asked by the Sent write just before it would claim this worker's next records, of
        either stream: how many (none while it holds some, or without a broadcast slot for
        this worker; this record's own counts as free: it is done once the write commits)."""
        if self._held():
            return 0
        # Counted as a claim under way from the first ask to the end of the Sent write.
        counted = getattr(self._current, "claiming", False)
        if counted:
            if self.stop_claiming.is_set():
                return 0
        elif not self._begin_claim():
            return 0
        current = getattr(self._current, "record", None)
        reserved = self._reserve(1, handing_over=current is not None and is_broadcast(current))
        self._current.reserved = reserved
        if reserved != 1:
            if not counted:
                self._end_claim()
            return 0
        self._current.claiming = True  # ended once the Sent write is over
        # One only while another worker of this pool waits for work: records held here
        # would wait behind this worker's sends while that one sits idle.
        return 1 if self._idle > self.handoff.qsize() else getattr(self._current, "want", 1)

    def _claim_own(self) -> Any:
        """This worker's next record, claimed by itself (None: nothing due, or stopping)."""
        own = self._claim(1)
        return own[0] if own else None

    def _wait_for_work(self) -> Any:
        with self._lock:
            self._idle += 1
        try:
            while True:
                try:
                    return self.handoff.get(timeout=0.2 if self.stop_claiming.is_set() else 1.0)
                except queue.Empty:
                    if self.stop_claiming.is_set():
                        return None
        finally:
            with self._lock:
                self._idle -= 1
