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

import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Engine,
    and_,
    case,
    func,
    literal_column,
    or_,
    select,
    union_all,
    update,
)
from sqlalchemy.orm import Session

from portal.models import MailSendRecord, SendStatus, SmsSendRecord, db_now
from portal.models.direct import Direct, Loader

RecordModel = type[MailSendRecord] | type[SmsSendRecord]


@dataclass(frozen=True, order=True)
class Candidate:
    due_at: datetime
    id: int


def scan_due(session: Session, model: RecordModel, n: int) -> list[Candidate]:
    """Up to ``n`` due records, longest due first (two index walks, merged)."""
    pending = (
        select(model.updated_time, model.id)
        .where(model.status == SendStatus.PENDING.value)
        .order_by(model.updated_time)
        .limit(n)
    )
    retry = (
        select(model.next_retry_at, model.id)
        .where(model.status == SendStatus.RETRY.value, model.next_retry_at <= db_now())
        .order_by(model.next_retry_at)
        .limit(n)
    )
    rows = [Candidate(due, rid) for due, rid in session.execute(pending)]
    rows += [Candidate(due, rid) for due, rid in session.execute(retry) if due is not None]
    rows.sort()
    return rows[:n]


def _due_condition(model: RecordModel) -> object:
    return or_(
        model.status == SendStatus.PENDING.value,
        and_(model.status == SendStatus.RETRY.value, model.next_retry_at <= db_now()),
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
            status=SendStatus.SENDING.value,
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


class _DueClaim:
    """The one-statement claim of up to ``k`` due records of one table, built once per ``k``.

    It has no parameters: its statuses and ``k`` are written into the SQL, so PostgreSQL
    plans it once. With ``status = $1`` it planned the claim anew at every run on a large
    table (its generic plan looked dearer than the plans for the values), a quarter of the
    claim's time (bench/claim.py)."""

    def __init__(self, model: RecordModel):
        self.model = model
        self.loader = Loader(model)
        self._by_k: dict[int, Direct] = {}

    def direct(self, k: int) -> Direct:
        found = self._by_k.get(k)
        if found is None:
            found = self._by_k.setdefault(k, Direct(self.statement(k), self.loader.columns))
        return found

    def statement(self, k: int) -> Any:
        """The claim as an UPDATE returning the record's columns in mapper order."""
        model = self.model
        pending = (
            select(model.id.label("id"), model.updated_time.label("due"))
            .where(model.status == _sql(SendStatus.PENDING.value))
            .order_by(model.updated_time)
            .limit(_sql(k))
            .with_for_update(skip_locked=True)
            .cte("pending")
        )
        retry = (
            select(model.id.label("id"), model.next_retry_at.label("due"))
            .where(model.status == _sql(SendStatus.RETRY.value), model.next_retry_at <= db_now())
            .order_by(model.next_retry_at)
            .limit(_sql(k))
            .with_for_update(skip_locked=True)
            .cte("retry")
        )
        due = union_all(select(pending.c.id, pending.c.due), select(retry.c.id, retry.c.due))
        merged = due.subquery("due")
        pick = select(merged.c.id).order_by(merged.c.due).limit(_sql(k)).cte("pick")
        return (
            update(model)
            .where(model.id == pick.c.id)
            .values(
                status=_sql(SendStatus.SENDING.value),
                version=model.version + _sql(1),
                updated_time=db_now(),
                first_claimed_at=func.coalesce(model.first_claimed_at, db_now()),
            )
            .returning(*self.loader.columns)
        )

    def __call__(self, engine: Engine, k: int) -> list[MailSendRecord | SmsSendRecord]:
        _count, rows = self.direct(k).run(engine)
        return [self.loader.load(row) for row in rows]


_CLAIMS = {model: _DueClaim(model) for model in (MailSendRecord, SmsSendRecord)}


def claim_due(engine: Engine, model: RecordModel, k: int) -> list[MailSendRecord | SmsSendRecord]:
    """Claim up to ``k`` due records, longest due first, in one statement of its own; returns
    them detached, as claimed (status Sending, version bumped)."""
    if k <= 0:
        return []
    return _CLAIMS[model](engine, k)


# --- the next claim, in the Sent write's statement ---------------------------------------------


@dataclass
class NextClaim:
    """A pool worker's request, while it works on a record, to claim its next one inside the
    statement that writes this one Sent (PostgreSQL; ``outcomes.record_sent``): one round
    trip and one commit fewer per record. ``wanted`` is asked just before (the worker may be
    stopping); ``ran`` says the claim was made (``records`` may then be empty: nothing due)."""

    model: RecordModel
    wanted: Callable[[], bool]
    ran: bool = False
    records: list[MailSendRecord | SmsSendRecord] = field(default_factory=list)


_next = threading.local()


@contextmanager
def claiming_next(model: RecordModel, wanted: Callable[[], bool]) -> Iterator[NextClaim]:
    """Within the block, a Sent write of a ``model`` record in this thread also claims the
    next due one (at most once), when ``wanted()`` still holds."""
    request = NextClaim(model, wanted)
    _next.request = request
    try:
        yield request
    finally:
        _next.request = None


def next_claim_for(model: RecordModel) -> NextClaim | None:
    """This thread's open request for ``model``, if it wants a claim now (taken: once only)."""
    request: NextClaim | None = getattr(_next, "request", None)
    if request is None or request.model is not model or request.ran or not request.wanted():
        return None
    return request


def claim_statement(model: RecordModel) -> Any:
    """The single-record claim (an UPDATE returning the record's columns in ``loader_for``'s
    order), to be used as a CTE of another statement."""
    return _CLAIMS[model].statement(1)


def loader_for(model: RecordModel) -> Loader:
    """Builds a claimed record from the claim's columns (mapper order)."""
    return _CLAIMS[model].loader
