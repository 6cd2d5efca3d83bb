"""What happened to an attempt, written by version: Sent, Retry, Failed or DeadLetter.

Every write here is ``WHERE id = ? AND version = ?`` in its own short transaction. A write
that matches no row lost a race (the sweep or an operator moved the record on): it did not
happen, and it records no metric and no log line.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, assert_never

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
    insert,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from portal.messaging.after_send import events, suppression
from portal.messaging.records import timeline
from portal.messaging.sending import claim, group_commit
from portal.messaging.sending.backoff import BackoffPolicy, DeadLetter, Fail, Retry, RetryDecision
from portal.messaging.sending.classify import ErrorCategory, MarkerCode, classify, is_retryable
from portal.metrics import MESSAGE_FAILED, MESSAGE_SENT, SENT_BATCH_SIZE
from portal.models import (
    AttemptOutcome,
    Channel,
    DeadLetterMessage,
    DeadLetterSource,
    DeliveryEvent,
    MailSendRecord,
    RecordEventKind,
    SendAttempt,
    SendStatus,
    SmsSendRecord,
    db_now,
    db_now_plus,
)
from portal.models.base import UTCDateTime
from portal.models.direct import Direct

log = logging.getLogger("portal.delivery")

MODELS: dict[Channel, type[MailSendRecord] | type[SmsSendRecord]] = {
    Channel.MAIL: MailSendRecord,
    Channel.SMS: SmsSendRecord,
}
MAX_ERROR_CHARS = 2000


def stored_text(value: str | None, limit: int) -> str:
    """Text from the other side (a server's reply, a provider's message) as a record keeps
    it: at most ``limit`` characters, a NUL shown as U+FFFD (PostgreSQL's text refuses NUL,
    and a Sent write that fails on one would leave its record to be swept and sent again)."""
    return (value or "")[:limit].replace("\x00", "\ufffd")


MARKER_CODES = {m.value for m in MarkerCode}


@dataclass(frozen=True)
class Claimed:
    """A record this worker holds: enough to write its outcome by version."""

    channel: Channel
    id: int
    version: int
    tenant_id: int
    retry_count: int
    provider: str = "unprepared"  # metric label: the server or provider name
    # The record's error code when claimed: a deferral with the same code goes on the stretch
    # of deferrals its timeline already shows, and writes no event.
    last_code: str | None = None

    def bumped(self, **changes: Any) -> Claimed:
        """The same claim after a write of ours that incremented the version."""
        return replace(self, version=self.version + 1, **changes)


_worker: tuple[int, str] | None = None


def worker_name() -> str:
    """This worker process, as attempts name it: host:pid (the pid of the process now, not
    of the one it was forked from)."""
    global _worker
    pid = os.getpid()
    if _worker is None or _worker[0] != pid:
        _worker = (pid, f"{socket.gethostname()}:{pid}")
    return _worker[1]


@dataclass(frozen=True)
class Attempt:
    """An attempt that reached the transport: written as a ``send_attempt``
    row by the statement that writes its outcome, numbered by the record's ``attempt_count``.
    ``code``/``message``: the other side's reply (SMTP code; HTTP status and the provider's
    code); none for a send it accepted."""

    started_at: datetime  # when the request went out (UTC)
    duration_s: float | None  # None: not known (a swept attempt's worker never said)
    config_id: int | None
    config_name: str | None
    code: str | None = None
    message: str | None = None
    # The worker process that made it (host:pid); None when not known (the stuck-send sweep
    # writes the attempt of a worker that stopped).
    worker: str | None = field(default_factory=lambda: worker_name())
    # What it said about the server itself (``classify.unavailable``; ``health``): True could
    # not reach it, False it answered, None nothing either way.
    unavailable: bool | None = None
    # Mail: each recipient the server refused, with its own reply ((code, text), coded as
    # ``code``); the suppression list reads which of them are gone for good.
    refused: dict[str, tuple[str, str]] = field(default_factory=dict)

    def params(self, ambiguous: bool = False) -> dict[str, Any]:
        return {
            "a_started": self.started_at,
            "a_ms": None if self.duration_s is None else round(self.duration_s * 1000),
            "a_worker": self.worker,
            "a_config": self.config_id,
            "a_config_name": stored_text(self.config_name, 200) or None,
            "a_ambiguous": ambiguous,
            "a_code": stored_text(self.code, 100) or None,
            "a_message": stored_text(self.message, MAX_ERROR_CHARS) or None,
            "a_unavailable": self.unavailable,
        }


# An attempt row's values that come from the worker (``Attempt.params``), with their types.
_ATTEMPT_FIELDS: dict[str, Any] = {
    "a_started": UTCDateTime,
    "a_ms": Integer,
    "a_worker": String,
    "a_config": BigInteger,
    "a_config_name": String,
    "a_ambiguous": Boolean,
    "a_code": String,
    "a_message": Text,
    "a_unavailable": Boolean,
}


def _attempt_insert(
    channel: Channel, written: Any, outcome: AttemptOutcome, per_row: bool = False
) -> Any:
    """INSERT of the attempt row from ``written``, the outcome write's result (a CTE with the
    record's ``id``, ``tenant_id`` and bumped ``attempt_count``): a row only when the write
    matched (PostgreSQL; in the same statement). The worker's values are bound parameters,
    or with ``per_row`` columns of ``written`` (a batch: only rows whose ``a_started`` is
    set made an attempt)."""
    given = [
        written.c[name] if per_row else bindparam(name, type_=kind)
        for name, kind in _ATTEMPT_FIELDS.items()
    ]
    values = select(
        written.c.tenant_id,
        claim._sql(channel.value),
        written.c.id,
        written.c.attempt_count,
        *given[:5],
        claim._sql(outcome.value),
        *given[5:],
        written.c.provider_message_id,
    )
    if per_row:
        values = values.where(written.c.a_started.is_not(None))
    columns = [
        "tenant_id",
        "channel",
        "record_id",
        "number",
        "started_at",
        "duration_ms",
        "worker",
        "config_id",
        "config_name",
        "outcome",
        "ambiguous",
        "code",
        "message",
        "unavailable",
        "provider_message_id",
    ]
    # The table, not the entity: an ORM INSERT run with parameters is a bulk insert.
    table: Any = SendAttempt.__table__
    return insert(table).from_select(columns, values)


def _attempt_row(
    claimed: Claimed,
    number: int,
    attempt: Attempt,
    outcome: AttemptOutcome,
    *,
    ambiguous: bool = False,
    pmid: str | None = None,
) -> SendAttempt:
    """The attempt row as an ORM object (SQLite: written after the outcome in its transaction)."""
    values = attempt.params(ambiguous)
    return SendAttempt(
        tenant_id=claimed.tenant_id,
        channel=claimed.channel.value,
        record_id=claimed.id,
        number=number,
        started_at=values["a_started"],
        duration_ms=values["a_ms"],
        worker=values["a_worker"],
        config_id=values["a_config"],
        config_name=values["a_config_name"],
        outcome=outcome.value,
        ambiguous=values["a_ambiguous"],
        code=values["a_code"],
        message=values["a_message"],
        unavailable=values["a_unavailable"],
        provider_message_id=pmid,
    )


def _extra(claimed: Claimed, **more: Any) -> dict[str, Any]:
    return {"record_id": claimed.id, "channel": claimed.channel.value} | more


def _sent_values(model: type[MailSendRecord] | type[SmsSendRecord], pmid: Any) -> dict[str, Any]:
    """What a Sent write sets, the provider's message id from ``pmid``."""
    return {
        "status": SendStatus.SENT.value,
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
    model = MODELS[channel]
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
    route = model.server_config_id if channel is Channel.MAIL else model.provider_config_id  # type: ignore[union-attr]
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


def _sent_and_claim_statement(channel: Channel, with_refused: bool, with_attempt: bool) -> Direct:
    """PostgreSQL: Sent as above and the claim of the worker's next record, in one statement
    (data-modifying CTEs; the two touch different rows: this one is Sending, the claim takes
    Pending or Retry), with the attempt's row (``with_attempt``). One row: (written,
    waiting, the claimed record's columns or NULLs).

    The order is by construction, not by the planner's choice: every scan of the claim that
    locks rows starts from the tenants' turn, which reads the ``sent`` CTE's ``tenant_id``,
    so the Sent write has run (and waited for any lock it needed) before the claim locks
    anything; the claim itself never waits (SKIP LOCKED)."""
    sent = _sent_update(
        channel, with_refused, meet_events=True, with_tenant=True, with_attempt=with_attempt
    ).cte(claim.SENT_CTE)
    claimed = claim.claim_statement(MODELS[channel]).cte("claimed")
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
    model = MODELS[channel]
    route = model.server_config_id if channel is Channel.MAIL else model.provider_config_id  # type: ignore[union-attr]
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
    model = MODELS[channel]
    rows = (
        func.json_to_recordset(cast(bindparam("batch", type_=Text), JSON))
        .table_valued(*(column(name, kind) for name, kind in _BATCH_FIELDS.items()))
        .render_derived(name="v", with_types=True)
    )
    route = model.server_config_id if channel is Channel.MAIL else model.provider_config_id  # type: ignore[union-attr]
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
        statement = _sent_batch(first.claimed.channel, len(wanting))
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
    loader = claim.loader_for(MODELS[first.claimed.channel])
    claimed = [row[3:] for row in rows if row[3 + loader.pk_index] is not None]
    for entry, record in zip(wanting, claimed + [None] * len(wanting), strict=False):
        assert entry.request is not None
        entry.request.ran = True
        entry.request.records = [loader.load(record)] if record is not None else []


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
        request = claim.next_claim_for(MODELS[claimed.channel])
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
        statement = _SENT_AND_CLAIM[(claimed.channel, with_refused, with_attempt)]
        _n, rows = statement.run(engine, **params)
    except psycopg.errors.DeadlockDetected:
        # Not expected (see _sent_and_claim_statement), and never an error if it happens:
        # the statement was rolled back whole, so it is a lost race for the claim; the Sent
        # write runs again on its own.
        log.warning(
            "the Sent write with the next claim deadlocked; written alone", extra=_extra(claimed)
        )
        return _SENT[(claimed.channel, with_refused, True, with_attempt)].run(engine, **params)
    written, waiting, *record = rows[0]
    request.ran = True
    loader = claim.loader_for(request.model)
    if record[loader.pk_index] is not None:  # NULLs: nothing was due
        request.records = [loader.load(record)]
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


def finish(
    engine: Engine,
    claimed: Claimed,
    status: SendStatus,
    code: str,
    message: str,
    **more: Any,
) -> bool:
    """End the attempt without a send (expired, suppressed, past the retry window), by
    version; ``ambiguous_attempt`` is never cleared. False when the race was lost."""
    model = MODELS[claimed.channel]
    with Session(engine) as session, session.begin():
        result = session.execute(
            update(model)
            .where(model.id == claimed.id, model.version == claimed.version)
            .values(
                status=status.value,
                version=model.version + 1,
                updated_time=db_now(),
                next_retry_at=None,
                error_code=stored_text(code, 100),
                error_message=stored_text(message, MAX_ERROR_CHARS),
                **more,
            )
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:  # type: ignore[attr-defined]
            return False
        _note(session, claimed, RecordEventKind.ENDED, code, message)
    outcome = "failed" if status is SendStatus.FAILED else status.value.lower()
    MESSAGE_FAILED.labels(claimed.channel.value, claimed.provider, outcome).inc()
    # Failed (EXPIRED, RETRY_WINDOW_EXPIRED) and Uncertain are failures like any other: ERROR.
    # Suppressed is the list doing its job.
    level = logging.WARNING if status is SendStatus.SUPPRESSED else logging.ERROR
    log.log(level, "not sent (%s): %s", code, message, extra=_extra(claimed, error_code=code))
    return True


def defer(
    engine: Engine,
    claimed: Claimed,
    code: str,
    message: str,
    delay_s: float,
    *,
    waiting_on: int | None = None,
    until: datetime | None = None,
) -> bool:
    """Put the record back to Retry in ``delay_s`` without using a retry and without an attempt
    (its server is busy, or its breaker is open): ``retry_count`` stays, no failure is counted.
    ``waiting_on``: the server or provider whose breaker it waits for, which makes it due
    (``breaker.release``); it is then due by itself only ``until`` (its deadline). By version;
    False when the race was lost."""
    model = MODELS[claimed.channel]
    with Session(engine) as session, session.begin():
        result = session.execute(
            update(model)
            .where(model.id == claimed.id, model.version == claimed.version)
            .values(
                status=SendStatus.RETRY.value,
                version=model.version + 1,
                updated_time=db_now(),
                next_retry_at=db_now_plus(delay_s) if until is None else until,
                waiting_config_id=waiting_on,
                error_code=stored_text(code, 100),
                error_message=stored_text(message, MAX_ERROR_CHARS),
                deferral_count=model.deferral_count + 1,
            )
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:  # type: ignore[attr-defined]
            return False
        _note_deferral(session, claimed, code, message)
    log.info(
        "send deferred, no retry used: %s",
        message,
        extra=_extra(claimed, error_code=code, retry_count=claimed.retry_count),
    )
    return True


def handle_failure(
    engine: Engine,
    claimed: Claimed,
    code: str | None,
    message: str | None,
    *,
    policy: BackoffPolicy,
    retry_after_s: float | None = None,
    ambiguous: bool = False,
    consume_retry: bool = True,
    hold: bool = False,
    attempt: Attempt | None = None,
) -> RetryDecision | None:
    """Classify a failure and carry out the decision by version; None when the race was lost.

    ``consume_retry=False`` is a local deferral, not a failed send (a full rate-limit window,
    the rate-limit store unreachable): the record goes to Retry no sooner than
    ``retry_after_s`` with ``retry_count`` unchanged, so waiting for a window never uses up
    the record's retries nor turns it into a dead letter.

    ``ambiguous`` (the request was written, no answer came) marks the attempt ambiguous; it is
    never cleared by a later write. With ``hold`` (the config's uncertain policy), an ambiguous
    failure ends Uncertain instead of being retried: it is never resent automatically.

    ``attempt``: the failure is the transport's answer (or its silence): the attempt's row is
    written by the same statement (PostgreSQL) or transaction (SQLite).
    """
    category = classify(code, message)
    if consume_retry:
        decision = policy.decide(category, claimed.retry_count, retry_after_s=retry_after_s)
    else:
        decision = deferral(policy, category, retry_after_s)
    model = MODELS[claimed.channel]
    message = stored_text(message, MAX_ERROR_CHARS)
    values: dict[str, Any] = {
        "version": model.version + 1,
        "updated_time": db_now(),
        "error_code": stored_text(code or "UNKNOWN", 100),
        "error_message": message,
    }
    if ambiguous:
        values |= {"ambiguous_attempt": True, "ambiguous_at": db_now(), "ambiguous_reason": message}
        if hold:
            values |= {"status": SendStatus.UNCERTAIN.value, "next_retry_at": None}
            with Session(engine) as session, session.begin():
                held = write_outcome(
                    session, claimed, values, attempt, AttemptOutcome.UNCERTAIN, ambiguous
                )
                if held and attempt is None:
                    _note(session, claimed, RecordEventKind.NOT_ATTEMPTED, code, message)
            if not held:
                return None
            MESSAGE_FAILED.labels(claimed.channel.value, claimed.provider, "uncertain").inc()
            log.error(
                "send outcome unknown; held as Uncertain: %s",
                message,
                extra=_extra(claimed, error_code=code),
            )
            return Fail()
    match decision:
        case Retry(delay_s=delay):
            values |= {
                "status": SendStatus.RETRY.value,
                "next_retry_at": db_now_plus(delay),
            }
            if consume_retry:
                values["retry_count"] = model.retry_count + 1
            else:  # a deferral (a full rate-limit window): counted, no attempt row
                values["deferral_count"] = model.deferral_count + 1
            outcome = "retry"
        case Fail():
            values |= {"status": SendStatus.FAILED.value, "next_retry_at": None}
            outcome = "failed"
        case DeadLetter():
            values |= {"status": SendStatus.DEAD_LETTER.value, "next_retry_at": None}
            outcome = "dead_letter"
        case _:
            assert_never(decision)
    with Session(engine) as session, session.begin():
        written = write_outcome(
            session, claimed, values, attempt, AttemptOutcome(outcome), ambiguous
        )
        if not written:
            return None
        if isinstance(decision, DeadLetter):
            session.add(dead_letter_row(claimed, values["error_code"], message))
        if attempt is None and not consume_retry:
            _note_deferral(session, claimed, values["error_code"], message)
        elif attempt is None:
            _note(session, claimed, RecordEventKind.NOT_ATTEMPTED, values["error_code"], message)
        else:
            # An answer refusing the recipient for good puts it on the tenant's suppression
            # list, as a hard bounce does (a check of the code; a write only then).
            suppression.suppress_refused(
                session,
                claimed.channel,
                claimed.id,
                claimed.tenant_id,
                code,
                message,
                refused=attempt.refused,
            )
    MESSAGE_FAILED.labels(claimed.channel.value, claimed.provider, outcome).inc()
    extra = _extra(
        claimed,
        error_code=code,
        error_category=category.value,
        outcome=outcome,
        retry_count=claimed.retry_count + (1 if outcome == "retry" and consume_retry else 0),
    )
    if outcome == "retry" and not consume_retry:
        log.warning("send deferred; will retry: %s", message, extra=extra)
    elif outcome == "retry":
        log.warning("send failed; will retry: %s", message, extra=extra)
    else:
        log.error("send failed (%s): %s", outcome, message, extra=extra)
    return decision


def _note(
    session: Session, claimed: Claimed, kind: RecordEventKind, code: str | None, message: str
) -> None:
    """The record's event for a change written without an attempt row, in its transaction."""
    timeline.note(
        session, claimed.channel, claimed.id, claimed.tenant_id, kind, code=code, message=message
    )


def _note_deferral(session: Session, claimed: Claimed, code: str, message: str) -> None:
    """A deferral's event: only the first of a stretch (the record was not already waiting
    with this code when claimed), so a record deferred at every poll writes one row."""
    if claimed.last_code != stored_text(code, 100):
        _note(session, claimed, RecordEventKind.DEFERRED, code, message)


def write_outcome(
    session: Session,
    claimed: Claimed,
    values: dict[str, Any],
    attempt: Attempt | None,
    outcome: AttemptOutcome,
    ambiguous: bool,
    *conditions: Any,
) -> bool:
    """A failure's write, by version (and ``conditions``), in the caller's transaction, with
    the attempt's row when there is one (PostgreSQL: one statement); False when the race was
    lost."""
    model = MODELS[claimed.channel]
    statement = update(model).where(
        model.id == claimed.id, model.version == claimed.version, *conditions
    )
    if attempt is None:
        result = session.execute(
            statement.values(**values).execution_options(synchronize_session=False)
        )
        return bool(result.rowcount == 1)  # type: ignore[attr-defined]
    statement = statement.values(**values, attempt_count=model.attempt_count + 1)
    params = attempt.params(ambiguous)
    if session.get_bind().dialect.name == "postgresql":
        written = statement.returning(
            model.id, model.tenant_id, model.attempt_count, model.provider_message_id
        ).cte("written")
        row = _attempt_insert(claimed.channel, written, outcome).add_cte(written)
        return (
            session.execute(row.returning(SendAttempt.__table__.c.id), params).first() is not None
        )
    number = session.execute(
        statement.returning(model.attempt_count).execution_options(synchronize_session=False)
    ).scalar()
    if number is None:
        return False
    session.add(_attempt_row(claimed, number, attempt, outcome, ambiguous=ambiguous))
    return True


def deferral(policy: BackoffPolicy, category: ErrorCategory, wait_s: float | None) -> RetryDecision:
    """A Retry that uses no retry: the policy's first delay (the QUOTA floor for a full window),
    and no sooner than ``wait_s``.

    ``wait_s`` is our own window's reset, not a provider's Retry-After, so the cap on those does
    not apply: a daily window that resets in 9 hours is retried in 9 hours, not in one.
    """
    if not is_retryable(category):
        return Fail()
    first = replace(policy, max_retries=max(policy.max_retries, 1)).decide(category, 0)
    assert isinstance(first, Retry)  # retryable, with a retry left: always a Retry
    return Retry(delay_s=max(first.delay_s, wait_s or 0.0))


def dead_letter_row(claimed: Claimed, code: str | None, reason: str | None) -> DeadLetterMessage:
    """The archive row for a record whose retries are used up."""
    return DeadLetterMessage(
        tenant_id=claimed.tenant_id,
        source=DeadLetterSource.SEND_EXHAUSTED.value,
        event_id=str(claimed.id),
        channel=claimed.channel.value,
        provider=claimed.provider,
        error_code=code,
        reason=reason,
        attempts=claimed.retry_count + 1,
        payload={
            "recordId": claimed.id,
            "channel": claimed.channel.value,
            "provider": claimed.provider,
            "errorCode": code,
            "reason": reason,
            "attempts": claimed.retry_count + 1,
        },
    )


def is_marker(code: str | None) -> bool:
    return code in MARKER_CODES


__all__ = [
    "Claimed",
    "ErrorCategory",
    "defer",
    "finish",
    "handle_failure",
    "is_marker",
    "record_sent",
]
