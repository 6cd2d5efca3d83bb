"""The due scan and the claim: how a worker finds its next record and makes it its own.

The scan is two queries, each walking its own status index and reading only the rows it
returns: Pending by ``updated_time`` and due Retry by ``next_retry_at``. One
``status = ? OR (status = ? AND next_retry_at <= ?)`` query would get a generic plan that walks
the whole history (seed 000, "How a scan reads"); two keep the cost flat as history grows.

The claim is one statement on both dialects: an UPDATE to Sending with ``version + 1`` over a
sub-select of still-due candidates. PostgreSQL takes the candidates ``FOR UPDATE SKIP LOCKED``
so contending workers skip each other's rows instead of queueing behind them; SQLite has one
writer at a time and the re-checked status and version guard the same way.

``claim_due`` is what the delivery loop runs: the scan folded into the claim (the same two
index walks, as CTEs that lock with SKIP LOCKED, merged by due time), one statement in its own
transaction, compiled once and run on the driver (portal.models.direct). ``scan_due`` plus
``claim`` are the two-step form (a caller's transaction; the scan-plan tests read them).
A busy worker's next claim rides on its Sent write (``claiming_next``, PostgreSQL): the
record is written Sent and the next one claimed in one statement and one commit.
"""

from __future__ import annotations

import math
import random
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Engine,
    Text,
    and_,
    case,
    func,
    literal_column,
    or_,
    select,
    text,
    union_all,
    update,
)
from sqlalchemy.orm import Session

from portal.messaging import transitions
from portal.messaging.sending import breaker
from portal.messaging.transitions import Cause
from portal.models import ConfigEpoch, MailSendRecord, SendStatus, SmsSendRecord, db_now
from portal.models.direct import Direct, Loader
from portal.models.record import Stream

RecordModel = type[MailSendRecord] | type[SmsSendRecord]

# The claim as the transition table has it: to Sending, from Pending or from a due Retry, each
# walked along its own index and so guarded on its own.
_CLAIM = transitions.change(Cause.CLAIMED, SendStatus.SENDING)
_FROM_PENDING = transitions.change(Cause.CLAIMED, SendStatus.SENDING, [SendStatus.PENDING])
_FROM_RETRY = transitions.change(Cause.CLAIMED, SendStatus.SENDING, [SendStatus.RETRY])


@dataclass(frozen=True, order=True)
class Candidate:
    due_at: datetime
    id: int


def scan_due(session: Session, model: RecordModel, n: int) -> list[Candidate]:
    """Up to ``n`` due records, longest due first (two index walks, merged)."""
    pending = (
        select(model.updated_time, model.id)
        .where(_FROM_PENDING.where(model.status))
        .order_by(model.updated_time)
        .limit(n)
    )
    retry = (
        select(model.next_retry_at, model.id)
        .where(_FROM_RETRY.where(model.status), model.next_retry_at <= db_now())
        .order_by(model.next_retry_at)
        .limit(n)
    )
    rows = [Candidate(due, rid) for due, rid in session.execute(pending)]
    rows += [Candidate(due, rid) for due, rid in session.execute(retry) if due is not None]
    rows.sort()
    return rows[:n]


def _due_condition(model: RecordModel) -> object:
    return or_(
        _FROM_PENDING.where(model.status),
        and_(_FROM_RETRY.where(model.status), model.next_retry_at <= db_now()),
    )


def claim(
    session: Session, model: RecordModel, ids: list[int], k: int
) -> list[MailSendRecord | SmsSendRecord]:
    """Claim up to ``k`` of ``ids`` that are still due; returns the claimed records (Sending).

    Runs in the caller's (short) transaction; the caller commits at once.
    """
    if not ids or k <= 0:
        return []
    candidates = (
        select(model.id)
        .where(model.id.in_(ids), _due_condition(model))  # type: ignore[arg-type]
        # In the order given (the caller shuffled them), not the index's.
        .order_by(case({rid: pos for pos, rid in enumerate(ids)}, value=model.id))
        .limit(k)
        .with_for_update(skip_locked=True)
    )
    statement = (
        update(model)
        .where(model.id.in_(candidates.scalar_subquery()))
        .values(
            **_CLAIM.values,
            version=model.version + 1,
            updated_time=db_now(),
            first_claimed_at=func.coalesce(model.first_claimed_at, db_now()),
        )
        .returning(model)
        .execution_options(synchronize_session=False)
    )
    return list(session.scalars(statement))


def claim_next(
    session: Session, model: RecordModel, *, scan_size: int, k: int, rng: random.Random
) -> list[MailSendRecord | SmsSendRecord]:
    """Scan ``scan_size`` due records, shuffle them, and claim ``k`` of them, in the caller's
    transaction: the two-step form of ``claim_due`` (which the workers run), for callers
    that want a claim order other than oldest first (the sweep's tests)."""
    found = scan_due(session, model, scan_size)
    if not found:
        return []
    ids = [c.id for c in found]
    rng.shuffle(ids)  # so the workers do not all go for the oldest one
    return claim(session, model, ids, k)


def _sql(value: str | int) -> Any:
    """A constant of this module written into the SQL, not bound (see ``Direct``)."""
    return literal_column(f"'{value}'" if isinstance(value, str) else str(int(value)))


ALL_STREAMS = (Stream.TRANSACTIONAL, Stream.BROADCAST)
TRANSACTIONAL_ONLY = (Stream.TRANSACTIONAL,)
_NO_TENANT = -(2**63)  # below every tenant id (the platform's is -1)


# Where the tenants' turn goes on from: the tenant of the newest claim (its Sending record,
# one step back along idx_*_status_updated; none within 10 s: from the lowest tenant id) or,
# in the Sent write (``claim_statement``), the tenant of the record written Sent, read from
# the Sent write's own CTE (``SENT_CTE``, which returns ``tenant_id``).
_NEWEST_CLAIM = (
    "SELECT r.tenant_id FROM {table} r WHERE r.status = 'Sending' "
    "AND r.updated_time > now() - interval '10 seconds' ORDER BY r.updated_time DESC LIMIT 1"
)
SENT_CTE = "sent"
# max: the Sent write of a group commit (``outcomes``) writes several records; the turn goes
# on after the highest of their tenants (one record: its tenant).
_SENT_RECORD = f"SELECT max(s.tenant_id) FROM {SENT_CTE} s"
# Every scan that locks rows is gated on the turn (its index walks start from the turn; the
# Retry walk has this one-time filter; the single-record claim function takes the turn as its
# argument), so in the Sent write no claim can lock a row before the Sent write has run: the
# turn reads the Sent write's result. The claim never holds a
# lock while the Sent write waits for one, which is what made a claim-first statement
# deadlock under 8 threads (PostgreSQL promises no order for data-modifying CTEs; the data
# dependency does).
_AFTER_TURN = "(SELECT cur FROM turn) IS NOT NULL"


def _fair_sql(table: str, stream: Stream, k: int) -> tuple[str, str]:
    """PostgreSQL: the CTEs that pick up to ``k`` due records of one stream, fairly, and the
    name of the one to select ``id`` from in pick order.

    Pending: the tenants with Pending work of this stream take turns, from the tenant after
    the cursor (CTE ``turn``) in tenant id order, wrapping round once: a recursive skip-scan
    of ``idx_*_pending_fair`` walks the next ``k + 1`` tenants, and a LATERAL walk takes each
    one's oldest ``k`` records ``FOR UPDATE SKIP LOCKED`` (a tenant whose records other
    workers hold gives way to the next). Picked first of every tenant, then second of every
    tenant, ..., in turn order: with T tenants due, a tenant's next record is at most T
    claims away, and the work is ``k + 1`` index probes whatever the number of tenants or
    the size of the history. Retry is the oldest due, along ``idx_*_retry_due`` (in the
    single-record claim, ``postroom_claim_one_*``, due retries take the tenants' turn too).
    The two are merged turn by turn (first of each; between the two of one rank the tenant
    whose turn comes first; then second of each; ...)."""
    s = stream.value
    pending = f"{_FROM_PENDING.sql_where('r.status')} AND r.stream = '{s}'"
    after = (
        f"SELECT r.tenant_id FROM {table} r WHERE {pending} AND r.tenant_id > {{x}} "
        "ORDER BY r.tenant_id LIMIT 1"
    )
    first = f"SELECT r.tenant_id FROM {table} r WHERE {pending} ORDER BY r.tenant_id LIMIT 1"
    retry = f"""
retry_{s} AS (
  SELECT r.id, r.next_retry_at AS due, r.tenant_id AS tid FROM {table} r
  WHERE {_FROM_RETRY.sql_where("r.status")} AND r.stream = '{s}' AND r.next_retry_at <= now()
    AND {_AFTER_TURN}
  ORDER BY r.next_retry_at LIMIT {k} FOR UPDATE SKIP LOCKED
),"""
    walk = f"""
walk_{s}(tid, lap, n) AS (
  SELECT f.tid, f.lap, 1
  FROM turn c
  CROSS JOIN LATERAL (SELECT ({after.format(x="c.cur")}) AS nxt OFFSET 0) a
  CROSS JOIN LATERAL (
    SELECT coalesce(a.nxt, ({first})) AS tid, CASE WHEN a.nxt IS NULL THEN 1 ELSE 0 END AS lap
  ) f
  WHERE f.tid IS NOT NULL AND (f.lap = 0 OR f.tid <= c.cur)
  UNION ALL
  SELECT f.tid, f.lap, w.n + 1
  FROM walk_{s} w CROSS JOIN turn c
  CROSS JOIN LATERAL (SELECT ({after.format(x="w.tid")}) AS nxt OFFSET 0) a
  CROSS JOIN LATERAL (
    SELECT coalesce(a.nxt, CASE WHEN w.lap = 0 THEN ({first}) END) AS tid,
           CASE WHEN a.nxt IS NULL THEN 1 ELSE w.lap END AS lap
  ) f
  WHERE w.n <= {k} AND f.tid IS NOT NULL AND (f.lap = 0 OR f.tid <= c.cur)
),
"""
    oldest = f"""
    SELECT r.id, r.updated_time AS due, r.tenant_id AS tid FROM {table} r
    WHERE {pending} AND r.tenant_id = w.tid
    ORDER BY r.updated_time LIMIT {k} FOR UPDATE SKIP LOCKED"""
    picks = f"""
pending_{s} AS (
  SELECT c.id, c.due, c.tid, w.n AS pos,
         row_number() OVER (PARTITION BY w.n ORDER BY c.due) AS turn
  FROM walk_{s} w CROSS JOIN LATERAL ({oldest}
  ) c
),
due_{s} AS (
  SELECT p.id, p.due, p.tid, row_number() OVER (ORDER BY p.turn, p.pos) AS seq
  FROM pending_{s} p
  UNION ALL
  SELECT q.id, q.due, q.tid, row_number() OVER (ORDER BY q.due) AS seq FROM retry_{s} q
)"""
    return retry + walk + picks, f"due_{s}"


def fair_pick_sql(
    table: str, k: int, streams: tuple[Stream, ...], *, after_sent: bool = False
) -> str:
    """PostgreSQL: a query of the ids of up to ``k`` records to claim, in the fair order, every
    constant written in (``after_sent``: the turn goes on from the tenant of the record the
    enclosing statement's ``SENT_CTE`` wrote Sent; ``streams``: every stream, or
    transactional only).

    ``k = 1``, every busy worker's next claim, calls ``postroom_claim_one_<table>`` (migration
    0022), which runs only the index probes that claim needs: as SQL, the same order was a
    plan of about 60 nodes, each set up at every run whether used or not (0.17 ms a record
    against 0.02 ms). Its one input is the turn, so in the Sent write it runs after that
    write: it reads the write's result. ``k > 1`` (the poll) is the SQL walk below.
    Transactional first: a later stream's CTEs run only when the earlier ones found fewer
    than ``k`` (an Append under a Limit stops pulling)."""
    if streams not in (ALL_STREAMS, TRANSACTIONAL_ONLY):
        raise ValueError(f"claimable streams: every one, or transactional only; not {streams}")
    cursor = (_SENT_RECORD if after_sent else _NEWEST_CLAIM).format(table=table)
    if k == 1:
        broadcast = "true" if Stream.BROADCAST in streams else "false"
        return (
            f"SELECT c.id FROM (SELECT postroom_claim_one_{table}("
            f"coalesce(({cursor}), {_NO_TENANT}), {broadcast}) AS id) c WHERE c.id IS NOT NULL"
        )
    turn = f"\nturn(cur) AS (SELECT coalesce(({cursor}), {_NO_TENANT}) AS cur),"
    parts = [_fair_sql(table, stream, k) for stream in streams]
    ctes = turn + ",".join(sql for sql, _name in parts)
    # First of each (the Pending turn's, the oldest due Retry), then second of each, ...;
    # between a Pending and a Retry record of one rank, the tenant whose turn comes first
    # after the cursor (a tenant's retry backlog never holds up another's new mail), then the
    # longer due.
    order = "seq, tid <= (SELECT cur FROM turn), tid, due"
    selects = [f"(SELECT id FROM {name} ORDER BY {order} LIMIT {k})" for _sql, name in parts]
    body = "\nUNION ALL\n".join(selects)
    if len(selects) > 1:
        body = f"SELECT id FROM ({body}) picked LIMIT {k}"
    return f"WITH RECURSIVE {ctes}\n{body}"


@dataclass(frozen=True)
class Looked:
    """What a claim on PostgreSQL read beside the record it claimed, for the attempt that
    follows (one round trip fewer per record; migration 0028): ``suppressions``, the tenant's
    active suppressions of the record's recipients as JSON text (rows of address, reason,
    "YYYY-MM-DD HH:MI" UTC, created_by, detail; None when there are none), and ``epoch``,
    the configuration epoch (``configcache``). Read by ``preparation.suppressed_recipients``."""

    suppressions: str | None
    epoch: int | None


_LOOKED = "_postroom_claim_looked"  # where a claimed record carries it (not a mapped column)


def looked(record: Any) -> Looked | None:
    """What the claim of this record read beside it, if a claim on PostgreSQL loaded it."""
    found: Looked | None = vars(record).get(_LOOKED)
    return found


class ClaimLoader:
    """Builds a claimed record from the claim's columns: the record's (mapper order), then,
    on PostgreSQL, the two columns of ``Looked``."""

    def __init__(self, model: RecordModel):
        self.record = Loader(model)
        self.pk_index = self.record.pk_index
        self.width = len(self.record.columns)
        suppressions = (
            func.postroom_mail_suppression_hits(
                model.tenant_id,
                model.to_addrs,
                model.cc_addrs,
                model.bcc_addrs,
                type_=Text,
            )
            if model is MailSendRecord
            else func.postroom_sms_suppression_hits(
                model.tenant_id,
                model.phone_number,  # type: ignore[union-attr]
                type_=Text,
            )
        )
        self.looked: tuple[Any, ...] = (
            suppressions.label("looked_suppressions"),
            ConfigEpoch.current().label("looked_epoch"),
        )

    def columns(self, dialect: str) -> tuple[Any, ...]:
        return self.record.columns + (self.looked if dialect == "postgresql" else ())

    def load(self, row: Sequence[Any]) -> Any:
        width = self.width
        if len(row) == width:
            return self.record.load(row)
        instance = self.record.load(row[:width])
        vars(instance)[_LOOKED] = Looked(row[width], row[width + 1])
        return instance


class _DueClaim:
    """The one-statement claim of up to ``k`` due records of one table, built once per ``k``
    and set of streams.

    It has no parameters: its statuses, streams and ``k`` are written into the SQL, so
    PostgreSQL plans it once. With ``status = $1`` it planned the claim anew at every run on
    a large table (its generic plan looked dearer than the plans for the values), a quarter
    of the claim's time (bench/claim.py).

    PostgreSQL runs the fair pick (``fair_pick_sql``); SQLite, one writer at a time and no
    SKIP LOCKED, the simpler form: the two status walks of the allowed streams merged by
    stream, then due time (transactional first, oldest first; no turns between tenants)."""

    def __init__(self, model: RecordModel):
        self.model = model
        self.loader = ClaimLoader(model)
        self._by_key: dict[tuple[str, int, tuple[Stream, ...]], Direct] = {}
        self.after_sent = self.statement(1, ALL_STREAMS, "postgresql", after_sent=True)
        self._after_sent: dict[int, Any] = {1: self.after_sent}

    def direct(self, dialect: str, k: int, streams: tuple[Stream, ...] = ALL_STREAMS) -> Direct:
        key = (dialect, k, streams)
        found = self._by_key.get(key)
        if found is None:
            built = Direct(self.statement(k, streams, dialect), self.loader.columns(dialect))
            found = self._by_key.setdefault(key, built)
        return found

    def _pick(self, k: int, streams: tuple[Stream, ...], dialect: str, after_sent: bool) -> Any:
        model = self.model
        if dialect == "postgresql":
            sql = fair_pick_sql(model.__tablename__, k, streams, after_sent=after_sent)
            return text(sql).columns(model.id.label("id"))
        allowed = model.stream.in_([_sql(s.value) for s in streams])
        pending = (
            select(
                model.id.label("id"), model.stream.label("stream"), model.updated_time.label("due")
            )
            .where(_FROM_PENDING.where(model.status, literal=True), allowed)
            .order_by(model.updated_time)
            .limit(_sql(k))
            .cte("pending")
        )
        retry = (
            select(
                model.id.label("id"), model.stream.label("stream"), model.next_retry_at.label("due")
            )
            .where(
                _FROM_RETRY.where(model.status, literal=True),
                model.next_retry_at <= db_now(),
                allowed,
            )
            .order_by(model.next_retry_at)
            .limit(_sql(k))
            .cte("retry")
        )
        due = union_all(
            select(pending.c.id, pending.c.stream, pending.c.due),
            select(retry.c.id, retry.c.stream, retry.c.due),
        ).subquery("due")
        first = case((due.c.stream == _sql(Stream.TRANSACTIONAL.value), _sql(0)), else_=_sql(1))
        return select(due.c.id).order_by(first, due.c.due).limit(_sql(k))

    def statement(
        self,
        k: int,
        streams: tuple[Stream, ...] = ALL_STREAMS,
        dialect: str = "postgresql",
        *,
        after_sent: bool = False,
    ) -> Any:
        """The claim as an UPDATE returning the record's columns in mapper order (and, on
        PostgreSQL, ``Looked``'s)."""
        model = self.model
        pick = self._pick(k, streams, dialect, after_sent).cte("pick")
        return (
            update(model)
            .where(model.id == pick.c.id)
            .values(
                **_CLAIM.literal_values,
                version=model.version + _sql(1),
                updated_time=db_now(),
                first_claimed_at=func.coalesce(model.first_claimed_at, db_now()),
            )
            .returning(*self.loader.columns(dialect))
        )

    def __call__(
        self, engine: Engine, k: int, streams: tuple[Stream, ...] = ALL_STREAMS
    ) -> list[MailSendRecord | SmsSendRecord]:
        _count, rows = self.direct(engine.dialect.name, k, streams).run(engine)
        return [self.loader.load(row) for row in rows]


_CLAIMS = {model: _DueClaim(model) for model in (MailSendRecord, SmsSendRecord)}


def claim_due(
    engine: Engine, model: RecordModel, k: int, streams: tuple[Stream, ...] = ALL_STREAMS
) -> list[MailSendRecord | SmsSendRecord]:
    """Claim up to ``k`` due records of ``streams`` in one statement of its own, in the fair
    order (transactional first; within a stream the tenants take turns; see
    ``fair_pick_sql``); returns them detached, as claimed (status Sending, version bumped)."""
    if k <= 0:
        return []
    breaker.tick(engine)  # an idle pool's poll is the open breakers' clock too
    return _CLAIMS[model](engine, k, streams)


def is_broadcast(record: Any) -> bool:
    return getattr(record, "stream", None) == Stream.BROADCAST.value


def in_turns(records: list[Any]) -> list[Any]:
    """A claim's records in the fair order, as near as the records tell it (an UPDATE ...
    RETURNING returns them in no order): transactional first; within a stream each tenant's
    first, then each one's second, ...; a tenant's oldest first."""
    rank: dict[tuple[bool, int], int] = {}
    keyed = []
    for record in sorted(records, key=lambda r: r.id):
        key = (is_broadcast(record), record.tenant_id)
        rank[key] = rank.get(key, -1) + 1
        keyed.append(((key[0], rank[key], record.tenant_id, record.id), record))
    return [record for _key, record in sorted(keyed, key=lambda pair: pair[0])]


# --- the next claim, in the Sent write's statement ---------------------------------------------


# At most this many records claimed for one worker in one statement (``NextClaim.k``): one,
# so a worker holds no record it has not begun. In bench/budget.py's statements alone, 8
# claimed in every 8th Sent write cost PostgreSQL 300 us a record against 490 for one in
# every Sent write; end to end it bought nothing: at full size (bench/README.md, "How many to
# hold") mail/s over bare smtplib moved as much between two runs of one setting as between
# 1, 2 and 4 (0.60-0.75 at 1 and 4 workers), while at 2 and 4 another tenant's mail waited
# behind the held records (its median 13 -> 44-54 ms, its p99 2.12x alone once) and a
# backlog drained slower beside it (0.76-0.90 of alone, goal 0.9). The mechanism stays,
# tested at 4: a larger k is this constant away.
NEXT_CLAIM_MAX = 1


@dataclass
class NextClaim:
    """A pool worker's request, while it works on a record, to claim its next ones inside the
    statement that writes this one Sent (PostgreSQL; ``sent_write.record_sent``): one round
    trip and one commit fewer per record. ``wanted`` is asked just before (the worker may be
    stopping): how many records to claim, at most ``NEXT_CLAIM_MAX`` (True: one; 0 or False:
    none), kept as ``k``; ``ran`` says the claim was made (``records``, in the fair order, may
    then be fewer than ``k`` or empty: nothing more was due)."""

    model: RecordModel
    wanted: Callable[[], int]
    ran: bool = False
    records: list[MailSendRecord | SmsSendRecord] = field(default_factory=list)
    k: int = 1


_next = threading.local()


@contextmanager
def claiming_next(model: RecordModel, wanted: Callable[[], int]) -> Iterator[NextClaim]:
    """Within the block, a Sent write of a ``model`` record in this thread also claims the
    next due ones (at most once), as many as ``wanted()`` says then (True: one)."""
    request = NextClaim(model, wanted)
    _next.request = request
    try:
        yield request
    finally:
        _next.request = None


def next_claim_for(model: RecordModel) -> NextClaim | None:
    """This thread's open request for ``model``, if it wants a claim now (taken: once only)."""
    request: NextClaim | None = getattr(_next, "request", None)
    if request is None or request.model is not model or request.ran:
        return None
    k = min(int(request.wanted()), NEXT_CLAIM_MAX)
    if k <= 0:
        return None
    request.k = k
    return request


def claim_statement(model: RecordModel, k: int = 1) -> Any:
    """The claim of up to ``k`` records in the fair order, every stream (an UPDATE returning
    the record's columns in ``loader_for``'s order), to be used after a CTE named ``SENT_CTE``
    that writes records Sent and returns their ``tenant_id`` (PostgreSQL): the tenants' turn
    goes on from the highest of those tenants, and nothing is locked before that write ran. A
    pool whose broadcast share is full declines this claim (``NextClaim.wanted``) and claims
    transactional work on its own instead."""
    claims = _CLAIMS[model]
    found = claims._after_sent.get(k)
    if found is None:
        built = claims.statement(k, ALL_STREAMS, "postgresql", after_sent=True)
        found = claims._after_sent.setdefault(k, built)
    return found


def loader_for(model: RecordModel) -> ClaimLoader:
    """Builds a claimed record from the claim's columns (mapper order)."""
    return _CLAIMS[model].loader


# --- at most pool size - 1 workers per server or provider ----------------------------------------


def slow_cap(workers: int, share: float) -> int:
    """How many of a pool's ``workers`` may be in flight to a server or provider whose sends
    time out (``SLOW_SERVER_MAX_SHARE``): ``share`` of them, rounded down, at least one and
    never all."""
    return max(1, min(math.floor(share * workers), workers - 1))


class RouteGate:
    """How many of a pool's workers are in flight per server or provider (a route): at most
    ``limit`` each (the pool's size - 1), so a hanging server cannot hold the whole pool; and
    at most ``slow_cap`` of them for a route whose last send timed out (``slow``), since a
    send that times out holds its worker for the whole timeout, whether or not the breaker
    counts it (a timeout after DATA does not: the mail may have been taken).

    Places are handed out first come, first served: a worker that left a route and comes
    straight back for its next record queues behind those already waiting. Without the
    queue it could take the place again before a waiter woke (it holds the GIL, the waiter
    must get it back first), and keep it record after record until the waiter gave up as
    SERVER_BUSY although the server was answering in milliseconds: the fault test of a
    server gone for a while saw that once the suppression lookup rode on the claim and
    nothing between two of one worker's records waited on the database any more. A slow
    route's places free only when a send times out, so nobody waits for one."""

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self.workers = self.limit + 1  # the pool's size: limit is all but one of them
        self._held: dict[Any, int] = {}
        self._waiting: dict[Any, deque[object]] = {}
        self._slow: set[Any] = set()
        self._lock = threading.Condition()

    def _limit(self, route: Any, slow_share: float) -> int:
        if route in self._slow:
            return min(self.limit, slow_cap(self.workers, slow_share))
        return self.limit

    def try_enter(self, route: Any, wait_s: float = 0.0, slow_share: float = 1.0) -> bool:
        """Take a place on ``route``, waiting up to ``wait_s`` (in turn) for one to free: a
        healthy server's sends free theirs in milliseconds, a hanging one's do not. A slow
        route (``slow``) takes ``slow_share`` of the pool's workers and no waiting."""
        with self._lock:
            queue = self._waiting.get(route)
            limit = self._limit(route, slow_share)
            if not queue and self._held.get(route, 0) < limit:
                self._held[route] = self._held.get(route, 0) + 1
                return True
            if route in self._slow:
                return False
            ticket = object()
            queue = self._waiting.setdefault(route, deque())
            queue.append(ticket)
            try:
                got = self._lock.wait_for(
                    lambda: (
                        queue[0] is ticket
                        and self._held.get(route, 0) < self._limit(route, slow_share)
                    ),
                    wait_s,
                )
            finally:
                queue.remove(ticket)
                if not queue:
                    self._waiting.pop(route, None)
                self._lock.notify_all()  # the next in the queue may go now
            if got:
                self._held[route] = self._held.get(route, 0) + 1
            return bool(got)

    def leave(self, route: Any) -> None:
        with self._lock:
            held = self._held.get(route, 0) - 1
            if held > 0:
                self._held[route] = held
            else:
                self._held.pop(route, None)
            self._lock.notify_all()

    def held(self, route: Any) -> int:
        return self._held.get(route, 0)

    def slow(self, route: Any) -> bool:
        return route in self._slow

    def settled(self, route: Any, *, timed_out: bool) -> None:
        """A send on ``route`` ended: ``timed_out`` makes the route slow; a send the server
        answered (``timed_out`` False) gives it its full share again."""
        with self._lock:
            if timed_out:
                self._slow.add(route)
            elif route in self._slow:
                self._slow.discard(route)
                self._lock.notify_all()


_route = threading.local()


@contextmanager
def gating_routes(gate: RouteGate) -> Iterator[None]:
    """Within the block (one attempt of a pool worker), ``enter_route`` counts against
    ``gate``; every route entered is left when the block ends."""
    _route.gate, _route.entered = gate, []
    try:
        yield
    finally:
        for route in _route.entered:
            gate.leave(route)
        _route.gate, _route.entered = None, []


def enter_route(route: Any, wait_s: float = 0.0, slow_share: float = 1.0) -> bool:
    """Called once the attempt's server or provider is chosen (``route``: e.g. ``("mail",
    config id)``), before anything is charged: False when ``pool size - 1`` workers of this
    pool are still in flight to it after ``wait_s``, or, when its last send timed out,
    ``slow_cap(pool size, slow_share)`` are (defer the record without using a retry).
    Outside a pool (tests, the drain helper) always True."""
    gate: RouteGate | None = getattr(_route, "gate", None)
    if gate is None:
        return True
    if route in _route.entered:
        return True
    if not gate.try_enter(route, wait_s, slow_share):
        return False
    _route.entered.append(route)
    return True


def route_is_slow(route: Any) -> bool:
    """Whether this pool holds ``route`` to its slow share (its last send timed out)."""
    gate: RouteGate | None = getattr(_route, "gate", None)
    return gate is not None and gate.slow(route)


def route_settled(route: Any, *, timed_out: bool) -> None:
    """After a send on ``route`` in this attempt: a timeout holds the route to the slow share
    of the pool's workers; an answer from the server lifts it. Outside a pool, nothing."""
    gate: RouteGate | None = getattr(_route, "gate", None)
    if gate is not None:
        gate.settled(route, timed_out=timed_out)
