"""What happened to an attempt that did not end Sent, written by version: Retry, Failed,
DeadLetter, Uncertain or Suppressed; and what every outcome write shares (the claim it is
written by, the attempt's row). The Sent write is ``sent``.

Every write here is ``WHERE id = ? AND version = ?`` in its own short transaction. A write
that matches no row lost a race (the sweep or an operator moved the record on): it did not
happen, and it records no metric and no log line.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, assert_never

from sqlalchemy import (
    BigInteger,
    Boolean,
    Engine,
    Integer,
    String,
    Text,
    bindparam,
    insert,
    select,
    update,
)
from sqlalchemy.orm import Session

from portal.messaging import transitions
from portal.messaging.after_send import suppression
from portal.messaging.records import timeline
from portal.messaging.sending import claim
from portal.messaging.sending.backoff import BackoffPolicy, DeadLetter, Fail, Retry, RetryDecision
from portal.messaging.sending.classify import ErrorCategory, MarkerCode, classify, is_retryable
from portal.messaging.transitions import Cause
from portal.metrics import MESSAGE_FAILED
from portal.models import (
    AttemptOutcome,
    Channel,
    DeadLetterMessage,
    DeadLetterSource,
    RecordEventKind,
    SendAttempt,
    SendStatus,
    db_now,
    db_now_plus,
)
from portal.models.base import UTCDateTime
from portal.models.by_channel import PARTS

log = logging.getLogger("portal.delivery")

MAX_ERROR_CHARS = 2000

# The transitions written here, all from Sending and by version (no guard on the status).
_RETRIED = transitions.change(Cause.RETRIED, SendStatus.RETRY)
_DEFERRED = transitions.change(Cause.DEFERRED, SendStatus.RETRY)
_FAILED = transitions.change(Cause.FAILED, SendStatus.FAILED)
_DEAD_LETTERED = transitions.change(Cause.DEAD_LETTERED, SendStatus.DEAD_LETTER)
_HELD = transitions.change(Cause.HELD, SendStatus.UNCERTAIN)
# ``finish``'s, by the status it ends the record in.
_ENDS = {
    SendStatus.FAILED: transitions.change(Cause.EXPIRED, SendStatus.FAILED),
    SendStatus.UNCERTAIN: transitions.change(Cause.EXPIRED, SendStatus.UNCERTAIN),
    SendStatus.SUPPRESSED: transitions.change(Cause.SUPPRESSED, SendStatus.SUPPRESSED),
}


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


def finish(
    engine: Engine,
    claimed: Claimed,
    status: SendStatus,
    code: str,
    message: str,
    **more: Any,
) -> bool:
    """End the attempt without a send, by version: ``status`` Failed (expired, past the retry
    window), Uncertain (the same after an ambiguous attempt) or Suppressed (``_ENDS``);
    ``ambiguous_attempt`` is never cleared. False when the race was lost."""
    with Session(engine) as session, session.begin():
        if not _write_unattempted(
            session, claimed, _ENDS[status], code, message, next_retry_at=None, **more
        ):
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
    model = PARTS[claimed.channel].record
    with Session(engine) as session, session.begin():
        if not _write_unattempted(
            session,
            claimed,
            _DEFERRED,
            code,
            message,
            next_retry_at=db_now_plus(delay_s) if until is None else until,
            waiting_config_id=waiting_on,
            deferral_count=model.deferral_count + 1,
        ):
            return False
        _note_deferral(session, claimed, code, message)
    log.info(
        "send deferred, no retry used: %s",
        message,
        extra=_extra(claimed, error_code=code, retry_count=claimed.retry_count),
    )
    return True


def _write_unattempted(
    session: Session,
    claimed: Claimed,
    change: transitions.Change,
    code: str,
    message: str,
    **values: Any,
) -> bool:
    """A change made without an attempt (``finish``, ``defer``), by version in the caller's
    transaction: ``change``, the error ``code`` and ``message``, and ``values``; False when the
    race was lost."""
    model = PARTS[claimed.channel].record
    result = session.execute(
        update(model)
        .where(model.id == claimed.id, model.version == claimed.version)
        .values(
            **change.values,
            version=model.version + 1,
            updated_time=db_now(),
            error_code=stored_text(code, 100),
            error_message=stored_text(message, MAX_ERROR_CHARS),
            **values,
        )
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


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
    model = PARTS[claimed.channel].record
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
            values |= {**_HELD.values, "next_retry_at": None}
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
                **(_RETRIED if consume_retry else _DEFERRED).values,
                "next_retry_at": db_now_plus(delay),
            }
            if consume_retry:
                values["retry_count"] = model.retry_count + 1
            else:  # a deferral (a full rate-limit window): counted, no attempt row
                values["deferral_count"] = model.deferral_count + 1
            outcome = "retry"
        case Fail():
            values |= {**_FAILED.values, "next_retry_at": None}
            outcome = "failed"
        case DeadLetter():
            values |= {**_DEAD_LETTERED.values, "next_retry_at": None}
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
    model = PARTS[claimed.channel].record
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
]
