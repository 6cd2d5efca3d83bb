"""Sent, written by version in one statement: alone, with the worker's next claim
(PostgreSQL, ``claim.claiming_next``), or with other workers' Sent writes through the group
commit (``group_commit``); each with its attempt's row, and the look for delivery events that
waited for the provider's message id.

A write that matches no row lost a race (the sweep or an operator moved the record on): it
did not happen, and it records no metric and no log line. A failure to write it is not a
send failure: the stuck-send sweep takes the record.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import weakref
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Engine,
    Integer,
    String,
    Text,
    bindparam,
    case,
    cast,
    column,
    exists,
    func,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from portal.messaging import transitions
from portal.messaging.after_send import events
from portal.messaging.sending import claim, group_commit
from portal.messaging.sending.outcomes import (
    _ATTEMPT_FIELDS,
    MAX_ERROR_CHARS,
    Attempt,
    Claimed,
    _attempt_insert,
    _attempt_row,
    _extra,
    stored_text,
)
from portal.messaging.transitions import Cause
from portal.metrics import MESSAGE_SENT, SENT_BATCH_SIZE
from portal.models import (
    AttemptOutcome,
    Channel,
    DeliveryEvent,
    MailSendRecord,
    SendStatus,
    SmsSendRecord,
    db_now,
)
from portal.models.by_channel import PARTS
from portal.models.direct import Direct

log = logging.getLogger("portal.delivery")

_TO_SENT = transitions.change(Cause.SENT, SendStatus.SENT)  # by version: no guard on status


def _sent_values(model: type[MailSendRecord] | type[SmsSendRecord], pmid: Any) -> dict[str, Any]:
    """What a Sent write sets, the provider's message id from ``pmid``."""
    return {
        **_TO_SENT.values,
        "version": model.version + 1,
        "sent_at": db_now(),
        "updated_time": db_now(),
        "next_retry_at": None,
        "provider_message_id": pmid,
        "error_code": None,
        "error_message": None,
    }


def _sent_update(
    channel: Channel,
    with_refused: bool,
    meet_events: bool,
    with_tenant: bool = False,
    with_attempt: bool = False,
) -> Any:
    """Sent, by version, as an UPDATE; with ``meet_events`` (PostgreSQL), it also returns
    whether delivery events for the record's route and provider id wait unmatched (and with
    ``with_tenant`` the record's tenant, where the next claim's turn goes on from). With
    ``with_attempt`` it counts the attempt and returns what its row needs."""
    model = PARTS[channel].record
    values = _sent_values(model, bindparam("pmid", type_=model.provider_message_id.type))
    if with_refused:
        refused = MailSendRecord.refused_recipients
        values["refused_recipients"] = bindparam("refused", type_=refused.type)
    if with_attempt:
        values["attempt_count"] = model.attempt_count + 1
    statement = (
        update(model)
        .where(model.id == bindparam("rid"), model.version == bindparam("ver"))
        .values(**values)
    )
    if not meet_events:
        return statement.returning(model.attempt_count) if with_attempt else statement
    # PostgreSQL: the look for waiting events rides on the write, made exact by the event
    # lock (migration 0006), which the WHERE takes before the row lock.
    route = PARTS[channel].route
    pmid = bindparam("pmid", type_=model.provider_message_id.type)
    locked = func.postroom_event_lock(channel.value, route, pmid, type_=Boolean)
    waiting = func.postroom_waiting_events(
        channel.value, route, model.provider_message_id, type_=Boolean
    ).label("waiting")
    statement = statement.where(locked.is_(True))
    returned: list[Any] = [waiting]
    if with_tenant or with_attempt:
        returned.append(model.tenant_id)
    if with_attempt:
        returned += [model.id, model.attempt_count, model.provider_message_id]
    return statement.returning(*returned)


def _sent_statement(
    channel: Channel, with_refused: bool, meet_events: bool, with_attempt: bool
) -> Direct:
    statement = _sent_update(channel, with_refused, meet_events, with_attempt=with_attempt)
    if not meet_events or not with_attempt:
        return Direct(statement, list(statement.exported_columns))
    # The attempt's row in the same statement: a data-modifying CTE over the Sent write's.
    sent = statement.cte(claim.SENT_CTE)
    attempt = _attempt_insert(channel, sent, AttemptOutcome.SENT).cte("attempt")
    return Direct(select(sent.c.waiting).add_cte(attempt), [sent.c.waiting])


def _sent_and_claim_statement(
    channel: Channel, with_refused: bool, with_attempt: bool, k: int = 1
) -> Direct:
    """PostgreSQL: Sent as above and the claim of the worker's next ``k`` records, in one
    statement (data-modifying CTEs; the two touch different rows: this one is Sending, the
    claim takes Pending or Retry), with the attempt's row (``with_attempt``). One row per
    claimed record: (written, waiting, the claimed record's columns), or one with NULLs
    for the record's columns when none was due.

    The order is by construction, not by the planner's choice: every scan of the claim that
    locks rows starts from the tenants' turn, which reads the ``sent`` CTE's ``tenant_id``,
    so the Sent write has run (and waited for any lock it needed) before the claim locks
    anything; the claim itself never waits (SKIP LOCKED)."""
    sent = _sent_update(
        channel, with_refused, meet_events=True, with_tenant=True, with_attempt=with_attempt
    ).cte(claim.SENT_CTE)
    claimed = claim.claim_statement(PARTS[channel].record, k).cte("claimed")
    outcome = select(
        func.count().label("written"), func.bool_or(sent.c.waiting).label("waiting")
    ).subquery("outcome")
    record_columns = list(claimed.c)
    statement = select(outcome.c.written, outcome.c.waiting, *record_columns).select_from(
        outcome.outerjoin(claimed, true())
    )
    if with_attempt:
        attempt = _attempt_insert(channel, sent, AttemptOutcome.SENT).cte("attempt")
        statement = statement.add_cte(attempt)
    return Direct(statement, [outcome.c.written, outcome.c.waiting, *record_columns])


def _retained_statement(channel: Channel) -> Direct:
    """Whether delivery events for this record's route and provider id wait unmatched."""
    model = PARTS[channel].record
    route = PARTS[channel].route
    waiting = exists().where(
        model.id == bindparam("rid"),
        DeliveryEvent.channel == channel.value,
        DeliveryEvent.config_id == route,
        DeliveryEvent.provider_message_id == bindparam("pmid"),
        DeliveryEvent.record_id.is_(None),
    )
    column = waiting.label("waiting")
    return Direct(select(column), [column])


_SENT = {
    (channel, with_refused, meet_events, with_attempt): _sent_statement(
        channel, with_refused, meet_events, with_attempt
    )
    for channel in Channel
    for with_refused in ((False, True) if channel is Channel.MAIL else (False,))
    for meet_events in (False, True)
    for with_attempt in ((False, True) if meet_events else (False,))
}
_RETAINED = {channel: _retained_statement(channel) for channel in Channel}
_SENT_AND_CLAIM = {
    (channel, with_refused, with_attempt): _sent_and_claim_statement(
        channel, with_refused, with_attempt
    )
    for channel in Channel
    for with_refused in ((False, True) if channel is Channel.MAIL else (False,))
    for with_attempt in (False, True)
}


def _sent_and_claim(channel: Channel, with_refused: bool, with_attempt: bool, k: int) -> Direct:
    """``_sent_and_claim_statement``: one claim built at import, more at first use."""
    if k == 1:
        return _SENT_AND_CLAIM[(channel, with_refused, with_attempt)]
    return _sent_and_claim_more(channel, with_refused, with_attempt, k)


_sent_and_claim_more = functools.cache(_sent_and_claim_statement)


# --- group commit of Sent writes (PostgreSQL) ---------------------------------------------------

# At most this many Sent writes in one statement (a batch is at most 16 records).
SENT_BATCH_LIMIT = 16
# The channels whose Sent writes go through the group commit. Mail: bench/claim.py at 8
# threads 0.54 -> 0.61 of the bare loop (client CPU 941 -> 719 us a record), bench/smtp.py at
# 5 workers unchanged within its noise. SMS measured 6 % lower at 10 workers in one process
# (0.58 -> 0.54 and 0.62 -> 0.58 of the bare loop, two ABBA sittings): those workers are bound
# by the GIL, and the hand-offs between the writer and the waiting workers cost more than the
# statements saved, so SMS writes alone as before.
SENT_BATCH_CHANNELS = frozenset({Channel.MAIL})
# The fields of one write in a batch, as the statement reads them from its JSON parameter.
_BATCH_FIELDS: dict[str, Any] = {
    "rid": BigInteger,
    "ver": Integer,
    "pmid": String,
    "has_refused": Boolean,
    "refused": JSON,
} | _ATTEMPT_FIELDS


def _sent_batch_statement(channel: Channel, claims: int) -> Direct:
    """PostgreSQL: several records written Sent by version in one statement (the rows of the
    JSON parameter ``batch``, ``_BATCH_FIELDS``), each with its attempt's row when it made
    one, each looking for waiting delivery events under its event lock as the single write
    does, and the claim of ``claims`` next records (the workers that want one) after them:
    the claim's turn reads the Sent write's result, so nothing is locked before that write
    ran (as in ``_sent_and_claim_statement``). One row per claimed record (one row with
    NULLs when none): the ids written Sent, the versions they were written by and whether
    events wait for each, as arrays, then the claimed record's columns."""
    model = PARTS[channel].record
    rows = (
        func.json_to_recordset(cast(bindparam("batch", type_=Text), JSON))
        .table_valued(*(column(name, kind) for name, kind in _BATCH_FIELDS.items()))
        .render_derived(name="v", with_types=True)
    )
    route = PARTS[channel].route
    values = _sent_values(model, rows.c.pmid)
    values["attempt_count"] = model.attempt_count + case(
        (rows.c.a_started.is_not(None), 1), else_=0
    )
    if channel is Channel.MAIL:
        refused = MailSendRecord.refused_recipients
        values["refused_recipients"] = case((rows.c.has_refused, rows.c.refused), else_=refused)
    waiting = func.postroom_waiting_events(
        channel.value, route, model.provider_message_id, type_=Boolean
    ).label("waiting")
    sent = (
        update(model)
        .where(
            model.id == rows.c.rid,
            model.version == rows.c.ver,
            # The event lock before the row lock, row by row, as the single write takes it.
            func.postroom_event_lock(channel.value, route, rows.c.pmid, type_=Boolean).is_(True),
        )
        .values(**values)
        .returning(
            waiting,
            model.tenant_id,
            model.id,
            rows.c.ver,
            model.attempt_count,
            model.provider_message_id,
            *(rows.c[name] for name in _ATTEMPT_FIELDS),
        )
        .cte(claim.SENT_CTE)
    )
    attempt = _attempt_insert(channel, sent, AttemptOutcome.SENT, per_row=True).cte("attempt")
    ids = func.array_agg(sent.c.id, type_=postgresql.ARRAY(BigInteger)).label("written")
    # By id and version: two workers' writes of one record (one holding it after the sweep
    # moved it on) may share a batch, and only the current version's is written.
    versions = func.array_agg(sent.c.ver, type_=postgresql.ARRAY(Integer)).label("versions")
    looks = func.array_agg(sent.c.waiting, type_=postgresql.ARRAY(Boolean)).label("waiting")
    outcome = select(ids, versions, looks).subquery("outcome")
    written = [outcome.c.written, outcome.c.versions, outcome.c.waiting]
    if not claims:
        return Direct(select(*written).add_cte(attempt), written)
    claimed = claim.claim_statement(model, claims).cte("claimed")
    record_columns = list(claimed.c)
    statement = (
        select(*written, *record_columns)
        .select_from(outcome.outerjoin(claimed, true()))
        .add_cte(attempt)
    )
    return Direct(statement, [*written, *record_columns])


# Built once per channel and number of claims (at most SENT_BATCH_LIMIT + 1 of each).
_sent_batch = functools.cache(_sent_batch_statement)


class _SentWrite(group_commit.Entry):
    """One worker's Sent write waiting in the group commit, and what became of it."""

    __slots__ = ("claimed", "count", "engine", "error", "params", "request", "rows")

    def __init__(
        self,
        engine: Engine,
        claimed: Claimed,
        params: dict[str, Any],
        request: claim.NextClaim | None,
    ):
        super().__init__()
        self.engine = engine
        self.claimed = claimed
        self.params = params
        self.request = request
        self.count = 0  # 1: written Sent
        self.rows: list[Sequence[Any]] = []  # [(waiting,)] when written
        # Until the flush gives this write its outcome: a flush that ended before it did
        # leaves the record to the sweep (logged), never reads as a lost race.
        self.error: BaseException | None = _UNFINISHED

    def alone(self) -> None:
        """This write in a statement of its own (with the next claim when it wants one)."""
        try:
            # What record_sent put in the parameters says which statement it needs.
            with_refused, with_attempt = "refused" in self.params, "a_started" in self.params
            channel = self.claimed.channel
            if self.request is None:
                statement = _SENT[(channel, with_refused, True, with_attempt)]
                self.count, self.rows = statement.run(self.engine, **self.params)
            else:
                self.count, self.rows = _sent_and_claimed(
                    self.claimed, with_refused, with_attempt, self.params, self.request, self.engine
                )
            self.error = None
        except Exception as exc:
            self.error = exc

    def as_row(self) -> dict[str, Any]:
        params = self.params
        row = {
            "rid": params["rid"],
            "ver": params["ver"],
            "pmid": params["pmid"],
            "has_refused": "refused" in params,
            "refused": params.get("refused"),
        }
        for name in _ATTEMPT_FIELDS:
            value = params.get(name)
            row[name] = value.isoformat() if isinstance(value, datetime) else value
        return row


_UNFINISHED = RuntimeError("the batch of Sent writes it was in ended before writing it")


def _gone(exc: Exception) -> bool:
    """The connection failed (no SQLSTATE: the client's own error; 08: connection; 57P: the
    server shutting down): the batch may have committed unseen, and statements of their
    own would fail too."""
    state = getattr(exc, "sqlstate", None)
    return isinstance(exc, psycopg.OperationalError) and (
        state is None or state.startswith(("08", "57P"))
    )


def _flush_sent(batch: list[_SentWrite]) -> None:
    """Write a group commit's batch: one write alone as before; several in one statement
    (``_sent_batch_statement``). A deadlock is a lost race for the claims: each write runs
    again alone, without its claim. A lost connection is every write's error (each logged and
    left to the stuck-send sweep). Any other error (one row's bad value, a cancelled
    statement) fails the statement as a whole, so each write runs again alone, with its
    claim, and fails or not by itself: every write is by version, safe to repeat."""
    first = batch[0]
    SENT_BATCH_SIZE.labels(first.claimed.channel.value).observe(len(batch))
    if len(batch) == 1:
        first.alone()
        return
    wanting = [entry for entry in batch if entry.request is not None]
    try:
        claims = sum(entry.request.k for entry in wanting if entry.request is not None)
        statement = _sent_batch(first.claimed.channel, claims)
        _n, rows = statement.run(first.engine, batch=json.dumps([e.as_row() for e in batch]))
    except Exception as exc:
        if _gone(exc):
            for entry in batch:
                entry.error = exc
            return
        deadlock = isinstance(exc, psycopg.errors.DeadlockDetected)
        log.warning("a batch of Sent writes failed; written one by one", exc_info=exc)
        for entry in batch:
            if deadlock:
                entry.request = None  # a lost race for the claims: each claims on its own
            entry.alone()
        return
    ids, versions, looks = rows[0][0] or [], rows[0][1] or [], rows[0][2] or []
    waiting = dict(zip(zip(ids, versions, strict=True), looks, strict=True))
    for entry in batch:
        look = waiting.get((entry.claimed.id, entry.claimed.version))
        entry.count, entry.rows = (0, []) if look is None else (1, [(look,)])
        entry.error = None
    if not wanting:
        return
    loader = claim.loader_for(PARTS[first.claimed.channel].record)
    # In the fair order (the statement returns its rows in the order it met them), each
    # worker its k of them in turn, the first its first k.
    claimed = claim.in_turns(
        [loader.load(row[3:]) for row in rows if row[3 + loader.pk_index] is not None]
    )
    for entry in wanting:
        assert entry.request is not None
        entry.request.ran = True
        entry.request.records, claimed = claimed[: entry.request.k], claimed[entry.request.k :]


_committers: weakref.WeakKeyDictionary[Engine, dict[Channel, group_commit.GroupCommit[_SentWrite]]]
_committers = weakref.WeakKeyDictionary()
_committers_lock = threading.Lock()


def _committer(engine: Engine, channel: Channel) -> group_commit.GroupCommit[_SentWrite]:
    """The group commit of ``engine``'s Sent writes of one channel (one per process)."""
    by_channel = _committers.get(engine)
    if by_channel is None or channel not in by_channel:
        with _committers_lock:
            by_channel = _committers.setdefault(engine, {})
            if channel not in by_channel:
                by_channel[channel] = group_commit.GroupCommit(_flush_sent, SENT_BATCH_LIMIT)
    return by_channel[channel]


def record_sent(
    engine: Engine,
    claimed: Claimed,
    provider_message_id: str | None,
    *,
    refused: dict[str, Any] | None = None,
    duplicate: bool = False,
    attempt: Attempt | None = None,
    batch_wait_s: float = 1.0,
) -> bool:
    """Sent, by version, in one statement, with the attempt's row when ``attempt`` says one
    reached the transport. A failure to write it is not a send failure: it is logged at
    ERROR and left to the stuck-send sweep (at least once).

    ``batch_wait_s`` (SENT_BATCH_WAIT_S): how long a write waits in the group commit's queue
    behind a running statement before it goes alone.

    ``duplicate``: the provider refused the idempotency key as already used, so an earlier
    attempt was accepted (its id may be unknown); said in the log line.
    """
    # As the provider's delivery events keep it (a NUL or an over-long id from a provider
    # would fail the write, and the record would be swept and sent again).
    provider_message_id = events.clean_text(provider_message_id or "")
    with_refused = bool(refused) and claimed.channel is Channel.MAIL
    params: dict[str, Any] = {
        "rid": claimed.id,
        "ver": claimed.version,
        "pmid": provider_message_id,
    }
    if with_refused:
        assert refused is not None
        params["refused"] = {
            address: [stored_text(x, MAX_ERROR_CHARS) if isinstance(x, str) else x for x in why]
            for address, why in refused.items()
        }
    if attempt is not None:
        params |= attempt.params()
    meet_events = engine.dialect.name == "postgresql"
    error: BaseException | None = None
    if meet_events:
        # Written with the other workers' Sent writes that come meanwhile (group commit),
        # the next claim with it when this worker wants one.
        request = claim.next_claim_for(PARTS[claimed.channel].record)
        write = _SentWrite(engine, claimed, params, request)
        if claimed.channel in SENT_BATCH_CHANNELS:
            _committer(engine, claimed.channel).submit(write, batch_wait_s)
        else:
            write.alone()
        count, rows, error = write.count, write.rows, write.error
    else:
        try:
            if attempt is not None:
                count, rows = _sent_with_attempt_row(engine, claimed, attempt, with_refused, params)
            else:
                count, rows = _SENT[(claimed.channel, with_refused, False, False)].run(
                    engine, **params
                )
        except Exception as exc:
            error = exc
    if error is not None:
        log.error(
            "sent, but recording it failed; the stuck-send sweep will retry it",
            exc_info=error,
            extra=_extra(claimed),
        )
        return False
    if count != 1:
        return False
    MESSAGE_SENT.labels(claimed.channel.value, claimed.provider).inc()
    if provider_message_id and (not meet_events or rows[0][0]):
        _apply_retained(engine, claimed, provider_message_id, looked=meet_events)
    more: dict[str, Any] = {"provider_message_id": provider_message_id}
    if duplicate:
        more["duplicate_key"] = True  # accepted by an earlier attempt
    log.info("sent", extra=_extra(claimed, **more))
    return True


def _sent_with_attempt_row(
    engine: Engine,
    claimed: Claimed,
    attempt: Attempt,
    with_refused: bool,
    params: dict[str, Any],
) -> tuple[int, list[Sequence[Any]]]:
    """SQLite (no data-modifying CTEs): the Sent write, then the attempt's row, in one
    transaction; returns what the Sent statement alone would."""
    statement = _sent_update(claimed.channel, with_refused, False, with_attempt=True)
    with Session(engine) as session, session.begin():
        number = session.execute(statement, params).scalar()
        if number is None:
            return 0, []
        session.add(
            _attempt_row(claimed, number, attempt, AttemptOutcome.SENT, pmid=params["pmid"])
        )
    return 1, [(False,)]


def _sent_and_claimed(
    claimed: Claimed,
    with_refused: bool,
    with_attempt: bool,
    params: dict[str, Any],
    request: claim.NextClaim,
    engine: Engine,
) -> tuple[int, list[Sequence[Any]]]:
    """The Sent write with the worker's next claim (``claim.claiming_next``); hands the claimed
    record to the request and returns what the Sent statement alone would."""
    try:
        statement = _sent_and_claim(claimed.channel, with_refused, with_attempt, request.k)
        _n, rows = statement.run(engine, **params)
    except psycopg.errors.DeadlockDetected:
        # Not expected (see _sent_and_claim_statement), and never an error if it happens:
        # the statement was rolled back whole, so it is a lost race for the claim; the Sent
        # write runs again on its own.
        log.warning(
            "the Sent write with the next claim deadlocked; written alone", extra=_extra(claimed)
        )
        return _SENT[(claimed.channel, with_refused, True, with_attempt)].run(engine, **params)
    written, waiting = rows[0][:2]
    request.ran = True
    loader = claim.loader_for(request.model)
    # NULLs: nothing was due
    request.records = [loader.load(row[2:]) for row in rows if row[2 + loader.pk_index] is not None]
    return int(written), [(waiting,)] if written else []


def _apply_retained(
    engine: Engine, claimed: Claimed, provider_message_id: str, *, looked: bool
) -> None:
    """Events that arrived before the provider id was written apply now (seed 002).

    ``looked``: the Sent statement already found some (PostgreSQL: a look inside the write,
    made exact by the lock of migration 0006). Otherwise (SQLite) the look is one indexed
    SELECT after the Sent write committed: a webhook stores its event, commits, then looks
    for the record once more (``events.match_again``); one of the two looks always comes
    after the other's commit. The transaction that applies events opens only when there are
    some.
    """
    try:
        if not looked:
            _count, rows = _RETAINED[claimed.channel].run(
                engine, rid=claimed.id, pmid=provider_message_id
            )
            if not rows or not rows[0][0]:
                return
        with Session(engine) as session, session.begin():
            events.apply_retained(session, claimed.channel, claimed.id)
    except Exception:
        log.exception("applying retained delivery events failed", extra=_extra(claimed))


__all__ = ["SENT_BATCH_CHANNELS", "record_sent"]
